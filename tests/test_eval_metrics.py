"""The eval metrics the trainer and tools/eval.py log: infrastructure faults are counted apart."""

import pytest

from cua_jax.env_api import Task
from cua_jax.evaluation.episodes import success_by_category
from cua_jax.rl.trajectory import Trajectory


def _traj(success: bool, failure_reason: str | None = None) -> Trajectory:
    return Trajectory(
        "t", "g", [], reward=float(success), success=success, failure_reason=failure_reason
    )


def test_faulted_episodes_are_counted_apart_not_as_failures():
    tasks = [
        Task(id=f"click/{i}", instruction="x", source="custom", category=c)
        for i, c in enumerate("aabb")
    ]
    trajs = [
        _traj(True),
        _traj(False, "env_error: browser has been closed"),  # a fault: not a failure
        _traj(False, "max_steps"),
        _traj(True),
    ]
    out = success_by_category(trajs, tasks)
    assert out["eval/episodes_infra_fault"] == 1.0
    assert out["eval/success"] == pytest.approx(2 / 3)  # 2 of the 3 episodes that ran
    assert out["eval/success/a"] == 1.0  # the faulted episode of category a is left out
    assert out["eval/success/b"] == 0.5
    assert out["eval/reward"] == pytest.approx(2 / 3)
