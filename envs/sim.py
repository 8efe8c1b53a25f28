"""A simulated environment host, and a scripted policy: the rollout side at scale without
Chromium, desktops or a model.

    python -m envs.sim --serve --hosts 100 --capacity 10          # 100 hosts in one process
    python -m envs.sim --measure                  # re-measure envs/sim_profile_browser.json
    python -m envs.sim --measure desktop          # ... envs/sim_profile_desktop.json
    python -m envs.sim --serve --profile desktop  # hosts with the desktops' times and screens

A ``SimServer`` speaks the browser host's wire protocol (``envs.browser.server``: ``/health``,
``/envs`` leases, ``reset``/``step``/``evaluate``/``oracle_next``/``close``, observations as
``application/x-cua-obs``), so the trainer side under test is the real one: ``BrowserFleet`` (or
the Ray fleet), ``RemoteBrowserEnv``'s HTTP and PNG decode, and ``AgentLoop``. Each call
sleeps a time drawn from a ``LatencyProfile``: reset, step and evaluate seconds and screenshot
PNG sizes measured from the real browser envs (``measure_browser_profile``; the shipped
profile is ``envs/sim_profile_browser.json``, with the command that measured it). A call costs
the host a few hundred microseconds of CPU, so hundreds of hosts run in one process on loopback.

Episodes end after ``task.spec["sim_steps"]`` steps (default: a draw from the profile's steps
per episode), and score 1 with probability ``task.spec["p_success"]`` (default 0.5), a pure
function of the task id and seed. ``fault_rate`` makes a step fail with HTTP 500 (an
infrastructure fault), for fault tests.

``ScriptedEngine`` stands in for the sampler ``Engine``: each ``generate`` waits ``think_s``
(the model's time, which the bench sets) and answers one fixed click, so ``AgentLoop`` runs
unchanged (prompt rendering, image preprocessing, parsing, recording) with no model.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import os
import random
import secrets
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from aiohttp import web

from cua_jax import actions as A
from cua_jax.env_api import Task
from cua_jax.sampler.scheduler import prompt_inputs
from envs.browser import BrowserPool, suite
from envs.browser.remote import (
    OBS_CONTENT_TYPE,
    PROTOCOL_VERSION,
    SCREEN_FORMATS,
    encode_png,
    pack_obs,
    screen_frame,
)

PROFILE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sim_profile_browser.json")
DESKTOP_PROFILE_PATH = os.path.join(os.path.dirname(PROFILE_PATH), "sim_profile_desktop.json")
PROFILES = {"browser": PROFILE_PATH, "desktop": DESKTOP_PROFILE_PATH}


@dataclasses.dataclass(frozen=True)
class LatencyProfile:
    """Measured samples of a real env's call times and screenshot sizes; draws bootstrap them.

    Attributes:
      viewport: (width, height) of the measured screens.
      reset_s, step_s, evaluate_s: seconds of each call, as the trainer saw them.
      screenshot_bytes: encoded (PNG) sizes of the observations.
      steps_per_episode: steps the measured (oracle) episodes took.
      source: how it was measured (command, machine, date).
    """

    viewport: tuple[int, int]
    reset_s: tuple[float, ...]
    step_s: tuple[float, ...]
    evaluate_s: tuple[float, ...]
    screenshot_bytes: tuple[int, ...]
    steps_per_episode: tuple[int, ...] = (3,)
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("reset_s", "step_s", "evaluate_s", "screenshot_bytes", "steps_per_episode"):
            v = getattr(self, name)
            if not v or any(not np.isfinite(x) or x < 0 for x in v):
                raise ValueError(f"LatencyProfile.{name} needs finite samples >= 0, got {v!r:.80}")

    @classmethod
    def load(cls, path: str = PROFILE_PATH) -> LatencyProfile:
        """The profile in file `path`, or a shipped one by name ("browser", "desktop")."""
        with open(PROFILES.get(path, path)) as f:
            d = json.load(f)
        return cls(
            viewport=tuple(d["viewport"]),
            **{k: tuple(d[k]) for k in ("reset_s", "step_s", "evaluate_s", "screenshot_bytes")},
            steps_per_episode=tuple(d.get("steps_per_episode", (3,))),
            source=d.get("source", ""),
        )

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=1)
            f.write("\n")

    def scaled(self, factor: float) -> LatencyProfile:
        """Every time x `factor` (0: an instant env, for tests)."""
        return dataclasses.replace(
            self,
            reset_s=tuple(x * factor for x in self.reset_s),
            step_s=tuple(x * factor for x in self.step_s),
            evaluate_s=tuple(x * factor for x in self.evaluate_s),
        )

    def mean_episode_s(self, turns: float, think_s: float = 0.0) -> float:
        """The mean wall time of an episode of `turns` steps, each after `think_s` of policy
        time, with nothing queueing: the ideal that a bench compares against."""
        m = statistics.fmean
        return m(self.reset_s) + turns * (m(self.step_s) + think_s) + m(self.evaluate_s)

    def summary(self) -> dict[str, float]:
        q = lambda v, p: float(np.percentile(v, p))  # noqa: E731
        out = {}
        for k in ("reset_s", "step_s", "evaluate_s", "screenshot_bytes"):
            v = getattr(self, k)
            out.update({f"{k}_p50": q(v, 50), f"{k}_p90": q(v, 90), f"{k}_mean": float(np.mean(v))})
        return out


def _screen_bank(viewport: tuple[int, int], sizes: Sequence[int], seed: int = 0) -> list[bytes]:
    """PNGs of `viewport` whose sizes span `sizes` (pages of flat boxes and noisy text rows):
    the trainer decodes payloads of the measured size and pixel count."""
    w, h = viewport
    rng = np.random.default_rng(seed)
    bank = []
    target = sorted(set(int(np.percentile(sizes, p)) for p in (5, 25, 50, 75, 95)))
    for goal in target:
        img = np.full((h, w, 3), 245, np.uint8)
        rows = 0
        data = encode_png(img)
        while len(data) < goal and rows < 4 * h:
            for _ in range(4):  # a box, then a row of "text" (noise compresses like glyphs)
                x0, y0 = int(rng.integers(0, w - 8)), int(rng.integers(0, h - 8))
                img[y0 : y0 + int(rng.integers(8, 80)), x0 : x0 + int(rng.integers(8, 200))] = (
                    rng.integers(0, 255, 3, dtype=np.uint8)
                )
                ty, tx = int(rng.integers(0, h - 10)), int(rng.integers(0, w - 120))
                img[ty : ty + 8, tx : tx + 110] = rng.integers(0, 2, (8, 110, 1), np.uint8) * 200
                rows += 1
            data = encode_png(img)
        bank.append(data)
    return bank


@dataclasses.dataclass
class _SimEnv:
    task: dict[str, Any]
    seed: int
    steps: int = 0
    budget: int = 3
    screens: str = "png"  # the lease's screen format (`envs.browser.remote.SCREEN_FORMATS`)


class SimServer:
    """A fake browser host (the module docstring): same routes and wire format as
    ``envs.browser.server.BrowserServer``, calls timed by a ``LatencyProfile``.

    Args:
      capacity: the most envs leased at once.
      profile: the latency profile (None: the shipped browser profile).
      token: the bearer token requests must carry (None: no check).
      fault_rate: probability that a step answers HTTP 500 (an infrastructure fault).
      seed: the draws' seed.
      name: reported by ``/health`` as ``host_id`` (a Ray actor's incarnation, say).
    """

    def __init__(
        self,
        capacity: int = 16,
        *,
        profile: LatencyProfile | None = None,
        token: str | None = None,
        fault_rate: float = 0.0,
        seed: int = 0,
        name: str = "",
    ):
        if capacity < 1:
            raise ValueError(f"a sim host needs capacity >= 1, got {capacity}")
        if not 0.0 <= fault_rate <= 1.0:
            raise ValueError(f"fault_rate={fault_rate} must be in [0, 1]")
        self.capacity = capacity
        self.profile = profile or LatencyProfile.load()
        self.token = token
        self.fault_rate = fault_rate
        self.name = name or secrets.token_hex(4)
        self.rng = random.Random(seed)
        self.bank = _screen_bank(self.profile.viewport, self.profile.screenshot_bytes, seed)
        # the same screens as frames, for leases that ask for them (what a browser host sends)
        self.frames = [screen_frame(b) for b in self.bank]
        self.leases: dict[str, _SimEnv] = {}
        self.calls = 0
        self.leased = 0  # leases granted so far
        self.resets = 0

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard], client_max_size=4 * 1024**2)
        r = app.router
        r.add_get("/health", self.health)
        r.add_post("/envs", self.lease)
        r.add_post("/envs/{env}/reset", self.reset)
        r.add_post("/envs/{env}/step", self.step)
        r.add_post("/envs/{env}/evaluate", self.evaluate)
        r.add_post("/envs/{env}/oracle_next", self.oracle_next)
        r.add_post("/envs/{env}/close", self.close)
        return app

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.calls += 1
        if self.token is not None:
            if request.headers.get("Authorization", "") != f"Bearer {self.token}":
                return _error("missing or wrong bearer token", 401)
        return await handler(request)

    def _draw(self, samples: Sequence[float]) -> float:
        return samples[self.rng.randrange(len(samples))]

    def _obs(self, env: _SimEnv, header: dict[str, Any]) -> web.Response:
        bank = self.frames if env.screens == "frame" else self.bank
        image = bank[self.rng.randrange(len(bank))]
        header = {
            "instruction": env.task.get("instruction", ""),
            "text": None,
            "info": {"sim_host": self.name, "step": env.steps},
            **header,
        }
        return web.Response(body=pack_obs(header, image), content_type=OBS_CONTENT_TYPE)

    def _env(self, request: web.Request) -> _SimEnv:
        env = self.leases.get(request.match_info["env"])
        if env is None:
            raise web.HTTPNotFound(
                text=json.dumps({"status": "error", "message": "unknown or expired lease"}),
                content_type="application/json",
            )
        return env

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "capacity": self.capacity,
                "free": self.capacity - len(self.leases),
                "leases": len(self.leases),
                "browser_connected": True,
                "browser_ok": True,
                "version": PROTOCOL_VERSION,
                "host_id": self.name,
            }
        )

    async def lease(self, request: web.Request) -> web.Response:
        if len(self.leases) >= self.capacity:
            return _error(f"all {self.capacity} envs of this host are leased", 503)
        data = await request.json() if request.can_read_body else {}
        screens = data.get("screens", "png") if isinstance(data, dict) else "png"
        if screens not in SCREEN_FORMATS:
            return _error(f"screens must be one of {SCREEN_FORMATS}, got {screens!r:.50}", 400)
        key = secrets.token_urlsafe(9)
        self.leases[key] = _SimEnv({}, 0, screens=screens)
        self.leased += 1
        return web.json_response({"env": key, "lease_s": 120.0, "screens": screens})

    async def reset(self, request: web.Request) -> web.Response:
        env = self._env(request)
        data = await request.json()
        task = data.get("task")
        if not isinstance(task, dict) or "id" not in task:
            return _error("reset needs {'task': Task.to_dict()}", 400)
        env.task, env.seed, env.steps = task, int(data.get("seed") or 0), 0
        self.resets += 1
        spec = task.get("spec") or {}
        env.budget = int(spec.get("sim_steps") or self._draw(self.profile.steps_per_episode))
        await asyncio.sleep(self._draw(self.profile.reset_s))
        return self._obs(env, {})

    async def step(self, request: web.Request) -> web.Response:
        env = self._env(request)
        data = await request.json()
        A.action_from_dict(data.get("action"))  # the host parses what it is sent, as a real one
        await asyncio.sleep(self._draw(self.profile.step_s))
        if self.fault_rate and self.rng.random() < self.fault_rate:
            return _error("simulated browser crash", 500)
        env.steps += 1
        done = env.steps >= env.budget
        info = {"done_reason": "env_done"} if done else {}
        return self._obs(env, {"done": done, "reward": 0.0, "info": info})

    async def evaluate(self, request: web.Request) -> web.Response:
        env = self._env(request)
        await asyncio.sleep(self._draw(self.profile.evaluate_s))
        p = float((env.task.get("spec") or {}).get("p_success", 0.5))
        h = hashlib.blake2b(f"{env.task.get('id')}/{env.seed}".encode(), digest_size=8).digest()
        return web.json_response({"score": float(int.from_bytes(h, "little") / 2**64 < p)})

    async def oracle_next(self, request: web.Request) -> web.Response:
        self._env(request)
        w, h = self.profile.viewport
        return web.json_response({"action": A.action_to_dict(A.Click(w // 2, h // 2))})

    async def close(self, request: web.Request) -> web.Response:
        self.leases.pop(request.match_info["env"], None)
        return web.json_response({"ok": True})


def _error(message: str, status: int) -> web.Response:
    return web.json_response({"status": "error", "message": message}, status=status)


async def start_sim_server(
    server: SimServer, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, str]:
    """Serves `server` on `host:port` in the running loop; (its runner, ``host:port``)."""
    runner = web.AppRunner(server.app(), access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, f"{host}:{site._server.sockets[0].getsockname()[1]}"


def sim_task(i: int, *, steps: int = 3, p_success: float = 0.5, max_steps: int = 15) -> Any:
    """A task for the sim host: ends after `steps` steps, solved with probability `p_success`."""

    spec = {"sim_steps": steps, "p_success": p_success}
    return Task(f"sim/{i}", "do the simulated task", "sim", spec=spec, max_steps=max_steps)


# ------------------------------------------------------------------------- scripted policy


@dataclasses.dataclass
class ScriptedOutput:
    """What ``Engine.generate`` returns, as much of it as ``SamplerPolicy`` reads."""

    tokens: list[int]
    logprobs: np.ndarray
    finish_reason: str = "stop"
    version: int = 0
    routes: Any = None
    error: str = ""


class ScriptedEngine:
    """Stands in for ``cua_jax.sampler.Engine`` (module docstring): every ``generate`` does the
    engine's host-side work on the prompt (``prompt_inputs``: M-RoPE positions, image runs,
    digests), waits ``think_s`` and answers a click at the middle of the screen in the action
    format. A prompt the engine would refuse is a ``sampler_error`` stop, as the engine's.

    Args:
      tokenizer: the processor's tokenizer.
      action_format: the loop's format (``RolloutSettings.action_format``).
      think_s: seconds each reply takes (the model's time per turn; 0: none).
      merge_size: the vision tower's spatial merge (2 in every Qwen-VL family).
    """

    def __init__(
        self,
        tokenizer: Any,
        action_format: str = "qwen3vl",
        think_s: float = 0.0,
        merge_size: int = 2,
    ):
        fmt = A.get_format(action_format)
        space = fmt.default_space(1000, 1000, 1000, 1000)
        text = fmt.format(A.Click(500, 500), space)
        self.tokens = [*tokenizer.encode(text), tokenizer.im_end_id]
        self.logprobs = np.zeros(len(self.tokens), np.float32)
        self.think_s = think_s
        self.image_token_id, self.merge_size = tokenizer.image_pad_id, merge_size
        self.version = 0
        self.calls = 0

    async def generate(
        self, prompt_ids, pixel_values=None, image_grid_thw=None, image_hashes=None, **_: Any
    ):
        self.calls += 1
        inputs = prompt_inputs(
            prompt_ids,
            pixel_values,
            image_grid_thw,
            image_token_id=self.image_token_id,
            merge_size=self.merge_size,
            image_hashes=image_hashes,
        )
        if isinstance(inputs, str):
            return ScriptedOutput([], np.zeros(0, np.float32), finish_reason="error", error=inputs)
        if self.think_s > 0:
            await asyncio.sleep(self.think_s)
        return ScriptedOutput(list(self.tokens), self.logprobs)


# ------------------------------------------------------------------------- measuring


class _Timings:
    """What a measurement collects: every call's seconds, every screen's encoded size, the
    steps each episode took."""

    def __init__(self) -> None:
        self.resets: list[float] = []
        self.steps: list[float] = []
        self.evals: list[float] = []
        self.sizes: list[int] = []
        self.lengths: list[int] = []

    async def episode(self, env: Any, task: Any, actions: Any) -> None:
        """One episode of `env` (it keeps ``last_screenshot_bytes``): its reset, each action of
        the async iterable `actions` until the env is done, its evaluate, each timed."""
        t = time.perf_counter()
        await env.reset(task)
        self.resets.append(time.perf_counter() - t)
        self.sizes.append(len(env.last_screenshot_bytes or b""))
        n = 0
        async for action in actions:
            t = time.perf_counter()
            res = await env.step(action)
            self.steps.append(time.perf_counter() - t)
            self.sizes.append(len(env.last_screenshot_bytes or b""))
            n += 1
            if res.done:
                break
        t = time.perf_counter()
        await env.evaluate()
        self.evals.append(time.perf_counter() - t)
        self.lengths.append(n)

    def profile(self, viewport: tuple[int, int], call: str) -> LatencyProfile:
        """The samples as a profile, its source the call, this machine and the time."""
        source = (
            f"{call} on {os.uname().nodename}, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
            f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
        )
        return LatencyProfile(
            tuple(viewport),
            tuple(self.resets),
            tuple(self.steps),
            tuple(self.evals),
            tuple(s for s in self.sizes if s > 0) or (1,),
            tuple(self.lengths),
            source,
        )


async def measure_browser_profile(
    envs: int = 8, episodes: int = 48, viewport: tuple[int, int] = (640, 480)
) -> LatencyProfile:
    """Times real browser envs (a local ``BrowserPool``) playing the built-in suite's oracle:
    every reset, step and evaluate as the caller sees it, and every screenshot's PNG size."""

    names = suite.SMOKE_TEMPLATES + ("nav-two-level", "type-word", "enter-name-email")
    tasks = [suite.make_task(names[i % len(names)], i) for i in range(episodes)]
    timings = _Timings()

    async def one(env: Any, task: Any) -> None:
        async def oracle():  # asked of the env after each step, up to the task's budget
            for _ in range(task.max_steps):
                yield await env.oracle_next()

        await timings.episode(env, task, oracle())

    async with BrowserPool(envs, viewport=viewport, decode_screenshots=False) as pool:
        await pool.map(one, tasks)
    call = f"measure_browser_profile(envs={envs}, episodes={episodes}, viewport={viewport})"
    return timings.profile(viewport, call)


async def measure_desktop_profile(
    desktops: int = 2, rounds: int = 2, viewport: tuple[int, int] = (1280, 720)
) -> LatencyProfile:
    """Times real desktops (``LocalDesktop``s: Xvfb, openbox and the VM server, in a
    ``DesktopPool``; each episode on a recreated desktop) playing the built-in desktop suite's
    oracles `rounds` times over: every reset (the task's set-up), step and evaluate (its
    checker) as ``VMEnv``'s caller sees it, and every screenshot's PNG size."""
    from envs.vm import osworld  # noqa: PLC0415 -- the desktop side only when measuring it
    from envs.vm.env import VMEnv, task_from_osworld  # noqa: PLC0415
    from envs.vm.providers import DesktopPool, LocalDesktop  # noqa: PLC0415

    tasks = [task_from_osworld(t, "desktop") for t in osworld.load_builtin()] * rounds
    timings = _Timings()
    queue: asyncio.Queue = asyncio.Queue()
    for t in tasks:
        queue.put_nowait(t)

    async def oracle(task: Any):  # the task's typed actions, as written
        for action in task.oracle:
            yield action

    async def worker(pool: Any) -> None:
        async with VMEnv(pool) as env:
            while not queue.empty():
                task = queue.get_nowait()
                await timings.episode(env, task, oracle(task))

    pool = DesktopPool([LocalDesktop(*viewport) for _ in range(desktops)])
    await pool.start()
    try:
        await asyncio.gather(*(worker(pool) for _ in range(desktops)))
    finally:
        await pool.stop()
    call = f"measure_desktop_profile(desktops={desktops}, rounds={rounds}, viewport={viewport})"
    return timings.profile(viewport, call)


async def serve_hosts(
    n: int, capacity: int, fault_rate: float = 0.0, profile: str = "browser"
) -> None:
    """`n` sim hosts in this process on loopback (`profile`: a shipped profile's name or a
    file); prints ``serving on http://...`` per host."""
    latency = LatencyProfile.load(profile)
    runners = []
    for i in range(n):
        server = SimServer(capacity, profile=latency, fault_rate=fault_rate, seed=i)
        runner, ep = await start_sim_server(server)
        runners.append(runner)
        print(f"serving on http://{ep}", flush=True)
    print("ready", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        for r in runners:
            await r.cleanup()


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m envs.sim", description=__doc__.split("\n")[0])
    p.add_argument("--serve", action="store_true", help="serve --hosts sim hosts on loopback")
    p.add_argument("--hosts", type=int, default=1)
    p.add_argument("--capacity", type=int, default=16)
    p.add_argument("--fault-rate", type=float, default=0.0)
    p.add_argument(
        "--profile", default="browser", help="the hosts' profile: browser, desktop or a file"
    )
    p.add_argument(
        "--measure",
        nargs="?",
        const="browser",
        choices=tuple(PROFILES),
        help="measure real envs: browsers (the default) or desktops",
    )
    p.add_argument("--envs", type=int, default=8, help="browsers (or desktops) at once")
    p.add_argument("--episodes", type=int, default=48, help="browser episodes")
    p.add_argument("--rounds", type=int, default=2, help="times over the desktop suite")
    p.add_argument("--viewport", default=None, help="WxH (640x480 browsers, 1280x720 desktops)")
    p.add_argument("--out", default=None, help="the profile file (default: the shipped one)")
    args = p.parse_args(argv)
    if args.serve == bool(args.measure):
        p.error("give one of --serve or --measure")
    if args.hosts < 1 or args.capacity < 1:
        p.error("--hosts and --capacity must be >= 1")
    if args.measure:
        desktop = args.measure == "desktop"
        viewport = args.viewport or ("1280x720" if desktop else "640x480")
        w, h = (int(x) for x in viewport.split("x"))
        if desktop:
            prof = asyncio.run(measure_desktop_profile(args.envs, args.rounds, (w, h)))
        else:
            prof = asyncio.run(measure_browser_profile(args.envs, args.episodes, (w, h)))
        prof.save(args.out or PROFILES[args.measure])
        print(json.dumps(prof.summary(), indent=1), file=sys.stderr)
        return
    asyncio.run(serve_hosts(args.hosts, args.capacity, args.fault_rate, args.profile))


if __name__ == "__main__":
    main()
