"""The learner's programs planned: the RL step (text only, or at the shape set's largest shape
with its screens), a token budget's chunk gradient programs and update on a batch drawn from the
preset's env settings (fitted to the chip: `next_budget`), SDPO's step and teacher pass, and the
SFT programs."""

from __future__ import annotations

import copy
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cua_jax import sharding as shd
from cua_jax.job import builders
from cua_jax.models import qwen_vl
from cua_jax.models.qwen_vl.config import splash_tile
from cua_jax.plan.abstract import (
    ACTION_TOKENS,
    FEEDBACK_TOKENS,
    SYSTEM_TOKENS,
    _Abstract,
    _compile,
    _text_param_count,
    build_abstract,
    trainer_rl_shapes,
)
from cua_jax.plan.hardware import Chip, PlanInputError
from cua_jax.plan.report import SAMPLER_CACHE, ProgramPlan, tree_shard_bytes
from cua_jax.rl import batching, sdpo
from cua_jax.rl.image_groups import ImageGroups
from cua_jax.rl.learner import APPLY_PROGRAM
from cua_jax.rl.shapes import ShapeError, teacher_row_length
from cua_jax.rl.trajectory import Trajectory, Turn, trajectory_to_samples


# ------------------------------------------------------------------------------- train step
def plan_train_step(
    config: Any,
    ab: _Abstract,
    mesh: Any,
    chip: Chip,
    rows: int,
    row_len: int,
    kv_bytes: int,
    shapes: Any,
) -> ProgramPlan:
    """The RL step on `rows` text-only rows of `row_len`; its notes name the trainer's largest
    RL shape of `shapes` (`trainer_rl_shapes`) when that is larger."""
    learner = ab.learner
    xs = _step_inputs(learner, rows, row_len)
    args = (ab.trainable, ab.opt_state, ab.frozen, ab.rest, ab.ref, xs, None)
    arguments = _step_arguments(ab, xs, "batch")
    prog = ProgramPlan("train_step", chip, arguments, {SAMPLER_CACHE: kv_bytes})
    prog.kind, prog.rows, prog.row_length = "learner", rows, row_len
    # Model FLOPs per device (`_model_flops`).
    tokens = rows * row_len
    prog.model_flops = _model_flops(ab, tokens, row_len) / mesh.size
    prog.notes.append(
        f"{rows} rows x {row_len} tokens, text only (no screenshots); "
        f"remat={ab.learner.config.remat}, logits_chunk={ab.learner.logits_chunk}"
    )
    largest = largest_rl_shape(shapes)
    if largest.rows * largest.length > tokens or largest.patches:
        prog.notes.append(
            f"the trainer's largest RL batch is {largest.rows} rows x {largest.length} tokens "
            f"+ {largest.patches} screen patches (its shape set): --programs=train_step_screens "
            "plans that program"
        )
    if ab.learner.config.attn_impl == "splash":
        prog.pallas_flops, prog.pallas_bytes = _splash_cost(ab.learner.config, rows, row_len, mesh)
        prog.notes.append("splash attention (Pallas): FLOPs and bytes counted by hand")
    _compile(learner.step_program("rl"), args, prog)
    s = learner.num_substeps
    if s > 1 and prog.compile_error is None:
        # XLA's cost analysis counts a loop body once: the micro-batch scan runs it s times (the
        # embedding stage and the optimizer update outside it are counted s times too: a
        # slight overcount)
        prog.flops *= s
        prog.bytes_accessed *= s
        prog.notes.append(f"FLOPs and bytes: XLA's count x {s} micro-batches")
    return prog


def largest_rl_shape(shapes: Any) -> Any:
    """The RL shape of a shape set with the most tokens (then the most patches)."""
    return max(shapes.rl, key=lambda sh: (sh.rows * sh.length, sh.patches))


def plan_train_step_screens(
    ab: _Abstract, chip: Chip, kv_bytes: int, shapes: Any, mode: str = "rl"
) -> ProgramPlan:
    """The RL step at the largest shape of the trainer's shape set (most tokens), its screens
    through the vision tower: the program the trainer compiles for its biggest batch. The
    screens are laid out as the learner lays them out (`BatchLayout.device_batch`): grouped by
    micro-batch and device (`cua_jax.rl.image_groups`), sharded over the batch axes, in the
    model's compute dtype. `mode="sft"`: the SFT step at the largest SFT shape instead."""
    learner = ab.learner
    cfg = learner.config
    shape = max(shapes.of(mode), key=lambda sh: (sh.rows * sh.length, sh.patches))
    xs = _step_inputs(learner, shape.rows, shape.length)
    s, b = learner.num_substeps, learner.layout.batch_parallel
    images, per_group, unit = _abstract_screens(learner, shape, shapes.grid)
    arguments = _step_arguments(ab, xs, "batch (text)")
    arguments["screens (pixel values by micro-batch and device, and layout)"] = tree_shard_bytes(
        images
    )
    name = "train_step_screens" if mode == "rl" else f"{mode}_step_screens"
    prog = ProgramPlan(name, chip, arguments, {SAMPLER_CACHE: kv_bytes})
    screens = shape.patches // unit
    prog.kind = "learner" if mode == "rl" else mode
    prog.rows, prog.row_length, prog.screens = shape.rows, shape.length, screens
    prog.notes.append(
        f"the trainer's largest {mode.upper()} shape: {shape.rows} rows x {shape.length} tokens "
        f"and {screens} screens of {unit} patches ({shape.patches} patches) through the vision "
        f"tower, {per_group} a (micro-batch, device) group of {s} x {b}; shape set: "
        f"{', '.join(map(str, shapes.of(mode)))}; {s} micro-batches, remat={cfg.remat}"
    )
    args = (ab.trainable, ab.opt_state, ab.frozen, ab.rest, ab.ref, xs, images)
    _compile(learner.step_program(mode, grouped=True), args, prog)
    return prog


def _model_flops(ab: _Abstract, tokens: float, row_len: int, useful: float = 1.0) -> float:
    """Model FLOPs of a learner pass over `tokens` tokens in rows of `row_len` (all devices):
    6 N T for trained weights, 4 N T for frozen ones, 2 N T more for the KL reference's
    forward, causal attention 6 x layers x T x L x heads x head_dim; x `useful`, the share of
    the tokens that are samples' (padding is not useful work)."""
    t = ab.learner.config.text
    moe = getattr(t, "num_experts", 0) or 0
    active = (t.num_experts_per_tok / moe) if moe else 1.0
    n_tr = _text_param_count(ab.trainable, active)
    n_fr = _text_param_count(ab.frozen, active)
    attn = 6 * t.num_hidden_layers * tokens * row_len * t.num_attention_heads * t.head_dim
    flops = 6 * n_tr * tokens + 4 * n_fr * tokens + attn
    if ab.ref is not None:
        flops += 2 * (_text_param_count(ab.ref, active) + n_fr) * tokens + attn / 3
    return flops * useful


def drawn_rl_batch(config: Any, learner: Any, shapes: Any, seed: int = 0) -> Any:
    """A step's RL batch as the preset's env settings make it, packed as the learner packs it
    (`batching.pack_chunks`): `rl.group_size x rl.groups_per_batch` episodes of 1 to
    `env.max_turns` turns (uniform), each turn showing the last `env.max_history_images`
    screens of the preset's viewport, `SYSTEM_TOKENS` of prompt, an action of `ACTION_TOKENS`
    tokens (at most `rl.max_tokens`) and `FEEDBACK_TOKENS` of feedback a turn; turns that
    extend the previous one while the window keeps every screen, separate samples once it
    drops one (as the chat renders a cut history). Pixels are stand-ins of one value a
    patch. Returns the packed batch."""

    cfg = learner.config
    rl, env = config.rl, config.env
    rng = np.random.default_rng(seed)
    unit = int(np.prod(shapes.grid))
    merge = cfg.vision.spatial_merge_size
    screen = np.r_[
        cfg.vision_start_token_id,
        [cfg.image_token_id] * (unit // merge**2),
        cfg.vision_end_token_id,
    ].astype(np.int32)

    def positions(ids, grid):
        return np.broadcast_to(np.arange(len(ids), dtype=np.int32), (3, len(ids))).copy()

    samples = []
    for _ in range(rl.group_size * rl.groups_per_batch):
        turns, actions = [], []
        for t in range(int(rng.integers(1, env.max_turns + 1))):
            shown = min(t + 1, env.max_history_images)
            history = np.concatenate(
                [np.full(len(a) + FEEDBACK_TOKENS, 7) for a in actions] or [[]]
            )
            prompt = np.concatenate([np.full(SYSTEM_TOKENS, 5), history] + [screen] * shown).astype(
                np.int32
            )
            extends = 0 < t < env.max_history_images
            if extends:  # the previous turn's sequence, then this turn's text and screen
                prev = turns[-1].full_ids
                prompt = np.r_[prev, np.full(FEEDBACK_TOKENS, 7), screen].astype(np.int32)
            low, high = (min(n, rl.max_tokens) for n in ACTION_TOKENS)
            gen = np.full(int(rng.integers(low, high + 1)), 9, np.int32)
            new = 1 if extends or t == 0 else shown
            turns.append(
                Turn(
                    prompt,
                    gen,
                    np.zeros(gen.size, np.float32),
                    pixel_values=np.zeros((new * unit, 1), np.float32),
                    image_grid_thw=np.tile(np.asarray(shapes.grid, np.int32), (new, 1)),
                    extends_previous=extends,
                )
            )
            actions.append(gen)
        traj = Trajectory("drawn", "g", turns, reward=1.0)
        samples += trajectory_to_samples(traj, 1.0, positions)
    shape, k = shapes.chunks_for("rl", samples)
    return batching.pack_chunks(
        samples,
        shape,
        k,
        image_token_id=cfg.image_token_id,
        merge=merge,
        substeps=learner.num_substeps,
        devices=learner.layout.batch_parallel,
        screen_patches=unit,
    )


def longest_sample_tokens(config: Any, image_tokens: int) -> int:
    """The longest turn sample the preset's env settings can make, by the same counts as
    `drawn_rl_batch`: the prompt, every earlier action with its feedback, this turn's action,
    and `env.max_history_images` screens with their two marker tokens."""
    rl, env = config.rl, config.env
    text = SYSTEM_TOKENS + env.max_turns * (rl.max_tokens + FEEDBACK_TOKENS)
    return text + min(env.max_history_images, env.max_turns) * (image_tokens + 2)


def least_tokens_per_chip(config: Any, image_tokens: int) -> int:
    """The least `rl.tokens_per_chip` the preset's env settings allow: the shortest row length
    of `rl.row_lengths` that holds the longest turn sample (`longest_sample_tokens`; a sample
    is never split over rows), else the longest row length."""
    lengths = sorted(config.rl.row_lengths)
    need = longest_sample_tokens(config, image_tokens)
    return next((n for n in lengths if n >= need), lengths[-1])


def next_budget(
    config: Any, grads: list[ProgramPlan], limit: int, image_tokens: int
) -> tuple[int, tuple[int, ...]] | None:
    """The smaller (tokens_per_chip, row_lengths) to plan again when the largest of the chunk
    programs `grads` (planned at `config.rl.tokens_per_chip`) peaks above `limit`; a program
    the compiler refused counts at the temporaries it said it needed. None when the largest
    fits, when a refused program gave no figure, when what does not grow with the chunk
    (params, accumulator, optimizer state) is already above `limit`, or when nothing smaller
    is left (`_fitted_budget`)."""
    if not grads or any(p.compile_error is not None and not p.temp_bytes for p in grads):
        return None
    top = max(grads, key=lambda p: p.total_bytes)
    if top.total_bytes <= limit:
        return None
    chunk = top.arguments["chunk (text)"] + top.arguments[_SCREENS_ARG] + top.temp_bytes
    fixed = top.total_bytes - chunk
    if fixed >= limit:
        return None
    tokens = int(config.rl.tokens_per_chip)
    return _fitted_budget(config, tokens, fixed, top.total_bytes, limit, image_tokens)


def _fitted_budget(
    config: Any, tokens: int, fixed: int, peak: int, limit: int, image_tokens: int
) -> tuple[int, tuple[int, ...]] | None:
    """(tokens_per_chip, row_lengths) for the chunk programs to peak under `limit`, from one
    plan at `tokens` whose largest chunk program peaked at `peak`, `fixed` of it not growing
    with the chunk (params, gradient accumulator, optimizer state): the chunk's bytes scaled
    linearly, rounded down to a power of two, at most half of `tokens`, never below the
    shortest row length that holds the longest sample; row lengths above it dropped. None when
    nothing smaller is left to try."""
    lengths = sorted(config.rl.row_lengths)
    floor = least_tokens_per_chip(config, image_tokens)
    scaled = tokens * (limit - fixed) / max(peak - fixed, 1)
    new = 1 << max(int(np.floor(np.log2(max(scaled, 1)))), 0)
    new = max(min(new, tokens // 2), floor)
    if new >= tokens:
        return None
    return new, tuple(n for n in lengths if n <= new) or (floor,)


def plan_budget_chunks(
    config: Any, ab: _Abstract, chip: Chip, kv_bytes: int, limit: int | None, sdpo: bool = False
) -> tuple[list[ProgramPlan], Any, Any, str]:
    """(programs, shapes, drawn batch, note) of the token-budget learner: the chunk programs of
    `rl.tokens_per_chip` (`plan_chunk_programs`, on a batch drawn from the preset's env
    settings). With `limit` (bytes a chip the learner may take: `kv_memory_fraction` less
    `kv_min_fraction` of HBM), a largest chunk program above it is planned again at a smaller
    budget (`_fitted_budget`; twice at most), so a preset sized for a larger slice plans to
    fit a smaller one, and the note says what to pass the run. `sdpo`: SDPO's chunks and
    teacher passes instead of GRPO's (`plan_chunk_programs`)."""
    tokens0, lengths0 = int(config.rl.tokens_per_chip), tuple(config.rl.row_lengths)
    c, note = config, ""
    for _ in range(3):
        shapes = trainer_rl_shapes(c, ab.learner)
        try:
            drawn = drawn_rl_batch(c, ab.learner, shapes)
        except ShapeError as e:
            raise PlanInputError(
                f"the preset's own env settings make a batch no shape holds: {e}"
            ) from None
        useful = 1.0 - drawn.padding_share
        progs = plan_chunk_programs(ab, chip, kv_bytes, shapes, useful, c if sdpo else None)
        grads = [p for p in progs if p.rows]
        if limit is None:
            break
        image_tokens = int(np.prod(shapes.grid)) // ab.learner.config.vision.spatial_merge_size**2
        # a chunk program the compiler refused (out of HBM) counts at the temporaries it said
        # it needed: on a small chip that is what the first plan at the preset's budget gives
        fit = next_budget(c, grads, limit, image_tokens)
        if fit is None:
            break  # fits, or no smaller chunk fits: the misfit is reported as planned
        c = copy.deepcopy(c)
        c.rl.tokens_per_chip, c.rl.row_lengths = fit
    if c is not config:
        t, lengths = int(c.rl.tokens_per_chip), tuple(c.rl.row_lengths)
        note = (
            f"rl.tokens_per_chip {tokens0} -> {t}, rl.row_lengths {lengths0} -> {lengths} to "
            f"leave the KV pool sampler.kv_min_fraction of {chip.name}'s HBM: run with "
            f"--config.rl.tokens_per_chip={t} --config.rl.row_lengths='{lengths}'"
        )
    return progs, shapes, drawn, note


_SCREENS_ARG = "chunk screens (by micro-batch and device)"


def plan_chunk_programs(
    ab: _Abstract,
    chip: Chip,
    kv_bytes: int,
    shapes: Any,
    useful: float = 1.0,
    sdpo_config: Any = None,
    *,
    mode: str = "rl",
    suffix: str = "",
    update: bool = True,
) -> list[ProgramPlan]:
    """A token-budget shape set's learner programs (`rl.tokens_per_chip`): the gradient program
    of one chunk of each RL shape, its screens through the vision tower (grouped by
    micro-batch and device, sharded, in the compute dtype, as `BatchLayout.device_batch` lays
    them out), with the optimizer state and the KV pool resident beside it; then the update
    (`apply_update`). A step runs one gradient call a chunk, so these are its peaks whatever
    a batch's size. `useful`: the share of a chunk's tokens that are samples' (MFU).
    `sdpo_config` (the run's config with rl.algorithm="sdpo"): the chunks are SDPO's (the
    gradient program of its step mode, the teacher's top-k targets among the chunk's inputs),
    and each teacher shape's teacher pass (`plan_teacher_chunks`) follows the update.
    `mode="sft"`: the SFT shapes' chunks of the SFT loss instead, and the update named
    "apply_update (sft)" (kind "sft"); `suffix` ends each name; `update=False` leaves the
    update out (Entropulse: the RL learner's, planned with its RL chunks)."""

    learner = ab.learner
    cfg = learner.config
    s, b = learner.num_substeps, learner.layout.batch_parallel
    repl = learner.replicated
    prefix, k = f"{mode}_grads", 0
    kind = "learner" if mode == "rl" else mode
    if sdpo_config is not None:
        rl = sdpo_config.rl
        mode = sdpo.step_mode(rl.sdpo_divergence, rl.sdpo_js_beta, rl.sdpo_weight)
        prefix, k = "sdpo_grads", sdpo.topk_width(int(rl.sdpo_topk), cfg.text.vocab_size)
    out = []
    for shape in shapes.of(mode):
        xs = _step_inputs(learner, shape.rows, shape.length)
        if k:
            xs.update(_sdpo_targets(learner, shape.rows, shape.length, k))
        images, per_group, unit = _abstract_screens(learner, shape, shapes.grid)
        arguments = {
            "params (trainable)": tree_shard_bytes(ab.trainable),
            "params (frozen)": tree_shard_bytes(ab.frozen) + tree_shard_bytes(ab.rest),
            "gradient accumulator": tree_shard_bytes(ab.trainable),
            "chunk (text)": tree_shard_bytes(xs),
            _SCREENS_ARG: tree_shard_bytes(images),
        }
        if ab.ref is not None:
            arguments["KL reference"] = tree_shard_bytes(ab.ref)
        resident = {
            "optimizer state (resident)": tree_shard_bytes(ab.opt_state),
            SAMPLER_CACHE: kv_bytes,
        }
        if k and sdpo_config.rl.sdpo_teacher == "ema":
            resident["EMA teacher params (resident)"] = tree_shard_bytes(ab.trainable)
        name = f"{prefix} {shape.rows}x{shape.length}{suffix}"
        prog = ProgramPlan(name, chip, arguments, resident)
        prog.kind = "sdpo" if k else kind
        prog.rows, prog.row_length = shape.rows, shape.length
        prog.screens = per_group * s * b
        tokens = shape.rows * shape.length
        prog.model_flops = _model_flops(ab, tokens, shape.length, useful) / learner.mesh.size
        prog.notes.append(
            f"one chunk: {shape.rows} rows x {shape.length} tokens ({shapes.tokens_per_chip} "
            f"tokens a chip a micro-batch), {per_group} screens a (micro-batch, device) group "
            f"of {s} x {b}; remat={cfg.remat}, logits_chunk={learner.logits_chunk}"
        )
        if cfg.attn_impl == "splash":
            prog.pallas_flops, prog.pallas_bytes = _splash_cost(
                cfg, shape.rows, shape.length, learner.mesh
            )
        n_total = jax.ShapeDtypeStruct((), jnp.float32, sharding=repl)
        grouped = learner.grads_program(mode, grouped=True)
        args = (ab.trainable, ab.frozen, ab.rest, ab.ref, xs, images, n_total, ab.trainable)
        _compile(grouped, args, prog)
        if s > 1 and prog.compile_error is None:
            prog.flops *= s  # XLA counts the micro-batch scan's body once
            prog.bytes_accessed *= s
        out.append(prog)
    if not update:
        return out
    arguments = {
        "params (trainable)": tree_shard_bytes(ab.trainable),
        "optimizer state": tree_shard_bytes(ab.opt_state),
        "gradients": tree_shard_bytes(ab.trainable),
    }
    resident = {
        "params (frozen, resident)": tree_shard_bytes(ab.frozen) + tree_shard_bytes(ab.rest),
        SAMPLER_CACHE: kv_bytes,
    }
    if ab.ref is not None:
        resident["KL reference (resident)"] = tree_shard_bytes(ab.ref)
    name = APPLY_PROGRAM if mode == "rl" else f"{APPLY_PROGRAM} ({mode})"
    prog = ProgramPlan(name + suffix, chip, arguments, resident)
    prog.kind = kind
    _compile(learner.apply_program(), (ab.trainable, ab.opt_state, ab.trainable), prog)
    out.append(prog)
    if k:
        out += plan_teacher_chunks(sdpo_config, ab, chip, kv_bytes, shapes, k)
    return out


def _sdpo_targets(learner: Any, rows: int, length: int, k: int) -> dict[str, Any]:
    """The abstract teacher targets of an SDPO step's rows (`sdpo.TARGET_KEYS`)."""
    topk_sh, tok_sh = learner.layout.rows_sharding(3), learner.layout.rows_sharding(2)
    return {
        "sdpo_ids": jax.ShapeDtypeStruct((rows, length, k), jnp.int32, sharding=topk_sh),
        "sdpo_logp": jax.ShapeDtypeStruct((rows, length, k), jnp.float32, sharding=topk_sh),
        "sdpo_mask": jax.ShapeDtypeStruct((rows, length), jnp.bool_, sharding=tok_sh),
        "sdpo_weights": jax.ShapeDtypeStruct((rows, length), jnp.float32, sharding=tok_sh),
    }


def plan_teacher_chunks(
    config: Any, ab: _Abstract, chip: Chip, kv_bytes: int, shapes: Any, k: int
) -> list[ProgramPlan]:
    """SDPO's teacher pass over a token-budget batch: one call a chunk of each teacher shape
    (the RL shapes and one row length longer for the feedback message, `shapes.teacher`), its
    screens grouped by micro-batch and device as the step's, top-`k` ids and log-probs out,
    with the learner's optimizer state and the KV pool resident beside it."""

    learner = ab.learner
    fn = sdpo._teacher_jit(learner, int(config.rl.sdpo_topk), {})
    out = []
    for shape in shapes.teacher:
        xs = _step_inputs(learner, shape.rows, shape.length)
        images, per_group, _ = _abstract_screens(learner, shape, shapes.grid)
        arguments = {
            "teacher params": tree_shard_bytes(ab.trainable)
            + tree_shard_bytes(ab.frozen)
            + tree_shard_bytes(ab.rest),
            "chunk (text)": tree_shard_bytes(xs),
            _SCREENS_ARG: tree_shard_bytes(images),
        }
        resident = {
            "optimizer state (learner, resident)": tree_shard_bytes(ab.opt_state),
            SAMPLER_CACHE: kv_bytes,
        }
        if config.rl.sdpo_teacher == "ema":
            resident["EMA teacher params (resident)"] = tree_shard_bytes(ab.trainable)
        prog = ProgramPlan(f"sdpo_teacher {shape.rows}x{shape.length}", chip, arguments, resident)
        prog.kind, prog.rows, prog.row_length = "sdpo", shape.rows, shape.length
        prog.screens = per_group * learner.num_substeps * learner.layout.batch_parallel
        prog.notes.append(f"one teacher chunk, top-{k} ids and log-probs out")
        _compile(fn, (ab.trainable, ab.frozen, ab.rest, xs, images), prog)
        out.append(prog)
    return out


def _abstract_screens(learner: Any, shape: Any, grid: Any) -> tuple[Any, int, int]:
    """(the step's abstract `ImageGroups` for `shape`, screens a group, patches a screen): the
    screens grouped by micro-batch and device as `BatchLayout.grouped_images` lays them out
    (sharded over the batch axes, in the compute dtype; a token-budget shape's group budget)."""

    patch_dim = learner.config.pixel_width
    s, b = learner.num_substeps, learner.layout.batch_parallel
    per_group, unit, meta = learner.layout.screen_layout(
        shape.length, shape.patches, s, grid, per_group=shape.group_screens
    )
    repl = learner.replicated

    def spec(a):
        a = np.asarray(a)
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=repl)

    pixels = jax.ShapeDtypeStruct(
        (s, b, per_group * unit, patch_dim),
        learner.layout.pixel_dtype(),
        sharding=learner.layout.pixel_sharding(4),
    )
    return ImageGroups(pixels, jax.tree.map(spec, meta)), per_group, unit


def _step_inputs(learner: Any, rows: int, row_len: int) -> dict[str, Any]:
    """The RL step's batch as abstract arrays (text only), laid out as the learner lays it."""
    row_sh, pos_sh = learner.layout.row_sh, learner.layout.pos_sh

    def arr(shape, dtype, sh):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)

    xs = {
        "input_ids": arr((rows, row_len), jnp.int32, row_sh),
        "segment_ids": arr((rows, row_len), jnp.int32, row_sh),
        "loss_mask": arr((rows, row_len), jnp.bool_, row_sh),
        "behaviour_logprobs": arr((rows, row_len), jnp.float32, row_sh),
        "advantages": arr((rows, row_len), jnp.float32, row_sh),
        "loss_weights": arr((rows, row_len), jnp.float32, row_sh),
        "position_ids": arr((3, rows, row_len), jnp.int32, pos_sh),
    }
    if learner.route_shape is not None:  # MoE: the sampler's recorded experts (routing replay)
        xs["routes"] = arr((rows, row_len, *learner.route_shape), jnp.int32, learner.route_sharding)
    return xs


def _step_arguments(ab: _Abstract, xs: dict[str, Any], batch: str) -> dict[str, int]:
    """A learner step's arguments by kind, in shard bytes (the batch under the name `batch`)."""
    arguments = {
        "params (trainable)": tree_shard_bytes(ab.trainable),
        "params (frozen)": tree_shard_bytes(ab.frozen) + tree_shard_bytes(ab.rest),
        "optimizer state": tree_shard_bytes(ab.opt_state),
        batch: tree_shard_bytes(xs),
    }
    if ab.ref is not None:
        arguments["KL reference"] = tree_shard_bytes(ab.ref)
    return arguments


def trains_sft(config: Any) -> tuple[bool, bool]:
    """(the SFT warm-up's learner trains: sft.steps or mid.steps > 0, the RL learner takes SFT
    steps: Entropulse, rl.entropulse_every > 0)."""
    warmup = config.sft.get("steps", 0) > 0 or config.get("mid", {}).get("steps", 0) > 0
    return warmup, config.rl.get("entropulse_every", 0) > 0


def plan_sft(
    config: Any,
    ab: _Abstract,
    cfg: qwen_vl.QwenVLConfig,
    mesh: Any,
    rules: shd.Rules,
    chip: Chip,
    kv_bytes: int,
    shapes: Any,
    useful: float = 1.0,
) -> list[ProgramPlan]:
    """The SFT programs a run of `config` compiles (kind "sft"), on the shape set's SFT shapes
    with their screens: the SFT warm-up's learner (built as the trainer builds it: no KL
    reference, its own optimizer state, beside the resident KV pool) with a token budget its
    chunk gradient programs and its update, else its one-call step at the largest SFT shape;
    with Entropulse the RL learner's SFT chunks too ("(entropulse)"). `ab`: the RL learner.
    Asked for (`--programs=sft_step`) by a run that trains no SFT: the SFT learner's."""
    warmup, entropulse = trains_sft(config)
    out: list[ProgramPlan] = []
    if warmup or not entropulse:
        sft_ab = build_abstract(config, cfg, mesh, rules, sft=True)
        if shapes.budgeted:
            out += plan_chunk_programs(sft_ab, chip, kv_bytes, shapes, useful, mode="sft")
        else:
            out.append(plan_train_step_screens(sft_ab, chip, kv_bytes, shapes, mode="sft"))
    if entropulse:
        if shapes.budgeted:
            out += plan_chunk_programs(
                ab, chip, kv_bytes, shapes, useful, mode="sft", suffix=" (entropulse)", update=False
            )
        else:
            prog = plan_train_step_screens(ab, chip, kv_bytes, shapes, mode="sft")
            prog.name += " (entropulse)"
            out.append(prog)
    return out


def plan_sdpo(
    config: Any,
    ab: _Abstract,
    mesh: Any,
    chip: Chip,
    rows: int,
    row_len: int,
    kv_bytes: int,
    programs: tuple[str, ...] = ("sdpo_step", "sdpo_teacher"),
) -> list[ProgramPlan]:
    """rl.algorithm="sdpo": the SDPO step (the RL step plus the teacher's top-k targets as
    inputs) on the RL rows, and the teacher pass (a forward over the learner's micro-batches,
    top-k log-probs out) on the teacher rows, one length longer for the feedback message
    (`shapes.teacher_row_length`, with one screen's tokens for the final screenshot); those of
    the two in `programs`."""

    rl, learner = config.rl, ab.learner
    cfg = learner.config
    k = sdpo.topk_width(int(rl.sdpo_topk), cfg.text.vocab_size)
    mode = sdpo.step_mode(rl.sdpo_divergence, rl.sdpo_js_beta, rl.sdpo_weight)
    xs = {**_step_inputs(learner, rows, row_len), **_sdpo_targets(learner, rows, row_len, k)}
    resident = {SAMPLER_CACHE: kv_bytes}
    if rl.sdpo_teacher == "ema":
        resident["EMA teacher params (resident)"] = tree_shard_bytes(ab.trainable)
    step = ProgramPlan(
        "sdpo_step", chip, _step_arguments(ab, xs, "batch with teacher targets"), resident
    )
    step.notes.append(
        f"{rows} rows x {row_len} tokens, text only; teacher top-{k} targets; mode {mode}"
    )
    step.kind, step.rows, step.row_length = "sdpo", rows, row_len
    args = (ab.trainable, ab.opt_state, ab.frozen, ab.rest, ab.ref, xs, None)
    out = []
    if "sdpo_step" in programs:
        _compile(learner.step_program(mode), args, step)
        out.append(step)
    if "sdpo_teacher" not in programs:
        return out

    unit = cfg.vision.patch_size * cfg.vision.spatial_merge_size
    screen = -(-config.env.viewport_height // unit) * -(-config.env.viewport_width // unit)
    t_len = teacher_row_length(builders.shape_settings(config), screen, row_len)
    t_xs = _step_inputs(learner, rows, t_len)
    teacher = ProgramPlan(
        "sdpo_teacher",
        chip,
        {
            "teacher params": tree_shard_bytes(ab.trainable)
            + tree_shard_bytes(ab.frozen)
            + tree_shard_bytes(ab.rest),
            "teacher batch": tree_shard_bytes(t_xs),
        },
        {
            "optimizer state (learner, resident)": tree_shard_bytes(ab.opt_state),
            **resident,
        },
    )
    teacher.notes.append(
        f"{rows} rows x {t_len} tokens (the RL rows plus the feedback message and a "
        f"{screen}-token screen) in {learner.num_substeps} micro-batches, text only; "
        f"top-{k} ids and log-probs out"
    )
    teacher.kind, teacher.rows, teacher.row_length = "sdpo", rows, t_len
    fn = sdpo._teacher_jit(learner, rl.sdpo_topk, {})
    _compile(fn, (ab.trainable, ab.frozen, ab.rest, t_xs, None), teacher)
    return [*out, teacher]


def _splash_cost(cfg: qwen_vl.QwenVLConfig, rows: int, row_len: int, mesh: Any) -> tuple:
    """FLOPs and HBM bytes per device of the learner's splash attention kernels in one step
    (XLA's cost analysis counts a Pallas call as almost nothing), by hand.

    Per layer and row, one causal [T, T] x [heads x head_dim] matmul is T^2 N H FLOPs (half
    of 2 T^2 N H: the kernel skips the masked tiles). The forward kernel runs two (QK^T, PV),
    the backward's dK/dV kernel four (QK^T, dV, dP, dK) and its dQ kernel three (QK^T, dP,
    dQ): 9; remat="full" runs the forward once more: 11. Bytes: the forward reads Q and
    writes O once and reads K and V once per query tile below the diagonal (T / block / 2
    times on average); the backward reads and writes about twice that."""
    t = cfg.text
    T, N, K, H = row_len, t.num_attention_heads, t.num_key_value_heads, t.head_dim
    block = splash_tile(cfg.attn_block, T)
    matmuls = 9 + (2 if cfg.remat == "full" else 0)
    flops = matmuls * T * T * N * H * rows * t.num_hidden_layers
    size = jnp.dtype(cfg.dtype).itemsize
    fwd = (2 * T * N * H + 2 * T * K * H * max(1.0, T / block / 2)) * size
    fwd_runs = 2 if cfg.remat == "full" else 1
    nbytes = (fwd_runs + 2) * fwd * rows * t.num_hidden_layers
    return flops / mesh.size, nbytes / mesh.size
