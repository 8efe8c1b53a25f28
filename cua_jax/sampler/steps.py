"""The sampler's device programs: prefill, the two decode loops, first-token sampling, page copy.

Module-level pure functions of (params, cache, arrays) with everything static (the model's
graphdef, page size, chunk length, attention backend, mesh) bound in a `ModelDef` and a
`StepConfig`; `build_step_fns` wraps them in `jax.jit` with explicit in/out shardings and the
cache donated. They can be lowered ahead of time from `jax.ShapeDtypeStruct`s (see
`decode_arg_shapes` / `prefill_arg_shapes` and /tmp/coord/engine_api.md):

    fns = build_step_fns(model_def, cfg, shardings)
    fns.decode_paged.lower(abstract_params, abstract_cache, *decode_arg_shapes(S, P)).compile()

Decode has two loops. `decode_paged`: every step writes its K/V into the pages and calls
`paged_attention` (the Pallas kernels on GPU / TPU, the jnp reference elsewhere).
`decode_contiguous` (jnp reference backend on CPU, when the gathered buffers are small): each
slot's pages are gathered into contiguous K/V buffers once per chunk, each step writes into and
attends to those buffers, and the chunk's new tokens go into the pages once at the end.

Hybrid models (Qwen3.5): K/V pages exist for the full-attention layers only (`attn_fn`'s
decoder layer index maps to its pool through `ModelDef.kv_index`), and the cache's `linear`
holds the Gated DeltaNet layers' states, one row per decode slot (then the session rows).
Prefill row b starts from state row src[b] (-1: zeros, a fresh sequence) and leaves its state
after its n[b] real tokens in row dst[b] (the slot); a decode step advances only the active
slots' states (`lengths` = active: an idle slot's state passes unchanged).

On a mesh (`StepConfig.mesh`), the K/V pools are sharded by kv head over `tensor` and the K/V
writes and attention run inside `shard_map`: each device writes and attends over its own kv
heads (q heads split over `tensor` the same way, so every q head meets its GQA kv head on the
same device). Everything else (embeddings, matmuls, vision tower, sampling) is left to GSPMD with
the parameters' own shardings.

Letters: S slots, C decode chunk, P pages per sequence, L page size, T tokens, V vocab,
N q-heads, K kv-heads, H head-dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from cua_jax.models.qwen_vl import qwen35
from cua_jax.models.qwen_vl.vision import vision_metadata
from cua_jax.sampler import kv_cache
from cua_jax.sampler.kernels.paged_attention import (
    GpuKernelOptions,
    chunk_attention_reference,
    contiguous_decode_attention,
    paged_attention,
)
from cua_jax.sampler.sampling import SlotSampling, advance, sample_tokens
from cua_jax.sampler.scheduler import MAX_STOP_IDS

KV_AXIS = "tensor"  # mesh axis the kv heads (and q heads) are split over


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """The static half of the model: `nnx.split(model, nnx.Param, ...)`'s graphdef and the
    non-Param state (empty for QwenVL; closed over as constants), plus its config."""

    graphdef: Any
    other: Any
    config: Any

    @staticmethod
    def of(model: nnx.Module) -> tuple[ModelDef, nnx.State]:
        """(ModelDef, params) of a model; params are the model's arrays (no copy).

        The sampler's model runs without remat whatever the caller's (the learner's) remat
        policy: sampling has no backward pass, and inside `jax.checkpoint` the attention
        callback's K/V writes into the page pools would leak out of the checkpointed trace
        (UnexpectedTracerError). The caller's model keeps its own config."""
        graphdef, params, other = nnx.split(model, nnx.Param, ...)
        lm = model.model.language_model
        if lm.cfg.remat == "none" and model.config.remat == "none":
            return ModelDef(graphdef, other, model.config), params
        copy = nnx.merge(graphdef, params, other)  # a new module over the same arrays
        copy.model.language_model.cfg = lm.cfg.replace(remat="none")
        copy.config = model.config.replace(remat="none")
        graphdef, _, other = nnx.split(copy, nnx.Param, ...)
        return ModelDef(graphdef, other, copy.config), params

    def merge(self, params: nnx.State) -> nnx.Module:
        return nnx.merge(self.graphdef, params, self.other)

    @property
    def kv_index(self) -> dict[int, int]:
        """Decoder layer index -> index of its page pool (`kv_cache.kv_layers`)."""
        return {li: j for j, li in enumerate(kv_cache.kv_layers(self.config))}

    @property
    def hybrid(self) -> bool:
        """Whether the model has linear-attention layers (states carried in `cache.linear`)."""
        return is_hybrid(self.config)

    @property
    def route_shape(self) -> tuple[int, int] | None:
        """(sparse layers L, experts per token K) of a MoE model (the decode steps then also
        return each token's chosen experts); None for a dense model."""
        return route_shape(self.config)


def is_hybrid(config: Any) -> bool:
    """Whether `config`'s decoder has linear-attention (Gated DeltaNet) layers."""
    t = config.text
    return any(t.layer_type(i) != "full_attention" for i in range(t.num_hidden_layers))


def route_shape(config: Any) -> tuple[int, int] | None:
    """(L, K) of a MoE config's recorded routes (L sparse layers, top-K); None when dense."""
    t = config.text
    if not t.is_moe:
        return None
    return sum(t.is_sparse_layer(i) for i in range(t.num_hidden_layers)), t.num_experts_per_tok


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static settings of the step functions.

    attn_backend: a resolved paged-attention backend ("tpu", "gpu", "interpret", "reference");
      prefill always uses the jnp chunk attention. mesh: shard_map the K/V writes and attention
      over kv heads on `mesh`'s `tensor` axis (None: no shard_map, one device or GSPMD only).
    """

    page_size: int
    decode_chunk: int
    head_dim: int
    attn_backend: str = "reference"
    attn_options: GpuKernelOptions = GpuKernelOptions()
    mesh: Mesh | None = None

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def kv_spec(self) -> PartitionSpec:
        """Spec of a page pool f[K, Ptot, L, H]: kv heads over `tensor` where the mesh has it."""
        return PartitionSpec(self.kv_axis)

    @property
    def kv_axis(self) -> str | None:
        if self.mesh is None or self.mesh.shape.get(KV_AXIS, 1) == 1:
            return None
        return KV_AXIS


def _on_kv_heads(cfg: StepConfig, fn: Callable, in_specs: tuple, out_specs: Any) -> Callable:
    """`fn` under shard_map over cfg.mesh with `kv` in the specs standing for the kv axis
    (identity without a mesh). Every input not split over kv heads is replicated.

    Pages are replicated over the `data` and `fsdp` axes: the page pool is one pool shared by
    all slots (any slot may hold any page, pages are forked between slots of a GRPO group), so
    splitting pages over devices would make every attention step gather other devices' pages;
    replicating them costs memory (num_pages x data x fsdp copies) but no communication. The
    decode batch is small and latency-bound, so it is replicated too; a throughput-bound
    deployment gives the sampler its own `tensor`-only sub-mesh (Engine(mesh=sampler_mesh)).
    """
    if cfg.mesh is None:
        return fn

    def spec(s):
        return PartitionSpec(*[cfg.kv_axis if a == "kv" else a for a in s])

    return jax.shard_map(
        fn,
        mesh=cfg.mesh,
        in_specs=tuple(spec(s) for s in in_specs),
        out_specs=tuple(spec(s) for s in out_specs),
        check_vma=False,  # the Pallas kernels carry no varying-axes annotations
    )


# ------------------------------------------------------------------------------- K/V writes
def write_kv(k_pages, v_pages, k_BTKH, v_BTKH, page_BT, offset_BT):
    """`kv_cache.write_kv` (same cells, same values) as a scatter of single [H] rows.

    Every (kv head, page, offset) cell is an index, so the scatter's only window dim is the
    minor head_dim: the compiler keeps the pool in its default layout f[K, Ptot, L, H], the one
    the Pallas paged-attention kernels take. Indexing (page, offset) alone makes [K, H] the
    window, and XLA:TPU then lays the pool out with K next to H for the scatter, so every write
    in a decode loop was followed by a relayout copy of the whole layer pool for the kernel (and
    the loop carried a second copy of the pool: temp = the pool, ~15x the bytes per step).
    """
    K = k_pages.shape[0]
    B, T = page_BT.shape
    k_idx = jnp.broadcast_to(jnp.arange(K, dtype=page_BT.dtype)[:, None, None], (K, B, T))
    page = jnp.broadcast_to(page_BT[None], (K, B, T))
    off = jnp.broadcast_to(offset_BT[None], (K, B, T))
    k_new = jnp.transpose(k_BTKH, (2, 0, 1, 3)).astype(k_pages.dtype)  # [K, B, T, H]
    v_new = jnp.transpose(v_BTKH, (2, 0, 1, 3)).astype(v_pages.dtype)
    k_pages = k_pages.at[k_idx, page, off].set(k_new, mode="promise_in_bounds")
    v_pages = v_pages.at[k_idx, page, off].set(v_new, mode="promise_in_bounds")
    return k_pages, v_pages


# ---------------------------------------------------------------------------------- prefill
def prefill(
    params,
    cache,
    ids_BT,
    pix,
    pos_3BT,
    table_BP,
    start_B,
    n_B,
    dst_B,
    src_B,
    *,
    model: ModelDef,
    cfg: StepConfig,
    grid: tuple = (),
):
    """Runs rows b: tokens start[b] .. start[b] + n[b] - 1 (n[b] = 0: a padding row) into the
    cache. Returns (cache, f32[B, V] logits of each row's last token). `grid`: the image grids
    (t, h, w) of the images in `pix` (static: the vision tower's shapes depend on it).
    Hybrid models: row b's linear states start from state row src[b] (-1: zeros) and end in
    row dst[b] (out of range for a padding row: dropped); ignored by other models."""
    m = model.merge(params)
    B, T = ids_BT.shape
    meta = vision_metadata(model.config, np.asarray(grid, np.int64)) if grid else None
    embeds, vis_mask, ds = m.embed(ids_BT, pix, None, vision_meta=meta)
    q_pos = start_B[:, None] + jnp.arange(T)[None]  # i32[B, T]
    valid = jnp.arange(T)[None] < n_B[:, None]
    page, off = kv_cache.token_slots(table_BP, q_pos, valid, cfg.page_size)
    k_pools, v_pools = list(cache.k), list(cache.v)
    kv_lengths = start_B + n_B

    def write_attend(kp, vp, q, k, v, page, off, table, q_pos, kv_lengths):
        kp, vp = write_kv(kp, vp, k, v, page, off)
        out = chunk_attention_reference(q, kp, vp, table, q_pos, kv_lengths, cfg.scale)
        return kp, vp, out.astype(q.dtype)

    bt_kv = (None, None, "kv", None)
    write_attend = _on_kv_heads(
        cfg,
        write_attend,
        (("kv",), ("kv",), bt_kv, bt_kv, bt_kv, (), (), (), (), ()),
        (("kv",), ("kv",), bt_kv),
    )

    kv_index = model.kv_index

    def attn_fn(li, q_BTNH, k_BTKH, v_BTKH):
        i = kv_index[li]
        k_pools[i], v_pools[i], out = write_attend(
            k_pools[i], v_pools[i], q_BTNH, k_BTKH, v_BTKH, page, off, table_BP, q_pos, kv_lengths
        )
        return out

    linear = cache.linear
    if model.hybrid:
        fresh = src_B < 0
        states = [
            jax.tree.map(
                lambda x: jnp.where(
                    fresh.reshape((B,) + (1,) * (x.ndim - 1)),
                    jnp.zeros((), x.dtype),
                    jnp.take(x, jnp.maximum(src_B, 0), axis=0, mode="clip"),
                ),
                st,
            )
            for st in linear
        ]
        hidden, states = m.decode(
            embeds,
            pos_3BT,
            attn_fn,
            linear_states=states,
            return_linear_states=True,
            lengths=n_B,
        )
        linear = tuple(
            jax.tree.map(lambda x, y: x.at[dst_B].set(y.astype(x.dtype), mode="drop"), old, new)
            for old, new in zip(linear, states, strict=True)
        )
    else:
        hidden = m.decode(embeds, pos_3BT, attn_fn, vis_mask, ds)
    last = jnp.take_along_axis(hidden, jnp.maximum(n_B - 1, 0)[:, None, None], axis=1)
    logits = m.logits(last)[:, 0]
    return kv_cache.KVCache(tuple(k_pools), tuple(v_pools), linear), logits


# ----------------------------------------------------------------------------------- decode
def _decode_loop(
    model: ModelDef,
    params,
    kv0,
    lin0,
    attend,
    table_SP,
    lengths_S,
    tok_S,
    delta_S,
    steps_S,
    gen_S,
    stop_SX,
    sampling,
    chunk: int,
):
    """The decode while_loop shared by both layouts; `attend(kv, j, q, k, v, active, lengths)`
    writes the step's K/V of page pool j into `kv` and returns (kv, attention output).
    `lin0`: the linear layers' states (state rows; the first S are the slots'), () when none.

    Returns (kv, lin, lengths, out_tok, out_lp, out_mlp, out_routes): out_routes is None for a
    dense model; for a MoE model i32[S, C, L, K], the experts each sparse layer chose for the
    token fed at step i (-1 where the slot was inactive)."""
    m = model.merge(params)
    S, C = tok_S.shape[0], chunk
    moe = model.route_shape
    kv_index = model.kv_index
    hybrid = model.hybrid
    # Dense models carry a [S, C, 0, 0] placeholder (no extra work), dropped at the end.
    L, K = moe if moe is not None else (0, 0)

    def cond(carry):
        i, done = carry[0], carry[5]
        return (i < C) & jnp.any(~done & (i < steps_S))

    def body(carry):
        i, kv, lin, lengths, tok, done, out_tok, out_lp, out_mlp, out_routes, gs = carry
        active = (~done) & (i < steps_S)
        pos_S = lengths + delta_S
        pos = jnp.broadcast_to(pos_S[None, :, None], (3, S, 1))
        box = [kv]

        def attn_fn(li, q_BTNH, k_BTKH, v_BTKH):
            box[0], o = attend(box[0], kv_index[li], q_BTNH, k_BTKH, v_BTKH, active, lengths)
            return o[:, None].astype(q_BTNH.dtype)

        embeds, _, _ = m.embed(tok[:, None])
        kw: dict[str, Any] = {}
        if hybrid:  # the slots' rows; an idle slot (length 0) passes its state unchanged
            slots = [jax.tree.map(lambda x: x[:S], st) for st in lin]
            kw = dict(linear_states=slots, return_linear_states=True, lengths=active * 1)
        out = m.decode(embeds, pos, attn_fn, return_routing=moe is not None, **kw)
        out = out if isinstance(out, tuple) else (out,)
        hidden = out[0]
        if hybrid:
            lin = tuple(
                jax.tree.map(lambda x, y: x.at[:S].set(y.astype(x.dtype)), old, new)
                for old, new in zip(lin, out[-1], strict=True)
            )
        if moe is not None:
            info = out[1]
            e_SLK = jnp.transpose(info.experts[:, :, 0], (1, 0, 2)).astype(jnp.int32)
            out_routes = out_routes.at[:, i].set(jnp.where(active[:, None, None], e_SLK, -1))
        logits = m.logits(hidden)[:, 0]
        new, lp, mlp = sample_tokens(
            logits, dataclasses.replace(sampling, grammar_state=gs), gen_S + i
        )
        is_stop = jnp.any(new[:, None] == stop_SX, axis=1)
        return (
            i + 1,
            box[0],
            lin,
            lengths + active,
            jnp.where(active, new, tok),
            done | (active & is_stop),
            out_tok.at[:, i].set(jnp.where(active, new, -1)),
            out_lp.at[:, i].set(lp),
            out_mlp.at[:, i].set(mlp),
            out_routes,
            jnp.where(active, advance(sampling, gs, new), gs),
        )

    init = (
        jnp.int32(0),
        kv0,
        tuple(lin0),
        lengths_S,
        tok_S,
        jnp.zeros((S,), bool),
        jnp.full((S, C), -1, jnp.int32),
        jnp.zeros((S, C), jnp.float32),
        jnp.zeros((S, C), jnp.float32),
        jnp.full((S, C, L, K), -1, jnp.int32),
        jnp.asarray(sampling.grammar_state, jnp.int32),
    )
    # while_loop, not fori_loop: the chunk ends early once every slot has stopped.
    _, kv, lin, lengths, _, _, out_tok, out_lp, out_mlp, out_routes, _ = jax.lax.while_loop(
        cond, body, init
    )
    return kv, lin, lengths, out_tok, out_lp, out_mlp, out_routes if moe is not None else None


def decode_paged(
    params,
    cache,
    table_SP,
    lengths_S,
    tok_S,
    delta_S,
    steps_S,
    gen_S,
    stop_SX,
    sampling,
    *,
    model: ModelDef,
    cfg: StepConfig,
):
    """Up to C decode steps for every slot (slot s runs steps_S[s] steps or until a stop token),
    each writing its K/V into the pages and attending with `paged_attention`.

    Returns (cache, i32[S, C] tokens (-1 after a slot's last), f32[S, C] log-probs, f32[S, C]
    model log-probs)."""

    def write_attend(kp, vp, q, k, v, page, off, table, attn_len):
        kp, vp = write_kv(kp, vp, k, v, page, off)
        o = paged_attention(
            q,
            kp,
            vp,
            table,
            attn_len,
            scale=cfg.scale,
            backend=cfg.attn_backend,
            gpu_options=cfg.attn_options,
        )
        return kp, vp, o

    bt_kv = (None, None, "kv", None)
    write_attend = _on_kv_heads(
        cfg,
        write_attend,
        (("kv",), ("kv",), (None, "kv"), bt_kv, bt_kv, (), (), (), ()),
        (("kv",), ("kv",), (None, "kv")),
    )

    def attend(kv, li, q_BTNH, k_BTKH, v_BTKH, active, lengths):
        page, off = kv_cache.token_slots(table_SP, lengths[:, None], active[:, None], cfg.page_size)
        attn_len = jnp.where(active, lengths + 1, 0)
        k_bufs, v_bufs = list(kv.k), list(kv.v)
        k_bufs[li], v_bufs[li], o = write_attend(
            k_bufs[li], v_bufs[li], q_BTNH[:, 0], k_BTKH, v_BTKH, page, off, table_SP, attn_len
        )
        return kv_cache.KVCache(tuple(k_bufs), tuple(v_bufs)), o

    kv, lin, _, out_tok, out_lp, out_mlp, out_routes = _decode_loop(
        model,
        params,
        kv_cache.KVCache(cache.k, cache.v),
        cache.linear,
        attend,
        table_SP,
        lengths_S,
        tok_S,
        delta_S,
        steps_S,
        gen_S,
        stop_SX,
        sampling,
        cfg.decode_chunk,
    )
    kv = kv_cache.KVCache(kv.k, kv.v, lin)
    return _decode_outputs(kv, out_tok, out_lp, out_mlp, out_routes)


def _decode_outputs(kv, out_tok, out_lp, out_mlp, out_routes) -> tuple:
    """(cache, tok, lp, mlp) for a dense model; + routes i32[S, C, L, K] for a MoE one."""
    if out_routes is None:
        return kv, out_tok, out_lp, out_mlp
    return kv, out_tok, out_lp, out_mlp, out_routes


def contiguous_bytes(cache: kv_cache.KVCache, num_slots: int, table_cols: int) -> int:
    """Bytes of the contiguous K/V buffers `decode_contiguous` gathers (all layers)."""
    K, _, L, H = cache.k[0].shape
    return 2 * cache.num_layers * K * num_slots * table_cols * L * H * cache.k[0].dtype.itemsize


def decode_contiguous(
    params,
    cache,
    table_SP,
    lengths_S,
    tok_S,
    delta_S,
    steps_S,
    gen_S,
    stop_SX,
    sampling,
    *,
    model: ModelDef,
    cfg: StepConfig,
):
    """`decode_paged`'s contract, over per-slot contiguous K/V buffers (jnp attention).

    Each slot's pages are gathered once per chunk (the table covers every position the chunk
    writes); each step writes its K/V into the buffers and attends to them; the chunk's new
    tokens go into the pages once at the end: no page gather inside the loop.
    """
    S, C = tok_S.shape[0], cfg.decode_chunk
    K, P, L, H = cache.k[0].shape[0], table_SP.shape[1], cfg.page_size, cache.k[0].shape[3]
    # k [S, K, H, P*L], v [S, K, P*L, H] (the layouts the attention dots take); V past each
    # slot's length is zeroed (stale pages) since attention multiplies it by 0.
    live = (jnp.arange(P * L)[None, :] < lengths_S[:, None])[:, None, :, None]
    ks, vs = [], []
    for kp, vp in zip(cache.k, cache.v, strict=True):
        k = kp[:, table_SP].reshape(K, S, P * L, H)
        v = jnp.transpose(vp[:, table_SP].reshape(K, S, P * L, H), (1, 0, 2, 3))
        ks.append(jnp.transpose(k, (1, 0, 3, 2)))
        vs.append(jnp.where(live, v, 0).astype(v.dtype))

    def write_attend(kb, vb, q, k, v, at, attn_len):
        rows = jnp.arange(S)
        # Inactive slots write out of range: dropped.
        kb = kb.at[rows, :, :, at].set(k[:, 0].astype(kb.dtype), mode="drop")
        vb = vb.at[rows, :, at].set(v[:, 0].astype(vb.dtype), mode="drop")
        return kb, vb, contiguous_decode_attention(q, kb, vb, attn_len, cfg.scale)

    bt_kv = (None, None, "kv", None)
    write_attend = _on_kv_heads(
        cfg,
        write_attend,
        ((None, "kv"), (None, "kv"), (None, "kv"), bt_kv, bt_kv, (), ()),
        ((None, "kv"), (None, "kv"), (None, "kv")),
    )

    def attend(kv, li, q_BTNH, k_BTKH, v_BTKH, active, lengths):
        k_bufs, v_bufs = list(kv[0]), list(kv[1])
        at = jnp.where(active, lengths, P * L)
        attn_len = jnp.where(active, lengths + 1, 0)
        k_bufs[li], v_bufs[li], o = write_attend(
            k_bufs[li], v_bufs[li], q_BTNH[:, 0], k_BTKH, v_BTKH, at, attn_len
        )
        return (tuple(k_bufs), tuple(v_bufs)), o

    kv, lin, lengths, out_tok, out_lp, out_mlp, out_routes = _decode_loop(
        model,
        params,
        (tuple(ks), tuple(vs)),
        cache.linear,
        attend,
        table_SP,
        lengths_S,
        tok_S,
        delta_S,
        steps_S,
        gen_S,
        stop_SX,
        sampling,
        C,
    )
    # A slot's active steps are a prefix of the chunk: it wrote positions
    # lengths_S .. lengths - 1; copy those from the buffers into the pages.
    pos_SC = jnp.minimum(lengths_S[:, None] + jnp.arange(C)[None], P * L - 1)
    valid_SC = jnp.arange(C)[None] < (lengths - lengths_S)[:, None]
    page, off = kv_cache.token_slots(table_SP, pos_SC, valid_SC, cfg.page_size)
    k_pools, v_pools = list(cache.k), list(cache.v)
    for li in range(cache.num_layers):
        k_new = jnp.take_along_axis(kv[0][li], pos_SC[:, None, None, :], axis=3)  # [S,K,H,C]
        v_new = jnp.take_along_axis(kv[1][li], pos_SC[:, None, :, None], axis=2)  # [S,K,C,H]
        k_pools[li], v_pools[li] = write_kv(
            k_pools[li],
            v_pools[li],
            jnp.transpose(k_new, (0, 3, 1, 2)),
            jnp.transpose(v_new, (0, 2, 1, 3)),
            page,
            off,
        )
    cache = kv_cache.KVCache(tuple(k_pools), tuple(v_pools), lin)
    return _decode_outputs(cache, out_tok, out_lp, out_mlp, out_routes)


def sample_first(logits_XV, idx_B, sampling, step_B):
    """First tokens after prefill: sample rows idx_B of a prefill call's logits."""
    return sample_tokens(logits_XV[idx_B], sampling, step_B)


# ------------------------------------------------------------------------------------ jitting
@dataclasses.dataclass(frozen=True)
class StepShardings:
    """params: a pytree (prefix) of shardings for the params; cache: the page pools' sharding;
    small: every other input and output (host arrays, tokens, log-probs, logits)."""

    params: Any
    cache: jax.sharding.Sharding
    small: jax.sharding.Sharding

    def cache_tree(self, cache: kv_cache.KVCache, config: Any = None) -> kv_cache.KVCache:
        """Shardings of `cache`: the pools' for K/V, `linear_state_sharding` for the linear
        states (replicated without `config`)."""
        lin = (
            linear_state_sharding(self, config)
            if config is not None and cache.linear
            else qwen35_state(self.small)
        )
        return kv_cache.KVCache(
            tuple(self.cache for _ in cache.k),
            tuple(self.cache for _ in cache.v),
            tuple(lin for _ in cache.linear),
        )


@dataclasses.dataclass(frozen=True)
class StepFns:
    """The jitted step functions (see the module docstring); `prefill(grid)` is built per grid."""

    decode_paged: Callable
    decode_contiguous: Callable
    prefill: Callable[[tuple], Callable]
    sample_first: Callable
    copy_pages: Callable
    copy_states: Callable


def linear_cache_shapes(config: Any, rows: int, dtype: Any = None) -> tuple:
    """ShapeDtypeStructs of a hybrid model's `cache.linear` with `rows` state rows (() for a
    model without linear layers). `dtype`: of the conv states (default: the compute dtype)."""

    if not is_hybrid(config):
        return ()
    zero = qwen35.LinearAttnState.zeros(qwen35.gated_deltanet_config(config), 1)
    conv_dtype = zero.conv.dtype if dtype is None else jnp.dtype(dtype)
    return tuple(
        qwen35.LinearAttnState(
            jax.ShapeDtypeStruct((rows, *zero.conv.shape[1:]), conv_dtype),
            jax.ShapeDtypeStruct((rows, *zero.recurrent.shape[1:]), zero.recurrent.dtype),
        )
        for _ in qwen35.linear_attention_layers(config)
    )


def linear_state_rows(max_slots: int, session_states: int | None = None) -> int:
    """A hybrid Engine's linear-state rows: its slots', then its finished sessions' (the Engine
    keeps `max_slots` sessions when `session_states` is None)."""
    return max_slots + (max_slots if session_states is None else session_states)


def linear_state_bytes_per_device(config: Any, rows: int, tensor: int) -> int:
    """Bytes a device holds of a hybrid model's `rows` linear-state rows (every linear layer's
    conv window and recurrent state), split over `tensor` as `linear_state_sharding` splits
    them when the value heads and conv channels divide; 0 for a model without linear layers."""
    states = linear_cache_shapes(config, rows)
    total = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(states))
    if states and tensor > 1:
        g = states[0]
        if g.recurrent.shape[1] % tensor == 0 and g.conv.shape[2] % tensor == 0:
            total //= tensor
    return total


def build_step_fns(
    model: ModelDef,
    cfg: StepConfig,
    sh: StepShardings,
    num_layers: int,
    compiler_options: dict | None = None,
) -> StepFns:
    """jax.jit of every step function with explicit in/out shardings; the cache is donated.

    Positional arguments of each (what `.lower` takes):
      decode_*(params, cache, table i32[S, P], lengths i32[S], tok i32[S], delta i32[S],
               steps i32[S], gen i32[S], stop i32[S, MAX_STOP_IDS], sampling SlotSampling[S])
        -> (cache, tok i32[S, C], lp f32[S, C], mlp f32[S, C])
           MoE models (`model.route_shape` not None) also return routes i32[S, C, L, K]: the
           experts of the L sparse layers for the token fed at each step, -1 where inactive.
      prefill(grid)(params, cache, ids i32[B, T], pix f32[n_patches, D] | None,
               pos i32[3, B, T], table i32[B, P], start i32[B], n i32[B], dst i32[B],
               src i32[B]) -> (cache, f32[B, V])   (dst / src: hybrid models' state rows)
      sample_first(logits f32[X, V], idx i32[B], sampling SlotSampling[B], step i32[B])
        -> (tok i32[B], lp f32[B], mlp f32[B])
      copy_pages(cache, src i32[n], dst i32[n]) -> cache
      copy_states(cache, src i32[n], dst i32[n]) -> cache   (hybrid models' state rows)

    `num_layers`: the page pools (`kv_cache.kv_layers`: a hybrid model's attention layers).
    """
    n_linear = len(linear_cache_shapes(model.config, 1))
    small = sh.small
    cache_sh = kv_cache.KVCache(
        (sh.cache,) * num_layers,
        (sh.cache,) * num_layers,
        tuple(linear_state_sharding(sh, model.config) for _ in range(n_linear)) if n_linear else (),
    )
    decode_kw = dict(
        in_shardings=(sh.params, cache_sh, *[small] * 8),
        out_shardings=(cache_sh, small, small, small, *[small] * (model.route_shape is not None)),
        donate_argnums=(1,),
        compiler_options=compiler_options,
    )
    d_paged = jax.jit(functools.partial(decode_paged, model=model, cfg=cfg), **decode_kw)
    d_contig = jax.jit(functools.partial(decode_contiguous, model=model, cfg=cfg), **decode_kw)

    @functools.cache
    def prefill_for(grid: tuple) -> Callable:
        return jax.jit(
            functools.partial(prefill, model=model, cfg=cfg, grid=grid),
            in_shardings=(sh.params, cache_sh, *[small] * 8),
            out_shardings=(cache_sh, small),
            donate_argnums=(1,),
            compiler_options=compiler_options,
        )

    sample = jax.jit(
        sample_first, in_shardings=small, out_shardings=small, compiler_options=compiler_options
    )
    copy = jax.jit(
        kv_cache.copy_pages,
        in_shardings=(cache_sh, small, small),
        out_shardings=cache_sh,
        donate_argnums=(0,),
    )
    copy_states = jax.jit(
        kv_cache.copy_state_rows,
        in_shardings=(cache_sh, small, small),
        out_shardings=cache_sh,
        donate_argnums=(0,),
    )
    return StepFns(d_paged, d_contig, prefill_for, sample, copy, copy_states)


def qwen35_state(x: Any) -> Any:
    """A `LinearAttnState` of `x` for both fields."""

    return qwen35.LinearAttnState(x, x)


def linear_state_sharding(sh: StepShardings, config: Any) -> Any:
    """Sharding of one linear layer's states (the Gated DeltaNet layers run under GSPMD with
    the parameters' own shardings): where the K/V pools are split over `tensor` and it divides
    the value heads and conv channels, the recurrent state f32[R, N, H, V] is split by value
    head and the conv window [R, W-1, C] by channel, as the layer's projections split them;
    else replicated, like the other small arrays."""

    kv = sh.cache
    if isinstance(kv, jax.sharding.NamedSharding) and kv.mesh.shape.get(KV_AXIS, 1) > 1:
        t, g = kv.mesh.shape[KV_AXIS], qwen35.gated_deltanet_config(config)
        if g.linear_num_value_heads % t == 0 and g.conv_dim % t == 0:
            return qwen35.LinearAttnState(
                jax.sharding.NamedSharding(kv.mesh, PartitionSpec(None, None, KV_AXIS)),
                jax.sharding.NamedSharding(kv.mesh, PartitionSpec(None, KV_AXIS)),
            )
    return qwen35.LinearAttnState(sh.small, sh.small)


def decode_arg_shapes(num_slots: int, table_cols: int, grammar: Any = None) -> tuple:
    """ShapeDtypeStructs of decode_*'s arguments after (params, cache), for `.lower`
    (`grammar`: the engine's abstract `GrammarTables`; default: none)."""
    S, i32 = num_slots, jnp.int32
    sds = jax.ShapeDtypeStruct
    sampling = SlotSampling.abstract(S, grammar)
    vec = sds((S,), i32)
    return (
        sds((S, table_cols), i32),
        vec,
        vec,
        vec,
        vec,
        vec,
        sds((S, MAX_STOP_IDS), i32),
        sampling,
    )


def prefill_arg_shapes(
    rows: int,
    tokens: int,
    table_cols: int,
    pixel_shape: tuple[int, int] | None = None,
    pixel_dtype: str = "float32",
) -> tuple:
    """ShapeDtypeStructs of prefill(grid)'s arguments after (params, cache). `pixel_shape`:
    (patch rows, row width) of the images of `grid` (None for a text-only call), in the
    model's `pixel_dtype` form."""
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    pix = None if pixel_shape is None else sds(pixel_shape, jnp.dtype(pixel_dtype))
    B, T = rows, tokens
    return (
        sds((B, T), i32),
        pix,
        sds((3, B, T), i32),
        sds((B, table_cols), i32),
        sds((B,), i32),
        sds((B,), i32),
        sds((B,), i32),
        sds((B,), i32),
    )


def abstract_cache(
    num_layers: int,
    num_kv_heads: int,
    num_pages: int,
    page_size: int,
    head_dim: int,
    dtype: Any,
    sharding: jax.sharding.Sharding | None = None,
    linear: tuple = (),
) -> kv_cache.KVCache:
    """ShapeDtypeStructs of a page cache (for `.lower` without allocating it); `linear`: a
    hybrid model's `linear_cache_shapes`."""
    x = jax.ShapeDtypeStruct(
        (num_kv_heads, num_pages, page_size, head_dim), dtype, sharding=sharding
    )
    return kv_cache.KVCache((x,) * num_layers, (x,) * num_layers, tuple(linear))
