"""Rollout sources: where the GRPO loop gets each step's groups, sync or async, one interface.

    source = SyncRollouts(agent, pool, cursor, settings)      # or AsyncRollouts(...)
    source.load_state_dict(meta)                               # resume: cursor + replay + store
    rollouts = await source.next_groups(step)                  # groups of one learner step
    ...train on rollouts.groups...
    source.trained(rollouts.groups, learner.version)           # the learner took them
    meta = source.state_dict()                                 # for the checkpoint
    await source.close()

`SyncRollouts` rolls out `groups_per_batch` groups of the next tasks, then hands them over
(on-policy). `AsyncRollouts` keeps up to `concurrency` episodes running while the learner trains;
a `StalenessGate` starts a group only when the learner will take it within
`max_steps_off_policy` versions, and the store drops (and counts) any that still arrive too old.
Both hold a `TaskCursor` (a deterministic, resumable task order), the `TrajectoryStore`, and a
`FaultMonitor`, which stops the run (`RolloutError`) on a systematic rollout failure instead of
training on nothing:

- every episode of a step ended by an infrastructure fault (`Trajectory.infra_fault`);
- `max_faulty_steps` steps in a row in which no group kept two healthy episodes;
- async: the same exception from `max_faulty_steps` x `groups_per_batch` groups in a row
  (sync: an exception out of a rollout stops the run at once).

Levers (`SourceSettings`, config keys `rl.*`):

- dynamic sampling (DAPO, Yu et al. 2025; `dynamic_sampling`): a group whose episodes all got
  the same reward carries no signal (every advantage is 0). Such groups are dropped and new
  groups of the next tasks are rolled out in their place until `groups_per_batch` informative
  groups are there, or `max_sampling_rounds` rounds (sync) / `max_sampling_rounds` x
  `groups_per_batch` groups (async) have been sampled for the step; then the step trains on
  what it has (fewer groups, or none). `rollout/groups_sampled` and `rollout/groups_kept` are
  logged either way (without the lever, kept = the informative groups among those trained on).
- success replay (ARPO, Lu et al. 2025; `replay_successes`): the store's keep-best replay: a
  group whose episodes all failed gets the best stored success of the same task in place of one
  episode, if that success is at most `replay_max_staleness` learner versions old.
- persisting (`persist_dir`): every rollout put into the store is written there
  (`TrajectoryWriter`; `--config.sft.source=DIR` trains on such a directory).
"""

from __future__ import annotations

import abc
import asyncio
import collections
import dataclasses
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from absl import logging

from cua_jax.env_api import Task
from cua_jax.rl.rollout import episode_seed
from cua_jax.rl.store import StoreClosed, TrajectoryStore
from cua_jax.rl.trajectory import INFRA_FAULTS, MIN_LIVE_EPISODES, Trajectory, live_episodes

Groups = list[list[Trajectory]]


class RolloutError(RuntimeError):
    """A systematic rollout failure (a broken environment, sampler or checker): the run stops
    rather than train on nothing. The message names the failure and the step."""


@dataclasses.dataclass(frozen=True)
class SourceSettings:
    """What a rollout source needs from the run's config (`cua_jax.job.builders` builds it)."""

    group_size: int
    groups_per_batch: int
    seed: int
    max_steps_off_policy: int = 1
    concurrency: int = 1  # episodes at once (async: groups at once = concurrency // group_size)
    groups_to_log: int = 0  # groups per step whose screenshots are kept (sync: episode pages)
    max_faulty_steps: int = 3  # see the module docstring
    put_timeout_s: float = 3600.0
    get_timeout_s: float = 3600.0
    dynamic_sampling: bool = False  # see the module docstring
    max_sampling_rounds: int = 3  # dynamic sampling's bound
    replay_successes: bool = False
    replay_max_staleness: int | None = None  # None: max_steps_off_policy
    persist_dir: str | None = None  # every rollout is written here (None: nowhere)

    def __post_init__(self) -> None:
        if self.max_sampling_rounds < 1:
            raise ValueError(f"max_sampling_rounds must be >= 1, got {self.max_sampling_rounds}")


@dataclasses.dataclass
class Rollouts:
    """One learner step's groups, with what the loop logs about them."""

    groups: Groups  # to train on
    screens: list = dataclasses.field(default_factory=list)  # per episode of sampled[:k]
    timings: dict[str, float] = dataclasses.field(default_factory=dict)  # rollout, idle (s)
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # rollout/...
    # every group rolled out for the step (dynamic sampling drops some; default: `groups`)
    sampled: Groups = dataclasses.field(default_factory=list)


class TaskCursor:
    """Deterministic, resumable order over the training tasks (reshuffled every epoch).

    Async mode takes tasks ahead of the learner (`take_tracked`): a task stays *outstanding*
    until the learner takes its group (`done`). A checkpoint saves those positions with the
    cursor (`pending`), and a resumed run rolls them out again first (`replay`), so no task the
    learner never saw is skipped by a restart.
    """

    def __init__(self, tasks: Sequence[Task], seed: int, position: int = 0):
        if not tasks:
            raise ValueError("the training task list is empty: check config.tasks")
        self.tasks = list(tasks)
        self.seed = seed
        self.position = position
        self.replay: list[int] = []  # positions to roll out before new ones (after a resume)
        self._outstanding: dict[int, None] = {}  # insertion-ordered set

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.tasks)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def task_at(self, position: int) -> Task:
        epoch, i = divmod(position, len(self.tasks))
        return self.tasks[self._order(epoch)[i]]

    def take(self, n: int) -> list[Task]:
        out = []
        for _ in range(n):
            out.append(self.task_at(self.position))
            self.position += 1
        return out

    def take_tracked(self) -> tuple[int, Task]:
        """(position, task): a replayed position first, else the next one; outstanding until
        `done(position)`."""
        if self.replay:
            pos = self.replay.pop(0)
        else:
            pos = self.position
            self.position += 1
        self._outstanding[pos] = None
        return pos, self.task_at(pos)

    def done(self, position: int) -> None:
        self._outstanding.pop(position, None)

    def pending(self) -> list[int]:
        """Positions taken but not yet trained on, and those still to replay."""
        return sorted({*self._outstanding, *self.replay})


class StalenessGate:
    """Admission control for async rollouts: a GRPO group starts only when the learner will take
    it within ``max_steps_off_policy`` versions of now, so nothing is produced just to be dropped.

    Count the groups ahead of a new one in the learner's consumption order: those rolling out,
    those complete in the store, and those the learner already took for the step it is running
    now (that step ends with a version bump). With P such groups the new one is taken after
    ⌊P / groups_per_batch⌋ version bumps, so it may start while
    P < (max_steps_off_policy + 1) * groups_per_batch. With ``max_steps_off_policy=0`` this is
    on-policy: rollouts for the next batch start only once the learner has published the version
    they will be trained against. (Groups finish out of order, so the store's staleness check
    still runs and counts what it drops.)
    """

    def __init__(self, max_steps_off_policy: int, groups_per_batch: int) -> None:
        self.limit = (max_steps_off_policy + 1) * groups_per_batch
        self.groups_per_batch = groups_per_batch
        self.steps_done = 0  # learner steps finished since the producer started
        self.settled = 0  # groups taken since then that are trained on or dropped
        self._event = asyncio.Event()

    def step_done(self, num_groups: int | None = None) -> None:
        """The learner finished a step on its batch of `num_groups` groups (default
        `groups_per_batch`) and published the next version."""
        self.steps_done += 1
        self.settled += self.groups_per_batch if num_groups is None else num_groups
        self._event.set()

    def discard(self, num_groups: int = 1) -> None:
        """Groups the learner took and dropped (dynamic sampling): no longer ahead of anything."""
        self.settled += num_groups
        self._event.set()

    def poke(self) -> None:
        """Something the producer's count depends on changed (a group finished)."""
        self._event.set()

    def running(self, groups_taken: int) -> int:
        """Groups the learner took for the step it is running now, of `groups_taken` taken
        since the producer started."""
        return groups_taken - self.settled

    async def wait_open(self, ahead: Callable[[], int]) -> None:
        """Returns once fewer than `limit` groups are ahead (one waiter: the producer)."""
        while ahead() >= self.limit:
            self._event.clear()
            await self._event.wait()


def _fault_kind(traj: Trajectory) -> str:
    return next(k for k in INFRA_FAULTS if (traj.failure_reason or "").startswith(k))


class FaultMonitor:
    """Counts infrastructure faults and stops the run on systematic ones (module docstring)."""

    def __init__(self, max_faulty_steps: int, groups_per_batch: int) -> None:
        if max_faulty_steps < 1:
            raise ValueError(f"max_faulty_steps must be >= 1, got {max_faulty_steps}")
        self.max_faulty_steps = max_faulty_steps
        self.max_group_errors = max_faulty_steps * groups_per_batch
        self.steps = 0  # steps checked by this object
        self.empty_steps = 0  # of them: no group kept MIN_LIVE_EPISODES healthy episodes
        self._empty_in_a_row = 0
        self._error_key: tuple[str, str] | None = None
        self._errors_in_a_row = 0
        self.group_errors = 0  # groups that raised since the last `check_step`

    def check_step(self, step: int, groups: Groups) -> dict[str, float]:
        """Fault counts of one step's groups (`rollout/...` metrics); raises `RolloutError`
        when every episode faulted or no group was trainable `max_faulty_steps` steps running."""
        trajs = [t for g in groups for t in g]
        faulted = [t for t in trajs if t.infra_fault]
        if trajs and len(faulted) == len(trajs):
            reasons = collections.Counter(t.failure_reason for t in faulted)
            (top, n), *_ = reasons.most_common()
            raise RolloutError(
                f"step {step + 1}: every one of the step's {len(trajs)} episodes ended by an "
                f"infrastructure fault ({n} of them: {top!r}); the environment, the sampler or "
                "the task checker is broken"
            )
        self.steps += 1
        empty = bool(groups) and all(len(live_episodes(g)) < MIN_LIVE_EPISODES for g in groups)
        self.empty_steps += empty
        self._empty_in_a_row = self._empty_in_a_row + 1 if empty else 0
        if self._empty_in_a_row >= self.max_faulty_steps:
            reasons = collections.Counter(t.failure_reason for t in faulted)
            raise RolloutError(
                f"step {step + 1}: {self._empty_in_a_row} steps in a row without a group of "
                f"{MIN_LIVE_EPISODES} episodes free of infrastructure faults; the run trains "
                f"on nothing (most common fault: {reasons.most_common(1)[0][0]!r})"
            )
        kinds = collections.Counter(_fault_kind(t) for t in faulted)
        out = {f"rollout/faults_{k}": float(kinds.get(k, 0)) for k in INFRA_FAULTS}
        out["rollout/env_failures"] = float(len(faulted))  # every infra fault (kept name)
        out["rollout/group_errors"] = float(self.group_errors)
        self.group_errors = 0
        return out

    def group_raised(self, error: BaseException) -> RolloutError | None:
        """Records a group whose rollout raised; returns the error that stops the run when the
        same exception has now come from `max_group_errors` groups in a row."""
        self.group_errors += 1
        key = (type(error).__name__, str(error))
        self._errors_in_a_row = self._errors_in_a_row + 1 if key == self._error_key else 1
        self._error_key = key
        if self._errors_in_a_row < self.max_group_errors:
            return None
        return RolloutError(
            f"{self._errors_in_a_row} rollout groups in a row raised {key[0]}: {key[1]}"
        )

    def group_ok(self) -> None:
        self._errors_in_a_row, self._error_key = 0, None

    def check_run(self) -> None:
        """At the end: raises when every step this object saw trained on nothing for faults."""
        if self.steps and self.empty_steps == self.steps:
            raise RolloutError(
                f"all {self.steps} steps of this run lost every group to infrastructure faults: "
                "nothing was trained"
            )


def informative(group: Sequence[Trajectory]) -> bool:
    """Whether a group carries a learning signal: at least `MIN_LIVE_EPISODES` episodes free of
    infrastructure faults, and not all of them with the same reward (the learner's filter)."""
    live = live_episodes(list(group))
    return len(live) >= MIN_LIVE_EPISODES and any(t.reward != live[0].reward for t in live)


def rollout_metrics(groups: Groups, version: int) -> dict[str, float]:
    """Per-step statistics of the trajectories of `groups` (learner at `version`)."""
    trajs = [t for g in groups for t in g]
    if not trajs:
        return {}
    turns = [len(t.turns) for t in trajs]
    gen = [t.num_generated for t in trajs]
    invalid = sum(t.timings.get("invalid_actions", 0.0) for t in trajs)
    return {
        "rollout/reward": float(np.mean([t.reward for t in trajs])),
        "rollout/score": float(np.mean([t.score or 0.0 for t in trajs])),
        "rollout/success": float(np.mean([t.success for t in trajs])),
        "rollout/episode_turns": float(np.mean(turns)),
        "rollout/generated_tokens": float(np.sum(gen)),
        "rollout/invalid_action_rate": float(invalid / max(1, sum(turns))),
        "rollout/staleness_max": float(max(version - t.policy_version for t in trajs)),
        "rollout/staleness_mean": float(np.mean([version - t.policy_version for t in trajs])),
    }


class RolloutSource(abc.ABC):
    """The interface the GRPO loop uses (module docstring); holds the cursor, store and faults."""

    def __init__(
        self, agent: Any, pool: Any, cursor: TaskCursor, settings: SourceSettings, version: int
    ) -> None:
        s = settings
        self.agent, self.pool, self.cursor, self.settings = agent, pool, cursor, s
        self.store = self._make_store(version)
        self.faults = FaultMonitor(s.max_faulty_steps, s.groups_per_batch)

    def _make_store(self, version: int) -> TrajectoryStore:
        s = self.settings
        in_flight = max(1, s.concurrency // s.group_size) + s.groups_per_batch
        if s.dynamic_sampling:  # a step may take up to max_sampling_rounds batches
            in_flight += (s.max_sampling_rounds - 1) * s.groups_per_batch
        store = TrajectoryStore(
            capacity=s.group_size * (in_flight + s.groups_per_batch),
            group_size=s.group_size,
            max_steps_off_policy=s.max_steps_off_policy,
            replay_best=s.replay_successes,
            replay_max_staleness=s.replay_max_staleness,
            persist_dir=s.persist_dir,
        )
        store.set_version(version)
        return store

    def use_levers(self, **levers: Any) -> None:
        """Sets `SourceSettings` lever fields (dynamic_sampling, max_sampling_rounds,
        replay_successes, replay_max_staleness, persist_dir) on a source that has not rolled
        anything out yet; the store is rebuilt with them (before `load_state_dict`)."""
        if self.store.stats()["put"]:
            raise RuntimeError("use_levers must be called before the first rollout")
        self.store.close()
        self.settings = dataclasses.replace(self.settings, **levers)
        self.store = self._make_store(self.store.version)

    async def next_groups(self, step: int) -> Rollouts:
        """The groups of learner step `step` (0-based), fault-checked: `groups_per_batch` of
        them, or with dynamic sampling up to that many informative ones."""
        out = await self._next(step)
        sampled = out.sampled or out.groups
        out.sampled = sampled
        out.metrics = {
            **rollout_metrics(sampled, self.store.version),
            **self.faults.check_step(step, sampled),
            "rollout/groups_sampled": float(len(sampled)),
            "rollout/groups_kept": float(sum(informative(g) for g in out.groups)),
        }
        return out

    @abc.abstractmethod
    async def _next(self, step: int) -> Rollouts: ...

    def trained(self, groups: Groups, version: int) -> None:
        """The learner trained on `groups` and published `version`: the store drops what is now
        too stale, and (async) their tasks are done and the next groups may start."""
        self.store.set_version(version)

    def state_dict(self) -> dict[str, Any]:
        """The cursor, the positions to replay after a resume, and the store's counters (the
        checkpoint's meta)."""
        return {
            "cursor": self.cursor.position,
            "replay": self.cursor.pending(),
            "store": self.store.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor.position = int(state["cursor"])
        self.cursor.replay = [int(p) for p in state.get("replay", [])]
        self.store.load_state_dict(state["store"])

    async def close(self) -> None:
        self.store.close()


class SyncRollouts(RolloutSource):
    """On-policy: each step rolls out its own groups with the current params, then trains."""

    async def _next(self, step: int) -> Rollouts:
        s = self.settings
        t_start = time.perf_counter()
        screens: list = []
        sampled: Groups = []
        kept: Groups = []
        t_rollout = 0.0
        for _ in range(s.max_sampling_rounds if s.dynamic_sampling else 1):
            t0 = time.perf_counter()
            got = await self._round(step, s.groups_per_batch - len(kept), len(sampled), screens)
            t_rollout += time.perf_counter() - t0
            sampled += got
            kept += [g for g in got if informative(g)] if s.dynamic_sampling else got
            if len(kept) >= s.groups_per_batch:
                break
        # The learner waits for the whole rollout: its idle time.
        idle = time.perf_counter() - t_start
        return Rollouts(kept, screens, {"rollout": t_rollout, "idle": idle}, sampled=sampled)

    async def _round(self, step: int, n: int, offset: int, screens: list) -> Groups:
        """Rolls out `n` groups of the next tasks (group ids and seeds numbered from `offset`
        within the step) and takes them from the store (where success replay applies)."""
        s = self.settings
        picked = self.cursor.take(n)
        first = self.cursor.position - len(picked)

        async def group(i: int, task: Task) -> list[Trajectory]:
            k = offset + i  # the group's number within the step
            g = await self.agent.run_group(
                self.pool,
                task,
                s.group_size,
                seed=episode_seed(s.seed, step, k),
                group_id=f"{step}/{k}",
                screens=screens if k < s.groups_to_log else None,
            )
            for traj in g:
                traj.task_position = first + i
            return g

        try:
            groups = await asyncio.gather(*(group(i, t) for i, t in enumerate(picked)))
        except Exception as e:
            raise RolloutError(f"step {step + 1}: a rollout raised {type(e).__name__}: {e}") from e
        for g in groups:
            for traj in g:
                await self.store.put_async(traj, timeout=60)
        return await self.store.get_groups_async(n, timeout=s.get_timeout_s)


class AsyncRollouts(RolloutSource):
    """Rollouts keep running while the learner trains (module docstring); the producer starts
    at the first `next_groups`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        s = self.settings
        self.gate = StalenessGate(s.max_steps_off_policy, s.groups_per_batch)
        self._producer: asyncio.Task | None = None
        self._failure: RolloutError | None = None
        self._running: set[asyncio.Task] = set()

    async def _next(self, step: int) -> Rollouts:
        if self._producer is None:
            self._producer = asyncio.create_task(self._produce())
        t0 = time.perf_counter()
        get = asyncio.ensure_future(
            self.store.get_groups_async(self.settings.groups_per_batch, self.settings.get_timeout_s)
        )
        await asyncio.wait({get, self._producer}, return_when=asyncio.FIRST_COMPLETED)
        if not get.done():  # the producer stopped: only a systematic failure ends it early
            self.store.close()  # wakes the waiting get
            await asyncio.gather(get, return_exceptions=True)
            raise self._producer_error(step)
        groups = self._result(get, step)
        s = self.settings
        if not s.dynamic_sampling:
            return Rollouts(groups, [], {"idle": time.perf_counter() - t0})
        sampled, kept = list(groups), []
        budget = s.max_sampling_rounds * s.groups_per_batch
        while True:
            for g in groups:
                if informative(g):
                    kept.append(g)
                else:  # dropped: its task is done, and it no longer counts as ahead
                    self.cursor.done(g[0].task_position)
                    self.gate.discard()
            need = min(s.groups_per_batch - len(kept), budget - len(sampled))
            if need <= 0:
                break
            get = asyncio.ensure_future(self.store.get_groups_async(need, s.get_timeout_s))
            await asyncio.wait({get, self._producer}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                self.store.close()
                await asyncio.gather(get, return_exceptions=True)
                raise self._producer_error(step)
            groups = self._result(get, step)
            sampled += groups
        return Rollouts(kept, [], {"idle": time.perf_counter() - t0}, sampled=sampled)

    def _result(self, get: asyncio.Future, step: int) -> Groups:
        try:
            return get.result()
        except StoreClosed:
            raise self._producer_error(step) from None
        except TimeoutError as e:  # rollouts run but no group completes (or all arrive stale)
            raise RolloutError(f"step {step + 1}: {e}") from e

    def _producer_error(self, step: int) -> RolloutError:
        if self._failure is not None:
            return self._failure
        p = self._producer
        err = p.exception() if p is not None and p.done() and not p.cancelled() else None
        return RolloutError(f"step {step + 1}: the async rollout producer stopped: {err!r}")

    def trained(self, groups: Groups, version: int) -> None:
        for g in groups:  # trained on: nothing to replay after a resume
            self.cursor.done(g[0].task_position)
        super().trained(groups, version)
        self.gate.step_done(len(groups))

    async def _produce(self) -> None:
        """Keeps up to `concurrency` episodes going, group by group; `gate` keeps every group
        within the staleness bound, and the store drops (and counts) any that still arrive too
        old."""
        s = self.settings
        sem = asyncio.Semaphore(max(1, s.concurrency // s.group_size))
        _, taken_at_start = self.store.queue_counts()

        def ahead() -> int:  # rolling out + complete in the store + taken for the running step
            ready, taken = self.store.queue_counts()
            return len(self._running) + ready + self.gate.running(taken - taken_at_start)

        async def one(task: Task, k: int) -> None:
            try:
                # seed and group id follow the task's cursor position: a replayed task after a
                # resume rolls out exactly as it would have
                group = await self.agent.run_group(
                    self.pool,
                    task,
                    s.group_size,
                    seed=episode_seed(s.seed, "async", k),
                    group_id=f"a{k}",
                )
                self.faults.group_ok()
                for traj in group:
                    traj.task_position = k
                    await self.store.put_async(traj, timeout=s.put_timeout_s)
            except StoreClosed:  # the learner is done: this group is not needed any more
                pass
            except Exception as e:  # noqa: BLE001 -- counted; a systematic one stops the run
                logging.error("async rollout group of task %s failed", task.id, exc_info=e)
                failure = self.faults.group_raised(e)
                if failure is not None and self._failure is None:
                    self._failure = failure
                    failure.__cause__ = e
                    self._producer.cancel()
            finally:
                sem.release()

        def finished(t: asyncio.Task) -> None:
            self._running.discard(t)
            self.gate.poke()

        try:
            while True:
                await sem.acquire()
                await self.gate.wait_open(ahead)
                pos, task = self.cursor.take_tracked()
                t = asyncio.create_task(one(task, pos))
                self._running.add(t)
                t.add_done_callback(finished)
        finally:  # cancelled at the end of training: stop the episodes still running
            for t in list(self._running):
                t.cancel()
            await asyncio.gather(*self._running, return_exceptions=True)

    async def close(self) -> None:
        if self._producer is not None:
            self._producer.cancel()
        self.store.close()
        if self._producer is not None:
            await asyncio.gather(self._producer, return_exceptions=True)


def make_source(mode: str, *args: Any, **kwargs: Any) -> RolloutSource:
    """`SyncRollouts` for mode "sync", `AsyncRollouts` for "async"."""
    kinds = {"sync": SyncRollouts, "async": AsyncRollouts}
    if mode not in kinds:
        raise ValueError(f"rollout mode {mode!r} is not one of {', '.join(kinds)}")
    return kinds[mode](*args, **kwargs)


__all__ = [
    "AsyncRollouts",
    "FaultMonitor",
    "RolloutError",
    "RolloutSource",
    "Rollouts",
    "SourceSettings",
    "StalenessGate",
    "SyncRollouts",
    "TaskCursor",
    "informative",
    "make_source",
    "rollout_metrics",
]
