"""Pieces of one GRPO step that every process of a job must agree on.

rollouts = await next_groups(source, step)   # a rollout failure anywhere stops every process
row = job_metrics(row)                       # one metrics row for the job
"""

from __future__ import annotations

from typing import Any

import jax

from cua_jax import multihost
from cua_jax.rl.sources import RolloutError


async def next_groups(source: Any, step: int) -> Any:
    """`source.next_groups(step)`; multi-host, a systematic rollout failure on any process
    stops every process (each would otherwise wait for the others in the next collective)."""
    if jax.process_count() == 1:
        return await source.next_groups(step)
    error, rollouts = None, None
    try:
        rollouts = await source.next_groups(step)
    except RolloutError as e:
        error = e
    failures = multihost.allgather_json(None if error is None else str(error))
    if error is not None:
        raise error
    failed = [(i, f) for i, f in enumerate(failures) if f is not None]
    if failed:
        i, message = failed[0]
        raise RolloutError(f"process {i}: {message}")
    return rollouts


def job_metrics(row: dict[str, Any]) -> dict[str, float]:
    """One metrics row for the whole job from every process's own (`multihost.reduce_metrics`:
    counts add up, times take the slowest process, means are averaged over equal shares)."""
    if jax.process_count() == 1:
        return row
    return multihost.reduce_metrics(multihost.allgather_json(row))


def env_pool_metrics(pool: Any) -> dict[str, float]:
    """The env pool's own `rollout/env_*` metrics, where it has them (`metrics()`: a browser
    fleet's hosts, a VM pool's live desktops and resets)."""
    get = getattr(pool, "metrics", None)
    return {f"rollout/{k}": float(v) for k, v in get().items()} if callable(get) else {}
