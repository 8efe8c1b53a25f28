"""A fleet of env hosts: the local browser pool plus remote browser hosts, as one env pool.

    fleet = BrowserFleet(local=BrowserPool(8, viewport=(640, 480)),
                         endpoints=("10.0.0.5:9001", "10.0.0.6:9001"), token=T,
                         viewport=(640, 480))
    async with fleet:
        async with fleet.acquire() as env:      # an env on the host with the most free capacity
            obs = await env.reset(task)
        fleet.env_hosts()                      # hosts answering now (the rollout/env_hosts metric)

What the rollout loop needs from a pool (``acquire()``, ``len()``), spread over hosts by free
capacity: each ``acquire`` takes an env on the host with the most free slots (the local pool
counts as one host). A remote host that stops answering (a refused connection, a time-out, a
5xx, a lost lease) is taken out at once: the episode it was running is an infrastructure fault
(``EnvError`` from reset/evaluate, ``info["error"]`` from step; never a policy failure), no new
episode goes to it, and a health check (``GET /health`` every ``health_interval_s``) puts it
back when it answers again. Hosts may join (``add_host``) and leave (``remove_host``) during a
run. With no host up, ``acquire`` waits up to ``acquire_timeout_s`` for one, then raises
``EnvError``.

Faults are attributed to the host *incarnation* that leased the env: a host that comes back
after being down starts a new ``generation``, and an env leased before that (its lease died with
the old process) counts against the old incarnation (``fault_log``) without taking the new one
out. A lost lease (HTTP 404) alone does not take a host out either: it asks for a health check at
once, which does when the host is really gone. Each leased env counts at most one fault.
An env given back after an episode that ended without a fault keeps its lease and goes to the
next episode on that host (``idle_lease_s``): its ``reset`` starts the new episode, so an
episode costs the trainer and the host five calls instead of seven (no ``POST /envs`` lease and
no ``close``; tools/bench_fleet.py). A lease idle longer than that, one of an earlier
incarnation, and one whose episode faulted or was cut short is closed instead of reused.
``acquire(avoid=host)`` prefers any other host with a free env: the rollout loop retries an
episode that a fault ended elsewhere (``cua_jax.rl.rollout``), and ``host_of(env)`` names the
host an env came from. The Ray backend (``envs.ray_fleet.RayFleet``) is this fleet with hosts
found, placed, restarted and scaled by Ray.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp

from cua_jax.env_api import EnvError
from envs.browser.remote import HostUnavailable, RemoteBrowserEnv, host_health

log = logging.getLogger(__name__)

LOCAL = "local"


@dataclasses.dataclass
class HostState:
    """One host of the fleet: its capacity, what runs on it, and whether it answers."""

    name: str
    capacity: int
    up: bool = True
    in_use: int = 0
    faults: int = 0
    episodes: int = 0
    last_error: str = ""
    down_since: float | None = None
    generation: int = 0  # +1 each time the host comes back after being down (a new process)
    draining: bool = False  # being scaled away: no new episodes
    # Leased envs between episodes, oldest first, kept for the next episode (not in_use).
    idle: collections.deque[_Lease] = dataclasses.field(default_factory=collections.deque)

    @property
    def free(self) -> int:
        return self.capacity - self.in_use if self.up and not self.draining else 0


@dataclasses.dataclass
class _Lease:
    """A remote env this fleet leased: the host incarnation that leased it, and whether one of
    its calls faulted (then it is closed, never handed to another episode)."""

    env: Any  # envs.browser.remote.RemoteBrowserEnv
    host: HostState
    generation: int
    faulted: bool = False
    idle_since: float = 0.0


class BrowserFleet:
    """The local ``BrowserPool`` (optional) and remote browser hosts as one env pool.

    Args:
      local: a ``BrowserPool`` run in this process (None: remote hosts only).
      endpoints: ``host:port`` of browser hosts (``python -m envs.browser.server``).
      token: their bearer token.
      viewport: the screen size of remote envs (the local pool has its own).
      capacity: envs per remote host (None: what its ``/health`` says).
      health_interval_s: how often every host is checked.
      request_timeout_s: the longest one remote env call may take.
      acquire_timeout_s: how long ``acquire`` waits for a free env while no host is up.
      idle_lease_s: the longest an env between episodes keeps its lease for the next one (at
        most half the host's lease time-out; 0: every episode leases and closes its own).
      screens: how remote hosts send screens, "frame" or "png" (`RemoteBrowserEnv`).
    """

    _finds_hosts = False  # a subclass that discovers its hosts may start with none

    def __init__(
        self,
        local: Any = None,
        endpoints: Sequence[str] = (),
        *,
        token: str | None = None,
        viewport: tuple[int, int] = (1280, 720),
        capacity: int | None = None,
        health_interval_s: float = 5.0,
        request_timeout_s: float = 60.0,
        acquire_timeout_s: float = 300.0,
        idle_lease_s: float = 30.0,
        screens: str = "frame",
    ):
        if local is None and not endpoints and not self._finds_hosts:
            raise ValueError("a BrowserFleet needs a local pool or at least one endpoint")
        self.local = local
        self.token = token
        self.viewport = viewport
        self.capacity = capacity
        self.health_interval_s = health_interval_s
        self.request_timeout_s = request_timeout_s
        self.acquire_timeout_s = acquire_timeout_s
        if idle_lease_s < 0:
            raise ValueError(f"idle_lease_s={idle_lease_s} must be >= 0")
        self.idle_lease_s = idle_lease_s
        self.screens = screens  # how remote hosts send screens (`RemoteBrowserEnv`)
        self.hosts: dict[str, HostState] = {}
        if local is not None:
            self.hosts[LOCAL] = HostState(LOCAL, len(local))
        self._endpoints = list(dict.fromkeys(endpoints))
        # Every fault of a leased env: host, its generation then, the reason (kept when a host
        # leaves, so no fault is lost from the counts).
        self.fault_log: list[dict[str, Any]] = []
        self.retries = 0  # acquires that asked to avoid a host (retries of faulted episodes)
        self._checks: set[asyncio.Task] = set()  # health checks a lost lease asked for
        self._leased: dict[int, tuple[str, int]] = {}  # id(env) -> (host, generation)
        self._session: aiohttp.ClientSession | None = None
        self._changed: asyncio.Condition | None = None
        self._health: asyncio.Task | None = None

    # ------------------------------------------------------------------------ lifecycle

    def __len__(self) -> int:
        """Envs the fleet can run at once now (hosts that answer), at least 1."""
        return max(1, sum(h.capacity for h in self.hosts.values() if h.up))

    async def __aenter__(self) -> BrowserFleet:
        self._changed = asyncio.Condition()
        # No cap on connections: each leased env has at most one call in flight, so the
        # fleet's own capacity bounds them. aiohttp's default (100 in all) queued the calls of
        # 1,000 concurrent episodes, and the hosts' health checks behind them past their
        # time-out, which took answering hosts out (tools/bench_fleet.py). Hosts set no
        # cookies: no jar to filter on every call.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), cookie_jar=aiohttp.DummyCookieJar()
        )
        if self.local is not None:
            await self.local.__aenter__()
        for ep in self._endpoints:
            await self.add_host(ep)
        self._health = asyncio.create_task(self._health_loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._health is not None:
            self._health.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health
            self._health = None
        idle = [le.env for h in self.hosts.values() for le in h.idle]
        for h in self.hosts.values():
            h.idle.clear()
        await asyncio.gather(*(env.close() for env in idle), return_exceptions=True)
        if self._checks:  # health checks and lease closes in flight: a moment, then no more
            _, late = await asyncio.wait(set(self._checks), timeout=2.0)
            for task in late:
                task.cancel()
        if self.local is not None:
            await self.local.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def add_host(self, endpoint: str) -> None:
        """A remote host joins (down until its first health check answers)."""
        if endpoint not in self.hosts:
            self.hosts[endpoint] = HostState(endpoint, self.capacity or 0, up=False)
        await self._check(endpoint)

    async def remove_host(self, endpoint: str) -> None:
        """A remote host leaves: no new episodes go to it (running ones finish or fault)."""
        h = self.hosts.pop(endpoint, None)
        if h is not None:
            self._close_idle(h)

    # ------------------------------------------------------------------------ health

    async def _check(self, endpoint: str) -> None:

        h = self.hosts.get(endpoint)
        if h is None or self._session is None:
            return
        try:
            info = await host_health(self._session, endpoint, self.token, timeout_s=5.0)
        except HostUnavailable as e:
            if h.up or not h.last_error:
                self.mark_down(endpoint, str(e))
            return
        if not h.up:
            log.warning("browser host %s answers again: back in the fleet", endpoint)
            if h.down_since is not None or h.last_error:
                h.generation += 1  # it was down: whatever answers now is a new process
        h.capacity = self.capacity or int(info.get("capacity", 0))
        h.up, h.down_since, h.last_error = h.capacity > 0, None, ""
        await self._notify()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            for h in self.hosts.values():  # leases idle too long go back to their hosts
                self._close_idle(h, older_than=self.idle_lease_s)
            names = [n for n in self.hosts if n != LOCAL]
            await asyncio.gather(*(self._check(n) for n in names), return_exceptions=True)

    def mark_down(self, endpoint: str, reason: str) -> None:
        """Takes a host out (its env failed to answer); the health check brings it back."""
        h = self.hosts.get(endpoint)
        if h is None:
            return
        if h.up:
            log.warning("browser host %s taken out of the fleet: %s", endpoint, reason)
        h.up, h.last_error = False, reason
        h.down_since = h.down_since or time.monotonic()
        self._close_idle(h)

    def _close_idle(self, h: HostState, older_than: float = -1.0) -> None:
        """Gives back (in the background, best effort) the host's idle leases that have been
        idle longer than `older_than` seconds (all by default)."""
        now = time.monotonic()
        while h.idle and now - h.idle[0].idle_since > older_than:
            self._background(h.idle.popleft().env.close())

    def _background(self, coro: Any) -> None:
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:  # no loop (a host dropped after the run): nothing to give back to
            coro.close()
            return
        self._checks.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._checks.discard)

    async def _notify(self) -> None:
        if self._changed is not None:
            async with self._changed:
                self._changed.notify_all()

    # ------------------------------------------------------------------------ metrics

    def env_hosts(self) -> int:
        """Hosts answering now (local included): the ``rollout/env_hosts`` metric."""
        return sum(1 for h in self.hosts.values() if h.up)

    def metrics(self) -> dict[str, float]:
        """What the trainer logs each step under ``rollout/``: ``env_hosts`` (answering now),
        ``env_hosts_down``, ``env_capacity`` (episodes the answering hosts can run at once), and
        the run's totals so far: ``env_faults`` (leased envs that faulted, every host and
        generation) and ``env_retries`` (episodes played again away from a faulted host).
        Without the totals a host's episodes, retried and then successful, left no trace in
        metrics.jsonl."""
        up = [h for h in self.hosts.values() if h.up]
        return {
            "env_hosts": float(len(up)),
            "env_hosts_down": float(len(self.hosts) - len(up)),
            "env_capacity": float(sum(h.capacity for h in up)),
            "env_faults": float(len(self.fault_log)),
            "env_retries": float(self.retries),
        }

    def fault_counts(self) -> dict[str, Any]:
        """Faults of leased envs by host and generation (earlier processes included), and the
        retries asked for: ``{"faults": n, "retries": n, "by_host": {host: {gen: n}}}``."""
        by_host: dict[str, dict[int, int]] = {}
        for f in self.fault_log:
            gens = by_host.setdefault(f["host"], {})
            gens[f["generation"]] = gens.get(f["generation"], 0) + 1
        return {"faults": len(self.fault_log), "retries": self.retries, "by_host": by_host}

    def report(self) -> dict[str, Any]:
        """Per host: up, capacity, in use, episodes, faults, last error."""
        return {
            n: {
                "up": h.up,
                "capacity": h.capacity,
                "in_use": h.in_use,
                "episodes": h.episodes,
                "faults": h.faults,
                "generation": h.generation,
                "idle_leases": len(h.idle),
                "last_error": h.last_error,
            }
            for n, h in self.hosts.items()
        }

    # ------------------------------------------------------------------------ acquire

    def _pick(self, avoid: str | None = None) -> HostState | None:
        free = [h for h in self.hosts.values() if h.free > 0]
        others = [h for h in free if h.name != avoid]
        return max(others or free, key=lambda h: h.free, default=None)

    def host_of(self, env: Any) -> str | None:
        """The host an env now leased from this fleet runs on (None: not one of ours)."""
        got = self._leased.get(id(env))
        return got[0] if got is not None else None

    @contextlib.asynccontextmanager
    async def acquire(self, avoid: str | None = None) -> AsyncIterator[Any]:
        """An env on the host with the most free capacity, for one ``async with`` block;
        `avoid`: a host to pass over while another has a free env (a retry after its fault)."""
        if self._changed is None:
            raise RuntimeError("use the fleet inside `async with BrowserFleet(...) as fleet`")
        if avoid is not None:
            self.retries += 1
        deadline = time.monotonic() + self.acquire_timeout_s
        while True:
            async with self._changed:
                h = self._pick(avoid)
                while h is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise EnvError(
                            f"no browser host has a free env after {self.acquire_timeout_s:g}s: "
                            f"{self.report()}"
                        )
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), min(left, 1.0))
                    h = self._pick(avoid)
                h.in_use += 1
            try:
                if h.name == LOCAL:
                    async with self.local.acquire() as env:
                        h.episodes += 1
                        self._leased[id(env)] = (LOCAL, h.generation)
                        try:
                            yield env
                        finally:
                            self._leased.pop(id(env), None)
                    return
                lease = self._reuse(h) or await self._lease(h)
                if lease is None:
                    continue  # the host failed to lease: taken out, try another
                env, ended = lease.env, False
                try:
                    h.episodes += 1
                    self._leased[id(env)] = (h.name, lease.generation)
                    yield env
                    ended = True
                finally:
                    self._leased.pop(id(env), None)
                    await self._give_back(lease, ended)
                return
            finally:
                h.in_use -= 1
                await self._notify()

    def _reuse(self, h: HostState) -> _Lease | None:
        """The host's most recently idle env, if its lease is young enough to reuse (older
        ones are given back)."""
        limit = min(self.idle_lease_s, h.idle[-1].env.lease_s / 2) if h.idle else 0.0
        self._close_idle(h, older_than=limit)
        while h.idle:
            lease = h.idle.pop()
            if lease.generation == h.generation and not lease.faulted and lease.env.leased:
                return lease
            self._background(lease.env.close())
        return None

    async def _give_back(self, lease: _Lease, ended: bool) -> None:
        """After an episode: the env waits, leased, for the host's next episode if the episode
        `ended` (its block returned) without a fault on the incarnation in the fleet now;
        otherwise its lease is closed."""
        h, env = lease.host, lease.env
        keep = (
            ended
            and self.idle_lease_s > 0
            and not lease.faulted
            and env.leased
            and self.hosts.get(h.name) is h
            and h.up
            and not h.draining
            and h.generation == lease.generation
            and self._session is not None
        )
        if keep:
            env.end_episode()
            lease.idle_since = time.monotonic()
            h.idle.append(lease)
        else:
            await env.close()

    def _on_fault(self, h: HostState, generation: int, reason: str) -> None:
        """A leased env's call failed: the fault is the incarnation's that leased it. The host
        is taken out only if that incarnation is the one in the fleet now; a lost lease (404)
        asks for a health check instead (the lease may have died with an earlier process)."""
        current = self.hosts.get(h.name) is h and h.generation == generation
        self.fault_log.append(
            {
                "host": h.name,
                "generation": generation,
                "current": current,
                "reason": reason,
                "t": time.time(),
            }
        )
        if not current:
            log.warning("browser host %s: a fault of its earlier process: %s", h.name, reason)
            return
        h.faults += 1
        if "HTTP 404" in reason:  # the lease is gone; is the host?
            self._background(self._check(h.name))
            return
        self.mark_down(h.name, reason)

    async def _lease(self, h: HostState) -> _Lease | None:

        lease = _Lease(None, h, h.generation)

        def on_fault(endpoint: str, reason: str) -> None:
            if not lease.faulted:  # one fault per leased env, however many of its calls fail
                lease.faulted = True
                self._on_fault(h, lease.generation, reason)

        env = RemoteBrowserEnv(
            h.name,
            self.token,
            self.viewport,
            session=self._session,
            timeout_s=self.request_timeout_s,
            screens=self.screens,
        )
        try:
            await env.lease()  # a failed lease is no episode's fault: the host is taken out
        except HostUnavailable as e:
            if "HTTP 503" in str(e):  # full (another trainer shares it): try again shortly
                await asyncio.sleep(0.2)
            elif self.hosts.get(h.name) is h:
                self.mark_down(h.name, str(e))
            return None
        env.on_fault = on_fault
        lease.env = env
        return lease
