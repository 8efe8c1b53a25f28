"""Pallas paged-attention decode kernel (one query token per sequence, grouped-query heads).

Grid (B, K): program (b, k) takes the G query heads that share kv-head k of sequence b, walks the
sequence's pages through the page table (`pages_per_block` pages per loop step) and keeps an
online (flash) softmax in f32.
Only the first cdiv(lengths[b], L) pages are touched, and positions past lengths[b] inside the last
page are masked for both K and V, so stale or NaN data in unused pages never leaks in.

Written for the Triton (GPU) lowering and for interpret mode (CPU tests); on TPU the dispatcher in
`__init__.py` uses JAX's shipped TPU kernel instead, since this one keeps a kv-head's whole page
pool addressable, which suits GPU global memory but not TPU VMEM.

Letters: B batch, N q-heads, K kv-heads, G q-heads per kv-head, H head-dim, L page size,
P pages per sequence.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from cua_jax.sampler.kernels.options import GpuKernelOptions

_DEFAULT_OPTIONS = GpuKernelOptions()


def _decode_kernel(
    lengths_ref,  # i32[B] (whole array)
    page_indices_ref,  # i32[B, P] (whole array)
    q_ref,  # [G, H] block of sequence b, kv-head k
    k_ref,  # [Ptot, L, H] kv-head k's page pool
    v_ref,  # [Ptot, L, H]
    o_ref,  # [G, H]
    *,
    scale: float,
    pages_per_block: int,
    f32_dots: bool,
):
    b = pl.program_id(0)
    length = lengths_ref[b]
    G, H = q_ref.shape
    L = k_ref.shape[1]
    P = page_indices_ref.shape[1]
    n = pages_per_block
    f32 = jnp.float32
    if f32_dots:
        q = q_ref[...].astype(f32) * scale
    else:
        q = q_ref[...]

    def dot(a, b_, contract):
        return jax.lax.dot_general(a, b_, (contract, ((), ())), preferred_element_type=f32)

    def body(i, carry):
        o, m, l = carry
        logits, values = [], []
        for j in range(n):  # unrolled: n independent page loads per step
            idx = i * n + j
            page = page_indices_ref[b, jnp.minimum(idx, P - 1)]  # past the end: masked below
            k = k_ref[page]  # [L, H]
            v = v_ref[page]
            if f32_dots:
                k, v = k.astype(f32), v.astype(f32)
            valid = idx * L + jnp.arange(L) < length  # [L]
            s = dot(q, k, ((1,), (1,)))  # [G, L]
            if not f32_dots:
                s = s * scale
            logits.append(jnp.where(valid[None, :], s, -jnp.inf))
            values.append(jnp.where(valid[:, None], v, jnp.zeros((), v.dtype)))
        # finite: the block's first page holds a valid position
        m_new = functools.reduce(jnp.maximum, [jnp.max(s, axis=1) for s in logits], m)
        corr = jnp.exp(m - m_new)
        l_new = corr * l
        o_new = corr[:, None] * o
        for s, v in zip(logits, values, strict=True):
            p = jnp.exp(s - m_new[:, None])
            l_new = l_new + jnp.sum(p, axis=1)
            o_new = o_new + dot(p.astype(v.dtype), v, ((1,), (0,)))
        return o_new, m_new, l_new

    init = (
        jnp.zeros((G, H), f32),
        jnp.full((G,), -jnp.inf, f32),
        jnp.zeros((G,), f32),
    )
    o, _, l = jax.lax.fori_loop(0, pl.cdiv(length, n * L), body, init)
    o_ref[...] = jnp.where(l[:, None] > 0, o / jnp.where(l > 0, l, 1.0)[:, None], 0.0).astype(
        o_ref.dtype
    )


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "min_block_g", "options"))
def paged_attention_kernel(
    q_BNH: jax.Array,
    k_pages: jax.Array,  # f[K, Ptot, L, H]
    v_pages: jax.Array,
    page_indices_BP: jax.Array,  # i32[B, P]
    lengths_B: jax.Array,  # i32[B]
    *,
    scale: float,
    interpret: bool = False,
    min_block_g: int = 1,
    options: GpuKernelOptions = _DEFAULT_OPTIONS,
) -> jax.Array:
    """Decode attention through the Pallas kernel. Returns f32[B, N, H].

    `min_block_g` pads the q-heads-per-kv-head block (Triton dots need >= 16 rows).
    """
    B, N, H = q_BNH.shape
    K, Ptot, L, _ = k_pages.shape
    G = N // K
    Gp = max(G, min_block_g)
    q = q_BNH.reshape(B, K, G, H)
    if not options.f32_dots:
        q = q.astype(k_pages.dtype)
    if Gp != G:
        q = jnp.pad(q, ((0, 0), (0, 0), (0, Gp - G), (0, 0)))
    compiler_params = None
    if not interpret and (options.num_warps or options.num_stages):
        compiler_params = pltriton.CompilerParams(
            num_warps=options.num_warps, num_stages=options.num_stages
        )
    out = pl.pallas_call(
        functools.partial(
            _decode_kernel,
            scale=scale,
            pages_per_block=options.pages_per_block,
            f32_dots=options.f32_dots,
        ),
        grid=(B, K),
        in_specs=[
            pl.BlockSpec(lengths_B.shape, lambda b, k: (0,)),
            pl.BlockSpec(page_indices_BP.shape, lambda b, k: (0, 0)),
            pl.BlockSpec((None, None, Gp, H), lambda b, k: (b, k, 0, 0)),
            pl.BlockSpec((None, Ptot, L, H), lambda b, k: (k, 0, 0, 0)),
            pl.BlockSpec((None, Ptot, L, H), lambda b, k: (k, 0, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, Gp, H), lambda b, k: (b, k, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, K, Gp, H), jnp.float32),
        interpret=interpret,
        compiler_params=compiler_params,
    )(lengths_B, page_indices_BP, q, k_pages, v_pages)
    return out[:, :, :G].reshape(B, N, H)
