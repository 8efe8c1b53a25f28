"""Browser env throughput vs the raw Playwright screenshot ceiling, side by side in one run.

    .venv/bin/python tools/bench_envs.py --concurrency 1,4,16 --seconds 5 --rounds 3

For each concurrency N, on ONE Chromium process, alternating ``--rounds`` times:
  ceiling: N pages (one context each) looping ``page.screenshot()`` (PNG bytes, nothing else)
  env:     N BrowserEnvs looping ``env.step(Move(...))``: input event + screenshot + PNG->RGB
           decode + done check, i.e. a full agent step
and prints screenshots/s, steps/s and the median of the per-round ratios (alternating rounds
keep a drifting background load from favouring either side). Both show the same task page.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from cua_jax import actions as A
from envs.browser import BrowserEnv, BrowserHost, suite
from envs.browser.pages import ORIGIN, handle_route


async def _rate(seconds: float, fns) -> float:
    """Calls/s of all ``fns`` looping concurrently for ``seconds``."""

    async def loop(fn) -> int:
        n, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            await fn()
            n += 1
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(loop(f) for f in fns))
    return sum(counts) / (time.perf_counter() - t0)


async def bench(host: BrowserHost, n: int, seconds: float, rounds: int, viewport) -> None:
    w, h = viewport
    ctxs, pages = [], []
    for i in range(n):
        ctx = await host.new_context(viewport={"width": w, "height": h}, device_scale_factor=1)
        await ctx.route("**/*", handle_route)
        page = await ctx.new_page()
        await page.goto(f"{ORIGIN}/builtin/task.html?t=settings-panel&seed={i}")
        await page.screenshot()  # warm-up
        ctxs.append(ctx)
        pages.append(page)
    envs = [BrowserEnv(viewport, host=host) for _ in range(n)]
    steps = []
    for i, e in enumerate(envs):
        await e.reset(suite.make_task("settings-panel", i))
        rng = random.Random(i)

        async def step(e=e, rng=rng):
            r = await e.step(A.Move(rng.uniform(0, w - 1), rng.uniform(0, h - 1)))
            assert not r.done, r.info

        await step()  # warm-up
        steps.append(step)

    raws, envr = [], []
    for _ in range(rounds):
        raws.append(await _rate(seconds, [p.screenshot for p in pages]))
        envr.append(await _rate(seconds, steps))
    ratio = statistics.median(e / r for e, r in zip(envr, raws, strict=True))
    print(
        f"{n:>5} {statistics.median(raws):>12.1f} {statistics.median(envr):>12.1f} {ratio:>7.2f}",
        flush=True,
    )
    for c in ctxs:
        await c.close()
    for e in envs:
        await e.close()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--viewport", default="640x480")
    ap.add_argument("--executable-path", default=None)
    args = ap.parse_args()
    viewport = tuple(int(v) for v in args.viewport.split("x"))
    print(
        f"viewport {viewport[0]}x{viewport[1]}, PNG, {args.rounds} alternating rounds of "
        f"{args.seconds:g} s per side"
    )
    print(f"{'envs':>5} {'raw shots/s':>12} {'env steps/s':>12} {'ratio':>7}")
    async with BrowserHost(args.executable_path) as host:
        for n in (int(x) for x in args.concurrency.split(",")):
            await bench(host, n, args.seconds, args.rounds, viewport)


if __name__ == "__main__":
    asyncio.run(main())
