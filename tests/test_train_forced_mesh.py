"""The main job on the test session's 8 forced host devices with `mesh.fsdp=-1`: the learner
shards the policy over all of them and the sampler decodes those very arrays (`learner.model`,
`build_engine(mesh=...)`), so rollouts run and a GRPO step trains.

Before the engine took the run's mesh, every rollout of such a run failed (the KV pool sat on
device 0, the parameters on 8 devices) and the run trained on nothing, silently. The same job
with a NaN learning rate stops at the first NaN loss. The env is a stand-in (a blank screen, one
turn, alternating scores), so the tests need no browser.
"""

import contextlib
import json
import os

import jax
import numpy as np
import pytest

from configs.qwen3vl_grpo import get_config
from cua_jax.env_api import Observation, StepResult, Task
from cua_jax.job import train
from cua_jax.rl.learner import NonFiniteError


class _BlankEnv:
    """One-turn episodes on a blank screen; scores alternate 1, 0 so groups carry a signal."""

    scored = 0

    def __init__(self, size):
        self.screen = np.full((size[1], size[0], 3), 255, np.uint8)

    async def reset(self, task, seed=None):
        return Observation(self.screen, task.instruction)

    async def step(self, action):
        return StepResult(Observation(self.screen, ""), done=True)

    async def evaluate(self):
        _BlankEnv.scored += 1
        return float(_BlankEnv.scored % 2)

    async def close(self):
        pass


class _Pool:
    def __init__(self, size):
        self.size = size

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False

    def __len__(self):
        return 2

    @contextlib.asynccontextmanager
    async def acquire(self):
        yield _BlankEnv(self.size)


def _load_tasks(sources):
    if sources[0]["source_type"] == "none":
        return []
    return [
        Task(id=f"blank/t{i}", instruction="click", source="blank", max_steps=1) for i in range(2)
    ]


def _config():
    c = get_config("smoke")
    c.total_steps = 1
    c.sft.steps = 0
    c.mesh.fsdp = -1
    c.rl.group_size = 2
    c.rl.groups_per_batch = 1
    c.rl.max_tokens = 8
    c.env.max_turns = 1
    c.env.concurrency = 2
    c.env.viewport_width = c.env.viewport_height = 64  # a few image tokens
    c.log.progress = False
    c.log.tensorboard = False
    c.compile_cache_dir = ""
    c.eval_tasks = ({"source_type": "none"},)
    return c


def test_one_grpo_step_on_all_forced_devices(tmp_path):
    assert len(jax.devices()) == 8  # tests/conftest.py
    c = _config()
    size = (c.env.viewport_width, c.env.viewport_height)
    train.main(c, str(tmp_path), env_factory=lambda: _Pool(size), load_tasks=_load_tasks)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    (step1,) = [r for r in rows if r["step"] == 1]
    assert step1["rollout/env_failures"] == 0.0 and step1["rollout/faults_sampler_error"] == 0.0
    assert step1["rollout/generated_tokens"] > 0 and step1["train/samples"] == 2.0
    assert np.isfinite(step1["train/loss"]) and step1["train/version"] == 1.0
    assert os.listdir(tmp_path / "checkpoints") == ["1"]


def test_a_blown_up_update_is_not_applied_and_stops_the_run(tmp_path):
    """A learning rate of 1e30 (a NaN one is refused by the config checks) makes step 1's
    update about 1e30 x the parameters (its own loss is finite): the update is not applied
    (optim.max_update_ratio), nothing of the step is saved, and the run stops there naming it.
    Before the guard, step 1's blown-up parameters were saved and named as the last good
    checkpoint when step 2's loss went NaN."""
    c = _config()
    c.total_steps = 2
    c.ckpt.save_every = 1
    c.ckpt.keep = 5
    c.rl.learning_rate = 1e30
    size = (c.env.viewport_width, c.env.viewport_height)
    ckpts = os.path.join(str(tmp_path), "checkpoints")
    with pytest.raises(NonFiniteError, match=r"GRPO step 1: its update was .* not applied"):
        train.main(c, str(tmp_path), env_factory=lambda: _Pool(size), load_tasks=_load_tasks)
    assert not os.path.isdir(ckpts) or "1" not in os.listdir(ckpts)  # nothing of it is saved


def test_sdpo_steps_on_all_forced_devices_compile_nothing_after_the_warm_up(tmp_path):
    """rl.algorithm=sdpo through the main job on the 8-device mesh, with strict shapes: the
    warm-up compiles the SDPO step and the teacher pass for the run's shape set, and the two
    steps (each failure distilled from its feedback) compile neither; a compile would raise."""
    c = _config()
    c.total_steps = 2
    c.rl.algorithm = "sdpo"
    c.rl.strict_shapes = True
    c.rl.warmup = "learner"
    size = (c.env.viewport_width, c.env.viewport_height)
    train.main(c, str(tmp_path), env_factory=lambda: _Pool(size), load_tasks=_load_tasks)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in rows if r["step"] in (1, 2) and "train/loss" in r]
    assert len(steps) == 2
    assert sum(r["train/sdpo/teacher_samples"] for r in steps) >= 1  # a failure was distilled
    for r in steps:  # (the sampler's programs compile in step 1: rl.warmup="learner")
        assert np.isfinite(r["train/loss"]) and r["compile/unplanned"] == 0.0
    # step 1's rollouts ran while the warm-up compiled the learner's programs (its compiles
    # are in step 1's counts); step 2 compiled none of them
    assert steps[1].get("compile/count/sdpo_teacher", 0.0) == 0.0
    # nothing of the learner's compiled in step 2 (a sampler bucket may: rl.warmup="learner"
    # warms the learner only, and which prefill lengths a step meets depends on its timing)
    compiled = {k: v for k, v in steps[1].items() if k.startswith("compile/count/")}
    learner = ("sdpo", "_grads", "_step", "apply_update", "logprobs", "zero_grads", "teacher")
    assert not [k for k in compiled if any(w in k for w in learner)], compiled
