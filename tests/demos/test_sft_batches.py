"""SFT warm-up from files (`config.sft.source`): a JSONL of demonstrations and a trajectory
directory give the same batches, unsuccessful episodes are skipped, and the loss goes down."""

import dataclasses
import json

import numpy as np
import pytest
from flax import nnx

from configs.qwen3vl_grpo import get_config
from cua_jax.config.checks import ConfigError
from cua_jax.demos.sft_batches import sft_file_batches
from cua_jax.models import qwen_vl
from cua_jax.rl.learner import Learner, OptimizerConfig
from cua_jax.rl.policies import recovery_detours
from cua_jax.rl.store import TrajectoryWriter
from cua_jax.rl.trajectory import Trajectory, Turn

_TINY = qwen_vl.tiny("qwen2_5_vl", vocab_size=256)
CFG = _TINY.replace(text=dataclasses.replace(_TINY.text, num_hidden_layers=1))


def _episodes():
    rng = np.random.default_rng(0)
    out = []
    for i in range(5):
        prompt = rng.integers(20, 200, 10 + i).tolist()
        gen = rng.integers(20, 200, 6).tolist()
        turns = [{"prompt_ids": prompt, "generated_ids": gen}]
        out.append({"task_id": f"t{i}", "success": i != 4, "turns": turns})
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("sft")
    eps = _episodes()
    jsonl = d / "demos.jsonl"
    jsonl.write_text("\n".join(json.dumps(e) for e in eps) + "\n")
    writer = TrajectoryWriter(str(d / "trajs"))
    for e in eps:
        t = e["turns"][0]
        gen = np.asarray(t["generated_ids"], np.int32)
        turn = Turn(np.asarray(t["prompt_ids"], np.int32), gen, np.zeros(gen.size, np.float32))
        traj = Trajectory(e["task_id"], e["task_id"], [turn], reward=1.0, success=e["success"])
        writer.write(traj)
    writer.close()
    return str(jsonl), str(d / "trajs")


def _learner():
    model = qwen_vl.QwenVL(CFG, rngs=nnx.Rngs(0))
    return Learner(model, optimizer=OptimizerConfig(learning_rate=3e-3), seq_len_buckets=(32,))


def test_jsonl_and_trajectory_dir_give_the_same_batches_of_successful_episodes(files):
    jsonl, trajs = files
    learner = _learner()
    a, info_a = sft_file_batches(jsonl, learner, batch_size=2, seed=3)
    b, info_b = sft_file_batches(trajs, learner, batch_size=2, seed=3)
    assert info_a == info_b == {"sft/demos": 4.0}  # the failed episode is skipped
    seen = set()
    for _ in range(6):  # three epochs of two batches: the iterator never runs dry
        x, y = next(a), next(b)
        np.testing.assert_array_equal(x.input_ids, y.input_ids)
        np.testing.assert_array_equal(x.loss_mask, y.loss_mask)
        seen.update(int(r[0]) for r in x.input_ids[x.segment_ids[:, 0] > 0])
    failed_first_token = _episodes()[4]["turns"][0]["prompt_ids"][0]
    assert failed_first_token not in seen


def test_sft_from_file_lowers_the_loss(files):
    jsonl, _ = files
    learner = _learner()
    batches, _ = sft_file_batches(jsonl, learner, batch_size=4, seed=0)
    losses = [learner.sft_step(next(batches))["loss"] for _ in range(15)]
    assert losses[-1] < 0.5 * losses[0]


def test_bad_sources_name_the_problem(tmp_path, files):
    learner = _learner()
    with pytest.raises(ConfigError, match="neither 'oracle'"):
        sft_file_batches(str(tmp_path / "nope.txt"), learner, batch_size=2)
    only_failed = tmp_path / "failed.jsonl"
    only_failed.write_text(json.dumps(_episodes()[4]) + "\n")
    with pytest.raises(ConfigError, match="no successful episode"):
        sft_file_batches(str(only_failed), learner, batch_size=2)


def test_recovery_detours_land_on_the_episodes_screen():
    """`sft.recovery_share` of the demos get a random first click, drawn as a screen fraction and
    placed on the size the episode's screenshot has (a 1920x1080 VM, not the config viewport)."""
    config = get_config("smoke")
    config.sft.recovery_share = 0.5
    detours = recovery_detours(40, share=config.sft.recovery_share, seed=config.seed + 1)
    clicks = [d for d in detours if d is not None]
    assert len(clicks) == 20
    for w, h in [(1920, 1080), (config.env.viewport_width, config.env.viewport_height)]:
        pts = np.array([[c.x, c.y] for c in (d(w, h) for d in clicks)])
        assert (pts >= 0).all() and (pts[:, 0] < w).all() and (pts[:, 1] < h).all()
        assert pts[:, 0].max() > 0.75 * w and pts[:, 1].max() > 0.75 * h  # spread over the screen
    assert [c(100, 100) for c in clicks] == [c(100, 100) for c in clicks]  # deterministic
    config.sft.recovery_share = 0.0
    assert (
        recovery_detours(40, share=config.sft.recovery_share, seed=config.seed + 1) == [None] * 40
    )


def test_feedback_demos_need_oracle_demonstrations(files):
    """sft.feedback_share plays failed attempts on the tasks' pages: a file source has none."""
    from cua_jax.config.checks import validate_config

    c = get_config("smoke")
    c.sft.source, c.sft.feedback_share = files[0], 0.5
    with pytest.raises(ConfigError, match=r"feedback_share=0.5 needs config.sft.source='oracle'"):
        validate_config(c)
    c.sft.source = "oracle"
    validate_config(c)
