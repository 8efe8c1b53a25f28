"""The run's parts, made by `train`'s set-up phases and handed from phase to phase.

    r = RunState(config=..., learner=..., ...)   # train._setup, then _start_sampler fills more
    r.sync_sampler()                             # the sampler decodes the learner's weights
    out = await r.evaluate("step8", 8)           # greedy success on the eval tasks

`learner` (and `warm`) are replaced after the SFT warm-up; `step` and `last_eval` advance.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import jax

from cua_jax import metrics as metrics_lib
from cua_jax import multihost
from cua_jax.checkpoint.orbax_io import Checkpointer
from cua_jax.env_api import Task
from cua_jax.evaluation.episodes import evaluate_policy
from cua_jax.job import compile_stats, warmup
from cua_jax.rl.rollout import AgentLoop


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """The in-run greedy eval: its seed, and how many of its episodes get a viewer page."""

    seed: int
    num_logged: int


@dataclasses.dataclass
class RunState:
    """Everything a phase of the run reads or replaces (module docstring)."""

    config: Any
    workdir: str
    tasks: Sequence[Task]
    eval_tasks: Sequence[Task]
    eval_settings: EvalSettings
    compiles: compile_stats.CompileStats
    job_mark: Any
    t_job: float
    mesh: Any
    rules: Any
    processor: Any
    ckpt: Checkpointer
    writer: metrics_lib.MetricsWriter
    resume_from: Checkpointer | None
    run_mid: bool  # the grounding mid-training (config.mid) and the SFT warm-up share
    run_sft: bool  # the SFT learner
    learner: Any
    db: Any
    step: int = 0
    meta: dict | None = None
    engine: Any = None
    agent: AgentLoop | None = None
    progress: metrics_lib.Progress | None = None
    distiller: Any = None
    warm: warmup.Warmup | None = None
    pool: Any = None
    source: Any = None
    last_eval: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def is_main(self) -> bool:
        """Process 0, which writes the job's files."""
        return jax.process_index() == 0

    @property
    def episodes_dir(self) -> str | None:
        """Where process 0 writes episode pages (None on the other processes)."""
        return os.path.join(self.workdir, "episodes") if self.is_main else None

    def sync_sampler(self) -> None:
        """The sampler decodes the learner's current weights from here on: the live parameters
        (one process), or this process's full copy of them (multi-host, `builders.build_engine`)."""
        params = multihost.local_copy(self.learner.params_for_sampler())
        self.engine.update_params(params, self.learner.version)

    async def evaluate(self, tag: str, at_step: int) -> dict[str, float]:
        """Greedy success on the eval tasks (`evaluate_policy`), logged on the progress bar."""
        out = await evaluate_policy(
            self.agent,
            self.pool,
            self.eval_tasks,
            tag,
            seed=self.eval_settings.seed,
            episodes_dir=self.episodes_dir,
            num_logged=self.eval_settings.num_logged,
            decode=self.processor.tokenizer.decode,
            db=self.db,
            step=at_step,
        )
        self.progress.write(f"eval {tag}: success {out['eval/success']:.3f}")
        return out


__all__ = ["EvalSettings", "RunState"]
