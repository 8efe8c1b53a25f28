"""Qwen-VL language decoder (Flax NNX) and the small layers the vision tower shares.

Letters: B batch, T q-len, S kv-len, N q-heads, K kv-heads, G q-per-kv, H head-dim, D model,
F mlp hidden, V vocab.

Attention is pluggable: every decoder layer calls `attn_fn(layer_idx, q_BTNH, k_BSKH, v_BSKH)`
with q/k after q/k-norm and rotary, so the same weights serve a dense training forward
(`make_dense_attn_fn`) and a paged-KV sampler that brings its own attention.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jax.sharding import Mesh, PartitionSpec

from cua_jax import sharding as shd
from cua_jax.models.qwen_vl.config import QwenVLConfig, splash_tile
from cua_jax.models.qwen_vl.moe import SparseMoeBlock
from cua_jax.models.qwen_vl.rope import apply_rotary
from cua_jax.models.qwen_vl.weights import INIT_STD, jdtype, param  # jdtype, param re-exported

AttnFn = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]

_MASK_VALUE = -1e30  # finite, so a fully masked (padding) row gives a uniform softmax, not NaN


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel is [in, out] (the HF weight transposed)."""

    def __init__(
        self,
        din: int,
        dout: int,
        axes: tuple[str, str],
        *,
        bias: bool,
        rngs: nnx.Rngs,
        param_dtype: jnp.dtype,
        dtype: jnp.dtype,
    ):
        w = jax.random.normal(rngs.params(), (din, dout), jnp.float32) * INIT_STD
        self.kernel = param(w.astype(param_dtype), axes)
        self.bias = param(jnp.zeros((dout,), param_dtype), (axes[1],)) if bias else None
        self.dtype = dtype
        self.axes = tuple(axes)

    def __call__(self, x: jax.Array) -> jax.Array:
        # in a learner's `training_layout`: the kernel all-gathered over the rows' mesh axes,
        # in the compute dtype, just before the matmul (FSDP); else as it is laid out
        kernel = shd.gathered(self.kernel[...].astype(self.dtype), self.axes)
        y = jnp.einsum("...i,io->...o", x.astype(self.dtype), kernel)
        if self.bias is not None:
            bias = shd.gathered(self.bias[...].astype(self.dtype), self.axes[1:])
            y = y + _last_axis(bias, y.ndim)
        return y


def _last_axis(v: jax.Array, ndim: int) -> jax.Array:
    """A vector laid along the last of `ndim` axes (explicit broadcasting: the tests raise on
    rank promotion)."""
    return v.reshape((1,) * (ndim - 1) + v.shape)


class RMSNorm(nnx.Module):
    """T5/Qwen RMSNorm: normalise in f32, cast back, then scale (same order as transformers)."""

    def __init__(self, dim: int, eps: float, *, param_dtype: jnp.dtype, axis: str = "norm"):
        self.weight = param(jnp.ones((dim,), param_dtype), (axis,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return _last_axis(self.weight[...].astype(x.dtype), x.ndim) * xf.astype(x.dtype)


class LayerNorm(nnx.Module):
    """LayerNorm with weight and bias (torch.nn.LayerNorm semantics), statistics in f32."""

    def __init__(self, dim: int, eps: float, *, param_dtype: jnp.dtype, axis: str = "norm"):
        self.weight = param(jnp.ones((dim,), param_dtype), (axis,))
        self.bias = param(jnp.zeros((dim,), param_dtype), (axis,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        w, b = (_last_axis(p[...].astype(jnp.float32), y.ndim) for p in (self.weight, self.bias))
        y = y * w + b
        return y.astype(x.dtype)


class Embed(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, rngs: nnx.Rngs, param_dtype: jnp.dtype):
        w = jax.random.normal(rngs.params(), (vocab, dim), jnp.float32) * INIT_STD
        self.weight = param(w.astype(param_dtype), ("vocab", "embed"))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0)


# ---------------------------------------------------------------------------------- attention
def dense_attention(
    q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, mask_BTS: jax.Array | None
) -> jax.Array:
    """Softmax attention with GQA; scores and softmax in f32. mask True = may attend."""
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    q = q_BTNH.reshape(B, T, K, N // K, H)
    s = jnp.einsum("btkgh,bskh->bkgts", q, k_BSKH, preferred_element_type=jnp.float32)
    s = s * (H**-0.5)
    if mask_BTS is not None:
        s = jnp.where(mask_BTS[:, None, None], s, _MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1).astype(v_BSKH.dtype)
    o = jnp.einsum("bkgts,bskh->btkgh", p, v_BSKH)
    return o.reshape(B, T, N, H)


def make_attention_mask(
    batch: int,
    seq_len: int,
    attention_mask: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """bool[B, T, T]: causal, keys with attention_mask==1, and (if given) the same segment id.

    segment_ids i32[B, T]: packed rows; 0 marks padding (never attended).
    """
    return block_mask(0, seq_len, seq_len, batch, attention_mask, segment_ids)


def block_mask(
    q_start: int,
    q_end: int,
    kv_len: int,
    batch: int,
    attention_mask: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """bool[B, q_end - q_start, kv_len]: rows q_start:q_end of the causal mask (keys with
    attention_mask 1, in the same non-zero segment), keys 0:kv_len (kv_len >= q_end: every key
    a causal row may see). `make_attention_mask` is the whole square."""
    q_pos = jnp.arange(q_start, q_end)
    k_pos = jnp.arange(kv_len)
    mask = jnp.broadcast_to(q_pos[:, None] >= k_pos[None, :], (batch, q_end - q_start, kv_len))
    if attention_mask is not None:
        mask = mask & (jnp.asarray(attention_mask)[:, :kv_len] != 0)[:, None, :]
    if segment_ids is not None:
        seg = jnp.asarray(segment_ids)
        q_seg, k_seg = seg[:, q_start:q_end], seg[:, :kv_len]
        mask = mask & (q_seg[:, :, None] == k_seg[:, None, :]) & (k_seg != 0)[:, None, :]
    return mask


def blockwise_attention(
    q_BTNH: jax.Array,
    k_BSKH: jax.Array,
    v_BSKH: jax.Array,
    block: int,
    attention_mask: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """`dense_attention` with the causal mask of `make_attention_mask`, in query blocks of
    `block` tokens: block i attends to keys 0:end_i only (the causal mask hides the rest, so
    about half the dense FLOPs), and its f32 scores are rematerialised in the backward pass, so
    at most one block's [B, heads, block, end_i] scores live at a time. Each query row sees the
    same keys with the same mask as the dense path (tests/models/test_blockwise_attention.py)."""
    B, T = q_BTNH.shape[:2]

    @jax.checkpoint
    def one(q, k, v, mask):
        return dense_attention(q, k, v, mask)

    outs = []
    for start in range(0, T, block):
        end = min(start + block, T)
        mask = block_mask(start, end, end, B, attention_mask, segment_ids)
        outs.append(one(q_BTNH[:, start:end], k_BSKH[:, :end], v_BSKH[:, :end], mask))
    return jnp.concatenate(outs, axis=1)


def splash_attention(
    q_BTNH: jax.Array,
    k_BSKH: jax.Array,
    v_BSKH: jax.Array,
    block: int,
    attention_mask: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    mesh: Mesh | None = None,
    rules: Sequence = (),
) -> jax.Array:
    """`dense_attention` with the causal mask of `make_attention_mask`, as JAX's Pallas TPU
    splash attention kernel (flash-style, online softmax in `block` x `block` tiles, causal
    tiles skipped, segment ids for packed rows; its own backward kernels): no [T, T] scores
    exist in HBM in either pass. Every real query row gets the dense path's output (padding
    rows attend among themselves; their outputs are never used).

    A TPU (Mosaic) kernel: on the CPU it runs in Pallas interpret mode (tests, the AOT plan
    compiles the real one for TPU devices); a GPU is refused. Under a mesh the kernel runs in
    `shard_map`: rows over the mesh axes of the logical "batch" axis, q / kv heads over those of
    "heads" when the kv heads divide evenly (else heads stay whole on each device).
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    if T % block or block % 128:
        raise ValueError(
            f"attn_impl='splash' needs row length {T} to be a multiple of its block {block}, "
            "and the block a multiple of 128 (model.attn_block; the TPU kernel's tiles)"
        )
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    if platform not in ("tpu", "cpu"):
        raise ValueError(
            f"attn_impl='splash' is a TPU kernel and cannot run on {platform}; "
            "use model.attn_impl='xla' (with model.attn_block for long rows)"
        )
    if segment_ids is not None:
        seg = jnp.asarray(segment_ids, jnp.int32)
        if attention_mask is not None:
            seg = jnp.where(jnp.asarray(attention_mask) != 0, seg, 0)
    elif attention_mask is not None:
        seg = (jnp.asarray(attention_mask) != 0).astype(jnp.int32)
    else:
        seg = jnp.ones((B, T), jnp.int32)

    def local(q, k, v, seg):
        b, _, n, _ = q.shape
        kk = k.shape[2]
        g = n // kk
        sizes = dict.fromkeys(("block_q", "block_kv", "block_kv_compute"), block)
        sizes.update(dict.fromkeys(("block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute"), block))
        sizes.update(dict.fromkeys(("block_q_dq", "block_kv_dq"), block))
        kernel = sk.make_splash_mqa(
            sm.MultiHeadMask([sm.CausalMask((T, T))] * g),
            block_sizes=sk.BlockSizes(**sizes),
            head_shards=1,
            q_seq_shards=1,
            interpret=platform != "tpu",
        )
        # f32 scale before the cast, as dense_attention scales its f32 scores
        qs = (q.astype(jnp.float32) * (H**-0.5)).astype(q.dtype)
        q_bkgth = jnp.transpose(qs.reshape(b, T, kk, g, H), (0, 2, 3, 1, 4))
        k_bkth, v_bkth = jnp.transpose(k, (0, 2, 1, 3)), jnp.transpose(v, (0, 2, 1, 3))

        def row(q_kgth, k_kth, v_kth, seg_t):
            ids = sk.SegmentIds(q=seg_t, kv=seg_t)
            return jax.vmap(lambda qh, kh, vh: kernel(qh, kh, vh, segment_ids=ids))(
                q_kgth, k_kth, v_kth
            )

        o = jax.vmap(row)(q_bkgth, k_bkth, v_bkth.astype(q.dtype), seg)  # [b, kk, g, T, H]
        return jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(b, T, n, H)

    if mesh is None or mesh.size == 1:
        return local(q_BTNH, k_BSKH.astype(q_BTNH.dtype), v_BSKH, seg)

    def axes(logical: str, size: int) -> str | tuple[str, ...] | None:
        target = dict(rules).get(logical)
        names = (target,) if isinstance(target, str) else tuple(target or ())
        names = tuple(a for a in names if a in mesh.axis_names and mesh.shape[a] > 1)
        n = 1
        for a in names:
            n *= mesh.shape[a]
        return names if names and size % n == 0 else None

    bs = axes("batch", B)
    hs = axes("heads", K)  # kv heads split like q heads: each device keeps whole GQA groups
    qspec = PartitionSpec(bs, None, hs, None)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(qspec, qspec, qspec, PartitionSpec(bs, None)),
        out_specs=qspec,
        check_vma=False,  # the Pallas kernel carries no varying-axes annotations
    )(q_BTNH, k_BSKH.astype(q_BTNH.dtype), v_BSKH, seg)


def make_dense_attn_fn(
    attention_mask: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    block: int = 0,
    impl: str = "xla",
    mesh: Mesh | None = None,
    rules: Sequence = (),
) -> AttnFn:
    """The default `attn_fn`: causal attention over the whole [B, T] sequence, dense, or in
    query blocks of `block` tokens when 0 < block < T (`blockwise_attention`); with
    impl="splash", the Pallas splash kernel in `block` (512 when 0) tiles on `mesh` under
    `rules` (`splash_attention`).

    `attention_mask` i[B, T] (1 = real token) and `segment_ids` i32[B, T] (0 = padding; tokens
    attend only within their own segment) are the same inputs as the model's __call__.
    """

    def attn_fn(layer_idx: int, q_BTNH: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        del layer_idx
        B, T = q_BTNH.shape[:2]
        if impl == "splash":
            tile = splash_tile(block, T)
            return splash_attention(q_BTNH, k, v, tile, attention_mask, segment_ids, mesh, rules)
        if 0 < block < T:
            return blockwise_attention(q_BTNH, k, v, block, attention_mask, segment_ids)
        return dense_attention(q_BTNH, k, v, make_attention_mask(B, T, attention_mask, segment_ids))

    return attn_fn


class Attention(nnx.Module):
    def __init__(self, cfg: QwenVLConfig, *, rngs: nnx.Rngs):
        t = cfg.text
        pd, dt = jdtype(cfg.param_dtype), jdtype(cfg.dtype)
        kw = dict(rngs=rngs, param_dtype=pd, dtype=dt)
        N, K, H = t.num_attention_heads, t.num_key_value_heads, t.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = N, K, H
        self.q_proj = Linear(t.hidden_size, N * H, ("embed", "heads"), bias=t.attention_bias, **kw)
        self.k_proj = Linear(
            t.hidden_size, K * H, ("embed", "kv_heads"), bias=t.attention_bias, **kw
        )
        self.v_proj = Linear(
            t.hidden_size, K * H, ("embed", "kv_heads"), bias=t.attention_bias, **kw
        )
        self.o_proj = Linear(N * H, t.hidden_size, ("heads", "embed"), bias=False, **kw)
        if t.qk_norm:
            self.q_norm = RMSNorm(H, t.rms_norm_eps, param_dtype=pd, axis="head_dim")
            self.k_norm = RMSNorm(H, t.rms_norm_eps, param_dtype=pd, axis="head_dim")
        else:
            self.q_norm = self.k_norm = None

    def __call__(self, x_BTD, cos, sin, attn_fn: AttnFn, layer_idx: int) -> jax.Array:
        B, T, _ = x_BTD.shape
        q = self.q_proj(x_BTD).reshape(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x_BTD).reshape(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x_BTD).reshape(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = attn_fn(layer_idx, q, k, v)
        return self.o_proj(o.reshape(B, T, self.num_heads * self.head_dim))


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). `intermediate_size` (default: the config's) sets
    the width, e.g. Qwen3.5-MoE's shared expert."""

    def __init__(self, cfg: QwenVLConfig, *, rngs: nnx.Rngs, intermediate_size: int | None = None):
        t = cfg.text
        F = intermediate_size or t.intermediate_size
        kw = dict(rngs=rngs, param_dtype=jdtype(cfg.param_dtype), dtype=jdtype(cfg.dtype))
        self.gate_proj = Linear(t.hidden_size, F, ("embed", "mlp"), bias=False, **kw)
        self.up_proj = Linear(t.hidden_size, F, ("embed", "mlp"), bias=False, **kw)
        self.down_proj = Linear(F, t.hidden_size, ("mlp", "embed"), bias=False, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """Pre-norm attention + MLP. Layer `layer_idx` of a MoE config whose `is_sparse_layer` holds
    gets the sparse block (`moe.SparseMoeBlock`) as its `mlp`, the others the dense SwiGLU."""

    def __init__(self, cfg: QwenVLConfig, layer_idx: int = 0, *, rngs: nnx.Rngs):
        t = cfg.text
        pd = jdtype(cfg.param_dtype)
        self.self_attn = Attention(cfg, rngs=rngs)
        sparse = t.is_sparse_layer(layer_idx)
        self.mlp = SparseMoeBlock(cfg, rngs=rngs) if sparse else MLP(cfg, rngs=rngs)
        self.input_layernorm = RMSNorm(t.hidden_size, t.rms_norm_eps, param_dtype=pd)
        self.post_attention_layernorm = RMSNorm(t.hidden_size, t.rms_norm_eps, param_dtype=pd)

    def __call__(
        self, h_BTD, cos, sin, attn_fn: AttnFn, layer_idx: int, routes_BTK: jax.Array | None = None
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """-> (hidden, None) for a dense layer; (hidden, (router logits f32[B, T, E], experts
        i32[B, T, K])) for a sparse one, which routes by `routes_BTK` when given (replay)."""
        h_BTD = h_BTD + self.self_attn(self.input_layernorm(h_BTD), cos, sin, attn_fn, layer_idx)
        x = self.post_attention_layernorm(h_BTD)
        if isinstance(self.mlp, MLP):
            return h_BTD + self.mlp(x), None
        y, logits, experts = self.mlp(x, routes_BTK)
        return h_BTD + y, (logits, experts)


class TextModel(nnx.Module):
    """HF `model.language_model`: embed_tokens, layers[i], norm."""

    def __init__(self, cfg: QwenVLConfig, *, rngs: nnx.Rngs):
        t = cfg.text
        pd = jdtype(cfg.param_dtype)
        self.cfg = cfg
        self.embed_tokens = Embed(t.vocab_size, t.hidden_size, rngs=rngs, param_dtype=pd)
        self.layers = nnx.List(
            [DecoderLayer(cfg, i, rngs=rngs) for i in range(t.num_hidden_layers)]
        )
        self.norm = RMSNorm(t.hidden_size, t.rms_norm_eps, param_dtype=pd)

    def run_layer(
        self, i: int, h_BTD, cos, sin, attn_fn: AttnFn, routes_BTK: jax.Array | None = None
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """Layer i (see DecoderLayer.__call__), wrapped in jax.checkpoint per cfg.remat."""

        def call(layer, h, cos, sin, routes):
            return layer(h, cos, sin, attn_fn, i, routes)

        return remat_call(self.layers[i], self.cfg.remat, call, h_BTD, cos, sin, routes_BTK)


def remat_call(module: nnx.Module, remat: str, call, *args):
    """`call(module, *args)` (array args), wrapped in `jax.checkpoint` per `remat`: "none" as
    is; "full" keeps only the inputs for the backward; "dots" also keeps matmul outputs without
    batch dims; "ordered" keeps only the inputs as "full" does, in the backward order
    `ordered_checkpoint` pins. The decoder's layers and the vision tower's blocks both go
    through here."""
    if remat == "none":
        return call(module, *args)
    graphdef, state = nnx.split(module)

    def f(state, *args):
        return call(nnx.merge(graphdef, state), *args)

    if remat == "ordered":
        return ordered_checkpoint(f)(state, *args)
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable if remat == "dots" else None
    return jax.checkpoint(f, policy=policy)(state, *args)


def _is_primal(x) -> bool:
    return isinstance(x, CustomVJPPrimal)


def _zeros_for(ct):
    """A cotangent with its symbolic zeros made real (float0 for integer outputs)."""

    def one(c):
        if not isinstance(c, SymbolicZero):
            return c
        if c.aval.dtype == jax.dtypes.float0:
            return np.zeros(c.aval.shape, jax.dtypes.float0)
        return jnp.zeros(c.aval.shape, c.aval.dtype)

    return jax.tree.map(one, ct, is_leaf=lambda x: isinstance(x, SymbolicZero))


def _barrier(tree):
    """`jax.lax.optimization_barrier` over the float leaves of `tree` (float0 ones as they are)."""
    leaves, treedef = jax.tree.flatten(tree)
    idx = [i for i, x in enumerate(leaves) if getattr(x, "dtype", None) != jax.dtypes.float0]
    held = jax.lax.optimization_barrier([leaves[i] for i in idx])
    for i, x in zip(idx, held, strict=True):
        leaves[i] = x
    return treedef.unflatten(leaves)


def ordered_checkpoint(f: Callable) -> Callable:
    """`f` rematerialised as `jax.checkpoint(f)` is (only its inputs kept for the backward), with
    the backward held to the layer's turn by two optimization barriers: the recompute waits for
    the incoming cotangent, and the parameters' cotangents are made before the input's is handed
    to the layer below. Under `jax.checkpoint` the TPU compiler was free to move work across
    layers: it kept each MoE layer's [rows, D] expert-input gathers alive from that layer's
    backward to the end of the program for the expert LoRA's weight gradients, scheduled last,
    so a 30B-A3B layer's gradient with all-to-all dispatch grew 2.3-3.7 GiB of temporaries a
    layer; with the barriers it stays flat (BENCHMARKS.md "MoE rows over the expert devices").
    Only the perturbed inputs (what the caller differentiates) get cotangents, so frozen base
    weights cost no weight gradient."""
    seen: dict = {}

    @jax.custom_vjp
    def g(*args):
        return f(*args)

    def fwd(*args):
        vals = jax.tree.map(lambda p: p.value, args, is_leaf=_is_primal)
        seen["perturbed"] = jax.tree.map(lambda p: p.perturbed, args, is_leaf=_is_primal)
        return f(*vals), vals

    def bwd(vals, ct):
        vals, ct = _barrier((vals, _zeros_for(ct)))
        flat, treedef = jax.tree.flatten(vals)
        perturbed = treedef.flatten_up_to(seen["perturbed"])
        idx = [i for i, p in enumerate(perturbed) if p]

        def h(*diff):
            full = list(flat)
            for i, x in zip(idx, diff, strict=True):
                full[i] = x
            return f(*treedef.unflatten(full))

        _, vjp = jax.vjp(h, *[flat[i] for i in idx])
        grads = _barrier(vjp(ct))
        out = [None] * len(flat)
        for i, x in zip(idx, grads, strict=True):
            out[i] = x
        return tuple(treedef.unflatten(out))

    g.defvjp(fwd, bwd, symbolic_zeros=True)
    return g


def deepstack_add(h_BTD: jax.Array, ds_BTD: jax.Array, mask_BT: jax.Array) -> jax.Array:
    """Add DeepStack visual features at visual positions (zeros elsewhere by construction)."""
    return h_BTD + jnp.where(mask_BT[..., None], ds_BTD, 0).astype(h_BTD.dtype)


__all__ = [
    "AttnFn",
    "Attention",
    "DecoderLayer",
    "Embed",
    "LayerNorm",
    "Linear",
    "MLP",
    "RMSNorm",
    "TextModel",
    "dense_attention",
    "deepstack_add",
    "make_attention_mask",
    "make_dense_attn_fn",
    "splash_attention",
    "splash_tile",
]
