r"""Entry point of every training run (TPU, GPU or CPU: "tpu" names the target, not a limit).

    python launch/tpu.py --config=configs/qwen3vl_grpo.py:smoke --workdir=/tmp/cua_smoke
    python launch/tpu.py --config=configs/qwen3vl_grpo.py:8b \
        --config.model.hf_path=/ckpts/Qwen3-VL-8B-Instruct --config.rl.group_size=16 --workdir=DIR

This file is the composition root: it parses flags (`--config.a.b=value` overrides are
type-checked; an unknown key or a value of the wrong type fails before any work starts, naming
the key), joins a multi-host job when there is one, builds the environments from `envs/`, and
hands everything to `cua_jax.job.train.main`. `cua_jax` itself never imports `envs`. A bad flag or
config value exits with status 2; a run stopped by a systematic rollout failure or a non-finite
loss exits with status 1, naming the error on stderr.
"""

from __future__ import annotations

import os
import sys

# One thread for OpenBLAS (numpy's and scipy's, whose LAPACK is what XLA:CPU calls for a
# triangular solve, e.g. in Qwen3.5's chunked gated delta rule), set before either is loaded: its
# own pool spins beside XLA's threads and the rollout side's, and on a loaded 2-core machine a
# 64x64 batched solve took 240 ms instead of 3 (BENCHMARKS.md, "Qwen3.5's forward and OpenBLAS").
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# `python launch/tpu.py` puts launch/ on sys.path, not the repo root that holds configs/ and envs/.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from launch.process import (  # noqa: E402,F401 (tests and tools import these from here)
    LaunchError,
    RunFailed,
    accelerator_present,
    check_config,
    cpu_unless_accelerated,
    maybe_initialize_distributed,
    stop_cleanly_on_sigterm,
)

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file, optionally with a preset: configs/qwen3vl_grpo.py:smoke"
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, metrics and logs go.")
_DRY_RUN = flags.DEFINE_bool(
    "dry_run",
    False,
    "Compile the run's train step and decode chunk for the devices present, "
    "print the memory / roofline plan (cua_jax/plan/) and exit: 0 fits, 1 does not. No training.",
)
flags.mark_flag_as_required("config")
flags.register_multi_flags_validator(
    ["workdir", "dry_run"],
    lambda f: f["workdir"] is not None or f["dry_run"],
    "flag --workdir must have a value other than None (only --dry_run runs without one)",
)


def parse_flags(argv: list[str]) -> list[str]:
    """absl's parser, with config errors turned into one line that names the key or value."""
    for arg in argv[1:]:
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1].split(":", 1)[0]
            if not os.path.isfile(path):
                raise LaunchError(f"--config: no config file {path!r}")
    try:
        rest = flags.FLAGS(argv)
        _ = _CONFIG.value.keys()  # the file and its overrides are applied lazily: force it here
        return rest
    except flags.Error as e:
        msg = str(e)
        if "Traceback" in msg:  # keep the flag and the final error line, not the stack
            lines = [ln for ln in msg.splitlines() if ln.strip()]
            msg = f"{lines[0]} {lines[-1]}"
        raise LaunchError(msg) from None
    except AttributeError as e:  # a key that is not in the (locked) config
        msg = str(e).strip("'\"").replace("\\n", " ").replace("\\'", "'")
        raise LaunchError(f"unknown config key in an override: {msg}") from None
    except (ValueError, TypeError, KeyError, OSError, ImportError) as e:
        raise LaunchError(f"bad --config: {e}") from None


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise LaunchError(f"unexpected positional arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:  # orbax logs every save at INFO: keep the bar readable
        logging.set_verbosity(logging.WARNING)
    check_config(_CONFIG.value)  # a bad value fails here, in half a second, before JAX loads
    cpu_unless_accelerated()  # before JAX's first device: no libtpu probe on a CPU machine
    # The trainer loads only now, its flags and values checked: a typo fails in 0.1 s, not 3
    from launch import job  # noqa: PLC0415

    job.run(_CONFIG.value, _WORKDIR.value, dry_run=_DRY_RUN.value)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
