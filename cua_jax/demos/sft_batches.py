"""SFT warm-up data: packed batches of demonstrations for `Learner.sft_step`.

    batches, info = await oracle_sft_batches(learner, agent, pool, tasks, rows=8, ...)
    batches, info = sft_file_batches(path, learner, batch_size=8, seed=0)
    metrics = learner.sft_step(next(batches))

Two sources (ComputerRL's SFT-then-RL recipe): the tasks' oracle demonstrations, played in the
model's own action format (`AgentLoop.demonstrations`; a share of them start with a scripted
miss and recover from it), or files: a trajectory directory (`TrajectoryWriter` /
`TrajectoryStore(persist_dir=)`) or a JSONL file of token-level episodes (`cua_jax.demos.pipeline`).
Only successful episodes are trained on. Both iterators are endless (reshuffled every epoch).

Feedback demonstrations (`feedback_share`, for SDPO): a share of the oracle demos is also
trained with an SDPO feedback message before the task, the same message, rendered the same way,
that SDPO's teacher reads in RL (`sdpo.teacher_sample`). The feedback is real: a scripted failed
attempt at the same task and seed (`AgentLoop.failed_attempts`: a click at a random point) gives
the screen after it and the checker's report, and half of them also name the demo's own tool
calls as a successful peer's. Without them the self-teacher has never seen a feedback prompt, and
distilling its off-format distribution collapsed the policy (BENCHMARKS.md, SDPO).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from cua_jax.config.checks import ConfigError, check_sft_source
from cua_jax.demos.pipeline import JsonlDemonstrations, batch_iterator, sft_dataset
from cua_jax.env_api import Task
from cua_jax.rl import sdpo
from cua_jax.rl.policies import recovery_detours
from cua_jax.rl.store import TrajectoryReader
from cua_jax.rl.trajectory import PositionFn, Sample, Trajectory, trajectory_to_samples

# Each oracle task is replayed with seeds `seed + SEED_STRIDE * r`: the built-in templates
# randomize their layout by seed.
SEED_STRIDE = 7919
# The share of feedback demonstrations whose feedback also names a successful peer's tool calls
# (the demo's own): in RL a failed episode has such a peer only when its group had a success.
PEER_SHARE = 0.5


def demo_tasks(tasks: Sequence[Task], episodes_per_task: int) -> list[Task]:
    """Every task `episodes_per_task` times, each time with another seed."""
    return [
        dataclasses.replace(t, seed=t.seed + SEED_STRIDE * r)
        for t in tasks
        for r in range(episodes_per_task)
    ]


def feedback_demo_samples(
    pairs: Sequence[tuple[Trajectory, Trajectory]],
    chat: Any,
    position_fn: PositionFn,
    *,
    kinds: Sequence[str] = sdpo.FEEDBACK_KINDS,
    peer_share: float = PEER_SHARE,
    seed: int = 0,
) -> list[Sample]:
    """SFT samples that teach the policy to act on SDPO feedback: for each (failed attempt,
    successful demo) of one task and seed, the demo's samples with the attempt's feedback
    message inserted after the system message (`sdpo.teacher_sample`: what SDPO's teacher reads
    in RL, token for token), the loss on the demo's own generated tokens. A share `peer_share`
    of the pairs also give the demo as the successful peer (`peer_success`). A pair whose
    attempt has no feedback of `kinds` (a success, an infrastructure fault) gives nothing."""
    rng = np.random.default_rng(seed)
    decode = sdpo.action_decoder(chat)
    out = []
    for attempt, demo in pairs:
        if not demo.success:
            raise ValueError(f"feedback demo of {demo.task_id} is not a success")
        group = [attempt, demo] if rng.random() < peer_share else [attempt]
        fb = sdpo.episode_feedback(attempt, group, decode, kinds)
        if fb is None:
            continue
        for s in trajectory_to_samples(demo, 1.0, position_fn):
            t = sdpo.teacher_sample(s, fb, chat, position_fn).sample
            out.append(dataclasses.replace(t, advantage=1.0, episode=s.episode))
    return out


async def oracle_sft_batches(
    learner: Any,
    agent: Any,
    pool: Any,
    tasks: Sequence[Task],
    *,
    rows: int,
    episodes_per_task: int,
    recovery_share: float,
    seed: int,
    on_demos: Callable[[list[Trajectory]], None] | None = None,
    feedback_share: float = 0.0,
    feedback_kinds: Sequence[str] = sdpo.FEEDBACK_KINDS,
) -> tuple[Iterator[Any], dict[str, float]]:
    """(endless iterator of packed batches of `rows` samples, info) from the oracle
    demonstrations of `tasks`; `on_demos` gets the successful ones (the trainer saves them).
    `feedback_share` of the successful demos are also trained as feedback demonstrations
    (module docstring) with the SDPO feedback of `feedback_kinds`."""
    if not 0.0 <= feedback_share <= 1.0:
        raise ValueError(f"feedback share={feedback_share} must be in [0, 1]")
    todo = demo_tasks(tasks, episodes_per_task)
    # `recovery_share` of them start with a random click (a miss, mostly): recovery demos.
    detours = recovery_detours(len(todo), share=recovery_share, seed=seed + 1)
    demos = await agent.demonstrations(pool, todo, detours)
    good_idx = [i for i, d in enumerate(demos) if d.success]
    good = [demos[i] for i in good_idx]
    if not good:
        raise RuntimeError("no oracle demonstration succeeded; check the env and task oracles")
    if on_demos is not None:
        on_demos(good)
    pos_fn = learner.position_fn()
    samples = [s for d in good for s in trajectory_to_samples(d, 1.0, pos_fn)]
    rng = np.random.default_rng(seed)
    fb_info: dict[str, float] = {}
    if feedback_share > 0:
        k = round(feedback_share * len(good))
        picked = sorted(rng.choice(len(good), size=k, replace=False).tolist())
        # the attempt plays the demo's own task and seed: the same page, a random click
        misses = recovery_detours(k, share=1.0, seed=seed + 2)
        attempts = await agent.failed_attempts(pool, [todo[good_idx[j]] for j in picked], misses)
        pairs = [(a, good[j]) for a, j in zip(attempts, picked, strict=True)]
        fb_samples = feedback_demo_samples(
            pairs, agent.chat, pos_fn, kinds=feedback_kinds, seed=seed + 3
        )
        samples += fb_samples
        fb_info = {
            "sft/feedback_attempts": float(k),
            "sft/feedback_attempts_failed": float(
                sum(not a.success and not a.infra_fault for a in attempts)
            ),
            "sft/feedback_samples": float(len(fb_samples)),
        }

    def batches() -> Iterator[Any]:
        while True:
            idx = rng.choice(len(samples), size=min(len(samples), rows), replace=False)
            yield learner.pack([samples[i] for i in idx])

    info = {
        "sft/demos": float(len(good)),
        "sft/demo_success": float(len(good) / len(demos)),
        "sft/recovery_demos": float(sum(not d.turns[0].trained for d in good if d.turns)),
        **fb_info,
    }
    return batches(), info


def sft_file_batches(
    path: str, learner: Any, *, batch_size: int, seed: int = 0
) -> tuple[Iterator[Any], dict[str, float]]:
    """(endless iterator of packed SFT batches, info) from a trajectory directory or a JSONL
    file of demonstrations; only successful episodes are used, reshuffled every epoch."""
    if check_sft_source(path) == "dir":
        source = TrajectoryReader(path)
        n_good = sum(bool(source.metadata(i)["success"]) for i in range(len(source)))
    else:
        source = JsonlDemonstrations(path)
        n_good = sum(source[i].success for i in range(len(source)))
    if n_good == 0:
        raise ConfigError(f"config.sft.source={path!r} holds no successful episode")
    ds = sft_dataset(
        source,
        learner.pack,
        batch_size=min(batch_size, n_good),
        position_fn=learner.position_fn(),
        seed=seed,
        num_epochs=None,
    )
    # a bounded read-ahead: iter(ds) reads 500 packed batches ahead on 16 threads (GBs of f32
    # screens)
    return batch_iterator(ds), {"sft/demos": float(n_good)}


__all__ = ["demo_tasks", "feedback_demo_samples", "oracle_sft_batches", "sft_file_batches"]
