"""The learner's blockwise attention (`model.attn_block`) against the dense path it replaces.

Reference: `dense_attention` with `make_attention_mask` (itself checked against transformers in
test_qwen_vl_parity.py). Every real query row (attention_mask 1 / segment id != 0) must get the
same output and the same gradients; padding rows are never attended and never scored, so they
are not compared (the dense path spreads them over all T keys, the blockwise one over its
block's keys).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cua_jax.models import qwen_vl
from cua_jax.models.qwen_vl.text import (
    blockwise_attention,
    dense_attention,
    make_attention_mask,
)

B, T, N, K, H = 2, 11, 4, 2, 8


def _qkv(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T, N, H)).astype(np.float32)
    k = rng.normal(size=(B, T, K, H)).astype(np.float32)
    v = rng.normal(size=(B, T, K, H)).astype(np.float32)
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)


# row 0: three packed segments then padding; row 1: one segment, right padding
SEGMENTS = np.array([[1, 1, 1, 2, 2, 2, 2, 3, 3, 0, 0], [1] * 8 + [0] * 3], np.int32)
ATTENTION = (SEGMENTS != 0).astype(np.int32)


@pytest.mark.parametrize("block", [3, 10])  # uneven last blocks: 3+3+3+2, 10+1
@pytest.mark.parametrize("packed", [True, False])
def test_blockwise_equals_dense_with_gradients(block, packed):
    q, k, v = _qkv()
    seg = jnp.asarray(SEGMENTS) if packed else None
    am = jnp.asarray(ATTENTION)
    real = SEGMENTS != 0
    w = jnp.asarray(real[:, :, None, None] * np.random.default_rng(1).normal(size=(B, T, N, H)))

    def dense(q, k, v):
        return dense_attention(q, k, v, make_attention_mask(B, T, am, seg))

    def blocked(q, k, v):
        return blockwise_attention(q, k, v, block, am, seg)

    np.testing.assert_allclose(blocked(q, k, v)[real], dense(q, k, v)[real], rtol=1e-5, atol=1e-6)
    # a loss over real rows only: the gradients reach q, k and v identically
    loss = lambda f: lambda *a: jnp.sum(f(*a) * w)  # noqa: E731
    g_dense = jax.grad(loss(dense), argnums=(0, 1, 2))(q, k, v)
    g_block = jax.grad(loss(blocked), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g_block, g_dense, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_model_with_attn_block_gives_the_dense_logits():
    """The whole tiny Qwen3-VL (two layers) on a packed batch: attn_block=4 vs 0."""
    tiny = qwen_vl.tiny("qwen3_vl", vocab_size=256)
    cfg = tiny.replace(text=dataclasses.replace(tiny.text, num_hidden_layers=2))
    dense = qwen_vl.init_random(cfg, seed=0)
    blocked = qwen_vl.init_random(cfg.replace(attn_block=4), seed=0)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 200, (B, T)), jnp.int32)
    pos = jnp.asarray([[0, 1, 2, 0, 1, 2, 3, 0, 1, 0, 0], [0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 0]])
    seg = jnp.asarray(SEGMENTS)
    real = SEGMENTS != 0
    a = dense(ids, position_ids=pos, segment_ids=seg)
    b = blocked(ids, position_ids=pos, segment_ids=seg)
    np.testing.assert_allclose(np.asarray(b)[real], np.asarray(a)[real], rtol=1e-4, atol=1e-5)


def test_a_negative_attn_block_is_refused_by_name():
    with pytest.raises(ValueError, match="attn_block=-1"):
        qwen_vl.tiny("qwen3_vl", vocab_size=256).replace(attn_block=-1)


def test_the_learner_honours_attn_block(monkeypatch):
    """The learner builds its own attn_fn (packed rows): with model.attn_block=5 it traces the
    blockwise path, and its log-probs and gradients equal the dense learner's on the same
    packed batch."""
    from flax import nnx

    from cua_jax.models.qwen_vl import text

    traced = []
    real_blockwise = text.blockwise_attention

    def counting(*a, **kw):
        traced.append(a[3])  # the block length
        return real_blockwise(*a, **kw)

    monkeypatch.setattr(text, "blockwise_attention", counting)

    from cua_jax.rl.learner import Learner, LossConfig, OptimizerConfig
    from tests.models.tiny_learner import one_layer_config, random_text_group

    cfg = one_layer_config()
    group = random_text_group()
    learners = [
        Learner(
            qwen_vl.QwenVL(cfg.replace(attn_block=block), rngs=nnx.Rngs(0)),
            seq_len_buckets=(32,),
            loss=LossConfig(),
            optimizer=OptimizerConfig(learning_rate=1e-2),
        )
        for block in (0, 5)
    ]
    batch, _ = learners[0].prepare_batch([group])
    assert batch.shape[1] > 5 and (batch.segment_ids.max(axis=1) > 1).any()  # packed, blocked
    real = batch.segment_ids != 0
    dense = learners[0].token_logprobs(batch)
    assert traced == []
    blocked = learners[1].token_logprobs(batch)
    assert traced == [5]  # one decoder layer
    np.testing.assert_allclose(blocked[real], dense[real], rtol=1e-5, atol=1e-5)
    (_, g_dense), (_, g_blocked) = (lrn.loss_and_grads(batch) for lrn in learners)
    for a, b in zip(jax.tree.leaves(g_blocked), jax.tree.leaves(g_dense), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
