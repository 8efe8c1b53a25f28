"""The raw screenshot ceiling of one browser process (``tools/bench_envs.py``; a browser host's
``/bench/screenshots``): pages looping ``page.screenshot()`` and nothing else."""

from __future__ import annotations

import asyncio
import time

from envs.browser.host import BrowserHost
from envs.browser.pages import ORIGIN, handle_route


async def open_pages(host: BrowserHost, n: int, viewport: tuple[int, int]) -> list:
    """``n`` contexts with one page each on the built-in settings-panel task (warmed up: one
    screenshot each, retried on Chromium's transient "Unable to capture screenshot")."""
    w, h = viewport
    pages = []
    for i in range(n):
        ctx = await host.new_context(viewport={"width": w, "height": h}, device_scale_factor=1)
        await ctx.route("**/*", handle_route)
        page = await ctx.new_page()
        await page.goto(f"{ORIGIN}/builtin/task.html?t=settings-panel&seed={i}")
        for attempt in range(3):
            try:
                await page.screenshot()
                break
            except Exception as e:  # noqa: BLE001 -- a busy renderer: try again, then give up
                if attempt == 2 or "Unable to capture screenshot" not in str(e):
                    raise
                await asyncio.sleep(0.5)
        pages.append(page)
    return pages


async def close_pages(pages: list) -> None:
    for p in pages:
        await p.context.close()


async def loop_rate(seconds: float, fns) -> tuple[int, float]:
    """(calls, elapsed seconds) of all ``fns`` looping concurrently for ``seconds``."""

    async def loop(fn) -> int:
        n, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            await fn()
            n += 1
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(loop(f) for f in fns))
    return sum(counts), time.perf_counter() - t0


async def screenshot_loop(
    pages: list, seconds: float, start_at: float | None = None
) -> tuple[int, float, float]:
    """(screenshots, seconds, late) of ``pages`` looping ``page.screenshot()`` for ``seconds``.

    start_at: a ``time.time()`` at which to begin, so that several hosts' loops run at the same
    moment (a fleet's ceiling: loops that run one after another, each with the cores to
    itself, add up to more than the hosts can do at once); ``late`` is how many seconds after
    it the loop began (0.0 when on time or not given)."""
    late = 0.0
    if start_at is not None:
        wait = start_at - time.time()
        if wait > 0:
            await asyncio.sleep(wait)
        late = max(0.0, time.time() - start_at)
    shots, took = await loop_rate(seconds, [p.screenshot for p in pages])
    return shots, took, late
