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
import signal
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

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

from cua_jax import plan as plan_lib  # noqa: E402
from cua_jax.checkpoint.orbax_io import CheckpointError  # noqa: E402
from cua_jax.config.checks import ConfigError, validate_config  # noqa: E402
from cua_jax.job import train  # noqa: E402
from cua_jax.rl.learner import NonFiniteError  # noqa: E402
from cua_jax.rl.sources import RolloutError  # noqa: E402
from cua_jax.sharding import MeshError  # noqa: E402
from envs.tasks import TaskSourceError, source_dicts  # noqa: E402
from launch import compose  # noqa: E402

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


class LaunchError(SystemExit):
    """A bad command line: printed as one clear line on stderr, exit status 2."""

    def __init__(self, msg: str):
        print(f"launch/tpu.py: error: {msg}", file=sys.stderr)
        super().__init__(2)


class RunFailed(SystemExit):
    """A run stopped by a systematic rollout failure or a non-finite loss: the traceback goes to
    the log, the error to stderr as one line, exit status 1."""

    def __init__(self, error: BaseException):
        logging.error("the run stopped", exc_info=error)
        print(f"launch/tpu.py: run failed: {type(error).__name__}: {error}", file=sys.stderr)
        super().__init__(1)


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


def maybe_initialize_distributed(environ: Mapping[str, str] | None = None) -> bool:
    """Joins a multi-host job when the environment describes one; returns whether it did.

    - explicit (any machine, CPU processes included): JAX_COORDINATOR_ADDRESS=host:port,
      JAX_NUM_PROCESSES=n, JAX_PROCESS_ID=i on every process (i = 0 .. n-1; process 0's host
      serves the coordinator at that port);
    - a TPU pod slice (TPU_WORKER_HOSTNAMES lists the workers): JAX reads the TPU metadata;
    - SLURM (SLURM_NTASKS > 1, one task per host or per GPU): JAX reads SLURM's variables.

    CPU devices talk over gloo (`jax_cpu_collectives_implementation`); set before the backend
    starts, so a job of CPU processes (the tests) runs the same collectives as a TPU/GPU job.
    """
    import jax

    env = os.environ if environ is None else environ
    explicit = env.get("JAX_COORDINATOR_ADDRESS")
    tpu_pod = env.get("TPU_WORKER_HOSTNAMES", "").count(",") > 0
    slurm = int(env.get("SLURM_NTASKS", "1") or 1) > 1
    if not (explicit or tpu_pod or slurm):
        return False
    kwargs: dict[str, Any] = {}
    if explicit:
        missing = [k for k in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID") if not env.get(k)]
        if missing:
            raise LaunchError(
                f"JAX_COORDINATOR_ADDRESS={explicit} is set but {' and '.join(missing)} not: "
                "set JAX_NUM_PROCESSES=<processes> and JAX_PROCESS_ID=<0..n-1> on every process"
            )
        kwargs = dict(
            coordinator_address=explicit,
            num_processes=int(env["JAX_NUM_PROCESSES"]),
            process_id=int(env["JAX_PROCESS_ID"]),
        )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kwargs)
    logging.info("jax.distributed: process %d of %d", jax.process_index(), jax.process_count())
    return True


def accelerator_present() -> bool:
    """Whether this machine has a TPU chip or a GPU, by JAX's own test (PCI ids, device files);
    True when that test is not there to ask (a JAX without it: leave the choice to JAX)."""
    try:
        from jax._src import hardware_utils as hw  # private, but what JAX's TPU start-up asks
    except ImportError:
        return True
    try:
        tpu_chips, _ = hw.num_available_tpu_chips_and_device_id()
        return bool(tpu_chips or hw.has_visible_nvidia_gpu() or hw.num_available_amd_gpus(1))
    except (AttributeError, OSError):
        return True


def cpu_unless_accelerated(
    environ: MutableMapping[str, str] | None = None, accelerated: bool | None = None
) -> bool:
    """Sets JAX_PLATFORMS=cpu on a machine with no TPU and no GPU when the user set no
    JAX_PLATFORMS; returns whether it did.

    Unset, JAX starts the TPU backend first, and libtpu (installed for `tools/plan.py`'s TPU
    compiles) on a machine without a TPU logs a TPU_WORKER_HOSTNAMES error and a source-location
    trace before JAX falls back to the CPU. The devices are the CPU's either way, so a run and
    `--dry_run` are unchanged. A plan for a TPU slice still works: libtpu's topology description
    needs no TPU backend (`tools/plan.py` runs with JAX_PLATFORMS=cpu too).
    """
    env = os.environ if environ is None else environ
    if env.get("JAX_PLATFORMS") or (accelerator_present() if accelerated is None else accelerated):
        return False
    env["JAX_PLATFORMS"] = "cpu"
    if environ is None:  # JAX, imported by accelerator_present, has read the variable already
        import jax

        jax.config.update("jax_platforms", "cpu")
    return True


def _check_workdir(workdir: str) -> None:
    """A local workdir must be a directory this process can write (or creatable)."""
    if "://" in workdir:
        return  # object storage: etils.epath reports its own errors
    path = os.path.abspath(workdir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise LaunchError(f"--workdir={workdir} exists and is not a directory")
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise LaunchError(f"--workdir={workdir}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise LaunchError(f"--workdir={workdir}: {parent} is not writable")


def stop_cleanly_on_sigterm() -> None:
    """SIGTERM (a scheduler's stop, `kill`) takes the path of Ctrl-C: asyncio cancels the run,
    whose `finally` blocks stop the env pool (local desktops' Xvfb, window manager and server,
    browsers), close the trajectory database and wait for a checkpoint save in flight. Without
    it the process dies at once and leaves its desktops running.

    A job started in the background of a non-interactive shell (`nohup ... &`, a pytest-xdist
    worker) inherits SIGINT ignored, and asyncio then leaves it so: Python's own SIGINT handler
    is put back first, so the SIGINT this sends is seen."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGINT))


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise LaunchError(f"unexpected positional arguments: {argv[1:]}")
    config = _CONFIG.value
    workdir = _WORKDIR.value
    if not flags.FLAGS["verbosity"].present:  # orbax logs every save at INFO: keep the bar readable
        logging.set_verbosity(logging.WARNING)
    cpu_unless_accelerated()  # before JAX's first device: no libtpu probe on a CPU machine
    try:  # a bad value (not just a bad key or type) also fails before any work starts
        validate_config(config)
        for key in ("tasks", "eval_tasks"):  # `--config.tasks=junk` leaves a string
            source_dicts(config.get(key, ()), f"config.{key}")
    except (ConfigError, TaskSourceError) as e:
        raise LaunchError(str(e)) from None
    if _DRY_RUN.value:  # the plan for the devices present (the whole job's), then exit
        maybe_initialize_distributed()
        try:
            raise SystemExit(plan_lib.dry_run(config))
        except plan_lib.PlanInputError as e:
            raise LaunchError(str(e)) from None
    _check_workdir(workdir)
    maybe_initialize_distributed()
    compose.enable_compile_cache(config.compile_cache_dir)
    env_factory, load_tasks = compose.build_env_factory(config)  # env.kind checked above
    stop_cleanly_on_sigterm()
    try:
        train.main(config, workdir, env_factory=env_factory, load_tasks=load_tasks)
    except (ConfigError, TaskSourceError, MeshError) as e:  # what the user gave is wrong
        raise LaunchError(str(e)) from None
    except (RolloutError, NonFiniteError, CheckpointError) as e:
        raise RunFailed(e) from e


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
