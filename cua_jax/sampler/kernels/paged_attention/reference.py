"""Plain-jnp paged attention: the reference the Pallas kernel is tested against.

Also the prefill path: a chunk of new tokens attends to the cached prefix pages plus itself. That
is done here in reference quality (gather the sequence's pages into a contiguous buffer, masked
softmax), which is what the engine uses for prefill on every backend; decode, the per-token hot
path, goes through the kernel.

Letters: B batch, T query tokens, N q-heads, K kv-heads, G q-heads per kv-head, H head-dim,
S gathered kv length (P * L), P pages per sequence, L page size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cua_jax.sampler.kv_cache import gather_pages


def _masked_softmax_attend(
    logits_BKGTS: jax.Array, mask_BTS: jax.Array, v_BSKH: jax.Array
) -> jax.Array:
    """Softmax over S with masked entries excluded even if K/V hold NaN; all-masked rows -> 0."""
    mask = mask_BTS[:, None, None]  # [B, 1, 1, T, S]
    logits = jnp.where(mask, logits_BKGTS, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(logits - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    # Zero masked V rows too: 0 * NaN would otherwise poison the weighted sum.
    v = jnp.where(jnp.any(mask_BTS, axis=1)[:, :, None, None], v_BSKH, 0.0)
    out = jnp.einsum("bkgts,bskh->btkgh", p, v.astype(p.dtype))
    denom = jnp.transpose(denom, (0, 3, 1, 2, 4))  # [B, T, K, G, 1]
    return jnp.where(denom > 0, out / jnp.where(denom > 0, denom, 1.0), 0.0)


def paged_attention_reference(
    q_BNH: jax.Array,
    k_pages: jax.Array,  # f[K, Ptot, L, H]
    v_pages: jax.Array,  # f[K, Ptot, L, H]
    page_indices_BP: jax.Array,  # i32[B, P]
    lengths_B: jax.Array,  # i32[B]
    scale: float,
) -> jax.Array:
    """Decode attention: one query token per sequence over its first lengths[b] cached tokens.

    Returns f32[B, N, H] (zeros where the length is 0). The cost is proportional to P, the width
    of the page table passed in: the engine passes only as many columns as the longest live
    sequence needs (a power-of-two bucket). The gathered pages stay kv-head major
    ([K, B, P*L, H], a reshape of the gather, no transpose) because both einsums contract in that
    layout; this is the decode hot path on CPU.
    """
    B, N, H = q_BNH.shape
    K = k_pages.shape[0]
    k_KBSH = k_pages[:, page_indices_BP].reshape(K, B, -1, H).astype(jnp.float32)
    v_KBSH = v_pages[:, page_indices_BP].reshape(K, B, -1, H).astype(jnp.float32)
    S = k_KBSH.shape[2]
    q_BKGH = q_BNH.astype(jnp.float32).reshape(B, K, N // K, H)
    mask_BS = jnp.arange(S)[None, :] < lengths_B[:, None]
    logits = jnp.einsum("bkgh,kbsh->bkgs", q_BKGH, k_KBSH) * scale
    logits = jnp.where(mask_BS[:, None, None], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask_BS[:, None, None], jnp.exp(logits - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    # Zero V outside each sequence too: 0 * NaN (stale or never-written pages) would poison it.
    v_KBSH = jnp.where(mask_BS[None, :, :, None], v_KBSH, 0.0)
    out = jnp.einsum("bkgs,kbsh->bkgh", p, v_KBSH)
    out = jnp.where(denom > 0, out / jnp.where(denom > 0, denom, 1.0), 0.0)
    return out.reshape(B, N, H)


def contiguous_decode_attention(
    q_BNH: jax.Array,
    k_BKHS: jax.Array,  # f[B, K, H, S] each sequence's K, contiguous
    v_BKSH: jax.Array,  # f[B, K, S, H]
    lengths_B: jax.Array,  # i32[B] valid positions
    scale: float,
) -> jax.Array:
    """Decode attention over per-sequence contiguous K/V: the CPU decode loop's attention.

    The engine gathers each slot's pages into these buffers once per decode chunk (in layouts
    both dots take without a transpose) and writes each step's new K/V into them, so a step
    reads contiguous memory instead of gathering pages. Equals `paged_attention_reference` over
    the same tokens. K may hold anything (NaN included) at masked positions; V there must be
    finite (it is multiplied by an exact 0): the engine zeroes it once per chunk rather than
    masking V in every step. Returns f32[B, N, H] (zeros where the length is 0).
    """
    B, N, H = q_BNH.shape
    K, S = k_BKHS.shape[1], k_BKHS.shape[3]
    q_BKGH = q_BNH.astype(jnp.float32).reshape(B, K, N // K, H)
    mask_BS = jnp.arange(S)[None, :] < lengths_B[:, None]
    logits = jnp.einsum("bkgh,bkhs->bkgs", q_BKGH, k_BKHS.astype(jnp.float32)) * scale
    logits = jnp.where(mask_BS[:, None, None], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m)  # masked logits give exactly 0
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bkgs,bksh->bkgh", p, v_BKSH.astype(jnp.float32))
    out = jnp.where(denom > 0, out / jnp.where(denom > 0, denom, 1.0), 0.0)
    return out.reshape(B, N, H)


def chunk_attention_reference(
    q_BTNH: jax.Array,
    k_pages: jax.Array,  # f[K, Ptot, L, H]
    v_pages: jax.Array,  # f[K, Ptot, L, H]
    page_indices_BP: jax.Array,  # i32[B, P]
    q_positions_BT: jax.Array,  # i32[B, T] absolute position of each query token
    kv_lengths_B: jax.Array,  # i32[B] tokens in the cache (prefix + this chunk)
    scale: float,
) -> jax.Array:
    """Causal attention of a chunk of queries over a paged cache that already holds the chunk.

    Query t of sequence b sees cached positions s <= q_positions[b, t] and s < kv_lengths[b].
    Returns f32[B, T, N, H].
    """
    B, T, N, H = q_BTNH.shape
    K = k_pages.shape[0]
    k_BSKH = gather_pages(k_pages, page_indices_BP)
    v_BSKH = gather_pages(v_pages, page_indices_BP)
    S = k_BSKH.shape[1]
    q = q_BTNH.astype(jnp.float32).reshape(B, T, K, N // K, H)
    logits = jnp.einsum("btkgh,bskh->bkgts", q, k_BSKH.astype(jnp.float32)) * scale
    s = jnp.arange(S)[None, None, :]
    mask_BTS = (s <= q_positions_BT[:, :, None]) & (s < kv_lengths_B[:, None, None])
    out = _masked_softmax_attend(logits, mask_BTS, v_BSKH)
    return out.reshape(B, T, N, H)
