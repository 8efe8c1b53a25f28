"""The SFT learner's phases before RL: grounding mid-training, then the SFT warm-up.

    metrics = await mid_training(learner, agent, settings, workdir=..., sync_sampler=...)
    metrics |= await sft_warmup(learner, agent, pool, tasks, settings, workdir=...)

Both take typed settings (`builders.mid_settings` / `builders.sft_settings` read the config)
and return one metrics row (`mid/*`, `sft/*`, `time/*`). A NaN or infinite loss stops either with
`NonFiniteError` naming the phase and the step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging
from etils import epath

from cua_jax import metrics as metrics_lib
from cua_jax.demos import pipeline as sft_lib
from cua_jax.demos import sft_batches, shards
from cua_jax.env_api import Task
from cua_jax.rl.learner import check_finite
from cua_jax.rl.store import TrajectoryWriter
from cua_jax.rl.trajectory import Trajectory


@dataclasses.dataclass(frozen=True)
class MidSettings:
    """Grounding mid-training (`config.mid`): `steps` steps of `batch_size` one-turn click
    demonstrations from the shard directory `source`; every `eval_every` steps greedy clicks on
    the first `eval_samples` screens of `heldout` ("" for none) are scored."""

    steps: int
    batch_size: int
    source: str
    heldout: str
    eval_every: int
    eval_samples: int
    seed: int
    progress: bool


@dataclasses.dataclass(frozen=True)
class SftSettings:
    """The SFT warm-up (`config.sft`): `steps` steps of `rows` demonstrations from `source`
    ("oracle", a grounding shard directory, a trajectory directory or a JSONL file)."""

    steps: int
    source: str
    rows: int
    episodes_per_task: int
    recovery_share: float
    feedback_share: float
    feedback_kinds: tuple[str, ...]
    seed: int
    progress: bool


async def sft_warmup(
    learner: Any,
    agent: Any,
    pool: Any,
    tasks: Sequence[Task],
    settings: SftSettings,
    *,
    workdir: str,
    before_first_step: Callable[[], Awaitable[Any]] | None = None,
) -> dict[str, float]:
    """Behaviour cloning before RL (ComputerRL's SFT-then-RL recipe) with the SFT learner, from
    the tasks' oracle demonstrations (kept under WORKDIR/sft_demos for reuse) or from
    `settings.source` (`cua_jax.demos.sft_batches`). `before_first_step` is awaited once the
    demonstrations are in hand, before the first step (the run waits there for the SFT step's
    compile, which runs while the demonstrations are played)."""
    s = settings
    t0 = time.perf_counter()
    if s.source == "oracle":
        batches, info = await sft_batches.oracle_sft_batches(
            learner,
            agent,
            pool,
            tasks,
            rows=s.rows,
            episodes_per_task=s.episodes_per_task,
            recovery_share=s.recovery_share,
            seed=s.seed,
            on_demos=lambda demos: keep_demos(demos, workdir),
            feedback_share=s.feedback_share,
            feedback_kinds=s.feedback_kinds,
        )
    elif shards.is_shard_dir(s.source):  # grounding screens (tools/make_grounding_data.py)
        batches, n = grounding_batches(s.source, learner, agent, batch_size=s.rows, seed=s.seed)
        info = {"sft/demos": float(n)}
    else:
        batches, info = sft_batches.sft_file_batches(
            s.source, learner, batch_size=s.rows, seed=s.seed
        )
    if before_first_step is not None:
        await before_first_step()
    losses = []
    bar = metrics_lib.Progress(s.steps, desc="sft", enabled=s.progress and jax.process_index() == 0)
    for i, batch in zip(range(s.steps), batches, strict=False):
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


async def mid_training(
    learner: Any,
    agent: Any,
    settings: MidSettings,
    *,
    workdir: str,
    sync_sampler: Callable[[], None],
) -> dict[str, float]:
    """Grounding mid-training, the ladder's rung before SFT (`MidSettings`), synthetic screens
    streamed from the shard directory by grain (`cua_jax.demos.shards`: this process's share,
    reshuffled each epoch). At each eval `sync_sampler()` hands the sampler the learner's
    weights, then the held-out clicks are scored (inside the target box): the held-out grounding
    curve against samples seen, one JSON line per eval in WORKDIR/mid_curve.jsonl, with the data
    iterator's state (`iterator.set_state` resumes it)."""
    s = settings
    it, available = grounding_batches(
        s.source, learner, agent, batch_size=s.batch_size, seed=s.seed
    )
    heldout = []
    if s.heldout:
        hs = shards.GroundingShards(s.heldout)
        heldout = [hs[i] for i in range(min(s.eval_samples, len(hs)))]
    is_main = jax.process_index() == 0
    curve_path = os.path.join(workdir, "mid_curve.jsonl")
    out: dict[str, float] = {"mid/samples_available": float(available)}

    async def grounding(step: int, loss: float) -> None:
        if not heldout:
            return
        sync_sampler()
        m = await asyncio.to_thread(shards.grounding_accuracy, agent.engine, agent, heldout)
        row = {"step": step, "samples": step * s.batch_size, "loss": loss, **m}
        out.update({f"mid/{k.split('/')[-1]}": v for k, v in m.items()})
        if is_main:
            with open(curve_path, "a") as f:
                f.write(json.dumps({**row, "data_state": it.get_state()}, default=str) + "\n")
        logging.info("mid-training step %d: held-out grounding %s", step, m)

    t0, losses = time.perf_counter(), []
    bar = metrics_lib.Progress(s.steps, desc="mid", enabled=s.progress and is_main)
    await grounding(0, float("nan"))
    for i in range(s.steps):
        m = await asyncio.to_thread(learner.sft_step, next(it))
        check_finite(m, step=i + 1, phase="mid-training", last_checkpoint=None)
        losses.append(float(m.get("loss", np.nan)))
        rate = (i + 1) * s.batch_size / (time.perf_counter() - t0)
        bar.update(1, loss=losses[-1], samples_s=round(rate, 1))
        if s.eval_every and (i + 1) % s.eval_every == 0 and i + 1 < s.steps:
            await grounding(i + 1, losses[-1])
    await grounding(s.steps, losses[-1] if losses else float("nan"))
    bar.close()
    return {
        **out,
        "mid/steps": float(len(losses)),
        "mid/samples": float(len(losses) * s.batch_size),
        "mid/loss_first": losses[0] if losses else float("nan"),
        "mid/loss_last": losses[-1] if losses else float("nan"),
        "time/mid": time.perf_counter() - t0,
    }


def grounding_batches(
    path: str, learner: Any, agent: Any, *, batch_size: int, seed: int
) -> tuple[Any, int]:
    """(endless iterator of packed batches, samples available) of the grounding shard directory
    `path`'s one-turn click demonstrations, this process's share, reshuffled each epoch."""
    source = shards.GroundingDemos(shards.GroundingShards(path), agent)
    ds = sft_lib.sft_dataset(
        source,
        learner.pack,
        batch_size=batch_size,
        position_fn=learner.position_fn(),
        seed=seed,
        num_epochs=None,
    )
    return sft_lib.batch_iterator(ds), len(source)


def keep_demos(demos: list[Trajectory], workdir: str) -> None:
    """Saves the successful oracle demonstrations once (a resumed run keeps the first set):
    `--config.sft.source=WORKDIR/sft_demos` reuses them."""
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
