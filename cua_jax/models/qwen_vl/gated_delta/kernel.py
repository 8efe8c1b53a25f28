"""The chunked gated delta rule as a Pallas TPU kernel (reference: `reference.py`).

Grid (B, N, S): program (b, n, s) takes chunk s of value head n of row b; the chunk axis is
sequential ("arbitrary") and the [H, V] state lives in a VMEM scratch across it, so the state
never goes to HBM between chunks. Per chunk, everything is 2-D matmuls:

    D  = exp(c_i - c_j) on the same-segment causal part, 0 elsewhere      [L, L]
    A  = tril(beta k k^T * D, -1),  T = (I + A)^-1 = prod_j (I + (-A)^(2^j))   (A nilpotent)
    U  = T (beta v) - T (beta gamma k) S
    O  = (gamma q) S + (q k^T * D) U,   S <- keep * S + (k * exp(c_L - c))^T U

The inverse by repeated squaring (log2 L matmul pairs) replaces the triangular solve, which has
no Pallas lowering. The wrapper does the elementwise work outside (q/k L2 norm, head grouping,
padding to whole chunks, the chunk-local cumulative log-decay c and the segment index r) and
hands c and r in both orientations, column [L, 1] and row [1, L], so the kernel needs no
transpose. Letters as in `reference.py`.

The backward is a Pallas kernel too (`chunk_gated_delta_rule_trainable`, what the model calls
with model.gated_delta_impl="pallas"): the forward kernel then also writes each chunk's incoming
state to HBM ([B, N, S, H, V] f32, the only residual beyond the inputs), and the backward kernel
walks the chunks last to first with the state's gradient in a VMEM scratch, recomputing each
chunk's U, T and D from its saved state (`_chunk_bwd_kernel`). JAX differentiates the
elementwise work around the kernels (`_chunked`). Against the reference's VJP it keeps no
per-chunk [L, L] array in HBM: a Qwen3.5 layer's gradient at T=16384 compiles to 3.8 GiB of
temporaries against 4.9 GiB and a third of the bytes accessed (BENCHMARKS.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from cua_jax.models.qwen_vl.gated_delta.reference import (
    CHUNK,
    _initial_state,
    _prepare,
    segment_index,
)

_NT = (((1,), (1,)), ((), ()))  # x @ y^T
_TN = (((0,), (0,)), ((), ()))  # x^T @ y


def _dot(x, y, dims=None):
    if dims is None:
        return jnp.dot(x, y, preferred_element_type=jnp.float32)
    return jax.lax.dot_general(x, y, dims, preferred_element_type=jnp.float32)


def _chunk_kernel(
    q_ref,
    k_ref,
    v_ref,
    beta_ref,
    c_col_ref,
    c_row_ref,
    r_col_ref,
    r_row_ref,
    r_in_ref,
    s0_ref,
    o_ref,
    s_out_ref,
    *rest,
):
    *states_ref, s_scr = rest  # states_ref: [chunk-start state] when the backward needs them
    s = pl.program_id(2)
    L = q_ref.shape[0]

    @pl.when(s == 0)
    def _():
        s_scr[...] = s0_ref[...]

    if states_ref:
        states_ref[0][...] = s_scr[...]

    q, k, v, beta = q_ref[...], k_ref[...], v_ref[...], beta_ref[...]  # [L,H] [L,H] [L,V] [L,1]
    c_col, c_row = c_col_ref[...], c_row_ref[...]  # [L, 1], [1, L]
    r_col, r_row, r_in = r_col_ref[...], r_row_ref[...], r_in_ref[...]  # [L,1] [1,L] [1,1]
    row = jax.lax.broadcasted_iota(jnp.int32, (L, L), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (L, L), 1)
    same = r_col == r_row  # [L, L]
    D = jnp.exp(jnp.where((row >= col) & same, c_col - c_row, -jnp.inf))
    gamma = jnp.where(r_col == r_in, jnp.exp(c_col), 0.0)  # [L, 1]
    c_last, r_last = c_col[L - 1 :, :], r_col[L - 1 :, :]  # [1, 1]
    to_end = jnp.exp(jnp.where(r_col == r_last, c_last - c_col, -jnp.inf))  # [L, 1]
    keep = jnp.where(r_last == r_in, jnp.exp(c_last), 0.0)  # [1, 1]

    kb = k * beta
    eye = (row == col).astype(jnp.float32)
    P = -jnp.where(row > col, _dot(kb, k, _NT) * D, 0.0)
    Tinv = eye + P
    power = 2
    while power < L:  # (I + P)(I + P^2)(I + P^4)... = sum_{i < 2L} P^i, and P^L = 0
        P = _dot(P, P)
        Tinv = _dot(Tinv, eye + P)
        power *= 2
    u0 = _dot(Tinv, v * beta)
    w = _dot(Tinv, kb * gamma)
    S = s_scr[...]  # [H, V]
    U = u0 - _dot(w, S)
    attn = _dot(q, k, _NT) * D
    o_ref[...] = (_dot(q * gamma, S) + _dot(attn, U)).astype(o_ref.dtype)
    S = S * keep + _dot(k * to_end, U, _TN)
    s_scr[...] = S

    @pl.when(s == pl.num_programs(2) - 1)
    def _():
        s_out_ref[...] = S


def _chunked(q_BTMH, k_BTMH, v_BTNV, g_BTN, beta_BTN, segment_ids, L, use_qk_l2norm):
    """The kernels' inputs (differentiable jnp): q, k [B, N, S*L, H], v [B, N, S*L, V], beta
    [B, N, S*L] (padded to whole chunks), the chunk-local cumulative log-decay c [B, N, S, L],
    the segment index as f32 r [B, S, L] and the incoming state's index r_in [B, S]."""
    if L < 2 or L & (L - 1):
        raise ValueError(f"chunk_size={L} must be a power of two >= 2")
    B, T = q_BTMH.shape[:2]
    N = v_BTNV.shape[2]
    q, k, v, g, beta = _prepare(q_BTMH, k_BTMH, v_BTNV, g_BTN, beta_BTN, use_qk_l2norm)
    r_BT = segment_index(segment_ids, B, T)
    pad = -T % L
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q, k, v))
        g, beta = (jnp.pad(x, ((0, 0), (0, 0), (0, pad))) for x in (g, beta))
        r_BT = jnp.pad(r_BT, ((0, 0), (0, pad)), mode="edge")
    S_ = (T + pad) // L
    c = jnp.cumsum(g.reshape(B, N, S_, L), axis=-1)
    r_f = r_BT.astype(jnp.float32).reshape(B, S_, L)  # small integers: exact in f32
    r_in = jnp.concatenate([r_f[:, :1, 0], r_f[:, :-1, -1]], axis=1)  # [B, S]
    return q, k, v, beta, c, r_f, r_in


def _chunk_specs(B, N, S_, L, H, V, reverse=False):
    """BlockSpecs of the per-chunk inputs both kernels read, in `_chunk_args`' order, and a
    maker of [B, N, S*L, d] token blocks; `reverse`: the grid walks the chunks last to first."""

    def at(s):
        return S_ - 1 - s if reverse else s

    def tok(d):  # a chunk of [B, N, S*L, d]
        return pl.BlockSpec((None, None, L, d), lambda b, n, s: (b, n, at(s), 0))

    specs = [
        tok(H),  # q
        tok(H),  # k
        tok(V),  # v
        tok(1),  # beta
        tok(1),  # c column [B, N, S*L, 1]
        pl.BlockSpec((None, None, None, 1, L), lambda b, n, s: (b, n, at(s), 0, 0)),  # c row
        pl.BlockSpec((None, L, 1), lambda b, n, s: (b, at(s), 0)),  # r column [B, S*L, 1]
        pl.BlockSpec((None, None, 1, L), lambda b, n, s: (b, at(s), 0, 0)),  # r row [B,S,1,L]
        pl.BlockSpec((None, None, 1, 1), lambda b, n, s: (b, at(s), 0, 0)),  # r_in [B,S,1,1]
    ]
    state = pl.BlockSpec((None, None, H, V), lambda b, n, s: (b, n, 0, 0))  # [B, N, H, V]
    chunk_state = pl.BlockSpec((None, None, None, H, V), lambda b, n, s: (b, n, at(s), 0, 0))
    return specs, tok, state, chunk_state


def _chunk_args(q, k, v, beta, c, r_f, r_in):
    B, N, S_, L = c.shape
    return (
        q,
        k,
        v,
        beta[..., None],
        c.reshape(B, N, S_ * L, 1),
        c[..., None, :],
        r_f.reshape(B, S_ * L, 1),
        r_f[:, :, None, :],
        r_in[:, :, None, None],
    )


_PARAMS = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))


def _forward(q, k, v, beta, c, r_f, r_in, s0, *, interpret, save_states=False):
    """(o f32[B, N, S*L, V], final state f32[B, N, H, V]) [+ each chunk's incoming state
    f32[B, N, S, H, V] with `save_states`], one pallas_call."""
    B, N, S_, L = c.shape
    H, V = q.shape[-1], v.shape[-1]
    specs, tok, state, chunk_state = _chunk_specs(B, N, S_, L, H, V)
    out_specs = [tok(V), state]
    out_shape = [
        jax.ShapeDtypeStruct((B, N, S_ * L, V), jnp.float32),
        jax.ShapeDtypeStruct((B, N, H, V), jnp.float32),
    ]
    if save_states:
        out_specs.append(chunk_state)
        out_shape.append(jax.ShapeDtypeStruct((B, N, S_, H, V), jnp.float32))
    return pl.pallas_call(
        _chunk_kernel,
        grid=(B, N, S_),
        in_specs=[*specs, state],
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((H, V), jnp.float32)],
        compiler_params=_PARAMS,
        interpret=interpret,
    )(*_chunk_args(q, k, v, beta, c, r_f, r_in), s0)


@functools.partial(jax.jit, static_argnames=("chunk_size", "use_qk_l2norm", "interpret"))
def chunk_gated_delta_rule(
    q_BTMH: jax.Array,
    k_BTMH: jax.Array,
    v_BTNV: jax.Array,
    g_BTN: jax.Array,
    beta_BTN: jax.Array,
    *,
    initial_state: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    chunk_size: int = CHUNK,
    use_qk_l2norm: bool = True,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """`reference.chunk_gated_delta_rule` (same arguments and results) as one pallas_call.

    interpret=True runs the kernel in Pallas' interpreter (CPU tests). On TPU, L (chunk_size)
    should be a multiple of 8, and H and V multiples of 128 or the whole dim."""
    B, T, _, H = q_BTMH.shape
    N, V = v_BTNV.shape[2:]
    args = _chunked(q_BTMH, k_BTMH, v_BTNV, g_BTN, beta_BTN, segment_ids, chunk_size, use_qk_l2norm)
    s0 = _initial_state(initial_state, B, N, H, V)
    o, S = _forward(*args, s0, interpret=interpret)
    return jnp.swapaxes(o[:, :, :T], 1, 2).astype(v_BTNV.dtype), S


def _chunk_bwd_kernel(
    q_ref,
    k_ref,
    v_ref,
    beta_ref,
    c_col_ref,
    c_row_ref,
    r_col_ref,
    r_row_ref,
    r_in_ref,
    s_ref,
    do_ref,
    ds_last_ref,
    dq_ref,
    dk_ref,
    dv_ref,
    dbeta_ref,
    dc_ref,
    ds0_ref,
    ds_scr,
):
    """Chunk s of the grid is chunk S-1-s of the row: the gradient of the state flows from the
    last chunk to the first in the [H, V] scratch. Recomputes the chunk's forward from its
    incoming state (saved by the forward), then differentiates it (letters of the module
    docstring; dX is the gradient of X):

        dU = (q k^T * D)^T dO + (k * to_end) dS'            dS = keep dS' + (gamma q)^T dO - w^T dU
        dT = dU (beta v)^T - dU S^T (beta gamma k)^T        dA = -T^T dT T^T  (strictly lower)

    and the chain through A = tril(beta k k^T * D, -1), D = exp(c_i - c_j), gamma = exp(c),
    to_end = exp(c_L - c) and keep = exp(c_L) to dq, dk, dv, dbeta and dc (c's gradient; the
    wrapper's cumsum takes it to g)."""
    s = pl.program_id(2)
    L = q_ref.shape[0]

    @pl.when(s == 0)
    def _():
        ds_scr[...] = ds_last_ref[...]

    q, k, v, beta = q_ref[...], k_ref[...], v_ref[...], beta_ref[...]
    c_col, c_row = c_col_ref[...], c_row_ref[...]
    r_col, r_row, r_in = r_col_ref[...], r_row_ref[...], r_in_ref[...]
    row = jax.lax.broadcasted_iota(jnp.int32, (L, L), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (L, L), 1)
    same = r_col == r_row
    D = jnp.exp(jnp.where((row >= col) & same, c_col - c_row, -jnp.inf))
    gamma = jnp.where(r_col == r_in, jnp.exp(c_col), 0.0)
    c_last, r_last = c_col[L - 1 :, :], r_col[L - 1 :, :]
    to_end = jnp.exp(jnp.where(r_col == r_last, c_last - c_col, -jnp.inf))
    keep = jnp.where(r_last == r_in, jnp.exp(c_last), 0.0)

    # the chunk's forward again
    kb = k * beta
    eye = (row == col).astype(jnp.float32)
    KK = _dot(kb, k, _NT)
    lower = row > col
    P = -jnp.where(lower, KK * D, 0.0)
    Tinv = eye + P
    power = 2
    while power < L:
        P = _dot(P, P)
        Tinv = _dot(Tinv, eye + P)
        power *= 2
    x, y = v * beta, kb * gamma
    w = _dot(Tinv, y)
    S = s_ref[...]
    U = _dot(Tinv, x) - _dot(w, S)
    qk = _dot(q, k, _NT)
    kend = k * to_end

    # O = (gamma q) S + (q k^T * D) U,  S' = keep S + (k * to_end)^T U
    dO, dSn = do_ref[...], ds_scr[...]
    dU = _dot(qk * D, dO, _TN) + _dot(kend, dSn)
    dattn = _dot(dO, U, _NT)
    dqg = _dot(dO, S, _NT)
    dS = keep * dSn + _dot(q * gamma, dO, _TN)
    dgamma = jnp.sum(dqg * q, axis=1, keepdims=True)
    dqk = dattn * D
    dq = dqg * gamma + _dot(dqk, k)
    dk = _dot(dqk, q, _TN)
    dD = dattn * qk
    dkend = _dot(U, dSn, _NT)
    dk = dk + dkend * to_end
    dto_end = jnp.sum(dkend * k, axis=1, keepdims=True)
    dkeep = jnp.sum(jnp.sum(S * dSn, axis=1, keepdims=True), axis=0, keepdims=True)  # [1, 1]
    # U = T x - w S, w = T y
    dw = -_dot(dU, S, _NT)
    dS = dS - _dot(w, dU, _TN)
    dx = _dot(Tinv, dU, _TN)
    dy = _dot(Tinv, dw, _TN)
    dT = _dot(dU, x, _NT) + _dot(dw, y, _NT)
    dA = -jnp.where(lower, _dot(_dot(Tinv, dT, _TN), Tinv, _NT), 0.0)
    # A = (beta k k^T) * D on the strictly lower part
    dKK = dA * D
    dD = dD + dA * KK
    dkb = _dot(dKK, k) + dy * gamma
    dk = dk + _dot(dKK, kb, _TN) + dkb * beta
    dgamma = dgamma + jnp.sum(dy * kb, axis=1, keepdims=True)
    dv_ref[...] = dx * beta
    dbeta_ref[...] = jnp.sum(dx * v, axis=1, keepdims=True) + jnp.sum(
        dkb * k, axis=1, keepdims=True
    )
    # c: D_ij = exp(c_i - c_j), gamma = exp(c), to_end = exp(c_L - c), keep = exp(c_L)
    G = dD * D
    ones = jnp.ones((L, 1), jnp.float32)
    dc = jnp.sum(G, axis=1, keepdims=True) - _dot(G, ones, _TN)
    te = dto_end * to_end
    dc = dc + dgamma * gamma - te
    at_last = jax.lax.broadcasted_iota(jnp.int32, (L, 1), 0) == L - 1
    to_last = jnp.sum(te, axis=0, keepdims=True) + dkeep * keep  # [1, 1]
    dc_ref[...] = jnp.where(at_last, dc + to_last, dc)
    dq_ref[...] = dq
    dk_ref[...] = dk
    ds_scr[...] = dS

    @pl.when(s == pl.num_programs(2) - 1)
    def _():
        ds0_ref[...] = dS


def _backward(q, k, v, beta, c, r_f, r_in, states, do, ds_last, *, interpret):
    """(dq, dk, dv, dbeta, dc, ds0) of the chunked rule, one pallas_call over the chunks in
    reverse."""
    B, N, S_, L = c.shape
    H, V = q.shape[-1], v.shape[-1]
    specs, tok, state, chunk_state = _chunk_specs(B, N, S_, L, H, V, reverse=True)

    def f32(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32)

    T_ = S_ * L
    dq, dk, dv, dbeta, dc, ds0 = pl.pallas_call(
        _chunk_bwd_kernel,
        grid=(B, N, S_),
        in_specs=[*specs, chunk_state, tok(V), state],
        out_specs=[tok(H), tok(H), tok(V), tok(1), tok(1), state],
        out_shape=[
            f32(B, N, T_, H),
            f32(B, N, T_, H),
            f32(B, N, T_, V),
            f32(B, N, T_, 1),
            f32(B, N, T_, 1),
            f32(B, N, H, V),
        ],
        scratch_shapes=[pltpu.VMEM((H, V), jnp.float32)],
        compiler_params=_PARAMS,
        interpret=interpret,
    )(*_chunk_args(q, k, v, beta, c, r_f, r_in), states, do, ds_last)
    return dq, dk, dv, dbeta[..., 0], dc.reshape(B, N, S_, L), ds0


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _core(q, k, v, beta, c, r_f, r_in, s0, interpret):
    return tuple(_forward(q, k, v, beta, c, r_f, r_in, s0, interpret=interpret))


def _core_fwd(q, k, v, beta, c, r_f, r_in, s0, interpret):
    o, S, states = _forward(q, k, v, beta, c, r_f, r_in, s0, interpret=interpret, save_states=True)
    return (o, S), (q, k, v, beta, c, r_f, r_in, states)


def _core_bwd(interpret, res, cts):
    q, k, v, beta, c, r_f, r_in, states = res
    do, ds_last = cts
    dq, dk, dv, dbeta, dc, ds0 = _backward(
        q, k, v, beta, c, r_f, r_in, states, do, ds_last, interpret=interpret
    )
    return dq, dk, dv, dbeta, dc, jnp.zeros_like(r_f), jnp.zeros_like(r_in), ds0


_core.defvjp(_core_fwd, _core_bwd)


def chunk_gated_delta_rule_trainable(
    q_BTMH: jax.Array,
    k_BTMH: jax.Array,
    v_BTNV: jax.Array,
    g_BTN: jax.Array,
    beta_BTN: jax.Array,
    *,
    initial_state: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    chunk_size: int = CHUNK,
    use_qk_l2norm: bool = True,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """`chunk_gated_delta_rule` with a Pallas backward: the forward kernel also saves each
    chunk's incoming state [B, N, S, H, V], and the backward kernel walks the chunks in reverse
    (`_chunk_bwd_kernel`) for the gradients of q, k, v, beta, the cumulative log-decay and the
    initial state; the elementwise work around the kernels (q/k L2 norm, head grouping,
    padding, the cumsum that makes c from g) is differentiated by JAX. segment_ids get no
    gradient (integers).

    The same arguments and results as `reference.chunk_gated_delta_rule`."""
    B, T = q_BTMH.shape[:2]
    N, H, V = v_BTNV.shape[2], q_BTMH.shape[3], v_BTNV.shape[3]
    seg = None if segment_ids is None else jax.lax.stop_gradient(jnp.asarray(segment_ids))
    args = _chunked(q_BTMH, k_BTMH, v_BTNV, g_BTN, beta_BTN, seg, chunk_size, use_qk_l2norm)
    s0 = _initial_state(initial_state, B, N, H, V)
    o, S = _core(*args, s0, interpret)
    return jnp.swapaxes(o[:, :, :T], 1, 2).astype(v_BTNV.dtype), S
