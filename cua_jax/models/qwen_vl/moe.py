"""Qwen3-VL-MoE sparse MLP block (HF `Qwen3VLMoeTextSparseMoeBlock`): a top-k softmax router
and per-expert SwiGLU MLPs, dropless, with grouped matmuls over tokens sorted by expert.

Letters: B batch, T q-len, N = B*T tokens, D model, E experts (El: on this device), K top-k,
F expert mlp width (Fl: on this device), M = N*K routed rows, R LoRA rank; in
`expert_mlp_all_to_all`: n tokens and M = n*K rows of this device, P expert devices, R rows of
its receive buffer.

    logits_NE = x @ gate.kernel                (f32)
    probs = softmax(logits); w_NK, e_NK = top_k(probs, K); w /= sum_k w   (norm_topk_prob)
    y_N = sum_k w_Nk * down_e(silu(gate_e(x)) * up_e(x)),   e = e_Nk

Dispatch: the M = N*K (token, expert) pairs are sorted by expert, so each expert's rows are one
contiguous group, and both expert matmuls are `jax.lax.ragged_dot` (a grouped matmul: every row
is multiplied by its own expert's weights only; no capacity, no dropped tokens, no dense
all-experts einsum). Combine: rows are unsorted and the K weighted outputs of a token summed.

Expert parallelism: when the block has a mesh (`set_expert_mesh`, called by
`cua_jax.sharding.shard_model` and `from_pretrained(mesh=...)`), the block runs under
`jax.shard_map`: expert weights are split over the mesh axes of the logical "expert" axis (each
device holds El = E / ep experts) and over those of "mlp" (tensor parallel, Fl = F / tp);
FSDP-sharded expert weights are gathered on entry (the in-specs keep only expert/tensor axes).
The config's `moe_dispatch` picks how tokens meet their experts:
  "all_to_all" (`expert_mlp_all_to_all`): the B*T tokens are split over the batch AND
    expert axes; each device routes its own tokens, sends every (token, expert) row to the
    device holding that expert (`jax.lax.ragged_all_to_all`; on XLA:CPU, which does not lower
    it, `ragged_all_to_all_emulated`, a padded dense all_to_all), runs its local experts with
    ragged_dot, sends the outputs back, and combines them with the routing weights; a psum over
    the tensor axes adds the width slices. Traffic: the rows each device sends off device, out
    and back (the CPU emulation moves padded worst-case buffers instead).
  "all_gather": tokens are split over the batch axes only and all-gathered over the
    expert/tensor axes by the in-specs; every device routes them all, runs ragged_dot on the rows
    that chose one of its local experts, and a psum over the expert and tensor axes combines:
    traffic grows with all the expert group's tokens times the expert-parallel degree.
  "auto" (the default): all_to_all when the sharding rules split the tokens over the expert
    axis, all_gather when they replicate them over it (the default rules), where gathering
    all_to_all's outputs back costs more than the psums (`choose_all_to_all`).

Weights (HF names; the expert tensors keep HF's fused gate/up layout, transposed to [in, out]):
    mlp.gate.kernel               f[D, E]          ("embed", None): the router, replicated over
                                                   experts (top-k needs every logit)
    mlp.experts.gate_up_proj      f[E, D, 2, F]    ("expert", "embed", None, "mlp"); [:, :, 0] gate
    mlp.experts.down_proj         f[E, F, D]       ("expert", "mlp", "embed")
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from cua_jax import sharding as shd
from cua_jax.models.qwen_vl.config import MOE_DISPATCHES, QwenVLConfig
from cua_jax.models.qwen_vl.weights import INIT_STD, jdtype, param

GATE_UP_AXES = ("expert", "embed", None, "mlp")


class RoutingInfo(NamedTuple):
    """What the sparse layers of one forward chose (a pytree; L = number of sparse layers, in
    layer order). `experts` is what routing replay feeds back (`decode(..., routes=...)`)."""

    router_logits: jax.Array  # f32[L, B, T, E]
    experts: jax.Array  # i32[L, B, T, K]


DOWN_AXES = ("expert", "mlp", "embed")


class Router(nnx.Module):
    """HF `mlp.gate` (a bias-free Linear [E, D]); logits are computed in f32 so the routing
    choice does not depend on the activation dtype."""

    def __init__(self, dim: int, num_experts: int, *, rngs: nnx.Rngs, param_dtype: jnp.dtype):
        w = jax.random.normal(rngs.params(), (dim, num_experts), jnp.float32) * INIT_STD
        self.kernel = param(w.astype(param_dtype), ("embed", None))

    def __call__(self, x_ND: jax.Array) -> jax.Array:
        return jnp.einsum(
            "nd,de->ne", x_ND.astype(jnp.float32), self.kernel[...].astype(jnp.float32)
        )


class Experts(nnx.Module):
    """HF `mlp.experts`: the stacked expert weights (see the module docstring for layouts)."""

    def __init__(self, cfg: QwenVLConfig, *, rngs: nnx.Rngs):
        t = cfg.text
        E, D, F = t.num_experts, t.hidden_size, t.moe_intermediate_size
        pd = jdtype(cfg.param_dtype)
        gu = jax.random.normal(rngs.params(), (E, D, 2, F), jnp.float32) * INIT_STD
        dn = jax.random.normal(rngs.params(), (E, F, D), jnp.float32) * INIT_STD
        self.gate_up_proj = param(gu.astype(pd), GATE_UP_AXES)
        self.down_proj = param(dn.astype(pd), DOWN_AXES)

    def arrays(self) -> tuple[dict[str, tuple[jax.Array, tuple]], float]:
        """({name: (array, logical axes)}, LoRA scale) for `expert_mlp` (no LoRA: scale 0)."""
        return {
            "gate_up": (self.gate_up_proj[...], GATE_UP_AXES),
            "down": (self.down_proj[...], DOWN_AXES),
        }, 0.0


def route(
    logits_NE: jax.Array, top_k: int, norm_topk_prob: bool = True
) -> tuple[jax.Array, jax.Array]:
    """(weights f32[N, K], expert ids i32[N, K]) as transformers' Qwen3-VL-MoE router: softmax
    in f32, top-k of the probabilities, renormalised to sum 1 over the k chosen."""
    probs = jax.nn.softmax(logits_NE.astype(jnp.float32), axis=-1)
    w_NK, e_NK = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        w_NK = w_NK / jnp.sum(w_NK, axis=-1, keepdims=True)
    return w_NK, e_NK.astype(jnp.int32)


def _lora(x: jax.Array, a: jax.Array, b: jax.Array, gs: jax.Array, scale: float) -> jax.Array:
    """scale * (x A_e) B_e per row's expert e; A f[E, I, R], B f[E, R, O]."""
    h = jax.lax.ragged_dot(x, a.astype(x.dtype), gs)
    return jax.lax.ragged_dot(h, b.astype(x.dtype), gs) * jnp.asarray(scale, x.dtype)


def grouped_mlp(
    xs_MD: jax.Array, gs_E: jax.Array, p: dict[str, jax.Array], lora_scale: float = 0.0
) -> jax.Array:
    """The expert SwiGLU on rows already grouped by expert, f[M, D] in the rows' dtype.

    Rows 0 .. gs_E[0]-1 go through expert 0 of `p`, the next gs_E[1] through expert 1, ...;
    `p["gate_up"]` f[El, D, 2, Fl], `p["down"]` f[El, Fl, D] (a slice Fl of the width: the
    output is then that slice's partial sum). Optional LoRA arrays: gate_up_a f[El, D, R],
    gate_up_b f[El, R, 2, Fl], down_a f[El, Fl, R], down_b f[El, R, D]. Rows past sum(gs_E)
    belong to no group and come out 0 (`ragged_dot`'s rule)."""
    gate_up, down = p["gate_up"], p["down"]
    El, D, _, Fl = gate_up.shape
    dt = xs_MD.dtype
    h = jax.lax.ragged_dot(xs_MD, gate_up.reshape(El, D, 2 * Fl).astype(dt), gs_E)
    if "gate_up_a" in p:
        b = p["gate_up_b"]
        h = h + _lora(xs_MD, p["gate_up_a"], b.reshape(*b.shape[:2], 2 * Fl), gs_E, lora_scale)
    act = jax.nn.silu(h[:, :Fl]) * h[:, Fl:]
    y_MD = jax.lax.ragged_dot(act, down.astype(dt), gs_E)
    if "down_a" in p:
        y_MD = y_MD + _lora(act, p["down_a"], p["down_b"], gs_E, lora_scale)
    return y_MD


def expert_mlp(
    x_ND: jax.Array,
    w_NK: jax.Array,
    e_NK: jax.Array,
    p: dict[str, jax.Array],
    first_expert: jax.Array | int,
    lora_scale: float = 0.0,
) -> jax.Array:
    """sum_k w_Nk * expert_{e_Nk}(x_N) over the experts held in `p`, f32[N, D].

    `p` (see `grouped_mlp`) holds experts first_expert .. first_expert + El - 1 (and a slice Fl
    of their width); rows routed elsewhere, or to a negative id, contribute 0.
    """
    N, K = e_NK.shape
    El, D = p["gate_up"].shape[:2]
    dt = x_ND.dtype
    local_NK = e_NK - first_expert
    is_local_NK = (local_NK >= 0) & (local_NK < El) & (e_NK >= 0)
    key_M = jnp.where(is_local_NK, local_NK, El).reshape(N * K)  # El: "not here", sorted last
    order_M = jnp.argsort(key_M, stable=True)
    gs_E = jnp.bincount(key_M, length=El + 1)[:El].astype(jnp.int32)
    y_MD = grouped_mlp(jnp.take(x_ND, order_M // K, axis=0), gs_E, p, lora_scale)
    # The reference casts the routing weights to the activation dtype before scaling.
    w_M = jnp.take(w_NK.astype(dt).reshape(N * K), order_M)
    here_M = jnp.take(is_local_NK.reshape(N * K), order_M)
    y_MD = jnp.where(here_M[:, None], y_MD * w_M[:, None], jnp.zeros((), dt))
    out_NKD = jnp.zeros((N * K, D), dt).at[order_M].set(y_MD).reshape(N, K, D)
    return jnp.sum(out_NKD.astype(jnp.float32), axis=1)


def ragged_all_to_all_emulated(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    *,
    axis_name: str | tuple[str, ...],
    chunk: int,
) -> jax.Array:
    """`jax.lax.ragged_all_to_all`'s result, built from a dense `jax.lax.all_to_all`, for
    backends that do not lower the ragged op (XLA:CPU). Every (sender, receiver) slice travels
    in a padded buffer of `chunk` rows, so `chunk` must bound every send size (a larger slice
    would lose its tail); the bytes moved are P * chunk rows whatever the sizes, where the
    ragged op moves only the rows sent. Differentiable (gathers, scatters and all_to_all).

    operand f[Mi, ...], output f[Mo, ...]; the four int32[P] arrays as the ragged op's."""
    P = input_offsets.shape[0]
    r_C = jnp.arange(chunk, dtype=jnp.int32)
    src_PC = input_offsets[:, None] + r_C[None, :]
    sent_PC = r_C[None, :] < send_sizes[:, None]
    src_PC = jnp.where(sent_PC, src_PC, 0)
    trail = (1,) * (operand.ndim - 1)
    buf = jnp.take(operand, src_PC.reshape(-1), axis=0).reshape(P, chunk, *operand.shape[1:])
    buf = jnp.where(sent_PC.reshape(P, chunk, *trail), buf, jnp.zeros((), operand.dtype))
    got = jax.lax.all_to_all(buf, axis_name, 0, 0, tiled=True)  # got[s]: source s's slice
    at_P = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    dst_PC = at_P[:, None] + r_C[None, :]
    dst_PC = jnp.where(r_C[None, :] < recv_sizes[:, None], dst_PC, output.shape[0])  # dropped
    return output.at[dst_PC.reshape(-1)].set(
        got.reshape(P * chunk, *operand.shape[1:]), mode="drop"
    )


def _ragged_all_to_all(*args, axis_name, chunk: int, emulate: bool) -> jax.Array:
    if emulate:
        return ragged_all_to_all_emulated(*args, axis_name=axis_name, chunk=chunk)
    return jax.lax.ragged_all_to_all(*args, axis_name=axis_name)


_IN_BOUNDS = "promise_in_bounds"


def _rows(x: jax.Array, idx: jax.Array, unique: bool = False) -> jax.Array:
    """x[idx] along axis 0 for indices known to be in bounds (argsort outputs and their
    quotients): indices clamped ("clip", free for these) rather than filled, so no [rows, D]
    out-of-bounds select beside each gather."""
    return jnp.take(x, idx, axis=0, mode="clip", unique_indices=unique)


def expert_mlp_all_to_all(
    x_nD: jax.Array,
    w_nK: jax.Array,
    e_nK: jax.Array,
    p: dict[str, jax.Array],
    num_experts: int,
    axis_name: tuple[str, ...],
    lora_scale: float = 0.0,
    emulate: bool = False,
) -> jax.Array:
    """`expert_mlp` under `shard_map` with the experts split over `axis_name` (P devices, El =
    E / P each, device i holding experts i*El .. i*El + El - 1), every device with its own n
    tokens: f32[n, D], each token's combined output.

    1. Sort this device's M = n*K (token, expert) rows by expert: the rows for device j are one
       contiguous slice. Exchange the per-expert counts (an all_gather of int32[E]: P*E ints),
       so every device knows every slice's size and where it lands.
    2. `ragged_all_to_all` sends each slice to the device holding its experts; a receiver's
       buffer holds source 0's rows, then source 1's, ..., each sorted by expert.
    3. Re-sort the received rows by local expert, run `grouped_mlp` (ragged_dot), unsort.
    4. `ragged_all_to_all` sends the outputs back to their senders' sorted positions; the
       sender scales them by the routing weights and sums each token's K rows (in f32).

    Dropless: the receive buffer has the worst case's P * n * min(K, El) rows (every source
    sending all its rows for this device's experts; a token's K experts are distinct, so at most
    min(K, El) of its rows go to one device). A negative expert id (padding) is not sent.
    `emulate`: the dense `ragged_all_to_all_emulated` (CPU) instead of the ragged op.
    """
    n, K = e_nK.shape
    D = x_nD.shape[1]
    dt = x_nD.dtype
    El = p["gate_up"].shape[0]
    P = num_experts // El
    M, R = n * K, P * n * min(K, El)
    me = jax.lax.axis_index(axis_name)
    # 1. this device's rows sorted by expert (padding, id E, last), the counts exchanged
    key_M = jnp.where(e_nK >= 0, e_nK, num_experts).reshape(M)
    order_M = jnp.argsort(key_M, stable=True)
    xs_MD = _rows(x_nD, order_M // K)
    cnt_E = jnp.bincount(key_M, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    cnt_PE = jax.lax.all_gather(cnt_E, axis_name)  # [source, expert]
    cnt_PPL = cnt_PE.reshape(P, P, El)  # [source, destination, local expert]
    rows_PP = jnp.sum(cnt_PPL, axis=-1)  # rows_PP[s, j]: rows s sends to j
    in_off_PP = jnp.cumsum(rows_PP, axis=1) - rows_PP  # where j's slice starts in s's xs_MD
    land_PP = jnp.cumsum(rows_PP, axis=0) - rows_PP  # where s's slice lands in j's buffer
    send_P, recv_P = rows_PP[me], rows_PP[:, me]
    # 2. rows to their experts' devices
    chunk = n * min(K, El)
    a2a = dict(axis_name=axis_name, chunk=chunk, emulate=emulate)
    buf_RD = _ragged_all_to_all(
        xs_MD,
        jax.lax.full_like(xs_MD, 0, shape=(R, D)),
        in_off_PP[me],
        send_P,
        land_PP[me],
        recv_P,
        **a2a,
    )
    # 3. group the received rows by local expert: source-major segments (s, l) of cnt[s, me, l]
    seg_end = jnp.cumsum(cnt_PPL[:, me, :].reshape(P * El))
    seg_R = jnp.searchsorted(seg_end, jnp.arange(R, dtype=seg_end.dtype), side="right")
    lkey_R = jnp.where(seg_R < P * El, seg_R % El, El)  # El: an unused row, sorted last
    order_R = jnp.argsort(lkey_R, stable=True)
    gs_E = jnp.bincount(lkey_R, length=El + 1)[:El].astype(jnp.int32)
    ys_RD = grouped_mlp(_rows(buf_RD, order_R, unique=True), gs_E, p, lora_scale)
    out_RD = jnp.zeros((R, D), dt).at[order_R].set(ys_RD, unique_indices=True, mode=_IN_BOUNDS)
    # 4. outputs back to where their rows came from, weighted and summed per token
    recv_off_P = jnp.cumsum(recv_P) - recv_P
    back_MD = _ragged_all_to_all(
        out_RD,
        jax.lax.full_like(out_RD, 0, shape=(M, D)),
        recv_off_P,
        recv_P,
        in_off_PP[:, me],
        send_P,
        **a2a,
    )
    w_M = _rows(w_nK.astype(dt).reshape(M), order_M, unique=True)
    y_MD = jnp.where(
        (_rows(key_M, order_M, unique=True) < num_experts)[:, None], back_MD * w_M[:, None], 0
    )
    out_nKD = (
        jnp.zeros((M, D), dt).at[order_M].set(y_MD.astype(dt), unique_indices=True, mode=_IN_BOUNDS)
    )
    out_nKD = out_nKD.reshape(n, K, D)
    return jnp.sum(out_nKD.astype(jnp.float32), axis=1)


def _mesh_axes(rules: shd.Rules, logical: str) -> tuple[str, ...]:
    target = dict(rules).get(logical)
    return (target,) if isinstance(target, str) else tuple(target or ())


def _in_spec(axes: tuple, rules: shd.Rules, keep: tuple[str, ...]) -> PartitionSpec:
    """The weight's PartitionSpec restricted to the `keep` mesh axes (others gathered)."""
    out = []
    for dim in shd.logical_to_spec(axes, rules):
        names = (dim,) if isinstance(dim, str) else tuple(dim or ())
        names = tuple(a for a in names if a in keep)
        out.append(None if not names else names[0] if len(names) == 1 else names)
    return PartitionSpec(*out)


class SparseMoeBlock(nnx.Module):
    """HF `mlp` of a sparse layer: `gate` (router) + `experts`. See the module docstring."""

    def __init__(self, cfg: QwenVLConfig, *, rngs: nnx.Rngs):
        t = cfg.text
        pd = jdtype(cfg.param_dtype)
        self.gate = Router(t.hidden_size, t.num_experts, rngs=rngs, param_dtype=pd)
        self.experts = Experts(cfg, rngs=rngs)
        self.top_k = t.num_experts_per_tok
        self.norm_topk_prob = t.norm_topk_prob
        self.num_experts = t.num_experts
        self.dispatch = cfg.moe_dispatch
        self.mesh: Mesh | None = None
        self.rules: shd.Rules = shd.DEFAULT_RULES

    def use_mesh(
        self, mesh: Mesh | None, rules: shd.Rules | None = None, dispatch: str | None = None
    ) -> None:
        """Run expert-parallel on `mesh` under `rules` (None: one device, no shard_map), by
        `dispatch` ("all_to_all" | "all_gather"; None keeps the current one)."""
        if dispatch is not None:
            if dispatch not in MOE_DISPATCHES:
                raise ValueError(f"moe dispatch={dispatch!r}: use one of {MOE_DISPATCHES}")
            self.dispatch = dispatch
        self.mesh = mesh
        self.rules = shd.DEFAULT_RULES if rules is None else rules

    def __call__(
        self, x_BTD: jax.Array, routes_BTK: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """-> (y f[B, T, D], router logits f32[B, T, E], chosen experts i32[B, T, K]).

        `routes_BTK` (routing replay): use these experts instead of the router's top-k; their
        weights are still the current router's probabilities (renormalised over the k), so the
        router keeps its gradient. A token whose row holds a negative id (not recorded, e.g. the
        last token of a rollout) uses the router's own top-k."""
        B, T, D = x_BTD.shape
        logits_NE = self.gate(x_BTD.reshape(B * T, D))
        w_NK, e_NK = route(logits_NE, self.top_k, self.norm_topk_prob)
        if routes_BTK is not None:
            r_NK = jnp.asarray(routes_BTK, jnp.int32).reshape(B * T, self.top_k)
            own_N1 = jnp.any(r_NK < 0, axis=-1, keepdims=True)
            e_NK = jnp.where(own_N1, e_NK, r_NK)
            w_NK = jnp.where(own_N1, w_NK, replay_weights(logits_NE, e_NK, self.norm_topk_prob))
        w, e = w_NK.reshape(B, T, -1), e_NK.reshape(B, T, -1)
        y = self._experts(x_BTD, w, e)
        return y.astype(x_BTD.dtype), logits_NE.reshape(B, T, -1), e

    def _experts(self, x_BTD: jax.Array, w_BTK: jax.Array, e_BTK: jax.Array) -> jax.Array:
        """The routed expert MLPs, f32[B, T, D]: locally, or under shard_map on self.mesh by
        `self.dispatch` ("all_to_all" or "all_gather", see the module docstring)."""
        arrays, scale = self.experts.arrays()
        names = tuple(arrays)
        ws = [a for a, _ in arrays.values()]
        mesh = self.mesh
        if mesh is None or mesh.size == 1:
            B, T, D = x_BTD.shape
            p = dict(zip(names, ws, strict=True))
            x_ND, w_NK, e_NK = (
                x_BTD.reshape(B * T, D),
                w_BTK.reshape(B * T, -1),
                e_BTK.reshape(B * T, -1),
            )
            return expert_mlp(x_ND, w_NK, e_NK, p, 0, scale).reshape(B, T, D)
        ep = tuple(a for a in _mesh_axes(self.rules, "expert") if a in mesh.axis_names)
        tp = tuple(a for a in _mesh_axes(self.rules, "mlp") if a in mesh.axis_names)
        dp = tuple(
            a
            for a in _mesh_axes(self.rules, "batch")
            if a in mesh.axis_names and a not in ep + tp and mesh.shape[a] > 1
        )
        w_specs = [_in_spec(ax, self.rules, ep + tp) for _, ax in arrays.values()]
        n_ep = _size(mesh, ep)
        if self.num_experts % n_ep:
            raise ValueError(
                f"the mesh's expert axes {ep} (size {n_ep}) do not divide num_experts="
                f"{self.num_experts}"
            )
        if n_ep > 1 and choose_all_to_all(self.dispatch, self.rules, ep):
            run = self._all_to_all
        else:
            run = self._all_gather
        return run(x_BTD, w_BTK, e_BTK, names, ws, w_specs, scale, mesh, ep, tp, dp)

    def _all_gather(self, x_BTD, w_BTK, e_BTK, names, ws, w_specs, scale, mesh, ep, tp, dp):
        """Every expert/tensor device routes all its batch shard's tokens through its experts;
        a psum over the expert and tensor axes combines."""
        B, _, D = x_BTD.shape
        reduce_axes = ep + tp
        row_spec = PartitionSpec(dp if dp and B % _size(mesh, dp) == 0 else None, None, None)
        n_local = self.num_experts // _size(mesh, ep)

        def sharded(x_BTD, w_BTK, e_BTK, *ws):
            # Tokens and routing are the same on every expert/tensor device; marking them as
            # varying makes their cotangents an explicit psum over those axes (the gathers in
            # expert_mlp use per-device expert offsets).
            x_BTD, w_BTK = jax.lax.pcast((x_BTD, w_BTK), reduce_axes, to="varying")
            first = jax.lax.axis_index(ep[0] if len(ep) == 1 else ep) * n_local if ep else 0
            K = e_BTK.shape[-1]
            p = dict(zip(names, ws, strict=True))
            x_ND, w_NK, e_NK = x_BTD.reshape(-1, D), w_BTK.reshape(-1, K), e_BTK.reshape(-1, K)
            y = expert_mlp(x_ND, w_NK, e_NK, p, first, scale).reshape(x_BTD.shape)
            return jax.lax.psum(y, reduce_axes) if reduce_axes else y

        return jax.shard_map(
            sharded,
            mesh=mesh,
            in_specs=(row_spec, row_spec, row_spec, *w_specs),
            out_specs=row_spec,
        )(x_BTD, w_BTK, e_BTK, *ws)

    def _all_to_all(self, x_BTD, w_BTK, e_BTK, names, ws, w_specs, scale, mesh, ep, tp, dp):
        """The B*T tokens split over the batch and expert axes (padded to a multiple of their
        size with tokens routed nowhere); each device sends its rows to their experts' devices
        and back (`expert_mlp_all_to_all`); a psum over the tensor axes adds the width
        slices' partial outputs."""
        B, T, D = x_BTD.shape
        K = e_BTK.shape[-1]
        N = B * T
        shards = _size(mesh, dp + ep)
        pad = -N % shards
        x_ND = jnp.pad(x_BTD.reshape(N, D), ((0, pad), (0, 0)))
        w_NK = jnp.pad(w_BTK.reshape(N, K), ((0, pad), (0, 0)))
        e_NK = jnp.pad(e_BTK.reshape(N, K), ((0, pad), (0, 0)), constant_values=-1)
        row_spec = PartitionSpec(dp + ep, None)
        emulate = mesh.devices.flat[0].platform == "cpu"  # XLA:CPU has no ragged-all-to-all

        def sharded(x_nD, w_nK, e_nK, *ws):
            p = dict(zip(names, ws, strict=True))
            y = expert_mlp_all_to_all(
                x_nD, w_nK, e_nK, p, self.num_experts, ep, scale, emulate=emulate
            )
            return jax.lax.psum(y, tp) if tp else y

        y_ND = jax.shard_map(
            sharded,
            mesh=mesh,
            in_specs=(row_spec, row_spec, row_spec, *w_specs),
            out_specs=row_spec,
        )(x_ND, w_NK, e_NK, *ws)
        return y_ND[:N].reshape(B, T, D)


def choose_all_to_all(dispatch: str, rules: shd.Rules, ep: tuple[str, ...]) -> bool:
    """Whether `dispatch` runs the all-to-all path for an expert group on the mesh axes `ep`.

    "auto" picks the one that moves fewer bytes per device. With n tokens a device, P = the
    expert group's size, forward + backward, the compiled programs move (tools/bench_moe.py
    --ep, v5e-8, K = 8: 28 vs 56 n D split, 56 vs 28 n D replicated):
      tokens split over the expert axes by the rules ("batch" maps to one of them):
        all_to_all ~4K(P-1)/P n D (rows out and back, twice) < all_gather ~8(P-1) n D;
      tokens replicated over them (the default rules): all_to_all still all-gathers its
        outputs and the input cotangents, ~(4K/P + 4)(P-1) n D > the psums' ~4(P-1) n D."""
    if dispatch != "auto":
        return dispatch == "all_to_all"
    return any(a in ep for a in _mesh_axes(rules, "batch"))


def _size(mesh: Mesh, axes: tuple[str, ...]) -> int:
    n = 1
    for a in axes:
        n *= mesh.shape[a]
    return n


def replay_weights(logits_NE: jax.Array, e_NK: jax.Array, norm_topk_prob: bool = True) -> jax.Array:
    """Routing weights f32[N, K] of given experts under the current router (routing replay).

    Renormalised as the router's own top-k (p_i / sum_k p_k, bit for bit), except where all k
    replayed experts' probabilities underflow in f32 (experts the current router has moved far
    from): there the same ratio as a softmax over the k chosen logits, instead of 0/0 = NaN
    (which the router's gradient would carry too)."""
    logits_NE = logits_NE.astype(jnp.float32)
    w_NK = jnp.take_along_axis(jax.nn.softmax(logits_NE, axis=-1), e_NK, axis=-1)
    if not norm_topk_prob:
        return w_NK
    sum_N1 = jnp.sum(w_NK, axis=-1, keepdims=True)
    ok_N1 = sum_N1 >= jnp.finfo(jnp.float32).tiny
    chosen = jax.nn.softmax(jnp.take_along_axis(logits_NE, e_NK, axis=-1), axis=-1)
    return jnp.where(ok_N1, w_NK / jnp.where(ok_N1, sum_N1, 1.0), chosen)


def load_balancing_loss(
    router_logits_LBTE: jax.Array, top_k: int, attention_mask_BT: jax.Array | None = None
) -> jax.Array:
    """The Switch-Transformer auxiliary loss as transformers' `load_balancing_loss_func`:
    E * sum_e f_e P_e over all sparse layers' tokens, f_e the share of top-k assignments to
    expert e (summing to k), P_e the mean router probability; padding (mask 0) left out.

    router_logits_LBTE: f32[L, B, T, E] (`RoutingInfo.router_logits`). Returns f32[] (=k when
    perfectly balanced); the trainer adds coef * loss (HF: router_aux_loss_coef)."""
    L, B, T, E = router_logits_LBTE.shape
    probs = jax.nn.softmax(router_logits_LBTE.astype(jnp.float32), axis=-1)
    _, e = jax.lax.top_k(probs, top_k)
    counts_LBTE = jnp.sum(jax.nn.one_hot(e, E, dtype=jnp.float32), axis=-2)
    if attention_mask_BT is None:
        m = jnp.ones((1, B, T, 1), jnp.float32)
    else:
        m = jnp.asarray(attention_mask_BT, jnp.float32).reshape(1, B, T, 1)
    m = jnp.broadcast_to(m, (L, B, T, 1))
    rows = jnp.sum(m)
    tokens_per_expert = jnp.sum(counts_LBTE * m, axis=(0, 1, 2)) / rows
    prob_per_expert = jnp.sum(probs * m, axis=(0, 1, 2)) / rows
    return jnp.sum(tokens_per_expert * prob_per_expert) * E


def routing_mismatch(
    experts_a_LBTK: jax.Array, experts_b_LBTK: jax.Array, mask_BT: jax.Array | None = None
) -> jax.Array:
    """Share f32[] of (layer, token) pairs whose chosen expert SETS differ between two forwards
    (e.g. the sampler's recorded routes and the learner's), over tokens with mask 1. Negative
    ids (unrecorded) count as agreeing."""
    a = jnp.sort(jnp.asarray(experts_a_LBTK), axis=-1)
    b = jnp.sort(jnp.asarray(experts_b_LBTK), axis=-1)
    unrecorded = jnp.any(a < 0, axis=-1) | jnp.any(b < 0, axis=-1)
    differ = jnp.any(a != b, axis=-1) & ~unrecorded  # [L, B, T]
    L, B, T = differ.shape
    m = jnp.ones((B, T), jnp.float32) if mask_BT is None else jnp.asarray(mask_BT, jnp.float32)
    m_LBT = jnp.broadcast_to(m.reshape(1, B, T), (L, B, T))
    return jnp.sum(differ * m_LBT) / jnp.maximum(jnp.sum(m_LBT), 1.0)


def set_expert_mesh(
    model: nnx.Module,
    mesh: Mesh | None,
    rules: shd.Rules | None = None,
    dispatch: str | None = None,
) -> int:
    """Run every MoE block of `model` expert-parallel on `mesh` under `rules` (None: on one
    device, no shard_map), by `dispatch` ("all_to_all" | "all_gather"; None: keep each block's,
    from `config.moe_dispatch`). Returns the number of MoE blocks set."""
    n = 0
    for _, m in nnx.iter_modules(model):
        if isinstance(m, SparseMoeBlock):
            m.use_mesh(mesh, rules, dispatch)
            n += 1
    return n
