"""Host-memory trajectory store between the rollout workers and the learner.

`TrajectoryStore` is a fixed-capacity ring of preallocated slots (it never grows): many
producers (rollout threads or asyncio tasks) put finished trajectories; one consumer (the
learner) takes *complete* GRPO groups of ``group_size`` rollouts. A full store blocks producers
(backpressure) instead of overwriting data nobody trained on. Groups sampled by params more than
``max_steps_off_policy`` learner versions old are dropped and counted. Every trajectory put is
accounted exactly once:

    put == trained + dropped_stale + replaced + lost_on_restore + pending

``trained`` counts trajectories handed to the consumer; ``replaced`` counts those swapped out of
an all-equal-reward group by keep-best replay (ARPO, Lu et al. 2025: a group whose rollouts all
failed gets one stored success of the same task, so it carries a learning signal; only a
success within ``replay_max_staleness`` versions of the learner, by default
``max_steps_off_policy``, is replayed);
``lost_on_restore`` counts what was pending when a checkpointed state was saved (pending
trajectories live only in memory).

Capacity must hold every group in flight: with W groups being rolled out at once, use
``capacity >= group_size * (W + groups per learner step)`` or producers of an unfinished group
wait on slots held by other unfinished groups (puts then time out rather than hang).

`TrajectoryWriter` / `TrajectoryReader` persist finished trajectories (tensorstore zarr arrays
for tokens, log-probs and pixels + a JSONL index) for replay, inspection, and SFT
(`cua_jax.demos.pipeline`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from cua_jax.rl.trajectory import Trajectory, Turn

_COUNTERS = ("put", "trained", "dropped_stale", "replaced", "lost_on_restore", "replayed")


class StoreClosed(RuntimeError):
    """Raised in waiting producers / the consumer when the store is closed."""


class TrajectoryStore:
    """Fixed-capacity, versioned, thread- and asyncio-safe store of GRPO groups."""

    def __init__(
        self,
        capacity: int,
        group_size: int,
        max_steps_off_policy: int = 1,
        *,
        replay_best: bool = False,
        replay_max_tasks: int = 10_000,
        replay_max_staleness: int | None = None,
        persist_dir: str | None = None,
        persist_images: bool = True,
        max_dropped_groups_tracked: int = 100_000,
    ) -> None:
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if capacity < group_size:
            raise ValueError(
                f"capacity={capacity} cannot hold one group of group_size={group_size}; "
                "use capacity >= group_size * (groups in flight + groups per step)"
            )
        if max_steps_off_policy < 0:
            raise ValueError(f"max_steps_off_policy must be >= 0, got {max_steps_off_policy}")
        self.capacity = capacity
        self.group_size = group_size
        self.max_steps_off_policy = max_steps_off_policy
        self.replay_best = replay_best
        # how many learner versions old a replayed success may be (default: the groups' bound)
        self.replay_max_staleness = (
            max_steps_off_policy if replay_max_staleness is None else replay_max_staleness
        )
        if self.replay_max_staleness < 0:
            raise ValueError(f"replay_max_staleness must be >= 0, got {replay_max_staleness}")
        self._replay_max_tasks = replay_max_tasks
        self._slots: list[Trajectory | None] = [None] * capacity  # preallocated, never grows
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._groups: dict[str, list[int]] = {}  # group id -> slots, arrival order
        self._ready: collections.deque[str] = collections.deque()  # complete groups, FIFO
        # Groups dropped before they completed: later members are dropped on arrival.
        self._dropped: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._max_dropped = max_dropped_groups_tracked
        self._best: collections.OrderedDict[str, Trajectory] = collections.OrderedDict()
        self._version = 0
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._groups_taken = 0  # groups handed to the consumer by this store object
        self._closed = False
        self._cond = threading.Condition()
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._writer = (
            TrajectoryWriter(persist_dir, persist_images=persist_images) if persist_dir else None
        )

    # --- producer side -------------------------------------------------------------------------

    def put(self, traj: Trajectory, timeout: float | None = None) -> bool:
        """Store one finished trajectory; blocks while the store is full.

        Returns True when stored, False when dropped as stale on arrival. Raises TimeoutError
        when no slot frees up within ``timeout`` seconds (nothing is counted then), and
        StoreClosed after `close`.
        """
        self._persist(traj)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                result = self._try_put_locked(traj)
                if result is not None:
                    return result
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"TrajectoryStore full ({self.capacity} slots) for {timeout}s; the "
                        "learner is not consuming, or capacity is below group_size x groups "
                        "in flight"
                    )
                self._cond.wait(remaining)

    async def put_async(self, traj: Trajectory, timeout: float | None = None) -> bool:
        """`put` for asyncio producers: awaits (without holding a thread) while full."""
        loop = asyncio.get_running_loop()
        self._persist(traj)
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            with self._cond:
                result = self._try_put_locked(traj)
                if result is not None:
                    return result
                fut = loop.create_future()
                self._async_waiters.append((loop, fut))
            remaining = None if deadline is None else deadline - loop.time()
            try:
                if remaining is not None and remaining <= 0:
                    raise TimeoutError
                await asyncio.wait_for(fut, remaining)
            except TimeoutError:
                with self._cond:
                    if (loop, fut) in self._async_waiters:
                        self._async_waiters.remove((loop, fut))
                raise TimeoutError(
                    f"TrajectoryStore full ({self.capacity} slots) for {timeout}s"
                ) from None

    def _try_put_locked(self, traj: Trajectory) -> bool | None:
        if self._closed:
            raise StoreClosed("TrajectoryStore is closed")
        gid = traj.group_id
        if gid in self._dropped:
            self._count_put_dropped(gid, 1)
            return False
        if self._is_stale(traj.policy_version):
            members = self._groups.pop(gid, [])
            for slot in members:
                self._release_slot(slot)
            self._counts["put"] += 1
            self._counts["dropped_stale"] += len(members) + 1
            self._mark_dropped(gid, self.group_size - len(members) - 1)
            return False
        members = self._groups.get(gid)
        if members is not None and len(members) >= self.group_size:
            raise ValueError(
                f"group {gid!r} already has {self.group_size} trajectories; group ids must be "
                "unique per GRPO group and each group gets exactly group_size rollouts"
            )
        if not self._free:
            return None
        slot = self._free.pop()
        self._slots[slot] = traj
        self._counts["put"] += 1
        self._groups.setdefault(gid, []).append(slot)
        if self.replay_best and traj.success:
            self._remember_best(traj)
        if len(self._groups[gid]) == self.group_size:
            self._ready.append(gid)
            self._cond.notify_all()
        return True

    # --- consumer side -------------------------------------------------------------------------

    def get_groups(self, num_groups: int, timeout: float | None = None) -> list[list[Trajectory]]:
        """Take ``num_groups`` complete, fresh groups (oldest first); blocks until available.

        Raises TimeoutError (taking nothing) when they are not there within ``timeout``.
        """
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closed:
                    raise StoreClosed("TrajectoryStore is closed")
                self._drop_stale_locked()
                if len(self._ready) >= num_groups:
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"only {len(self._ready)} of {num_groups} complete groups after "
                        f"{timeout}s ({self._pending_locked()} trajectories pending)"
                    )
                self._cond.wait(remaining)
            out = []
            for _ in range(num_groups):
                gid = self._ready.popleft()
                group = []
                for slot in self._groups.pop(gid):
                    group.append(self._slots[slot])
                    self._release_slot(slot)
                self._counts["trained"] += len(group)
                self._groups_taken += 1
                if self.replay_best:
                    group = self._refill_locked(group)
                out.append(group)
            return out

    async def get_groups_async(
        self, num_groups: int, timeout: float | None = None
    ) -> list[list[Trajectory]]:
        """`get_groups` from asyncio (one consumer, so one worker thread at most)."""
        return await asyncio.to_thread(self.get_groups, num_groups, timeout)

    def set_version(self, version: int) -> None:
        """Tell the store the learner's current policy version; stale groups are dropped."""
        with self._cond:
            if version < self._version:
                raise ValueError(f"version went backwards: {self._version} -> {version}")
            self._version = version
            self._drop_stale_locked()
            self._cond.notify_all()

    @property
    def version(self) -> int:
        return self._version

    def close(self) -> None:
        """Wake every waiter with StoreClosed (shutdown never hangs on a full store)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            self._wake_async_locked()
        if self._writer is not None:
            self._writer.close()

    # --- accounting ----------------------------------------------------------------------------

    def queue_counts(self) -> tuple[int, int]:
        """(complete groups waiting for the consumer, groups handed to it so far by this store
        object), read together under the lock: a group moves from the first to the second at
        once, so their sum never skips it (the async staleness gate counts on that)."""
        with self._cond:
            return len(self._ready), self._groups_taken

    def stats(self) -> dict[str, int]:
        """Counters; put == trained + dropped_stale + replaced + lost_on_restore + pending."""
        with self._cond:
            s = dict(self._counts)
            s["pending"] = self._pending_locked()
            s["ready_groups"] = len(self._ready)
            s["free_slots"] = len(self._free)
            s["replay_tasks"] = len(self._best)
            s["version"] = self._version
            return s

    def state_dict(self) -> dict[str, Any]:
        """Counters and version for a checkpoint (pending trajectories are not saved)."""
        with self._cond:
            state = {k: int(v) for k, v in self._counts.items()}
            state["pending"] = self._pending_locked()
            state["version"] = self._version
            return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counters; what was pending at save time is counted as lost_on_restore."""
        with self._cond:
            if self._counts["put"]:
                raise RuntimeError("load_state_dict must be called before any put")
            for k in _COUNTERS:
                self._counts[k] = int(state.get(k, 0))
            self._counts["lost_on_restore"] += int(state.get("pending", 0))
            self._version = int(state.get("version", 0))

    # --- internals (hold self._cond) -----------------------------------------------------------

    def _pending_locked(self) -> int:
        return self.capacity - len(self._free)

    def _is_stale(self, policy_version: int) -> bool:
        return self._version - policy_version > self.max_steps_off_policy

    def _release_slot(self, slot: int) -> None:
        self._slots[slot] = None
        self._free.append(slot)
        self._cond.notify_all()
        self._wake_async_locked()

    def _wake_async_locked(self) -> None:
        for loop, fut in self._async_waiters:
            loop.call_soon_threadsafe(_resolve, fut)
        self._async_waiters.clear()

    def _mark_dropped(self, gid: str, remaining: int) -> None:
        if remaining > 0:
            self._dropped[gid] = remaining
            while len(self._dropped) > self._max_dropped:
                self._dropped.popitem(last=False)

    def _count_put_dropped(self, gid: str, n: int) -> None:
        self._counts["put"] += n
        self._counts["dropped_stale"] += n
        self._dropped[gid] -= n
        if self._dropped[gid] <= 0:
            del self._dropped[gid]

    def _drop_stale_locked(self) -> None:
        stale = [
            gid
            for gid, slots in self._groups.items()
            if self._is_stale(min(self._slots[s].policy_version for s in slots))
        ]
        for gid in stale:
            slots = self._groups.pop(gid)
            for s in slots:
                self._release_slot(s)
            self._counts["dropped_stale"] += len(slots)
            self._mark_dropped(gid, self.group_size - len(slots))
        if stale:
            stale_set = set(stale)
            self._ready = collections.deque(g for g in self._ready if g not in stale_set)

    def _remember_best(self, traj: Trajectory) -> None:
        old = self._best.get(traj.task_id)
        if old is None or traj.reward >= old.reward:
            self._best[traj.task_id] = traj
        self._best.move_to_end(traj.task_id)
        while len(self._best) > self._replay_max_tasks:
            self._best.popitem(last=False)

    def _refill_locked(self, group: list[Trajectory]) -> list[Trajectory]:
        rewards = [t.reward for t in group]
        if len(group) < 2 or any(r != rewards[0] for r in rewards):
            return group
        best = self._best.get(group[0].task_id)
        if best is None or best.reward == rewards[0] or any(t is best for t in group):
            return group
        if self._version - best.policy_version > self.replay_max_staleness:
            return group  # a staleness bound holds for replayed successes too
        # Swap the last rollout for the stored success; the swapped one is accounted "replaced".
        self._counts["trained"] -= 1
        self._counts["replaced"] += 1
        self._counts["replayed"] += 1
        stand_in = dataclasses.replace(
            best, group_id=group[0].group_id, task_position=group[0].task_position
        )
        return group[:-1] + [stand_in]

    def _persist(self, traj: Trajectory) -> None:
        if self._writer is not None:
            self._writer.write(traj)


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


# --- persistence ---------------------------------------------------------------------------------

# "pixels": float screens (transformers' pixel_values), "screens": screens as bytes
_ARRAYS = {"tokens": "<i4", "logprobs": "<f4", "pixels": "<f4", "screens": "|u1"}


def _open_array(path: str, dtype: str, create: bool):
    import tensorstore as ts

    spec: dict[str, Any] = {"driver": "zarr", "kvstore": {"driver": "file", "path": path}}
    if create and not os.path.exists(os.path.join(path, ".zarray")):
        spec["metadata"] = {"shape": [0], "chunks": [1 << 16], "dtype": dtype}
        return ts.open(spec, create=True).result()
    return ts.open(spec).result()


def _jsonable(x: Any) -> Any:
    try:
        json.dumps(x)
        return x
    except TypeError:
        return repr(x)


class TrajectoryWriter:
    """Appends trajectories to ``directory``: flat zarr arrays + ``index.jsonl`` (one line each).

    Token ids and log-probs of every turn go to ``tokens`` / ``logprobs``; screens (flattened)
    to ``screens`` when they are bytes, ``pixels`` when they are floats; the index line holds
    metadata and per-turn offsets. Reopening a
    directory appends after what is there.
    """

    def __init__(self, directory: str, persist_images: bool = True) -> None:
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.persist_images = persist_images
        self._lock = threading.Lock()
        self._arrays = {
            k: _open_array(os.path.join(directory, k), dt, create=True) for k, dt in _ARRAYS.items()
        }
        self._size = {k: int(a.shape[0]) for k, a in self._arrays.items()}
        self._index = open(os.path.join(directory, "index.jsonl"), "a")  # noqa: SIM115

    def _append(self, name: str, data: np.ndarray) -> int:
        start = self._size[name]
        if data.size:
            end = start + data.size
            arr = self._arrays[name].resize(exclusive_max=[end], expand_only=True).result()
            self._arrays[name] = arr
            arr[start:end].write(data).result()
            self._size[name] = end
        return start

    @staticmethod
    def _screens(pixel_values: np.ndarray) -> tuple[str, np.ndarray]:
        """(the array a turn's screens go to, the screens in its dtype)."""
        if np.asarray(pixel_values).dtype == np.uint8:
            return "screens", np.asarray(pixel_values)
        return "pixels", np.asarray(pixel_values, np.float32)

    def write(self, traj: Trajectory) -> None:
        with self._lock:
            turns = []
            for t in traj.turns:
                rec: dict[str, Any] = {
                    "prompt": [self._append("tokens", t.prompt_ids), int(t.prompt_ids.size)],
                    "generated": [
                        self._append("tokens", t.generated_ids),
                        int(t.generated_ids.size),
                    ],
                    "logprobs": self._append("logprobs", t.logprobs),
                    "extends_previous": bool(t.extends_previous),
                    "action": _jsonable(t.action),
                    "feedback": t.feedback,
                    "trained": bool(t.trained),
                }
                if t.pixel_values is not None and self.persist_images:
                    key, pv = self._screens(t.pixel_values)
                    rec[key] = [self._append(key, pv.reshape(-1)), list(pv.shape)]
                    rec["image_grid_thw"] = np.asarray(t.image_grid_thw).tolist()
                turns.append(rec)
            line = {
                "task_id": traj.task_id,
                "group_id": traj.group_id,
                "reward": float(traj.reward),
                "score": None if traj.score is None else float(traj.score),
                "success": bool(traj.success),
                "policy_version": int(traj.policy_version),
                "timings": traj.timings,
                "failure_reason": traj.failure_reason,
                "checker_message": traj.checker_message,
                "task_position": traj.task_position,
                "turns": turns,
            }
            if traj.final_screen is not None and self.persist_images:
                key, pv = self._screens(traj.final_screen[0])
                line["final_screen"] = {
                    key: [self._append(key, pv.reshape(-1)), list(pv.shape)],
                    "image_grid_thw": np.asarray(traj.final_screen[1]).tolist(),
                }
            # The index line is written last: a reader never sees offsets past the arrays.
            self._index.write(json.dumps(line) + "\n")
            self._index.flush()

    def close(self) -> None:
        with self._lock:
            self._index.close()


class TrajectoryReader:
    """Random access to trajectories written by `TrajectoryWriter` (grain-friendly)."""

    def __init__(self, directory: str) -> None:
        path = os.path.join(directory, "index.jsonl")
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"no trajectory index at {path}; point at a directory written by "
                "TrajectoryStore(persist_dir=...) or TrajectoryWriter"
            )
        with open(path) as f:
            self._index = [json.loads(line) for line in f if line.strip()]
        self.directory = directory
        self._arrays: dict[str, Any] | None = None

    def _arr(self, name: str):
        if self._arrays is None:  # opened lazily so readers can be pickled to grain workers
            self._arrays = {}
        if name not in self._arrays:  # one at a time: older directories have no "screens"
            path = os.path.join(self.directory, name)
            self._arrays[name] = _open_array(path, _ARRAYS[name], create=False)
        return self._arrays[name]

    def __len__(self) -> int:
        return len(self._index)

    def metadata(self, i: int) -> dict[str, Any]:
        return self._index[i]

    def _pixels(self, rec: dict[str, Any]) -> np.ndarray | None:
        """A record's screens (bytes or floats, as written), or None when it has none."""
        key = "screens" if "screens" in rec else "pixels" if "pixels" in rec else None
        if key is None:
            return None
        start, shape = rec[key]
        n = int(np.prod(shape))
        return self._arr(key)[start : start + n].read().result().reshape(shape)

    def __getitem__(self, i: int) -> Trajectory:
        rec = self._index[i]
        turns = []
        for t in rec["turns"]:
            (ps, pn), (gs, gn), ls = t["prompt"], t["generated"], t["logprobs"]
            pv, grid = self._pixels(t), None
            if pv is not None:
                grid = np.asarray(t["image_grid_thw"], np.int32)
            turns.append(
                Turn(
                    prompt_ids=self._arr("tokens")[ps : ps + pn].read().result(),
                    generated_ids=self._arr("tokens")[gs : gs + gn].read().result(),
                    logprobs=self._arr("logprobs")[ls : ls + gn].read().result(),
                    pixel_values=pv,
                    image_grid_thw=grid,
                    extends_previous=t["extends_previous"],
                    action=t["action"],
                    feedback=t["feedback"],
                    trained=t.get("trained", True),  # absent in trajectories written before
                )
            )
        return Trajectory(
            task_id=rec["task_id"],
            group_id=rec["group_id"],
            turns=turns,
            reward=rec["reward"],
            success=rec["success"],
            policy_version=rec["policy_version"],
            timings=rec["timings"],
            failure_reason=rec["failure_reason"],
            score=rec.get("score"),  # absent in directories written before it existed
            checker_message=rec.get("checker_message", ""),
            task_position=rec.get("task_position"),
            final_screen=(
                (self._pixels(fs), np.asarray(fs["image_grid_thw"], np.int32))
                if (fs := rec.get("final_screen"))
                else None
            ),
        )

    def __iter__(self) -> Iterator[Trajectory]:
        for i in range(len(self)):
            yield self[i]
