"""``BrowserPool``: N BrowserEnvs sharing one Chromium process, run concurrently with asyncio.

async with BrowserPool(16, viewport=(640, 480)) as pool:
    async with pool.acquire() as env:            # waits for a free env
        obs = await env.reset(task)
    scores = await pool.map(run_episode, tasks)  # run_episode(env, task) on free envs
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeVar

from envs.browser.env import BrowserEnv
from envs.browser.host import BrowserHost

T = TypeVar("T")
R = TypeVar("R")


class BrowserPool:
    """``n`` envs (one context each) in one browser; ``acquire()`` lends a free one.

    Args:
      n: number of envs (concurrent episodes).
      viewport: (width, height) of every env's screen.
      executable_path: Chromium binary (autodetected when None).
      page_memory_mb: per-page JavaScript heap cap (``BrowserHost``; None: V8's default).
      **env_kwargs: passed to each :class:`BrowserEnv` (step_timeout_s, text_state, ...).
    """

    def __init__(
        self,
        n: int,
        viewport: tuple[int, int] = (1280, 720),
        executable_path: str | None = None,
        page_memory_mb: int | None = None,
        **env_kwargs: Any,
    ):
        if n < 1:
            raise ValueError(f"BrowserPool needs n >= 1 envs, got {n}")
        self.host = BrowserHost(executable_path, page_memory_mb=page_memory_mb)
        self.envs = [BrowserEnv(viewport, host=self.host, **env_kwargs) for _ in range(n)]
        self._free: asyncio.Queue[BrowserEnv] | None = None

    def __len__(self) -> int:
        return len(self.envs)

    async def __aenter__(self) -> BrowserPool:
        await self.host.browser()
        self._free = asyncio.Queue()
        for e in self.envs:
            self._free.put_nowait(e)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await asyncio.gather(*(e.close() for e in self.envs), return_exceptions=True)
        await self.host.close()

    @contextlib.asynccontextmanager
    async def acquire(self) -> AsyncIterator[BrowserEnv]:
        """Borrow a free env for the duration of the ``async with`` block."""
        if self._free is None:
            raise RuntimeError("use the pool inside `async with BrowserPool(...) as pool`")
        env = await self._free.get()
        try:
            yield env
        finally:
            self._free.put_nowait(env)

    async def map(
        self, fn: Callable[[BrowserEnv, T], Awaitable[R]], items: Iterable[T]
    ) -> list[R | BaseException]:
        """``fn(env, item)`` for every item, at most ``n`` at once; results in item order
        (an exception raised by ``fn`` is returned in its slot, not raised)."""

        async def one(item: T) -> R:
            async with self.acquire() as env:
                return await fn(env, item)

        return await asyncio.gather(*(one(i) for i in items), return_exceptions=True)
