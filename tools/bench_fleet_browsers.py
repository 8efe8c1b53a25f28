"""64 browser envs over three browser hosts against the hosts' raw screenshot ceiling, with the
hosts hand-started (``python -m envs.browser.server`` processes, an endpoint list) and as Ray
actors (``envs.ray_fleet.RayFleet`` on a Ray of this machine), side by side in one run.

    .venv/bin/python tools/bench_fleet_browsers.py [--envs 64 --hosts 3 --seconds 5 --rounds 3]

The measurement is ``tools/bench_envs.py --fleet``'s, without the local pool (the two set-ups
then differ only in who starts, places and finds the hosts): every env is reset on a built-in
page and then moves the mouse as fast as it can (env steps/s, ``envs.browser.bench.loop_rate``);
the ceiling is the same hosts' raw ``page.screenshot()`` loops on as many pages, all starting at
once (``/bench/pages`` then ``/bench/screenshots`` with one ``start_at``). Prints per set-up the
median raw shots/s, env steps/s and their ratio.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import time

import aiohttp

from cua_jax import actions as A
from envs.browser import suite
from envs.browser.bench import loop_rate
from envs.browser.server import start_host_process
from envs.fleet import BrowserFleet
from envs.ray_fleet import RayFleet, host_actor_options
from tools import bench_setup

TOKEN = "bench-fleet-browsers-token-0123456789"
VIEWPORT = (640, 480)
LEASE_S = 1800.0  # the envs sit idle while the ceiling is measured (minutes on a loaded machine)


async def _post(session, ep: str, path: str, body: dict, timeout_s: float) -> dict:
    async with session.post(
        f"http://{ep}{path}",
        json=body,
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    ) as r:
        data = await r.json()
        if r.status != 200:
            raise RuntimeError(f"{ep}{path}: HTTP {r.status}: {data}")
        return data


async def measure(fleet, n: int, seconds: float, rounds: int) -> dict:
    """The env steps/s of `n` envs of `fleet` and the hosts' raw ceiling, per round."""
    w, h = VIEWPORT
    async with contextlib.AsyncExitStack() as stack, aiohttp.ClientSession() as session:
        envs = [await stack.enter_async_context(fleet.acquire()) for _ in range(n)]
        per_host: dict[str, int] = {}
        steps = []
        for i, e in enumerate(envs):
            await e.reset(suite.make_task("settings-panel", i))
            per_host[e.endpoint] = per_host.get(e.endpoint, 0) + 1
            rng = random.Random(i)

            async def step(e=e, rng=rng):
                r = await e.step(A.Move(rng.uniform(0, w - 1), rng.uniform(0, h - 1)))
                assert not r.done, r.info

            await step()
            steps.append(step)
        raws, envr = [], []
        for _ in range(rounds):
            await asyncio.gather(
                *(
                    _post(
                        session, ep, "/bench/pages", {"pages": c, "viewport": list(VIEWPORT)}, 300
                    )
                    for ep, c in per_host.items()
                )
            )
            body = {"seconds": seconds, "start_at": time.time() + 3.0}
            got = await asyncio.gather(
                *(_post(session, ep, "/bench/screenshots", body, seconds + 60) for ep in per_host)
            )
            raws.append(sum(d["shots"] / d["seconds"] for d in got))
            count, took = await loop_rate(seconds, steps)
            envr.append(count / took)
            print(f"  round: raw {raws[-1]:.1f} shots/s, env {envr[-1]:.1f} steps/s", flush=True)
    ratio = bench_setup.median_ratio(envr, raws)
    return {
        "per_host": per_host,
        "raw": statistics.median(raws),
        "env": statistics.median(envr),
        "ratio": ratio,
    }


async def hand_started(args) -> dict:
    """`args.hosts` browser host processes started by hand, one `BrowserFleet` over them: the
    level's episodes, throughput and memory."""

    cap = -(-args.envs // args.hosts)
    extra = ("--lease-s", str(LEASE_S))
    procs = [start_host_process(token=TOKEN, capacity=cap, extra=extra) for _ in range(args.hosts)]
    try:
        fleet = BrowserFleet(None, [ep for _, ep in procs], token=TOKEN, viewport=VIEWPORT)
        async with fleet:
            return await measure(fleet, args.envs, args.seconds, args.rounds)
    finally:
        for p, _ in procs:
            p.terminate()
            p.wait(30)


async def on_ray(args) -> dict:
    """The same browser hosts as Ray actors (`RayFleet` on a local Ray): the same figures."""

    cap = -(-args.envs // args.hosts)
    fleet = RayFleet(
        "local",
        kind="browser",
        target_concurrency=args.envs,
        host_capacity=cap,
        actor_options=host_actor_options("browser", num_cpus=0, resource=""),
        host_options={"lease_s": LEASE_S},
        token=TOKEN,
        viewport=VIEWPORT,
        namespace="bench_fleet_browsers",
    )
    async with fleet:
        t0 = time.monotonic()
        while sum(h.up for h in fleet.hosts.values()) < args.hosts:
            if time.monotonic() - t0 > 300:
                raise RuntimeError(f"the Ray hosts did not come up: {fleet.report()}")
            await asyncio.sleep(0.5)
        return await measure(fleet, args.envs, args.seconds, args.rounds)


def main() -> None:
    """The command line: runs what the module docstring describes."""
    p = bench_setup.arg_parser(__doc__)
    p.add_argument("--envs", type=int, default=64)
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.envs < args.hosts or args.hosts < 1:
        p.error("--envs must be >= --hosts >= 1")
    rows = {}
    for name, fn in (("hand-started", hand_started), ("Ray actors", on_ray)):
        print(f"{name}:", flush=True)
        rows[name] = asyncio.run(fn(args))
    print(f"{'hosts':>13} {'raw shots/s':>12} {'env steps/s':>12} {'ratio':>6}  envs per host")
    for name, r in rows.items():
        per = sorted(r["per_host"].values())
        print(f"{name:>13} {r['raw']:>12.1f} {r['env']:>12.1f} {r['ratio']:>6.2f}  {per}")


if __name__ == "__main__":
    main()
