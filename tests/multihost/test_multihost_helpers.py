"""The host-side pieces of a multi-host job that need no second process: task shares, the
reduction of every process's metrics row, the launch's reading of the environment."""

import pytest

from cua_jax import multihost
from launch import tpu


def test_task_shares_partition_the_tasks_deterministically():
    tasks = list(range(11))
    shares = [multihost.task_share(tasks, i, 3) for i in range(3)]
    assert sorted(t for s in shares for t in s) == tasks  # each task once
    assert shares == [multihost.task_share(tasks, i, 3) for i in range(3)]  # same after restart
    assert shares[1] == [1, 4, 7, 10]
    assert multihost.task_share(tasks) == tasks  # one process: all of them


def test_reduce_metrics_adds_counts_takes_the_slowest_time_and_averages_means():
    rows = [
        {
            "rollout/reward": 0.5,
            "rollout/env_failures": 1.0,
            "time/step": 3.0,
            "rollout/staleness_max": 0.0,
            "store/put": 4.0,
            "train/loss": 0.25,
            "eval/success": 0.5,
            "train/rows": 2.0,
        },
        {
            "rollout/reward": 1.0,
            "rollout/env_failures": 2.0,
            "time/step": 5.0,
            "rollout/staleness_max": 1.0,
            "store/put": 4.0,
            "train/loss": 0.25,
            "eval/success": 0.5,
            "train/rows": 2.0,
            "only/here": 7.0,
        },
    ]
    out = multihost.reduce_metrics(rows)
    assert out == {
        "rollout/reward": 0.75,
        "rollout/env_failures": 3.0,
        "time/step": 5.0,
        "rollout/staleness_max": 1.0,
        "store/put": 8.0,
        "train/loss": 0.25,  # the same global value on every process stays itself
        "eval/success": 0.5,
        "train/rows": 4.0,
        "only/here": 7.0,
    }


def test_one_process_collectives_are_local():
    assert multihost.allgather_json({"a": [1, 2]}) == [{"a": [1, 2]}]
    assert multihost.allgather_ints([3, 4]).tolist() == [[3, 4]]
    tree = {"x": [1.0]}
    assert multihost.local_copy(tree) is tree


def test_launch_joins_a_job_only_when_the_environment_describes_one():
    assert tpu.maybe_initialize_distributed({}) is False
    assert tpu.maybe_initialize_distributed({"SLURM_NTASKS": "1"}) is False
    with pytest.raises(SystemExit) as e:
        tpu.maybe_initialize_distributed({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234"})
    assert e.value.code == 2  # names JAX_NUM_PROCESSES and JAX_PROCESS_ID on stderr
