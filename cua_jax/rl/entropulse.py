"""Entropulse (ComputerRL, arXiv 2508.14040): RL phases alternate with SFT on the run's own
successes, which restores the entropy RL collapses so the next RL phase can improve further.

    pulse = Entropulse(every=20, sft_steps=10, rows=8)
    ...after each RL step:
    row.update(pulse.after_step(step, learner, groups))   # {} between phases

Every `every` RL steps the learner takes `sft_steps` cross-entropy steps (`Learner.sft_step`,
the RL optimizer's state kept unless `reset_optimizer`) on the successful rollouts collected
since the last phase: successes of this run only (never demonstrations, never an episode ended
by an infrastructure fault), deduplicated per task (episodes of a task with the same generated
tokens count once), most recent policy first, tasks interleaved so one easy task cannot fill the
batches. The policy's mean token entropy on the last RL step's rollouts is measured before and
after the phase (`entropulse/entropy_before` / `_after`) and the phase row is marked
(`entropulse/phase` = 1).

Multi-host: each process keeps the successes of its own rollouts and packs its share of every
SFT batch (`rows` samples a process); the phases line up because they follow the same steps.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cua_jax import multihost
from cua_jax import sharding as shd
from cua_jax.rl import step
from cua_jax.rl.micro import check_finite
from cua_jax.rl.trajectory import Trajectory, live_episodes, trajectory_to_samples


def _key(traj: Trajectory) -> bytes:
    """Episodes of a task with the same generated tokens are one demonstration."""
    return b"|".join(np.asarray(t.generated_ids, np.int32).tobytes() for t in traj.turns)


def policy_entropy(learner: Any, batch: Any, cache: dict | None = None) -> float:
    """The policy's mean next-token entropy over a packed batch's loss-masked tokens, at the
    learner's temperature (the quantity `train/entropy` reports for a train step), no gradient;
    one compile per batch shape (kept in `cache`)."""
    cache = {} if cache is None else cache
    fn = cache.get("entropy")
    if fn is None:

        def f(trainable, frozen, rest, xs, images):
            with shd.training_layout(learner.mesh, learner.rules):  # as the learner's programs
                spec = learner.spec
                ids = xs["input_ids"]
                (emb, ds), vmask = step.embed(spec, trainable, frozen, rest, ids, images)
                temp = spec.loss.temperature
                stats = step.token_stats(
                    spec, trainable, frozen, rest, emb, ds, vmask, xs, temp, True
                )
                mask = xs["loss_mask"][:, 1:].astype(jnp.float32)
                return jnp.sum(stats[1] * mask), jnp.sum(mask)

        fn = cache["entropy"] = jax.jit(f)
    total = count = 0.0
    for part, _ in learner.chunks(batch):  # a token-budget batch: one call a chunk
        xs, images = learner.layout.device_batch(part, substeps=1)
        s, n = fn(learner.trainable, learner.frozen, learner.rest, xs, images)
        total, count = total + float(s), count + float(n)
    return total / max(count, 1.0)


@dataclasses.dataclass
class Entropulse:
    """Alternating RL / SFT phases (see the module docstring).

    every: RL steps per phase; sft_steps: SFT steps per phase; rows: samples per SFT batch;
    reset_optimizer: the next RL phase starts from a fresh optimizer state (else the state the
    SFT steps left); entropy_fn: (learner, packed batch) -> mean entropy (tests pass a stub).
    """

    every: int
    sft_steps: int
    rows: int = 8
    reset_optimizer: bool = False
    entropy_fn: Callable[[Any, Any], float] | None = None
    _pool: dict[str, dict[bytes, Trajectory]] = dataclasses.field(default_factory=dict)
    _cache: dict = dataclasses.field(default_factory=dict)
    phases: int = 0

    def __post_init__(self) -> None:
        if self.every < 1 or self.sft_steps < 1:
            raise ValueError(
                f"entropulse every={self.every}, sft_steps={self.sft_steps}: both must be >= 1"
            )
        if self.rows < 1:
            raise ValueError(f"entropulse rows={self.rows} must be >= 1")

    def collect(self, groups: Sequence[Sequence[Trajectory]]) -> None:
        """Keeps the successful episodes of an RL step's groups (a newer policy's episode with
        the same tokens replaces an older one)."""
        for group in groups:
            for traj in live_episodes(list(group)):
                if not traj.success or not traj.turns:
                    continue
                per_task = self._pool.setdefault(traj.task_id, {})
                old = per_task.get(_key(traj))
                if old is None or traj.policy_version >= old.policy_version:
                    per_task[_key(traj)] = traj

    def successes(self) -> list[Trajectory]:
        """The kept successes: per task most recent policy first, tasks interleaved."""
        per_task = [
            sorted(v.values(), key=lambda t: -t.policy_version)
            for _, v in sorted(self._pool.items())
        ]
        mixed = itertools.chain.from_iterable(itertools.zip_longest(*per_task))
        return [t for t in mixed if t is not None]

    def due(self, step: int) -> bool:
        """An SFT phase follows RL step `step` (1-based: after steps every, 2 every, ...)."""
        return step > 0 and step % self.every == 0

    def sft_phase(
        self, learner: Any, probe_groups: Sequence[Sequence[Trajectory]]
    ) -> dict[str, float]:
        """The SFT phase on the kept successes; empties them. `probe_groups` (the last RL
        step's) are the episodes the entropy before/after is measured on."""

        entropy_fn = self.entropy_fn or (lambda lr, b: policy_entropy(lr, b, self._cache))
        pos_fn = learner.position_fn()
        trajs = self.successes()
        self._pool = {}
        self.phases += 1
        out = {
            "entropulse/phase": 1.0,
            "entropulse/phases": float(self.phases),
            "entropulse/episodes": float(len(trajs)),
            "entropulse/tasks": float(len({t.task_id for t in trajs})),
        }
        # multi-host: each process trains on its own successes (its share of the job's
        # batches), all of them together, unless no process has any
        if not multihost.allgather_ints([len(trajs)]).sum():
            out["entropulse/skipped_no_success"] = 1.0
            return out
        probe = [
            s for g in probe_groups for t in live_episodes(list(g)) for s in _samples(t, pos_fn)
        ]
        probe_batch = learner.pack(probe) if multihost.allgather_ints([len(probe)]).sum() else None
        if probe_batch is not None:
            out["entropulse/entropy_before"] = float(entropy_fn(learner, probe_batch))
        samples = [s for t in trajs for s in _samples(t, pos_fn)]
        order = itertools.cycle(range(len(samples)))
        losses = []
        for i in range(self.sft_steps):
            idx = [next(order) for _ in range(min(self.rows, len(samples)))]
            m = learner.sft_step(learner.pack([samples[j] for j in idx]))
            check_finite(m, step=i + 1, phase="Entropulse SFT", last_checkpoint=None)
            losses.append(float(m.get("loss", np.nan)))
        if self.reset_optimizer:
            reset_optimizer(learner)
        if probe_batch is not None:
            out["entropulse/entropy_after"] = float(entropy_fn(learner, probe_batch))
        out.update(
            {
                "entropulse/sft_steps": float(len(losses)),
                "entropulse/sft_loss_first": losses[0],
                "entropulse/sft_loss_last": losses[-1],
                "entropulse/samples": float(len(samples)),
            }
        )
        return out

    def after_step(
        self, step: int, learner: Any, groups: Sequence[Sequence[Trajectory]]
    ) -> dict[str, float]:
        """Collects the step's successes; runs an SFT phase when one is due. Returns the phase's
        metrics, or {} after an RL step without one."""
        self.collect(groups)
        if not self.due(step):
            return {}
        return self.sft_phase(learner, groups)


def _samples(traj: Trajectory, pos_fn: Any) -> list[Any]:
    return trajectory_to_samples(traj, 1.0, pos_fn)


def reset_optimizer(learner: Any) -> None:
    """A fresh optimizer state for the learner's current parameters (the next RL phase starts
    its moments and its schedule from zero)."""
    learner.reset_optimizer()
