"""Qwen2.5-VL and Qwen3-VL vision towers (Flax NNX), equal to transformers' implementations.

All images of a batch are one flat sequence of patches (as in transformers). Variable-length
per-image attention and Qwen2.5's window attention use dense attention with segment-id masks,
so shapes are static: jit compiles once per (number of patches) and the per-image layout
lives in `VisionMeta`, a pytree of index arrays computed on the host from `image_grid_thw`
by `vision_metadata`.

Letters: P patches (all images), M merged tokens (= P / merge^2), D vision hidden, E out hidden,
N heads, H head dim, C flattened patch (in_channels * temporal_patch * patch^2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from cua_jax.data.image import normalize_table
from cua_jax.models.qwen_vl.config import QwenVLConfig
from cua_jax.models.qwen_vl.rope import apply_rotary, vision_cos_sin
from cua_jax.models.qwen_vl.text import (
    LayerNorm,
    Linear,
    RMSNorm,
    dense_attention,
    jdtype,
    param,
    remat_call,
)

_INIT_STD = 0.02


QUERY_CHUNK = 1024  # at most this many vision attention queries per lax.map step
MIN_QUERY_CHUNK = 64  # ... and at least this many (fewer, longer steps for tiny windows)


@struct.dataclass
class VisionMeta:
    """Host-computed layout of the flat patch sequence (a pytree of arrays; the query chunk
    sizes are static: part of the tree's structure, so jit specialises on them)."""

    patch_perm: jax.Array  # i32[P] order in which the blocks see patches (window order)
    pos_hw: jax.Array  # i32[P, 2] (h, w) rotary coordinates, in block order
    full_seg: jax.Array  # i32[P] image-frame id, in block order (full attention)
    window_seg: jax.Array  # i32[P] window id, in block order (Qwen2.5 window attention)
    merge_unperm: jax.Array  # i32[M] merged tokens back to image order
    interp_idx: jax.Array | None  # i32[P, 4] Qwen3 bilinear taps into pos_embed
    interp_w: jax.Array | None  # f32[P, 4]
    # i32[ceil(P / QUERY_CHUNK), S]: the keys each query chunk can see (its segments are
    # contiguous runs, so a window of S keys from its first segment's start covers them);
    # None: every chunk scans all P keys (one chunk, or segments not contiguous).
    full_keys: jax.Array | None = None
    window_keys: jax.Array | None = None
    # Queries per attention step (`segment_attention`'s chunk): the most common segment length
    # (one screenshot, one window), so a chunk's keys are about one segment, not a 1024-query
    # chunk plus the images it straddles (the smoke's 432-patch screenshots: ~4x fewer scores).
    full_chunk: int = struct.field(pytree_node=False, default=QUERY_CHUNK)
    window_chunk: int = struct.field(pytree_node=False, default=QUERY_CHUNK)


def _block_order_hw(t: int, h: int, w: int, m: int) -> np.ndarray:
    """(h, w) coordinates of patches in spatial-merge-block order (transformers' patch order)."""
    hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // m, m, w // m, m)
    hh = hh.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    ww = ww.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    return np.tile(np.stack([hh, ww], -1), (t, 1))


def _window_index(grid_thw: np.ndarray, m: int, window_size: int, patch_size: int):
    """Port of transformers' get_vision_window_index: merged-token permutation + window sizes."""
    vit_win = window_size // m // patch_size
    index_all, lens = [], []
    offset = 0
    for t, h, w in grid_thw:
        gh, gw = h // m, w // m
        index = np.arange(t * gh * gw).reshape(t, gh, gw)
        ph, pw = vit_win - gh % vit_win, vit_win - gw % vit_win
        nh, nw = (gh + ph) // vit_win, (gw + pw) // vit_win
        padded = np.pad(index, ((0, 0), (0, ph), (0, pw)), constant_values=-100)
        padded = padded.reshape(t, nh, vit_win, nw, vit_win).transpose(0, 1, 3, 2, 4)
        padded = padded.reshape(t, nh * nw, vit_win * vit_win)
        lens.extend((padded != -100).sum(-1).reshape(-1).tolist())
        flat = padded.reshape(-1)
        index_all.append(flat[flat != -100] + offset)
        offset += t * gh * gw
    return np.concatenate(index_all), np.asarray(lens)


def _interp_taps(index: np.ndarray, size: np.ndarray, side: int):
    """Bilinear align_corners=True taps/weights along one axis (transformers' helper, in f32)."""
    src = (
        index.astype(np.float32) * np.float32(side - 1) / np.maximum(size - 1, 1).astype(np.float32)
    )
    floor = np.floor(src)
    offsets = np.arange(2)
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
    dist = np.abs(src[:, None] - floor[:, None] - offsets.astype(np.float32))
    return taps, np.clip(np.float32(1) - dist, 0, None).astype(np.float32)


def vision_metadata(cfg: QwenVLConfig, image_grid_thw: np.ndarray) -> VisionMeta:
    """Index arrays for the flat patch sequence of the images in `image_grid_thw` i[N, 3]."""
    v = cfg.vision
    m = v.spatial_merge_size
    grid = np.asarray(image_grid_thw, np.int64).reshape(-1, 3)
    if (grid[:, 1:] % m).any():
        raise ValueError(f"image_grid_thw h and w must be multiples of spatial_merge_size={m}")
    pos_hw = np.concatenate([_block_order_hw(t, h, w, m) for t, h, w in grid])
    frames = np.repeat(
        np.arange(int(grid[:, 0].sum())), np.repeat(grid[:, 1] * grid[:, 2], grid[:, 0])
    )
    P = len(pos_hw)
    unit = m * m
    if cfg.family == "qwen2_5_vl":
        win_index, lens = _window_index(grid, m, v.window_size, v.patch_size)
        patch_perm = (win_index[:, None] * unit + np.arange(unit)).reshape(-1)
        window_seg = np.repeat(np.arange(len(lens)), lens * unit)
        merge_unperm = np.argsort(win_index, kind="stable")
        interp_idx = interp_w = None
    else:
        patch_perm = np.arange(P)
        window_seg = frames
        merge_unperm = np.arange(P // unit)
        side = int(v.num_position_embeddings**0.5)
        sizes_h = np.repeat(
            np.repeat(grid[:, 1], grid[:, 0]), np.repeat(grid[:, 1] * grid[:, 2], grid[:, 0])
        )
        sizes_w = np.repeat(
            np.repeat(grid[:, 2], grid[:, 0]), np.repeat(grid[:, 1] * grid[:, 2], grid[:, 0])
        )
        ht, hw_ = _interp_taps(pos_hw[:, 0], sizes_h, side)
        wt, ww_ = _interp_taps(pos_hw[:, 1], sizes_w, side)
        interp_idx = jnp.asarray((ht[:, :, None] * side + wt[:, None, :]).reshape(P, 4), jnp.int32)
        interp_w = jnp.asarray((hw_[:, :, None] * ww_[:, None, :]).reshape(P, 4), jnp.float32)
    full_seg = frames[patch_perm]
    full_chunk = _query_chunk(full_seg)
    window_chunk = _query_chunk(window_seg)
    return VisionMeta(
        patch_perm=jnp.asarray(patch_perm, jnp.int32),
        pos_hw=jnp.asarray(pos_hw[patch_perm], jnp.int32),
        full_seg=jnp.asarray(full_seg, jnp.int32),
        window_seg=jnp.asarray(window_seg, jnp.int32),
        merge_unperm=jnp.asarray(merge_unperm, jnp.int32),
        interp_idx=interp_idx,
        interp_w=interp_w,
        full_keys=_chunk_keys(full_seg, full_chunk),
        window_keys=None
        if cfg.vision_family == "qwen3_vl"
        else _chunk_keys(window_seg, window_chunk),
        full_chunk=full_chunk,
        window_chunk=window_chunk,
    )


def _runs(seg_P: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of the runs of equal ids in `seg_P`."""
    starts = np.r_[0, np.flatnonzero(np.diff(seg_P)) + 1]
    return starts, np.r_[starts[1:], len(seg_P)]


def _query_chunk(seg_P: np.ndarray) -> int:
    """The most common run length of `seg_P` (an image's or a window's patches), clipped to
    [MIN_QUERY_CHUNK, QUERY_CHUNK]: chunks then line up with equal-sized segments."""
    starts, ends = _runs(seg_P)
    lengths = ends - starts
    typical = int(np.bincount(lengths).argmax()) if len(lengths) else QUERY_CHUNK
    return int(min(QUERY_CHUNK, max(MIN_QUERY_CHUNK, typical)))


def _chunk_keys(seg_P: np.ndarray, chunk: int = QUERY_CHUNK) -> jax.Array | None:
    """Key windows for `segment_attention`: with many images in a batch, a query chunk attends
    over its own images' patches (S ~ chunk + 2 x image) instead of all P patches."""
    P = len(seg_P)
    if P <= chunk:
        return None
    starts, ends = _runs(seg_P)
    if len(np.unique(seg_P[starts])) != len(starts):
        return None  # a segment in several runs: keep the exact all-keys scan
    run = np.repeat(np.arange(len(starts)), ends - starts)
    q0 = np.arange(-(-P // chunk)) * chunk
    q1 = np.minimum(q0 + chunk, P) - 1
    k0, k1 = starts[run[q0]], ends[run[q1]]
    span = -(-int((k1 - k0).max()) // 128) * 128  # rounded: few distinct shapes
    if span >= P:
        return None
    return jnp.asarray(k0[:, None] + np.arange(span), jnp.int32)  # >= P: masked out


class GELU(nnx.Module):
    """Exact (erf) GELU, a parameter-free slot so `merger.mlp.{0,2}` keep HF's indices."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.gelu(x, approximate=False)


def lift_pixels(rows_u8: jax.Array, cfg: QwenVLConfig) -> jax.Array:
    """f32[P, C*T*P*P] pixel_values from screens as bytes u8[P, C*P*P] (`data.image.patch_bytes`).

    Each byte becomes its normalized value by a lookup in the processor's own table
    (`data.image.normalize_table` of `cfg.pixel_config`, so the bits are those the host computes
    for f32 screens), repeated over the temporal patch, as transformers' processor repeats a
    still image. Screens travel and wait as bytes, 8x fewer than these floats.
    """
    v = cfg.vision
    c, t, pp = v.in_channels, v.temporal_patch_size, v.patch_size**2
    if rows_u8.shape[-1] != c * pp:
        raise ValueError(
            f"uint8 screens have rows of {rows_u8.shape[-1]} bytes; this vision tower takes "
            f"{c} x {v.patch_size} x {v.patch_size} = {c * pp}"
        )
    table = jnp.asarray(normalize_table(cfg.pixel_config).reshape(c, 256))
    idx = rows_u8.reshape(-1, c, pp).astype(jnp.int32)
    vals = table[jnp.arange(c)[None, :, None], idx]  # [P, C, pp]
    vals = jnp.broadcast_to(vals[:, :, None, :], (vals.shape[0], c, t, pp))
    return vals.reshape(-1, c * t * pp)


class PatchEmbed(nnx.Module):
    """Conv3d with stride == kernel, as a matmul over flattened patches (C = c*t*p*p)."""

    def __init__(self, cfg: QwenVLConfig, *, bias: bool, rngs: nnx.Rngs):
        v = cfg.vision
        pd = jdtype(cfg.param_dtype)
        C = v.in_channels * v.temporal_patch_size * v.patch_size**2
        self.proj = Linear(
            C,
            v.hidden_size,
            ("vision_patch", "vision_embed"),
            bias=bias,
            rngs=rngs,
            param_dtype=pd,
            dtype=jdtype(cfg.dtype),
        )

    def __call__(self, pixel_values_PC: jax.Array) -> jax.Array:
        return self.proj(pixel_values_PC)


class VisionAttention(nnx.Module):
    def __init__(self, cfg: QwenVLConfig, *, rngs: nnx.Rngs):
        v = cfg.vision
        kw = dict(rngs=rngs, param_dtype=jdtype(cfg.param_dtype), dtype=jdtype(cfg.dtype))
        self.num_heads, self.head_dim = v.num_heads, v.head_dim
        self.qkv = Linear(
            v.hidden_size, 3 * v.hidden_size, ("vision_embed", "vision_heads"), bias=True, **kw
        )
        self.proj = Linear(
            v.hidden_size, v.hidden_size, ("vision_heads", "vision_embed"), bias=True, **kw
        )

    def __call__(self, x_PD, cos, sin, seg_P, keys_nS=None, chunk=QUERY_CHUNK) -> jax.Array:
        P = x_PD.shape[0]
        qkv = self.qkv(x_PD).reshape(P, 3, self.num_heads, self.head_dim)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = segment_attention(q, k, v, seg_P, chunk, keys_nS)
        return self.proj(o.reshape(P, -1))


def segment_attention(
    q_PNH: jax.Array,
    k_PNH: jax.Array,
    v_PNH: jax.Array,
    seg_P: jax.Array,
    chunk: int = QUERY_CHUNK,
    keys_nS: jax.Array | None = None,
) -> jax.Array:
    """Bidirectional attention within equal segment ids (images / windows) of a flat sequence.

    Queries are processed `chunk` at a time (lax.map), so the score buffer is N x chunk x P
    instead of N x P x P (a 1280-token screenshot has 5120 patches). Each query row sees every
    key, or with `keys_nS` (`VisionMeta.full_keys` / `window_keys`) the S keys its chunk's
    segments can hold: the same result, without scanning every other image of the batch.
    """
    P = q_PNH.shape[0]
    if keys_nS is not None:
        n = keys_nS.shape[0]
        pad = n * chunk - P
        q = jnp.pad(q_PNH, ((0, pad), (0, 0), (0, 0))).reshape(n, chunk, *q_PNH.shape[1:])
        seg_q = jnp.pad(seg_P, (0, pad), constant_values=-1).reshape(n, chunk)

        def windowed(args):
            q_c, s_c, idx = args
            safe = jnp.minimum(idx, P - 1)
            k_seg = jnp.where(idx < P, seg_P[safe], -2)  # past the end: nobody's segment
            mask = (s_c[:, None] == k_seg[None, :])[None]
            return dense_attention(q_c[None], k_PNH[safe][None], v_PNH[safe][None], mask)[0]

        o = jax.lax.map(jax.checkpoint(windowed), (q, seg_q, keys_nS))
        return o.reshape(n * chunk, *q_PNH.shape[1:])[:P]
    if P <= chunk:
        mask = (seg_P[:, None] == seg_P[None, :])[None]
        return dense_attention(q_PNH[None], k_PNH[None], v_PNH[None], mask)[0]
    n = -(-P // chunk)
    pad = n * chunk - P
    q = jnp.pad(q_PNH, ((0, pad), (0, 0), (0, 0))).reshape(n, chunk, *q_PNH.shape[1:])
    seg_q = jnp.pad(seg_P, (0, pad), constant_values=-1).reshape(n, chunk)

    def one(args):
        q_c, s_c = args
        mask = (s_c[:, None] == seg_P[None, :])[None]
        return dense_attention(q_c[None], k_PNH[None], v_PNH[None], mask)[0]

    o = jax.lax.map(jax.checkpoint(one), (q, seg_q))
    return o.reshape(n * chunk, *q_PNH.shape[1:])[:P]


class VisionMLP(nnx.Module):
    """Qwen2.5: SwiGLU with bias (gate/up/down). Qwen3: fc1 -> GELU(tanh) -> fc2."""

    def __init__(self, cfg: QwenVLConfig, *, rngs: nnx.Rngs):
        v = cfg.vision
        kw = dict(rngs=rngs, param_dtype=jdtype(cfg.param_dtype), dtype=jdtype(cfg.dtype))
        up, down = ("vision_embed", "vision_mlp"), ("vision_mlp", "vision_embed")
        self.act = v.hidden_act
        if cfg.family == "qwen2_5_vl":
            self.gate_proj = Linear(v.hidden_size, v.intermediate_size, up, bias=True, **kw)
            self.up_proj = Linear(v.hidden_size, v.intermediate_size, up, bias=True, **kw)
            self.down_proj = Linear(v.intermediate_size, v.hidden_size, down, bias=True, **kw)
        else:
            self.linear_fc1 = Linear(v.hidden_size, v.intermediate_size, up, bias=True, **kw)
            self.linear_fc2 = Linear(v.intermediate_size, v.hidden_size, down, bias=True, **kw)

    def _act(self, x):
        if self.act == "silu":
            return jax.nn.silu(x)
        if self.act in ("gelu_pytorch_tanh", "gelu_new"):
            return jax.nn.gelu(x, approximate=True)
        if self.act == "gelu":
            return jax.nn.gelu(x, approximate=False)
        raise ValueError(f"vision_config.hidden_act={self.act!r} is not supported")

    def __call__(self, x):
        if hasattr(self, "gate_proj"):
            return self.down_proj(self._act(self.gate_proj(x)) * self.up_proj(x))
        return self.linear_fc2(self._act(self.linear_fc1(x)))


class VisionBlock(nnx.Module):
    def __init__(self, cfg: QwenVLConfig, *, rngs: nnx.Rngs):
        v = cfg.vision
        pd = jdtype(cfg.param_dtype)
        Norm = RMSNorm if cfg.family == "qwen2_5_vl" else LayerNorm
        self.norm1 = Norm(v.hidden_size, 1e-6, param_dtype=pd)
        self.norm2 = Norm(v.hidden_size, 1e-6, param_dtype=pd)
        self.attn = VisionAttention(cfg, rngs=rngs)
        self.mlp = VisionMLP(cfg, rngs=rngs)

    def __call__(self, x_PD, cos, sin, seg_P, keys_nS=None, chunk=QUERY_CHUNK):
        x_PD = x_PD + self.attn(self.norm1(x_PD), cos, sin, seg_P, keys_nS, chunk)
        return x_PD + self.mlp(self.norm2(x_PD))


class PatchMerger(nnx.Module):
    """Merge each 2x2 block of patches: norm -> [P/4, 4D] -> MLP -> E.

    Qwen2.5: `ln_q` (RMSNorm over D) + `mlp.{0,2}`. Qwen3: `norm` (LayerNorm over D, or over 4D
    after the shuffle for DeepStack mergers) + `linear_fc1/2`.
    """

    def __init__(self, cfg: QwenVLConfig, *, rngs: nnx.Rngs, postshuffle: bool = False):
        v = cfg.vision
        pd, dt = jdtype(cfg.param_dtype), jdtype(cfg.dtype)
        kw = dict(rngs=rngs, param_dtype=pd, dtype=dt)
        self.merged = v.hidden_size * v.spatial_merge_size**2
        self.postshuffle = postshuffle
        fc1_axes, fc2_axes = ("vision_merge", "vision_mlp"), ("vision_mlp", "embed")
        if cfg.family == "qwen2_5_vl":
            self.ln_q = RMSNorm(v.hidden_size, 1e-6, param_dtype=pd)
            self.mlp = nnx.List(
                [
                    Linear(self.merged, self.merged, fc1_axes, bias=True, **kw),
                    GELU(),
                    Linear(self.merged, v.out_hidden_size, fc2_axes, bias=True, **kw),
                ]
            )
        else:
            self.norm = LayerNorm(
                self.merged if postshuffle else v.hidden_size, 1e-6, param_dtype=pd
            )
            self.linear_fc1 = Linear(self.merged, self.merged, fc1_axes, bias=True, **kw)
            self.linear_fc2 = Linear(self.merged, v.out_hidden_size, fc2_axes, bias=True, **kw)

    def __call__(self, x_PD: jax.Array) -> jax.Array:
        if hasattr(self, "ln_q"):
            x = self.ln_q(x_PD).reshape(-1, self.merged)
            return self.mlp[2](self.mlp[1](self.mlp[0](x)))
        if self.postshuffle:
            x = self.norm(x_PD.reshape(-1, self.merged))
        else:
            x = self.norm(x_PD).reshape(-1, self.merged)
        return self.linear_fc2(jax.nn.gelu(self.linear_fc1(x), approximate=False))


class VisionModel(nnx.Module):
    """HF `model.visual` for both families.

    __call__(pixel_values f[P, C], meta) -> (merged f32[M, E] in image order,
    deepstack list of f32[M, E] (Qwen3; empty for Qwen2.5)).
    """

    def __init__(self, cfg: QwenVLConfig, *, rngs: nnx.Rngs):
        v = cfg.vision
        self.cfg = cfg
        q3 = cfg.vision_family == "qwen3_vl"
        self.patch_embed = PatchEmbed(cfg, bias=q3, rngs=rngs)
        if q3:
            w = (
                jax.random.normal(rngs.params(), (v.num_position_embeddings, v.hidden_size))
                * _INIT_STD
            )
            self.pos_embed = _Table(
                param(w.astype(jdtype(cfg.param_dtype)), ("vision_pos", "vision_embed"))
            )
        self.blocks = nnx.List([VisionBlock(cfg, rngs=rngs) for _ in range(v.depth)])
        self.merger = PatchMerger(cfg, rngs=rngs)
        if q3:
            self.deepstack_merger_list = nnx.List(
                [PatchMerger(cfg, rngs=rngs, postshuffle=True) for _ in v.deepstack_visual_indexes]
            )

    def __call__(self, pixel_values_PC: jax.Array, meta: VisionMeta):
        v = self.cfg.vision
        dt = jdtype(self.cfg.dtype)
        if pixel_values_PC.dtype == jnp.uint8:
            pixel_values_PC = lift_pixels(pixel_values_PC, self.cfg)
        x = self.patch_embed(pixel_values_PC.astype(dt))
        if self.cfg.vision_family == "qwen3_vl":
            table = self.pos_embed.weight[...]
            pe = (jnp.take(table, meta.interp_idx, axis=0) * meta.interp_w[..., None]).sum(1)
            x = x + pe.astype(x.dtype)
        x = jnp.take(x, meta.patch_perm, axis=0)
        cos, sin = vision_cos_sin(meta.pos_hw, v.head_dim, v.rope_theta)
        deepstack = []
        for i, blk in enumerate(self.blocks):
            full = self.cfg.vision_family == "qwen3_vl" or i in v.fullatt_block_indexes
            if full:
                args = (meta.full_seg, meta.full_keys, meta.full_chunk)
            else:
                args = (meta.window_seg, meta.window_keys, meta.window_chunk)
            x = self._run_block(blk, x, cos, sin, *args)
            if i in v.deepstack_visual_indexes:
                j = v.deepstack_visual_indexes.index(i)
                deepstack.append(self.deepstack_merger_list[j](x).astype(jnp.float32))
        merged = jnp.take(self.merger(x), meta.merge_unperm, axis=0)
        return merged.astype(jnp.float32), deepstack

    def _run_block(self, blk, x, cos, sin, seg, keys, chunk):
        """A vision block, wrapped in jax.checkpoint per cfg.remat as the decoder's layers are
        (`text.remat_call`): a learner's backward then keeps each block's input, not its MLP's
        4x-wide activations (for a real tower, tens of GiB over a step's screens)."""

        def call(blk, x, cos, sin, seg, keys):
            return blk(x, cos, sin, seg, keys, chunk)

        return remat_call(blk, self.cfg.remat, call, x, cos, sin, seg, keys)


class _Table(nnx.Module):
    """`pos_embed` (HF nn.Embedding): a learned [num_position_embeddings, D] table."""

    def __init__(self, weight: nnx.Param):
        self.weight = weight
