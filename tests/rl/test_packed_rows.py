"""Packed rows == one sample per row, for both model families and every attention path.

A learner on a forced fsdp=2 x tensor=2 mesh packs episodes with screens into rows of several
samples (segment ids, per-sample M-RoPE positions, screens grouped by device as a shape-set
batch lays them out); the same samples one per row (`packing.unpacked`) through the same
compiled programs must give each sample the same log-probs, and the batch the same loss
(per-sequence aggregation) and gradients. Dense attention, blockwise (`attn_block=32`) and
splash (its Pallas kernel in interpret mode under shard_map); Qwen3-VL (DeepStack) and
Qwen2.5-VL (window attention in the tower). One-layer models; both layouts have one shape, so
each case compiles one gradient and one log-prob program.
"""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from cua_jax import sharding as shd
from cua_jax.models import qwen_vl
from cua_jax.rl import packing
from cua_jax.rl.learner import Learner, LossConfig, OptimizerConfig
from cua_jax.rl.shapes import Shape, ShapeSet
from cua_jax.rl.trajectory import trajectory_to_samples
from tests.rl.test_learner import make_groups

ROW = 128  # splash tiles rows in multiples of 128
ROWS = 8  # 8 samples: one a row unpacked; packed, they take 2 of the 8 rows
GRID = (1, 4, 4)  # make_groups' screens: 16 patches, 4 merged tokens
SCREENS = 8  # the shape's screen budget (make_groups gives 4)
ATTENTION = {
    "dense": dict(attn_impl="xla", attn_block=0),
    "blockwise": dict(attn_impl="xla", attn_block=32),
    "splash": dict(attn_impl="splash", attn_block=ROW),
}
LOSS = LossConfig(agg_mode="seq-mean-token-mean")


def _config(family: str, attention: str) -> qwen_vl.QwenVLConfig:
    tiny = qwen_vl.tiny(family, vocab_size=256)
    vision = dict(depth=1)
    if family == "qwen3_vl":
        vision["deepstack_visual_indexes"] = (0,)
    else:  # one window-attention block
        vision["fullatt_block_indexes"] = ()
    return tiny.replace(
        text=dataclasses.replace(tiny.text, num_hidden_layers=1),
        vision=dataclasses.replace(tiny.vision, **vision),
        **ATTENTION[attention],
    )


def _patch_dim(cfg: qwen_vl.QwenVLConfig) -> int:
    v = cfg.vision
    return v.in_channels * v.temporal_patch_size * v.patch_size**2


def _samples(learner: Learner, seed: int = 7) -> list:
    """make_groups' episodes (every other one with a screen, two turns each), their screens
    redrawn at the family's patch size."""
    dim = _patch_dim(learner.config)
    rng = np.random.default_rng(seed)
    groups = make_groups(seed=seed)
    pos = learner.position_fn()
    out = []
    for group in groups:
        for traj in group:
            for turn in traj.turns:
                if turn.pixel_values is not None:
                    turn.pixel_values = rng.normal(size=(16, dim)).astype(np.float32)
            out += trajectory_to_samples(traj, traj.reward - 0.5, pos)
    return out


def _by_sample(batch: packing.PackedBatch, lp_RL: np.ndarray) -> dict[tuple, np.ndarray]:
    """{a sample's token ids: its log-probs from its second token on} (a sample's first token
    is predicted from the row's previous sample, or from nothing)."""
    out = {}
    for r in range(batch.shape[0]):
        for k in range(1, int(batch.segment_ids[r].max()) + 1):
            at = batch.segment_ids[r] == k
            out[tuple(batch.input_ids[r, at])] = lp_RL[r, at][1:]
    return out


@pytest.fixture(scope="module")
def mesh():
    return shd.make_mesh(1, 2, 2, devices=jax.devices()[:4])


@pytest.mark.parametrize("attention", list(ATTENTION))
@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl"])
def test_packed_rows_equal_one_sample_per_row(mesh, family, attention):
    cfg = _config(family, attention)
    learner = Learner(
        qwen_vl.QwenVL(cfg, rngs=nnx.Rngs(0)),
        mesh=mesh,
        loss=LOSS,
        optimizer=OptimizerConfig(learning_rate=1e-3),
        seq_len_buckets=(ROW,),
    )
    unit = int(np.prod(GRID))
    shape = Shape(ROWS, ROW, SCREENS * unit)
    learner.shapes = ShapeSet(rl=(shape,), sft=(shape,), grid=GRID, strict=True)
    samples = _samples(learner)
    assert len(samples) == ROWS

    packed = learner.pack(samples, mode="rl")
    flat = packing.unpacked(
        samples, seq_len_buckets=(ROW,), agg_mode=LOSS.agg_mode, pad_id=cfg.text.pad_token_id
    )
    flat.patch_budget = packed.patch_budget  # the same program: screens grouped alike
    assert packed.shape == flat.shape == (ROWS, ROW)
    assert (packed.segment_ids.max(axis=1) > 1).any()  # several samples share a row
    assert flat.segment_ids.max() == 1
    assert packed.pixel_values.shape == flat.pixel_values.shape == (4 * unit, _patch_dim(cfg))
    _, images = learner.layout.device_batch(packed, 1)
    assert type(images).__name__ == "ImageGroups"  # screens sharded by device, not replicated

    got, want = (_by_sample(b, learner.token_logprobs(b)) for b in (packed, flat))
    assert got.keys() == want.keys() and len(got) == ROWS
    for ids, lp in want.items():
        np.testing.assert_allclose(got[ids], lp, rtol=1e-5, atol=1e-5)

    mp, gp = learner.loss_and_grads(packed)
    mu, gu = learner.loss_and_grads(flat)
    assert mp["num_tokens"] == mu["num_tokens"] == sum(s.loss_mask[1:].sum() for s in samples)
    for k in ("loss", "pg_loss", "entropy", "grad_norm"):
        assert mp[k] == pytest.approx(mu[k], rel=1e-5, abs=1e-7), k
    assert mp["grad_norm"] > 0
    for a, b in zip(jax.tree.leaves(gp), jax.tree.leaves(gu), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def cfg_dim(cfg: qwen_vl.QwenVLConfig) -> int:
    v = cfg.vision
    return v.in_channels * v.temporal_patch_size * v.patch_size**2
