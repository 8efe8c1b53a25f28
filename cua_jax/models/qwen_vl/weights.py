"""How the Qwen-VL layers make their parameters: dtype names, the initial scale, and
`nnx.Param`s that carry logical axis names.

The dense layers (`text.py`), the sparse MoE block (`moe.py`) and the linear-attention layers
all build their weights from these, so none of them has to import another for it.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

INIT_STD = 0.02
"""Standard deviation of the normal initial weights (the Qwen configs' `initializer_range`)."""


def jdtype(name: str) -> jnp.dtype:
    """The jnp dtype of a config's dtype name ("float32" or "bfloat16")."""
    return jnp.dtype({"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name])


def param(value: jax.Array, axes: Sequence[str | None]) -> nnx.Param:
    """An nnx.Param carrying logical axis names (mapped to the mesh by cua_jax.sharding)."""
    if len(axes) != value.ndim:
        raise ValueError(f"logical axes {tuple(axes)} do not match shape {value.shape}")
    # eager_sharding=False: placement happens in cua_jax.sharding / params.from_pretrained,
    # which know the mesh; model construction stays mesh-free.
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)
