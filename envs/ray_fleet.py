"""The env fleet on Ray: browser (and simulated) hosts as Ray actors, placed by resources,
restarted by Ray when they die, found with no endpoint list, scaled by a target concurrency.

    pip install -e '.[ray]'
    ray start --head                                   # on the trainer's machine (or any)
    ray start --address=HEAD:6379 --resources='{"browser_host": 4}'   # on each env machine
    python -m envs.ray_fleet --address=auto --hosts 8 --capacity 16   # optional: hosts that
                                                                     # outlive any trainer
    python launch/tpu.py ... --config.env.fleet=ray --config.env.ray_address=auto \
        --config.env.concurrency=128

``RayFleet`` is ``envs.fleet.BrowserFleet`` (the same leases over HTTP, health checks, fault
rules and retries) whose hosts are Ray actors (``EnvHost``) named ``<prefix><i>`` in the
fleet's Ray namespace. Each actor runs a host server in its own process (the browser host of
``envs.browser.server`` with its Chromium, or ``envs.sim.SimServer``) on a free port of its
node and publishes ``host:port`` through ``info()``; the fleet lists the namespace's actors
every ``discover_interval_s`` and adds or drops their endpoints, so hosts started by anyone
(this fleet, another trainer, an operator with ``python -m envs.ray_fleet``) are found.

- Placement: an actor asks for ``num_cpus``, ``memory`` and a custom resource
  (``browser_host`` for browsers, ``desktop`` for desktops, as ``ray start --resources``
  grants them), scheduled ``SPREAD`` over the nodes that have them.
- Healing: actors are created with ``max_restarts=-1``: when a process or a node dies, Ray
  starts the actor again where the resources are, it serves on a new endpoint, and discovery
  swaps it in. The dead endpoint's episodes are infrastructure faults (``BrowserFleet``'s
  rules), retried elsewhere by the rollout loop, and counted against the dead incarnation.
- Scaling: ``scale(target_concurrency)`` keeps ``ceil(target / capacity)`` actors this fleet
  started; surplus hosts are drained (no new episodes) and killed once idle.

The data path never goes through Ray: the trainer talks HTTP to each host, as it does to
hand-started ones. Desktops run on Ray too, one to an actor (``RayDesktop``, env.kind='vm'
with env.fleet='ray'): a desktop needs the VM env's client, not the browser lease protocol, so
they form a ``DesktopPool`` (its fault and retirement rules) instead of a fleet.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Sequence
from typing import Any

from envs.browser.server import BrowserServer
from envs.fleet import BrowserFleet
from envs.sim import LatencyProfile, SimServer
from envs.vm.client import VMClient, VMError
from envs.vm.providers import LocalDesktop
from envs.vm.server_http import is_loopback

log = logging.getLogger(__name__)

KINDS = ("browser", "sim")  # hosts of a RayFleet (the browser lease protocol)
HOST_KINDS = (*KINDS, "desktop")  # what an EnvHost runs: those, or one desktop (RayDesktop)
DEFAULT_RESOURCE = {"browser": "browser_host", "sim": "browser_host", "desktop": "desktop"}
NAMESPACE = "cua_env_fleet"
PREFIX = "cua-env-host-"


def _ray() -> Any:
    try:
        import ray  # noqa: PLC0415 -- an optional extra: pip install -e '.[ray]'
    except ImportError:
        raise ImportError(
            "env.fleet='ray' needs Ray: pip install -e '.[ray]' (or pip install 'ray>=2.40')"
        ) from None
    return ray


def node_address() -> str:
    """This node's address as other nodes reach it (loopback on a one-machine cluster)."""
    ray = _ray()
    ip = ray.util.get_node_ip_address()
    return ip or socket.gethostbyname(socket.gethostname())


class EnvHost:
    """One env host inside a Ray actor (made with ``ray.remote`` by ``host_actor_class``).

    Args:
      kind: "browser" (``envs.browser.server.BrowserServer``, one Chromium), "sim"
        (``envs.sim.SimServer``) or "desktop" (one ``envs.vm.providers.LocalDesktop``: Xvfb,
        its window manager and our VM server, bound to this node's address; ``RayDesktop``).
      capacity: envs it serves at once.
      token: the bearer token its clients send (needed when it binds beyond loopback).
      bind: the address to serve on (None: this node's address).
      options: passed to the server (``step_timeout_s``, ``page_memory_mb``; for "sim":
        ``fault_rate``, ``seed``, ``time_scale``; for "desktop": ``LocalDesktop``'s keyword
        arguments, ``width`` and ``height`` among them).
    """

    def __init__(
        self,
        kind: str,
        capacity: int,
        token: str | None = None,
        bind: str | None = None,
        options: dict[str, Any] | None = None,
    ):
        if kind not in HOST_KINDS:
            raise ValueError(f"EnvHost kind={kind!r}: use one of {HOST_KINDS}")
        if kind == "desktop" and not token:
            raise ValueError("a desktop host needs a token (its VM server refuses none)")
        self.kind, self.capacity, self.token = kind, capacity, token
        self.desktop: Any = None
        self.bind = bind
        self.options = dict(options or {})
        self.endpoint: str | None = None
        self.runner: Any = None
        self.started = time.time()
        ray = _ray()
        ctx = ray.get_runtime_context()
        self.node_id = ctx.get_node_id()
        # A new incarnation after each restart: the same actor id, a new process.
        self.incarnation = f"{ctx.get_actor_id()[:8]}/{os.getpid()}"

    async def info(self) -> dict[str, Any]:
        """Starts the server on first call; ``{"endpoint", "kind", "capacity", "node_id",
        "incarnation", "pid"}``."""
        if self.runner is None:
            await self._start()
        return {
            "endpoint": self.endpoint,
            "kind": self.kind,
            "capacity": self.capacity,
            "node_id": self.node_id,
            "incarnation": self.incarnation,
            "pid": os.getpid(),
        }

    async def _start(self) -> None:
        from aiohttp import web  # noqa: PLC0415

        bind = self.bind or node_address()

        if not is_loopback(bind) and not self.token:
            raise ValueError(
                f"an env host on {bind} (beyond loopback) needs a token: set env.browser_token "
                "or $CUA_BROWSER_TOKEN"
            )
        if self.kind == "desktop":
            self.desktop = LocalDesktop(token=self.token, host=bind, **self.options)
            await self.desktop.start()
            self.runner, self.endpoint = self.desktop, self.desktop.url
            return
        if self.kind == "sim":
            opts = dict(self.options)
            profile = LatencyProfile.load().scaled(float(opts.pop("time_scale", 1.0)))
            server = SimServer(
                self.capacity, profile=profile, token=self.token, name=self.incarnation, **opts
            )
            app = server.app()
        else:
            server = BrowserServer(
                self.capacity, token=self.token, allowed_hosts=None, **self.options
            )
            app = server.app()
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, bind, 0)
        await site.start()
        self.runner = runner
        self.endpoint = f"{bind}:{site._server.sockets[0].getsockname()[1]}"

    async def reset_desktop(self) -> dict[str, Any]:
        """A "desktop" host: recreates its desktop unless it is fresh (``LocalDesktop.reset``;
        the server may come back on another port); then ``info()``."""
        if self.runner is None:
            await self._start()
        else:
            await self.desktop.reset()
            self.endpoint = self.desktop.url
        return await self.info()

    async def stop(self) -> None:
        if self.desktop is not None:
            await self.desktop.stop()
            self.desktop = self.runner = None
        elif self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


def host_actor_options(
    kind: str,
    *,
    num_cpus: float = 1.0,
    memory_mb: int = 0,
    resource: str | None = None,
    resource_amount: float = 1.0,
) -> dict[str, Any]:
    """Ray actor options of one host: CPUs, memory, its custom resource, restarts forever,
    spread over nodes."""
    opts: dict[str, Any] = {
        "num_cpus": num_cpus,
        "max_restarts": -1,
        "max_task_retries": 0,
        "scheduling_strategy": "SPREAD",
        "max_concurrency": 1000,  # info() while the server's handlers run (async actor)
    }
    if memory_mb > 0:
        opts["memory"] = memory_mb * 1024**2
    res = DEFAULT_RESOURCE[kind] if resource is None else resource
    if res:
        opts["resources"] = {res: resource_amount}
    return opts


def start_hosts(
    n: int,
    kind: str,
    capacity: int,
    *,
    token: str | None = None,
    first: int = 0,
    prefix: str = PREFIX,
    namespace: str = NAMESPACE,
    detached: bool = False,
    actor_options: dict[str, Any] | None = None,
    host_options: dict[str, Any] | None = None,
) -> list[Any]:
    """Creates (or gets, if they exist) actors ``prefix{first}`` .. ``prefix{first+n-1}``."""
    ray = _ray()
    cls = ray.remote(EnvHost)
    opts = dict(actor_options or host_actor_options(kind))
    handles = []
    for i in range(first, first + n):
        name = f"{prefix}{i}"
        handles.append(
            cls.options(
                name=name,
                namespace=namespace,
                get_if_exists=True,
                lifetime="detached" if detached else None,
                **opts,
            ).remote(kind, capacity, token, None, host_options)
        )
    return handles


class RayDesktop:
    """A desktop (``envs.vm.providers.Desktop``) that runs in a Ray actor: an ``EnvHost`` of
    kind "desktop" placed by the ``desktop`` resource (``ray start --resources='{"desktop":
    8}'`` on each desktop machine), restarted by Ray when its process or node dies. Episodes
    reach its VM server over HTTP (``client``), as they reach any remote desktop; a
    ``DesktopPool`` of them is the trainer's env pool (``env.kind='vm'``, ``env.fleet='ray'``).

    ``reset()`` has the actor recreate the desktop (``LocalDesktop.reset``) and follows its
    server to a new port. ``recover()`` after a fault waits, up to ``restart_timeout_s``, for
    Ray to bring a dead actor back (on another node if its node died) and connects to the
    desktop it starts there; a desktop that does not come back is retired by the pool.
    """

    def __init__(
        self,
        index: int,
        *,
        token: str | None = None,
        screen: tuple[int, int] = (1280, 720),
        namespace: str = NAMESPACE,
        prefix: str = PREFIX,
        actor_options: dict[str, Any] | None = None,
        desktop_options: dict[str, Any] | None = None,
        ready_timeout_s: float = 120.0,
        restart_timeout_s: float = 180.0,
    ):
        self.name = f"{prefix}desktop-{index}"
        self.namespace = namespace
        # every incarnation of the actor is made with the same arguments, so the same token
        self.token = token or secrets.token_urlsafe(24)
        self.actor_options = dict(actor_options or host_actor_options("desktop"))
        self.desktop_options = {"width": screen[0], "height": screen[1], **(desktop_options or {})}
        self.client_password = self.desktop_options.get("client_password", "password")  # sudo
        self.ready_timeout_s, self.restart_timeout_s = ready_timeout_s, restart_timeout_s
        self.client = VMClient("http://127.0.0.1:1")  # replaced by start()
        self.url: str | None = None
        self.actor: Any = None
        self.info: dict[str, Any] = {}
        self.restarts = 0  # desktops recreated (reset after an episode, recovery)

    def __repr__(self) -> str:
        return f"RayDesktop({self.name!r}, {self.url!r})"

    async def start(self) -> None:
        ray = _ray()
        self.actor = (
            ray.remote(EnvHost)
            .options(
                name=self.name, namespace=self.namespace, get_if_exists=True, **self.actor_options
            )
            .remote("desktop", 1, self.token, None, self.desktop_options)
        )
        await self._connect(await self._call("info", self.ready_timeout_s))

    async def _call(self, method: str, timeout_s: float) -> dict[str, Any]:
        ray = _ray()
        try:
            return await asyncio.wait_for(getattr(self.actor, method).remote(), timeout_s)
        except (ray.exceptions.RayError, TimeoutError) as e:
            raise VMError(f"Ray desktop {self.name}: {method}() failed: {e!r}"[:500]) from e

    async def _connect(self, info: dict[str, Any]) -> None:
        url = info["endpoint"]  # a desktop host's is its server's URL (LocalDesktop.url)
        if url != self.url:
            old, self.url = self.client, url
            self.client = VMClient(url, token=self.token, timeout=60.0, retries=2, backoff=0.2)
            await old.close()
        self.info = info
        await self.client.wait_ready(self.ready_timeout_s)

    async def reset(self) -> None:
        info = await self._call("reset_desktop", self.ready_timeout_s)
        if info["incarnation"] != self.info.get("incarnation") or info["endpoint"] != (
            self.info.get("endpoint")
        ):
            self.restarts += 1
        await self._connect(info)

    async def recover(self) -> None:
        """After a fault: the actor's desktop recreated, or the actor itself once Ray has
        restarted it (a dead process or node); ``VMError`` when neither within the time-out."""
        t0 = time.monotonic()
        while True:
            try:
                await self.reset()
                return
            except VMError:
                if time.monotonic() - t0 > self.restart_timeout_s:
                    raise
                await asyncio.sleep(1.0)  # Ray is restarting the actor

    async def stop(self) -> None:
        await self.client.close()
        if self.actor is not None:
            with contextlib.suppress(Exception):  # a dead actor or a Ray already shut down
                await asyncio.wait_for(self.actor.stop.remote(), 30)
            with contextlib.suppress(Exception):
                _ray().kill(self.actor)
            self.actor = None


def ray_desktops(ec: Any) -> list[RayDesktop]:
    """``env.concurrency`` Ray desktops for a config's ``env`` section (``env.kind='vm'``,
    ``env.fleet='ray'``): Ray at ``env.ray_address``, one desktop (1 CPU, one ``desktop``
    resource) a slot, ``env.vm_token`` (or $CUA_VM_TOKEN; else one made up), the viewport as
    the screen, the local desktops' limits (``env.desktop_memory_mb``, ...)."""
    ray = _ray()
    if not ray.is_initialized():
        ray.init(address=ec.get("ray_address") or None, namespace=NAMESPACE, log_to_driver=False)
    opts = {
        k: v
        for k, v in {
            "memory_mb": ec.get("desktop_memory_mb") or None,
            "max_processes": ec.get("desktop_max_processes") or None,
            "cpus": ec.get("desktop_cpus") or None,
        }.items()
        if v is not None
    }
    token = ec.get("vm_token") or os.environ.get("CUA_VM_TOKEN") or None
    return [
        RayDesktop(
            i,
            token=token,
            screen=(int(ec.viewport_width), int(ec.viewport_height)),
            desktop_options=opts,
        )
        for i in range(int(ec.concurrency))
    ]


class RayFleet(BrowserFleet):
    """A ``BrowserFleet`` whose hosts are Ray actors (module docstring).

    Args:
      address: the Ray cluster (``ray.init(address=...)``; "auto", "ray://host:10001", or None
        for a Ray already initialised in this process / a local one).
      kind: the hosts it starts: "browser" or "sim".
      target_concurrency: envs to provide; ``ceil(target / host_capacity)`` hosts are started
        and kept (0: start none, use the hosts others started).
      host_capacity: envs per host it starts.
      actor_options: Ray options of the hosts it starts (default ``host_actor_options(kind)``).
      host_options: passed to each host's server (``EnvHost``).
      namespace, prefix: where hosts are found (every actor named ``prefix*`` in the namespace).
      discover_interval_s: how often the namespace is listed.
      local, token, viewport, health_interval_s, request_timeout_s, acquire_timeout_s: as
        ``BrowserFleet``.
    """

    _finds_hosts = True

    def __init__(
        self,
        address: str | None = None,
        *,
        kind: str = "browser",
        target_concurrency: int = 0,
        host_capacity: int = 16,
        actor_options: dict[str, Any] | None = None,
        host_options: dict[str, Any] | None = None,
        namespace: str = NAMESPACE,
        prefix: str = PREFIX,
        discover_interval_s: float = 2.0,
        local: Any = None,
        token: str | None = None,
        viewport: tuple[int, int] = (1280, 720),
        health_interval_s: float = 5.0,
        request_timeout_s: float = 60.0,
        acquire_timeout_s: float = 300.0,
        screens: str = "frame",
    ):
        if kind not in KINDS:
            raise ValueError(f"RayFleet kind={kind!r}: use one of {KINDS} (desktops: not yet)")
        if target_concurrency < 0 or host_capacity < 1:
            raise ValueError(
                f"RayFleet needs target_concurrency >= 0 and host_capacity >= 1, got "
                f"{target_concurrency} and {host_capacity}"
            )
        super().__init__(
            local,
            (),
            token=token,
            viewport=viewport,
            health_interval_s=health_interval_s,
            request_timeout_s=request_timeout_s,
            acquire_timeout_s=acquire_timeout_s,
            screens=screens,
        )
        self.address = address
        self.kind = kind
        self.target_concurrency = target_concurrency
        self.host_capacity = host_capacity
        self.actor_options = actor_options
        self.host_options = host_options
        self.namespace = namespace
        self.prefix = prefix
        self.discover_interval_s = discover_interval_s
        self.actors: dict[str, dict[str, Any]] = {}  # actor name -> its last info()
        self._mine: dict[str, Any] = {}  # actors this fleet started (scaled by it): handles
        self._discover_task: asyncio.Task | None = None

    # ---------------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> RayFleet:
        ray = _ray()
        if not ray.is_initialized():
            await asyncio.to_thread(
                ray.init, address=self.address, namespace=self.namespace, log_to_driver=False
            )
        await super().__aenter__()
        if self.target_concurrency:
            await self.scale(self.target_concurrency)
        await self.discover()
        self._discover_task = asyncio.create_task(self._discover_loop())
        return self

    async def close(self) -> None:
        if self._discover_task is not None:
            self._discover_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._discover_task
            self._discover_task = None
        for name in list(self._mine):
            with contextlib.suppress(Exception):
                self._kill_actor(name)
        self._mine.clear()
        await super().close()

    # ---------------------------------------------------------------------- scaling

    async def scale(self, target_concurrency: int) -> int:
        """Keeps ``ceil(target / host_capacity)`` hosts of this fleet's own; returns that
        number. Surplus hosts are drained and killed once their episodes are done."""
        if target_concurrency < 0:
            raise ValueError(f"target_concurrency={target_concurrency} must be >= 0")
        self.target_concurrency = target_concurrency
        want = math.ceil(target_concurrency / self.host_capacity)
        names = [f"{self.prefix}{i}" for i in range(want)]
        new = [n for n in names if n not in self._mine]
        if new:
            first = int(new[0].removeprefix(self.prefix))
            handles = await asyncio.to_thread(
                start_hosts,
                len(new),
                self.kind,
                self.host_capacity,
                token=self.token,
                first=first,
                prefix=self.prefix,
                namespace=self.namespace,
                actor_options=self.actor_options or host_actor_options(self.kind),
                host_options=self.host_options,
            )
            # Held: Ray ends an actor whose last handle is dropped, named or not.
            self._mine.update(dict(zip(new, handles, strict=True)))
        for name in sorted(set(self._mine) - set(names)):
            ep = (self.actors.get(name) or {}).get("endpoint")
            if ep in self.hosts:
                self.hosts[ep].draining = True
        return want

    async def _reap_drained(self) -> None:
        keep = math.ceil(self.target_concurrency / self.host_capacity)
        for name in sorted(self._mine):
            if int(name.removeprefix(self.prefix)) < keep:
                continue
            ep = (self.actors.get(name) or {}).get("endpoint")
            h = self.hosts.get(ep) if ep else None
            if h is not None and h.in_use:
                h.draining = True
                continue
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self._kill_actor, name)
            self._mine.pop(name, None)
            if ep:
                await self.remove_host(ep)
            self.actors.pop(name, None)

    def _kill_actor(self, name: str) -> None:
        ray = _ray()
        ray.kill(ray.get_actor(name, namespace=self.namespace), no_restart=True)

    # ---------------------------------------------------------------------- discovery

    async def discover(self) -> None:
        """Lists the namespace's host actors, asks each for its endpoint (starting its server),
        and swaps endpoints in and out of the fleet."""
        ray = _ray()
        listed = await asyncio.to_thread(ray.util.list_named_actors, all_namespaces=True)
        names = sorted(
            a["name"]
            for a in listed
            if a.get("namespace") == self.namespace and a["name"].startswith(self.prefix)
        )

        async def ask(name: str) -> tuple[str, dict[str, Any] | None]:
            try:
                handle = await asyncio.to_thread(ray.get_actor, name, self.namespace)
                return name, await asyncio.wait_for(handle.info.remote(), 20.0)
            except Exception as e:  # noqa: BLE001 -- restarting, or gone: asked again next time
                log.info("env host %s not ready: %s: %s", name, type(e).__name__, e)
                return name, None

        def known_up(name: str) -> bool:  # asked before, and its host answers health checks
            h = self.hosts.get((self.actors.get(name) or {}).get("endpoint"))
            return h is not None and h.up

        # Only new actors and those whose host is down are asked (an actor call each): at
        # hundreds of hosts, asking all every few seconds would be hundreds of calls a second.
        answers = [(n, self.actors[n]) for n in names if known_up(n)]
        answers += await asyncio.gather(*(ask(n) for n in names if not known_up(n)))
        live = set()
        for name, info in answers:
            if info is None:
                old = (self.actors.get(name) or {}).get("endpoint")
                if old in self.hosts and self.hosts[old].up:
                    self.mark_down(old, f"Ray actor {name} does not answer (restarting?)")
                continue
            old = (self.actors.get(name) or {}).get("endpoint")
            self.actors[name] = info
            ep = info["endpoint"]
            live.add(ep)
            if old and old != ep:
                log.warning("env host %s restarted by Ray: %s -> %s", name, old, ep)
                await self.remove_host(old)
            if ep not in self.hosts:
                await self.add_host(ep)
        for ep in [e for e in self.hosts if e != "local" and e not in live]:
            h = self.hosts[ep]
            if h.in_use == 0 or not h.up:
                await self.remove_host(ep)
        await self._reap_drained()

    async def _discover_loop(self) -> None:
        while True:
            await asyncio.sleep(self.discover_interval_s)
            try:
                await self.discover()
            except Exception as e:  # noqa: BLE001 -- the GCS can blink; try again next time
                log.warning("Ray fleet discovery failed: %s: %s", type(e).__name__, e)

    def report(self) -> dict[str, Any]:
        """``BrowserFleet.report`` plus each host's actor name, node and incarnation."""
        out = super().report()
        for name, info in self.actors.items():
            ep = info.get("endpoint")
            if ep in out:
                out[ep].update(actor=name, node_id=info["node_id"], incarnation=info["incarnation"])
        return out


def fleet_from_config(ec: Any, local: Any = None) -> RayFleet:
    """The ``RayFleet`` of a config's ``env`` section (``env.fleet='ray'``, ``kind='browser'``):
    Ray at ``env.ray_address``, hosts of 16 envs (1 CPU and one ``browser_host`` each) for
    ``env.concurrency`` envs, ``env.browser_token`` (or $CUA_BROWSER_TOKEN), the viewport and
    the step time-out. `local`: a local pool to use beside the Ray hosts."""
    if ec.get("fleet", "") != "ray" or ec.get("kind", "browser") != "browser":
        raise ValueError(
            f"env.fleet={ec.get('fleet')!r} with env.kind={ec.get('kind')!r}: the Ray fleet is "
            "env.fleet='ray' with env.kind='browser' (desktops on Ray: envs.ray_fleet.ray_desktops)"
        )
    return RayFleet(
        ec.ray_address or None,
        kind="browser",
        target_concurrency=int(ec.concurrency),
        host_capacity=16,
        actor_options=host_actor_options("browser"),
        host_options={"step_timeout_s": float(ec.step_timeout_s)},
        local=local,
        token=ec.get("browser_token") or os.environ.get("CUA_BROWSER_TOKEN"),
        viewport=(int(ec.viewport_width), int(ec.viewport_height)),
        screens=ec.get("host_screens", "frame"),
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Starts detached host actors on a running Ray cluster (they outlive this command; a
    trainer's ``RayFleet`` in the same namespace finds them), or lists / stops them."""
    p = argparse.ArgumentParser(prog="python -m envs.ray_fleet", description=main.__doc__)
    p.add_argument("--address", default="auto", help="the Ray cluster (ray.init address)")
    p.add_argument("--hosts", type=int, default=1, help="host actors to start")
    p.add_argument("--kind", default="browser", choices=KINDS)
    p.add_argument("--capacity", type=int, default=16, help="envs per host")
    p.add_argument("--cpus", type=float, default=1.0, help="CPUs each host reserves")
    p.add_argument("--memory-mb", type=int, default=0, help="memory each host reserves")
    p.add_argument("--resource", default=None, help="custom resource (default browser_host)")
    p.add_argument("--first", type=int, default=1000, help="index of the first actor's name")
    p.add_argument("--namespace", default=NAMESPACE)
    p.add_argument("--list", action="store_true", help="list the hosts and their endpoints")
    p.add_argument("--stop", action="store_true", help="kill every host actor of the namespace")
    args = p.parse_args(argv)
    if args.hosts < 1 or args.capacity < 1:
        p.error("--hosts and --capacity must be >= 1")
    token = os.environ.get("CUA_BROWSER_TOKEN")
    ray = _ray()
    ray.init(address=args.address, namespace=args.namespace, log_to_driver=False)
    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a.get("namespace") == args.namespace and a["name"].startswith(PREFIX)
    ]
    if args.list or args.stop:
        for n in sorted(names):
            h = ray.get_actor(n, namespace=args.namespace)
            if args.stop:
                ray.kill(h, no_restart=True)
                print(f"stopped {n}")
            else:
                print(n, ray.get(h.info.remote(), timeout=120))
        return
    opts = host_actor_options(
        args.kind, num_cpus=args.cpus, memory_mb=args.memory_mb, resource=args.resource
    )
    handles = start_hosts(
        args.hosts,
        args.kind,
        args.capacity,
        token=token,
        first=args.first,
        namespace=args.namespace,
        detached=True,
        actor_options=opts,
    )
    for h in handles:
        print(ray.get(h.info.remote(), timeout=300))


if __name__ == "__main__":
    main()
