"""The RL levers of `config.rl` (advantage estimator, PPO epochs and mini-batches, dynamic
sampling, success replay, persisted rollouts): the rules they must satisfy together, and the
settings they hand to the learner and the rollout source. These functions read `config.rl`
(and the workdir), which makes this module one of the places the run's config reaches below
`cua_jax.job.train` (see its docstring).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax

from cua_jax import metrics as metrics_lib
from cua_jax.config.checks import ConfigError
from cua_jax.rl.advantages import ESTIMATORS, estimator_options


def check_levers(config: Any) -> None:
    """Raises `ConfigError` for RL lever settings that cannot work together."""
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
