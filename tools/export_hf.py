r"""Export a training run's checkpoint to a Hugging Face directory (merged LoRA, config, tokenizer).

    python tools/export_hf.py --workdir=/tmp/cua_smoke --out=/tmp/cua_smoke_hf [--step=N]

transformers' `AutoModelForImageTextToText.from_pretrained(OUT)` (or the Qwen2.5-VL / Qwen3-VL
class) loads the result with no missing or unexpected keys, and its logits equal cua_jax's.

The tool never writes into a run: `--out` that is the workdir, lies inside its checkpoints, or is
a directory holding a run's files (a cua_jax `config.json`, `metrics.jsonl`, `checkpoints/`) is
refused before anything is loaded. A bad `--workdir`, `--step` or `--out`, or a damaged
checkpoint, is one line on stderr and exit status 2 (the traceback with `--verbosity=1`).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from absl import app, flags, logging  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", None, "The training run's directory.", required=True)
_OUT = flags.DEFINE_string("out", None, "Where to write the Hugging Face directory.", required=True)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")

# Files whose presence makes a directory a run's (train.py writes them into its workdir).
RUN_FILES = ("metrics.jsonl", "checkpoints")


class UsageError(Exception):
    """A problem with the arguments or the files they name: one line, exit status 2."""


def is_run_config(path: str) -> bool:
    """Whether `path` is a cua_jax run's `config.json` (not a Hugging Face model config)."""
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return False
    return (
        isinstance(saved, dict)
        and isinstance(saved.get("model"), dict)
        and any(k in saved for k in ("ckpt", "rl", "sft", "total_steps"))
    )


def holds_a_run(path: str) -> str | None:
    """The run file that `path` (a directory) holds, or None."""
    if os.path.isfile(os.path.join(path, "config.json")) and is_run_config(
        os.path.join(path, "config.json")
    ):
        return "config.json"
    return next((f for f in RUN_FILES if os.path.exists(os.path.join(path, f))), None)


def checkpoint_steps(workdir: str) -> list[int]:
    """The steps of `workdir/checkpoints` (finished step directories: `N/` with its items)."""
    d = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(d):
        return []
    return sorted(
        int(n) for n in os.listdir(d) if n.isdigit() and os.path.isdir(os.path.join(d, n))
    )


def check_args(workdir: str, out: str, step: int | None) -> None:
    """Raises `UsageError` for a workdir that is not a run, a step it does not have, or an
    `--out` that is a run's directory or not writable. Loads nothing; writes only a probe file
    into `out` (creating it)."""
    if not os.path.isdir(workdir):
        raise UsageError(f"--workdir={workdir} is not a directory")
    if not is_run_config(os.path.join(workdir, "config.json")):
        raise UsageError(
            f"--workdir={workdir} is not a cua_jax training run (no run config.json in it)"
        )
    steps = checkpoint_steps(workdir)
    if not steps:
        raise UsageError(f"--workdir={workdir} has no checkpoints (nothing in checkpoints/)")
    if step is not None and step not in steps:
        raise UsageError(f"--step={step}: {workdir}/checkpoints has steps {steps}")
    real_out, real_wd = os.path.realpath(out), os.path.realpath(workdir)
    if real_out == real_wd:
        raise UsageError(
            f"--out={out} is the run's workdir: exporting there would overwrite the run's "
            "config.json; pick another directory"
        )
    ckpts = os.path.join(real_wd, "checkpoints")
    if os.path.commonpath([real_out, ckpts]) == ckpts:
        raise UsageError(f"--out={out} is inside the run's checkpoints; pick another directory")
    inside = os.path.commonpath([real_out, real_wd]) == real_wd
    if inside and os.path.isdir(real_out) and os.listdir(real_out):
        # the run's own folders (sft_demos, tb, screens, eval): a new folder in it is fine
        raise UsageError(
            f"--out={out} is a folder of the run that holds files; exporting there would mix "
            "model files into them: pick a new directory"
        )
    if os.path.isdir(real_out):
        found = holds_a_run(real_out)
        if found:
            raise UsageError(
                f"--out={out} holds a training run's files ({found}); exporting there would "
                "overwrite them: pick another directory"
            )
    elif os.path.exists(real_out):
        raise UsageError(f"--out={out} exists and is not a directory")
    try:
        os.makedirs(real_out, exist_ok=True)
        with tempfile.TemporaryFile(dir=real_out):
            pass
    except OSError as e:
        raise UsageError(f"--out={out} is not writable: {e.strerror or e}") from e


def main(argv: list[str]) -> None:
    """The command line: runs what the module docstring describes."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    verbose = flags.FLAGS.verbosity >= 1
    workdir, out = _WORKDIR.value, _OUT.value
    try:
        check_args(workdir, out, _STEP.value)
        from configs.common import load_run_config
        from cua_jax.checkpoint.orbax_io import CheckpointError
        from cua_jax.job.export import export_checkpoint

        if not flags.FLAGS["verbosity"].present:  # orbax logs each step of a restore
            logging.set_verbosity(logging.ERROR)

        try:
            config = load_run_config(workdir)
        except (OSError, ValueError) as e:
            raise UsageError(f"cannot read {workdir}/config.json: {e}") from e
        try:
            step = export_checkpoint(workdir, out, step=_STEP.value, config=config)
        except CheckpointError as e:
            raise UsageError(str(e)) from e
        except OSError as e:  # a full disk, a directory that went away
            raise UsageError(f"writing {out} failed: {e}") from e
    except UsageError as e:
        if verbose:
            traceback.print_exc()
        print(f"export_hf: {e}", file=sys.stderr, flush=True)
        # After JAX/orbax started threads, a normal exit can add shutdown noise to stderr.
        sys.stdout.flush()
        os._exit(2)
    print(f"exported step {step} of {workdir} to {out}")


if __name__ == "__main__":
    app.run(main)
