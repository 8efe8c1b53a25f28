"""The PPO update on one batch of GRPO groups: `epochs` passes over mini-batches of whole
groups, one optimizer update each, the learner's version moved by one (`cua_jax.job.train` calls it
once a GRPO step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from cua_jax.rl.trajectory import Trajectory


def ppo_update(
    learner: Any,
    groups: Sequence[Sequence[Trajectory]],
    *,
    epochs: int = 1,
    minibatches: int = 1,
    distiller: Any = None,
) -> tuple[dict[str, float], dict[str, float] | None]:
    """The learner step on one batch of groups: `epochs` passes over `minibatches` mini-batches
    of whole groups (groups i, i + M, i + 2M, ... form mini-batch i), one optimizer update per
    mini-batch and pass (PPO). Advantages are per group, so a mini-batch's are the batch's;
    each mini-batch's loss weights are normalised over its own tokens. The PPO ratio is against
    the sampler's log-probs (`rl.old_logprobs="behaviour"`): 1 at the first update (up to
    sampler/learner numerics), off 1 afterwards, where the clip then bounds the update.

    However many updates, the learner's version moves by one per call (a version is a learner
    step: the staleness bounds count steps). Returns (prepare_batch's info, the updates'
    metrics: means over updates, `*_max` the max, `ratio_mean_first`/`_last`, the last update's
    clip fractions, `updates`), or metrics None when no group carried a signal. With SDPO's
    `distiller` (`cua_jax.rl.sdpo.SelfDistiller`) each update adds its self-distillation term."""
    if not groups:  # dynamic sampling kept nothing
        return {"groups": 0.0, "samples": 0.0}, None
    batch, info = learner.prepare_batch(groups)
    if batch is None:
        return info, None
    m = min(minibatches, len(groups))
    if m > 1:
        chunks = [learner.prepare_batch(groups[i::m])[0] for i in range(m)]
        batches = [b for b in chunks if b is not None]
    else:
        batches = [batch]
    version = learner.version
    per_update = []
    for _ in range(epochs):
        for b in batches:
            if distiller is None:
                per_update.append(learner.train_step(b))
            else:  # the teacher pass on b's failed episodes, then the blended step
                per_update.append(distiller.train_step(learner, b, groups))
    learner.version = version + 1
    out: dict[str, float] = {}
    for k in per_update[0]:
        vals = [u[k] for u in per_update if k in u]
        out[k] = float(max(vals)) if k.endswith("_max") else float(np.mean(vals))
    out["version"] = float(learner.version)
    out["updates"] = float(len(per_update))
    if "ratio_mean" in per_update[0]:
        out["ratio_mean_first"] = per_update[0]["ratio_mean"]
        out["ratio_mean_last"] = per_update[-1]["ratio_mean"]
        out["clip_frac_high_last"] = per_update[-1]["clip_frac_high"]
        out["clip_frac_low_last"] = per_update[-1]["clip_frac_low"]
    return info, out
