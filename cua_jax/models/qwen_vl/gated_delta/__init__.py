"""Qwen3.5's Gated DeltaNet operations: `reference` (plain jnp, recurrent and chunked) and
`kernel` (the chunked form as a Pallas TPU kernel, imported on its own: it loads Pallas)."""

from cua_jax.models.qwen_vl.gated_delta.reference import (
    CHUNK,
    causal_conv1d,
    chunk_gated_delta_rule,
    gated_rmsnorm,
    recurrent_gated_delta_rule,
    segment_index,
)

__all__ = [
    "CHUNK",
    "causal_conv1d",
    "chunk_gated_delta_rule",
    "gated_rmsnorm",
    "recurrent_gated_delta_rule",
    "segment_index",
]
