"""Paged attention with one entry point that picks the backend.

`paged_attention(q, k_pages, v_pages, page_indices, lengths, backend=...)`:
  "tpu"       JAX's shipped Pallas TPU kernel (jax.experimental.pallas.ops.tpu.paged_attention),
  "gpu"       this package's Pallas kernel compiled through Triton,
  "interpret" the same kernel in Pallas interpret mode (CPU tests; slow),
  "reference" plain jnp (fast on CPU for small models),
  "auto"      tpu / gpu by the platform, else reference; also reference when that platform's
              kernel cannot take the shapes (see `unsupported_reason`), with one log line.

An explicit "tpu" or "gpu" with shapes its kernel cannot take raises a ValueError naming the
constraint, instead of an error from deep inside the Mosaic / Triton lowering at first compile.
The constraints were found by lowering both kernels ahead of time for an abstract H100 and TPU v5e
over a grid of shapes; `tests/sampler/test_kernel_lowering.py` re-checks them against the installed
JAX, so a JAX upgrade that changes them fails a test rather than a TPU job.
"""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp

from cua_jax.sampler.kernels.paged_attention.kernel import GpuKernelOptions, paged_attention_kernel
from cua_jax.sampler.kernels.paged_attention.reference import (
    chunk_attention_reference,
    contiguous_decode_attention,
    paged_attention_reference,
)

BACKENDS = ("auto", "tpu", "gpu", "interpret", "reference")

__all__ = [
    "BACKENDS",
    "GpuKernelOptions",
    "chunk_attention_reference",
    "contiguous_decode_attention",
    "paged_attention",
    "paged_attention_kernel",
    "paged_attention_reference",
    "resolve_backend",
    "select_backend",
    "unsupported_reason",
    "validate_inputs",
]

log = logging.getLogger(__name__)
_logged_fallbacks: set[tuple] = set()


def resolve_backend(backend: str, platform: str | None = None) -> str:
    """`backend` for `platform` (default: JAX's default backend), before any shape check."""
    if backend not in BACKENDS:
        raise ValueError(f"paged_attention backend={backend!r}; choose one of {BACKENDS}.")
    if backend != "auto":
        return backend
    platform = platform or jax.default_backend()
    return {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}.get(platform, "reference")


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def unsupported_reason(backend: str, *, head_dim: int, page_size: int) -> str | None:
    """Why `backend`'s kernel cannot take these shapes, or None if it can.

    tpu: head_dim is the last dim of the shipped kernel's blocks, and Mosaic needs a block's last
         dim to be a multiple of 128 (or the whole array dim, which its output blocks are not).
    gpu: Triton tensors have power-of-two sizes; the kernel loads [page_size, head_dim] pages.
    """
    if backend == "tpu" and head_dim % 128:
        return f"the TPU kernel needs head_dim % 128 == 0 (got head_dim={head_dim})"
    if backend == "gpu" and not (_pow2(head_dim) and _pow2(page_size)):
        return (
            "the GPU (Triton) kernel needs power-of-two head_dim and page_size "
            f"(got head_dim={head_dim}, page_size={page_size})"
        )
    return None


def select_backend(
    backend: str, *, head_dim: int, page_size: int, platform: str | None = None
) -> str:
    """`resolve_backend`, then the shape check: "auto" falls back to "reference" (logged once per
    shape) where the platform's kernel cannot take the shapes; an explicit backend raises."""
    chosen = resolve_backend(backend, platform)
    why = unsupported_reason(chosen, head_dim=head_dim, page_size=page_size)
    if why is None:
        return chosen
    if backend != "auto":
        raise ValueError(f"paged_attention backend={backend!r}: {why}; use 'reference' or 'auto'.")
    key = (chosen, head_dim, page_size)
    if key not in _logged_fallbacks:
        _logged_fallbacks.add(key)
        log.warning("paged attention: %s; decode uses the jnp reference instead.", why)
    return "reference"


def validate_inputs(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_indices: jax.Array,
    lengths: jax.Array,
) -> None:
    """Raises ValueError naming the offending argument when shapes or dtypes do not fit."""
    if q.ndim != 3:
        raise ValueError(f"q must be [batch, q_heads, head_dim]; got shape {q.shape}.")
    if k_pages.ndim != 4:
        raise ValueError(
            f"k_pages must be [kv_heads, num_pages, page_size, head_dim]; got {k_pages.shape}."
        )
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} differ in shape.")
    B, N, H = q.shape
    K = k_pages.shape[0]
    if k_pages.shape[3] != H:
        raise ValueError(f"head_dim of q ({H}) != head_dim of k_pages ({k_pages.shape[3]}).")
    if N % K:
        raise ValueError(f"q heads ({N}) must be a multiple of kv heads ({K}).")
    if page_indices.ndim != 2 or page_indices.shape[0] != B:
        raise ValueError(f"page_indices must be i32[{B}, pages_per_seq]; got {page_indices.shape}.")
    if lengths.shape != (B,):
        raise ValueError(f"lengths must be i32[{B}]; got shape {lengths.shape}.")
    for name, a in (("page_indices", page_indices), ("lengths", lengths)):
        if a.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32; got {a.dtype} (cast with .astype(jnp.int32)).")


def _tpu(q, k_pages, v_pages, page_indices, lengths, scale):
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_pa

    P = page_indices.shape[1]
    block = max(d for d in range(1, min(P, 8) + 1) if P % d == 0)
    # The shipped kernel does not scale q and is undefined for empty sequences.
    out = tpu_pa(
        (q * scale).astype(k_pages.dtype),
        k_pages,
        v_pages,
        jnp.maximum(lengths, 1),
        page_indices,
        pages_per_compute_block=block,
    )
    return jnp.where((lengths > 0)[:, None, None], out.astype(jnp.float32), 0.0)


def paged_attention(
    q: jax.Array,  # [B, N, H]
    k_pages: jax.Array,  # [K, Ptot, L, H]
    v_pages: jax.Array,  # [K, Ptot, L, H]
    page_indices: jax.Array,  # i32[B, P]
    lengths: jax.Array,  # i32[B]
    *,
    scale: float | None = None,
    backend: str = "auto",
    gpu_options: GpuKernelOptions | None = None,
) -> jax.Array:
    """Decode attention of one query token per sequence over its paged K/V. Returns f32[B, N, H].

    `scale` defaults to 1/sqrt(head_dim). Sequences of length 0 give zeros. `gpu_options` tune our
    Pallas kernel ("gpu" and "interpret" backends); the others ignore them.
    """
    validate_inputs(q, k_pages, v_pages, page_indices, lengths)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    backend = select_backend(backend, head_dim=q.shape[-1], page_size=k_pages.shape[2])
    if backend == "reference":
        return paged_attention_reference(q, k_pages, v_pages, page_indices, lengths, scale)
    if backend == "tpu":
        return _tpu(q, k_pages, v_pages, page_indices, lengths, scale)
    return paged_attention_kernel(
        q,
        k_pages,
        v_pages,
        page_indices,
        lengths,
        scale=scale,
        interpret=backend == "interpret",
        min_block_g=16 if backend == "gpu" else 1,
        options=gpu_options or GpuKernelOptions(),
    )
