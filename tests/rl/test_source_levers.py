"""Rollout-source levers (#24): dynamic sampling refills to the batch size and stops at its bound
(sync and async), success replay injects only same-task successes within the staleness bound,
and every rollout can be persisted for later SFT. No model: a scripted agent plays the groups."""

import asyncio

import pytest

from cua_jax.env_api import Task
from cua_jax.rl.sources import (
    AsyncRollouts,
    SourceSettings,
    SyncRollouts,
    TaskCursor,
    informative,
)
from cua_jax.rl.store import TrajectoryReader, TrajectoryStore
from cua_jax.rl.trajectory import Trajectory

TASKS = [Task(id=f"t{i}", instruction="", source="test") for i in range(12)]


def _order():
    """Task ids in the cursor's order (seed 0): position p -> id."""
    cursor = TaskCursor(TASKS, seed=0)
    return [cursor.task_at(p).id for p in range(len(TASKS))]


class _Agent:
    """Groups whose rewards are [0, 1, 0, 1, ...] for the tasks in `mixed`, all `constant`
    otherwise (no signal); `rewards` overrides per (task id, call number of that task)."""

    def __init__(self, mixed=(), constant=0.0, rewards=None):
        self.mixed, self.constant, self.rewards = set(mixed), constant, rewards or {}
        self.calls: list[str] = []
        self.version = 0

    async def run_group(self, pool, task, group_size, *, seed, group_id, screens=None):
        n = self.calls.count(task.id)
        self.calls.append(task.id)
        await asyncio.sleep(0)
        if (task.id, n) in self.rewards:
            rs = self.rewards[(task.id, n)]
        elif task.id in self.mixed:
            rs = [float(i % 2) for i in range(group_size)]
        else:
            rs = [self.constant] * group_size
        return [
            Trajectory(task.id, group_id, [], reward=r, success=r > 0, policy_version=self.version)
            for r in rs
        ]


def _source(kind, agent, **levers):
    settings = SourceSettings(
        group_size=2, groups_per_batch=2, seed=0, concurrency=4, get_timeout_s=20.0
    )
    source = kind(agent, None, TaskCursor(TASKS, seed=0), settings, version=0)
    if levers:
        source.use_levers(**levers)
    return source


def _steps(source, n, agent=None):
    async def go():
        outs = []
        try:
            for step in range(n):
                out = await source.next_groups(step)
                outs.append(out)
                if agent is not None:
                    agent.version = step + 1
                source.trained(out.groups, version=step + 1)
        finally:
            await source.close()
        return outs

    return asyncio.run(go())


def test_sync_dynamic_sampling_refills_to_the_batch_size():
    ids = _order()
    # positions 0, 1 and 3 have no signal, 2 and 4 do: round 1 (0, 1) keeps nothing, round 2
    # (2, 3) keeps one, round 3 (one group: 4) fills the batch of two.
    agent = _Agent(mixed={ids[2], ids[4], ids[6]})
    (out,) = _steps(_source(SyncRollouts, agent, dynamic_sampling=True, max_sampling_rounds=3), 1)
    assert agent.calls == ids[:5]
    assert [g[0].task_id for g in out.groups] == [ids[2], ids[4]]
    assert all(informative(g) for g in out.groups)
    assert out.metrics["rollout/groups_sampled"] == 5.0
    assert out.metrics["rollout/groups_kept"] == 2.0
    # rollout statistics are over every sampled episode: 2 successes of 10
    assert out.metrics["rollout/success"] == pytest.approx(0.2)
    # group ids and seeds stay unique within the step
    assert len({g[0].group_id for g in out.sampled}) == 5


def test_sync_dynamic_sampling_stops_at_its_bound():
    ids = _order()
    agent = _Agent(mixed={ids[2], ids[6]})
    (out,) = _steps(_source(SyncRollouts, agent, dynamic_sampling=True, max_sampling_rounds=2), 1)
    # round 1: 0, 1 (nothing), round 2: 2, 3 (one kept); the bound stops it one group short
    assert agent.calls == ids[:4]
    assert [g[0].task_id for g in out.groups] == [ids[2]]
    assert out.metrics["rollout/groups_sampled"] == 4.0
    assert out.metrics["rollout/groups_kept"] == 1.0


def test_without_dynamic_sampling_the_step_trains_on_what_it_sampled():
    ids = _order()
    agent = _Agent(mixed={ids[1]})
    (out,) = _steps(_source(SyncRollouts, agent), 1)
    assert [g[0].task_id for g in out.groups] == ids[:2]
    assert out.metrics["rollout/groups_sampled"] == 2.0
    assert out.metrics["rollout/groups_kept"] == 1.0  # the informative ones among them


def test_async_dynamic_sampling_refills_and_keeps_the_gate_moving():
    ids = _order()
    agent = _Agent(mixed={ids[p] for p in (1, 3, 4, 5, 8, 9, 10, 11)})
    source = _source(AsyncRollouts, agent, dynamic_sampling=True, max_sampling_rounds=3)
    outs = _steps(source, 3, agent)
    for out in outs:
        assert len(out.groups) == 2 and all(informative(g) for g in out.groups)
        assert out.metrics["rollout/groups_kept"] == 2.0
        assert 2 <= out.metrics["rollout/groups_sampled"] <= 6
    kept = [g[0].task_id for out in outs for g in out.groups]
    assert len(set(kept)) == 6  # six different informative tasks, none trained twice
    dropped = sum(o.metrics["rollout/groups_sampled"] for o in outs) - 6
    assert dropped >= 2  # positions 0 and 2 come first and carry no signal
    assert source.cursor.pending() == sorted(source.cursor.pending())  # a valid resume state


def test_async_dynamic_sampling_stops_at_its_bound():
    agent = _Agent()  # no group ever has a signal
    source = _source(AsyncRollouts, agent, dynamic_sampling=True, max_sampling_rounds=2)
    outs = _steps(source, 2, agent)
    for out in outs:
        assert out.groups == []
        assert out.metrics["rollout/groups_sampled"] == 4.0  # 2 rounds x 2 groups
        assert out.metrics["rollout/groups_kept"] == 0.0


def test_replay_injects_only_same_task_successes_within_the_bound():
    st = TrajectoryStore(capacity=8, group_size=2, replay_best=True, replay_max_staleness=2)

    def put_group(task, gid, rewards, version):
        for r in rewards:
            st.put(Trajectory(task, gid, [], reward=r, success=r > 0, policy_version=version))

    put_group("A", "a0", [1.0, 0.0], 0)  # a success of A, sampled at version 0
    assert [t.reward for t in st.get_groups(1)[0]] == [1.0, 0.0]
    put_group("B", "b0", [0.0, 0.0], 0)  # all failed, but no success of B stored
    assert [t.reward for t in st.get_groups(1)[0]] == [0.0, 0.0]
    st.set_version(2)  # A's success is 2 versions old: within the bound
    put_group("A", "a1", [0.0, 0.0], 2)
    (g,) = st.get_groups(1)
    assert [t.reward for t in g] == [0.0, 1.0]
    assert g[1].task_id == "A" and g[1].group_id == "a1" and g[1].policy_version == 0
    st.set_version(3)  # 3 versions old: past the bound, not replayed
    put_group("A", "a2", [0.0, 0.0], 3)
    assert [t.reward for t in st.get_groups(1)[0]] == [0.0, 0.0]
    s = st.stats()
    assert s["replayed"] == 1 and s["replaced"] == 1
    assert s["put"] == s["trained"] + s["replaced"] + s["dropped_stale"] + s["pending"]


def test_sync_success_replay_from_config_gives_an_all_failed_group_a_signal():
    ids = _order()
    # the first task succeeds once on its first visit, fails entirely on its second
    first = ids[0]
    agent = _Agent(rewards={(first, 0): [1.0, 0.0], (first, 1): [0.0, 0.0]})
    settings = SourceSettings(group_size=2, groups_per_batch=6, seed=0, concurrency=4)
    cursor = TaskCursor(TASKS[:6], seed=0)
    source = SyncRollouts(agent, None, cursor, settings, version=0)
    source.use_levers(replay_successes=True, replay_max_staleness=1)
    outs = _steps(source, 2, agent)
    second = {g[0].task_id: g for g in outs[1].groups}
    assert [t.reward for t in second[first]] == [0.0, 1.0]  # the step-0 success, replayed
    assert informative(second[first])
    # tasks without a stored success stay all-failed
    assert all(not informative(g) for tid, g in second.items() if tid != first)
    assert outs[1].metrics["rollout/groups_kept"] == 1.0
    assert source.store.stats()["replayed"] == 1


def test_persist_rollouts_writes_every_rollout(tmp_path):
    ids = _order()
    agent = _Agent(mixed={ids[2]})
    source = _source(
        SyncRollouts, agent, dynamic_sampling=True, max_sampling_rounds=2, persist_dir=str(tmp_path)
    )
    (out,) = _steps(source, 1)
    reader = TrajectoryReader(str(tmp_path))
    assert len(reader) == 8  # every sampled episode, dropped groups included
    assert sorted({reader.metadata(i)["task_id"] for i in range(8)}) == sorted(ids[:4])
    assert sum(reader.metadata(i)["reward"] for i in range(8)) == 1.0


def test_use_levers_after_a_rollout_is_refused():
    source = _source(SyncRollouts, _Agent())
    _steps(source, 1)
    with pytest.raises(RuntimeError, match="before the first rollout"):
        source.use_levers(dynamic_sampling=True)
