"""Qwen3.5's hybrid decoder (dense and MoE) in Flax NNX, equal to transformers'
`Qwen3_5TextModel` / `Qwen3_5MoeTextModel`; `QwenVL` builds it for family "qwen3_5".

Letters: B batch, T tokens, D model, N q-heads, K kv-heads, H head dim, R rotary dims
(H x partial_rotary_factor), F mlp width, E experts, L sparse layers.

Module tree (HF names; `params.py` maps them):
    layers[i].linear_attn        `GatedDeltaNet` where text.layer_types[i] == "linear_attention"
    layers[i].self_attn          `GatedAttention` where it is "full_attention": q_proj gives
                                 [q | gate] per head (2 H), q/k zero-centred RMSNorm, rotary on
                                 the first R dims, output * sigmoid(gate) before o_proj
    layers[i].mlp                SwiGLU, or (MoE) `SharedExpertMoeBlock`: the routed experts of
                                 `moe.SparseMoeBlock` + sigmoid(shared_expert_gate(x)) *
                                 shared_expert(x)
    layers[i].input_layernorm / post_attention_layernorm, norm: `CenteredRMSNorm`,
                                 x_hat * (1 + weight) (Qwen3-Next's form; weights start at 0)

Full-attention layers call the model's `attn_fn(layer_idx, q, k, v)` with the decoder layer's
index, exactly as the Qwen2.5/3-VL layers do, so a paged-KV sampler plugs in unchanged (it only
ever sees the indices of `full_attention_layers(cfg)`). Linear layers carry a
`LinearAttnState` (conv window + recurrent state): `decode` takes one per linear layer and
returns the new ones, so prefill-then-decode equals one pass (the sampler's hybrid cache keeps
them per slot). Packed rows: the linear layers restart their state wherever `segment_ids`
changes, the attention mask does the same for full layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from cua_jax.models.qwen_vl.config import QwenVLConfig
from cua_jax.models.qwen_vl.gated_deltanet import (
    ChunkRule,
    GatedDeltaNet,
    GatedDeltaNetConfig,
    LinearAttnState,
)
from cua_jax.models.qwen_vl.moe import RoutingInfo, SparseMoeBlock
from cua_jax.models.qwen_vl.rope import apply_rotary, mrope_cos_sin
from cua_jax.models.qwen_vl.text import MLP, AttnFn, Embed, Linear, _last_axis, remat_call
from cua_jax.models.qwen_vl.weights import jdtype, param


@dataclasses.dataclass(frozen=True)
class RowAttnFn:
    """An `attn_fn` together with the row layout it masks by, so a hybrid model's linear layers
    (which have no attention mask) see the same padding and packed-row boundaries:
    `QwenVL.attn_fn(attention_mask, segment_ids)` returns one, and `decode` reads the layout
    from it when not given explicitly (the learner's `model.decode(..., model.attn_fn(None,
    segment_ids), ...)` then resets the linear state at each sample boundary)."""

    fn: AttnFn
    attention_mask: jax.Array | None = None
    segment_ids: jax.Array | None = None

    def __call__(self, layer_idx: int, q, k, v) -> jax.Array:
        return self.fn(layer_idx, q, k, v)


def gated_deltanet_config(cfg: QwenVLConfig) -> GatedDeltaNetConfig:
    """The linear-attention layer's config from the model config."""
    t = cfg.text
    return GatedDeltaNetConfig(
        hidden_size=t.hidden_size,
        linear_num_key_heads=t.linear_num_key_heads,
        linear_num_value_heads=t.linear_num_value_heads,
        linear_key_head_dim=t.linear_key_head_dim,
        linear_value_head_dim=t.linear_value_head_dim,
        linear_conv_kernel_dim=t.linear_conv_kernel_dim,
        rms_norm_eps=t.rms_norm_eps,
        hidden_act=t.hidden_act,
        param_dtype=cfg.param_dtype,
        dtype=cfg.dtype,
    )


def linear_attention_layers(cfg: QwenVLConfig) -> tuple[int, ...]:
    """Decoder indices of the Gated DeltaNet layers (the order of `decode`'s states)."""
    t = cfg.text
    return tuple(i for i in range(t.num_hidden_layers) if t.layer_type(i) == "linear_attention")


def full_attention_layers(cfg: QwenVLConfig) -> tuple[int, ...]:
    """Decoder indices of the full-attention layers (the only ones that call attn_fn)."""
    t = cfg.text
    return tuple(i for i in range(t.num_hidden_layers) if t.layer_type(i) == "full_attention")


def initial_linear_states(cfg: QwenVLConfig, batch: int) -> list[LinearAttnState]:
    """Zero states, one per linear layer (what `decode` uses when given none)."""
    gcfg = gated_deltanet_config(cfg)
    return [LinearAttnState.zeros(gcfg, batch) for _ in linear_attention_layers(cfg)]


class CenteredRMSNorm(nnx.Module):
    """transformers' Qwen3_5RMSNorm: normalise in f32, scale by (1 + weight) in f32, cast back."""

    def __init__(self, dim: int, eps: float, *, param_dtype: jnp.dtype, axis: str = "norm"):
        self.weight = param(jnp.zeros((dim,), param_dtype), (axis,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        w = _last_axis(self.weight[...].astype(jnp.float32), x.ndim)
        return (xf * (1.0 + w)).astype(x.dtype)


def apply_partial_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary on the first R = cos.shape[-1] dims of each head; the rest pass through."""
    R = cos.shape[-1]
    if R == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    return jnp.concatenate([apply_rotary(x[..., :R], cos, sin), x[..., R:]], axis=-1)


class GatedAttention(nnx.Module):
    """HF `self_attn` of a Qwen3.5 full-attention layer (see the module docstring)."""

    def __init__(self, cfg: QwenVLConfig, *, rngs: nnx.Rngs):
        t = cfg.text
        pd = jdtype(cfg.param_dtype)
        kw = dict(bias=False, rngs=rngs, param_dtype=pd, dtype=jdtype(cfg.dtype))
        N, K, H, D = t.num_attention_heads, t.num_key_value_heads, t.head_dim, t.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = N, K, H
        # per head: H query dims, then H gate dims (transformers' view(..., N, 2H).chunk(2))
        self.q_proj = Linear(D, N * H * 2, ("embed", "heads"), **kw)
        self.k_proj = Linear(D, K * H, ("embed", "kv_heads"), **kw)
        self.v_proj = Linear(D, K * H, ("embed", "kv_heads"), **kw)
        self.o_proj = Linear(N * H, D, ("heads", "embed"), **kw)
        self.q_norm = CenteredRMSNorm(H, t.rms_norm_eps, param_dtype=pd, axis="head_dim")
        self.k_norm = CenteredRMSNorm(H, t.rms_norm_eps, param_dtype=pd, axis="head_dim")

    def __call__(self, x_BTD, cos, sin, attn_fn: AttnFn, layer_idx: int) -> jax.Array:
        B, T, _ = x_BTD.shape
        N, K, H = self.num_heads, self.num_kv_heads, self.head_dim
        qg_BTN2H = self.q_proj(x_BTD).reshape(B, T, N, 2 * H)
        q, gate = qg_BTN2H[..., :H], qg_BTN2H[..., H:].reshape(B, T, N * H)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x_BTD).reshape(B, T, K, H))
        v = self.v_proj(x_BTD).reshape(B, T, K, H)
        q, k = apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)
        o = attn_fn(layer_idx, q, k, v).reshape(B, T, N * H)
        return self.o_proj(o * jax.nn.sigmoid(gate).astype(o.dtype))


class SharedExpertMoeBlock(SparseMoeBlock):
    """HF `mlp` of a Qwen3.5-MoE layer: the routed experts (router, top-k renormalised, as
    `SparseMoeBlock`, routing replay included) plus a shared SwiGLU expert scaled by
    sigmoid(shared_expert_gate(x)) per token."""

    def __init__(self, cfg: QwenVLConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        t = cfg.text
        self.shared_expert = MLP(
            cfg, rngs=rngs, intermediate_size=t.shared_expert_intermediate_size
        )
        self.shared_expert_gate = Linear(
            t.hidden_size,
            1,
            ("embed", None),
            bias=False,
            rngs=rngs,
            param_dtype=jdtype(cfg.param_dtype),
            dtype=jdtype(cfg.dtype),
        )

    def __call__(
        self, x_BTD: jax.Array, routes_BTK: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        y, logits, experts = super().__call__(x_BTD, routes_BTK)
        shared = jax.nn.sigmoid(self.shared_expert_gate(x_BTD)) * self.shared_expert(x_BTD)
        return y + shared.astype(y.dtype), logits, experts


class HybridDecoderLayer(nnx.Module):
    """Pre-norm token mixer (Gated DeltaNet or gated attention) + MLP / MoE block."""

    def __init__(self, cfg: QwenVLConfig, layer_idx: int, *, rngs: nnx.Rngs):
        t = cfg.text
        pd = jdtype(cfg.param_dtype)
        self.layer_type = t.layer_type(layer_idx)
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(gated_deltanet_config(cfg), rngs=rngs)
            self.self_attn = None
        else:
            self.linear_attn = None
            self.self_attn = GatedAttention(cfg, rngs=rngs)
        sparse = t.is_sparse_layer(layer_idx)
        self.mlp = SharedExpertMoeBlock(cfg, rngs=rngs) if sparse else MLP(cfg, rngs=rngs)
        self.input_layernorm = CenteredRMSNorm(t.hidden_size, t.rms_norm_eps, param_dtype=pd)
        self.post_attention_layernorm = CenteredRMSNorm(
            t.hidden_size, t.rms_norm_eps, param_dtype=pd
        )

    def __call__(
        self,
        h_BTD: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        attn_fn: AttnFn,
        layer_idx: int,
        routes_BTK: jax.Array | None = None,
        state: LinearAttnState | None = None,
        segment_ids: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        lengths: jax.Array | None = None,
        chunk_rule: ChunkRule | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None, LinearAttnState | None]:
        """-> (hidden, (router logits, experts) of a sparse layer or None, the linear layer's
        new state or None). chunk_rule: the linear layer's chunked rule (`GatedDeltaNet`)."""
        x = self.input_layernorm(h_BTD)
        new_state = None
        if self.linear_attn is not None:
            y, new_state = self.linear_attn(
                x,
                state=state,
                segment_ids=segment_ids,
                attention_mask=attention_mask,
                lengths=lengths,
                chunk_rule=chunk_rule,
            )
        else:
            y = self.self_attn(x, cos, sin, attn_fn, layer_idx)
        h_BTD = h_BTD + y.astype(h_BTD.dtype)
        x = self.post_attention_layernorm(h_BTD)
        if isinstance(self.mlp, MLP):
            return h_BTD + self.mlp(x), None, new_state
        y, logits, experts = self.mlp(x, routes_BTK)
        return h_BTD + y, (logits, experts), new_state


class HybridTextModel(nnx.Module):
    """HF `model.language_model` of Qwen3.5: embed_tokens, layers[i], norm."""

    def __init__(self, cfg: QwenVLConfig, *, rngs: nnx.Rngs):
        t = cfg.text
        pd = jdtype(cfg.param_dtype)
        self.cfg = cfg
        self.embed_tokens = Embed(t.vocab_size, t.hidden_size, rngs=rngs, param_dtype=pd)
        self.layers = nnx.List(
            [HybridDecoderLayer(cfg, i, rngs=rngs) for i in range(t.num_hidden_layers)]
        )
        self.norm = CenteredRMSNorm(t.hidden_size, t.rms_norm_eps, param_dtype=pd)

    def run_layer(
        self,
        i: int,
        h_BTD: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        attn_fn: AttnFn,
        routes_BTK: jax.Array | None = None,
        state: LinearAttnState | None = None,
        segment_ids: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        lengths: jax.Array | None = None,
        chunk_rule: ChunkRule | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None, LinearAttnState | None]:
        """Layer i (see HybridDecoderLayer.__call__), wrapped in jax.checkpoint per cfg.remat."""

        def call(layer, h, cos, sin, routes, state, seg, mask, lengths):
            return layer(h, cos, sin, attn_fn, i, routes, state, seg, mask, lengths, chunk_rule)

        return remat_call(
            self.layers[i],
            self.cfg.remat,
            call,
            h_BTD,
            cos,
            sin,
            routes_BTK,
            state,
            segment_ids,
            attention_mask,
            lengths,
        )


def decode(
    lm: HybridTextModel,
    inputs_embeds_BTD: jax.Array,
    position_ids_3BT: jax.Array,
    attn_fn: AttnFn,
    *,
    routes: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
    linear_states: Sequence[LinearAttnState] | None = None,
    lengths: jax.Array | None = None,
    chunk_rule: ChunkRule | None = None,
) -> tuple[jax.Array, RoutingInfo | None, list[LinearAttnState]]:
    """Decoder layers + final norm -> (hidden f[B, T, D], RoutingInfo of the sparse layers or
    None, the linear layers' states after the last token).

    `segment_ids` / `attention_mask` i32[B, T] default to those of a `RowAttnFn`.
    `linear_states`: one per linear layer (`linear_attention_layers`), continuing an earlier
    call; None means zeros and is only accepted with a `RowAttnFn` (`QwenVL.attn_fn`: whole
    sequences), so a KV-cache caller cannot forget them. A call with T == 1 takes the
    recurrent (decode) form. `lengths` i32[B]: real tokens of each right-padded row; the
    linear states returned are those after each row's last real token (`GatedDeltaNet`), so a
    sampler can bucket its prefill lengths and leave idle decode slots' states untouched.
    `chunk_rule`: the linear layers' chunked rule for T > 1 (`gated_deltanet.make_chunk_rule`
    of the config's `gated_delta_impl`; the jnp reference when None)."""
    cfg = lm.cfg
    t = cfg.text
    linear = linear_attention_layers(cfg)
    if isinstance(attn_fn, RowAttnFn):
        segment_ids = attn_fn.segment_ids if segment_ids is None else segment_ids
        attention_mask = attn_fn.attention_mask if attention_mask is None else attention_mask
    elif linear and linear_states is None:
        # A caller with its own attention (a KV-cache sampler) continues sequences across
        # calls; without the linear layers' states it would silently restart them every call.
        raise ValueError(
            "Qwen3.5 decode with a custom attn_fn needs linear_states (one LinearAttnState per "
            "linear-attention layer; qwen_vl.initial_linear_states(config, batch) for fresh "
            "sequences): a sampler must carry them between calls (the hybrid cache)"
        )
    if linear_states is not None and len(linear_states) != len(linear):
        raise ValueError(
            f"linear_states has {len(linear_states)} entries but the model has {len(linear)} "
            "linear-attention layers"
        )
    sparse = [i for i in range(t.num_hidden_layers) if t.is_sparse_layer(i)]
    if routes is not None and jnp.shape(routes)[0] != len(sparse):
        raise ValueError(
            f"routes has {jnp.shape(routes)[0]} layers but the model has {len(sparse)} sparse "
            "layers"
        )
    cos, sin = mrope_cos_sin(
        jnp.asarray(position_ids_3BT),
        t.rotary_dim,
        t.rope_theta,
        t.mrope_section,
        t.mrope_interleaved,
    )
    h = inputs_embeds_BTD.astype(jdtype(cfg.dtype))
    infos, states = [], []
    for i in range(t.num_hidden_layers):
        r = None if routes is None or i not in sparse else routes[sparse.index(i)]
        st = None
        if i in linear and linear_states is not None:
            st = linear_states[linear.index(i)]
        h, info, new_state = lm.run_layer(
            i, h, cos, sin, attn_fn, r, st, segment_ids, attention_mask, lengths, chunk_rule
        )
        if info is not None:
            infos.append(info)
        if new_state is not None:
            states.append(new_state)
    h = lm.norm(h)
    routing = None
    if infos:
        routing = RoutingInfo(jnp.stack([lg for lg, _ in infos]), jnp.stack([e for _, e in infos]))
    return h, routing, states
