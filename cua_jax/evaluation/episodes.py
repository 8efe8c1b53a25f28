"""Greedy evaluation episodes of a policy: played by the `AgentLoop` (multi-host: each process
its share of the tasks), counted per task category with infrastructure faults apart, and shown on
the episode viewer page (`cua_jax.viz`). The trainer's in-run eval (`cua_jax.job.train`) and
`tools/eval.py` count with the same functions.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import jax
import numpy as np
from etils import epath

from cua_jax import multihost
from cua_jax.env_api import Task
from cua_jax.rl.rollout import AgentLoop, count_infra_faults
from cua_jax.rl.trajectory import Trajectory
from cua_jax.viz import episodes_html


async def evaluate_policy(
    agent: AgentLoop,
    pool: Any,
    tasks: Sequence[Task],
    tag: str,
    *,
    seed: int,
    episodes_dir: str | None,
    num_logged: int,
    decode: Callable,
    db: Any = None,
    step: int = 0,
) -> dict[str, float]:
    """Greedy episodes of `tasks`: `success_by_category` + time/eval; the first `num_logged`
    episodes go to EPISODES_DIR/eval_TAG.html when `episodes_dir` is given, and every episode
    of this process to the trajectory database `db` (at `step`) when it is given.

    Multi-host: each process plays its share of the tasks (`multihost.task_share`) and the
    results of all are counted together (the same metrics on every process); greedy episodes
    do not depend on the seed, so they are those one process would play. The page shows this
    process's episodes."""
    screens: list = []
    t0 = time.perf_counter()
    share = multihost.task_share(tasks)
    trajs = await agent.evaluate(pool, share, seed=seed, screens=screens)
    if jax.process_count() == 1:
        out = success_by_category(trajs, tasks)
    else:
        out = success_by_category(_gather_outcomes(trajs, len(tasks)), tasks)
    out["time/eval"] = time.perf_counter() - t0
    if db is not None:
        db.log_eval(step, tag, trajs, share, screens=screens, metrics=out)
    if episodes_dir is not None:
        write_episodes(
            os.path.join(episodes_dir, f"eval_{tag}.html"),
            list(zip(trajs[:num_logged], screens[:num_logged], strict=True)),
            decode,
            f"eval {tag}: success {out['eval/success']:.2f}",
        )
    return out


def success_by_category(trajs: Sequence[Trajectory], tasks: Sequence[Task]) -> dict[str, float]:
    """eval/success overall and per task category, and eval/reward, over the episodes that ran:
    an episode still ended by an infrastructure fault after its retry is counted apart
    (eval/episodes_infra_fault), never as a failure."""
    by_cat: dict[str, list[float]] = defaultdict(list)
    ran = [(traj, task) for traj, task in zip(trajs, tasks, strict=True) if not traj.infra_fault]
    for traj, task in ran:
        by_cat[task.category or "all"].append(float(traj.success))
    out = {f"eval/success/{k}": float(np.mean(v)) for k, v in sorted(by_cat.items())}
    out["eval/success"] = float(np.mean([t.success for t, _ in ran])) if ran else 0.0
    out["eval/reward"] = float(np.mean([t.reward for t, _ in ran])) if ran else 0.0
    out["eval/episodes_infra_fault"] = float(count_infra_faults(trajs))
    return out


def _gather_outcomes(trajs: Sequence[Trajectory], num_tasks: int) -> list[Any]:
    """Every process's eval outcomes (success, reward, infra fault) in task order, from each
    process's episodes of its `task_share` (multi-host)."""
    mine = [[bool(t.success), float(t.reward), bool(t.infra_fault)] for t in trajs]
    shares = multihost.allgather_json(mine)
    out: list[Any] = [None] * num_tasks
    for p, share in enumerate(shares):
        for k, (success, reward, fault) in enumerate(share):
            out[p + k * len(shares)] = SimpleNamespace(
                success=success, reward=reward, infra_fault=fault
            )
    return out


def write_episodes(path: str, episodes, decode: Callable, title: str) -> None:
    """The episode viewer page (`cua_jax.viz`) of (trajectory, screenshots) pairs."""
    page = epath.Path(path)
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(episodes_html(episodes, decode, title))
