"""The gated delta rule, causal conv and gated RMSNorm of Qwen3.5's Gated DeltaNet
(cua_jax/models/qwen_vl/gated_delta/reference.py) against transformers' torch references, and
the chunked form against the recurrent one, on random f32 inputs.

Shapes: 2 q/k heads serving 4 value heads (grouped), q/k head dim 16 != value head dim 8, so a
transposed state or a wrong head grouping cannot pass. Tolerance 2e-5 absolute on outputs of
scale ~0.1-1 (each check also asserts that scale).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf  # noqa: E402

from cua_jax.models.qwen_vl.gated_delta import reference as ref  # noqa: E402

B, M, N, H, V = 2, 2, 4, 16, 8
TOL = 2e-5
chunked = jax.jit(ref.chunk_gated_delta_rule, static_argnames=("chunk_size", "use_qk_l2norm"))
recurrent = jax.jit(ref.recurrent_gated_delta_rule, static_argnames="use_qk_l2norm")
conv = jax.jit(ref.causal_conv1d)


def _inputs(T: int, gates: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, M, H)).astype(np.float32)
    k = rng.standard_normal((B, T, M, H)).astype(np.float32)
    v = rng.standard_normal((B, T, N, V)).astype(np.float32)
    if gates == "random":
        g = -rng.uniform(0.0, 0.3, (B, T, N))
        beta = rng.uniform(0.0, 1.0, (B, T, N))
    else:  # decay factors exp(g) and beta at ~0 and ~1, mixed per token and head
        g = rng.choice([-30.0, -1e-4, -0.5], (B, T, N))
        beta = rng.choice([1e-4, 1.0 - 1e-4, 0.5], (B, T, N))
    s0 = rng.standard_normal((B, N, H, V)).astype(np.float32) * 0.5
    return q, k, v, g.astype(np.float32), beta.astype(np.float32), s0


def _torch(fn, q, k, v, g, beta, s0, **kw):
    t = [torch.from_numpy(np.asarray(x)) for x in (q, k, v, g, beta, s0)]
    o, s = fn(
        *t[:3],
        g=t[3],
        beta=t[4],
        initial_state=t[5],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        **kw,
    )
    return o.numpy(), s.numpy()


def _close(a, b, tol=TOL):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    err = float(np.max(np.abs(a - b)))
    assert err <= tol, f"max abs diff {err} > {tol}"


@pytest.mark.parametrize(
    "T,chunk,gates",
    [(150, 64, "random"), (37, 16, "extreme")],
    ids=["T150_L64", "T37_L16_extreme_gates"],
)
def test_chunked_and_recurrent_equal_transformers(T, chunk, gates):
    q, k, v, g, beta, s0 = _inputs(T, gates)
    o_ref, s_ref = _torch(hf.torch_recurrent_gated_delta_rule, q, k, v, g, beta, s0)
    o_hfc, s_hfc = _torch(hf.torch_chunk_gated_delta_rule, q, k, v, g, beta, s0, chunk_size=chunk)
    assert np.abs(o_ref).max() > 0.1 and np.abs(s_ref).max() > 0.3
    _close(o_hfc, o_ref), _close(s_hfc, s_ref)  # the two torch forms agree too

    o_r, s_r = recurrent(q, k, v, g, beta, initial_state=s0)
    o_c, s_c = chunked(q, k, v, g, beta, initial_state=s0, chunk_size=chunk)
    _close(o_r, o_ref), _close(s_r, s_ref)
    _close(o_c, o_ref), _close(s_c, s_ref)
    _close(o_c, o_r), _close(s_c, s_r)


def test_without_initial_state_and_without_l2norm():
    q, k, v, g, beta, _ = _inputs(40, "random", seed=1)
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)  # the un-normalised rule needs |k| <= 1
    t = [torch.from_numpy(x) for x in (q, k, v, g, beta)]
    o_t, s_t = hf.torch_chunk_gated_delta_rule(
        *t[:3], g=t[3], beta=t[4], output_final_state=True, chunk_size=16
    )
    o_c, s_c = chunked(q, k, v, g, beta, chunk_size=16, use_qk_l2norm=False)
    o_r, s_r = recurrent(q, k, v, g, beta, use_qk_l2norm=False)
    _close(o_c, o_t.numpy(), 1e-4), _close(s_c, s_t.numpy(), 1e-4)
    _close(o_r, o_t.numpy(), 1e-4), _close(s_r, s_t.numpy(), 1e-4)


# A packed row: sample A (23 tokens, continuing the initial state), sample B (41 tokens, from
# zero), 6 padding tokens (id 0). Sample B crosses the chunk boundary at 32 and at 64.
LENS = (23, 41, 6)
SEG = np.concatenate([np.full(n, i, np.int32) for i, n in zip((1, 2, 0), LENS, strict=True)])


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_packed_row_equals_its_samples_run_alone(form):
    T = sum(LENS)
    q, k, v, g, beta, s0 = _inputs(T, "random", seed=2)
    seg = np.broadcast_to(SEG, (B, T))

    def run(sl, init, segment_ids=None):
        args = [x[:, sl] for x in (q, k, v, g, beta)]
        if form == "chunked":
            return chunked(*args, initial_state=init, segment_ids=segment_ids, chunk_size=16)
        return recurrent(*args, initial_state=init, segment_ids=segment_ids)

    o, s = run(slice(None), s0, seg)
    a, b = LENS[0], LENS[0] + LENS[1]
    o_a, _ = run(slice(0, a), s0)
    o_b, _ = run(slice(a, b), None)
    _, s_pad = run(slice(b, None), None)
    _close(o[:, :a], o_a), _close(o[:, a:b], o_b)
    _close(s, s_pad)  # the final state is the last segment's (padding from zero)
    # without the reset, sample B would see sample A's state: the check above is not vacuous
    o_no_reset, _ = run(slice(None), s0)
    assert np.abs(np.asarray(o_no_reset[:, a:b]) - np.asarray(o_b)).max() > 1e-2


def test_chunked_gradients_equal_recurrent():
    T = 37
    q, k, v, g, beta, s0 = _inputs(T, "random", seed=3)
    seg = np.broadcast_to(np.repeat(np.array([1, 2], np.int32), [15, 22]), (B, T))
    w = np.random.default_rng(4).standard_normal((B, T, N, V)).astype(np.float32)

    def loss(fn, **kw):
        def f(q, k, v, g, beta, s0):
            o, s = fn(q, k, v, g, beta, initial_state=s0, segment_ids=seg, **kw)
            return jnp.sum(o * w) + jnp.sum(s * s)

        return jax.jit(jax.grad(f, argnums=range(6)))(q, k, v, g, beta, s0)

    for a, b in zip(
        loss(ref.chunk_gated_delta_rule, chunk_size=16),
        loss(ref.recurrent_gated_delta_rule),
        strict=True,
    ):
        assert np.abs(np.asarray(b)).max() > 1e-2
        _close(a, b, 1e-4)


# ------------------------------------------------------------------------- conv and norm
def test_causal_conv_prefill_then_steps_equal_transformers():
    rng = np.random.default_rng(5)
    C, W, T, P = 12, 4, 9, 5
    x = rng.standard_normal((B, T, C)).astype(np.float32)
    w = rng.standard_normal((C, W)).astype(np.float32)
    xt, wt = torch.from_numpy(x).transpose(1, 2), torch.from_numpy(w)
    y_full = hf.causal_conv1d_fn(xt, wt, None, activation=None).transpose(1, 2).numpy()

    y, state = conv(x, w)
    _close(y, y_full, 1e-5)
    _close(state, x[:, -(W - 1) :], 0)

    # prefill P tokens, then one token at a time against transformers' update (state of W)
    y_p, state = conv(x[:, :P], w)
    hf_state = torch.nn.functional.pad(xt[:, :, :P], (W - P, 0))[:, :, -W:].contiguous()
    outs = [np.asarray(y_p)]
    for t in range(P, T):
        y_t, state = conv(x[:, t : t + 1], w, conv_state=state)
        y_hf = hf.causal_conv1d_update(xt[:, :, t : t + 1], hf_state, wt, None, None)
        _close(y_t, y_hf.transpose(1, 2).numpy(), 1e-5)
        _close(state, hf_state.transpose(1, 2).numpy()[:, 1:], 0)  # its oldest is never read
        outs.append(np.asarray(y_t))
    _close(np.concatenate(outs, axis=1), y_full, 1e-5)


def test_causal_conv_resets_at_segment_changes():
    rng = np.random.default_rng(6)
    C, W = 6, 4
    seg = np.array([[3, 3, 3, 3, 3, 7, 7], [1, 1, 2, 0, 0, 0, 0]], np.int32)
    x = rng.standard_normal((2, 7, C)).astype(np.float32)
    w = rng.standard_normal((C, W)).astype(np.float32)
    s0 = rng.standard_normal((2, W - 1, C)).astype(np.float32)
    y, state = conv(x, w, conv_state=s0, segment_ids=seg)
    for b in range(2):
        starts = [0] + [t for t in range(1, 7) if seg[b, t] != seg[b, t - 1]] + [7]
        for i, (lo, hi) in enumerate(zip(starts[:-1], starts[1:], strict=True)):
            init = s0[b : b + 1] if i == 0 else None  # the initial state continues segment 1
            y_alone, st_alone = conv(x[b : b + 1, lo:hi], w, conv_state=init)
            _close(y[b : b + 1, lo:hi], y_alone, 1e-6)
        _close(state[b : b + 1], st_alone, 0)  # the state holds the last segment only
    # row 0's second segment has 2 tokens: its state is [0, x5, x6]
    assert np.all(np.asarray(state)[0, 0] == 0) and np.all(np.asarray(state)[0, 1:] == x[0, 5:])


def test_gated_rmsnorm_equals_transformers():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 5, V)).astype(np.float32) * 3
    z = rng.standard_normal((3, 5, V)).astype(np.float32) * 2
    w = rng.standard_normal((V,)).astype(np.float32)
    norm = hf.Qwen3_5RMSNormGated(V, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(w))
        want = norm(torch.from_numpy(x), torch.from_numpy(z)).numpy()
    _close(ref.gated_rmsnorm(x, z, w, 1e-6), want, 1e-5)
