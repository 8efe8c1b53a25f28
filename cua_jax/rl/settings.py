"""The learner's typed settings: the optimizer, the policy loss, the advantages and LoRA.

`cua_jax.job.builders.build_learner` makes them from a run's config; `cua_jax.rl.learner.Learner`
takes them (and re-exports them: `from cua_jax.rl.learner import LossConfig` works too).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import optax

from cua_jax.models import lora as lora_lib
from cua_jax.rl import losses


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup, then constant or cosine decay, and global-norm clipping."""

    learning_rate: float = 1e-6
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = 0
    decay_steps: int = 0  # cosine: steps after warmup to reach end_lr_ratio * learning_rate
    end_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    # An update whose norm is more than this times the parameters' norm, or not finite, is not
    # applied (the step reports `update_rejected` and the run stops: `check_finite`); 0: off
    max_update_ratio: float = 1.0

    def schedule_fn(self) -> optax.Schedule:
        lr = self.learning_rate
        if self.schedule == "constant":
            after = optax.constant_schedule(lr)
        elif self.schedule == "cosine":
            if self.decay_steps <= 0:
                raise ValueError("schedule='cosine' needs decay_steps > 0 (steps after warmup)")
            after = optax.cosine_decay_schedule(lr, self.decay_steps, alpha=self.end_lr_ratio)
        else:
            raise ValueError(f"unknown schedule {self.schedule!r}; use 'constant' or 'cosine'")
        if self.warmup_steps <= 0:
            return after
        warm = optax.linear_schedule(0.0, lr, self.warmup_steps)
        return optax.join_schedules([warm, after], [self.warmup_steps])

    def build(self) -> optax.GradientTransformation:
        parts = []
        if self.max_grad_norm is not None:
            parts.append(optax.clip_by_global_norm(self.max_grad_norm))
        parts.append(
            optax.adamw(
                self.schedule_fn(),
                b1=self.b1,
                b2=self.b2,
                eps=self.eps,
                weight_decay=self.weight_decay,
            )
        )
        return optax.chain(*parts)


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Policy-loss options (see `cua_jax.rl.losses` for the symbols).

    old_logprobs: "behaviour" anchors the PPO ratio at the sampler's log-probs μ (r = π_θ/μ,
      clipping bounds staleness); "learner" anchors it at the learner's own log-probs at the
      start of the step (r = 1 there) and, with ``tis_cap``, corrects the sampler/learner
      mismatch with truncated importance weights min(π_old/μ, C).
    temperature: the sampling temperature of the rollouts. Logits are divided by it before
      every log-prob / entropy (as verl does), so the learner scores the same tempered policy
      the sampler drew from and reported log-probs for: the PPO ratio starts at 1. The KL
      reference is tempered alike. SFT steps never temper.
    """

    eps_low: float = 0.2
    eps_high: float = 0.2
    old_logprobs: Literal["behaviour", "learner"] = "behaviour"
    tis_cap: float | None = None
    kl_coef: float = 0.0
    kl_estimator: losses.KLEstimator = "k3"
    entropy_coef: float = 0.0
    agg_mode: losses.AggMode = "token-mean"
    loss_norm: float | None = None  # Dr. GRPO's constant C; "seq-mean-token-sum-norm" needs it
    temperature: float = 1.0
    router_aux_coef: float = 0.0  # MoE: coef x load-balancing loss over the trained tokens
    routing_replay: bool = False  # MoE: forwards use the sampler's recorded experts

    def __post_init__(self):
        if not self.router_aux_coef >= 0:
            raise ValueError(f"router_aux_coef={self.router_aux_coef} must be >= 0")
        if self.old_logprobs not in ("behaviour", "learner"):
            raise ValueError(f"old_logprobs={self.old_logprobs!r}: use 'behaviour' or 'learner'")
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (rollouts sample at it)")
        if self.tis_cap is not None and self.old_logprobs != "learner":
            raise ValueError("tis_cap needs old_logprobs='learner' (π_old/μ is 1 otherwise)")
        if self.agg_mode == "seq-mean-token-sum-norm" and not (self.loss_norm or 0) > 0:
            raise ValueError(
                "agg_mode='seq-mean-token-sum-norm' needs loss_norm > 0: Dr. GRPO's constant, "
                "e.g. the generation budget (max new tokens per turn x turns)"
            )


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    """GRPO's group advantages (`cua_jax.rl.advantages.group_advantages`): divide by the
    group's std (else Dr. GRPO's mean-only centring), leave-one-out means, and whether groups
    whose rewards are all equal are dropped ("filter") or trained on with zero advantage."""

    normalize_std: bool = True
    leave_one_out: bool = False
    eps: float = 1e-6
    zero_variance: Literal["filter", "keep"] = "filter"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters on `target_modules` (`cua_jax.models.lora`); only they train."""

    rank: int = 8
    alpha: float = 16.0
    target_modules: tuple[str, ...] = lora_lib.DEFAULT_TARGETS
    seed: int = 0
