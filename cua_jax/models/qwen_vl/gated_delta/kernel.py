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

The kernel is forward only. `chunk_gated_delta_rule_trainable` (what the model calls with
model.gated_delta_impl="pallas") gives it a gradient with `jax.custom_vjp` whose backward is
NOT a Pallas kernel: it recomputes the jnp reference (`reference.chunk_gated_delta_rule`) from
the saved inputs and returns that function's VJP. The forward keeps no [L, L] array in HBM; the
backward materialises the reference's per-chunk [B, N, S, L, L] arrays for one layer at a time,
as the reference path does in its own backward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from cua_jax.models.qwen_vl.gated_delta import reference as ref
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
    s_scr,
):
    s = pl.program_id(2)
    L = q_ref.shape[0]

    @pl.when(s == 0)
    def _():
        s_scr[...] = s0_ref[...]

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
    L = chunk_size
    if L < 2 or L & (L - 1):
        raise ValueError(f"chunk_size={L} must be a power of two >= 2")
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
    s0 = _initial_state(initial_state, B, N, H, V)

    def tok(d):  # a chunk of [B, N, S*L, d]
        return pl.BlockSpec((None, None, L, d), lambda b, n, s: (b, n, s, 0))

    in_specs = [
        tok(H),  # q
        tok(H),  # k
        tok(V),  # v
        tok(1),  # beta
        tok(1),  # c column [B, N, S*L, 1]
        pl.BlockSpec((None, None, None, 1, L), lambda b, n, s: (b, n, s, 0, 0)),  # c row
        pl.BlockSpec((None, L, 1), lambda b, n, s: (b, s, 0)),  # r column [B, S*L, 1]
        pl.BlockSpec((None, None, 1, L), lambda b, n, s: (b, s, 0, 0)),  # r row [B, S, 1, L]
        pl.BlockSpec((None, None, 1, 1), lambda b, n, s: (b, s, 0, 0)),  # r_in [B, S, 1, 1]
        pl.BlockSpec((None, None, H, V), lambda b, n, s: (b, n, 0, 0)),  # initial state
    ]
    out_specs = [
        tok(V),
        pl.BlockSpec((None, None, H, V), lambda b, n, s: (b, n, 0, 0)),
    ]
    o, S = pl.pallas_call(
        _chunk_kernel,
        grid=(B, N, S_),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=[
            jax.ShapeDtypeStruct((B, N, S_ * L, V), jnp.float32),
            jax.ShapeDtypeStruct((B, N, H, V), jnp.float32),
        ],
        scratch_shapes=[pltpu.VMEM((H, V), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
    )(
        q,
        k,
        v,
        beta[..., None],
        c.reshape(B, N, S_ * L, 1),
        c[..., None, :],
        r_f.reshape(B, S_ * L, 1),
        r_f[:, :, None, :],
        r_in[:, :, None, None],
        s0,
    )
    return jnp.swapaxes(o[:, :, :T], 1, 2).astype(v_BTNV.dtype), S


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
    """`chunk_gated_delta_rule` (the Pallas forward) with a gradient: the backward recomputes
    the jnp reference from the inputs and returns its VJP (see the module docstring), for q, k,
    v, g, beta and the initial state; segment_ids get none (integers).

    The same arguments and results as `reference.chunk_gated_delta_rule`."""
    B, T = q_BTMH.shape[:2]
    N, H, V = v_BTNV.shape[2], q_BTMH.shape[3], v_BTNV.shape[3]
    s0 = _initial_state(initial_state, B, N, H, V)
    seg = jnp.zeros((B, T), jnp.int32) if segment_ids is None else jnp.asarray(segment_ids)
    return _trainable(
        q_BTMH,
        k_BTMH,
        v_BTNV,
        g_BTN,
        beta_BTN,
        s0,
        seg.astype(jnp.int32),
        chunk_size,
        use_qk_l2norm,
        interpret,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _trainable(q, k, v, g, beta, s0, seg, chunk_size, use_qk_l2norm, interpret):
    return chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state=s0,
        segment_ids=seg,
        chunk_size=chunk_size,
        use_qk_l2norm=use_qk_l2norm,
        interpret=interpret,
    )


def _trainable_fwd(q, k, v, g, beta, s0, seg, chunk_size, use_qk_l2norm, interpret):
    out = _trainable(q, k, v, g, beta, s0, seg, chunk_size, use_qk_l2norm, interpret)
    return out, (q, k, v, g, beta, s0, seg)


def _trainable_bwd(chunk_size, use_qk_l2norm, interpret, res, cts):
    del interpret
    q, k, v, g, beta, s0, seg = res

    def reference(q, k, v, g, beta, s0):
        return ref.chunk_gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            initial_state=s0,
            segment_ids=seg,
            chunk_size=chunk_size,
            use_qk_l2norm=use_qk_l2norm,
        )

    _, vjp = jax.vjp(reference, q, k, v, g, beta, s0)
    return (*vjp(cts), np.zeros(seg.shape, jax.dtypes.float0))


_trainable.defvjp(_trainable_fwd, _trainable_bwd)
