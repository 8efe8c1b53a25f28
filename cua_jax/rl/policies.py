"""Per-turn policies of the agent loop, and the recovery detours of SFT demonstrations.

The episode loop (`cua_jax.rl.rollout.AgentLoop.run_episode`) steps the env, records turns and
scores; what the agent writes each turn comes from a `Policy`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from cua_jax import actions as A

Detour = A.Action | Callable[[int, int], A.Action]
"""A recovery demonstration's scripted first action: an action in screen pixels, or a callable
that gets the first screenshot's (width, height) and returns one."""


@dataclasses.dataclass(frozen=True)
class ScreenFractionClick:
    """A left click at a fixed fraction (fx, fy) of whatever screen the episode has: called with
    the first screenshot's (width, height), it returns ``Click(int(fx * w), int(fy * h))``."""

    fx: float
    fy: float

    def __call__(self, w: int, h: int) -> A.Click:
        return A.Click(float(int(self.fx * w)), float(int(self.fy * h)))


def recovery_detours(n: int, *, share: float, seed: int) -> list[ScreenFractionClick | None]:
    """Detours for `n` demonstrations: round(`share` * n) of them, chosen at random, start with
    a click at a uniformly random point of the screen (a miss, mostly), the rest are None (the
    oracle from the first turn). The point is a screen fraction placed on the size the
    episode's first screenshot has, so it lands on a VM's 1920x1080 screen as well as on the
    browser's viewport. The same (n, share, seed) give the same detours.
    """
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"recovery share={share} must be in [0, 1]")
    rng = np.random.default_rng(seed)
    k = round(share * n)
    which = set(rng.choice(n, size=k, replace=False).tolist()) if k else set()
    fractions = rng.random((n, 2))
    return [
        ScreenFractionClick(float(fractions[i, 0]), float(fractions[i, 1])) if i in which else None
        for i in range(n)
    ]
