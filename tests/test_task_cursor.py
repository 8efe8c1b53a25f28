"""TaskCursor: a deterministic epoch order, and async mode's ledger of tasks taken ahead of the
learner, so a resumed async run replays what was in flight instead of skipping it."""

from cua_jax.env_api import Task
from cua_jax.rl.sources import TaskCursor

TASKS = [Task(id=f"t{i}", instruction="", source="test") for i in range(5)]


def test_epochs_are_reshuffled_permutations_and_take_is_deterministic():
    a, b = TaskCursor(TASKS, seed=3), TaskCursor(TASKS, seed=3)
    first, second = a.take(5), a.take(5)
    assert sorted(t.id for t in first) == sorted(t.id for t in second) == [t.id for t in TASKS]
    assert [t.id for t in first + second] == [t.id for t in b.take(10)]
    assert [a.task_at(p).id for p in range(10)] == [t.id for t in first + second]


def test_async_resume_replays_what_the_learner_never_took():
    run = TaskCursor(TASKS, seed=0, position=2)
    taken = [run.take_tracked() for _ in range(4)]  # positions 2..5 go out to roll out
    assert [p for p, _ in taken] == [2, 3, 4, 5] and run.position == 6
    run.done(3)  # the learner trained on the groups of 3 and 5; 2 and 4 are still out
    run.done(5)
    meta = {"cursor": run.position, "replay": run.pending()}
    assert meta == {"cursor": 6, "replay": [2, 4]}

    resumed = TaskCursor(TASKS, seed=0, position=meta["cursor"])
    resumed.replay = list(meta["replay"])
    again = [resumed.take_tracked() for _ in range(3)]
    assert [p for p, _ in again] == [2, 4, 6]  # the lost ones first, then new ones
    assert [t.id for _, t in again] == [run.task_at(p).id for p in (2, 4, 6)]
    assert resumed.pending() == [2, 4, 6]
