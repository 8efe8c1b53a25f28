"""The sampler's programs planned: one decode step of every slot over the KV pool and the prefill
of a real turn; the KV pool sized from memory (`size_kv_pool`, `sampler_pool_cut`) or refused
(`kv_pool_problem`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from cua_jax.models import qwen_vl
from cua_jax.plan.abstract import (
    SYSTEM_TOKENS,
    _Abstract,
    _compile,
    _text_param_count,
    trainer_rl_shapes,
)
from cua_jax.plan.hardware import Chip, GiB, PlanInputError
from cua_jax.plan.report import (
    SAMPLER_CACHE,
    ProgramPlan,
    set_sampler_cache,
    tree_shard_bytes,
)
from cua_jax.sampler import kv_cache, steps
from cua_jax.sampler.kernels.paged_attention import GpuKernelOptions, select_backend
from cua_jax.sampler.kv_cache import kv_pages_for_budget, kv_pool_bytes_per_device
from cua_jax.sampler.placement import kv_sharding
from cua_jax.sampler.scheduler import token_bucket


# ------------------------------------------------------------------------------- decode step
def sampler_cache(cfg: Any, sc: Any, mesh: Any, num_pages: int) -> kv_cache.KVCache:
    """The Engine's cache as abstract arrays with its shardings: a page pool a attention layer
    (`kv_cache.kv_layers`: a hybrid model's full-attention layers only), kv heads over `tensor`,
    and for a hybrid model (Qwen3.5) every linear layer's state rows (`steps.linear_state_rows`
    of `sampler.max_slots`), sharded by `steps.linear_state_sharding`."""
    t = cfg.text
    kv_sh = kv_sharding(mesh)  # as the engine lays out its pools
    shapes = steps.linear_cache_shapes(cfg, steps.linear_state_rows(sc.max_slots))
    linear = ()
    if shapes:
        small = NamedSharding(mesh, P())
        state_sh = steps.linear_state_sharding(steps.StepShardings(None, kv_sh, small), cfg)
        linear = tuple(
            jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), st, state_sh
            )
            for st in shapes
        )
    return steps.abstract_cache(
        len(kv_cache.kv_layers(cfg)),
        t.num_key_value_heads,
        num_pages,
        sc.page_size,
        t.head_dim,
        jnp.dtype(cfg.dtype),
        kv_sh,
        linear,
    )


def _cache_arguments(cache: kv_cache.KVCache, num_pages: int) -> dict[str, int]:
    """A sampler program's cache arguments by part: the KV pool, and a hybrid model's states."""
    out = {f"KV pool ({num_pages} pages)": tree_shard_bytes((cache.k, cache.v))}
    if cache.linear:
        rows = cache.linear[0].recurrent.shape[0]
        out[f"linear states ({len(cache.linear)} layers x {rows} rows)"] = tree_shard_bytes(
            cache.linear
        )
    return out


def _engine_step_fns(
    ab: _Abstract, sc: Any, mesh: Any, backend: str, params: Any, kv_sh: Any, repl: Any
) -> Any:
    """The engine's own jitted step functions (cua_jax.sampler.steps), sharded as the engine
    shards them: params in place with the learner's shardings, pools over kv heads."""
    t = ab.learner.config.text
    step_cfg = steps.StepConfig(
        page_size=sc.page_size,
        decode_chunk=sc.decode_chunk,
        head_dim=t.head_dim,
        attn_backend=backend,
        attn_options=GpuKernelOptions(),
        mesh=mesh,
    )
    shardings = steps.StepShardings(
        params=jax.tree.map(lambda x: x.sharding, params), cache=kv_sh, small=repl
    )
    n_kv = len(kv_cache.kv_layers(ab.learner.config))
    return steps.build_step_fns(ab.decode_model, step_cfg, shardings, n_kv)


def plan_decode_step(
    config: Any, ab: _Abstract, mesh: Any, chip: Chip, num_pages: int, backend: str
) -> ProgramPlan:

    cfg = ab.learner.config
    t = cfg.text
    sc = config.sampler
    S, L = sc.max_slots, sc.page_size
    tensor = mesh.shape["tensor"]
    if t.num_key_value_heads % tensor:
        raise PlanInputError(
            f"num_key_value_heads={t.num_key_value_heads} is not divisible by mesh.tensor="
            f"{tensor}: the sampler shards K/V over kv heads; change --config.mesh.tensor"
        )
    pages_per_seq = -(-sc.max_seq_len // L)
    # Every slot live, the pool shared evenly: each slot's context is what the pool can hold.
    ctx = min(sc.max_seq_len, (num_pages - 1) * L // S)
    cache_dtype = jnp.dtype(cfg.dtype)

    kv_sh = kv_sharding(mesh)
    cache = sampler_cache(cfg, sc, mesh, num_pages)
    n_kv = len(cache.k)  # a hybrid model's full-attention layers
    repl = NamedSharding(mesh, P())
    params = nnx.merge_state(ab.trainable, ab.frozen, ab.rest)
    arguments = {"params": tree_shard_bytes(params), **_cache_arguments(cache, num_pages)}
    resident = {"optimizer state (learner, resident)": tree_shard_bytes(ab.opt_state)}
    if ab.ref is not None:
        resident["KL reference (learner, resident)"] = tree_shard_bytes(ab.ref)
    prog = ProgramPlan("decode_step", chip, arguments, resident)
    prog.kind = "sampler"
    # As the engine decides: the TPU kernel, or the jnp reference where it cannot take the shapes.
    platform = mesh.devices.flat[0].platform
    backend = select_backend(backend, head_dim=t.head_dim, page_size=L, platform=platform)
    # The kernel, by hand (XLA's cost analysis counts a Pallas call as almost nothing): per
    # layer and slot, q.k and p.v over ctx tokens (4 N H ctx FLOPs) reading K and V of ctx
    # tokens (2 K H ctx x dtype bytes); heads split over `tensor`.
    per_layer = S * ctx * t.head_dim
    attn_flops = 4 * t.num_attention_heads * per_layer * n_kv / tensor
    kv_read = 2 * t.num_key_value_heads * per_layer * cache_dtype.itemsize * n_kv
    kv_read /= tensor
    if backend in ("tpu", "gpu"):  # Pallas calls (Mosaic / Triton)
        prog.pallas_flops, prog.pallas_bytes = attn_flops, kv_read
    n_text = _text_param_count(params)
    prog.model_flops = (2 * n_text * S) / mesh.size + attn_flops
    # A decode step must read every text weight once (each device its shard, FSDP gathers
    # the rest: the shard is what HBM serves), the live K/V, and a hybrid model's live slots'
    # linear states (read and written: the recurrent state is the layer's whole memory).
    live_states = 2 * tree_shard_bytes(cache.linear) * S // max(steps.linear_state_rows(S), 1)
    prog.min_bytes = tree_shard_bytes(_text_only(params)) + kv_read + live_states
    prog.notes.append(
        f"{S} slots x context {ctx} (pool {num_pages} x {L} tokens, max_seq_len "
        f"{sc.max_seq_len}, {pages_per_seq} pages a sequence); the engine's decode chunk "
        f"(steps.decode_paged): XLA counts its loop body once, so FLOPs and bytes are one of "
        f"its {sc.decode_chunk} steps; "
        f"paged attention: {backend} kernel, K/V {cache_dtype.name} sharded over tensor={tensor}"
        + (
            f"; {n_kv} of {t.num_hidden_layers} layers attend, the other "
            f"{len(cache.linear)} keep Gated DeltaNet states"
            if cache.linear
            else ""
        )
    )

    # The engine's own jitted decode chunk (cua_jax.sampler.steps), sharded as the engine
    # shards it: params in place with the learner's shardings, pools over kv heads.
    fns = _engine_step_fns(ab, config.sampler, mesh, backend, params, kv_sh, repl)
    fn = fns.decode_paged
    args = (params, cache, *steps.decode_arg_shapes(S, pages_per_seq))
    _compile(fn, args, prog)
    return prog


def plan_prefill_turn(
    config: Any, ab: _Abstract, mesh: Any, chip: Chip, num_pages: int, backend: str
) -> ProgramPlan:
    """The sampler's prefill of one real turn: one row of the preset's `env.max_history_images`
    screens at its viewport with `SYSTEM_TOKENS` of prompt, in the engine's token bucket, its
    whole page table, with the KV pool resident as the decode step has it (the engine's
    `prefill(grid)` program, `cua_jax.sampler.steps`)."""

    cfg = ab.learner.config
    t, v = cfg.text, cfg.vision
    sc, env = config.sampler, config.env
    L = sc.page_size
    shapes = trainer_rl_shapes(config, ab.learner)
    grid = shapes.grid
    unit = int(np.prod(grid))
    screens = env.max_history_images
    tokens = screens * (unit // v.spatial_merge_size**2 + 2) + SYSTEM_TOKENS
    T = min(token_bucket(tokens), sc.max_seq_len)
    cols = -(-sc.max_seq_len // L)
    dim = cfg.pixel_width
    kv_sh = kv_sharding(mesh)
    cache = sampler_cache(cfg, sc, mesh, num_pages)
    params = nnx.merge_state(ab.trainable, ab.frozen, ab.rest)
    repl = NamedSharding(mesh, P())
    arguments = {
        "params": tree_shard_bytes(params),
        **_cache_arguments(cache, num_pages),
        "the turn's screens": screens * unit * dim * np.dtype(cfg.pixel_dtype).itemsize,
    }
    resident = {"optimizer state (learner, resident)": tree_shard_bytes(ab.opt_state)}
    if ab.ref is not None:
        resident["KL reference (learner, resident)"] = tree_shard_bytes(ab.ref)
    prog = ProgramPlan("prefill_turn", chip, arguments, resident)
    prog.kind, prog.rows, prog.row_length, prog.screens = "sampler", 1, T, screens
    platform = mesh.devices.flat[0].platform
    backend = select_backend(backend, head_dim=t.head_dim, page_size=L, platform=platform)
    fns = _engine_step_fns(ab, config.sampler, mesh, backend, params, kv_sh, repl)
    prog.notes.append(
        f"one turn: {screens} screens of {unit} patches and about {tokens} tokens in a "
        f"{T}-token prefill, a {cols}-column page table"
        + (f" (a turn is longer than sampler.max_seq_len={sc.max_seq_len})" if tokens > T else "")
    )
    args = (
        params,
        cache,
        *steps.prefill_arg_shapes(1, T, cols, (screens * unit, dim), cfg.pixel_dtype),
    )
    _compile(fns.prefill((tuple(grid),) * screens), args, prog)
    return prog


def _text_only(state: Any) -> list[Any]:
    return [
        x
        for p, x in jax.tree_util.tree_flatten_with_path(state)[0]
        if "visual" not in jax.tree_util.keystr(p)
    ]


# ------------------------------------------------------------------------------- KV pool sizing
def size_kv_pool(
    cfg: qwen_vl.QwenVLConfig,
    sc: Any,
    tensor: int,
    hbm: int,
    frac: float,
    programs: list,
    state_bytes: int = 0,
) -> tuple[int, int, str]:
    """(pages, bytes a device, a note) of the KV pool sized from memory: `frac` of the chip's
    HBM less the largest planned program's peak without the sampler's cache resident beside it
    (as the run measures its learner before the engine exists) and a hybrid model's linear
    states (`state_bytes` a device, as `builders.kv_pages` takes them), in whole pages of
    `kv_pool_bytes_per_device`; each program's resident sampler cache is set to pool + states.
    (The learner's programs are planned with the states resident: counted once, not twice.)"""
    peak = max((p.total_bytes - p.resident.get(SAMPLER_CACHE, 0) for p in programs), default=0)
    pages = kv_pages_for_budget(
        cfg, max(0, int(hbm * frac) - peak - state_bytes), sc.page_size, cfg.dtype, tensor
    )
    kv = kv_pool_bytes_per_device(cfg, pages, sc.page_size, cfg.dtype, tensor)
    set_sampler_cache(programs, kv + state_bytes)
    note = (
        f"{pages} pages: {frac:.0%} of {hbm / GiB:.0f} GiB less the largest learner program's "
        f"{peak / GiB:.2f} GiB"
        + (f" and {state_bytes / GiB:.2f} GiB of linear states" if state_bytes else "")
        + " (sampler.kv_memory_fraction)"
    )
    return pages, kv, note


def sampler_pool_cut(sampler: list[ProgramPlan], hbm: int, frac: float, per_page: int) -> int:
    """KV pages the pool sized from the learner's programs (`size_kv_pool`) must give up so that
    every sampler program (`decode_step`, `prefill_turn`, each with that pool among its
    arguments) peaks within `frac` of `hbm`: its excess over that share in whole pages of
    `per_page` bytes (0 when none is over; a program the compiler refused counts at the
    temporaries it said it needed)."""
    peaks = [p.total_bytes for p in sampler if p.compile_error is None or p.temp_bytes]
    over = max(peaks, default=0) - int(hbm * frac)
    return -(-over // per_page) if over > 0 else 0


def kv_pool_problem(
    cfg: qwen_vl.QwenVLConfig,
    sc: Any,
    pages: int,
    tensor: int,
    hbm: int,
    min_frac: float,
    vision_trained: bool = False,
) -> str:
    """Why a run stops at start with the pool of `pages` a device sized from memory, as
    `builders.kv_pages` refuses it: less than `min_frac` (sampler.kv_min_fraction) of `hbm`, or
    not one sequence of sampler.max_seq_len past the scratch page 0; "" when neither.
    `vision_trained` (full fine-tuning of the vision tower too) adds model.freeze_vision to what
    to change: the tower's gradients, optimizer state and saved activations leave the learner."""
    pool = kv_pool_bytes_per_device(cfg, pages, sc.page_size, cfg.dtype, tensor)
    freeze = "--config.model.freeze_vision=True, " if vision_trained else ""
    fix = (
        f"{freeze}lower --config.rl.tokens_per_chip or --config.sampler.kv_min_fraction, a "
        "larger --config.mesh.tensor (K/V and activations split over it), or a larger topology"
    )
    if pool < min_frac * hbm:
        return (
            f"the KV pool gets {pool / GiB:.2f} GiB ({pages} pages) a device, less than "
            f"sampler.kv_min_fraction={min_frac} of {hbm / GiB:.0f} GiB "
            f"({min_frac * hbm / GiB:.2f} GiB): a run stops at start; {fix}"
        )
    if (pages - 1) * sc.page_size < sc.max_seq_len:
        return (
            f"the KV pool gets {pages} pages of {sc.page_size} tokens, not one sequence of "
            f"sampler.max_seq_len={sc.max_seq_len} past the scratch page: a run stops at "
            f"start; {fix}, or a shorter --config.sampler.max_seq_len"
        )
    return ""
