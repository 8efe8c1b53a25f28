"""The one trainer: SFT warm-up (optional), then multi-turn GRPO, sync or async.

    main(config, workdir, env_factory=..., load_tasks=...)

`launch/tpu.py` builds `env_factory` (a function returning an async-context-managed env pool
with `acquire()`) and `load_tasks` (task-source dicts -> list[Task]) from `envs/`, so this module
never imports `envs`. The ConfigDict stops here: every library object below gets typed
arguments. Reads top to bottom:

    setup -> resume -> eval@0 -> SFT warm-up -> GRPO steps (rollouts -> store -> learner ->
    sampler weights) with eval / checkpoints / metrics -> final eval, curves, export hints
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging

from cua_jax import metrics as metrics_lib
from cua_jax import sharding as shd
from cua_jax.checkpoint.orbax_io import Checkpointer, CheckpointError, init_params
from cua_jax.env_api import Task
from cua_jax.rl.rollout import AgentLoop, RolloutSettings, episode_seed
from cua_jax.rl.trajectory import Trajectory
from cua_jax.sampler.kernels.paged_attention import GpuKernelOptions

_ENUMS = {
    "model.family": ("qwen2_5_vl", "qwen3_vl"),
    "model.dtype": ("float32", "bfloat16"),
    "model.param_dtype": ("float32", "bfloat16"),
    "model.remat": ("none", "full", "dots"),
    "rl.mode": ("sync", "async"),
    "rl.kl_estimator": ("k1", "k2", "k3"),
    "rl.loss_agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "rl.old_logprobs": ("behaviour", "learner"),
    "optim.schedule": ("constant", "cosine"),
    "env.kind": ("browser", "vm"),
    "env.action_format": ("qwen25vl", "qwen3vl", "pyautogui"),
    "env.system_prompt": ("tools", "compact"),
    "sampler.backend": ("auto", "tpu", "gpu", "interpret", "reference"),
}


class ConfigError(ValueError):
    """A config value that type-checks but means nothing; names the key and the valid values."""


def validate_config(config: Any) -> None:
    """Fails before any work starts on values the flag parser cannot catch."""
    for key, valid in _ENUMS.items():
        section, name = key.split(".")
        value = config[section][name]
        if value not in valid:
            raise ConfigError(f"config.{key}={value!r} is not one of {', '.join(valid)}")
    positive = (
        *("rl.group_size", "rl.groups_per_batch", "rl.max_tokens", "env.concurrency"),
        *("env.max_turns", "sampler.max_slots", "sampler.page_size", "sampler.num_pages"),
        *("log.eval_every", "ckpt.keep", "ckpt.save_every"),
    )
    for key in positive:
        section, name = key.split(".")
        if config[section][name] < 1:
            raise ConfigError(f"config.{key}={config[section][name]} must be >= 1")
    if config.rl.loss_norm < 0:
        raise ConfigError(
            f"config.rl.loss_norm={config.rl.loss_norm} must be >= 0 (0: the generation budget)"
        )
    if config.rl.invalid_action_penalty < 0:
        raise ConfigError(
            f"config.rl.invalid_action_penalty={config.rl.invalid_action_penalty} must be >= 0 "
            "(it is subtracted from the reward per invalid action)"
        )
    sc = config.sampler
    if -(-sc.max_seq_len // sc.page_size) > sc.num_pages - 1:
        raise ConfigError(
            f"config.sampler.max_seq_len={sc.max_seq_len} needs "
            f"{-(-sc.max_seq_len // sc.page_size)} KV pages of config.sampler.page_size="
            f"{sc.page_size}, but config.sampler.num_pages={sc.num_pages} holds "
            f"{sc.num_pages - 1} (page 0 is scratch)"
        )
    try:
        GpuKernelOptions.parse(config.sampler.gpu_kernel)
    except ValueError as e:
        raise ConfigError(f"config.sampler.gpu_kernel={config.sampler.gpu_kernel!r}: {e}") from None
    init_from = config.ckpt.init_params_from
    if init_from:
        if config.ckpt.load_checkpoint_path:
            raise ConfigError(
                "config.ckpt.init_params_from and config.ckpt.load_checkpoint_path are exclusive: "
                "the first starts a new run from saved weights, the second resumes a run"
            )
        if not os.path.isdir(init_from):
            raise ConfigError(
                f"config.ckpt.init_params_from={init_from!r} is not a directory (pass a run's "
                "workdir or its checkpoints directory, WORKDIR/checkpoints)"
            )
    if config.rl.logits_chunk < 0:
        raise ConfigError(f"config.rl.logits_chunk={config.rl.logits_chunk} must be >= 0")
    if not config.rl.temperature > 0:
        raise ConfigError(
            f"config.rl.temperature={config.rl.temperature} must be > 0 (rollouts sample at it; "
            "the learner scores the same tempered policy; eval is greedy regardless)"
        )
    if not 0 < config.rl.top_p <= 1:
        raise ConfigError(f"config.rl.top_p={config.rl.top_p} must be in (0, 1]")
    if config.rl.top_p < 1 and config.rl.old_logprobs == "behaviour":
        # The sampler reports log-probs of the nucleus-truncated distribution it drew from; the
        # learner scores the full (tempered) one, so the PPO ratio would not start at 1.
        raise ConfigError(
            f"config.rl.top_p={config.rl.top_p} needs config.rl.old_logprobs='learner' (the "
            "ratio is anchored at the learner's own log-probs; truncated importance sampling "
            "with rl.tis_cap corrects the nucleus truncation)"
        )
    if not 0.0 <= config.sft.recovery_share <= 1.0:
        raise ConfigError(
            f"config.sft.recovery_share={config.sft.recovery_share} must be in [0, 1] (the share "
            "of oracle demonstrations that start with a scripted miss)"
        )
    src = config.sft.source
    if config.sft.steps > 0 and src != "oracle":
        if not (os.path.isdir(src) or (os.path.isfile(src) and src.endswith(".jsonl"))):
            raise ConfigError(
                f"config.sft.source={src!r} does not exist or is not a trajectory directory / "
                ".jsonl file (use 'oracle' for the tasks' scripted demonstrations)"
            )
    if config.rl.group_size < 2:
        raise ConfigError("config.rl.group_size must be >= 2: GRPO compares rollouts in a group")
    if config.model.hf_path is None and config.model.preset != "tiny":
        raise ConfigError(
            f"preset {config.preset!r} trains a real checkpoint: pass "
            "--config.model.hf_path=/path/to/local/hf_dir (a Qwen2.5-VL / Qwen3-VL directory)"
        )
    if config.model.hf_path is not None:
        path = config.model.hf_path
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise ConfigError(
                f"config.model.hf_path={path!r} is not a Hugging Face model directory "
                "(no config.json); point it at a local Qwen2.5-VL / Qwen3-VL checkpoint"
            )
        with open(cfg_file) as f:
            model_type = json.load(f).get("model_type")
        if model_type not in ("qwen2_5_vl", "qwen3_vl"):
            raise ConfigError(
                f"config.model.hf_path={path!r} holds a {model_type!r} model; cua_jax trains "
                "Qwen2.5-VL ('qwen2_5_vl') and Qwen3-VL ('qwen3_vl') checkpoints"
            )


# ---------------------------------------------------------------------------------------------
# Building blocks (small, typed; each is used once below)
# ---------------------------------------------------------------------------------------------


def build_model_and_processor(config: Any, mesh: Any, rules: Any):
    """The policy and its processor: a local HF checkpoint, or the tiny preset at random init
    with the tokenizer the project ships."""
    from cua_jax.data.processor import QwenVLProcessor
    from cua_jax.models import qwen_vl

    mc = config.model
    if mc.hf_path is not None:
        model = qwen_vl.from_pretrained(mc.hf_path, dtype=mc.param_dtype, mesh=mesh, rules=rules)
        model.config = model.config.replace(dtype=mc.dtype, remat=mc.remat)
        processor = QwenVLProcessor.from_pretrained(mc.hf_path)
        return model, processor
    # Tiny screens: a screenshot of the smoke viewport is a few dozen merged tokens.
    w, h = config.env.viewport_width, config.env.viewport_height
    processor = QwenVLProcessor.default(mc.family, max_pixels=w * h, min_pixels=32 * 32)
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
    )
    return qwen_vl.init_random(cfg, seed=config.seed), processor


def init_model_weights(model: Any, config: Any) -> int:
    """Writes `config.ckpt.init_params_from`'s saved weights into `model` (none when unset);
    run before restoring a run's own checkpoint, which holds only its trainable params (its
    frozen ones came from here). Returns the number of arrays set."""
    src = config.ckpt.get("init_params_from")
    if not src:
        return 0
    if os.path.isdir(os.path.join(src, "checkpoints")):  # a run's workdir: its checkpoints
        src = os.path.join(src, "checkpoints")
    step = config.ckpt.get("init_params_step", -1)
    source = Checkpointer(src, keep=10**6)
    try:
        n = init_params(model, source.restore_params(None if step < 0 else step))
    finally:
        source.close()
    logging.warning("initialized %d parameter arrays from %s", n, src)
    return n


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
    return model, processor, step


def build_learner(model: Any, config: Any, mesh: Any, rules: Any, *, sft: bool):
    from cua_jax.rl import learner as L

    rl, opt = config.rl, config.optim
    lr = config.sft.learning_rate if sft else rl.learning_rate
    steps = config.sft.steps if sft else config.total_steps
    optimizer = L.OptimizerConfig(
        learning_rate=lr,
        schedule=opt.schedule,
        warmup_steps=opt.warmup_steps,
        decay_steps=max(1, steps - opt.warmup_steps),
        weight_decay=opt.weight_decay,
        b1=opt.b1,
        b2=opt.b2,
        max_grad_norm=opt.grad_clip if opt.grad_clip > 0 else None,
    )
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
        optimizer=optimizer,
        loss=loss,
        advantages=advantages,
        lora=lora,
        num_substeps=rl.num_substeps,
        freeze_vision=mc.freeze_vision,
        remat=mc.remat,
        seq_len_buckets=tuple(rl.row_lengths),
        # Async RL: the engine keeps decoding with the current params while the step runs, so
        # the step must not donate (delete) them; the engine drops them at the next version.
        donate=sft or rl.mode != "async",
        banned_token_ids=model.config.vision_placeholder_ids,
        logits_chunk=rl.logits_chunk,
    )


def build_engine(model: Any, config: Any, tokenizer: Any):
    from cua_jax.sampler import Engine

    sc = config.sampler
    return Engine(
        model,
        max_slots=sc.max_slots,
        page_size=sc.page_size,
        num_pages=sc.num_pages,
        max_seq_len=sc.max_seq_len,
        decode_chunk=sc.decode_chunk,
        attn_backend=sc.backend,
        attn_options=sc.gpu_kernel,
        detokenize=tokenizer.decode,
    )


def build_rollout_settings(config: Any, model: Any) -> RolloutSettings:
    rl, env = config.rl, config.env
    return RolloutSettings(
        max_turns=env.max_turns,
        max_history_images=env.max_history_images,
        max_new_tokens=rl.max_tokens,
        temperature=rl.temperature,
        top_p=rl.top_p,
        invalid_action_penalty=rl.invalid_action_penalty,
        action_format=env.action_format,
        system_prompt=env.system_prompt,
        banned_token_ids=model.config.vision_placeholder_ids,
    )


class TaskCursor:
    """Deterministic, resumable order over the training tasks (reshuffled every epoch).

    Async mode takes tasks ahead of the learner (`take_tracked`): a task stays *outstanding*
    until the learner takes its group (`done`). A checkpoint saves those positions with the
    cursor (`pending`), and a resumed run rolls them out again first (`replay`), so no task the
    learner never saw is skipped by a restart.
    """

    def __init__(self, tasks: Sequence[Task], seed: int, position: int = 0):
        if not tasks:
            raise ValueError("the training task list is empty: check config.tasks")
        self.tasks = list(tasks)
        self.seed = seed
        self.position = position
        self.replay: list[int] = []  # positions to roll out before new ones (after a resume)
        self._outstanding: dict[int, None] = {}  # insertion-ordered set

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.tasks)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def task_at(self, position: int) -> Task:
        epoch, i = divmod(position, len(self.tasks))
        return self.tasks[self._order(epoch)[i]]

    def take(self, n: int) -> list[Task]:
        out = []
        for _ in range(n):
            out.append(self.task_at(self.position))
            self.position += 1
        return out

    def take_tracked(self) -> tuple[int, Task]:
        """(position, task): a replayed position first, else the next one; outstanding until
        `done(position)`."""
        if self.replay:
            pos = self.replay.pop(0)
        else:
            pos = self.position
            self.position += 1
        self._outstanding[pos] = None
        return pos, self.task_at(pos)

    def done(self, position: int) -> None:
        self._outstanding.pop(position, None)

    def pending(self) -> list[int]:
        """Positions taken but not yet trained on, and those still to replay."""
        return sorted({*self._outstanding, *self.replay})


def success_by_category(trajs: Sequence[Trajectory], tasks: Sequence[Task]) -> dict[str, float]:
    by_cat: dict[str, list[float]] = defaultdict(list)
    for traj, task in zip(trajs, tasks, strict=True):
        by_cat[task.category or "all"].append(float(traj.success))
    out = {f"eval/success/{k}": float(np.mean(v)) for k, v in sorted(by_cat.items())}
    out["eval/success"] = float(np.mean([t.success for t in trajs])) if trajs else 0.0
    out["eval/reward"] = float(np.mean([t.reward for t in trajs])) if trajs else 0.0
    return out


def rollout_metrics(groups: Sequence[Sequence[Trajectory]], version: int) -> dict[str, float]:
    trajs = [t for g in groups for t in g]
    if not trajs:
        return {}
    turns = [len(t.turns) for t in trajs]
    gen = [t.num_generated for t in trajs]
    invalid = sum(t.timings.get("invalid_actions", 0.0) for t in trajs)
    return {
        "rollout/reward": float(np.mean([t.reward for t in trajs])),
        "rollout/score": float(np.mean([t.score or 0.0 for t in trajs])),
        "rollout/success": float(np.mean([t.success for t in trajs])),
        "rollout/episode_turns": float(np.mean(turns)),
        "rollout/generated_tokens": float(np.sum(gen)),
        "rollout/invalid_action_rate": float(invalid / max(1, sum(turns))),
        "rollout/env_failures": float(sum(t.infra_fault for t in trajs)),
        "rollout/staleness_max": float(max(version - t.policy_version for t in trajs)),
        "rollout/staleness_mean": float(np.mean([version - t.policy_version for t in trajs])),
    }


def write_episodes(path: str, episodes, decode: Callable, title: str) -> None:
    from cua_jax.viz import episodes_html

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(episodes_html(episodes, decode, title))


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def main(
    config: Any,
    workdir: str,
    *,
    env_factory: Callable[[], Any],
    load_tasks: Callable[[Any], list[Task]],
) -> dict[str, float]:
    """Runs the job described by `config` in `workdir`; returns the last eval metrics."""
    validate_config(config)
    tasks = load_tasks([dict(t) for t in config.tasks])
    eval_tasks = load_tasks([dict(t) for t in config.eval_tasks])
    _warn_if_turns_cut(tasks + eval_tasks, config.env.max_turns)
    os.makedirs(workdir, exist_ok=True)
    return asyncio.run(_main(config, workdir, env_factory, tasks, eval_tasks))


def _warn_if_turns_cut(tasks: Sequence[Task], max_turns: int) -> None:
    """An episode lasts min(task.max_steps, env.max_turns) turns: say so where the config cuts
    tasks short (those whose solution needs more turns cannot succeed)."""
    cut = sorted({t.id.rsplit("/", 1)[0] for t in tasks if t.max_steps > max_turns})
    if cut:
        logging.warning(
            "%d task kinds allow more steps than config.env.max_turns=%d, up to %d; their "
            "episodes end after %d turns, so a task that needs more cannot succeed: %s",
            len(cut), max_turns, max(t.max_steps for t in tasks), max_turns,
            ", ".join(cut[:10]) + (" ..." if len(cut) > 10 else ""),
        )  # fmt: skip


async def _main(config, workdir, env_factory, tasks, eval_tasks) -> dict[str, float]:
    is_main = jax.process_index() == 0
    t_job = time.perf_counter()

    # ---- mesh, model, processor -----------------------------------------------------------
    mesh = shd.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
    rules = tuple(shd.DEFAULT_RULES) + tuple(tuple(r) for r in config.mesh.rules)
    model, processor = build_model_and_processor(config, mesh, rules)
    tokenizer = processor.tokenizer
    if is_main:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2))

    # ---- a run may start from another run's weights (not its optimizer or step); applied on
    # resume too, since parameters this run keeps frozen are not in its own checkpoints ------
    init_model_weights(model, config)

    # ---- learner, sampler, store, checkpoints, metrics -------------------------------------
    from cua_jax.rl.store import TrajectoryStore

    learner = build_learner(model, config, mesh, rules, sft=False)
    engine = build_engine(model, config, tokenizer)
    rl = config.rl
    settings = build_rollout_settings(config, model)
    agent = AgentLoop(engine, processor, settings)
    in_flight = max(1, config.env.concurrency // rl.group_size) + rl.groups_per_batch
    store = TrajectoryStore(
        capacity=rl.group_size * (in_flight + rl.groups_per_batch),
        group_size=rl.group_size,
        max_steps_off_policy=rl.max_steps_off_policy,
    )
    ckpt = Checkpointer(
        os.path.join(workdir, "checkpoints"),
        keep=config.ckpt.keep,
        save_every=config.ckpt.save_every,
        async_save=config.ckpt.async_save,
    )
    writer = metrics_lib.MetricsWriter(
        workdir,
        enabled=is_main,
        tensorboard=config.log.tensorboard,
        wandb_project=config.log.wandb_project,
        wandb_name=config.log.wandb_name,
        config=config.to_dict(),
    )
    cursor = TaskCursor(tasks, config.seed)

    # ---- resume: this workdir's own checkpoints first, else ckpt.load_checkpoint_path -----
    step, sft_done = 0, config.sft.steps == 0
    resume_from = ckpt
    if ckpt.latest_step() is None and config.ckpt.load_checkpoint_path:
        resume_from = Checkpointer(config.ckpt.load_checkpoint_path, keep=config.ckpt.keep)
        if resume_from.latest_step() is None:
            raise ConfigError(
                f"config.ckpt.load_checkpoint_path={config.ckpt.load_checkpoint_path!r} holds "
                "no checkpoint (expected step directories written by a cua_jax run)"
            )
    resumed = resume_from.latest_step() is not None
    if resumed:
        state, meta = resume_from.restore(learner.abstract_state())
        learner.load_state_dict(state)
        step, cursor.position, sft_done = int(meta["step"]), int(meta["cursor"]), True
        cursor.replay = [int(p) for p in meta.get("replay", [])]
        store.load_state_dict(meta["store"])
        writer.truncate_after(step)
        logging.info("resumed from %s at step %d", resume_from.directory, step)
    else:  # a rerun of a run that died before its first checkpoint starts its metrics afresh
        writer.truncate_after(-1)
    engine.update_params(learner.params_for_sampler(), learner.version)
    store.set_version(learner.version)

    def save(force: bool = False) -> None:
        meta = {
            "cursor": cursor.position, "replay": cursor.pending(), "store": store.state_dict(),
            "sft_done": True,
        }  # fmt: skip
        ckpt.save(step, learner.state_dict(), meta, force=force)

    progress = metrics_lib.Progress(
        config.total_steps, initial=step, desc="grpo", enabled=is_main and config.log.progress
    )
    last_eval: dict[str, float] = {}

    async with env_factory() as pool:

        async def run_eval(tag: str) -> dict[str, float]:
            screens: list = []
            t0 = time.perf_counter()
            trajs = await agent.evaluate(pool, eval_tasks, seed=config.seed, screens=screens)
            out = success_by_category(trajs, eval_tasks)
            out["time/eval"] = time.perf_counter() - t0
            if is_main:
                n = config.log.num_groups_to_log * rl.group_size
                write_episodes(
                    os.path.join(workdir, "episodes", f"eval_{tag}.html"),
                    list(zip(trajs[:n], screens[:n], strict=True)),
                    tokenizer.decode,
                    f"eval {tag}: success {out['eval/success']:.2f}",
                )
            progress.write(f"eval {tag}: success {out['eval/success']:.3f}")
            return out

        # ---- eval at step 0 (before any training) ---------------------------------------------
        if not resumed:
            last_eval = await run_eval("step0")
            writer.write(0, {**last_eval, "phase_sft": 0.0})

        # ---- SFT warm-up on oracle demonstrations --------------------------------------------
        if not sft_done:
            # The RL learner built above holds an optimizer state (and a KL reference copy) that
            # SFT does not use: release it while the SFT learner holds its own.
            learner = None
            sft_metrics = await _sft_warmup(
                config, model, mesh, rules, agent, pool, cursor, workdir
            )
            learner = build_learner(model, config, mesh, rules, sft=False)  # fresh RL optimizer
            engine.update_params(learner.params_for_sampler(), learner.version)
            last_eval = await run_eval("after_sft")
            writer.write(0, {**sft_metrics, **last_eval, "phase_sft": 1.0})
            save(force=True)

        # ---- GRPO ------------------------------------------------------------------------------
        timers = defaultdict(float)
        producer = None
        if rl.mode == "async":
            gate = StalenessGate(rl.max_steps_off_policy, rl.groups_per_batch)
            producer = asyncio.create_task(_produce(agent, pool, store, cursor, config, gate))
        while step < config.total_steps:
            t_step = time.perf_counter()
            logged_screens: list = []
            if rl.mode == "sync":
                t0 = time.perf_counter()
                picked = cursor.take(rl.groups_per_batch)
                groups = await asyncio.gather(
                    *(
                        agent.run_group(
                            pool,
                            task,
                            rl.group_size,
                            seed=episode_seed(config.seed, step, i),
                            group_id=f"{step}/{i}",
                            screens=logged_screens if i < config.log.num_groups_to_log else None,
                        )
                        for i, task in enumerate(picked)
                    )
                )
                for g in groups:
                    for traj in g:
                        await store.put_async(traj, timeout=60)
                timers["rollout"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            groups = await store.get_groups_async(rl.groups_per_batch, timeout=3600)
            timers["idle"] = time.perf_counter() - t0 if rl.mode == "async" else 0.0
            if rl.mode == "async":  # these tasks are trained on now: nothing to replay
                for g in groups:
                    cursor.done(int(g[0].group_id.removeprefix("a")))
            step_metrics = rollout_metrics(groups, learner.version)
            t0 = time.perf_counter()
            batch, info = learner.prepare_batch(groups)
            if batch is not None:
                train_metrics = await asyncio.to_thread(learner.train_step, batch)
            else:  # every group had equal rewards: nothing to learn from this batch
                train_metrics = {"skipped_no_signal": 1.0}
            timers["train"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            engine.update_params(learner.params_for_sampler(), learner.version)
            store.set_version(learner.version)
            if producer is not None:
                gate.step_done()
            timers["sync"] = time.perf_counter() - t0
            step += 1
            total = time.perf_counter() - t_step
            row = {
                **step_metrics,
                **{f"train/{k}": v for k, v in {**info, **train_metrics}.items()},
            }
            row.update({f"time/{k}": v for k, v in timers.items()}, **{"time/step": total})
            row.update({f"store/{k}": float(v) for k, v in store.stats().items()})
            if rl.mode == "async":
                row["time/learner_idle_share"] = timers["idle"] / max(total, 1e-9)
            if is_main and logged_screens:
                write_episodes(
                    os.path.join(workdir, "episodes", f"train_step{step:05d}.html"),
                    list(zip([t for g in groups for t in g], logged_screens, strict=False)),
                    tokenizer.decode,
                    f"train step {step}",
                )
            if step % config.log.eval_every == 0 or step == config.total_steps:
                last_eval = await run_eval(f"step{step}")
                row.update(last_eval)
            writer.write(step, row)
            shown = {"reward": row.get("rollout/reward", 0.0)}
            if "eval/success" in last_eval:
                shown["eval"] = last_eval["eval/success"]
            progress.update(1, **shown)
            save(force=step == config.total_steps)
        if producer is not None:
            producer.cancel()
            store.close()
            await asyncio.gather(producer, return_exceptions=True)

    ckpt.close()
    writer.close()
    if is_main:
        rows = metrics_lib.read_metrics(writer.path)
        metrics_lib.plot_curves(
            rows,
            ["eval/success", "rollout/reward", "rollout/success", "train/loss"],
            os.path.join(workdir, "curves.png"),
            title=f"{config.model.family} {config.preset}",
        )
        summary = {
            "eval_success_step0": next(
                (r["eval/success"] for r in rows if r["step"] == 0 and "eval/success" in r), None
            ),
            # the last eval logged (a rerun of a finished run evaluates nothing new)
            "eval_success_final": next(
                (r["eval/success"] for r in reversed(rows) if "eval/success" in r), None
            ),
            "steps": step,
            "wall_s": time.perf_counter() - t_job,
        }
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        progress.write(f"summary: {json.dumps(summary)}")
    progress.close()
    return last_eval


async def _sft_warmup(
    config, model, mesh, rules, agent, pool, cursor, workdir: str | None = None
) -> dict[str, float]:
    """Behaviour cloning before RL (ComputerRL's SFT-then-RL recipe), from the tasks' oracle
    demonstrations (saved under WORKDIR/sft_demos for reuse) or from `config.sft.source`: a
    trajectory directory (`TrajectoryWriter` / `TrajectoryStore(persist_dir=)`) or a JSONL file
    of token-level episodes (`cua_jax.data.sft`)."""
    sc = config.sft
    t0 = time.perf_counter()
    learner = build_learner(model, config, mesh, rules, sft=True)
    if sc.source == "oracle":
        batches, info = await _oracle_sft_batches(config, learner, agent, pool, cursor, workdir)
    else:
        batches, info = sft_file_batches(
            sc.source, learner, batch_size=config.rl.rows_per_step, seed=config.seed
        )
    losses = []
    bar = metrics_lib.Progress(
        sc.steps, desc="sft", enabled=config.log.progress and jax.process_index() == 0
    )
    for _, batch in zip(range(sc.steps), batches, strict=False):
        m = await asyncio.to_thread(learner.sft_step, batch)
        losses.append(m.get("loss", np.nan))
        bar.update(1, loss=float(losses[-1]))
    bar.close()
    return {
        **info,
        "sft/steps": float(len(losses)),
        "sft/loss_first": float(losses[0]) if losses else float("nan"),
        "sft/loss_last": float(losses[-1]) if losses else float("nan"),
        "time/sft": time.perf_counter() - t0,
    }


async def _oracle_sft_batches(config, learner, agent, pool, cursor, workdir):
    from cua_jax.rl.store import TrajectoryWriter
    from cua_jax.rl.trajectory import trajectory_to_samples

    # Each task again with other seeds: the built-in templates randomize their layout by seed.
    demo_tasks = [
        dataclasses.replace(t, seed=t.seed + 7919 * r)
        for t in cursor.tasks
        for r in range(config.sft.episodes_per_task)
    ]
    demos = await agent.demonstrations(pool, demo_tasks, _recovery_detours(config, len(demo_tasks)))
    good = [d for d in demos if d.success]
    if not good:
        raise RuntimeError("no oracle demonstration succeeded; check the env and task oracles")
    if workdir is not None and jax.process_index() == 0:
        out = os.path.join(workdir, "sft_demos")
        if not os.path.exists(out):  # a resumed run keeps the first set
            writer = TrajectoryWriter(out)
            for d in good:
                writer.write(d)
            writer.close()
    pos_fn = learner.position_fn()
    samples = [s for d in good for s in trajectory_to_samples(d, 1.0, pos_fn)]
    rng = np.random.default_rng(config.seed)
    rows = config.rl.rows_per_step

    def batches():
        while True:
            idx = rng.choice(len(samples), size=min(len(samples), rows), replace=False)
            yield learner.pack([samples[i] for i in idx])

    info = {
        "sft/demos": float(len(good)),
        "sft/demo_success": float(len(good) / len(demos)),
        "sft/recovery_demos": float(sum(not d.turns[0].trained for d in good if d.turns)),
    }
    return batches(), info


def _recovery_detours(config: Any, n: int) -> list[Any]:
    """`config.sft.recovery_share` of `n` demonstrations start with a click at a uniformly random
    point of the screen (a miss, mostly; one that ends or spoils the episode is dropped with the
    failed demonstrations), the rest with the oracle. The point is drawn as a fraction of the
    screen and placed on the size the episode's first screenshot has (VM screens differ from
    `config.env.viewport_*`)."""
    from cua_jax.actions import Click

    rng = np.random.default_rng(config.seed + 1)
    k = round(config.sft.recovery_share * n)
    which = set(rng.choice(n, size=k, replace=False).tolist()) if k else set()
    fractions = rng.random((n, 2))

    def click_at(fx: float, fy: float) -> Callable[[int, int], Click]:
        return lambda w, h: Click(float(int(fx * w)), float(int(fy * h)))

    return [click_at(*fractions[i]) if i in which else None for i in range(n)]


def sft_file_batches(path: str, learner: Any, *, batch_size: int, seed: int = 0):
    """(endless iterator of packed SFT batches, info) from a trajectory directory or a JSONL
    file of demonstrations; only successful episodes are used, reshuffled every epoch."""
    from cua_jax.data.sft import JsonlDemonstrations, sft_dataset
    from cua_jax.rl.store import TrajectoryReader

    if os.path.isdir(path):
        source = TrajectoryReader(path)
        n_good = sum(bool(source.metadata(i)["success"]) for i in range(len(source)))
    elif os.path.isfile(path) and path.endswith(".jsonl"):
        source = JsonlDemonstrations(path)
        n_good = sum(source[i].success for i in range(len(source)))
    else:
        raise ConfigError(
            f"config.sft.source={path!r} is neither 'oracle', a trajectory directory, nor a "
            ".jsonl file of demonstrations"
        )
    if n_good == 0:
        raise ConfigError(f"config.sft.source={path!r} holds no successful episode")
    ds = sft_dataset(
        source, learner.pack, batch_size=min(batch_size, n_good),
        position_fn=learner.position_fn(), seed=seed, num_epochs=None,
    )  # fmt: skip
    return iter(ds), {"sft/demos": float(n_good)}


class StalenessGate:
    """Admission control for async rollouts: a GRPO group starts only when the learner will take
    it within ``max_steps_off_policy`` versions of now, so nothing is produced just to be dropped.

    Count the groups ahead of a new one in the learner's consumption order: those rolling out,
    those complete in the store, and those the learner already took for the step it is running
    now (that step ends with a version bump). With P such groups the new one is taken after
    ⌊P / groups_per_batch⌋ version bumps, so it may start while
    P < (max_steps_off_policy + 1) * groups_per_batch. With ``max_steps_off_policy=0`` this is
    on-policy: rollouts for the next batch start only once the learner has published the version
    they will be trained against. (Groups finish out of order, so the store's staleness check
    still runs and counts what it drops.)
    """

    def __init__(self, max_steps_off_policy: int, groups_per_batch: int) -> None:
        self.limit = (max_steps_off_policy + 1) * groups_per_batch
        self.groups_per_batch = groups_per_batch
        self.steps_done = 0  # learner steps finished since the producer started
        self._event = asyncio.Event()

    def step_done(self) -> None:
        """The learner finished a step on its batch and published the next version."""
        self.steps_done += 1
        self._event.set()

    def poke(self) -> None:
        """Something the producer's count depends on changed (a group finished)."""
        self._event.set()

    async def wait_open(self, ahead: Callable[[], int]) -> None:
        """Returns once fewer than `limit` groups are ahead (one waiter: the producer)."""
        while ahead() >= self.limit:
            self._event.clear()
            await self._event.wait()


async def _produce(agent, pool, store, cursor, config, gate: StalenessGate) -> None:
    """Async mode: keeps up to `env.concurrency` episodes going, group by group, while the
    learner trains; `gate` keeps every group within the staleness bound, and the store drops
    (and counts) any that still arrive too old."""
    from cua_jax.rl.store import StoreClosed

    rl = config.rl
    sem = asyncio.Semaphore(max(1, config.env.concurrency // rl.group_size))
    tasks: set[asyncio.Task] = set()

    trained_at_start = store.stats()["trained"]

    def ahead() -> int:
        # rolling out + complete in the store + taken for the learner's running step. "trained"
        # counts what the learner took, updated under the store's lock with the ready queue.
        st = store.stats()
        taken = (st["trained"] - trained_at_start) // rl.group_size
        running = taken - gate.steps_done * gate.groups_per_batch
        return len(tasks) + st["ready_groups"] + running

    async def one(task: Task, k: int) -> None:
        try:
            # seed and group id follow the task's cursor position: a replayed task after a
            # resume rolls out exactly as it would have
            group = await agent.run_group(
                pool, task, rl.group_size, seed=episode_seed(config.seed, "async", k),
                group_id=f"a{k}",
            )  # fmt: skip
            for traj in group:
                await store.put_async(traj, timeout=3600)
        except StoreClosed:  # the learner is done: this group is not needed any more
            pass
        finally:
            sem.release()

    def finished(t: asyncio.Task) -> None:
        tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:
            logging.error("async rollout group failed", exc_info=t.exception())
        gate.poke()

    try:
        while True:
            await sem.acquire()
            await gate.wait_open(ahead)
            pos, task = cursor.take_tracked()
            t = asyncio.create_task(one(task, pos))
            tasks.add(t)
            t.add_done_callback(finished)
    finally:  # cancelled at the end of training: stop the episodes still running
        for t in list(tasks):
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


__all__ = ["ConfigError", "main", "validate_config"]
