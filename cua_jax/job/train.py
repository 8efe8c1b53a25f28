"""The one trainer: SFT warm-up (optional), then multi-turn GRPO, sync or async.

    main(config, workdir, env_factory=..., load_tasks=...)

`launch/tpu.py` builds `env_factory` (a function returning an async-context-managed env pool
with `acquire()`) and `load_tasks` (task-source dicts -> list[Task]) from `envs/`, so this module
never imports `envs`. `run` reads top to bottom, one function a phase, the run's parts in one
`RunState`:

    _setup (mesh, model, checkpoints, metrics, learner) -> _resume -> _start_sampler (engine,
    agent, warm-up) -> [env pool] _warm_start (eval@0, mid-training, SFT) -> grpo (steps:
    rollouts -> update -> sampler weights, eval / checkpoints / metrics; `cua_jax.job.grpo`)
    -> _close -> _finish

Where the ConfigDict goes: this module, `cua_jax.job.builders` (mesh, model, checkpointer,
learner, engine, rollout settings and source, the phases', warm-up's, shape set's, levers' and
live server's settings, the SDPO distiller, Entropulse, the lever and mid-training rules), the
start-up checks (`cua_jax.config.checks`) and `redact.write_run_config`. Every library object
below them gets typed arguments (`cua_jax.plan`, a job of its own, reads the config too and
builds its shape set with the same builder).

A systematic rollout failure stops the run with `cua_jax.rl.sources.RolloutError`, a NaN or
infinite loss or gradient norm with `cua_jax.rl.learner.NonFiniteError`; `launch/job.py` turns
either into one line on stderr and exit status 1.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import jax
from absl import logging
from etils import epath

from cua_jax import db as db_lib
from cua_jax import metrics as metrics_lib
from cua_jax import multihost, redact
from cua_jax.checkpoint.orbax_io import Checkpointer
from cua_jax.config.checks import validate_config, warn_if_turns_cut
from cua_jax.env_api import Task
from cua_jax.evaluation.live import serve_live_policy
from cua_jax.evaluation.summary import run_summary
from cua_jax.job import builders, compile_stats, warmup
from cua_jax.job.builders import init_model_weights
from cua_jax.job.grpo import grpo
from cua_jax.job.resume import process_meta, resume_source, save_checkpoint
from cua_jax.job.sft import mid_training, sft_warmup
from cua_jax.job.state import RunState
from cua_jax.job.steps import job_metrics
from cua_jax.rl.rollout import AgentLoop
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
    builders.check_levers(config)
    builders.check_mid(config)
    tasks = load_tasks([dict(t) for t in config.tasks])
    eval_tasks = load_tasks([dict(t) for t in config.eval_tasks])
    warn_if_turns_cut(tasks + eval_tasks, config.env.max_turns)
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
    r = _setup(config, workdir, tasks, eval_tasks)
    _resume(r)
    _start_sampler(r)
    async with env_factory() as pool:
        r.pool = pool
        # multi-host: this process's share of the tasks, and of each step's groups
        r.source = builders.build_rollout_source_share(
            config, r.agent, pool, tasks, r.learner.version
        )
        r.source.use_levers(**builders.source_levers(config, workdir))
        if r.meta is not None:
            r.source.load_state_dict(process_meta(r.meta))
        status, server = "finished", None
        try:
            # the live policy server (config.serve.port): the rollouts' own Engine
            server = await serve_live_policy(
                builders.serve_settings(config),
                workdir,
                r.engine,
                r.processor,
                r.learner.model.config.vision_placeholder_ids,
            )
            await _warm_start(r)
            await grpo(
                r,
                builders.grpo_settings(config),
                builders.build_entropulse(config),
                trained_before=_trained_before(r),
            )
        except BaseException as e:
            status = f"failed: {type(e).__name__}: {e}"
            raise
        finally:
            await _close(r, server, status)
    if r.is_main:
        _finish(r)
    r.progress.close()
    return r.last_eval


def _setup(
    config: Any, workdir: str, tasks: Sequence[Task], eval_tasks: Sequence[Task]
) -> RunState:
    """Mesh, model, checkpoints, metrics, the first learner and the trajectory database."""
    is_main = jax.process_index() == 0
    t_job = time.perf_counter()
    compiles = compile_stats.install()  # compile counts and seconds per program
    job_mark = compiles.snapshot()
    mesh, rules = builders.mesh_and_rules(config)
    model, processor = builders.build_model_and_processor(config, mesh, rules)
    if is_main:
        redact.write_run_config(workdir, config)  # tokens and passwords redacted, 0600
    # A run may start from another run's weights (not its optimizer or step); applied on resume
    # too, since parameters this run keeps frozen are not in its own checkpoints.
    init_model_weights(model, config)
    ckpt = builders.build_checkpointer(config, workdir)
    writer = builders.build_metrics_writer(config, workdir, enabled=is_main)
    # The learner takes ownership of the model (LoRA, sharding); the sampler decodes exactly
    # `learner.model`. Without a checkpoint to resume and with an SFT warm-up, the first learner
    # is the SFT one; the RL learner is built after it (fresh optimizer, SFT policy as the KL
    # reference).
    resume_from = _resume_source(config, ckpt)
    run_mid = resume_from is None and config.mid.steps > 0
    run_sft = resume_from is None and (config.sft.steps > 0 or run_mid)
    learner = builders.build_learner(model, config, mesh, rules, sft=run_sft)
    builders.use_advantage_estimator(learner, config)
    del model
    # The trajectory database (tools/monitor.py shows it): never slows or fails the run.
    db = db_lib.open_run(
        workdir,
        config.log.db_url or None,
        run_name=os.path.basename(os.path.abspath(workdir)),
        config=config.to_dict(),
        decode=processor.tokenizer.decode,
        advantage=learner.advantage_config,
        enabled=config.log.db,
        process_index=jax.process_index(),  # multi-host: each process records its own groups
    )
    return RunState(
        config=config,
        workdir=workdir,
        tasks=tasks,
        eval_tasks=eval_tasks,
        eval_settings=builders.eval_settings(config),
        compiles=compiles,
        job_mark=job_mark,
        t_job=t_job,
        mesh=mesh,
        rules=rules,
        processor=processor,
        ckpt=ckpt,
        writer=writer,
        resume_from=resume_from,
        run_mid=run_mid,
        run_sft=run_sft,
        learner=learner,
        db=db,
    )


def _resume_source(config: Any, ckpt: Checkpointer) -> Checkpointer | None:
    """This workdir's own checkpoints, else `config.ckpt.load_checkpoint_path`'s, else None."""
    ck = config.ckpt
    return resume_source(ckpt, ck.load_checkpoint_path, keep=ck.keep)


def _resume(r: RunState) -> None:
    """The learner's state and step from `r.resume_from`; metrics and database rows after it
    are dropped (a resume redoes those steps)."""
    if r.resume_from is not None:
        state, r.meta = r.resume_from.restore(r.learner.abstract_state())
        r.learner.load_state_dict(state)
        r.step = int(r.meta["step"])
        logging.info("resumed from %s at step %d", r.resume_from.directory, r.step)
        if r.resume_from is not r.ckpt:
            r.resume_from.close()
    # a rerun of a run that died before its first checkpoint starts its metrics afresh (-1)
    r.writer.truncate_after(r.step if r.resume_from is not None else -1)
    r.db.truncate_after(r.step if r.resume_from is not None else -1)
    if jax.process_count() > 1:  # process 0's truncate drops every process's rows: it lands
        if r.is_main:  # before any process writes a redone step's groups
            r.db.flush(60)
        multihost.sync("db_truncate")


def _start_sampler(r: RunState) -> None:
    """The sampler on the learner's weights, the agent loop, the progress bar, and the learner's
    shape set compiled ahead in a thread while the environments start."""
    config, learner = r.config, r.learner
    # one shape set for the KV pool's sizing (the learner's largest program) and the warm-up
    learner.shapes = builders.learner_shapes(config, learner, r.processor.image_config)
    num_pages = builders.kv_pages(config, learner, r.processor.image_config)
    r.engine = builders.build_engine(
        learner.model,
        config,
        r.processor.tokenizer,
        mesh=r.mesh,
        rules=r.rules,
        num_pages=num_pages,
    )
    r.sync_sampler()
    settings = builders.build_rollout_settings(config, learner.model)
    r.agent = AgentLoop(r.engine, r.processor, settings)
    r.progress = metrics_lib.Progress(
        config.total_steps, initial=r.step, desc="grpo", enabled=r.is_main and config.log.progress
    )
    r.distiller = builders.build_distiller(config, r.processor.chat)  # None unless SDPO
    r.warm = warmup.begin(
        builders.warmup_settings(config),
        learner,
        r.engine,
        learner.shapes,
        sft_phase=r.run_sft,
        distiller=r.distiller,
    )
    r.progress.write(learner.shapes.describe())


async def _warm_start(r: RunState) -> None:
    """Eval at step 0 (before any training; `log.eval_before_sft=False` skips it when an SFT
    warm-up follows, whose eval is then the first), then grounding mid-training and the SFT
    warm-up with the SFT learner, after which the RL learner replaces it."""
    config = r.config
    if r.resume_from is None and (config.log.eval_before_sft or not r.run_sft):
        r.last_eval = await r.evaluate("step0", 0)
        r.writer.write(0, {**r.last_eval, "phase_sft": 0.0})
        r.db.log_step(0, {**r.last_eval, "phase_sft": 0.0})
    if not r.run_sft:
        return

    def ready() -> Awaitable[dict[str, float]]:
        """The SFT programs' warm-up, waited for (a second wait returns at once): the oracle
        demonstrations are played while the SFT step compiles."""
        return asyncio.to_thread(r.warm.wait, r.compiles)

    sft_metrics = {}
    if r.run_mid:
        await ready()
        sft_metrics = await mid_training(
            r.learner,
            r.agent,
            builders.mid_settings(config),
            workdir=r.workdir,
            sync_sampler=r.sync_sampler,
        )
    if config.sft.steps > 0:
        sft_tasks = multihost.task_share(r.tasks[: config.sft.num_tasks or None])
        sft_metrics |= await sft_warmup(
            r.learner,
            r.agent,
            r.pool,
            sft_tasks,
            builders.sft_settings(config),
            workdir=r.workdir,
            before_first_step=ready,
        )
    await ready()
    sft_metrics = job_metrics(sft_metrics)
    _start_rl_learner(r)
    r.last_eval = await r.evaluate("after_sft", 0)
    row = {**sft_metrics, **r.last_eval, "phase_sft": 1.0}
    r.writer.write(0, row)
    r.db.log_sft(sft_metrics, source=config.sft.source, steps=config.sft.steps)
    r.db.log_step(0, row)
    save_checkpoint(r.ckpt, r.step, r.learner, r.source.state_dict(), force=True)


def _start_rl_learner(r: RunState) -> None:
    """The RL learner replaces the SFT one (a fresh optimizer; the SFT policy is the KL
    reference), its programs' warm-up starts, and the sampler takes its weights."""
    config = r.config
    policy = r.learner.model
    r.learner = None  # its optimizer state goes before the RL learner makes its own
    r.learner = builders.build_learner(policy, config, r.mesh, r.rules, sft=False)
    builders.use_advantage_estimator(r.learner, config)
    if r.step < config.total_steps:  # a run with no GRPO step to take compiles none
        r.warm = warmup.begin(
            builders.warmup_settings(config),
            r.learner,
            r.engine,
            builders.learner_shapes(config, r.learner, r.processor.image_config),
            sft_phase=False,
            distiller=r.distiller,
        )
    r.sync_sampler()


async def _close(r: RunState, server: Any, status: str) -> None:
    """Whether the run finished or failed: the warm-up stops at its next program, the server
    and the rollouts stop, a save in flight completes, the writers close."""
    r.warm.cancel()
    if server is not None:
        await server.stop()
    await r.source.close()
    r.ckpt.close()  # waits for a save in flight: the last good checkpoint is complete
    r.writer.close()
    r.db.close(status)


def _trained_before(r: RunState) -> str | None:
    """What trained the policy before GRPO, for the run's no-signal check (None: nothing)."""
    if r.run_sft and r.config.sft.steps > 0:
        return "the SFT warm-up"
    return "the run this one resumed" if r.resume_from is not None else None


def _finish(r: RunState) -> None:
    """Process 0's curves (WORKDIR/curves.png) and summary (WORKDIR/summary.json)."""
    config = r.config
    rows = metrics_lib.read_metrics(r.writer.path)
    keys = ["eval/success", "rollout/reward", "rollout/success", "train/loss"]
    if config.rl.entropulse_every > 0:  # what the phases are for: entropy restored
        keys.append("train/entropy")
    plot_run_curves(
        rows,
        keys,
        os.path.join(r.workdir, "curves.png"),
        title=f"{config.model.family} {config.preset}",
    )
    wall_s = time.perf_counter() - r.t_job
    summary = {
        **run_summary(rows),
        "steps": r.step,
        "wall_s": wall_s,
        **compile_stats.wall_share(rows, wall_s, r.compiles.busy_seconds(r.job_mark)),
    }
    (epath.Path(r.workdir) / "summary.json").write_text(json.dumps(summary, indent=2))
    r.progress.write(f"summary: {json.dumps(summary)}")


__all__ = ["main", "run", "save_checkpoint"]
