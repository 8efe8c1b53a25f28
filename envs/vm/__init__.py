"""OSWorld-compatible VM environments over RPC.

* ``envs.vm.client.VMClient``: async client of the OSWorld VM server protocol.
* ``python -m envs.vm.server``: that protocol on any Linux X display.
* ``envs.vm.env.VMEnv``: the ``cua_jax.env_api.Env`` contract over a VM.
* ``envs.vm.providers``: ``LocalDesktop`` (Xvfb + openbox + server), ``RemoteDesktop`` /
  ``Remote`` (user-given endpoints), ``DesktopPool``.
* ``envs.vm.osworld``: OSWorld task JSON (setup steps, getters, metrics); built-in desktop tasks
  live in ``envs/vm/tasks``.

Nothing here is imported by ``cua_jax``.

``import envs.vm`` registers the task sources "desktop" and "osworld" (and ids ``desktop/<name>``)
with ``envs.tasks.load_tasks``, and ``envs.vm.make_env_pool`` builds the env pool
``launch/tpu.py`` uses. Both import the env modules inside the functions that need them: the
in-VM server (``python -m envs.vm.server``) imports this package, in a guest image that holds the
server's own dependencies (pyautogui, python-xlib) and none of the rest (aiohttp's clients, the
browser stack, JAX), and must start fast.

Tokens: remote endpoints (``env.vm_endpoints``) share one bearer token, ``env.vm_token``, or,
when that is empty, ``$CUA_VM_TOKEN`` (as ``env.browser_token`` falls back to
``$CUA_BROWSER_TOKEN``): pass it by the environment, where ``ps`` and the run's config.json do
not show it. Desktops this process starts (local, Docker, QEMU) make up their own tokens.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

VM_TOKEN_ENV = "CUA_VM_TOKEN"  # remote endpoints' token when env.vm_token is empty


def _builtin_desktop_tasks(cfg: dict[str, Any]) -> list[Any]:
    from envs.vm import sources

    return sources.builtin_desktop_tasks(cfg)


def _osworld_tasks(cfg: dict[str, Any]) -> list[Any]:
    from envs.vm import sources

    return sources.osworld_tasks(cfg)


def _desktop_task_from_id(task_id: str) -> Any:
    from envs.vm import sources

    return sources.desktop_task_from_id(task_id)


def _register_sources() -> None:
    try:
        from envs.tasks import register_id_prefix, register_source
    except ImportError:  # the server copied into a VM without the rest of the project
        return
    register_source(
        "desktop", _builtin_desktop_tasks, keys=("names", "limit", "seed", "api_actions")
    )
    register_source(
        "osworld",
        _osworld_tasks,
        keys=("path", "meta", "domains", "ids", "skip_unsupported", "limit", "seed", "api_actions"),
    )
    register_id_prefix("desktop", _desktop_task_from_id)


_register_sources()


def make_env_pool(
    concurrency: int,
    *,
    endpoints: Sequence[str] = (),
    token: str | None = None,
    screen: tuple[int, int] = (1280, 720),
    revert: str = "",
    docker_image: str | None = None,
    memory_mb: int | None = None,
    qemu_image: str | None = None,
    qemu_options: dict[str, Any] | None = None,
    max_processes: int | None = 4096,
    cpus: float | None = None,
    command_cpu_s: float | None = None,
    **env_kwargs: Any,
) -> Any:
    """An env pool for the trainer (``envs.vm.env.VMEnvPool``).

    With ``endpoints`` (``"http://host:port"`` of OSWorld VMs or our servers, all sharing
    ``token``, by default ``$CUA_VM_TOKEN``): one desktop per endpoint (a VM runs one episode at
    a time; ``concurrency`` caps how many are used). Without: ``concurrency`` local Xvfb
    desktops of size ``screen``.
    ``revert``: how a remote desktop is reset before each episode (``env.vm_revert``; see
    ``envs.vm.providers.revert_hook``: "libvirt:DOM@SNAP", "qemu:SOCK@SNAP", "docker:NAME",
    "cmd:..."), then the task's setup steps run. ``docker_image``: ``concurrency`` desktops in
    containers of that image (``envs/docker/Dockerfile``), restarted before each episode.
    ``qemu_image``: ``concurrency`` QEMU guests booted from that disk image (OSWorld's
    ``Ubuntu.qcow2``; ``envs.vm.qemu.QemuDesktop``, ``qemu_options`` its keyword arguments),
    reverted to their booted snapshot before each episode.
    ``memory_mb``: the address-space cap of each local desktop's processes (None: none).
    ``max_processes``, ``cpus``: each local or Docker desktop's task budget and CPU-core quota
    (``envs.vm.limits``; Docker's --pids-limit / --cpus); ``command_cpu_s``: the CPU seconds of
    each command a local desktop's server runs (None: no cap).
    ``env_kwargs`` go to every ``VMEnv`` (``observe_a11y``, ``pause_s``, ``action_timeout``).
    """
    from envs.vm.env import VMEnvPool
    from envs.vm.providers import LocalDesktop, RemoteDesktop, revert_hook

    if concurrency < 1:
        raise ValueError(f"make_env_pool: concurrency must be >= 1, got {concurrency}")
    named = {"endpoints": endpoints, "docker_image": docker_image, "qemu_image": qemu_image}
    given = [n for n, v in named.items() if v]
    if len(given) > 1:
        raise ValueError(
            f"make_env_pool: give one of endpoints, docker_image, qemu_image, not {given}"
        )
    if endpoints:
        token = token or os.environ.get(VM_TOKEN_ENV) or None
        desktops: list[Any] = [
            RemoteDesktop(e, token, revert=revert_hook(revert, i))
            for i, e in enumerate(endpoints[:concurrency])
        ]
    elif qemu_image:
        from envs.vm.qemu import QemuDesktop

        desktops = [
            QemuDesktop(qemu_image, token, **(qemu_options or {})) for _ in range(concurrency)
        ]
    elif docker_image:
        from envs.docker.provider import DockerDesktop

        desktops = [
            DockerDesktop(
                docker_image, token, screen=screen, max_processes=max_processes, cpus=cpus
            )
            for _ in range(concurrency)
        ]
    else:
        desktops = [
            LocalDesktop(
                *screen,
                token=token,
                memory_mb=memory_mb,
                max_processes=max_processes,
                cpus=cpus,
                command_cpu_s=command_cpu_s,
            )
            for _ in range(concurrency)
        ]
    return VMEnvPool(desktops, **env_kwargs)
