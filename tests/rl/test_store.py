"""TrajectoryStore: group release, staleness, backpressure, replay, persistence, stress."""

import asyncio
import random
import threading

import numpy as np
import pytest

from cua_jax.rl.store import StoreClosed, TrajectoryReader, TrajectoryStore
from cua_jax.rl.trajectory import Trajectory, Turn


def _traj(gid, version=0, reward=0.0, task="t", uid="", n=3, success=None, images=False):
    turn = Turn(
        prompt_ids=np.arange(n) + 1,
        generated_ids=np.arange(n) + 100,
        logprobs=-np.linspace(0.1, 1.0, n),
        pixel_values=np.ones((4, 6), np.float32) * n if images else None,
        image_grid_thw=np.array([[1, 2, 2]]) if images else None,
        action={"k": uid},
    )
    return Trajectory(
        task_id=task,
        group_id=gid,
        turns=[turn],
        reward=reward,
        success=reward > 0 if success is None else success,
        policy_version=version,
        timings={"uid": uid},
    )


def _invariant(s):
    return s["put"] == (
        s["trained"] + s["dropped_stale"] + s["replaced"] + s["lost_on_restore"] + s["pending"]
    )


def test_releases_only_complete_groups_in_order():
    st = TrajectoryStore(capacity=8, group_size=2)
    st.put(_traj("a"))
    st.put(_traj("b"))
    with pytest.raises(TimeoutError):
        st.get_groups(1, timeout=0.01)
    st.put(_traj("b"))
    st.put(_traj("a"))
    (g1,), (g2,) = st.get_groups(1), st.get_groups(1)
    assert [t.group_id for t in g1] == ["b", "b"] and [t.group_id for t in g2] == ["a", "a"]
    s = st.stats()
    assert s["trained"] == 4 and s["pending"] == 0 and _invariant(s)
    with pytest.raises(ValueError, match="group_size"):
        TrajectoryStore(capacity=1, group_size=2)


def test_queue_counts_move_a_group_from_ready_to_taken_at_once():
    """The async staleness gate counts groups ahead of a new one from these two numbers."""
    st = TrajectoryStore(capacity=8, group_size=2, replay_best=True)
    assert st.queue_counts() == (0, 0)
    for gid, reward in (("a", 1.0), ("a", 0.0), ("b", 0.0), ("b", 0.0), ("c", 0.0)):
        traj = _traj(gid, reward=reward)
        traj.task_position = {"a": 3, "b": 7, "c": 9}[gid]
        st.put(traj)
    assert st.queue_counts() == (2, 0)  # "c" is not complete
    (ga,) = st.get_groups(1)
    assert st.queue_counts() == (1, 1)
    # a replayed success stands in for a rollout of "b" (keep-best replay): still one group
    # taken, and the stand-in keeps the group's own id and task position
    st.put(_traj("d"))
    st.put(_traj("d"))
    (gb,) = st.get_groups(1)
    assert st.stats()["replayed"] == 1 and gb[-1].reward == 1.0 and gb[-1].group_id == "b"
    assert [t.task_position for t in ga + gb] == [3, 3, 7, 7]
    assert st.queue_counts() == (1, 2)


def test_staleness_drops_and_counts_groups():
    st = TrajectoryStore(capacity=8, group_size=2, max_steps_off_policy=1)
    st.put(_traj("old", version=0))
    st.put(_traj("old", version=0))
    st.put(_traj("partial", version=0))
    st.put(_traj("new", version=1))
    st.set_version(2)  # version 0 is now 2 steps behind: "old" and "partial" go
    s = st.stats()
    assert s["dropped_stale"] == 3 and s["pending"] == 1 and _invariant(s)
    assert st.put(_traj("partial", version=0)) is False  # late member of a dropped group
    assert st.put(_traj("stale", version=0)) is False  # stale on arrival
    st.put(_traj("new", version=2))
    (g,) = st.get_groups(1)
    assert {t.policy_version for t in g} == {1, 2}
    s = st.stats()
    assert s["dropped_stale"] == 5 and s["trained"] == 2 and s["put"] == 7 and _invariant(s)


def test_backpressure_blocks_then_resumes():
    st = TrajectoryStore(capacity=2, group_size=2)
    st.put(_traj("a"))
    st.put(_traj("a"))
    with pytest.raises(TimeoutError, match="full"):
        st.put(_traj("b"), timeout=0.01)
    assert st.stats()["put"] == 2  # the timed-out put is not counted
    done = threading.Event()

    def producer():
        st.put(_traj("b"), timeout=10)
        done.set()

    th = threading.Thread(target=producer)
    th.start()
    assert not done.wait(0.05)  # blocked, not overwriting
    st.get_groups(1, timeout=10)
    th.join(10)
    assert done.is_set() and st.stats()["pending"] == 1


def test_async_put_waits_for_space():
    st = TrajectoryStore(capacity=2, group_size=2)

    async def main():
        await st.put_async(_traj("a"))
        await st.put_async(_traj("a"))
        with pytest.raises(TimeoutError):
            await st.put_async(_traj("b"), timeout=0.01)
        waiter = asyncio.create_task(st.put_async(_traj("b"), timeout=10))
        await asyncio.sleep(0)
        assert not waiter.done()
        groups = await st.get_groups_async(1, timeout=10)
        assert await waiter is True
        return groups

    groups = asyncio.run(main())
    assert len(groups[0]) == 2 and _invariant(st.stats())


def test_close_wakes_waiters():
    st = TrajectoryStore(capacity=2, group_size=2)
    err = []

    def consumer():
        try:
            st.get_groups(1, timeout=10)
        except StoreClosed as e:
            err.append(e)

    th = threading.Thread(target=consumer)
    th.start()
    st.close()
    th.join(10)
    assert len(err) == 1


def test_keep_best_replay_refills_all_failed_group():
    st = TrajectoryStore(capacity=8, group_size=2, replay_best=True)
    st.put(_traj("g1", reward=1.0, task="x", uid="win"))
    st.put(_traj("g1", reward=0.0, task="x"))
    st.get_groups(1)
    st.put(_traj("g2", reward=0.0, task="x", uid="f1"))
    st.put(_traj("g2", reward=0.0, task="x", uid="f2"))
    (g,) = st.get_groups(1)
    assert [t.reward for t in g] == [0.0, 1.0] and g[1].timings["uid"] == "win"
    assert g[1].group_id == "g2"
    s = st.stats()
    assert s["replaced"] == 1 and s["replayed"] == 1 and s["trained"] == 3 and _invariant(s)
    # A task with no stored success is left alone.
    st.put(_traj("g3", task="y"))
    st.put(_traj("g3", task="y"))
    assert [t.reward for t in st.get_groups(1)[0]] == [0.0, 0.0]
    # A stored success older than max_steps_off_policy (1) is not replayed.
    st.set_version(2)
    st.put(_traj("g4", reward=0.0, task="x", version=2))
    st.put(_traj("g4", reward=0.0, task="x", version=2))
    assert [t.reward for t in st.get_groups(1)[0]] == [0.0, 0.0]
    assert st.stats()["replayed"] == 1


def test_state_dict_round_trip():
    st = TrajectoryStore(capacity=8, group_size=2)
    for gid in ["a", "a", "b"]:
        st.put(_traj(gid))
    st.get_groups(1)
    st.set_version(1)
    state = st.state_dict()
    st2 = TrajectoryStore(capacity=8, group_size=2)
    st2.load_state_dict(state)
    s = st2.stats()
    assert s["put"] == 3 and s["trained"] == 2 and s["lost_on_restore"] == 1
    assert s["version"] == 1 and _invariant(s)


def test_persistence_round_trip(tmp_path):
    st = TrajectoryStore(capacity=4, group_size=2, persist_dir=str(tmp_path / "traj"))
    a = _traj("a", uid="u1", n=5, images=True)
    a.turns[0].trained = False  # a recovery demonstration's scripted first step
    a.turns.append(
        Turn(
            prompt_ids=np.r_[a.turns[0].full_ids, 7],
            generated_ids=[8, 9],
            logprobs=[-0.5, -0.25],
            extends_previous=True,
            feedback="ok",
        )
    )
    # the failed episode's last screen and its checker's message (SDPO's feedback)
    a.final_screen = (np.arange(12, dtype=np.float32).reshape(2, 6), np.array([[1, 1, 2]]))
    a.checker_message = 'Clicked "Cancel" at (1, 2); the target was "OK" at (3, 4).'
    b = _traj("a", uid="u2", n=2, reward=1.0)
    st.put(a)
    st.put(b)
    st.close()
    rd = TrajectoryReader(str(tmp_path / "traj"))
    assert len(rd) == 2
    for want, got in zip([a, b], rd, strict=True):
        assert (got.task_id, got.group_id, got.reward, got.success) == (
            want.task_id,
            want.group_id,
            want.reward,
            want.success,
        )
        assert len(got.turns) == len(want.turns)
        for tw, tg in zip(want.turns, got.turns, strict=True):
            np.testing.assert_array_equal(tg.prompt_ids, tw.prompt_ids)
            np.testing.assert_array_equal(tg.generated_ids, tw.generated_ids)
            np.testing.assert_array_equal(tg.logprobs, tw.logprobs)
            assert tg.extends_previous == tw.extends_previous and tg.feedback == tw.feedback
            assert tg.trained == tw.trained
            if tw.pixel_values is not None:
                np.testing.assert_array_equal(tg.pixel_values, tw.pixel_values)
                np.testing.assert_array_equal(tg.image_grid_thw, tw.image_grid_thw)
    assert rd[0].turns[0].action == {"k": "u1"}
    assert rd[0].checker_message == a.checker_message and rd[1].final_screen is None
    np.testing.assert_array_equal(rd[0].final_screen[0], a.final_screen[0])
    np.testing.assert_array_equal(rd[0].final_screen[1], a.final_screen[1])


def test_screens_as_bytes_are_stored_as_bytes(tmp_path):
    """uint8 screens go to their own byte array (a quarter of the f32 file), and come back as
    uint8; a directory written before the byte array existed still reads."""
    import os
    import shutil

    st = TrajectoryStore(capacity=4, group_size=1, persist_dir=str(tmp_path / "traj"))
    a = _traj("a", n=3)
    screens = np.random.default_rng(0).integers(0, 256, (8, 12), dtype=np.uint8)
    a.turns[0].pixel_values, a.turns[0].image_grid_thw = screens, np.array([[1, 2, 4]])
    a.final_screen = (screens[:4], np.array([[1, 2, 2]]))
    f = _traj("f", n=2, images=True)
    st.put(a)
    st.put(f)
    st.close()
    rd = TrajectoryReader(str(tmp_path / "traj"))
    got = rd[0].turns[0].pixel_values
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, screens)
    assert rd[0].final_screen[0].dtype == np.uint8
    np.testing.assert_array_equal(rd[0].final_screen[0], screens[:4])
    assert rd[1].turns[0].pixel_values.dtype == np.float32
    # an older directory (no "screens" array, float screens only) reads as before
    shutil.rmtree(tmp_path / "traj" / "screens")
    assert os.path.isdir(tmp_path / "traj" / "pixels")
    assert TrajectoryReader(str(tmp_path / "traj"))[1].turns[0].pixel_values.shape == (4, 6)


def test_stress_many_producers_one_consumer():
    group_size, capacity, n_producers, groups_each = 4, 24, 8, 25
    st = TrajectoryStore(capacity=capacity, group_size=group_size, max_steps_off_policy=3)
    lock = threading.Lock()
    accepted, timeouts = [], [0]
    max_pending = [0]
    producers_done = threading.Event()
    trained_ids, bad = [], []

    def producer(p):
        rng = random.Random(p)
        for g in range(groups_each):
            gid = f"p{p}g{g}"
            n = group_size if rng.random() < 0.8 else rng.randrange(1, group_size)
            for k in range(n):
                v = max(0, st.version - rng.choice([0, 0, 0, 0, 0, 1, 5]))
                uid = f"{gid}/{k}"
                try:
                    ok = st.put(_traj(gid, version=v, uid=uid), timeout=0.2)
                except TimeoutError:
                    with lock:
                        timeouts[0] += 1
                    continue
                with lock:
                    accepted.append((uid, ok))

    def consumer():
        while True:
            try:
                groups = st.get_groups(2, timeout=0.05)
            except TimeoutError:
                if producers_done.is_set() and st.stats()["ready_groups"] < 2:
                    return
                st.set_version(st.version + 1)  # learner progress flushes unfinished groups
                continue
            for grp in groups:
                if len(grp) != group_size or len({t.group_id for t in grp}) != 1:
                    bad.append("incomplete group")
                if any(st.version - t.policy_version > 3 for t in grp):
                    bad.append("stale group released")
                trained_ids.extend(t.timings["uid"] for t in grp)
            s = st.stats()
            max_pending[0] = max(max_pending[0], s["pending"])
            st.set_version(st.version + 1)

    threads = [threading.Thread(target=producer, args=(p,)) for p in range(n_producers)]
    cons = threading.Thread(target=consumer)
    cons.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    producers_done.set()
    cons.join(60)
    assert not cons.is_alive() and not any(t.is_alive() for t in threads), "deadlock"
    assert not bad
    s = st.stats()
    assert _invariant(s)
    assert s["put"] == len(accepted)
    assert len(trained_ids) == len(set(trained_ids)) == s["trained"]
    assert set(trained_ids) <= {u for u, ok in accepted if ok}
    assert s["dropped_stale"] > 0 and s["trained"] > 0
    assert max_pending[0] <= capacity and len(st._slots) == capacity
    st.close()
