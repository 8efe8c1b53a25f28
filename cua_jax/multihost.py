"""Multi-process helpers of the trainer: small host values exchanged between processes.

A multi-host job runs one process per host (TPU VM worker, GPU node, or a CPU process in tests);
every process runs the same loop, its own environments and its own share of the tasks. What
they must agree on goes through these collectives (every process calls each one, in the same
order; on CPU they run over gloo, see `launch/tpu.py`):

    shares = allgather_json({"rows": 3})          # [obj of process 0, obj of process 1, ...]
    row = reduce_metrics(allgather_json(row))      # one metrics row for the whole job
    mine = task_share(tasks)                       # tasks[process_index::process_count]

With one process each is a plain local computation (no collective is issued).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


def allgather_ints(values: Sequence[int]) -> np.ndarray:
    """i64[process_count, len(values)]: every process's `values` (the same length everywhere)."""
    local = np.asarray(values, np.int64)
    if process_count() == 1:
        return local[None]
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(local))


def _padded_size(n: int) -> int:
    """`n` rounded up to a power of two: `process_allgather` compiles one program per shape, so
    gathers of varying sizes (images, JSON) share a few."""
    return 1 << max(n - 1, 0).bit_length()


def allgather_json(obj: Any) -> list[Any]:
    """Every process's JSON-serialisable `obj`, in process order (a list of process_count)."""
    if process_count() == 1:
        return [json.loads(json.dumps(obj))]
    data = np.frombuffer(json.dumps(obj, sort_keys=True).encode(), np.uint8)
    lengths = allgather_ints([data.size])[:, 0]
    padded = np.zeros(_padded_size(int(lengths.max())), np.uint8)
    padded[: data.size] = data
    from jax.experimental import multihost_utils

    rows = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(rows[i, : int(n)].tobytes().decode()) for i, n in enumerate(lengths)]


def allgather_arrays(x: np.ndarray) -> list[np.ndarray]:
    """Every process's array `x` (same rank and dtype everywhere, any first dimension)."""
    if process_count() == 1:
        return [np.asarray(x)]
    x = np.asarray(x)
    firsts = allgather_ints([x.shape[0]])[:, 0]
    padded = np.zeros((_padded_size(int(firsts.max())), *x.shape[1:]), x.dtype)
    padded[: x.shape[0]] = x
    from jax.experimental import multihost_utils

    rows = np.asarray(multihost_utils.process_allgather(padded))
    return [rows[i, : int(n)] for i, n in enumerate(firsts)]


def sync(name: str) -> None:
    """Waits until every process reaches this point (a no-op with one process)."""
    if process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def task_share[T](
    items: Sequence[T], index: int | None = None, count: int | None = None
) -> list[T]:
    """This process's share of `items`: every `count`-th item from `index` (deterministic; the
    same process index gets the same share after a restart)."""
    index = process_index() if index is None else index
    count = process_count() if count is None else count
    return list(items[index::count])


def local_copy(tree: Any) -> Any:
    """`tree` with each array spanning several processes replaced by this process's full copy
    of it (on its first local device); arrays already local are kept as they are (no copy).

    A collective (every process calls it with the same tree): the sampler of a multi-host job
    decodes this process's rollouts on its own devices from such a copy (`builders`). Leaf by
    leaf, so at most one array is replicated at a time."""
    if process_count() == 1:
        return tree

    def one(x: Any) -> Any:
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return x
        return _replicate(x.sharding.mesh)(x).addressable_data(0)

    return jax.tree.map(one, tree)


def local_rows(x: Any) -> np.ndarray:
    """This process's rows of an array whose leading axis is sharded like a batch's rows (the
    inverse of `jax.make_array_from_process_local_data` on that axis): its addressable shards in
    row order, one copy of each; the whole array when it is fully addressable."""
    if x.is_fully_addressable:
        return np.asarray(x)
    shards: dict[int, np.ndarray] = {}
    for s in x.addressable_shards:
        shards.setdefault(s.index[0].start or 0, np.asarray(s.data))
    return np.concatenate([shards[k] for k in sorted(shards)])


@functools.cache
def _replicate(mesh: Any) -> Any:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, P()))


# Metrics that add up over processes (counts); time/ and *_max keys take the largest value (the
# slowest host sets the pace); every other key is a per-episode or per-token mean over equal
# shares, so the processes' values are averaged.
SUM_PREFIXES = (
    "rollout/faults_",
    "rollout/env_failures",
    "rollout/group_errors",
    "rollout/generated_tokens",
    "train/groups",
    "train/episodes_infra_fault",
    "train/samples",
    "train/rows",
    "store/",
    "sft/demos",
    "sft/recovery_demos",
)


def reduce_metrics(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """One metrics row from every process's row (`allgather_json` of each): sums for counts,
    maxima for times and `*_max`, means otherwise (module constants). A key missing on some
    processes is reduced over those that have it."""
    keys: dict[str, None] = {}
    for r in rows:
        keys.update(dict.fromkeys(r))
    out: dict[str, float] = {}
    for k in keys:
        vals = [float(r[k]) for r in rows if k in r and _is_number(r[k])]
        if not vals:
            continue
        if k.startswith(SUM_PREFIXES):
            out[k] = float(np.sum(vals))
        elif k.startswith("time/") or k.endswith("_max"):
            out[k] = float(np.max(vals))
        else:
            out[k] = float(np.mean(vals))
    return out


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) or isinstance(v, np.floating)


__all__ = [
    "allgather_arrays",
    "allgather_ints",
    "allgather_json",
    "local_copy",
    "local_rows",
    "process_count",
    "process_index",
    "reduce_metrics",
    "task_share",
]
