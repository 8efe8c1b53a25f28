"""Ahead-of-time memory and roofline plan of a run for a TPU slice, compiled on this machine.

    plan = make_plan(config, "v5p-8")          # config: a configs/*.py ConfigDict
    print(format_plan(plan)); plan.fits         # per-device HBM, FLOPs, roofline, MFU / MBU

With `libtpu` installed, `jax.experimental.topologies.get_topology_desc` gives the abstract
devices of a TPU slice that is not here, and `jax.jit(f).lower(*abstract_args).compile()` runs
the real TPU compiler for them (as MaxText's train_compile.py does). The model is built
abstractly (`jax.eval_shape`: shapes only, no weights, no checkpoint) from the published
config.json dimensions of the preset's size (`qwen_vl.published_config`) or from
`model.hf_path/config.json`, laid out on a mesh of the slice's devices with the preset's rules,
and these programs are compiled (`PROGRAMS`; `programs=` picks):

  train_step    the learner's RL step (cua_jax.rl.learner, built by builders.build_learner) on one
                packed batch of `rl.rows_per_step` rows x the longest `rl.row_lengths` bucket;
                with rl.algorithm="sdpo" also the two SDPO programs below.
  train_step_screens  the RL step at the largest shape of the trainer's shape set
                (`rl.shapes`: a step's episodes or turns as rows) with its screens through the
                vision tower: the program the trainer compiles for its biggest batch. Not in
                the default set (its compile is the largest).
  sft_step      the SFT learner's step (the SFT warm-up's, built by build_learner(sft=True):
                no KL reference, its own optimizer state) on the shape set's SFT shapes with
                their screens: with rl.tokens_per_chip each SFT shape's chunk gradient program
                and the SFT learner's update; with Entropulse (rl.entropulse_every) also the RL
                learner's SFT chunks. In the default set when the run trains SFT
                (sft.steps, mid.steps or rl.entropulse_every) and has a token budget.
  sdpo_step     SDPO's step: the RL step with the teacher's top-k targets as inputs.
  sdpo_teacher  SDPO's teacher pass: a forward over the learner's micro-batches, top-k out, on
                rows one length longer (the feedback message and screen).
  decode_step   one decode step of every sampler slot: the model's decode path with the
                platform's paged-attention kernel (JAX's Pallas TPU kernel) over the KV pool,
                params shared in place with the learner (colocated), K/V sharded over kv heads.

Memory is per device: the compiler's argument / output / alias / temp bytes of each program,
plus what the other program keeps resident meanwhile (the KV pool while the train step runs;
optimizer state and KL reference while the sampler decodes). Arguments are also broken down by
hand (shard shape x dtype size) into params, optimizer state, KL reference, KV pool, batch.
FLOPs and bytes are XLA's `cost_analysis()` of the per-device program; it does not see inside a
Pallas call, so the paged-attention kernel's FLOPs and bytes are counted by hand and added.
Roofline time = max(FLOPs / peak, bytes / bandwidth) with the chip's published figures; MFU =
model FLOPs (6 N T + attention; 4 N T for frozen weights) / (roofline time x peak); MBU = the
bytes a decode step must read (params once, the live K/V) / (roofline time x bandwidth).

The package: `hardware` (the chips and slices, their abstract devices), `abstract` (the model and
the learner built abstractly, the compile that records a program's figures, the run's shapes),
`learner_programs` (the learner's programs: RL step, token-budget chunks, SDPO, SFT),
`sampler_programs` (decode step, prefill turn, the KV pool sized from memory), `report` (byte
counts, `ProgramPlan`, `Plan` and its verdict, the tables and JSON); here the programs a run
compiles and the plan itself (`make_plan`, the launch-time `dry_run`).
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import numpy as np

from cua_jax import sharding as shd
from cua_jax.plan.abstract import (
    _param_count,
    build_abstract,
    compiler_oom_temp_bytes,
    model_config,
    trainer_rl_shapes,
)
from cua_jax.plan.hardware import (
    CHIPS,
    TOPOLOGIES,
    PlanInputError,
    Topology,
    abstract_devices,
    get_topology,
    local_topology,
    table_of_topologies,
)
from cua_jax.plan.learner_programs import (
    _SCREENS_ARG,
    _fitted_budget,
    least_tokens_per_chip,
    longest_sample_tokens,
    next_budget,
    plan_budget_chunks,
    plan_sdpo,
    plan_sft,
    plan_train_step,
    plan_train_step_screens,
    trains_sft,
)
from cua_jax.plan.report import (
    Plan,
    ProgramPlan,
    format_plan,
    plan_json,
    set_sampler_cache,
    tree_shard_bytes,
    with_shardings,
)
from cua_jax.plan.sampler_programs import (
    kv_pool_problem,
    plan_decode_step,
    plan_prefill_turn,
    sampler_pool_cut,
    size_kv_pool,
)
from cua_jax.rl.layout import process_rows_problem
from cua_jax.sampler.kv_cache import kv_pages_for_budget, kv_pool_bytes_per_device
from cua_jax.sampler.steps import linear_state_bytes_per_device, linear_state_rows

# what code outside reads off this package (tools/plan.py, launch/tpu.py, the tests), the private
# helpers among it included
__all__ = [
    "CHIPS",
    "PROGRAMS",
    "TOPOLOGIES",
    "Plan",
    "PlanInputError",
    "ProgramPlan",
    "_SCREENS_ARG",
    "_fitted_budget",
    "abstract_devices",
    "compiler_oom_temp_bytes",
    "default_programs",
    "dry_run",
    "format_plan",
    "get_topology",
    "kv_pages_for_budget",
    "kv_pool_bytes_per_device",
    "kv_pool_problem",
    "least_tokens_per_chip",
    "longest_sample_tokens",
    "make_plan",
    "model_config",
    "next_budget",
    "plan_json",
    "sampler_pool_cut",
    "size_kv_pool",
    "table_of_topologies",
    "tree_shard_bytes",
    "with_shardings",
]


PROGRAMS = (
    "train_step",
    "train_step_screens",
    "sft_step",
    "sdpo_step",
    "sdpo_teacher",
    "decode_step",
    "prefill_turn",
)


def default_programs(config: Any) -> tuple[str, ...]:
    """What a run of `config` compiles: with a token-budget shape set (`rl.tokens_per_chip`)
    the learner's chunk programs with their screens and the update, the SFT learner's chunks
    and update when the run trains SFT (`trains_sft`), and the sampler's prefill of a real
    turn, else the text-only `train_step`; SDPO's teacher pass and step when `rl.algorithm`
    asks; the sampler's decode."""
    distill = ("sdpo_step", "sdpo_teacher") if config.rl.get("algorithm", "grpo") == "sdpo" else ()
    if config.rl.get("tokens_per_chip", 0) <= 0:
        return ("train_step", *distill, "decode_step")
    # with a token budget SDPO's programs are its chunks' (`plan_chunk_programs`)
    sft = ("sft_step",) if any(trains_sft(config)) else ()
    return ("train_step_screens", *sft, *distill, "decode_step", "prefill_turn")


# ------------------------------------------------------------------------------- the plan
def make_plan(
    config: Any,
    topology: str | Topology,
    *,
    devices: list[Any] | None = None,
    headroom: float = 0.1,
    rows: int | None = None,
    row_len: int | None = None,
    programs: tuple[str, ...] | None = None,
    attn_backend: str = "auto",
) -> Plan:
    """Compiles `programs` of the run `config` describes for the slice `topology` (a name in
    TOPOLOGIES), or, with `devices` (e.g. `jax.devices()`), for the devices present.

    Raises PlanInputError for bad input (unknown topology, hf_path not a directory, a mesh that
    does not divide the slice or the model).
    """
    if not programs:
        programs = default_programs(config)
    unknown = set(programs) - set(PROGRAMS)
    if unknown:
        raise PlanInputError(f"unknown programs {sorted(unknown)}; use {', '.join(PROGRAMS)}")
    if devices is None:
        topo = get_topology(str(topology))
        devices = abstract_devices(topo)
    else:  # the devices present (a launch-time check)
        topo = topology if isinstance(topology, Topology) else local_topology(list(devices))
    cfg = model_config(config)
    m = config.mesh
    try:
        mesh = shd.make_mesh(m.data, m.fsdp, m.tensor, devices=devices, expert=m.get("expert", 1))
    except ValueError as e:
        raise PlanInputError(f"mesh does not fit {topo.name} ({len(devices)} chips): {e}") from e
    rules = tuple(shd.DEFAULT_RULES) + tuple(tuple(r) for r in m.rules)
    # a multi-host slice runs one process a host, each packing its own rows (`BatchLayout`);
    # the devices present: the processes they belong to
    procs = topo.num_hosts if topo.topology_name else len({d.process_index for d in devices})
    problem = process_rows_problem(mesh, rules, procs)
    if problem:
        raise PlanInputError(f"{topo.name} runs {procs} processes: {problem}")
    try:
        ab = build_abstract(config, cfg, mesh, rules)
    except ValueError as e:  # a dimension the mesh cannot divide
        raise PlanInputError(f"the mesh {dict(mesh.shape)} cannot lay out the model: {e}") from e

    sc = config.sampler
    tensor = mesh.shape["tensor"]
    budget = int(topo.chip.hbm_bytes * (1.0 - headroom))
    num_pages = sc.num_pages
    frac = float(config.sampler.get("kv_memory_fraction", 0.0) or 0.0)
    # kv_memory_fraction > 0: the pool takes what the learner's programs leave of that share
    # of HBM (`size_kv_pool`, after they are planned with no pool); else sampler.num_pages
    kv_bytes = (
        0 if frac > 0 else kv_pool_bytes_per_device(cfg, num_pages, sc.page_size, cfg.dtype, tensor)
    )
    # a hybrid model's (Qwen3.5) linear-state rows: resident beside the pool, out of its budget
    state_bytes = linear_state_bytes_per_device(cfg, linear_state_rows(sc.max_slots), tensor)
    cache_bytes = kv_bytes + state_bytes  # the sampler's cache, resident in every learner program
    rows = rows or config.rl.rows_per_step
    mult = ab.learner.row_multiple
    rows = -(-rows // mult) * mult
    row_len = row_len or max(config.rl.row_lengths)

    with_train = "train_step" in programs and config.rl.algorithm == "sdpo"
    sdpo_programs = tuple(p for p in ("sdpo_step", "sdpo_teacher") if p in programs or with_train)
    out: list[ProgramPlan] = []
    shapes = None
    if {"train_step", "train_step_screens", "sft_step"} & set(programs):
        shapes = trainer_rl_shapes(config, ab.learner)
    if "train_step" in programs:
        out.append(plan_train_step(config, ab, mesh, topo.chip, rows, row_len, cache_bytes, shapes))
    drawn = None
    fit_note = ""
    if "train_step_screens" in programs and shapes.budgeted:
        min_frac = float(config.sampler.get("kv_min_fraction", 0.0) or 0.0)
        limit = int(topo.chip.hbm_bytes * (frac - min_frac)) if frac > 0 and min_frac else None
        chunks, shapes, drawn, fit_note = plan_budget_chunks(
            config, ab, topo.chip, cache_bytes, limit, sdpo=bool(sdpo_programs)
        )
        out += chunks
        sdpo_programs = ()  # planned with the chunks: SDPO's gradient and teacher chunks
    elif "train_step_screens" in programs:
        out.append(plan_train_step_screens(ab, topo.chip, cache_bytes, shapes))
    if "sft_step" in programs:  # the budget's shapes as fitted above (the SFT shapes are the RL)
        useful = 1.0 - drawn.padding_share if drawn is not None else 1.0
        out += plan_sft(config, ab, cfg, mesh, rules, topo.chip, cache_bytes, shapes, useful)
    if sdpo_programs:
        out += plan_sdpo(config, ab, mesh, topo.chip, rows, row_len, cache_bytes, sdpo_programs)
    pool_note = ""
    hbm = topo.chip.hbm_bytes
    if frac > 0:
        num_pages, kv_bytes, pool_note = size_kv_pool(cfg, sc, tensor, hbm, frac, out, state_bytes)

    def sampler_programs(pages: int) -> list[ProgramPlan]:
        # a pool of 0 or 1 pages holds nothing to decode: compiled at 2 (`kv_pool_problem`
        # then says the plan does not fit)
        pages, progs = max(pages, 2), []
        if "decode_step" in programs:
            progs.append(plan_decode_step(config, ab, mesh, topo.chip, pages, attn_backend))
        if "prefill_turn" in programs:
            progs.append(plan_prefill_turn(config, ab, mesh, topo.chip, pages, attn_backend))
        return progs

    sampler = sampler_programs(num_pages)
    problems = []
    if frac > 0:
        # the sampler's own scratch (the prefill's vision tower, the decode loop) above the
        # learner's: the pool gives up the rest, and both are compiled again with it
        per_page = kv_pool_bytes_per_device(cfg, 1, sc.page_size, cfg.dtype, tensor)
        cut = sampler_pool_cut(sampler, hbm, frac, per_page)
        if cut:
            num_pages = max(0, num_pages - cut)
            kv_bytes = num_pages * per_page
            names = ", ".join(p.name for p in sampler if p.total_bytes > hbm * frac)
            sampler = sampler_programs(num_pages)
            set_sampler_cache(out, kv_bytes + state_bytes)
            pool_note += f"; cut to {num_pages} pages for the sampler's own scratch ({names})"
        min_frac = float(sc.get("kv_min_fraction", 0.0) or 0.0)
        mc = config.model
        vision_trained = not mc.get("freeze_vision", False) and not mc.get("lora_rank", 0)
        problem = kv_pool_problem(cfg, sc, num_pages, tensor, hbm, min_frac, vision_trained)
        if problem:
            problems.append(problem)
    out += sampler

    # The pool that would fit next to the train step (its other consumers as compiled).
    summary: dict[str, Any] = {
        "model": f"{cfg.family} {_param_count(ab.trainable) + _param_count(ab.frozen):,} params",
        "trainable_params": _param_count(ab.trainable),
        "lora_rank": int(config.model.lora_rank),
        "num_pages": num_pages,
        "kv_pool_bytes": kv_bytes,
        "kv_pool": pool_note or f"sampler.num_pages = {num_pages}",
        "linear_state_bytes": state_bytes,
        "rows": rows,
        "row_len": row_len,
        "remat": ab.learner.config.remat,
        "num_substeps": ab.learner.num_substeps,
    }
    if shapes is not None and shapes.budgeted:
        summary["tokens_per_chip"] = shapes.tokens_per_chip
        summary["row_lengths"] = tuple(sh.length for sh in shapes.rl)
        image_tokens = int(np.prod(shapes.grid)) // cfg.vision.spatial_merge_size**2
        summary["least_tokens_per_chip"] = least_tokens_per_chip(config, image_tokens)
    if fit_note:
        summary["token_budget"] = fit_note
    if drawn is not None:
        summary["drawn_batch"] = (
            f"{drawn.num_samples} samples in {drawn.chunks} chunks of "
            f"{drawn.shape[0] // drawn.chunks} x {drawn.shape[1]}, "
            f"padding share {drawn.padding_share:.3f}"
        )
        summary["padding_share"] = drawn.padding_share
        summary["chunks"] = drawn.chunks
        summary["drawn_length"] = drawn.shape[1]
    train = next((p for p in out if p.name == "train_step" and p.compile_error is None), None)
    if train is not None:
        spare = budget - (train.total_bytes - kv_bytes)  # its resident states stay counted
        summary["kv_pages_that_fit"] = kv_pages_for_budget(
            cfg, max(spare, 0), sc.page_size, cfg.dtype, tensor
        )
    return Plan(topo, dict(mesh.shape), headroom, out, summary, problems)


def dry_run(config: Any, devices: list[Any] | None = None, prog: str = "launch/tpu.py") -> int:
    """The launch-time check (`launch/tpu.py --dry_run`): the run's programs compiled for the
    devices present (`jax.devices()`: real TPU / GPU chips, or CPU devices), the plan printed on
    stdout; returns the exit status: 0 fits, 1 does not (the one-line reason on stderr, prefixed
    with `prog`). Raises PlanInputError for bad input (the caller's exit 2)."""
    plan = make_plan(config, "", devices=list(devices if devices is not None else jax.devices()))
    print(format_plan(plan), flush=True)
    if plan.fits:
        return 0
    print(f"{prog}: {plan.reason()}", file=sys.stderr)
    return 1
