"""The raw screenshot ceiling of one browser process (``tools/bench_envs.py``; a browser host's
``/bench/screenshots``): pages looping ``page.screenshot()`` and nothing else."""

from __future__ import annotations

import asyncio
import time

from envs.browser.host import BrowserHost
from envs.browser.pages import ORIGIN, handle_route


async def open_pages(host: BrowserHost, n: int, viewport: tuple[int, int]) -> list:
    """``n`` contexts with one page each on the built-in settings-panel task (warmed up)."""
    w, h = viewport
    pages = []
    for i in range(n):
        ctx = await host.new_context(viewport={"width": w, "height": h}, device_scale_factor=1)
        await ctx.route("**/*", handle_route)
        page = await ctx.new_page()
        await page.goto(f"{ORIGIN}/builtin/task.html?t=settings-panel&seed={i}")
        await page.screenshot()  # warm-up
        pages.append(page)
    return pages


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


async def raw_screenshot_rate(
    host: BrowserHost, n: int, seconds: float, viewport: tuple[int, int]
) -> tuple[int, float]:
    """(screenshots, seconds) of ``n`` fresh pages looping ``page.screenshot()``."""
    pages = await open_pages(host, n, viewport)
    try:
        return await loop_rate(seconds, [p.screenshot for p in pages])
    finally:
        for p in pages:
            await p.context.close()
