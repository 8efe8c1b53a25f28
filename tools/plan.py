r"""Will this run fit that TPU slice? Compile it for the slice here, on a CPU machine, and see.

    python tools/plan.py --config=configs/qwen3vl_grpo.py:8b [--topology=v5e-16] [--config.x=y ...]
    python tools/plan.py --list_topologies

Builds the preset's model abstractly from the published config.json dimensions (no weights),
lays it out on the abstract devices of `--topology` (libtpu's topology description; default the
slice the preset is sized for, `config.topology`) with the
preset's mesh and sharding rules, and AOT-compiles with the real TPU compiler the learner's RL
train step and the sampler's decode step (Pallas TPU paged attention). Prints per program the
per-device HBM (params, optimizer state, KL reference, KV pool, temp) against the chip's HBM,
FLOPs and bytes per step, roofline time, MFU / MBU (see cua_jax/plan/).

Exit status: 0 everything fits with `--headroom` of HBM to spare; 1 something does not (one
line naming the program, the biggest consumer and what to change; a program the TPU compiler
refuses counts at the temporaries its message names; or a KV pool sized from memory that a run
would refuse at start); 2 bad input (unknown topology, hf_path not a directory, a mesh that
does not divide the slice, a bad flag).
"""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
# The compile runs for the abstract TPU devices; JAX itself stays on the CPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from cua_jax import plan as plan_lib  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file with a preset: configs/qwen3vl_grpo.py:8b"
)
_TOPOLOGY = flags.DEFINE_string(
    "topology",
    None,
    "TPU slice by its usual name: v5p-8, v5e-16, ... (default: the preset's config.topology)",
)
_HEADROOM = flags.DEFINE_float("headroom", 0.1, "Share of each chip's HBM that must stay free.")
_ROWS = flags.DEFINE_integer("rows", None, "Train-step rows (default: config.rl.rows_per_step).")
_ROW_LEN = flags.DEFINE_integer("row_len", None, "Row length (default: longest rl.row_lengths).")
_PROGRAMS = flags.DEFINE_list(
    "programs",
    [],
    "Programs to compile (default: what the run compiles; cua_jax.plan.default_programs): "
    "train_step (8 text-only rows; with rl.algorithm=sdpo also sdpo_step and sdpo_teacher), "
    "train_step_screens (the trainer's RL shapes with their screens: with rl.tokens_per_chip "
    "each chunk's gradient program and the update), sft_step (the SFT learner's: with "
    "rl.tokens_per_chip each SFT shape's chunk program and its update; Entropulse's too), "
    "sdpo_step, sdpo_teacher, decode_step, prefill_turn.",
)
_JSON = flags.DEFINE_string(
    "json", None, "Also write the plan as JSON here (preset, topology, programs, fits, bytes)."
)
_LIST = flags.DEFINE_bool("list_topologies", False, "Print the table of known slices and exit.")


def _fail(msg: str, code: int) -> None:
    print(f"tools/plan.py: {msg}", file=sys.stderr)
    sys.exit(code)


def _parse(argv: list[str]) -> None:
    if any(a in ("-h", "--help", "--helpshort", "--helpfull") for a in argv[1:]):
        print(__doc__.strip(), "\n", flags.FLAGS.main_module_help(), sep="\n")
        sys.exit(0)
    for arg in argv[1:]:
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1].split(":", 1)[0]
            if not os.path.isfile(path):
                _fail(f"error: --config: no config file {path!r}", 2)
    try:
        flags.FLAGS(argv)
        if not _LIST.value:
            if _CONFIG.value is None:
                _fail("error: --config is required", 2)
            _ = _CONFIG.value.keys()  # applies the file and its overrides now
            if _TOPOLOGY.value is None and not _CONFIG.value.get("topology"):
                _fail(
                    f"error: preset {_CONFIG.value.get('preset')!r} names no TPU slice: "
                    "pass --topology (e.g. --topology=v5e-8)",
                    2,
                )
    except flags.Error as e:
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        _fail(f"error: {lines[0]} {lines[-1] if len(lines) > 1 else ''}".strip(), 2)
    except AttributeError as e:
        _fail(f"error: unknown config key in an override: {str(e).strip(chr(39))}", 2)
    except (ValueError, TypeError, KeyError, OSError, ImportError) as e:
        _fail(f"error: bad --config: {e}", 2)


def main() -> None:
    """The command line: runs what the module docstring describes."""
    _parse(sys.argv)

    if _LIST.value:
        print(plan_lib.table_of_topologies())
        return
    try:  # an unknown program name is a PlanInputError, before anything is built
        plan = plan_lib.make_plan(
            _CONFIG.value,
            _TOPOLOGY.value or _CONFIG.value.topology,
            headroom=_HEADROOM.value,
            rows=_ROWS.value,
            row_len=_ROW_LEN.value,
            programs=tuple(_PROGRAMS.value),
        )
    except plan_lib.PlanInputError as e:
        _fail(f"error: {e}", 2)
    print(plan_lib.format_plan(plan), flush=True)
    if _JSON.value:
        import json
        import pathlib

        record = plan_lib.plan_json(plan, str(_CONFIG.value.get("preset", "")))
        pathlib.Path(_JSON.value).write_text(json.dumps(record, indent=2) + "\n")
    if not plan.fits:
        _fail(plan.reason(), 1)


if __name__ == "__main__":
    main()
