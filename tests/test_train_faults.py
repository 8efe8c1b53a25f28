"""No silent failure: a run whose every rollout fails stops with an error that names the fault
(launch/tpu.py exits 1), and a NaN or infinite loss, or an update the guard rejected, stops it
naming the step, the metric and the last good checkpoint.

The runs are the smoke preset cut to one GRPO step with no SFT and no eval tasks, on an env pool
whose every reset fails, so no episode reaches the sampler: nothing compiles.
"""

import asyncio
import contextlib
import math
import os
import sqlite3
import subprocess
import sys

import pytest

from configs.qwen3vl_grpo import get_config
from cua_jax.env_api import EnvError, Task
from cua_jax.job import grpo, train
from cua_jax.rl.learner import NonFiniteError, check_finite
from cua_jax.rl.sources import (
    AsyncRollouts,
    FaultMonitor,
    RolloutError,
    SourceSettings,
    SyncRollouts,
    TaskCursor,
)
from cua_jax.rl.trajectory import Trajectory
from tests.main_job import job_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _BrokenEnv:
    def __init__(self, error: Exception):
        self.error = error

    async def reset(self, task, seed=None):
        raise self.error

    async def step(self, action):  # never reached: reset fails
        raise AssertionError("step after a failed reset")

    async def evaluate(self):
        raise AssertionError("evaluate after a failed reset")

    async def close(self):
        pass


class _Pool:
    """An env pool (async context manager with `acquire()`) lending one broken env."""

    def __init__(self, error: Exception):
        self.env = _BrokenEnv(error)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False

    def __len__(self):
        return 1

    @contextlib.asynccontextmanager
    async def acquire(self):
        yield self.env


def _load_tasks(sources):
    if sources and sources[0]["source_type"] == "none":
        return []  # no eval tasks: eval costs nothing
    return [Task(id=f"fake/t{i}", instruction="click", source="fake") for i in range(3)]


def _config(mode, total_steps=1):
    c = get_config("smoke")
    c.total_steps = total_steps
    c.sft.steps = 0
    c.rl.mode = mode
    c.rl.group_size = 2
    c.rl.groups_per_batch = 1
    c.env.concurrency = 2
    c.log.progress = False
    c.log.tensorboard = False
    c.compile_cache_dir = ""
    c.mesh.fsdp = -1  # the test session's forced host devices
    c.eval_tasks = ({"source_type": "none"},)
    return c


def _run(config, workdir, error):
    return train.main(
        config, str(workdir), env_factory=lambda: _Pool(error), load_tasks=_load_tasks
    )


def test_every_episode_an_env_fault_stops_the_first_step(tmp_path):
    with pytest.raises(
        RolloutError,
        match=r"step 1: every one of the step's 2 episodes.*"
        r"env_error: reset: display :99 is gone",
    ):
        _run(_config("sync"), tmp_path, EnvError("display :99 is gone"))
    # the trajectory database records the run as failed, naming the error
    with sqlite3.connect(tmp_path / "trajectories.sqlite") as db:
        ((status,),) = db.execute("SELECT status FROM runs").fetchall()
    assert status.startswith("failed: RolloutError: step 1"), status


class _Agent:
    """`AgentLoop.run_group`'s signature; raises `error`, or plays groups of reward i % 2."""

    def __init__(self, error=None):
        self.error = error
        self.calls = []

    async def run_group(self, pool, task, group_size, *, seed, group_id, screens=None):
        self.calls.append(group_id)
        await asyncio.sleep(0)
        if self.error is not None:
            raise self.error
        return [Trajectory(task.id, group_id, [], reward=float(i % 2)) for i in range(group_size)]


def _source(kind, agent, groups_per_batch=2):
    tasks = [Task(id=f"t{i}", instruction="", source="test") for i in range(5)]
    settings = SourceSettings(
        group_size=2, groups_per_batch=groups_per_batch, seed=0, concurrency=4
    )
    return kind(agent, None, TaskCursor(tasks, seed=0), settings, version=0)


def test_a_rollout_exception_stops_a_sync_step_naming_it():
    source = _source(SyncRollouts, _Agent(RuntimeError("xvfb died")))
    with pytest.raises(RolloutError, match="step 4: a rollout raised RuntimeError: xvfb died"):
        asyncio.run(source.next_groups(3))


def test_the_same_exception_in_every_async_group_stops_the_run():
    """Async groups run in the background; their exceptions used to be logged and dropped while
    the learner waited an hour for groups. Now 3 steps' worth in a row stop the run."""
    agent = _Agent(RuntimeError("xvfb died"))
    source = _source(AsyncRollouts, agent)

    async def go():
        try:
            await source.next_groups(0)
        finally:
            await source.close()

    with pytest.raises(RolloutError, match="6 rollout groups in a row raised RuntimeError: xvfb"):
        asyncio.run(go())
    assert len(agent.calls) >= 6


@pytest.mark.parametrize("kind", [SyncRollouts, AsyncRollouts])
def test_sources_tag_groups_with_their_task_position_and_resume_the_cursor(kind):
    """Healthy rollouts: each episode carries its task's cursor position (a typed field, not a
    string in the group id); the checkpoint state names what to replay after a resume."""
    source = _source(kind, _Agent())

    async def go():
        try:
            out = await source.next_groups(0)
            state_before = source.state_dict()
            source.trained(out.groups, version=1)
            return out, state_before, source.state_dict()
        finally:
            await source.close()

    out, before, after = asyncio.run(go())
    assert len(out.groups) == 2 and all(len(g) == 2 for g in out.groups)
    positions = [g[0].task_position for g in out.groups]
    assert all(t.task_position == g[0].task_position for g in out.groups for t in g)
    assert out.metrics["rollout/env_failures"] == 0.0 and out.metrics["rollout/reward"] == 0.5
    if kind is SyncRollouts:
        assert positions == [0, 1] and before["replay"] == after["replay"] == []
    else:  # taken ahead of the learner: outstanding until trained on
        assert set(positions) <= set(before["replay"])
        assert not set(positions) & set(after["replay"])
    assert after["store"]["trained"] == 4 and after["store"]["version"] == 1


def _traj(reason=None):
    return Trajectory("t", "g", [], failure_reason=reason)


def test_fault_monitor_counts_faults_and_stops_a_run_that_trains_on_nothing():
    m = FaultMonitor(max_faulty_steps=2, groups_per_batch=2)
    ok, env, sampler = _traj(), _traj("env_error: hung"), _traj("sampler_error: oom")
    # one healthy group of two: trainable; the fault counts are logged by kind
    out = m.check_step(0, [[ok, _traj()], [env, sampler]])
    assert out["rollout/faults_env_error"] == out["rollout/faults_sampler_error"] == 1.0
    assert out["rollout/env_failures"] == 2.0 and out["rollout/faults_evaluate_error"] == 0.0
    # no group keeps two healthy episodes: nothing to train on, twice in a row -> stop
    m.check_step(1, [[ok, env], [ok, sampler]])
    with pytest.raises(RolloutError, match="step 3: 2 steps in a row.*'env_error: hung'"):
        m.check_step(2, [[ok, env], [_traj(), env]])
    # a run of one step that trained on nothing fails at the end too
    single = FaultMonitor(max_faulty_steps=3, groups_per_batch=1)
    single.check_step(0, [[ok, env]])
    with pytest.raises(RolloutError, match="nothing was trained"):
        single.check_run()
    # exceptions: the same one from max_faulty_steps x groups_per_batch groups in a row
    m = FaultMonitor(max_faulty_steps=2, groups_per_batch=2)
    for e in (OSError("a"), OSError("a"), ValueError("b"), OSError("a"), OSError("a")):
        assert m.group_raised(e) is None
    m.group_ok()
    errs = [m.group_raised(OSError("a")) for _ in range(4)]
    assert errs[:3] == [None] * 3 and "4 rollout groups in a row raised OSError: a" in str(errs[3])
    assert m.check_step(0, [[ok, ok]])["rollout/group_errors"] == 9.0  # 5 + 4 since the last step


def test_a_run_whose_rl_never_updated_the_policy_fails_unless_something_else_trained(caplog):
    """Every GRPO step had only equal-reward groups (job.grpo marks it `skipped_no_signal`):
    without an SFT phase the run trained on nothing and raises, naming why; after SFT it warns."""
    failed = grpo.RLSignal()
    for _ in range(3):
        failed.add({"rollout/success": 0.0}, updated=False)
    with pytest.raises(
        RolloutError, match=r"none of this run's 3 GRPO steps.*every episode failed.*nothing was"
    ):
        failed.check_run(trained=None)
    failed.check_run(trained="the SFT warm-up")  # a warning only
    assert "the policy is what the SFT warm-up trained" in caplog.text
    solved = grpo.RLSignal()
    solved.add({"rollout/success": 1.0}, updated=False)
    with pytest.raises(RolloutError, match="every episode succeeded: the tasks are too easy"):
        solved.check_run(trained=None)
    trained = grpo.RLSignal()
    trained.add({"rollout/success": 0.0}, updated=False)
    trained.add({"rollout/success": 0.5}, updated=True)
    trained.check_run(trained=None)  # one update is training
    grpo.RLSignal().check_run(trained=None)  # no GRPO step (total_steps=0): silent


@pytest.mark.parametrize("key", ["loss", "grad_norm"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_loss_or_gradient_norm_names_step_metric_and_checkpoint(key, value):
    metrics = {"loss": 0.5, "grad_norm": 1.0, "ratio_max": math.nan, key: value}
    with pytest.raises(
        NonFiniteError,
        match=rf"GRPO step 7: {key} is {value}.*last good "
        r"checkpoint is /w/checkpoints/6",
    ):
        check_finite(metrics, step=7, phase="GRPO", last_checkpoint="/w/checkpoints/6")
    with pytest.raises(NonFiniteError, match="SFT step 2: .*no checkpoint was saved"):
        check_finite(metrics, step=2, phase="SFT", last_checkpoint=None)
    check_finite({"loss": 0.5, "grad_norm": 1.0}, step=7, phase="GRPO", last_checkpoint=None)


def test_a_rejected_update_names_the_last_good_checkpoint():
    """The update guard (optim.max_update_ratio): a step whose update was rejected stops the run
    even with a finite loss and gradient norm, saying the update was not applied and naming the
    last checkpoint saved before it, or that none was."""
    metrics = {"loss": 0.5, "grad_norm": 1.0, "update_rejected": 1.0, "update_ratio": 3.2e29}
    with pytest.raises(
        NonFiniteError,
        match=r"GRPO step 4: its update was 3\.2e\+29 x .*not applied.*"
        r"the last good checkpoint is /w/checkpoints/3\)",
    ):
        check_finite(metrics, step=4, phase="GRPO", last_checkpoint="/w/checkpoints/3")
    with pytest.raises(NonFiniteError, match=r"not applied.*no checkpoint was saved before it"):
        check_finite(metrics, step=1, phase="GRPO", last_checkpoint=None)
    check_finite({**metrics, "update_rejected": 0.0}, step=4, phase="GRPO", last_checkpoint=None)


_LAUNCH = """
import sys
from absl import app
from cua_jax.env_api import EnvError
from launch import compose, tpu
from tests.test_train_faults import _Pool, _load_tasks

broken = (lambda: _Pool(EnvError("display :99 is gone")), _load_tasks)
compose.build_env_factory = lambda config: broken
sys.argv = ["launch/tpu.py", *sys.argv[1:]]
app.run(tpu.main, flags_parser=tpu.parse_flags)
"""


def test_launch_exits_1_naming_the_fault(tmp_path):
    """launch/tpu.py (its env factory swapped for the broken pool): the run stops at step 1 with
    exit status 1 and the error on stderr as one line."""
    args = [
        "--config=configs/qwen3vl_grpo.py:smoke",
        "--config.total_steps=1",
        "--config.sft.steps=0",
        "--config.rl.group_size=2",
        "--config.rl.groups_per_batch=1",
        "--config.env.concurrency=2",
        "--config.log.progress=False",
        "--config.log.tensorboard=False",
        "--config.compile_cache_dir=",
        "--config.eval_tasks=({'source_type': 'none'},)",
        f"--workdir={tmp_path}",
    ]
    r = subprocess.run(
        [sys.executable, "-c", _LAUNCH, *args],
        cwd=ROOT,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 1, r.stderr[-3000:]
    want = "launch/tpu.py: run failed: RolloutError: step 1: every one of the step's 2 episodes"
    assert want in r.stderr, r.stderr[-3000:]
    assert "env_error: reset: display :99 is gone" in r.stderr
