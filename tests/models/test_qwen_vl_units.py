"""Unit checks of the model's building blocks against plain-numpy references."""

import jax.numpy as jnp
import numpy as np

from cua_jax.models.qwen_vl import rope
from cua_jax.models.qwen_vl.text import make_attention_mask
from cua_jax.models.qwen_vl.vision import _chunk_keys, segment_attention


def _np_segment_attention(q, k, v, seg):
    s = np.einsum("pnh,snh->nps", q, k) / np.sqrt(q.shape[-1])
    s = np.where(seg[None, :, None] == seg[None, None, :], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("nps,snh->pnh", p, v)


def test_query_chunked_segment_attention_equals_dense_reference():
    rng = np.random.default_rng(0)
    P, N, H = 203, 2, 8  # not a multiple of the chunk: exercises the padded last chunk
    q, k, v = (rng.standard_normal((P, N, H)).astype(np.float32) for _ in range(3))
    seg = np.repeat(np.arange(5), [40, 1, 80, 50, 32]).astype(np.int32)
    want = _np_segment_attention(q, k, v, seg)
    for chunk in (64, 1024):  # chunked and single-shot paths
        got = segment_attention(
            jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(seg), chunk
        )
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


def test_key_windows_per_chunk_equal_the_all_keys_scan():
    """Many images in one batch: each query chunk scans only the keys of its own segments."""
    rng = np.random.default_rng(1)
    seg = np.repeat(np.arange(10), [40, 1, 80, 50, 32, 60, 45, 55, 30, 20]).astype(np.int32)
    P, N, H = len(seg), 2, 8
    q, k, v = (rng.standard_normal((P, N, H)).astype(np.float32) for _ in range(3))
    want = _np_segment_attention(q, k, v, seg)
    for chunk in (16, 32):
        keys = _chunk_keys(seg, chunk)
        assert keys.shape == (-(-P // chunk), 256) and int(keys.max()) >= P  # tail masked
        got = segment_attention(
            jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(seg), chunk, keys
        )
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)
    assert _chunk_keys(seg, 512) is None  # one chunk holds every query: plain scan
    split = seg.copy()
    split[-1] = 0  # segment 0 in two runs: no windows
    assert _chunk_keys(split, 16) is None


def test_chunked_vision_attention_gradients_and_memory():
    """The query-chunk bodies are rematerialised in the backward pass: gradients equal the
    one-chunk scan's, and the step holds about one chunk's scores instead of every chunk's
    (the smoke's 32-screenshot GRPO batch: 5.7 -> 1.9 GiB of scratch, BENCHMARKS.md)."""
    import jax

    rng = np.random.default_rng(2)
    sizes = [432] * 9 + [208]  # nine smoke screenshots + a padding image
    seg = jnp.asarray(np.repeat(np.arange(len(sizes)), sizes).astype(np.int32))
    P, N, H = int(seg.shape[0]), 4, 16
    q, k, v = (jnp.asarray(rng.standard_normal((P, N, H)), jnp.float32) for _ in range(3))
    w = jnp.asarray(rng.standard_normal((P, N, H)), jnp.float32)

    def loss(q, k, v, chunk, keys):
        return jnp.sum(w * segment_attention(q, k, v, seg, chunk, keys))

    keys = _chunk_keys(np.asarray(seg), 512)
    g_ref = jax.grad(loss, (0, 1, 2))(q, k, v, 8192, None)  # one chunk: no map
    g = jax.grad(loss, (0, 1, 2))(q, k, v, 512, keys)
    for a, b in zip(g, g_ref, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)

    grad_fn = jax.jit(jax.grad(lambda q, k, v: loss(q, k, v, 512, keys), (0, 1, 2)))
    temp = grad_fn.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes
    chunk_scores = N * 512 * keys.shape[1] * 4  # f32 scores of one query chunk
    # a few chunk-sized buffers (scores, probabilities and their cotangents of one chunk), not
    # all 8 chunks' residuals (~250 MiB here before the bodies were rematerialised)
    assert keys.shape[0] == 8 and temp < 5 * chunk_scores, (temp, chunk_scores)


def test_query_chunks_follow_the_image_size():
    """Equal screenshots: a query chunk is one screenshot, so its keys are that screenshot
    (rounded up to 128), not 1024 queries plus the screenshots they straddle."""
    from cua_jax.models import qwen_vl
    from cua_jax.models.qwen_vl.vision import MIN_QUERY_CHUNK, QUERY_CHUNK, vision_metadata

    grid = np.array([[1, 18, 24]] * 9 + [[1, 2, 6]])  # nine 432-patch screenshots + a small one
    meta = vision_metadata(qwen_vl.tiny("qwen3_vl"), grid)
    assert meta.full_chunk == 432 and meta.full_keys.shape == (10, 512)
    q25 = vision_metadata(qwen_vl.tiny("qwen2_5_vl"), grid)  # 16-patch windows
    assert q25.full_chunk == 432 and q25.window_chunk == MIN_QUERY_CHUNK
    one_big = vision_metadata(qwen_vl.tiny("qwen3_vl"), np.array([[1, 64, 64]]))
    assert one_big.full_chunk == QUERY_CHUNK  # 4096 patches: capped


def test_attention_mask_causal_padding_segments():
    am = np.array([[0, 1, 1, 1]])
    seg = np.array([[0, 1, 1, 2]])
    m = np.asarray(make_attention_mask(1, 4, am, seg))[0]
    want = np.array(
        [
            [0, 0, 0, 0],  # padding query: attends nowhere
            [0, 1, 0, 0],
            [0, 1, 1, 0],
            [0, 0, 0, 1],  # new segment starts fresh
        ],
        bool,
    )
    np.testing.assert_array_equal(m, want)


def test_mrope_axis_layouts():
    # Qwen2.5: contiguous blocks; Qwen3: t h w interleaved for the first 3*s frequencies
    np.testing.assert_array_equal(
        rope.mrope_axis_of_freq(16, (2, 3, 3), False), [0, 0, 1, 1, 1, 2, 2, 2]
    )
    np.testing.assert_array_equal(
        rope.mrope_axis_of_freq(16, (4, 2, 2), True), [0, 1, 2, 0, 1, 2, 0, 0]
    )


def test_vision_blocks_are_rematerialised_like_the_decoder_layers():
    """remat="full": the vision tower's gradient equals remat="none"'s, and the backward keeps
    each block's input instead of its MLP's activations: less scratch over the same screens."""
    import dataclasses

    import jax
    from flax import nnx

    from cua_jax.models import qwen_vl
    from cua_jax.models.qwen_vl.vision import vision_metadata

    cfg = qwen_vl.tiny("qwen3_vl", scale=2)
    grid = np.array([[1, 8, 8]] * 6)  # six 64-patch screens
    meta = vision_metadata(cfg, grid)
    pv = jnp.asarray(np.random.default_rng(3).standard_normal((6 * 64, 3 * 2 * 16 * 16)))
    pv = pv.astype(jnp.float32)
    out = {}
    for remat in ("none", "full"):
        model = qwen_vl.init_random(dataclasses.replace(cfg, remat=remat), seed=0)
        graphdef, state = nnx.split(model.model.visual)

        def loss(state, pv, graphdef=graphdef):
            feats, ds = nnx.merge(graphdef, state)(pv, meta)
            return jnp.sum(feats**2) + sum(jnp.sum(d**2) for d in ds)

        fn = jax.jit(jax.value_and_grad(loss))
        temp = fn.lower(state, pv).compile().memory_analysis().temp_size_in_bytes
        out[remat] = fn(state, pv), temp
    (v0, g0), t0 = out["none"]
    (v1, g1), t1 = out["full"]
    np.testing.assert_allclose(float(v1), float(v0), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert t1 < 0.8 * t0, (t1, t0)
