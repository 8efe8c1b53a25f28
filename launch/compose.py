"""What every entry point builds from a config besides the trainer: the environments (from
`envs/`) and JAX's persistent compilation cache. Used by `launch/tpu.py` and `tools/eval.py`;
`cua_jax` itself never imports `envs`."""

from __future__ import annotations

import os

from absl import logging

from envs import tasks as task_sources
from envs.browser import BrowserPool
from envs.fleet import BrowserFleet
from envs.vm import make_env_pool
from envs.vm.env import VMEnvPool


def enable_compile_cache(path: str | None) -> None:
    """JAX's persistent compilation cache: a rerun, a resumed run or another run of the same
    shapes loads compiled steps from disk instead of compiling them again (on the smoke preset
    most GRPO-phase time on a CPU is compiles). Off when `path` is empty."""
    if not path:
        return
    import jax

    path = os.path.expanduser(path)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    # Least recently used entries go first beyond 4 GiB (the default has no bound).
    jax.config.update("jax_compilation_cache_max_size", 4 * 2**30)
    logging.info("persistent compilation cache: %s", path)


def build_env_factory(config):
    """Returns `(env_factory, load_tasks)` for `config.env.kind`; see `cua_jax.job.train.main`.

    `env_factory()` gives an env pool: an async context manager with `acquire()` lending one
    env at a time, `config.env.concurrency` envs in all. `envs.vm` (imported above) registers
    the "desktop" / "osworld" task sources; `envs.ray_fleet` is imported only for
    `env.fleet=ray`, Ray being an optional dependency (the `ray` extra).
    """
    ec = config.env
    if ec.kind == "browser":
        return _browser_factory(ec), task_sources.load_tasks
    if ec.kind == "vm":
        return _vm_factory(ec), task_sources.load_tasks
    raise ValueError(f"config.env.kind={ec.kind!r} is not one of 'browser', 'vm'")


def _browser_factory(ec):
    """Browsers: this host's pool, remote browser hosts (`env.browser_endpoints`, with the local
    pool beside them when `env.concurrency` > 0), or a Ray fleet (`env.fleet=ray`)."""

    def local_pool():
        return BrowserPool(
            ec.concurrency,
            viewport=(ec.viewport_width, ec.viewport_height),
            executable_path=ec.executable_path,
            step_timeout_s=ec.step_timeout_s,
            page_memory_mb=ec.get("page_memory_mb") or None,
        )

    endpoints = tuple(ec.get("browser_endpoints", ()) or ())
    fleet = ec.get("fleet", "") or ""
    if fleet not in ("", "ray"):
        raise ValueError(f"config.env.fleet={fleet!r} is not one of '', 'ray'")
    if fleet == "ray":
        # browser hosts as Ray actors, placed, restarted and found by Ray (envs/ray_fleet.py)
        from envs.ray_fleet import fleet_from_config  # noqa: PLC0415 -- Ray is optional

        return lambda: fleet_from_config(ec)  # env.concurrency envs on Ray's hosts
    if not endpoints:
        return local_pool

    def env_factory():
        # `fleet.env_hosts()` is the rollout/env_hosts metric (hosts answering now)
        return BrowserFleet(
            local_pool() if ec.concurrency > 0 else None,
            endpoints,
            token=ec.get("browser_token") or os.environ.get("CUA_BROWSER_TOKEN"),
            viewport=(ec.viewport_width, ec.viewport_height),
            request_timeout_s=3 * ec.step_timeout_s,
            screens=ec.get("host_screens", "frame"),
        )

    return env_factory


def _vm_factory(ec):
    """Desktops: local ones, `env.vm_endpoints`' servers, or Ray actors (`env.fleet=ray`)."""
    if (ec.get("fleet", "") or "") == "ray":
        # desktops in Ray actors placed by the `desktop` resource, restarted by Ray
        from envs.ray_fleet import ray_desktops  # noqa: PLC0415 -- Ray is optional

        return lambda: VMEnvPool(ray_desktops(ec))

    def env_factory():
        return make_env_pool(
            ec.concurrency,
            endpoints=tuple(ec.vm_endpoints),
            token=ec.vm_token,
            screen=(ec.viewport_width, ec.viewport_height),
            revert=ec.get("vm_revert", ""),
            docker_image=ec.get("vm_docker_image") or None,
            memory_mb=ec.get("desktop_memory_mb") or None,
            max_processes=ec.get("desktop_max_processes") or None,
            cpus=ec.get("desktop_cpus") or None,
            command_cpu_s=ec.get("desktop_command_cpu_s") or None,
            qemu_image=ec.get("vm_qemu_image") or None,
            qemu_options={"memory_mb": ec.vm_qemu_memory_mb, "cpus": ec.vm_qemu_cpus},
        )

    return env_factory
