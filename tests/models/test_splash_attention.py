"""The learner's splash attention (`model.attn_impl="splash"`) against the dense path.

Reference: `dense_attention` with `make_attention_mask` (checked against transformers in
test_qwen_vl_parity.py). The kernel is JAX's Pallas TPU splash attention, run here in Pallas
interpret mode (the TPU compile itself is tools/plan.py's business). Real query rows (segment id
!= 0) must get the dense outputs and gradients, on one device and under shard_map on a forced
fsdp=2 x tensor=2 mesh; padding rows are not compared (they attend among themselves).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cua_jax import sharding as shd
from cua_jax.models import qwen_vl
from cua_jax.models.qwen_vl.text import dense_attention, make_attention_mask, splash_attention

B, T, N, K, H = 2, 256, 4, 2, 32
BLOCK = 128
# row 0: three packed segments then padding; row 1: one segment, then padding
SEGMENTS = np.zeros((B, T), np.int32)
SEGMENTS[0, :90], SEGMENTS[0, 90:200], SEGMENTS[0, 200:230] = 1, 2, 3
SEGMENTS[1, :170] = 1
REAL = SEGMENTS != 0


def _qkv(seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(B, T, N, H), (B, T, K, H), (B, T, K, H)]
    return [jnp.asarray(rng.normal(size=s).astype(np.float32)) for s in shapes]


def _loss(fn):
    w = jnp.asarray(REAL[:, :, None, None] * np.random.default_rng(1).normal(size=(B, T, N, H)))
    return lambda *a: jnp.sum(fn(*a) * w)  # real rows only


def _dense(q, k, v):
    return dense_attention(q, k, v, make_attention_mask(B, T, None, jnp.asarray(SEGMENTS)))


def _mesh():
    return shd.make_mesh(1, 2, 2, devices=jax.devices()[:4])


@pytest.mark.parametrize("on_mesh", [False, True], ids=["one_device", "fsdp2_tensor2"])
def test_splash_equals_dense_with_gradients(on_mesh):
    q, k, v = _qkv()
    mesh = _mesh() if on_mesh else None
    seg = jnp.asarray(SEGMENTS)

    def splash(q, k, v):
        return splash_attention(q, k, v, BLOCK, None, seg, mesh, shd.DEFAULT_RULES)

    out = jax.jit(splash)(q, k, v)
    np.testing.assert_allclose(
        np.asarray(out)[REAL], np.asarray(_dense(q, k, v))[REAL], rtol=1e-5, atol=1e-5
    )
    g_splash = jax.jit(jax.grad(_loss(splash), argnums=(0, 1, 2)))(q, k, v)
    g_dense = jax.grad(_loss(_dense), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g_splash, g_dense, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_attention_mask_alone_becomes_segments():
    """model(..., attention_mask=) without segment ids: real tokens attend to real keys only."""
    q, k, v = _qkv(3)
    am = jnp.asarray(REAL.astype(np.int32))
    out = splash_attention(q, k, v, BLOCK, am, None)
    ref = dense_attention(q, k, v, make_attention_mask(B, T, am, None))
    np.testing.assert_allclose(np.asarray(out)[REAL], np.asarray(ref)[REAL], rtol=1e-5, atol=1e-5)


def test_a_row_length_off_the_block_is_refused_by_name():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="multiple of its block 96"):
        splash_attention(q, k, v, 96, None, jnp.asarray(SEGMENTS))
    with pytest.raises(ValueError, match="a multiple of 128"):
        splash_attention(q, k, v, 64, None, jnp.asarray(SEGMENTS))
    with pytest.raises(ValueError, match="attn_impl='flash'"):
        qwen_vl.tiny("qwen3_vl", vocab_size=256).replace(attn_impl="flash")


def test_the_learner_on_a_forced_mesh_gives_the_one_device_dense_logprobs(monkeypatch):
    """The learner (packed rows, fsdp=2 x tensor=2) with attn_impl="splash" and with
    attn_block=32 (blockwise) gives the log-probs and gradients of the 1-device dense learner;
    the splash kernel runs on the learner's mesh (shard_map), not on one device."""
    from cua_jax.models.qwen_vl import text
    from cua_jax.rl.learner import Learner, LossConfig, OptimizerConfig

    meshes = []
    real_splash = text.splash_attention

    def recording(*a, **kw):
        meshes.append(a[6])  # the mesh argument
        return real_splash(*a, **kw)

    monkeypatch.setattr(text, "splash_attention", recording)
    from tests.models.tiny_learner import one_layer_config, random_text_group

    cfg = one_layer_config()
    group = random_text_group(prompt_len=(10, 30), gen_len=(5, 20))

    def learner(mesh, **model_options):
        return Learner(
            qwen_vl.QwenVL(cfg.replace(**model_options), rngs=nnx.Rngs(0)),
            mesh=mesh,
            seq_len_buckets=(128,),
            loss=LossConfig(),
            optimizer=OptimizerConfig(learning_rate=1e-2),
        )

    one = learner(None)
    batch, _ = one.prepare_batch([group], num_rows=2)
    assert batch.shape[1] == 128 and (batch.segment_ids.max(axis=1) > 1).any()  # packed
    real = batch.segment_ids != 0
    ref = one.token_logprobs(batch)
    (_, g_ref) = one.loss_and_grads(batch)
    for options in (dict(attn_impl="splash", attn_block=128), dict(attn_block=32)):
        sharded = learner(_mesh(), **options)
        got = sharded.token_logprobs(batch)
        np.testing.assert_allclose(got[real], ref[real], rtol=1e-5, atol=1e-5, err_msg=str(options))
        (_, g) = sharded.loss_and_grads(batch)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    assert meshes and all(m is not None and m.shape["tensor"] == 2 for m in meshes)
