"""Synthetic runs built with the real Trajectory / Turn / Action classes (no model, no env)."""

from __future__ import annotations

import dataclasses

import numpy as np

from cua_jax import actions as A
from cua_jax.rl.trajectory import Trajectory, Turn


@dataclasses.dataclass
class FakeTask:
    id: str
    category: str


def decode(ids: list[int]) -> str:
    return "<tool_call>" + " ".join(str(i) for i in ids) + "</tool_call>"


def screen(seed: int, w: int = 160, h: int = 120) -> np.ndarray:
    """A distinct u8[H, W, 3] screenshot: a coloured background with a dark button."""
    rng = np.random.default_rng(seed)
    img = np.empty((h, w, 3), np.uint8)
    img[:] = rng.integers(120, 255, 3, dtype=np.uint8)
    img[h // 2 - 10 : h // 2 + 10, w // 2 - 25 : w // 2 + 25] = (40, 60, 160)
    return img


def trajectory(
    task_id: str,
    group_id: str,
    turns: int,
    reward: float,
    version: int,
    *,
    seed: int = 0,
    failure: str | None = None,
) -> tuple[Trajectory, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    ts, shots = [], []
    for k in range(turns):
        gen = rng.integers(10, 200, size=4 + k)
        acts = (
            [A.Click(60.0 + 10 * k, 50.0 + 5 * k)]
            if k % 2 == 0
            else [A.Drag(120.0, 90.0, start_x=20.0, start_y=30.0)]
        )
        ts.append(
            Turn(
                prompt_ids=np.arange(5 + k),
                generated_ids=gen,
                logprobs=-np.full(gen.size, 0.5, np.float32),
                action=acts,
                feedback=f"feedback {k}",
            )
        )
        shots.append(screen(seed * 31 + k))
    traj = Trajectory(
        task_id=task_id,
        group_id=group_id,
        turns=ts,
        reward=reward,
        success=reward >= 1.0,
        policy_version=version,
        timings={"invalid_actions": float(k % 2), "total": 0.1 * turns},
        failure_reason=failure,
        score=reward,
    )
    return traj, shots


def step_groups(
    step: int, num_groups: int, group_size: int, version: int
) -> tuple[list[list[Trajectory]], list[list[np.ndarray]]]:
    """`num_groups` groups of `group_size`; episode i of group g has 1 + (g + i) % 3 turns,
    rewards alternate so every group has signal except group 1 (all equal)."""
    groups, screens = [], []
    for g in range(num_groups):
        group = []
        for i in range(group_size):
            reward = 0.0 if g == 1 else float((i + step) % 2)
            traj, shots = trajectory(
                f"click-button/{g}",
                f"{step}/{g}",
                1 + (g + i) % 3,
                reward,
                version,
                seed=step * 1000 + g * 10 + i,
            )
            group.append(traj)
            screens.append(shots)
        groups.append(group)
    return groups, screens


def eval_batch(step: int, n: int = 6) -> tuple[list[Trajectory], list[FakeTask], list]:
    trajs, tasks, screens = [], [], []
    for i in range(n):
        cat = ["click", "form", "scroll"][i % 3]
        traj, shots = trajectory(
            f"{cat}-task/{i}",
            "",
            1 + i % 2,
            float((i + step // 2) % 2),
            step,
            seed=10_000 + step * 100 + i,
        )
        trajs.append(traj)
        tasks.append(FakeTask(traj.task_id, cat))
        screens.append(shots)
    return trajs, tasks, screens


def metrics_row(step: int) -> dict[str, float]:
    return {
        "rollout/reward": 0.1 * step,
        "rollout/success": min(1.0, 0.05 * step),
        "train/loss": 1.0 / (1 + step),
        "train/entropy": 2.0 - 0.01 * step,
        "train/kl": 0.001 * step,
        "train/clip_frac_low": 0.01,
        "train/clip_frac_high": 0.02,
        "rollout/staleness_mean": 0.5,
        "rollout/generated_tokens": 100.0 + step,
        "time/step": 2.0,
    }
