"""Qwen3.5's Gated DeltaNet in plain jnp: the gated delta rule (recurrent and chunked), the
causal depthwise conv with its state, and the gated RMSNorm.

Letters: B batch, T time, M q/k heads, N value heads (each q/k head serves R = N // M
consecutive value heads, as transformers' `repeat_interleave`), H q/k head dim, V value head dim,
C conv channels, W conv width, S chunks, L chunk length.

The rule, per value head, with state S[H, V] (transformers' layout [B, N, H, V]):

    S_t = a_t S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - (a_t S_{t-1})^T k_t),   o_t = S_t^T q_t

with a_t = exp(g_t) (g <= 0), q and k L2-normalised and q scaled by H^-1/2.

Packed rows: `segment_ids` i32[B, T] mark samples; wherever the id changes between t-1 and t
the state (and the conv's window) starts again from zero, so a row holding two samples gives
each the output it would get alone. The initial state (and initial conv state) continues the
FIRST token's segment: a decode step or a prefill that extends a conversation passes its state
in, and a packed row starting from zeros is unaffected. Reset points are where ids change, not
id values, so padding (id 0) between two samples is a segment of its own.

`recurrent_gated_delta_rule` scans token by token (decode, and the reference);
`chunk_gated_delta_rule` is the chunked (UT-transform) form for prefill and training: within a
chunk of L tokens the updates are solved at once with one unit-lower-triangular solve, and only
the S chunks are scanned. Both are f32 inside and agree to rounding
(tests/models/test_gated_deltanet.py); both agree with transformers' torch references.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CHUNK = 64  # transformers' and FLA's chunk length


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis (FLA's and transformers' form)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def segment_index(segment_ids: jax.Array | None, batch: int, length: int) -> jax.Array:
    """i32[B, T]: how many segment changes precede each token (0 for the first segment).

    Two tokens share a state history iff their indices are equal; the initial state belongs to
    index 0."""
    if segment_ids is None:
        return jnp.zeros((batch, length), jnp.int32)
    seg = jnp.asarray(segment_ids)
    change = jnp.concatenate(
        [jnp.zeros((batch, 1), jnp.int32), (seg[:, 1:] != seg[:, :-1]).astype(jnp.int32)], axis=1
    )
    return jnp.cumsum(change, axis=1)


def _prepare(q_BTMH, k_BTMH, v_BTNV, g_BTN, beta_BTN, use_qk_l2norm):
    """f32, heads first ([B, N, T, *]), q/k repeated to the value heads, normalised, q scaled."""
    M, N = q_BTMH.shape[2], v_BTNV.shape[2]
    if N % M:
        raise ValueError(f"value heads {N} must be a multiple of q/k heads {M}")
    q, k = (jnp.repeat(x, N // M, axis=2) for x in (q_BTMH, k_BTMH))
    q, k, v = (jnp.swapaxes(x.astype(jnp.float32), 1, 2) for x in (q, k, v_BTNV))
    g, beta = (jnp.swapaxes(x.astype(jnp.float32), 1, 2) for x in (g_BTN, beta_BTN))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (q.shape[-1] ** -0.5)
    return q, k, v, g, beta


def _initial_state(initial_state, B, N, H, V):
    if initial_state is None:
        return jnp.zeros((B, N, H, V), jnp.float32)
    if initial_state.shape != (B, N, H, V):
        raise ValueError(f"initial_state shape {initial_state.shape} != {(B, N, H, V)}")
    return initial_state.astype(jnp.float32)


def recurrent_gated_delta_rule(
    q_BTMH: jax.Array,
    k_BTMH: jax.Array,
    v_BTNV: jax.Array,
    g_BTN: jax.Array,
    beta_BTN: jax.Array,
    *,
    initial_state: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule one token at a time (lax.scan over T).

    Returns (o [B, T, N, V] in v's dtype, final state f32[B, N, H, V])."""
    B, T, _, H = q_BTMH.shape
    N, V = v_BTNV.shape[2:]
    q, k, v, g, beta = _prepare(q_BTMH, k_BTMH, v_BTNV, g_BTN, beta_BTN, use_qk_l2norm)
    r_BT = segment_index(segment_ids, B, T)
    reset_BT = jnp.concatenate([jnp.zeros((B, 1), bool), r_BT[:, 1:] != r_BT[:, :-1]], axis=1)
    a_BNT = jnp.where(reset_BT[:, None, :], 0.0, jnp.exp(g))

    def step(S_BNHV, xs):
        q_t, k_t, v_t, a_t, b_t = xs  # [B, N, H], [B, N, H], [B, N, V], [B, N], [B, N]
        S_BNHV = S_BNHV * a_t[..., None, None]
        kv_mem = jnp.einsum("bnhv,bnh->bnv", S_BNHV, k_t)
        u = (v_t - kv_mem) * b_t[..., None]
        S_BNHV = S_BNHV + jnp.einsum("bnh,bnv->bnhv", k_t, u)
        return S_BNHV, jnp.einsum("bnhv,bnh->bnv", S_BNHV, q_t)

    time_major = [jnp.moveaxis(x, 2, 0) for x in (q, k, v, a_BNT, beta)]
    S, o_TBNV = jax.lax.scan(step, _initial_state(initial_state, B, N, H, V), time_major)
    return jnp.moveaxis(o_TBNV, 0, 1).astype(v_BTNV.dtype), S


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
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule in chunks of `chunk_size` tokens (T padded up to a multiple).

    Within a chunk, with cumulative log-decay c_i and D_ij = exp(c_i - c_j) for j <= i in the
    same segment (0 otherwise), the chunk's updates U solve (I + tril(beta k k^T * D, -1)) U =
    beta v - beta gamma k S_in (gamma_i = exp(c_i) while i is still in the incoming state's
    segment), and

        O = (gamma q) S_in + (q k^T * D) U,   S_out = exp(c_L) S_in + (k * exp(c_L - c))^T U

    (the exp(c_L) term dropped when the chunk crosses a segment change, the second masked to the
    chunk's last segment). Padding tokens have beta = 0, k = 0, g = 0: they leave S unchanged.

    Returns (o [B, T, N, V] in v's dtype, final state f32[B, N, H, V])."""
    B, T, _, H = q_BTMH.shape
    N, V = v_BTNV.shape[2:]
    L = chunk_size
    q, k, v, g, beta = _prepare(q_BTMH, k_BTMH, v_BTNV, g_BTN, beta_BTN, use_qk_l2norm)
    r_BT = segment_index(segment_ids, B, T)
    pad = -T % L
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q, k, v))
        g, beta = (jnp.pad(x, ((0, 0), (0, 0), (0, pad))) for x in (g, beta))
        r_BT = jnp.pad(r_BT, ((0, 0), (0, pad)), mode="edge")
    S_ = (T + pad) // L

    def chunks(x):  # [B, N, S*L, *] -> [B, N, S, L, *]
        return x.reshape(B, N, S_, L, *x.shape[3:])

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    r_BSL = r_BT.reshape(B, S_, L)
    r_in_BS = jnp.concatenate([r_BSL[:, :1, 0], r_BSL[:, :-1, -1]], axis=1)
    r_last_BS = r_BSL[:, :, -1]

    c = jnp.cumsum(g, axis=-1)  # [B, N, S, L]
    causal_LL = jnp.tril(jnp.ones((L, L), bool))
    same_BSLL = r_BSL[:, :, :, None] == r_BSL[:, :, None, :]
    mask = (causal_LL[None, None] & same_BSLL)[:, None]  # [B, 1, S, L, L]
    diff = c[..., :, None] - c[..., None, :]
    D = jnp.exp(jnp.where(mask, diff, -jnp.inf))  # exp of masked entries is exactly 0
    from_in = (r_BSL == r_in_BS[:, :, None])[:, None]  # [B, 1, S, L]
    to_out = (r_BSL == r_last_BS[:, :, None])[:, None]
    gamma = jnp.where(from_in, jnp.exp(c), 0.0)
    to_end = jnp.exp(jnp.where(to_out, c[..., -1:] - c, -jnp.inf))
    keep_BNS = jnp.where((r_last_BS == r_in_BS)[:, None], jnp.exp(c[..., -1]), 0.0)

    k_beta = k * beta[..., None]
    A = jnp.einsum("bnsih,bnsjh->bnsij", k_beta, k) * D
    A = jnp.where(jnp.tril(jnp.ones((1, 1, 1, L, L), bool), -1), A, 0.0)
    eye = jnp.eye(L, dtype=jnp.float32)[None, None, None]
    rhs = jnp.concatenate([v * beta[..., None], k_beta * gamma[..., None]], axis=-1)
    sol = jax.scipy.linalg.solve_triangular(eye + A, rhs, lower=True, unit_diagonal=True)
    u0, w = sol[..., :V], sol[..., V:]  # U = u0 - w @ S_in
    attn = jnp.einsum("bnsih,bnsjh->bnsij", q, k) * D
    q_in = q * gamma[..., None]
    k_out = k * to_end[..., None]

    def step(S_BNHV, xs):
        u0_, w_, attn_, q_in_, k_out_, keep_ = xs
        U = u0_ - jnp.einsum("bnlh,bnhv->bnlv", w_, S_BNHV)
        o = jnp.einsum("bnlh,bnhv->bnlv", q_in_, S_BNHV) + jnp.einsum("bnij,bnjv->bniv", attn_, U)
        S_BNHV = S_BNHV * keep_[..., None, None] + jnp.einsum("bnlh,bnlv->bnhv", k_out_, U)
        return S_BNHV, o

    xs = [jnp.moveaxis(x, 2, 0) for x in (u0, w, attn, q_in, k_out, keep_BNS)]
    S, o_SBNLV = jax.lax.scan(step, _initial_state(initial_state, B, N, H, V), xs)
    o_BNTV = jnp.moveaxis(o_SBNLV, 0, 2).reshape(B, N, S_ * L, V)[:, :, :T]
    return jnp.swapaxes(o_BNTV, 1, 2).astype(v_BTNV.dtype), S


def causal_conv1d(
    x_BTC: jax.Array,
    weight_CW: jax.Array,
    *,
    conv_state: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Causal depthwise conv (no bias, no activation): y_t = sum_w weight[:, w] x_{t-W+1+w}.

    conv_state [B, W-1, C]: the W-1 inputs before x (zeros when None). Returns (y [B, T, C] in
    f32, the new state: the last W-1 inputs, zeroed where they belong to an earlier segment than
    the last token's, so a decode step after a packed prefill sees only its own sample).
    transformers keeps W inputs in its cache; the oldest is never read."""
    B, T, C = x_BTC.shape
    W = weight_CW.shape[1]
    if conv_state is None:
        conv_state = jnp.zeros((B, W - 1, C), x_BTC.dtype)
    if conv_state.shape != (B, W - 1, C):
        raise ValueError(f"conv_state shape {conv_state.shape} != {(B, W - 1, C)}")
    xx = jnp.concatenate([conv_state.astype(jnp.float32), x_BTC.astype(jnp.float32)], axis=1)
    r_BT = segment_index(segment_ids, B, T)
    r_ext = jnp.concatenate([jnp.zeros((B, W - 1), jnp.int32), r_BT], axis=1)
    w_CW = weight_CW.astype(jnp.float32)
    y = jnp.zeros((B, T, C), jnp.float32)
    for tap in range(W):
        same = (r_ext[:, tap : tap + T] == r_BT)[..., None]
        y = y + jnp.where(same, xx[:, tap : tap + T], 0.0) * w_CW[None, None, :, tap]
    tail_ok = (r_ext[:, -(W - 1) :] == r_BT[:, -1:])[..., None]
    new_state = jnp.where(tail_ok, xx[:, -(W - 1) :], 0.0).astype(conv_state.dtype)
    return y, new_state


def gated_rmsnorm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """weight * rmsnorm(x) * silu(gate) over the last axis (norm before gate), as transformers'
    Qwen3_5RMSNormGated: normalise in f32, cast, scale, gate in f32, cast back."""
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    y = weight.reshape((1,) * (x.ndim - 1) + weight.shape) * xf.astype(dtype)
    return (y * jax.nn.silu(gate.astype(jnp.float32))).astype(dtype)
