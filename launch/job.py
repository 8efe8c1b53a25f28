"""A training job after its flags and values are checked (`launch.process.check_config`): the
devices (multi-host join, the platform), the dry-run plan or the environments and the trainer,
and the errors each turns into (`launch.process.LaunchError`: exit 2; `RunFailed`: exit 1).
`launch/tpu.py` imports this module only once its config has passed, so a typo or a bad value
fails before the trainer loads.
"""

from __future__ import annotations

from typing import Any

from cua_jax.checkpoint.orbax_io import CheckpointError
from cua_jax.config.checks import ConfigError
from cua_jax.job import train
from cua_jax.rl.learner import NonFiniteError
from cua_jax.rl.sources import RolloutError
from cua_jax.sharding import MeshError
from envs.tasks import TaskSourceError
from launch.process import (
    LaunchError,
    RunFailed,
    check_workdir,
    maybe_initialize_distributed,
    stop_cleanly_on_sigterm,
)


def run(config: Any, workdir: str | None, *, dry_run: bool) -> None:
    """Prints the dry-run plan and exits (0 fits, 1 does not) or trains in `workdir`, for a
    `config` whose values `launch.process.check_config` has passed."""
    if dry_run:  # the plan for the devices present (the whole job's), then exit
        from cua_jax import plan as plan_lib  # noqa: PLC0415 -- the planner, for --dry_run only

        maybe_initialize_distributed()
        try:
            raise SystemExit(plan_lib.dry_run(config))
        except plan_lib.PlanInputError as e:
            raise LaunchError(str(e)) from None
    # the environments' modules (Playwright, the fleets) load once the config has passed
    from launch import compose  # noqa: PLC0415

    check_workdir(workdir)
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
