"""A browser host: serves browser envs to trainers on other machines over HTTP.

    python -m envs.browser.server --port 9001                  # loopback; prints a made-up token
    python -m envs.browser.server --host 0.0.0.0 --port 9001 --token T --capacity 32

One Chromium, up to ``--capacity`` envs (one browser context each), leased to clients
(``envs.browser.remote.RemoteBrowserEnv``; ``env.browser_endpoints`` in the trainer's config).
The env API is small, so the protocol is the project's own JSON over aiohttp rather than
Playwright's browser server (``launch_server`` is Node-only; Python Playwright cannot serve one)
or Chromium's CDP endpoint (which would give a client the whole browser, and run the network
isolation on the client, with the pages served from its memory):

    GET  /health                 {"capacity", "free", "leases", "episodes",
                                 "browser_connected", "browser_ok", "version"} ("episodes":
                                 leases between a reset and its evaluate; a lease a client
                                 keeps between episodes is not one): 503 (with "message") when the
                                 browser cannot open a page, or one has been opening for
                                 over --health-timeout-s (a wedged browser stays connected)
    POST /envs                   {"viewport": [w, h][, "screens": "png" | "frame"]} ->
                                 {"env": id, "lease_s", "screens"} (503: full); "frame": the
                                 observations' screens as `envs.screenshots.encode_frame`
                                 frames (this host decodes the browser's PNG and compresses
                                 the pixels: cheaper for the trainer to decode)
    POST /envs/{id}/reset        {"task": Task.to_dict(), "seed"} -> observation
    POST /envs/{id}/step         {"action": actions.action_to_dict(a)} -> observation + result
    POST /envs/{id}/evaluate     -> {"score"} (422 {"message"}: EnvError)
    POST /envs/{id}/oracle_next  -> {"action"} (501 for tasks without an oracle)
    POST /envs/{id}/close        gives the env back
    POST /bench/pages            {"pages", "viewport"} -> {"pages"}: opens pages for ...
    POST /bench/screenshots      {"seconds"[, "start_at"]} -> {"shots", "seconds", "late_s"}:
                                 this host's raw page.screenshot() rate on them (the ceiling
                                 of tools/bench_envs.py), looping from time.time() = start_at
                                 when given, so that every host of a fleet loops at once

Every call renews its lease; a lease not renewed for ``--lease-s`` seconds (a client that
died) is reclaimed. Built-in tasks, MiniWoB++ pages and inline HTML are served by this host's
Chromium from this host's memory; every other request is aborted (``envs.browser.pages``), so a
task cannot make the browser reach the network.

Security, as ``envs.vm.server`` (whose request guard this reuses): loopback by default; a
non-loopback ``--host`` needs ``--token``; without ``--token`` (or ``$CUA_BROWSER_TOKEN``) a
token is made up and printed on stderr, ``--no-token`` opts out on loopback; requests from web
pages (foreign ``Origin`` / ``Host`` / ``Sec-Fetch-Site``) are refused (403), a missing token
is 401, JSON routes need ``Content-Type: application/json`` (415), and bodies are capped (413).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import secrets
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from cua_jax import actions as A
from cua_jax.env_api import EnvError
from envs.browser.bench import close_pages, open_pages, screenshot_loop
from envs.browser.env import BrowserEnv, check_viewport
from envs.browser.host import BrowserHost
from envs.browser.remote import (
    OBS_CONTENT_TYPE,
    PROTOCOL_VERSION,
    SCREEN_FORMATS,
    encode_png,
    pack_obs,
    screen_frame,
    task_from_dict,
)
from envs.vm.server_http import (
    JSON,
    NONE,
    RequestGuard,
    Route,
    error,
    is_loopback,
    is_wildcard,
    json_body,
)

log = logging.getLogger(__name__)

MiB = 1024**2
ROUTES = (
    Route("GET", "/health", "health"),
    Route("POST", "/envs", "lease", JSON),
    Route("POST", "/envs/{env}/reset", "reset", JSON, 4 * MiB),  # an inline page's HTML
    Route("POST", "/envs/{env}/step", "step", JSON, 1 * MiB),
    Route("POST", "/envs/{env}/evaluate", "evaluate", NONE),
    Route("POST", "/envs/{env}/oracle_next", "oracle_next", NONE),
    Route("POST", "/envs/{env}/close", "close", NONE),
    Route("POST", "/bench/pages", "bench_pages", JSON),
    Route("POST", "/bench/screenshots", "bench_screenshots", JSON),
)
MAX_BENCH_SECONDS = 60.0
# On SIGTERM: what an in-flight request, then the envs' contexts, then the browser get before
# the browser is killed (a wedged Chromium answers nothing; the host still stops in seconds).
SHUTDOWN_GRACE_S = 0.5
MIN_TOKEN_CHARS = 16  # beyond loopback: a token a network neighbour cannot guess


@dataclasses.dataclass
class _Lease:
    env: BrowserEnv
    deadline: float
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    in_episode: bool = False  # reset, not evaluated yet
    screens: str = "png"  # how observations carry the screen: "png" or "frame"


class BrowserServer:
    """The host side: a ``BrowserHost`` and up to ``capacity`` leased ``BrowserEnv`` s.

    Args:
      capacity: the most envs leased at once.
      token: the bearer token every request must carry (None: no check; loopback only).
      allowed_hosts: ``Host`` names accepted besides loopback ones (None: any).
      lease_s: a lease not renewed for this long is reclaimed.
      executable_path: Chromium (autodetected when None).
      **env_kwargs: passed to each ``BrowserEnv`` (step_timeout_s, screenshot_type, ...).
    """

    def __init__(
        self,
        capacity: int = 16,
        *,
        token: str | None = None,
        allowed_hosts: Sequence[str] | None = (),
        lease_s: float = 120.0,
        executable_path: str | None = None,
        page_memory_mb: int | None = None,
        health_timeout_s: float = 20.0,
        **env_kwargs: Any,
    ):
        if capacity < 1:
            raise ValueError(f"a browser host needs capacity >= 1, got {capacity}")
        self.capacity = capacity
        self._bench_pages: list | None = None  # opened by /bench/pages for /bench/screenshots
        self.lease_s = lease_s
        self.health_timeout_s = health_timeout_s
        self.host = BrowserHost(executable_path, page_memory_mb=page_memory_mb)
        self.env_kwargs = env_kwargs
        self.leases: dict[str, _Lease] = {}
        self.idle: list[BrowserEnv] = []  # envs given back, kept for the next lease (cheap reset)
        self._routes: dict[Any, Route] = {}
        self.guard = RequestGuard(
            token=token, allowed_hosts=allowed_hosts, route_of=self._routes.get
        )
        self._sweeper: asyncio.Task | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.guard.middleware], client_max_size=4 * MiB)
        for spec in ROUTES:
            route = app.router.add_route(spec.method, spec.path, getattr(self, spec.handler))
            self._routes[route] = spec
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, _app: web.Application) -> None:
        await self.host.browser()
        self._sweeper = asyncio.create_task(self._sweep())

    async def _cleanup(self, _app: web.Application) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        leases, self.leases = list(self.leases.values()), {}
        envs, self.idle = [le.env for le in leases] + self.idle, []
        closing = asyncio.gather(*(e.close() for e in envs), return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(closing, SHUTDOWN_GRACE_S)
        await self.host.close(SHUTDOWN_GRACE_S)

    async def _sweep(self) -> None:
        """Reclaims leases whose client stopped renewing them."""
        while True:
            await asyncio.sleep(max(self.lease_s / 4, 0.05))
            now = time.monotonic()
            for key, le in list(self.leases.items()):
                if le.deadline < now and not le.lock.locked():
                    log.warning("lease %s expired (client gone?): env reclaimed", key)
                    self.leases.pop(key, None)
                    await le.env.close()

    # ---------------------------------------------------------------------------- handlers

    async def health(self, request: web.Request) -> web.Response:
        """200 when the browser opens pages (``BrowserHost.check``); else 503 naming why (a
        fleet then takes this host out until it answers again). Answers within ~1 s."""
        why = await self.host.check(self.health_timeout_s)
        body = {
            "capacity": self.capacity,
            "free": self.capacity - len(self.leases),
            "leases": len(self.leases),
            "episodes": sum(le.in_episode for le in self.leases.values()),
            "browser_connected": self.host.connected,
            "browser_ok": why is None,
            "version": PROTOCOL_VERSION,
        }
        if why is not None:
            return web.json_response({**body, "status": "error", "message": why}, status=503)
        return web.json_response(body)

    async def lease(self, request: web.Request) -> web.Response:
        data = await json_body(request)
        if len(self.leases) >= self.capacity:
            return error(f"all {self.capacity} envs of this host are leased", 503)
        vp = data.get("viewport", [1280, 720])
        screens = data.get("screens", "png")
        if screens not in SCREEN_FORMATS:
            return error(f"screens must be one of {SCREEN_FORMATS}, got {screens!r:.50}", 400)
        try:
            vp = tuple(vp)
            same = [e for e in self.idle if e.viewport == vp]
            if same:
                env = same[0]
                self.idle.remove(env)
            else:
                env = BrowserEnv(vp, host=self.host, decode_screenshots=False, **self.env_kwargs)
        except (TypeError, ValueError) as e:
            return error(f"bad viewport {vp!r}: {e}", 400)
        key = secrets.token_urlsafe(12)
        self.leases[key] = _Lease(env, time.monotonic() + self.lease_s, screens=screens)
        return web.json_response({"env": key, "lease_s": self.lease_s, "screens": screens})

    def _lease_of(self, request: web.Request) -> _Lease:
        le = self.leases.get(request.match_info["env"])
        if le is None:
            raise web.HTTPNotFound(
                text=json.dumps({"status": "error", "message": "unknown or expired lease"}),
                content_type="application/json",
            )
        le.deadline = time.monotonic() + self.lease_s
        return le

    async def _obs_response(self, le: _Lease, obs: Any, header: dict[str, Any]) -> web.Response:
        env = le.env
        raw = env.last_screenshot_bytes
        if le.screens == "frame":  # the pixels, compressed, off this host's event loop
            pixels = raw if raw is not None and obs is env._last_obs else obs.screenshot
            image = await asyncio.to_thread(screen_frame, pixels)
        elif raw is not None and obs is env._last_obs:
            image = raw
        else:
            image = encode_png(obs.screenshot)
        header = {"instruction": obs.instruction, "text": obs.text, "info": obs.info, **header}
        return web.Response(body=pack_obs(header, image), content_type=OBS_CONTENT_TYPE)

    async def reset(self, request: web.Request) -> web.Response:
        le = self._lease_of(request)
        data = await json_body(request)
        try:
            task = task_from_dict(dict(data["task"]))
        except (KeyError, TypeError, ValueError) as e:
            return error(f"reset needs {{'task': Task.to_dict()}}: {e}", 400)
        seed = data.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            return error(f"reset's seed must be an integer or null, got {seed!r:.100}", 400)
        async with le.lock:
            le.in_episode = False
            try:
                obs = await le.env.reset(task, seed)
            except EnvError as e:
                return error(str(e), 422)
            le.in_episode = True
            return await self._obs_response(le, obs, {})

    async def step(self, request: web.Request) -> web.Response:
        le = self._lease_of(request)
        data = await json_body(request)
        action = A.action_from_dict(data.get("action"))
        async with le.lock:
            res = await le.env.step(action)
            return await self._obs_response(
                le, res.observation, {"done": res.done, "reward": res.reward, "info": res.info}
            )

    async def evaluate(self, request: web.Request) -> web.Response:
        le = self._lease_of(request)
        async with le.lock:
            le.in_episode = False  # the episode ends with its score, or without one
            try:
                return web.json_response({"score": await le.env.evaluate()})
            except EnvError as e:
                return error(str(e), 422)

    async def oracle_next(self, request: web.Request) -> web.Response:
        le = self._lease_of(request)
        async with le.lock:
            try:
                a = await le.env.oracle_next()
            except NotImplementedError as e:
                return error(str(e) or "this task has no oracle", 501)
            except RuntimeError as e:
                return error(str(e), 409)
            return web.json_response({"action": A.action_to_dict(a)})

    async def bench_pages(self, request: web.Request) -> web.Response:
        """Opens ``pages`` fresh pages of this host's Chromium for the next
        ``/bench/screenshots`` (at most ``capacity``, on top of the leased envs; pages opened
        before and not looped yet are closed first)."""

        data = await json_body(request)
        try:
            n = int(data.get("pages", 1))
            vp = check_viewport(data.get("viewport", [640, 480]))  # bounded as /envs is
        except (TypeError, ValueError) as e:
            return error(f"bad bench arguments: {e}", 400)
        if not 1 <= n <= self.capacity:
            return error("pages must be 1..capacity", 400)
        old, self._bench_pages = self._bench_pages, None
        await close_pages(old or [])
        self._bench_pages = await open_pages(self.host, n, vp)
        return web.json_response({"pages": n})

    async def bench_screenshots(self, request: web.Request) -> web.Response:
        """Raw ``page.screenshot()`` looping for ``seconds`` on the pages ``/bench/pages``
        opened: the host's screenshot ceiling, which ``tools/bench_envs.py`` sets beside env
        steps/s. With ``start_at`` (a ``time.time()``) the loop begins then, so that every
        host of a fleet loops at once; the pages are closed after."""

        data = await json_body(request)
        try:
            seconds = float(data.get("seconds", 5.0))
            start_at = data.get("start_at")
            start_at = None if start_at is None else float(start_at)
        except (TypeError, ValueError) as e:
            return error(f"bad bench arguments: {e}", 400)
        if not 0 < seconds <= MAX_BENCH_SECONDS:
            return error(f"seconds must be in (0, {MAX_BENCH_SECONDS:g}]", 400)
        if start_at is not None and not 0 <= start_at - time.time() <= MAX_BENCH_SECONDS:
            return error(f"start_at must be within {MAX_BENCH_SECONDS:g} s from now", 400)
        pages, self._bench_pages = self._bench_pages, None
        if not pages:
            return error("no bench pages: POST /bench/pages first", 409)
        try:
            shots, took, late = await screenshot_loop(pages, seconds, start_at)
        finally:
            await close_pages(pages)
        return web.json_response({"shots": shots, "seconds": took, "late_s": late})

    async def close(self, request: web.Request) -> web.Response:
        le = self.leases.pop(request.match_info["env"], None)
        if le is not None:
            async with le.lock:
                # kept for the next lease: its next reset wipes the context (or replaces it
                # after a fault), as a local pool's env between episodes
                le.env._active = False
                self.idle.append(le.env)
                while len(self.idle) > self.capacity:
                    await self.idle.pop(0).close()
        return web.json_response({"ok": True})


# ------------------------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m envs.browser.server",
        description="Serve browser envs (one Chromium, many contexts) to trainers over HTTP.",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (others need --token)")
    p.add_argument("--port", type=int, default=9001, help="port (0 picks a free one)")
    p.add_argument("--token", default=None, help="bearer token (default $CUA_BROWSER_TOKEN)")
    p.add_argument("--no-token", action="store_true", help="no token check (loopback only)")
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a Host name clients use besides loopback and --host (repeatable)",
    )
    p.add_argument("--capacity", type=int, default=16, help="envs leased at once (default 16)")
    p.add_argument("--lease-s", type=float, default=120.0, help="lease time-out in seconds")
    p.add_argument("--step-timeout-s", type=float, default=20.0, help="BrowserEnv step timeout")
    p.add_argument(
        "--health-timeout-s",
        type=float,
        default=20.0,
        help="/health is 503 once a page has been opening for this long (default 20, as a "
        "reset's time-out)",
    )
    p.add_argument("--executable-path", default=None, help="Chromium (autodetected)")
    p.add_argument(
        "--page-memory-mb",
        type=int,
        default=None,
        help="per-page JavaScript heap cap in MiB (a runaway page crashes alone)",
    )
    args = p.parse_args(argv)
    loopback = is_loopback(args.host)
    if not 0 <= args.port <= 65535:
        p.error(f"--port {args.port} must be in [0, 65535] (0 picks a free one)")
    if args.capacity < 1:
        p.error(f"--capacity {args.capacity} must be >= 1")
    for name in ("lease_s", "step_timeout_s", "health_timeout_s"):
        v = getattr(args, name)
        if not (math.isfinite(v) and v > 0):
            p.error(f"--{name.replace('_', '-')} {v} must be a finite number > 0 (seconds)")
    if not loopback and args.token and len(args.token) < MIN_TOKEN_CHARS:
        p.error(f"--token: a non-loopback address needs at least {MIN_TOKEN_CHARS} characters")
    if args.no_token and args.token is not None:
        p.error("--no-token and --token contradict each other: give one")
    if args.token is None and not args.no_token:
        args.token = os.environ.get("CUA_BROWSER_TOKEN")
    if not loopback and (args.no_token or not args.token):
        p.error(
            f"refusing to bind {args.host} without a token: a non-loopback address needs "
            "--token T (or $CUA_BROWSER_TOKEN); clients then send 'Authorization: Bearer T'"
        )
    args.token_generated = False
    if args.no_token:
        args.token = None
    elif not args.token:
        args.token, args.token_generated = secrets.token_urlsafe(32), True
    return args


async def serve(args: argparse.Namespace) -> None:
    """Runs until SIGTERM/SIGINT; prints ``serving on http://HOST:PORT`` on stdout once bound
    and the token (or where it came from) on stderr."""
    hosts = (
        None
        if is_wildcard(args.host) and not args.allow_host
        else [h for h in [args.host, *args.allow_host] if not is_wildcard(h)]
    )
    server = BrowserServer(
        args.capacity,
        token=args.token,
        allowed_hosts=hosts,
        lease_s=args.lease_s,
        executable_path=args.executable_path,
        page_memory_mb=args.page_memory_mb,
        health_timeout_s=args.health_timeout_s,
        step_timeout_s=args.step_timeout_s,
    )
    # A request still running at SIGTERM (a reset on a wedged browser) is cancelled after the
    # grace, not waited for (aiohttp's default: 60 s).
    runner = web.AppRunner(server.app(), access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    url = f"http://{args.host}:{port}"
    print(f"serving on {url}", flush=True)
    how = (
        "with no token (--no-token)"
        if args.token is None
        else f"with token {args.token}"
        if args.token_generated
        else "with the token from --token / $CUA_BROWSER_TOKEN"
    )
    print(f"envs.browser.server: {url} {how}", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    try:
        await asyncio.wait_for(runner.cleanup(), 10 * SHUTDOWN_GRACE_S)
    except TimeoutError:  # each step is bounded; this is the backstop
        log.warning("shutdown overran %gs: killing the browser", 10 * SHUTDOWN_GRACE_S)
        server.host.kill()


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING)
    args = parse_args(argv)
    os.environ.pop("CUA_BROWSER_TOKEN", None)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()


def start_host_process(
    *, port: int = 0, token: str | None = None, capacity: int = 16, extra: Sequence[str] = ()
) -> tuple[Any, str]:
    """Starts ``python -m envs.browser.server`` on loopback in a child process (tests, benches);
    returns (the ``subprocess.Popen``, its ``host:port``) once it serves."""
    import subprocess  # noqa: PLC0415

    cmd = [sys.executable, "-m", "envs.browser.server", "--port", str(port)]
    cmd += ["--capacity", str(capacity), *(["--token", token] if token else ["--no-token"])]
    proc = subprocess.Popen(
        [*cmd, *extra], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.startswith("serving on http://"):
        proc.kill()
        raise RuntimeError(f"the browser host did not start (exit {proc.wait()}): {line!r}")
    return proc, line.strip().removeprefix("serving on http://")
