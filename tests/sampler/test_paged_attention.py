"""Pallas paged-attention kernel (interpret mode) vs the jnp reference vs plain numpy."""

import jax.numpy as jnp
import numpy as np
import pytest

from cua_jax.sampler.kernels.paged_attention import (
    GpuKernelOptions,
    chunk_attention_reference,
    contiguous_decode_attention,
    paged_attention,
)


def _numpy_attention(q_NH, k_SKH, v_SKH, scale):
    N, H = q_NH.shape
    K = k_SKH.shape[1]
    if k_SKH.shape[0] == 0:
        return np.zeros((N, H), np.float64)
    out = np.zeros((N, H))
    for n in range(N):
        kh = n // (N // K)
        s = k_SKH[:, kh] @ q_NH[n] * scale
        p = np.exp(s - s.max())
        out[n] = (p / p.sum()) @ v_SKH[:, kh]
    return out


def _make_case(rng, page_size, q_heads, kv_heads, lengths, head_dim=8, pages_per_seq=None):
    """Random paged K/V with shuffled page ids; every cell a sequence does not own is NaN."""
    B = len(lengths)
    P = pages_per_seq or max(1, max(-(-n // page_size) for n in lengths))
    total = 1 + B * P + 2
    k = np.full((kv_heads, total, page_size, head_dim), np.nan, np.float32)
    v = np.full_like(k, np.nan)
    perm = rng.permutation(np.arange(1, total))
    table = np.zeros((B, P), np.int32)
    contiguous = []
    for b, n in enumerate(lengths):
        kb = rng.standard_normal((n, kv_heads, head_dim)).astype(np.float32)
        vb = rng.standard_normal((n, kv_heads, head_dim)).astype(np.float32)
        contiguous.append((kb, vb))
        for p in range(P):
            table[b, p] = perm[b * P + p]
        for t in range(n):
            k[:, table[b, t // page_size], t % page_size] = kb[t]
            v[:, table[b, t // page_size], t % page_size] = vb[t]
    q = rng.standard_normal((B, q_heads, head_dim)).astype(np.float32)
    return q, k, v, table, np.asarray(lengths, np.int32), contiguous


CASES = [
    # page_size, q_heads, kv_heads, lengths (0, 1, exact page boundaries, ragged)
    (4, 4, 4, [0, 1, 4, 8, 7]),
    (4, 8, 2, [5, 12, 1, 0]),
    (8, 8, 1, [8, 16, 3, 17]),
    (16, 6, 2, [31, 32, 33, 1]),
    (1, 4, 2, [3, 1, 0]),
]


@pytest.mark.parametrize("page_size,q_heads,kv_heads,lengths", CASES)
def test_kernel_matches_reference_and_numpy(page_size, q_heads, kv_heads, lengths):
    rng = np.random.default_rng(page_size * 100 + q_heads)
    q, k, v, table, lens, contiguous = _make_case(rng, page_size, q_heads, kv_heads, lengths)
    scale = 0.37
    got = np.asarray(paged_attention(q, k, v, table, lens, scale=scale, backend="interpret"))
    ref = np.asarray(paged_attention(q, k, v, table, lens, scale=scale, backend="reference"))
    assert np.isfinite(got).all() and np.isfinite(ref).all()
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)
    for b, (kb, vb) in enumerate(contiguous):
        want = _numpy_attention(q[b].astype(np.float64), kb, vb, scale)
        np.testing.assert_allclose(ref[b], want, atol=1e-5, rtol=1e-5)
    for b, n in enumerate(lengths):
        if n == 0:
            assert (got[b] == 0).all()


def test_chunk_attention_reference_matches_numpy():
    """Prefill: queries at positions start..start+T-1 over cached prefix + the chunk itself."""
    rng = np.random.default_rng(3)
    lengths = [9, 4]
    q1, k, v, table, lens, contiguous = _make_case(rng, 4, 4, 2, lengths)
    T = 3
    q = rng.standard_normal((2, T, 4, 8)).astype(np.float32)
    pos = np.stack([np.arange(n - T, n) for n in lengths]).astype(np.int32)
    out = np.asarray(
        chunk_attention_reference(q, k, v, jnp.asarray(table), pos, jnp.asarray(lens), 0.5)
    )
    for b, (kb, vb) in enumerate(contiguous):
        for t in range(T):
            p = pos[b, t]
            want = _numpy_attention(q[b, t].astype(np.float64), kb[: p + 1], vb[: p + 1], 0.5)
            np.testing.assert_allclose(out[b, t], want, atol=1e-5, rtol=1e-5)


def test_validators_name_the_argument():
    q = np.zeros((2, 4, 8), np.float32)
    k = np.zeros((2, 5, 4, 8), np.float32)
    table = np.zeros((2, 3), np.int32)
    lens = np.zeros((2,), np.int32)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        paged_attention(np.zeros((2, 3, 8), np.float32), k, k, table, lens)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention(np.zeros((2, 4, 4), np.float32), k, k, table, lens)
    with pytest.raises(ValueError, match="lengths must be"):
        paged_attention(q, k, k, table, np.zeros((3,), np.int32))
    with pytest.raises(ValueError, match="int32"):
        paged_attention(q, k, k, table.astype(np.int64), lens)
    with pytest.raises(ValueError, match="backend"):
        paged_attention(q, k, k, table, lens, backend="cuda")


@pytest.mark.parametrize("page_size,q_heads,kv_heads,lengths", CASES)
def test_contiguous_decode_attention_matches_reference(page_size, q_heads, kv_heads, lengths):
    """The CPU decode loop's attention over pages gathered into contiguous buffers (NaN K past
    each length; V there zeroed, as the engine does once per chunk) == the paged reference."""
    rng = np.random.default_rng(page_size * 7 + kv_heads)
    q, k, v, table, lens, _ = _make_case(rng, page_size, q_heads, kv_heads, lengths)
    B, P = table.shape
    H = k.shape[-1]
    k_g = k[:, table].reshape(kv_heads, B, P * page_size, H)  # NaN past each length
    v_g = v[:, table].reshape(kv_heads, B, P * page_size, H)
    live = np.arange(P * page_size)[None, :] < lens[:, None]
    v_g = np.where(live[None, :, :, None], v_g, 0.0)
    got = np.asarray(
        contiguous_decode_attention(
            q, np.transpose(k_g, (1, 0, 3, 2)), np.transpose(v_g, (1, 0, 2, 3)), lens, 0.37
        )
    )
    ref = np.asarray(paged_attention(q, k, v, table, lens, scale=0.37, backend="reference"))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)


OPTION_CASES = [
    # pages_per_block over: a block with pages past the table's end (P=3 with 2 per block), an
    # empty sequence, exact page boundaries; all unused cells NaN.
    ("pages_per_block=2", 4, 8, 2, [0, 1, 4, 8, 12, 9]),
    ("pages_per_block=4", 8, 8, 1, [8, 16, 3, 17, 0]),
    ("pages_per_block=3,f32_dots=false", 4, 4, 2, [5, 12, 1, 0, 11]),
]


@pytest.mark.parametrize("spec,page_size,q_heads,kv_heads,lengths", OPTION_CASES)
def test_kernel_options_match_reference(spec, page_size, q_heads, kv_heads, lengths):
    """Every GPU tuning knob the bench sweeps computes the same attention (interpret mode)."""
    rng = np.random.default_rng(len(spec) + page_size)
    q, k, v, table, lens, _ = _make_case(rng, page_size, q_heads, kv_heads, lengths)
    opts = GpuKernelOptions.parse(spec)
    got = np.asarray(
        paged_attention(q, k, v, table, lens, scale=0.3, backend="interpret", gpu_options=opts)
    )
    ref = np.asarray(paged_attention(q, k, v, table, lens, scale=0.3, backend="reference"))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("f32_dots", [True, False])
def test_kernel_bf16_pages_within_bf16_rounding(f32_dots):
    """bf16 K/V: f32 dots match the reference to f32 rounding; bf16 dots (probabilities rounded
    to bf16 before the V product, as flash attention does) to bf16 rounding."""
    rng = np.random.default_rng(11)
    q, k, v, table, lens, _ = _make_case(rng, 8, 8, 2, [40, 17, 8, 1], head_dim=16)
    q, k, v = (jnp.asarray(np.nan_to_num(x), jnp.bfloat16) for x in (q, k, v))
    opts = GpuKernelOptions(pages_per_block=2, f32_dots=f32_dots)
    got = np.asarray(
        paged_attention(q, k, v, table, lens, scale=0.25, backend="interpret", gpu_options=opts)
    )
    ref = np.asarray(paged_attention(q, k, v, table, lens, scale=0.25, backend="reference"))
    tol = 1e-5 if f32_dots else 2e-2
    np.testing.assert_allclose(got, ref, atol=tol, rtol=tol)
    if not f32_dots:
        assert np.abs(got - ref).max() > 0  # the bf16 path really is a different computation


def test_kernel_options_parse():
    assert GpuKernelOptions.parse("") == GpuKernelOptions()
    o = GpuKernelOptions.parse(" pages_per_block=4 , f32_dots=false,num_warps=8,num_stages=none")
    assert o == GpuKernelOptions(pages_per_block=4, f32_dots=False, num_warps=8, num_stages=None)
    assert GpuKernelOptions.parse(str(o)) == o
    for bad, match in [
        ("pages=4", "names"),
        ("pages_per_block", "name=value"),
        ("f32_dots=maybe", "true or false"),
        ("num_warps=eight", "integer"),
        ("pages_per_block=0", ">= 1"),
        ("pages_per_block=none", "integer"),
    ]:
        with pytest.raises(ValueError, match=match):
            GpuKernelOptions.parse(bad)
