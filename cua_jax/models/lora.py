"""LoRA adapters on the Qwen-VL model's Linear layers (Hu et al. 2021).

    y = base(x) + (α / r) · x A B        A: f32[in, r] (he-uniform), B: f32[r, out] (zeros)

`apply_lora` wraps every `Linear` whose dotted path matches one of the target patterns in a
`LoRALinear` (a `flax.nnx.LoRA` with the model's Linear as ``base_module`` and the α/r scale
Flax's class does not have). Adapter weights are `nnx.LoRAParam`s (a subclass of `nnx.Param`),
so ``nnx.LoRAParam`` selects exactly the trainable adapters and the base weights stay as they
are. They carry logical axis names (A: (in axis, None), B: (None, out axis)) so
`cua_jax.sharding` places them like the kernel they adapt.

MoE expert stacks (`mlp.experts` of a Qwen3-VL-MoE layer) are wrapped in a `LoRAExperts`: one
adapter pair per expert and projection (gate_up: A f32[E, D, r], B f32[E, r, 2, F]; down:
A f32[E, F, r], B f32[E, r, D]), applied inside the grouped matmuls of the expert dispatch (so
they shard over the expert and tensor axes like the experts).

`adapters_off` gives the adapter state with B = 0, which computes the base model's policy
without copying the base weights. (The learner's KL reference is not the base model but the
adapters as the learner started, e.g. after an SFT warm-up: see `cua_jax.rl.learner`.)
`merge_lora` folds W += (α / r) A B into the base kernels and removes the wrappers, for export.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from cua_jax.models.qwen_vl.moe import Experts
from cua_jax.models.qwen_vl.text import Linear

# The decoder's attention and MLP projections (the usual LoRA targets for an LLM policy).
DEFAULT_TARGETS: tuple[str, ...] = (
    r"language_model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj$",
    r"language_model\.layers\.\d+\.mlp\.(gate|up|down)_proj$",
)
# The expert stacks of MoE layers (gate_up and down of every expert; the router is not adapted).
EXPERT_TARGET = r"language_model\.layers\.\d+\.mlp\.experts$"
# Attention, dense MLPs and experts: the Qwen3-VL-MoE recipe's LoRA (matches dense models too).
MOE_TARGETS: tuple[str, ...] = (*DEFAULT_TARGETS, EXPERT_TARGET)


class LoRALinear(nnx.LoRA):
    """``base(x) + scale · x A B``; `base_module` is the model's (unchanged) Linear."""

    def __init__(self, base: Linear, rank: int, alpha: float, *, rngs: nnx.Rngs):
        din, dout = base.kernel.shape
        axes = tuple(base.kernel.get_metadata().get("out_sharding") or (None, None))
        super().__init__(
            din,
            rank,
            dout,
            base_module=base,
            param_dtype=jnp.float32,
            rngs=rngs,
            a_metadata={"out_sharding": (axes[0], None), "eager_sharding": False},
            b_metadata={"out_sharding": (None, axes[1]), "eager_sharding": False},
        )
        self.rank = rank
        self.scale = float(alpha) / rank

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.base_module(x)
        # The low-rank path runs in the activation dtype; A and B are kept in f32.
        a = self.lora_a[...].astype(y.dtype)
        b = self.lora_b[...].astype(y.dtype)
        return y + (x.astype(y.dtype) @ a @ b) * jnp.asarray(self.scale, y.dtype)


class ExpertAdapter(nnx.Module):
    """One projection's adapters for every expert: lora_a f32[E, in, r], lora_b f32[E, r, *out]
    (zeros). Logical axes follow the expert weight they adapt."""

    def __init__(self, a_shape, b_shape, a_axes, b_axes, *, rngs: nnx.Rngs):
        a = jax.random.normal(rngs.params(), a_shape, jnp.float32) * a_shape[1] ** -0.5
        meta = {"eager_sharding": False}
        self.lora_a = nnx.LoRAParam(a, out_sharding=tuple(a_axes), **meta)
        self.lora_b = nnx.LoRAParam(jnp.zeros(b_shape, jnp.float32), out_sharding=b_axes, **meta)


class LoRAExperts(nnx.Module):
    """An `Experts` stack with LoRA on gate_up_proj and down_proj (per expert)."""

    def __init__(self, base: Experts, rank: int, alpha: float, *, rngs: nnx.Rngs):
        E, D, two, F = base.gate_up_proj.shape
        r = rank
        self.base_module = base
        # A keeps the base weight's input axes, B its output axes (see moe.GATE_UP/DOWN_AXES).
        gu_a, gu_b = ("expert", "embed", None), ("expert", None, None, "mlp")
        dn_a, dn_b = ("expert", "mlp", None), ("expert", None, "embed")
        self.gate_up_lora = ExpertAdapter((E, D, r), (E, r, two, F), gu_a, gu_b, rngs=rngs)
        self.down_lora = ExpertAdapter((E, F, r), (E, r, D), dn_a, dn_b, rngs=rngs)
        self.rank = rank
        self.scale = float(alpha) / rank

    def arrays(self) -> tuple[dict[str, tuple[jax.Array, tuple]], float]:
        """The base expert arrays plus the adapters, for `moe.expert_mlp`."""
        out, _ = self.base_module.arrays()
        for proj, ad in (("gate_up", self.gate_up_lora), ("down", self.down_lora)):
            for ab in ("a", "b"):
                var = getattr(ad, f"lora_{ab}")
                out[f"{proj}_{ab}"] = (var[...], tuple(var.get_metadata()["out_sharding"]))
        return out, self.scale

    def merge(self) -> Experts:
        """Fold the adapters into the base stacks (W_e += scale A_e B_e); returns the base."""
        base = self.base_module
        for w, ad, eq in (
            (base.gate_up_proj, self.gate_up_lora, "edr,erxf->edxf"),
            (base.down_proj, self.down_lora, "efr,erd->efd"),
        ):
            delta = jnp.einsum(eq, ad.lora_a[...], ad.lora_b[...]) * self.scale
            w[...] = (w[...].astype(jnp.float32) + delta).astype(w[...].dtype)
        return base


def _path_str(path: Sequence) -> str:
    return ".".join(str(p) for p in path)


def _set_child(root: nnx.Module, path: Sequence, value: nnx.Module) -> None:
    parent = root
    for p in path[:-1]:
        parent = parent[p] if isinstance(p, int) else getattr(parent, p)
    last = path[-1]
    if isinstance(last, int):
        parent[last] = value
    else:
        setattr(parent, last, value)


def apply_lora(
    model: nnx.Module,
    rank: int,
    alpha: float,
    target_modules: Sequence[str] = DEFAULT_TARGETS,
    *,
    rngs: nnx.Rngs | None = None,
) -> list[str]:
    """Wrap matching Linear layers (and MoE expert stacks) in place; returns the dotted paths
    that were wrapped.

    ``target_modules`` are regular expressions searched in each Linear's dotted path (e.g.
    ``model.language_model.layers.0.self_attn.q_proj``, ``...layers.0.mlp.experts``).
    Raises when nothing matches, so a typo in a pattern cannot silently train nothing.
    """
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    rngs = rngs or nnx.Rngs(0)
    pats = [re.compile(p) for p in target_modules]
    found = [
        (path, m)
        for path, m in nnx.iter_modules(model)
        if isinstance(m, Linear | Experts) and any(p.search(_path_str(path)) for p in pats)
    ]
    if not found:
        raise ValueError(
            f"no Linear layer matches LoRA target_modules={list(target_modules)}; patterns are "
            "regexes over dotted paths such as 'model.language_model.layers.0.self_attn.q_proj'"
        )
    for path, m in found:
        wrap = LoRAExperts if isinstance(m, Experts) else LoRALinear
        _set_child(model, path, wrap(m, rank, alpha, rngs=rngs))
    return [_path_str(p) for p, _ in found]


def lora_modules(model: nnx.Module) -> list[tuple[tuple, LoRALinear | LoRAExperts]]:
    return [
        (tuple(p), m) for p, m in nnx.iter_modules(model) if isinstance(m, LoRALinear | LoRAExperts)
    ]


def has_lora(model: nnx.Module) -> bool:
    return bool(lora_modules(model))


def adapters_off(lora_state: nnx.State) -> nnx.State:
    """The adapter state with every B set to zero: the model then computes the base policy.

    Only the (small) adapter arrays are replaced; base weights are untouched and uncopied.
    """

    def zero_b(key_path, x):
        # Key paths end in (..., "lora_b") or (..., "lora_b", "value") when the state holds
        # Variables; either way the adapter's B matrix is named in the path.
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in key_path]
        return jnp.zeros_like(x) if "lora_b" in names else x

    return jax.tree_util.tree_map_with_path(zero_b, lora_state)


def merge_lora(model: nnx.Module) -> nnx.Module:
    """Fold each adapter into its base kernel (W += scale · A B) and unwrap it, in place."""
    for path, m in lora_modules(model):
        if isinstance(m, LoRAExperts):
            _set_child(model, path, m.merge())
            continue
        base: Linear = m.base_module
        w = base.kernel[...]
        delta = (m.lora_a[...].astype(jnp.float32) @ m.lora_b[...].astype(jnp.float32)) * m.scale
        base.kernel[...] = (w.astype(jnp.float32) + delta).astype(w.dtype)
        _set_child(model, path, base)
    return model
