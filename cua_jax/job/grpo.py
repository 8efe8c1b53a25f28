"""The run's GRPO phase: steps up to `total_steps`, each rollouts -> PPO update -> sampler
weights -> metrics row, with an eval every `eval_every` steps and a checkpoint when due.

    await grpo(r, builders.grpo_settings(config), pulse, trained_before="the SFT warm-up")

`r` is the run's `RunState`; what the phase reads of the config is in `GrpoSettings` (built
by `cua_jax.job.builders.grpo_settings`). `RLSignal` is the run-level check that some step
updated the policy: a run whose every group had equal rewards does not exit 0 as if it trained.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from typing import Any

import numpy as np
from absl import logging

from cua_jax.evaluation.episodes import write_episodes
from cua_jax.job.resume import last_checkpoint, save_checkpoint
from cua_jax.job.state import RunState
from cua_jax.job.steps import env_pool_metrics, job_metrics, next_groups
from cua_jax.rl.learner import check_finite
from cua_jax.rl.ppo import ppo_update
from cua_jax.rl.sources import RolloutError


@dataclasses.dataclass(frozen=True)
class GrpoSettings:
    """The GRPO phase (`config.total_steps`, `config.log.eval_every`, `config.rl.ppo_*`)."""

    total_steps: int
    eval_every: int
    ppo_epochs: int
    ppo_minibatches: int


async def grpo(
    r: RunState, settings: GrpoSettings, pulse: Any, *, trained_before: str | None
) -> None:
    """The GRPO steps up to `settings.total_steps` (with an `Entropulse` `pulse`: an SFT phase
    when one is due), then the run-level checks of the rollouts and of the updates.
    `trained_before`: what trained the policy before this phase ("the SFT warm-up"), or None."""
    warm_pending = True  # the RL programs' warm-up: waited for before the first update
    if not r.warm.overlap:
        await asyncio.to_thread(r.warm.wait, r.compiles)
        warm_pending = False
    rl_signal = RLSignal()  # did any step of this run update the policy?
    while r.step < settings.total_steps:
        await _grpo_step(r, settings, pulse, rl_signal, wait_warm=warm_pending)
        warm_pending = False
    r.source.faults.check_run()
    rl_signal.check_run(trained=trained_before)


async def _grpo_step(
    r: RunState, settings: GrpoSettings, pulse: Any, rl_signal: RLSignal, *, wait_warm: bool
) -> None:
    """One step: rollouts -> PPO update -> sampler weights -> metrics row -> `_log_step`."""
    t_step = time.perf_counter()
    step_mark = r.compiles.snapshot()
    rollouts = await next_groups(r.source, r.step)
    if wait_warm:  # the first step's rollouts ran while the learner compiled
        await asyncio.to_thread(r.warm.wait, r.compiles)
    trained_on = r.learner.version  # these groups' staleness is counted from it
    t0 = time.perf_counter()
    train_metrics = await _update(r, settings, rollouts.groups, rl_signal, rollouts.metrics)
    t_train = time.perf_counter() - t0
    t0 = time.perf_counter()
    r.sync_sampler()
    r.source.trained(rollouts.groups, r.learner.version)
    timers = {**rollouts.timings, "train": t_train, "sync": time.perf_counter() - t0}
    r.step += 1
    timers["step"] = time.perf_counter() - t_step
    row = {
        **rollouts.metrics,
        **{f"train/{k}": v for k, v in train_metrics.items()},
        **{f"time/{k}": v for k, v in timers.items()},
        "time/learner_idle_share": timers["idle"] / max(timers["step"], 1e-9),
        **{f"store/{k}": float(v) for k, v in r.source.store.stats().items()},
        **r.compiles.step_metrics(step_mark, timers["step"]),
        **env_pool_metrics(r.pool),
    }
    await _log_step(r, settings, rollouts, row, pulse, rl_signal, trained_on)


async def _update(
    r: RunState,
    settings: GrpoSettings,
    groups: Any,
    rl_signal: RLSignal,
    rollout_metrics: dict[str, float],
) -> dict[str, float]:
    """The PPO update on this step's groups (SDPO's with a distiller); its metrics, or
    `skipped_no_signal` when every group had equal rewards (nothing to learn from)."""
    info, train_metrics = await asyncio.to_thread(
        ppo_update,
        r.learner,
        groups,
        epochs=settings.ppo_epochs,
        minibatches=settings.ppo_minibatches,
        distiller=r.distiller,
    )
    if train_metrics is not None:
        check_finite(
            train_metrics, step=r.step + 1, phase="GRPO", last_checkpoint=last_checkpoint(r.ckpt)
        )
    else:
        train_metrics = {"skipped_no_signal": 1.0}
    rl_signal.add(rollout_metrics, updated="skipped_no_signal" not in train_metrics)
    r.compiles.check()  # rl.strict_shapes: a compile outside the warmed set fails
    return {**info, **train_metrics}


async def _log_step(
    r: RunState,
    settings: GrpoSettings,
    rollouts: Any,
    row: dict,
    pulse: Any,
    rl_signal: RLSignal,
    trained_on: int,
) -> None:
    """After an update: the step's episodes page, an Entropulse phase when due, the job's
    metrics row (with an eval every `eval_every`), the database, the bar, a checkpoint."""
    step = r.step
    if r.episodes_dir is not None and rollouts.screens:
        trajs = [t for g in rollouts.sampled for t in g]
        write_episodes(
            os.path.join(r.episodes_dir, f"train_step{step:05d}.html"),
            list(zip(trajs, rollouts.screens, strict=False)),
            r.processor.tokenizer.decode,
            f"train step {step}",
        )
    if pulse is not None:  # SFT on the run's own successes when a phase is due
        pulsed = await asyncio.to_thread(pulse.after_step, step, r.learner, rollouts.groups)
        if pulsed:
            r.sync_sampler()
            row.update(pulsed)
            rl_signal.updates += 1
    row = job_metrics(row)  # multi-host: one row for the job (process 0 writes it)
    if step % settings.eval_every == 0 or step == settings.total_steps:
        r.last_eval = await r.evaluate(f"step{step}", step)
        row.update(r.last_eval)
    r.writer.write(step, row)
    r.db.log_step(  # every sampled group (kept or not), as its screens are
        step, row, rollouts.sampled, screens=rollouts.screens, version=trained_on
    )
    shown = {"reward": row.get("rollout/reward", 0.0)}
    if "eval/success" in r.last_eval:
        shown["eval"] = r.last_eval["eval/success"]
    r.progress.update(1, **shown)
    force = step == settings.total_steps
    save_checkpoint(r.ckpt, step, r.learner, r.source.state_dict(), force=force)


class RLSignal:
    """Counts the GRPO steps of this run that updated the policy. When every step had only
    equal-reward groups (all failed or all succeeded), `check_run` says which: a run that
    trained nothing else either raises `RolloutError` instead of exiting 0; after an SFT phase,
    or in a resumed run, it is a warning (`summary.json`'s `rl_steps_updated` is 0)."""

    def __init__(self) -> None:
        self.steps = 0
        self.updates = 0
        self.success: list[float] = []

    def add(self, rollout_metrics: dict[str, float], *, updated: bool) -> None:
        """One GRPO step's rollout metrics, and whether its update changed the policy."""
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


__all__ = ["GrpoSettings", "RLSignal", "grpo"]
