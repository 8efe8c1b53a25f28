"""What a training process does around the trainer: its one-line errors and exit statuses, the
config's values checked, joining a multi-host job, the platform on a machine without
accelerators, the workdir check and a clean stop on SIGTERM. Light to import (no JAX until a
function needs it): `launch/tpu.py` checks its flags and values with these before the trainer
loads.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

from absl import logging

from cua_jax.config.checks import ConfigError, validate_config
from envs.tasks import TaskSourceError, source_dicts


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


def check_config(config: Any) -> None:
    """The config's values (its keys and types are the flag parser's): a bad one, or a task
    source that is not a dict, exits 2 naming it. No JAX: a bad value fails before the trainer
    loads."""
    try:
        validate_config(config)
        for key in ("tasks", "eval_tasks"):  # `--config.tasks=junk` leaves a string
            source_dicts(config.get(key, ()), f"config.{key}")
    except (ConfigError, TaskSourceError) as e:
        raise LaunchError(str(e)) from None


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


def check_workdir(workdir: str) -> None:
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
