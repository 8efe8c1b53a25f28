"""Paged KV cache: one page pool per attention layer, and the scatter/gather/copy ops on it.

Layout per layer: k, v f[K, P_total, L, H] (kv-heads major), the layout JAX's shipped TPU
paged-attention kernel takes, so the TPU path needs no transpose. The cache is a pytree of
per-layer arrays; jitted functions take it donated and return the updated one.

Hybrid models (Qwen3.5: Gated DeltaNet + full attention) keep pools for their full-attention
layers only (`kv_layers`) and, in `linear`, one `LinearAttnState` per linear layer with a row
per state slot: rows [0, max_slots) are the decode slots' live states, the rows after them
hold finished sessions' states (the engine's hybrid cache; see `engine.py`).

Letters: B batch, T new tokens, K kv-heads, H head-dim, L page size, P pages per sequence.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer page pools. k[i], v[i]: f[K, num_pages, L, H] (i: the i-th layer of
    `kv_layers`). linear[j]: the j-th linear layer's states, conv [R, W-1, C] and recurrent
    f32[R, N, H, V] for R state rows (empty for models without linear layers)."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    linear: tuple[Any, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PageTable:
    """Device-side page table; an immutable pytree.

    Attributes:
      page_indices: i32[S, P] page id of the p-th page of slot s (TRASH_PAGE where unused).
      lengths: i32[S] tokens of slot s whose K/V are already in the cache.
    """

    page_indices: jax.Array  # i32[S, P]
    lengths: jax.Array  # i32[S]


def kv_layers(cfg: Any) -> tuple[int, ...]:
    """Decoder indices of the layers with K/V pages (every layer but Qwen3.5's linear ones)."""
    t = cfg.text
    return tuple(i for i in range(t.num_hidden_layers) if t.layer_type(i) == "full_attention")


def init_cache(
    num_layers: int,
    num_kv_heads: int,
    num_pages: int,
    page_size: int,
    head_dim: int,
    dtype: jnp.dtype = jnp.float32,
    sharding: jax.sharding.Sharding | None = None,
    linear: tuple[Any, ...] = (),
    linear_sharding: Any = None,
) -> KVCache:
    """Zero-filled cache; `sharding` (e.g. kv-heads over the `tensor` mesh axis) is applied.
    `linear`: the linear layers' zero states, put on `linear_sharding` (a sharding or a
    pytree prefix of them)."""
    shape = (num_kv_heads, num_pages, page_size, head_dim)

    def make():
        z = jnp.zeros(shape, dtype)
        return jax.device_put(z, sharding) if sharding is not None else z

    if linear_sharding is not None:
        linear = jax.device_put(linear, linear_sharding)
    return KVCache(
        tuple(make() for _ in range(num_layers)),
        tuple(make() for _ in range(num_layers)),
        tuple(linear),
    )


def write_kv(
    k_pages: jax.Array,  # f[K, Ptot, L, H]
    v_pages: jax.Array,  # f[K, Ptot, L, H]
    k_BTKH: jax.Array,
    v_BTKH: jax.Array,
    page_BT: jax.Array,  # i32[B, T] page id of each new token (TRASH_PAGE for padding)
    offset_BT: jax.Array,  # i32[B, T] slot inside that page
) -> tuple[jax.Array, jax.Array]:
    """Scatters new K/V into their (page, offset) cells. Duplicate trash writes are harmless.

    The plain reference: the engine's steps use `steps.write_kv` (same cells and values, one
    [H] row per index, which keeps the pool in the Pallas kernels' layout on TPU)."""
    # Advanced indices on adjacent axes 1, 2 -> the indexed block is [K, B, T, H].
    k_new = jnp.transpose(k_BTKH, (2, 0, 1, 3)).astype(k_pages.dtype)
    v_new = jnp.transpose(v_BTKH, (2, 0, 1, 3)).astype(v_pages.dtype)
    k_pages = k_pages.at[:, page_BT, offset_BT].set(k_new, mode="promise_in_bounds")
    v_pages = v_pages.at[:, page_BT, offset_BT].set(v_new, mode="promise_in_bounds")
    return k_pages, v_pages


def token_slots(
    page_indices_BP: jax.Array, positions_BT: jax.Array, valid_BT: jax.Array, page_size: int
) -> tuple[jax.Array, jax.Array]:
    """(page id, offset) of each token position; invalid tokens go to the trash page 0."""
    page_BT = jnp.take_along_axis(page_indices_BP, positions_BT // page_size, axis=1, mode="clip")
    page_BT = jnp.where(valid_BT, page_BT, 0)
    return page_BT, positions_BT % page_size


def gather_pages(pages: jax.Array, page_indices_BP: jax.Array) -> jax.Array:
    """Contiguous view of each sequence's pages: f[K, Ptot, L, H] -> f[B, P*L, K, H]."""
    g = pages[:, page_indices_BP]  # f[K, B, P, L, H]
    K, B, P, L, H = g.shape
    return jnp.transpose(g, (1, 2, 3, 0, 4)).reshape(B, P * L, K, H)


def copy_pages(cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    """Copies pages src[i] -> dst[i] in every layer (copy-on-write). Pad with (0, 0) pairs."""
    k = tuple(kp.at[:, dst].set(kp[:, src]) for kp in cache.k)
    v = tuple(vp.at[:, dst].set(vp[:, src]) for vp in cache.v)
    return KVCache(k, v, cache.linear)


def copy_state_rows(cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    """Copies linear-state rows src[i] -> dst[i] in every linear layer (a finished session's
    slot state into its session row). Pad with dst out of range (dropped)."""
    linear = jax.tree.map(lambda x: x.at[dst].set(x[src], mode="drop"), cache.linear)
    return KVCache(cache.k, cache.v, linear)


def kv_pool_bytes_per_device(
    cfg: Any, num_pages: int, page_size: int, dtype: Any, tensor: int
) -> int:
    """pages x page_size x kv_heads x head_dim x 2 (K and V) x attention layers (`kv_layers`)
    x dtype size / tensor."""
    t = cfg.text
    return (
        num_pages
        * page_size
        * (t.num_key_value_heads // tensor)
        * t.head_dim
        * 2
        * len(kv_layers(cfg))
        * jnp.dtype(dtype).itemsize
    )


def kv_pages_for_budget(
    cfg: Any, budget_bytes: int, page_size: int, dtype: Any, tensor: int
) -> int:
    """The most KV pages whose pool fits `budget_bytes` per device (K/V sharded over `tensor`)."""
    per_page = kv_pool_bytes_per_device(cfg, 1, page_size, dtype, tensor)
    return max(0, int(budget_bytes // per_page))
