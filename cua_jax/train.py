"""The one trainer: SFT warm-up (optional), then multi-turn GRPO, sync or async.

    main(config, workdir, env_factory=..., load_tasks=...)

`launch/tpu.py` builds `env_factory` (a function returning an async-context-managed env pool
with `acquire()`) and `load_tasks` (task-source dicts -> list[Task]) from `envs/`, so this module
never imports `envs`. `run` reads top to bottom, in phases:

    set-up -> resume -> eval@0 -> SFT warm-up -> GRPO steps (rollout source -> learner ->
    sampler weights, eval / checkpoints / metrics) -> finish (curves, summary)

Where the ConfigDict goes: this module, `cua_jax.builders` (mesh, model, checkpointer, learner,
engine, rollout settings and source), the start-up checks (`config_checks.validate_config`,
`rl.levers.check_levers`, `check_mid`) and `redact.write_run_config` (WORKDIR's copy, secrets
redacted). Below them it reaches only the `from_config`-style
edges of a few modules, each of which reads its own sections and makes its typed objects:
`warmup.begin` (`config.rl`, `config.env`; through `rl.shapes.ShapeSet.from_config`, which
`cua_jax.plan` calls too, and `rl.shapes.teacher_row_length`, which also reads `config.model`),
`rl.entropulse.from_config` (`config.rl`), `rl.sdpo.from_config` (given `config.rl`),
`rl.levers` (`config.rl`: the advantage estimator and the rollout source's levers) and
`evaluation.live.serve_live_policy` (`config.serve`). Past those edges every library object
(Learner, Engine, AgentLoop, ShapeSet, Entropulse, SelfDistiller, the rollout source) gets typed
arguments. The shape set stays a `from_config` because `tools/plan.py` builds the same shapes
from a config without a run.

A systematic rollout failure stops the run with `cua_jax.rl.sources.RolloutError`, a NaN or
infinite loss or gradient norm with `cua_jax.rl.learner.NonFiniteError`; `launch/tpu.py` turns
either into one line on stderr and exit status 1.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging
from etils import epath

from cua_jax import builders, compile_stats, multihost, redact, warmup
from cua_jax import db as db_lib
from cua_jax import metrics as metrics_lib
from cua_jax.builders import init_model_weights
from cua_jax.checkpoint.orbax_io import Checkpointer
from cua_jax.config_checks import ConfigError, validate_config
from cua_jax.data import sft as sft_lib
from cua_jax.data import shards
from cua_jax.env_api import Task
from cua_jax.evaluation.episodes import evaluate_policy, write_episodes
from cua_jax.evaluation.live import serve_live_policy
from cua_jax.evaluation.summary import run_summary
from cua_jax.rl import entropulse, sdpo, sft_data
from cua_jax.rl.learner import check_finite
from cua_jax.rl.levers import check_levers, source_levers, use_advantage_estimator
from cua_jax.rl.ppo import ppo_update
from cua_jax.rl.rollout import AgentLoop
from cua_jax.rl.sources import RolloutError
from cua_jax.rl.trajectory import Trajectory
from cua_jax.viz import plot_run_curves


def main(
    config: Any,
    workdir: str,
    *,
    env_factory: Callable[[], Any],
    load_tasks: Callable[[Any], list[Task]],
) -> dict[str, float]:
    """Runs the job described by `config` in `workdir`; returns the last eval metrics."""
    validate_config(config)
    check_levers(config)
    check_mid(config)
    tasks = load_tasks([dict(t) for t in config.tasks])
    eval_tasks = load_tasks([dict(t) for t in config.eval_tasks])
    _warn_if_turns_cut(tasks + eval_tasks, config.env.max_turns)
    epath.Path(workdir).mkdir(parents=True, exist_ok=True)  # a local path or gs://...
    return asyncio.run(run(config, workdir, env_factory, tasks, eval_tasks))


async def run(
    config: Any,
    workdir: str,
    env_factory: Callable[[], Any],
    tasks: Sequence[Task],
    eval_tasks: Sequence[Task],
) -> dict[str, float]:
    """`main` after the tasks are loaded: the whole job, phase by phase."""
    # ---- set-up: mesh, model, checkpoints, metrics ------------------------------------------
    is_main = jax.process_index() == 0
    t_job = time.perf_counter()
    compiles = compile_stats.install()  # compile counts and seconds per program (#23)
    job_mark = compiles.snapshot()
    rl = config.rl
    mesh, rules = builders.mesh_and_rules(config)
    model, processor = builders.build_model_and_processor(config, mesh, rules)
    decode = processor.tokenizer.decode
    if is_main:
        redact.write_run_config(workdir, config)  # tokens and passwords redacted, 0600
    # A run may start from another run's weights (not its optimizer or step); applied on resume
    # too, since parameters this run keeps frozen are not in its own checkpoints.
    init_model_weights(model, config)
    ckpt = builders.build_checkpointer(config, workdir)
    writer = metrics_lib.MetricsWriter(
        workdir,
        enabled=is_main,
        tensorboard=config.log.tensorboard,
        wandb_project=config.log.wandb_project,
        wandb_name=config.log.wandb_name,
        config=config.to_dict(),
    )

    # ---- resume: this workdir's own checkpoints first, else ckpt.load_checkpoint_path ------
    # The learner takes ownership of the model (LoRA, sharding); the sampler decodes exactly
    # `learner.model`. Without a checkpoint to resume and with an SFT warm-up, the first learner
    # is the SFT one; the RL learner is built after it (fresh optimizer, SFT policy as the KL
    # reference).
    resume_from = _resume_source(config, ckpt)
    # the grounding mid-training (config.mid) and the SFT warm-up share the SFT learner
    run_mid = resume_from is None and config.mid.steps > 0
    run_sft = resume_from is None and (config.sft.steps > 0 or run_mid)
    learner = builders.build_learner(model, config, mesh, rules, sft=run_sft)
    use_advantage_estimator(learner, config)
    del model
    # The trajectory database (tools/monitor.py shows it): never slows or fails the run.
    db = db_lib.open_run(
        workdir,
        config.log.db_url or None,
        run_name=os.path.basename(os.path.abspath(workdir)),
        config=config.to_dict(),
        decode=decode,
        advantage=learner.advantage_config,
        enabled=config.log.db,
        process_index=jax.process_index(),  # multi-host: each process records its own groups
    )
    step, meta = 0, None
    if resume_from is not None:
        state, meta = resume_from.restore(learner.abstract_state())
        learner.load_state_dict(state)
        step = int(meta["step"])
        logging.info("resumed from %s at step %d", resume_from.directory, step)
        if resume_from is not ckpt:
            resume_from.close()
    # a resume redoes the steps after `step`; a rerun of a run that died before its first
    # checkpoint starts its metrics afresh (-1)
    writer.truncate_after(step if resume_from is not None else -1)
    db.truncate_after(step if resume_from is not None else -1)
    if jax.process_count() > 1:  # process 0's truncate drops every process's rows: it lands
        if is_main:  # before any process writes a redone step's groups
            db.flush(60)
        multihost.sync("db_truncate")
    num_pages = builders.kv_pages(config, learner, processor.image_config)
    engine = builders.build_engine(
        learner.model, config, processor.tokenizer, mesh=mesh, rules=rules, num_pages=num_pages
    )
    engine.update_params(builders.sampler_params(learner), learner.version)
    agent = AgentLoop(engine, processor, builders.build_rollout_settings(config, learner.model))
    progress = metrics_lib.Progress(
        config.total_steps, initial=step, desc="grpo", enabled=is_main and config.log.progress
    )
    episodes_dir = os.path.join(workdir, "episodes") if is_main else None
    n_logged = config.log.num_groups_to_log * rl.group_size
    last_eval: dict[str, float] = {}
    # The learner's shape set, compiled ahead in a thread while the environments start (#23)
    distiller = sdpo.from_config(rl, processor.chat)  # None unless rl.algorithm=sdpo
    warm = warmup.begin(
        config, learner, engine, processor.image_config, sft_phase=run_sft, distiller=distiller
    )
    if learner.shapes is not None:
        progress.write(learner.shapes.describe())

    async with env_factory() as pool:
        # multi-host: this process's share of the tasks, and of each step's groups
        source = builders.build_rollout_source_share(config, agent, pool, tasks, learner.version)
        source.use_levers(**source_levers(config, workdir))
        if meta is not None:
            source.load_state_dict(_process_meta(meta))

        async def evaluate(tag: str, at_step: int) -> dict[str, float]:
            out = await evaluate_policy(
                agent,
                pool,
                eval_tasks,
                tag,
                seed=config.seed,
                episodes_dir=episodes_dir,
                num_logged=n_logged,
                decode=decode,
                db=db,
                step=at_step,
            )
            progress.write(f"eval {tag}: success {out['eval/success']:.3f}")
            return out

        db_status, server = "finished", None
        try:
            # ---- the live policy server (config.serve.port): the rollouts' own Engine ----------
            server = await serve_live_policy(
                config, workdir, engine, processor, learner.model.config.vision_placeholder_ids
            )
            # ---- eval at step 0 (before any training; log.eval_before_sft=False skips it when
            # an SFT warm-up follows, whose eval is then the first) -----------------------------
            if resume_from is None and (config.log.eval_before_sft or not run_sft):
                last_eval = await evaluate("step0", 0)
                writer.write(0, {**last_eval, "phase_sft": 0.0})
                db.log_step(0, {**last_eval, "phase_sft": 0.0})

            # ---- grounding mid-training, then the SFT warm-up ----------------------------------
            if run_sft:
                await asyncio.to_thread(warm.wait, compiles)
                sft_metrics = {}
                if run_mid:
                    sft_metrics = await _mid_training(config, learner, agent, engine, workdir)
                if config.sft.steps > 0:
                    sft_tasks = tasks[: config.sft.num_tasks or None]
                    sft_metrics |= await _sft_warmup(
                        config, learner, agent, pool, multihost.task_share(sft_tasks), workdir
                    )
                sft_metrics = _job_metrics(sft_metrics)
                policy = learner.model
                del learner  # its optimizer state goes before the RL learner makes its own
                learner = builders.build_learner(policy, config, mesh, rules, sft=False)
                use_advantage_estimator(learner, config)
                warm = warmup.begin(
                    config,
                    learner,
                    engine,
                    processor.image_config,
                    sft_phase=False,
                    distiller=distiller,
                )
                engine.update_params(builders.sampler_params(learner), learner.version)
                last_eval = await evaluate("after_sft", 0)
                writer.write(0, {**sft_metrics, **last_eval, "phase_sft": 1.0})
                db.log_sft(sft_metrics, source=config.sft.source, steps=config.sft.steps)
                db.log_step(0, {**sft_metrics, **last_eval, "phase_sft": 1.0})
                save_checkpoint(ckpt, step, learner, source.state_dict(), force=True)

            # ---- GRPO steps (with Entropulse: an SFT phase every rl.entropulse_every) ----------
            pulse = entropulse.from_config(config)
            warm_pending = True  # the RL programs' warm-up: waited for before the first update
            if not warm.overlap:
                await asyncio.to_thread(warm.wait, compiles)
                warm_pending = False
            rl_signal = _SignalCount()  # did any step of this run update the policy?
            while step < config.total_steps:
                t_step = time.perf_counter()
                step_mark = compiles.snapshot()
                rollouts = await _next_groups(source, step)
                if warm_pending:  # the first step's rollouts ran while the learner compiled
                    await asyncio.to_thread(warm.wait, compiles)
                    warm_pending = False
                trained_on = learner.version  # these groups' staleness is counted from it
                t0 = time.perf_counter()
                info, train_metrics = await asyncio.to_thread(
                    ppo_update,
                    learner,
                    rollouts.groups,
                    epochs=rl.ppo_epochs,
                    minibatches=rl.ppo_minibatches,
                    distiller=distiller,
                )
                if train_metrics is not None:
                    check_finite(
                        train_metrics,
                        step=step + 1,
                        phase="GRPO",
                        last_checkpoint=_last_checkpoint(ckpt),
                    )
                else:  # every group had equal rewards: nothing to learn from this batch
                    train_metrics = {"skipped_no_signal": 1.0}
                rl_signal.add(rollouts.metrics, updated="skipped_no_signal" not in train_metrics)
                compiles.check()  # rl.strict_shapes: a compile outside the warmed set fails
                t_train = time.perf_counter() - t0
                t0 = time.perf_counter()
                engine.update_params(builders.sampler_params(learner), learner.version)
                source.trained(rollouts.groups, learner.version)
                timers = {**rollouts.timings, "train": t_train, "sync": time.perf_counter() - t0}
                step += 1
                timers["step"] = time.perf_counter() - t_step
                row = {
                    **rollouts.metrics,
                    **{f"train/{k}": v for k, v in {**info, **train_metrics}.items()},
                    **{f"time/{k}": v for k, v in timers.items()},
                    "time/learner_idle_share": timers["idle"] / max(timers["step"], 1e-9),
                    **{f"store/{k}": float(v) for k, v in source.store.stats().items()},
                    **compiles.step_metrics(step_mark, timers["step"]),
                    **env_pool_metrics(pool),
                }
                if episodes_dir is not None and rollouts.screens:
                    trajs = [t for g in rollouts.sampled for t in g]
                    write_episodes(
                        os.path.join(episodes_dir, f"train_step{step:05d}.html"),
                        list(zip(trajs, rollouts.screens, strict=False)),
                        decode,
                        f"train step {step}",
                    )
                if pulse is not None:  # SFT on the run's own successes when a phase is due
                    pulsed = await asyncio.to_thread(
                        pulse.after_step, step, learner, rollouts.groups
                    )
                    if pulsed:
                        engine.update_params(builders.sampler_params(learner), learner.version)
                        row.update(pulsed)
                        rl_signal.updates += 1
                row = _job_metrics(row)  # multi-host: one row for the job (process 0 writes it)
                if step % config.log.eval_every == 0 or step == config.total_steps:
                    last_eval = await evaluate(f"step{step}", step)
                    row.update(last_eval)
                writer.write(step, row)
                db.log_step(  # every sampled group (kept or not), as its screens are
                    step, row, rollouts.sampled, screens=rollouts.screens, version=trained_on
                )
                shown = {"reward": row.get("rollout/reward", 0.0)}
                if "eval/success" in last_eval:
                    shown["eval"] = last_eval["eval/success"]
                progress.update(1, **shown)
                save_checkpoint(
                    ckpt, step, learner, source.state_dict(), force=step == config.total_steps
                )
            source.faults.check_run()
            rl_signal.check_run(
                trained="the SFT warm-up"
                if run_sft and config.sft.steps > 0
                else "the run this one resumed"
                if resume_from is not None
                else None
            )
        except BaseException as e:
            db_status = f"failed: {type(e).__name__}: {e}"
            raise
        finally:
            warm.cancel()  # a failed run does not wait for the rest of the warm-up
            if server is not None:
                await server.stop()
            await source.close()
            ckpt.close()  # waits for a save in flight: the last good checkpoint is complete
            writer.close()
            db.close(db_status)

    # ---- finish: curves, summary --------------------------------------------------------------
    if is_main:
        rows = metrics_lib.read_metrics(writer.path)
        keys = ["eval/success", "rollout/reward", "rollout/success", "train/loss"]
        if config.rl.entropulse_every > 0:  # what the phases are for: entropy restored
            keys.append("train/entropy")
        plot_run_curves(
            rows,
            keys,
            os.path.join(workdir, "curves.png"),
            title=f"{config.model.family} {config.preset}",
        )
        wall_s = time.perf_counter() - t_job
        summary = {
            **run_summary(rows),
            "steps": step,
            "wall_s": wall_s,
            **compile_stats.wall_share(rows, wall_s, compiles.busy_seconds(job_mark)),
        }
        (epath.Path(workdir) / "summary.json").write_text(json.dumps(summary, indent=2))
        progress.write(f"summary: {json.dumps(summary)}")
    progress.close()
    return last_eval


# ---------------------------------------------------------------------------------------------
# Phase helpers (explicit arguments; no state shared with `run` beyond them)
# ---------------------------------------------------------------------------------------------


def _resume_source(config: Any, ckpt: Checkpointer) -> Checkpointer | None:
    """The checkpoints to resume from: this workdir's own, else `ckpt.load_checkpoint_path`'s,
    else None (a new run). `load_checkpoint_path` naming one step of this workdir's own
    checkpoints (what a damaged checkpoint's error suggests) resumes from that step: the later
    step directories are renamed `N.set_aside`, nothing deleted."""
    path = config.ckpt.load_checkpoint_path
    own = os.path.abspath(ckpt.directory)
    name = os.path.basename(path.rstrip("/")) if path else ""
    if name.isdigit() and os.path.dirname(os.path.abspath(path.rstrip("/"))) == own:
        step = int(name)
        if step not in ckpt.all_steps():
            raise ConfigError(
                f"config.ckpt.load_checkpoint_path={path!r}: no step {step} in {own}; "
                f"have {ckpt.all_steps()}"
            )
        if jax.process_index() == 0:
            moved = ckpt.set_aside_after(step)
            if moved:
                logging.warning("resuming from step %d; set aside: %s", step, ", ".join(moved))
        multihost.sync("set_aside")
        ckpt.reload()
        return ckpt
    if ckpt.latest_step() is not None:
        return ckpt
    if not path:
        return None
    other = Checkpointer(path, keep=config.ckpt.keep)
    if other.latest_step() is None:
        raise ConfigError(
            f"config.ckpt.load_checkpoint_path={path!r} holds no checkpoint (expected step "
            "directories written by a cua_jax run)"
        )
    return other


def save_checkpoint(
    ckpt: Checkpointer, step: int, learner: Any, source_state: dict, *, force: bool = False
) -> None:
    """The learner's state at `step` with the rollout source's cursor, replay and store
    counters (`ckpt.save_every` decides unless `force`). Every process calls it: orbax saves
    each process's shards; multi-host, the metadata holds every process's source state
    (`processes`, in process order) so that it is the same on all of them."""
    meta = {**source_state, "sft_done": True}
    if jax.process_count() > 1:
        meta = {**meta, "processes": multihost.allgather_json(source_state)}
    ckpt.save(step, learner.state_dict(), meta, force=force)


def _process_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """This process's rollout-source state in a checkpoint's metadata (`save_checkpoint`);
    raises `ConfigError` when the checkpoint was written by a job of another process count (its
    task shares would not be this job's)."""
    saved = meta.get("processes")
    n, i = jax.process_count(), jax.process_index()
    if saved is None and n == 1:
        return meta
    if saved is None or len(saved) != n:
        raise ConfigError(
            f"the checkpoint at step {meta.get('step')} was written by a job of "
            f"{1 if saved is None else len(saved)} processes, this one has {n}: each process "
            "resumes its own share of the tasks, so resume with the same number of processes"
        )
    return saved[i]


async def _next_groups(source: Any, step: int) -> Any:
    """`source.next_groups(step)`; multi-host, a systematic rollout failure on any process
    stops every process (each would otherwise wait for the others in the next collective)."""
    if jax.process_count() == 1:
        return await source.next_groups(step)
    error, rollouts = None, None
    try:
        rollouts = await source.next_groups(step)
    except RolloutError as e:
        error = e
    failures = multihost.allgather_json(None if error is None else str(error))
    if error is not None:
        raise error
    failed = [(i, f) for i, f in enumerate(failures) if f is not None]
    if failed:
        i, message = failed[0]
        raise RolloutError(f"process {i}: {message}")
    return rollouts


def _job_metrics(row: dict[str, Any]) -> dict[str, float]:
    """One metrics row for the whole job from every process's own (`multihost.reduce_metrics`:
    counts add up, times take the slowest process, means are averaged over equal shares)."""
    if jax.process_count() == 1:
        return row
    return multihost.reduce_metrics(multihost.allgather_json(row))


def _last_checkpoint(ckpt: Checkpointer) -> str | None:
    latest = ckpt.latest_step()
    return None if latest is None else os.path.join(ckpt.directory, str(latest))


def env_pool_metrics(pool: Any) -> dict[str, float]:
    """The env pool's own `rollout/env_*` metrics, where it has them (`metrics()`: a browser
    fleet's hosts, a VM pool's live desktops and resets)."""
    get = getattr(pool, "metrics", None)
    return {f"rollout/{k}": float(v) for k, v in get().items()} if callable(get) else {}


class _SignalCount:
    """Counts the GRPO steps of this run that updated the policy. When every step had only
    equal-reward groups (all failed or all succeeded), `check_run` says which: a run that
    trained nothing else either raises `RolloutError` instead of exiting 0; after an SFT phase,
    or in a resumed run, it is a warning (`summary.json`'s `rl_steps_updated` is 0)."""

    def __init__(self) -> None:
        self.steps = 0
        self.updates = 0
        self.success: list[float] = []

    def add(self, rollout_metrics: dict[str, float], *, updated: bool) -> None:
        self.steps += 1
        self.updates += updated
        if "rollout/success" in rollout_metrics:
            self.success.append(rollout_metrics["rollout/success"])

    def check_run(self, *, trained: str | None) -> None:
        """`trained`: what else trained this run's policy ("the SFT warm-up"), or None."""
        if not self.steps or self.updates:
            return
        rate = float(np.mean(self.success)) if self.success else float("nan")
        why = (
            "every episode failed: the policy never succeeds at this temperature (a longer or "
            "stronger SFT warm-up, easier tasks or rl.replay_successes give it a success to "
            "learn from)"
            if rate == 0.0
            else "every episode succeeded: the tasks are too easy to learn from"
            if rate == 1.0
            else "every group's episodes had equal rewards"
        )
        what = (
            f"none of this run's {self.steps} GRPO steps had a group whose rewards differ, so "
            f"RL never updated the policy (rollout success {rate:.3f}: {why})"
        )
        if trained is None:
            raise RolloutError(f"{what}: nothing was trained")
        logging.warning("%s; the policy is what %s trained", what, trained)


async def _sft_warmup(
    config: Any, learner: Any, agent: AgentLoop, pool: Any, tasks: Sequence[Task], workdir: str
) -> dict[str, float]:
    """Behaviour cloning before RL (ComputerRL's SFT-then-RL recipe) with the SFT learner, from
    the tasks' oracle demonstrations (kept under WORKDIR/sft_demos for reuse) or from
    `config.sft.source` (`cua_jax.rl.sft_data`)."""
    sc = config.sft
    t0 = time.perf_counter()
    if sc.source == "oracle":
        batches, info = await sft_data.oracle_sft_batches(
            learner,
            agent,
            pool,
            tasks,
            rows=config.rl.rows_per_step,
            episodes_per_task=sc.episodes_per_task,
            recovery_share=sc.recovery_share,
            seed=config.seed,
            on_demos=lambda demos: _keep_demos(demos, workdir),
            feedback_share=sc.feedback_share,
            feedback_kinds=sdpo.feedback_kinds(config.rl.sdpo_feedback),
        )
    elif shards.is_shard_dir(sc.source):  # grounding screens (tools/make_grounding_data.py)
        source = shards.GroundingDemos(shards.GroundingShards(sc.source), agent)
        ds = sft_lib.sft_dataset(
            source,
            learner.pack,
            batch_size=config.rl.rows_per_step,
            position_fn=learner.position_fn(),
            seed=config.seed,
            num_epochs=None,
        )
        batches, info = sft_lib.batch_iterator(ds), {"sft/demos": float(len(source))}
    else:
        batches, info = sft_data.sft_file_batches(
            sc.source, learner, batch_size=config.rl.rows_per_step, seed=config.seed
        )
    losses = []
    bar = metrics_lib.Progress(
        sc.steps, desc="sft", enabled=config.log.progress and jax.process_index() == 0
    )
    for i, batch in zip(range(sc.steps), batches, strict=False):
        m = await asyncio.to_thread(learner.sft_step, batch)
        check_finite(m, step=i + 1, phase="SFT", last_checkpoint=None)
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


async def _mid_training(
    config: Any, learner: Any, agent: AgentLoop, engine: Any, workdir: str
) -> dict[str, float]:
    """Grounding mid-training, the ladder's rung before SFT: `mid.steps` steps of the SFT
    learner on `mid.batch_size` one-turn click demonstrations a step, synthetic screens streamed
    from the shard directory `mid.source` by grain (`cua_jax.data.shards`: this process's share,
    reshuffled each epoch). Every `mid.eval_every` steps and at the end, greedy clicks on the
    first `mid.eval_samples` screens of `mid.heldout` are scored (inside the target box): the
    held-out grounding curve against samples seen, one JSON line per eval in
    WORKDIR/mid_curve.jsonl, with the data iterator's state (`iterator.set_state` resumes it)."""
    mc = config.mid
    source = shards.GroundingDemos(shards.GroundingShards(mc.source), agent)
    ds = sft_lib.sft_dataset(
        source,
        learner.pack,
        batch_size=mc.batch_size,
        position_fn=learner.position_fn(),
        seed=config.seed,
        num_epochs=None,
    )
    it = sft_lib.batch_iterator(ds)
    heldout = []
    if mc.heldout:
        hs = shards.GroundingShards(mc.heldout)
        heldout = [hs[i] for i in range(min(mc.eval_samples, len(hs)))]
    is_main = jax.process_index() == 0
    curve_path = os.path.join(workdir, "mid_curve.jsonl")
    out: dict[str, float] = {"mid/samples_available": float(len(source))}

    async def grounding(step: int, loss: float) -> None:
        if not heldout:
            return
        engine.update_params(builders.sampler_params(learner), learner.version)
        m = await asyncio.to_thread(shards.grounding_accuracy, engine, agent, heldout)
        row = {"step": step, "samples": step * mc.batch_size, "loss": loss, **m}
        out.update({f"mid/{k.split('/')[-1]}": v for k, v in m.items()})
        if is_main:
            with open(curve_path, "a") as f:
                f.write(json.dumps({**row, "data_state": it.get_state()}, default=str) + "\n")
        logging.info("mid-training step %d: held-out grounding %s", step, m)

    t0, losses = time.perf_counter(), []
    bar = metrics_lib.Progress(mc.steps, desc="mid", enabled=config.log.progress and is_main)
    await grounding(0, float("nan"))
    for i in range(mc.steps):
        m = await asyncio.to_thread(learner.sft_step, next(it))
        check_finite(m, step=i + 1, phase="mid-training", last_checkpoint=None)
        losses.append(float(m.get("loss", np.nan)))
        rate = (i + 1) * mc.batch_size / (time.perf_counter() - t0)
        bar.update(1, loss=losses[-1], samples_s=round(rate, 1))
        if mc.eval_every and (i + 1) % mc.eval_every == 0 and i + 1 < mc.steps:
            await grounding(i + 1, losses[-1])
    await grounding(mc.steps, losses[-1] if losses else float("nan"))
    bar.close()
    return {
        **out,
        "mid/steps": float(len(losses)),
        "mid/samples": float(len(losses) * mc.batch_size),
        "mid/loss_first": losses[0] if losses else float("nan"),
        "mid/loss_last": losses[-1] if losses else float("nan"),
        "time/mid": time.perf_counter() - t0,
    }


def _keep_demos(demos: list[Trajectory], workdir: str) -> None:
    """Saves the successful oracle demonstrations once (a resumed run keeps the first set):
    `--config.sft.source=WORKDIR/sft_demos` reuses them."""
    from cua_jax.rl.store import TrajectoryWriter

    out = os.path.join(workdir, "sft_demos")
    if jax.process_index() != 0 or epath.Path(out).exists():
        return
    if not metrics_lib.is_local(out):  # the trajectory store writes local files only
        logging.warning("oracle demonstrations are not kept under %s (not a local path)", out)
        return
    writer = TrajectoryWriter(out)
    for d in demos:
        writer.write(d)
    writer.close()


def _warn_if_turns_cut(tasks: Sequence[Task], max_turns: int) -> None:
    """An episode lasts min(task.max_steps, env.max_turns) turns: say so where the config cuts
    tasks short (those whose solution needs more turns cannot succeed)."""
    cut = sorted({t.id.rsplit("/", 1)[0] for t in tasks if t.max_steps > max_turns})
    if cut:
        kinds = ", ".join(cut[:10]) + (" ..." if len(cut) > 10 else "")
        logging.warning(
            "%d task kinds allow more steps than config.env.max_turns=%d, up to %d; their "
            "episodes end after %d turns, so a task that needs more cannot succeed: %s",
            len(cut),
            max_turns,
            max(t.max_steps for t in tasks),
            max_turns,
            kinds,
        )


__all__ = [
    "main",
    "run",
    "save_checkpoint",
]
