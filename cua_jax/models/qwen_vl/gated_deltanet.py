"""Qwen3.5's Gated DeltaNet (linear attention) layer in Flax NNX, with transformers' names.

Letters: B batch, T time, D model, M q/k heads, N value heads, H q/k head dim, V value head
dim, C conv channels (2 M H + N V: q, k, v side by side), W conv width.

Parameters (transformers 5 `Qwen3_5GatedDeltaNet`, the same in `Qwen3_5MoeGatedDeltaNet`):
`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, `out_proj` (nn.Linear: our `kernel` is the
HF `weight` transposed), `conv1d.weight` [C, 1, W] (the HF array as is), `dt_bias` [N],
`A_log` [N], `norm.weight` [V].

The layer carries `LinearAttnState` between calls: the conv's last W-1 inputs and the
recurrent state [B, N, H, V]. A call with T > 1 uses the chunked rule (prefill, training), a
call with T == 1 the recurrent one (decode); either takes the state in and gives it back, so
prefill-then-decode equals one pass over the whole sequence.

Which chunked rule (`make_chunk_rule`, from the model config's `gated_delta_impl`): the jnp
reference, or the Pallas TPU kernels (`gated_delta/kernel.py`): the forward, and a backward
kernel that walks the chunks in reverse from the chunk states the forward saved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from cua_jax.models.qwen_vl.config import GATED_DELTA_IMPLS
from cua_jax.models.qwen_vl.gated_delta import kernel
from cua_jax.models.qwen_vl.gated_delta import reference as gdr
from cua_jax.models.qwen_vl.text import Linear, jdtype, param

# nn.Linear modules of the layer (HF weight [out, in] <-> our kernel [in, out]).
HF_LINEAR = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetConfig:
    """The HF text-config fields the layer reads, plus run-time options (not HF fields)."""

    hidden_size: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    # --- run-time options ---
    chunk_size: int = gdr.CHUNK
    param_dtype: str = "float32"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads={self.linear_num_value_heads} must be a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads}"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act={self.hidden_act!r}: only 'silu' is supported")
        if self.linear_conv_kernel_dim < 2:
            raise ValueError(f"linear_conv_kernel_dim={self.linear_conv_kernel_dim} must be >= 2")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], **run_time: Any) -> GatedDeltaNetConfig:
        """From an HF (text) config dict, ignoring the fields the layer does not read (HF's
        own `dtype` included: the run-time options come from `run_time`)."""
        names = {f.name for f in dataclasses.fields(cls)} - _RUN_TIME
        return cls(**{k: v for k, v in d.items() if k in names}, **run_time)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


_RUN_TIME = {"chunk_size", "param_dtype", "dtype"}


def layer_types(num_hidden_layers: int, full_attention_interval: int = 4) -> tuple[str, ...]:
    """transformers' default pattern when config.json gives no `layer_types`: every
    `full_attention_interval`-th layer (1-based) is "full_attention", the rest
    "linear_attention"."""
    return tuple(
        "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
        for i in range(num_hidden_layers)
    )


# (q, k, v, g, beta, *, initial_state, segment_ids, chunk_size) -> (o, final state): the
# signature of `reference.chunk_gated_delta_rule`
ChunkRule = Callable[..., tuple[jax.Array, jax.Array]]


def make_chunk_rule(
    impl: str = "reference", mesh: Mesh | None = None, rules: Sequence = ()
) -> ChunkRule:
    """The chunked gated delta rule of `model.gated_delta_impl`.

    "reference": `reference.chunk_gated_delta_rule` (jnp). "pallas": the Pallas TPU kernel
    with a custom VJP whose backward recomputes the reference and takes its VJP
    (`kernel.chunk_gated_delta_rule_trainable`); on the CPU it runs in Pallas interpret mode
    (tests), a GPU is refused. "auto": pallas on a TPU, reference elsewhere. On a mesh of more
    than one device the kernel runs in `shard_map`: rows over the mesh axes of the logical
    "batch" axis, heads over those of "heads" when the q/k heads divide evenly (each device
    then holds whole groups of value heads), else whole. Raises ValueError on another impl or
    platform, naming the key."""
    if impl not in GATED_DELTA_IMPLS:
        raise ValueError(f"model.gated_delta_impl={impl!r}: use one of {GATED_DELTA_IMPLS}")
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    if impl == "auto":
        impl = "pallas" if platform == "tpu" else "reference"
    if impl == "reference":
        return gdr.chunk_gated_delta_rule
    if platform not in ("tpu", "cpu"):
        raise ValueError(
            f"model.gated_delta_impl='pallas' is a TPU kernel and cannot run on {platform}; "
            "use 'reference' or 'auto'"
        )
    # Pallas loads only when the kernel is asked for (the reference path never imports it).

    def rule(q, k, v, g, beta, *, initial_state=None, segment_ids=None, chunk_size=gdr.CHUNK):
        B, T, M, H = q.shape
        N, V = v.shape[2:]
        s0 = gdr._initial_state(initial_state, B, N, H, V)
        seg = jnp.zeros((B, T), jnp.int32) if segment_ids is None else segment_ids

        def local(q, k, v, g, beta, s0, seg):
            return kernel.chunk_gated_delta_rule_trainable(
                q,
                k,
                v,
                g,
                beta,
                initial_state=s0,
                segment_ids=seg,
                chunk_size=chunk_size,
                interpret=platform != "tpu",
            )

        if mesh is None or mesh.size == 1:
            return local(q, k, v, g, beta, s0, seg)
        bs, hs = _mesh_axes(mesh, rules, "batch", B), _mesh_axes(mesh, rules, "heads", M)
        tok, row = PartitionSpec(bs, None, hs, None), PartitionSpec(bs, None, hs)
        state = PartitionSpec(bs, hs, None, None)
        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(tok, tok, tok, row, row, state, PartitionSpec(bs, None)),
            out_specs=(tok, state),
            check_vma=False,  # the Pallas kernel carries no varying-axes annotations
        )(q, k, v, g, beta, s0, jnp.asarray(seg, jnp.int32))

    return rule


def _mesh_axes(mesh: Mesh, rules: Sequence, logical: str, size: int) -> tuple[str, ...] | None:
    """The mesh axes (of size > 1) that `rules` map `logical` to, if they divide `size`."""
    target = dict(rules).get(logical)
    names = (target,) if isinstance(target, str) else tuple(target or ())
    names = tuple(a for a in names if a in mesh.axis_names and mesh.shape[a] > 1)
    n = int(np.prod([mesh.shape[a] for a in names])) if names else 1
    return names if names and size % n == 0 else None


class LinearAttnState(NamedTuple):
    """A linear-attention layer's carried state (a pytree)."""

    conv: jax.Array  # [B, W-1, C] the conv's last W-1 inputs (compute dtype)
    recurrent: jax.Array  # f32[B, N, H, V]

    @classmethod
    def zeros(cls, cfg: GatedDeltaNetConfig, batch: int) -> LinearAttnState:
        return cls(
            jnp.zeros((batch, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), jdtype(cfg.dtype)),
            jnp.zeros(
                (
                    batch,
                    cfg.linear_num_value_heads,
                    cfg.linear_key_head_dim,
                    cfg.linear_value_head_dim,
                ),
                jnp.float32,
            ),
        )


class DepthwiseConv1d(nnx.Module):
    """Holds `weight` [C, 1, W] in transformers' nn.Conv1d layout (groups=C, no bias)."""

    def __init__(self, channels: int, width: int, *, rngs: nnx.Rngs, param_dtype: jnp.dtype):
        bound = width**-0.5  # torch's default (kaiming-uniform) bound for fan_in = W
        w = jax.random.uniform(rngs.params(), (channels, 1, width), jnp.float32, -bound, bound)
        self.weight = param(w.astype(param_dtype), ("heads", None, None))


class RMSNormGated(nnx.Module):
    """weight * rmsnorm(x) * silu(gate), per value head (transformers' Qwen3_5RMSNormGated)."""

    def __init__(self, dim: int, eps: float, *, param_dtype: jnp.dtype):
        self.weight = param(jnp.ones((dim,), param_dtype), ("norm",))
        self.eps = eps

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        return gdr.gated_rmsnorm(x, gate, self.weight[...].astype(x.dtype), self.eps)


class GatedDeltaNet(nnx.Module):
    """One Qwen3.5 linear-attention token mixer (the decoder layer's `linear_attn`)."""

    def __init__(self, cfg: GatedDeltaNetConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pd, dt = jdtype(cfg.param_dtype), jdtype(cfg.dtype)
        kw = dict(bias=False, rngs=rngs, param_dtype=pd, dtype=dt)
        D, N = cfg.hidden_size, cfg.linear_num_value_heads
        # The fused [q | k | v] axis is tensor-sharded like the head axes; the depthwise conv
        # is per channel, so it needs no communication on it.
        self.in_proj_qkv = Linear(D, cfg.conv_dim, ("embed", "heads"), **kw)
        self.in_proj_z = Linear(D, cfg.value_dim, ("embed", "heads"), **kw)
        self.in_proj_b = Linear(D, N, ("embed", "heads"), **kw)
        self.in_proj_a = Linear(D, N, ("embed", "heads"), **kw)
        self.conv1d = DepthwiseConv1d(
            cfg.conv_dim, cfg.linear_conv_kernel_dim, rngs=rngs, param_dtype=pd
        )
        self.dt_bias = param(jnp.ones((N,), pd), ("heads",))
        a = jax.random.uniform(rngs.params(), (N,), jnp.float32, 0.01, 16.0)  # HF's init
        self.A_log = param(jnp.log(a).astype(pd), ("heads",))
        self.norm = RMSNormGated(cfg.linear_value_head_dim, cfg.rms_norm_eps, param_dtype=pd)
        self.out_proj = Linear(cfg.value_dim, D, ("heads", "embed"), **kw)

    def __call__(
        self,
        x_BTD: jax.Array,
        *,
        state: LinearAttnState | None = None,
        segment_ids: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        lengths: jax.Array | None = None,
        chunk_rule: ChunkRule | None = None,
    ) -> tuple[jax.Array, LinearAttnState]:
        """x [B, T, D] -> (y [B, T, D], the state after the last token).

        state: carried from an earlier call (zeros when None). segment_ids i32[B, T]: packed
        rows, the conv and the recurrent state restart wherever the id changes (the incoming
        state continues the first token's segment). attention_mask [B, T]: as transformers,
        inputs at 0 are zeroed (left padding then leaves the state at zero). lengths i32[B]:
        row b's tokens at t >= lengths[b] are right padding (a sampler's bucketed prefill, an
        idle decode slot): they get g = 0 and beta = 0, so the recurrent state passes them
        unchanged, and the returned conv state is the W-1 inputs up to token lengths[b] - 1;
        the state returned is the one after each row's last real token (their outputs are
        not meaningful). chunk_rule: the chunked rule for T > 1 (`make_chunk_rule`; the jnp
        reference when None)."""
        cfg = self.cfg
        B, T, _ = x_BTD.shape
        M, N = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        H, V = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        dt = jdtype(cfg.dtype)
        x_BTD = x_BTD.astype(dt)
        if attention_mask is not None:
            x_BTD = x_BTD * jnp.asarray(attention_mask)[:, :, None].astype(dt)
        if state is None:
            state = LinearAttnState.zeros(cfg, B)

        mixed_BTC = self.in_proj_qkv(x_BTD)
        z = self.in_proj_z(x_BTD).reshape(B, T, N, V)
        b_BTN = self.in_proj_b(x_BTD)
        a_BTN = self.in_proj_a(x_BTD)

        conv_BTC, conv_state = gdr.causal_conv1d(
            mixed_BTC,
            self.conv1d.weight[...][:, 0, :],
            conv_state=state.conv,
            segment_ids=segment_ids,
        )
        conv_in_BTC = mixed_BTC
        mixed_BTC = jax.nn.silu(conv_BTC).astype(dt)
        q, k, v = jnp.split(mixed_BTC, [cfg.key_dim, 2 * cfg.key_dim], axis=-1)
        q, k = q.reshape(B, T, M, H), k.reshape(B, T, M, H)
        v = v.reshape(B, T, N, V)

        beta = jax.nn.sigmoid(b_BTN)
        if lengths is not None:
            if segment_ids is not None:
                raise ValueError("GatedDeltaNet: pass lengths or segment_ids, not both")
            live_BT1 = (jnp.arange(T)[None] < jnp.asarray(lengths)[:, None])[..., None]
            beta = jnp.where(live_BT1, beta, 0.0)
            # the conv window ending at each row's last real token (xx index W-1+t is token t)
            W = cfg.linear_conv_kernel_dim
            xx = jnp.concatenate([state.conv.astype(dt), conv_in_BTC.astype(dt)], axis=1)
            idx = jnp.asarray(lengths)[:, None] + jnp.arange(W - 1)[None]
            conv_state = jnp.take_along_axis(xx, idx[..., None], axis=1)
        a_log = self.A_log[...].astype(jnp.float32)
        dt_bias = self.dt_bias[...].astype(jnp.float32)
        g = -jnp.exp(a_log)[None, None] * jax.nn.softplus(
            a_BTN.astype(jnp.float32) + dt_bias[None, None]
        )
        if lengths is not None:
            g = jnp.where(live_BT1, g, 0.0)

        rule_kw = dict(initial_state=state.recurrent, segment_ids=segment_ids)
        if T == 1:
            o, recurrent = gdr.recurrent_gated_delta_rule(q, k, v, g, beta, **rule_kw)
        else:
            rule = gdr.chunk_gated_delta_rule if chunk_rule is None else chunk_rule
            o, recurrent = rule(q, k, v, g, beta, chunk_size=cfg.chunk_size, **rule_kw)
        o = self.norm(o.astype(dt), z).reshape(B, T, cfg.value_dim)
        return self.out_proj(o), LinearAttnState(conv_state.astype(dt), recurrent)


def load_hf_tensors(layer: GatedDeltaNet, tensors: dict[str, np.ndarray]) -> None:
    """Set the layer's parameters from HF tensors named as in the layer's state_dict
    ("in_proj_qkv.weight", "conv1d.weight", "A_log", ...). Every parameter must be given,
    with its HF shape."""
    state = nnx.state(layer, nnx.Param)
    params = dict(nnx.to_flat_state(state))
    want = {".".join(map(str, path)) for path in params}
    got = {
        name.removesuffix(".weight") + ".kernel"
        if name.removesuffix(".weight") in HF_LINEAR
        else name
        for name in tensors
    }
    if got != want:
        raise ValueError(
            f"HF tensors do not match the layer: missing {sorted(want - got)}, "
            f"unexpected {sorted(got - want)}"
        )
    for name, value in tensors.items():
        base = name.removesuffix(".weight")
        ours = (base, "kernel") if base in HF_LINEAR else tuple(name.split("."))
        value = np.asarray(value).T if base in HF_LINEAR else np.asarray(value)
        var = params[ours]
        if value.shape != var[...].shape:
            raise ValueError(f"{name}: HF shape {value.shape} != ours {var[...].shape}")
        var.set_value(jnp.asarray(value, var[...].dtype))
    nnx.update(layer, state)
