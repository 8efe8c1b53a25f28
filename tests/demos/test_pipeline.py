"""SFT through the grain pipeline: the loss falls on a small synthetic demonstration set until
greedy argmax reproduces every demonstrated token."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cua_jax.demos.pipeline import JsonlDemonstrations, sft_dataset
from cua_jax.models import qwen_vl
from cua_jax.rl.learner import Learner, OptimizerConfig
from cua_jax.rl.store import TrajectoryReader, TrajectoryWriter
from cua_jax.rl.trajectory import Trajectory, Turn

_TINY = qwen_vl.tiny("qwen3_vl", vocab_size=256)
CFG = _TINY.replace(
    text=dataclasses.replace(_TINY.text, num_hidden_layers=1),
    vision=dataclasses.replace(_TINY.vision, depth=1, deepstack_visual_indexes=(0,)),
)


def _demos(path, n=4, seed=0):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n):
            p0 = rng.integers(0, 200, 5).tolist()
            g0 = rng.integers(0, 200, 4).tolist()
            p1 = p0 + g0 + rng.integers(0, 200, 2).tolist()  # the episode continues
            g1 = rng.integers(0, 200, 3).tolist()
            turns = [
                {"prompt_ids": p0, "generated_ids": g0},
                {"prompt_ids": p1, "generated_ids": g1, "extends_previous": True},
            ]
            f.write(json.dumps({"task_id": f"demo{i}", "turns": turns}) + "\n")


def test_sft_memorises_demonstrations(tmp_path):
    path = tmp_path / "demos.jsonl"
    _demos(path)
    learner = Learner(
        qwen_vl.QwenVL(CFG, rngs=nnx.Rngs(0)),
        seq_len_buckets=(16, 32),
        optimizer=OptimizerConfig(learning_rate=3e-3, max_grad_norm=None),
    )
    ds = sft_dataset(
        JsonlDemonstrations(str(path)),
        learner.pack,
        batch_size=4,
        num_epochs=None,
        shard_index=0,
        shard_count=1,
    )
    batch = ds[0]
    assert batch.num_samples == 4 and batch.loss_mask.sum() == 4 * 7
    losses, reproduced = [], False
    for step in range(300):
        losses.append(learner.sft_step(ds[step])["loss"])
        if step % 20 == 19:
            logits = learner.model(
                jnp.asarray(batch.input_ids),
                position_ids=batch.position_ids,
                segment_ids=batch.segment_ids,
            )
            pred = np.asarray(jnp.argmax(logits[:, :-1], -1))
            mask = batch.loss_mask[:, 1:]
            if (pred[mask] == batch.input_ids[:, 1:][mask]).all():
                reproduced = True
                break
    assert reproduced, f"not memorised after {len(losses)} steps, loss {losses[-1]:.3f}"
    assert losses[-1] < 0.2 * losses[0]

    # Checkpoint round trip of the learner state through the project's orbax Checkpointer.
    from cua_jax.checkpoint.orbax_io import Checkpointer

    ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
    ckpt.save(learner.version, learner.state_dict(), {"version": learner.version}, force=True)
    saved = [np.asarray(x) for x in jax.tree.leaves(learner.state_dict())]
    version = learner.version
    learner.sft_step(batch)
    state, meta = ckpt.restore(learner.abstract_state())
    learner.load_state_dict(state)
    assert learner.version == version == meta["version"]
    for a, b in zip(saved, jax.tree.leaves(learner.state_dict()), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    ckpt.close()


def test_sft_sources_and_sharding(tmp_path):
    w = TrajectoryWriter(str(tmp_path / "traj"))
    for i, ok in enumerate([True, False, True, True]):
        t = Turn([1, 2, 3], [4 + i, 5], [-0.1, -0.2])
        w.write(Trajectory(f"t{i}", "g", [t], reward=float(ok), success=ok))
    w.close()
    reader = TrajectoryReader(str(tmp_path / "traj"))
    packed_ids = []
    for shard in range(2):
        ds = sft_dataset(
            reader, lambda s: s, batch_size=1, shuffle=False, shard_index=shard, shard_count=2
        )
        packed_ids += [int(b[0].input_ids[3]) for b in ds]
    assert sorted(packed_ids) == [4, 6, 7]  # the failed episode (4 + 1) is skipped
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task_id": "x"}\n')
    with pytest.raises(ValueError, match="turns"):
        JsonlDemonstrations(str(bad))
