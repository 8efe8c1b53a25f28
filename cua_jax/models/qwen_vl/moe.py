"""Qwen3-VL-MoE sparse MLP block (HF `Qwen3VLMoeTextSparseMoeBlock`): a top-k softmax router
and per-expert SwiGLU MLPs, dropless, with grouped matmuls over tokens sorted by expert.

Letters: B batch, T q-len, N = B*T tokens, D model, E experts (El: on this device), K top-k,
F expert mlp width (Fl: on this device), M = N*K routed rows, R LoRA rank.

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
tokens are split over the remaining batch axes and all-gathered over the expert/tensor axes by
the in-specs, so every device routes its tokens, runs ragged_dot on the rows that chose one of
its local experts, and a psum over the expert and tensor axes combines the partial outputs.
FSDP-sharded expert weights are gathered on entry (the in-specs keep only expert/tensor axes).

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
from cua_jax.models.qwen_vl.config import QwenVLConfig
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


def expert_mlp(
    x_ND: jax.Array,
    w_NK: jax.Array,
    e_NK: jax.Array,
    p: dict[str, jax.Array],
    first_expert: jax.Array | int,
    lora_scale: float = 0.0,
) -> jax.Array:
    """sum_k w_Nk * expert_{e_Nk}(x_N) over the experts held in `p`, f32[N, D].

    `p["gate_up"]` f[El, D, 2, Fl], `p["down"]` f[El, Fl, D] hold experts first_expert ..
    first_expert + El - 1 (and a slice Fl of their width); rows routed elsewhere contribute 0.
    Optional LoRA arrays: gate_up_a f[El, D, R], gate_up_b f[El, R, 2, Fl], down_a f[El, Fl, R],
    down_b f[El, R, D].
    """
    N, K = e_NK.shape
    gate_up, down = p["gate_up"], p["down"]
    El, D, _, Fl = gate_up.shape
    dt = x_ND.dtype
    local_NK = e_NK - first_expert
    is_local_NK = (local_NK >= 0) & (local_NK < El)
    key_M = jnp.where(is_local_NK, local_NK, El).reshape(N * K)  # El: "not here", sorted last
    order_M = jnp.argsort(key_M, stable=True)
    tok_M = order_M // K
    gs_E = jnp.bincount(key_M, length=El + 1)[:El].astype(jnp.int32)
    xs_MD = jnp.take(x_ND, tok_M, axis=0)
    h = jax.lax.ragged_dot(xs_MD, gate_up.reshape(El, D, 2 * Fl).astype(dt), gs_E)
    if "gate_up_a" in p:
        b = p["gate_up_b"]
        h = h + _lora(xs_MD, p["gate_up_a"], b.reshape(*b.shape[:2], 2 * Fl), gs_E, lora_scale)
    act = jax.nn.silu(h[:, :Fl]) * h[:, Fl:]
    y_MD = jax.lax.ragged_dot(act, down.astype(dt), gs_E)
    if "down_a" in p:
        y_MD = y_MD + _lora(act, p["down_a"], p["down_b"], gs_E, lora_scale)
    # The reference casts the routing weights to the activation dtype before scaling.
    w_M = jnp.take(w_NK.astype(dt).reshape(N * K), order_M)
    here_M = jnp.take(is_local_NK.reshape(N * K), order_M)
    y_MD = jnp.where(here_M[:, None], y_MD * w_M[:, None], jnp.zeros((), dt))
    out_NKD = jnp.zeros((N * K, D), dt).at[order_M].set(y_MD).reshape(N, K, D)
    return jnp.sum(out_NKD.astype(jnp.float32), axis=1)


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
        self.mesh: Mesh | None = None
        self.rules: shd.Rules = shd.DEFAULT_RULES

    def use_mesh(self, mesh: Mesh | None, rules: shd.Rules | None = None) -> None:
        """Run expert-parallel on `mesh` under `rules` (None: one device, no shard_map)."""
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
        """The routed expert MLPs, f32[B, T, D]: locally, or under shard_map on self.mesh."""
        B, _, D = x_BTD.shape
        arrays, scale = self.experts.arrays()
        names = tuple(arrays)
        ws = [a for a, _ in arrays.values()]

        def local(x_BTD, w_BTK, e_BTK, *ws, first_expert=0):
            K = e_BTK.shape[-1]
            p = dict(zip(names, ws, strict=True))
            x_ND, w_NK, e_NK = x_BTD.reshape(-1, D), w_BTK.reshape(-1, K), e_BTK.reshape(-1, K)
            return expert_mlp(x_ND, w_NK, e_NK, p, first_expert, scale).reshape(x_BTD.shape)

        mesh = self.mesh
        if mesh is None or mesh.size == 1:
            return local(x_BTD, w_BTK, e_BTK, *ws)

        ep = tuple(a for a in _mesh_axes(self.rules, "expert") if a in mesh.axis_names)
        tp = tuple(a for a in _mesh_axes(self.rules, "mlp") if a in mesh.axis_names)
        reduce_axes = ep + tp
        dp = tuple(
            a
            for a in _mesh_axes(self.rules, "batch")
            if a in mesh.axis_names and a not in reduce_axes and mesh.shape[a] > 1
        )
        n_dp = 1
        for a in dp:
            n_dp *= mesh.shape[a]
        row_spec = PartitionSpec(dp if dp and B % n_dp == 0 else None, None, None)
        w_specs = [_in_spec(ax, self.rules, reduce_axes) for _, ax in arrays.values()]
        n_local = self.num_experts
        for a in ep:
            n_local //= mesh.shape[a]

        def sharded(x_BTD, w_BTK, e_BTK, *ws):
            # Tokens and routing are the same on every expert/tensor device; marking them as
            # varying makes their cotangents an explicit psum over those axes (the gathers in
            # expert_mlp use per-device expert offsets).
            x_BTD, w_BTK = jax.lax.pcast((x_BTD, w_BTK), reduce_axes, to="varying")
            first = jax.lax.axis_index(ep[0] if len(ep) == 1 else ep) * n_local if ep else 0
            y = local(x_BTD, w_BTK, e_BTK, *ws, first_expert=first)
            return jax.lax.psum(y, reduce_axes) if reduce_axes else y

        return jax.shard_map(
            sharded,
            mesh=mesh,
            in_specs=(row_spec, row_spec, row_spec, *w_specs),
            out_specs=row_spec,
        )(x_BTD, w_BTK, e_BTK, *ws)


def replay_weights(logits_NE: jax.Array, e_NK: jax.Array, norm_topk_prob: bool = True) -> jax.Array:
    """Routing weights f32[N, K] of given experts under the current router (routing replay)."""
    probs = jax.nn.softmax(logits_NE.astype(jnp.float32), axis=-1)
    w_NK = jnp.take_along_axis(probs, e_NK, axis=-1)
    if norm_topk_prob:
        w_NK = w_NK / jnp.sum(w_NK, axis=-1, keepdims=True)
    return w_NK


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


def set_expert_mesh(model: nnx.Module, mesh: Mesh | None, rules: shd.Rules | None = None) -> int:
    """Run every MoE block of `model` expert-parallel on `mesh` under `rules` (None: on one
    device, no shard_map). Returns the number of MoE blocks set."""
    n = 0
    for _, m in nnx.iter_modules(model):
        if isinstance(m, SparseMoeBlock):
            m.use_mesh(mesh, rules)
            n += 1
    return n
