"""SFT warm-up data: packed batches of demonstrations for `Learner.sft_step`.

    batches, info = await oracle_sft_batches(learner, agent, pool, tasks, rows=8, ...)
    batches, info = sft_file_batches(path, learner, batch_size=8, seed=0)
    metrics = learner.sft_step(next(batches))

Two sources (ComputerRL's SFT-then-RL recipe): the tasks' oracle demonstrations, played in the
model's own action format (`AgentLoop.demonstrations`; a share of them start with a scripted
miss and recover from it), or files: a trajectory directory (`TrajectoryWriter` /
`TrajectoryStore(persist_dir=)`) or a JSONL file of token-level episodes (`cua_jax.data.sft`).
Only successful episodes are trained on. Both iterators are endless (reshuffled every epoch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from cua_jax.config_checks import ConfigError, check_sft_source
from cua_jax.env_api import Task
from cua_jax.rl.policies import recovery_detours
from cua_jax.rl.trajectory import Trajectory

# Each oracle task is replayed with seeds `seed + SEED_STRIDE * r`: the built-in templates
# randomize their layout by seed.
SEED_STRIDE = 7919


def demo_tasks(tasks: Sequence[Task], episodes_per_task: int) -> list[Task]:
    """Every task `episodes_per_task` times, each time with another seed."""
    return [
        dataclasses.replace(t, seed=t.seed + SEED_STRIDE * r)
        for t in tasks
        for r in range(episodes_per_task)
    ]


async def oracle_sft_batches(
    learner: Any,
    agent: Any,
    pool: Any,
    tasks: Sequence[Task],
    *,
    rows: int,
    episodes_per_task: int,
    recovery_share: float,
    seed: int,
    on_demos: Callable[[list[Trajectory]], None] | None = None,
) -> tuple[Iterator[Any], dict[str, float]]:
    """(endless iterator of packed batches of `rows` samples, info) from the oracle
    demonstrations of `tasks`; `on_demos` gets the successful ones (the trainer saves them)."""
    from cua_jax.rl.trajectory import trajectory_to_samples

    todo = demo_tasks(tasks, episodes_per_task)
    # `recovery_share` of them start with a random click (a miss, mostly): recovery demos.
    detours = recovery_detours(len(todo), share=recovery_share, seed=seed + 1)
    demos = await agent.demonstrations(pool, todo, detours)
    good = [d for d in demos if d.success]
    if not good:
        raise RuntimeError("no oracle demonstration succeeded; check the env and task oracles")
    if on_demos is not None:
        on_demos(good)
    pos_fn = learner.position_fn()
    samples = [s for d in good for s in trajectory_to_samples(d, 1.0, pos_fn)]
    rng = np.random.default_rng(seed)

    def batches() -> Iterator[Any]:
        while True:
            idx = rng.choice(len(samples), size=min(len(samples), rows), replace=False)
            yield learner.pack([samples[i] for i in idx])

    info = {
        "sft/demos": float(len(good)),
        "sft/demo_success": float(len(good) / len(demos)),
        "sft/recovery_demos": float(sum(not d.turns[0].trained for d in good if d.turns)),
    }
    return batches(), info


def sft_file_batches(
    path: str, learner: Any, *, batch_size: int, seed: int = 0
) -> tuple[Iterator[Any], dict[str, float]]:
    """(endless iterator of packed SFT batches, info) from a trajectory directory or a JSONL
    file of demonstrations; only successful episodes are used, reshuffled every epoch."""
    from cua_jax.data.sft import JsonlDemonstrations, sft_dataset
    from cua_jax.rl.store import TrajectoryReader

    if check_sft_source(path) == "dir":
        source = TrajectoryReader(path)
        n_good = sum(bool(source.metadata(i)["success"]) for i in range(len(source)))
    else:
        source = JsonlDemonstrations(path)
        n_good = sum(source[i].success for i in range(len(source)))
    if n_good == 0:
        raise ConfigError(f"config.sft.source={path!r} holds no successful episode")
    ds = sft_dataset(
        source,
        learner.pack,
        batch_size=min(batch_size, n_good),
        position_fn=learner.position_fn(),
        seed=seed,
        num_epochs=None,
    )
    return iter(ds), {"sft/demos": float(n_good)}


__all__ = ["demo_tasks", "oracle_sft_batches", "sft_file_batches"]
