"""Builders from a run's config to typed library objects; the ConfigDict stops here.

    model, processor = build_model_and_processor(config, mesh, rules)
    init_model_weights(model, config)           # config.ckpt.init_params_from, if set
    learner = build_learner(model, config, mesh, rules, sft=False)
    engine = build_engine(learner.model, config, processor.tokenizer, mesh=mesh, rules=rules)
    agent = AgentLoop(engine, processor, build_rollout_settings(config, learner.model))

Model hand-off: `Learner` takes ownership of the model it is given (it applies LoRA, shards it on
the mesh, sets its remat policy) and exposes it as `learner.model`. The sampler must decode
exactly that object, so `build_engine` is handed `learner.model`, never the model as it was
before the learner saw it. `restore_run_model` returns the learner's model for the same reason.
Used by `cua_jax.job.train`, `tools/eval.py`, `tools/bench_smoke_step.py` and the HF export.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
import numpy as np
from absl import logging
from etils import epath
from flax import nnx

from cua_jax import metrics as metrics_lib
from cua_jax import multihost
from cua_jax import sharding as shd
from cua_jax.actions import get_format
from cua_jax.checkpoint.orbax_io import Checkpointer, CheckpointError, init_params
from cua_jax.config.checks import ConfigError, feedback_kinds
from cua_jax.data.processor import QwenVLProcessor
from cua_jax.demos import shards
from cua_jax.evaluation.live import ServeSettings
from cua_jax.job import warmup
from cua_jax.job.grpo import GrpoSettings
from cua_jax.job.sft import MidSettings, SftSettings
from cua_jax.job.state import EvalSettings
from cua_jax.metrics import MetricsWriter
from cua_jax.models import qwen_vl
from cua_jax.rl import learner as L
from cua_jax.rl import sources
from cua_jax.rl.advantages import ESTIMATORS, estimator_options
from cua_jax.rl.entropulse import Entropulse
from cua_jax.rl.rollout import RolloutSettings
from cua_jax.rl.sdpo import SelfDistiller
from cua_jax.rl.shapes import ShapeSet, ShapeSettings
from cua_jax.sampler import Engine, steps
from cua_jax.sampler.grammar import action_automaton
from cua_jax.sampler.kv_cache import kv_pages_for_budget, kv_pool_bytes_per_device


def mesh_and_rules(config: Any, devices: Any = None) -> tuple[Any, tuple]:
    """The run's device mesh (`config.mesh`) and its logical-axis rules (the defaults, then
    `config.mesh.rules`)."""
    mc = config.mesh
    expert = mc.get("expert", 1)  # an older run's config has no expert axis
    try:
        mesh = shd.make_mesh(mc.data, mc.fsdp, mc.tensor, devices=devices, expert=expert)
    except ValueError as e:
        raise ConfigError(
            f"config.mesh (data={mc.data}, fsdp={mc.fsdp}, expert={expert}, tensor={mc.tensor}) "
            f"does not fit the devices: {e}"
        ) from None
    return mesh, tuple(shd.DEFAULT_RULES) + tuple(tuple(r) for r in mc.rules)


def build_model_and_processor(config: Any, mesh: Any, rules: Any):
    """The policy and its processor: a local HF checkpoint, or the tiny preset at random init
    with the tokenizer the project ships (`model.preset`: "tiny"; "small": the tiny model at
    twice the depth and width, `qwen_vl.tiny(scale=2)`; or "tiny_moe": the tiny MoE of the
    family (Qwen3-VL-MoE, or Qwen3.5-MoE with its shared expert), 8 experts top-2 in every
    decoder layer). Qwen3.5 takes Qwen3-VL's processor and chat rendering (transformers maps
    its model types to Qwen3VLProcessor)."""
    mc = config.model
    dispatch = mc.get("moe_dispatch", "auto")  # configs saved before the key: "auto"
    gated_delta = mc.get("gated_delta_impl", "reference")  # configs saved before the key
    if mc.hf_path is not None:
        model = qwen_vl.from_pretrained(mc.hf_path, dtype=mc.param_dtype, mesh=mesh, rules=rules)
        model.config = model.config.replace(
            dtype=mc.dtype,
            remat=mc.remat,
            attn_block=mc.attn_block,
            attn_impl=mc.attn_impl,
            moe_dispatch=dispatch,
            gated_delta_impl=gated_delta,
        )
        qwen_vl.set_expert_mesh(model, mesh, rules, dispatch)  # its blocks were built "auto"
        processor = screen_form(QwenVLProcessor.from_pretrained(mc.hf_path), config)
        return model_screens(model, processor), processor
    # Tiny screens: a screenshot of the smoke viewport is a few dozen merged tokens.
    w, h = config.env.viewport_width, config.env.viewport_height
    processor = screen_form(
        QwenVLProcessor.default(mc.family, max_pixels=w * h, min_pixels=32 * 32), config
    )
    tok = processor.tokenizer
    cfg = qwen_vl.tiny(
        mc.family,
        vocab_size=tok.vocab_size,
        **tok.vision_token_ids(),
        eos_token_id=tok.eos_id,  # exported to generation_config.json: generate() stops there
        pad_token_id=tok.pad_id,
        dtype=mc.dtype,
        param_dtype=mc.param_dtype,
        remat=mc.remat,
        attn_block=mc.attn_block,
        attn_impl=mc.attn_impl,
        moe=mc.preset == "tiny_moe",
        moe_dispatch=dispatch,
        gated_delta_impl=gated_delta,
        scale=2 if mc.preset == "small" else 1,
    )
    return model_screens(qwen_vl.init_random(cfg, seed=config.seed), processor), processor


def screen_form(processor: QwenVLProcessor, config: Any) -> QwenVLProcessor:
    """`processor` making screens in the run's form (`model.pixel_dtype`; configs saved before
    the key: "float32")."""
    form = config.model.get("pixel_dtype", "float32")
    ic = processor.image_config
    if form == "uint8" and abs(ic.rescale_factor - 1 / 255) > 1e-12:
        raise ConfigError(
            f"model.pixel_dtype='uint8' normalizes screens with rescale 1/255, but the processor's "
            f"rescale_factor is {ic.rescale_factor}; use --config.model.pixel_dtype=float32"
        )
    processor.image_config = dataclasses.replace(ic, pixel_dtype=form)
    return processor


def model_screens(model: Any, processor: QwenVLProcessor) -> Any:
    """`model` taking the processor's screens: their form, and (for bytes) its normalization."""
    ic = processor.image_config
    model.config = model.config.replace(
        pixel_dtype=ic.pixel_dtype, image_mean=ic.image_mean, image_std=ic.image_std
    )
    return model


def init_model_weights(model: Any, config: Any) -> int:
    """Writes `config.ckpt.init_params_from`'s saved weights into `model` (none when unset);
    run before restoring a run's own checkpoint, which holds only its trainable params (its
    frozen ones came from here). Returns the number of arrays set."""
    src = config.ckpt.get("init_params_from")
    if not src:
        return 0
    if epath.Path(src, "checkpoints").is_dir():  # a run's workdir: its checkpoints
        src = os.path.join(src, "checkpoints")
    step = config.ckpt.get("init_params_step", -1)
    source = Checkpointer(src, keep=10**6)
    try:
        n = init_params(model, source.restore_params(None if step < 0 else step))
    finally:
        source.close()
    logging.warning("initialized %d parameter arrays from %s", n, src)
    return n


def build_learner(model: Any, config: Any, mesh: Any, rules: Any, *, sft: bool):
    """The learner of the RL phase (`sft=False`) or of the SFT warm-up (`sft=True`: its own
    learning rate and schedule length, no KL term, untempered). It takes ownership of `model`
    (see the module docstring): build the sampler from `learner.model`."""
    rl = config.rl
    learner_tis = rl.old_logprobs == "learner" and rl.tis_cap > 0
    loss = L.LossConfig(
        eps_low=rl.clip_low,
        eps_high=rl.clip_high,
        old_logprobs=rl.old_logprobs,
        tis_cap=rl.tis_cap if learner_tis else None,
        kl_coef=0.0 if sft else rl.kl_penalty_coef,
        kl_estimator=rl.kl_estimator,
        entropy_coef=rl.entropy_coef,
        agg_mode=rl.loss_agg,
        loss_norm=rl.loss_norm or rl.max_tokens * config.env.max_turns,
        temperature=1.0 if sft else rl.temperature,
        router_aux_coef=rl.get("router_aux_coef", 0.0),
        # SFT data carries no sampler routes (the learner routes by itself there)
        routing_replay=not sft and rl.get("routing_replay", False),
    )
    advantages = L.AdvantageConfig(
        normalize_std=rl.std_normalize,
        zero_variance="filter" if rl.filter_zero_variance else "keep",
    )
    mc = config.model
    lora = (
        L.LoraConfig(rank=mc.lora_rank, alpha=mc.lora_alpha, target_modules=tuple(mc.lora_targets))
        if mc.lora_rank > 0
        else None
    )
    return L.Learner(
        model,
        mesh=mesh,
        rules=rules,
        optimizer=_optimizer_config(config, sft=sft),
        loss=loss,
        advantages=advantages,
        lora=lora,
        num_substeps=rl.num_substeps,
        freeze_vision=mc.freeze_vision,
        remat=mc.remat,
        seq_len_buckets=tuple(rl.row_lengths),
        # The step must not donate (delete) the params while the engine may decode them: in
        # async RL (rollouts run during the step), and whenever the live policy server is on
        # (config.serve.port: a request can decode during any SFT or RL step; a donated array
        # failed its sampler step with "Array has been deleted"). The engine drops the old
        # buffers at the next version.
        donate=(sft or rl.mode != "async") and not config.serve.get("port", 0),
        banned_token_ids=model.config.vision_placeholder_ids,
        logits_chunk=rl.logits_chunk,
    )


def _optimizer_config(config: Any, *, sft: bool) -> L.OptimizerConfig:
    """`config.optim` with the phase's learning rate and schedule length."""
    opt = config.optim
    lr = config.sft.learning_rate if sft else config.rl.learning_rate
    n_steps = config.sft.steps if sft else config.total_steps
    return L.OptimizerConfig(
        learning_rate=lr,
        schedule=opt.schedule,
        warmup_steps=opt.warmup_steps,
        decay_steps=max(1, n_steps - opt.warmup_steps),
        weight_decay=opt.weight_decay,
        b1=opt.b1,
        b2=opt.b2,
        max_grad_norm=opt.grad_clip if opt.grad_clip > 0 else None,
        max_update_ratio=opt.max_update_ratio,
    )


def kv_pages(
    config: Any, learner: Any, image_config: Any, stats: dict[str, int] | None = None
) -> int:
    """The sampler's KV pages: `sampler.num_pages`, or with `sampler.kv_memory_fraction` > 0 on
    devices that report their memory, what that share of a device's memory leaves after what
    is already on it (the learner's params and optimizer state) and the learner's largest
    program (its scratch and its batch: the shape set's largest RL shape, compiled now; the
    warm-up later finds it compiled), in whole pages. A device that reports no memory (the
    CPU) keeps `sampler.num_pages`, logged. `stats`: the device's `memory_stats()` (tests)."""

    sc = config.sampler
    frac = float(sc.get("kv_memory_fraction", 0.0) or 0.0)
    if frac <= 0:
        return int(sc.num_pages)
    if stats is None:
        stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        logging.info(
            "sampler.kv_memory_fraction: the devices report no memory limit; "
            "sampler.num_pages=%d KV pages",
            sc.num_pages,
        )
        return int(sc.num_pages)
    if learner.shapes is None:
        learner.shapes = learner_shapes(config, learner, image_config)
    scratch = _largest_program_bytes(learner)
    budget = int(stats["bytes_limit"] * frac) - int(stats.get("bytes_in_use", 0)) - scratch
    cfg, tensor = learner.config, learner.mesh.shape["tensor"]
    # hybrid models (Qwen3.5): the Engine's linear-state rows come out of the same budget
    budget -= steps.linear_state_bytes_per_device(
        cfg, steps.linear_state_rows(sc.max_slots), tensor
    )
    pages = kv_pages_for_budget(cfg, budget, sc.page_size, cfg.dtype, tensor)
    limit, in_use = stats["bytes_limit"] / 2**30, stats.get("bytes_in_use", 0) / 2**30
    logging.info(
        "KV pool: %d pages from %.0f%% of %.1f GiB less %.1f GiB in use and %.1f GiB for the "
        "learner's largest program",
        *(pages, 100 * frac, limit, in_use, scratch / 2**30),
    )
    min_frac = float(sc.get("kv_min_fraction", 0.0) or 0.0)
    pool = kv_pool_bytes_per_device(cfg, pages, sc.page_size, cfg.dtype, tensor)
    if pool < min_frac * stats["bytes_limit"]:
        raise ValueError(
            f"the KV pool gets {pool / 2**30:.1f} GiB, less than sampler.kv_min_fraction="
            f"{min_frac} of {limit:.1f} GiB: the learner's largest program takes "
            f"{scratch / 2**30:.1f} GiB; lower rl.tokens_per_chip={config.rl.tokens_per_chip} "
            "(tools/plan.py --topology=<this slice> prints the budget that fits)"
        )
    if (pages - 1) * sc.page_size < sc.max_seq_len:  # page 0 is scratch
        raise ValueError(
            f"sampler.kv_memory_fraction={frac} leaves {pages} KV pages ({pages * sc.page_size} "
            f"tokens), not one sequence of sampler.max_seq_len={sc.max_seq_len}; raise "
            "the fraction or shrink the learner's batch (rl.tokens_per_chip)"
        )
    return pages


def _largest_program_bytes(learner: Any) -> int:
    """Device bytes of the learner's largest RL program (compiled now): its scratch and
    outputs less what it donates, plus its batch (generously, three times over)."""
    shape = max(learner.shapes.rl, key=lambda sh: (sh.rows * sh.length, sh.patches))
    batch = learner.blank_batch(shape)
    compiled = learner.lower_step(batch).compile()
    m = compiled.memory_analysis()
    scratch = int(m.temp_size_in_bytes) + int(m.output_size_in_bytes) - int(m.alias_size_in_bytes)
    arrays = [batch.input_ids, batch.position_ids, batch.loss_mask, batch.loss_weights]
    scratch += sum(int(np.asarray(a).nbytes) * 3 for a in arrays)  # the batch, generously
    cfg = learner.config
    scratch += shape.patches * np.dtype(cfg.pixel_dtype).itemsize * cfg.pixel_width
    return scratch


def build_engine(
    model: Any, config: Any, tokenizer: Any, *, mesh: Any, rules: Any, num_pages: int = 0
):
    """The paged sampler over `model` (a learner's `learner.model` when one trains it) on the
    run's `mesh`: parameters already sharded there (the learner's) are decoded in place, K/V
    pages are sharded over `tensor`.

    Multi-host: each process rolls out its own episodes, so its sampler runs on its own devices
    only (`sampler_mesh`) with a local copy of the parameters (`sampler_params`); give it
    `sampler_params(learner)` at every `update_params`. `num_pages`: the KV pages (`kv_pages`;
    0: `sampler.num_pages`)."""
    sc = config.sampler
    model, mesh = _sampler_model(model, mesh)
    return Engine(
        model,
        mesh=mesh,
        rules=rules,
        max_slots=sc.max_slots,
        page_size=sc.page_size,
        num_pages=num_pages or sc.num_pages,
        max_seq_len=sc.max_seq_len,
        decode_chunk=sc.decode_chunk,
        attn_backend=sc.backend,
        attn_options=sc.gpu_kernel,
        detokenize=tokenizer.decode,
        grammar=action_automaton(tokenizer, get_format(config.env.action_format))
        if config.env.constrain_actions
        else None,
    )


def sampler_mesh(mesh: Any) -> Any:
    """The sampler's mesh: the run's mesh with one process, else this process's devices (its
    own rollouts), with the run's `tensor` size where they divide by it."""

    if jax.process_count() == 1:
        return mesh
    local = jax.local_devices()
    tensor = mesh.shape["tensor"] if len(local) % mesh.shape["tensor"] == 0 else 1
    return shd.make_mesh(1, -1, tensor, devices=local)


def sampler_params(learner: Any) -> Any:
    """What `engine.update_params` takes: the learner's live parameters (one process), or this
    process's full copy of them (multi-host, see `build_engine`)."""
    return multihost.local_copy(learner.params_for_sampler())


def _sampler_model(model: Any, mesh: Any) -> tuple[Any, Any]:
    """(model, mesh) the engine decodes: `model` itself on the run's mesh with one process; a
    copy holding this process's replica of its arrays on `sampler_mesh` with several."""

    if jax.process_count() == 1:
        return model, mesh
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, multihost.local_copy(state)), sampler_mesh(mesh)


def build_rollout_settings(config: Any, model: Any) -> RolloutSettings:
    rl, env = config.rl, config.env
    # SDPO's teacher is shown the screen after a failed episode's last action
    final_screen = rl.algorithm == "sdpo" and "final_screenshot" in feedback_kinds(rl.sdpo_feedback)
    return RolloutSettings(
        max_turns=env.max_turns,
        max_history_images=env.max_history_images,
        max_new_tokens=rl.max_tokens,
        temperature=rl.temperature,
        top_p=rl.top_p,
        invalid_action_penalty=rl.invalid_action_penalty,
        closeness_reward=rl.closeness_reward,
        keep_final_screen=final_screen,
        action_format=env.action_format,
        system_prompt=env.system_prompt,
        constrain_actions=env.constrain_actions,
        banned_token_ids=model.config.vision_placeholder_ids,
    )


def build_rollout_source(config: Any, agent: Any, pool: Any, tasks: Any, version: int):
    """The GRPO loop's rollout source for `config.rl.mode` over `tasks` in a fresh task order
    (`cua_jax.rl.sources`); `version` is the learner's current one."""
    rl = config.rl
    settings = sources.SourceSettings(
        group_size=rl.group_size,
        groups_per_batch=rl.groups_per_batch,
        seed=config.seed,
        max_steps_off_policy=rl.max_steps_off_policy,
        concurrency=config.env.concurrency,
        groups_to_log=config.log.num_groups_to_log,
    )
    cursor = sources.TaskCursor(tasks, config.seed)
    return sources.make_source(rl.mode, agent, pool, cursor, settings, version)


def build_rollout_source_share(config: Any, agent: Any, pool: Any, tasks: Any, version: int):
    """`build_rollout_source` for this process's share of a multi-host job: its own tasks
    (`multihost.task_share`: every process_count-th task from its index, the same after a
    restart) and `groups_per_batch / process_count` whole groups per step (a group never
    straddles processes). With one process, exactly `build_rollout_source`."""

    n = jax.process_count()
    if n == 1:
        return build_rollout_source(config, agent, pool, tasks, version)
    rl = config.rl
    if rl.groups_per_batch % n:
        raise ConfigError(
            f"config.rl.groups_per_batch={rl.groups_per_batch} must be a multiple of the "
            f"{n} processes: each process rolls out whole groups of its own tasks"
        )
    share = multihost.task_share(tasks)
    if not share:
        raise ConfigError(f"{len(tasks)} training tasks leave process {jax.process_index()} none")
    per_host = config.copy_and_resolve_references()
    per_host.rl.groups_per_batch = rl.groups_per_batch // n
    return build_rollout_source(per_host, agent, pool, share, version)


def mid_settings(config: Any) -> MidSettings:
    """Grounding mid-training's settings (`config.mid`)."""
    mc = config.mid
    return MidSettings(
        steps=mc.steps,
        batch_size=mc.batch_size,
        source=mc.source,
        heldout=mc.heldout,
        eval_every=mc.eval_every,
        eval_samples=mc.eval_samples,
        seed=config.seed,
        progress=config.log.progress,
    )


def sft_settings(config: Any) -> SftSettings:
    """The SFT warm-up's settings (`config.sft`; a step's rows are `config.rl.rows_per_step`)."""
    sc = config.sft
    return SftSettings(
        steps=sc.steps,
        source=sc.source,
        rows=config.rl.rows_per_step,
        episodes_per_task=sc.episodes_per_task,
        recovery_share=sc.recovery_share,
        feedback_share=sc.feedback_share,
        feedback_kinds=feedback_kinds(config.rl.sdpo_feedback),
        seed=config.seed,
        progress=config.log.progress,
    )


def build_metrics_writer(config: Any, workdir: str, *, enabled: bool) -> MetricsWriter:
    """The run's metrics writer (`config.log`: jsonl, tensorboard, wandb) under `workdir`."""
    log = config.log
    return MetricsWriter(
        workdir,
        enabled=enabled,
        tensorboard=log.tensorboard,
        wandb_project=log.wandb_project,
        wandb_name=log.wandb_name,
        config=config.to_dict(),
    )


def build_distiller(config: Any, chat: Any) -> SelfDistiller | None:
    """The `SelfDistiller` of `config.rl` (None for rl.algorithm = "grpo")."""
    rl = config.rl
    if rl.algorithm == "grpo":
        return None
    if rl.algorithm != "sdpo":
        raise ValueError(f"rl.algorithm={rl.algorithm!r}; use 'grpo' or 'sdpo'")
    return SelfDistiller(
        chat,
        weight=rl.sdpo_weight,
        divergence=rl.sdpo_divergence,
        js_beta=rl.sdpo_js_beta,
        topk=rl.sdpo_topk,
        teacher=rl.sdpo_teacher,
        ema=rl.sdpo_ema,
        feedback=feedback_kinds(rl.sdpo_feedback),
    )


def grpo_settings(config: Any) -> GrpoSettings:
    """The GRPO phase's settings (`config.total_steps`, `log.eval_every`, `rl.ppo_*`)."""
    return GrpoSettings(
        total_steps=config.total_steps,
        eval_every=config.log.eval_every,
        ppo_epochs=config.rl.ppo_epochs,
        ppo_minibatches=config.rl.ppo_minibatches,
    )


def eval_settings(config: Any) -> EvalSettings:
    """The in-run eval's seed and logged episodes (`log.num_groups_to_log` groups' worth)."""
    return EvalSettings(
        seed=config.seed, num_logged=config.log.num_groups_to_log * config.rl.group_size
    )


def check_mid(config: Any) -> None:
    """Mid-training's shard directories exist (a ConfigError naming the key, before any work)."""
    mc = config.mid
    keys = [("source", mc.source)] if mc.steps > 0 else []
    keys += [("heldout", mc.heldout)] if mc.steps > 0 and mc.heldout else []
    for key, path in keys:
        if not shards.is_shard_dir(path):
            raise ConfigError(
                f"config.mid.{key}={path!r} is not a grounding shard directory; write one with "
                "tools/make_grounding_data.py --out=DIR --num=N"
            )


def check_levers(config: Any) -> None:
    """Raises `ConfigError` for RL lever settings (`rl.advantage`, `rl.ppo_*`) that cannot
    work together."""
    rl = config.rl
    if rl.advantage not in ESTIMATORS:
        raise ConfigError(
            f"config.rl.advantage={rl.advantage!r} is not one of {', '.join(ESTIMATORS)}"
        )
    if rl.ppo_epochs * rl.ppo_minibatches > 1 and rl.old_logprobs != "behaviour":
        raise ConfigError(
            f"config.rl.ppo_epochs={rl.ppo_epochs} x ppo_minibatches={rl.ppo_minibatches} "
            "optimizer updates per batch need config.rl.old_logprobs='behaviour': with "
            "'learner' the PPO ratio is taken against the current update's own log-probs and "
            "stays 1, so nothing would be clipped"
        )
    if rl.ppo_minibatches > 1 and jax.process_count() > 1:
        raise ConfigError(
            "config.rl.ppo_minibatches > 1 is single-process only (each process would split "
            "its own groups into mini-batches of different sizes)"
        )


def use_advantage_estimator(learner: Any, config: Any) -> None:
    """Sets the learner's advantage estimator from `config.rl.advantage`."""
    opts = estimator_options(config.rl.advantage, std_normalize=config.rl.std_normalize)
    learner.advantage_config = dataclasses.replace(learner.advantage_config, **opts)


def source_levers(config: Any, workdir: str) -> dict[str, Any]:
    """The rollout source's lever settings (`RolloutSource.use_levers`) from `config.rl`;
    rollouts are persisted under WORKDIR/rollouts (multi-host: .../p{process index})."""
    rl = config.rl
    persist = None
    if rl.persist_rollouts:
        persist = os.path.join(workdir, "rollouts")
        if jax.process_count() > 1:
            persist = os.path.join(persist, f"p{jax.process_index()}")
        if not metrics_lib.is_local(persist):
            raise ConfigError(
                f"config.rl.persist_rollouts writes local files only; workdir {workdir!r} is not "
                "a local path"
            )
    return {
        "dynamic_sampling": bool(rl.dynamic_sampling),
        "max_sampling_rounds": int(rl.max_sampling_rounds),
        "replay_successes": bool(rl.replay_successes),
        "replay_max_staleness": None if rl.replay_max_staleness < 0 else rl.replay_max_staleness,
        "persist_dir": persist,
    }


def shape_settings(config: Any) -> ShapeSettings:
    """The fields of `config.rl`, `env`, `sft` and `model` the learner's shape set is decided
    from (`cua_jax.rl.shapes`)."""
    rl, env = config.rl, config.env
    unit = 128
    model = config.get("model")
    if model is not None and model.get("attn_impl", "") == "splash":
        unit = max(unit, model.get("attn_block", 0) or 512)
    return ShapeSettings(
        row_lengths=tuple(int(n) for n in rl.row_lengths),
        episodes=rl.group_size * rl.groups_per_batch,
        sft_rows=rl.rows_per_step,
        viewport=(env.viewport_width, env.viewport_height),
        max_turns=env.max_turns,
        max_history_images=env.max_history_images,
        learner_rows=rl.learner_rows,
        images_per_row=rl.images_per_row,
        tokens_per_chip=int(rl.get("tokens_per_chip", 0)),
        screens_per_chip=int(rl.get("screens_per_chip", 0)),
        strict=bool(rl.strict_shapes),
        sdpo=rl.get("algorithm", "grpo") == "sdpo",
        feedback_kinds=frozenset(feedback_kinds(rl.sdpo_feedback)),
        max_tokens=rl.max_tokens,
        sft_feedback=config.sft.get("feedback_share", 0.0) > 0,
        row_unit=unit,
    )


def shape_set(config: Any, image_config: Any, *, row_multiple: int = 1) -> ShapeSet:
    """The shape set of `config` (`ShapeSet.build` of its `shape_settings`)."""
    return ShapeSet.build(shape_settings(config), image_config, row_multiple=row_multiple)


def learner_shapes(config: Any, learner: Any, image_config: Any) -> ShapeSet:
    """The learner's shape set for `config`: multi-process jobs use the same global shapes,
    rows rounded to a multiple of the process count."""
    n = jax.process_count()
    multiple = learner.row_multiple * n // math.gcd(learner.row_multiple, n)
    return shape_set(config, image_config, row_multiple=multiple)


def warmup_settings(config: Any) -> warmup.WarmupSettings:
    """What the warm-up compiles (`rl.warmup`, `rl.entropulse_every`, `rl.strict_shapes`,
    `env.max_history_images`)."""
    rl = config.rl
    return warmup.WarmupSettings(
        mode=rl.warmup,
        entropulse=rl.entropulse_every > 0,
        strict=bool(rl.strict_shapes),
        max_images=config.env.max_history_images,
    )


def serve_settings(config: Any) -> ServeSettings:
    """The live policy server's settings (`config.serve`)."""
    sv = config.serve
    return ServeSettings(
        port=int(sv.port), host=sv.host, token=sv.token or None, max_tokens=sv.max_tokens
    )


def build_entropulse(config: Any) -> Entropulse | None:
    """The run's `Entropulse` (None when `rl.entropulse_every` is 0)."""
    rl = config.rl
    if rl.entropulse_every <= 0:
        return None
    return Entropulse(
        every=rl.entropulse_every,
        sft_steps=rl.entropulse_sft_steps,
        rows=rl.rows_per_step,
        reset_optimizer=rl.entropulse_reset_optimizer,
    )


def build_checkpointer(config: Any, workdir: str) -> Checkpointer:
    ck = config.ckpt
    return Checkpointer(
        os.path.join(workdir, "checkpoints"),
        keep=ck.keep,
        save_every=ck.save_every,
        async_save=ck.async_save,
    )


def restore_run_model(config: Any, workdir: str, mesh: Any, rules: Any, step: int | None = None):
    """(model, processor, step) of a run's checkpoint at `step` (None: the latest): the model as
    the run built it, its init weights (`init_model_weights`), then the checkpoint's trainable
    params. Raises `CheckpointError` naming the steps there when there is no such checkpoint."""
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=10**6)
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None or step not in ckpt.all_steps():
            where = f"{workdir}/checkpoints (steps there: {ckpt.all_steps()})"
            raise CheckpointError(
                f"no checkpoint in {where}"
                if step is None
                else f"no checkpoint at step {step} in {where}"
            )
        model, processor = build_model_and_processor(config, mesh, rules)
        init_model_weights(model, config)  # weights the run started from (frozen ones too)
        learner = build_learner(model, config, mesh, rules, sft=False)
        state, _ = ckpt.restore(learner.abstract_state(), step=step)
        learner.load_state_dict(state)
    finally:
        ckpt.close()
    return learner.model, processor, step


__all__ = [
    "build_checkpointer",
    "build_engine",
    "build_learner",
    "build_model_and_processor",
    "build_rollout_settings",
    "build_rollout_source",
    "build_rollout_source_share",
    "check_mid",
    "eval_settings",
    "grpo_settings",
    "init_model_weights",
    "mesh_and_rules",
    "restore_run_model",
    "sampler_mesh",
    "sampler_params",
]
