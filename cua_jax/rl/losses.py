"""Token-level policy-gradient losses for GRPO-style RL (small pure jnp functions, all f32).

Notation (per generated token t of rollout i):
  π_θ      the policy being trained; log π_θ(o_t) = ``logprobs``
  π_old    the PPO anchor (``old_logprobs``): the sampler's behaviour policy μ, or the learner's
           own policy at the start of the step, sg(π_θ), when importance sampling corrects the
           sampler/learner mismatch separately (see ``tis_cap``)
  μ        the behaviour policy that sampled the tokens (``behaviour_logprobs``)
  π_ref    the frozen reference policy for the KL penalty (``ref_logprobs``)
  r_t      = π_θ(o_t) / π_old(o_t), the PPO ratio
  Â        the advantage (see ``advantages.py``), broadcast over the rollout's tokens

Loss per token (to minimise):
  L_t = - w^TIS_t · min(r_t Â, clip(r_t, 1 - ε_low, 1 + ε_high) Â)  + β · KL_t  - α · H_t
where
  clip-higher (DAPO, Yu et al. 2025): separate ε_low / ε_high;
  w^TIS_t = min(π_old(o_t) / μ(o_t), C)  truncated importance sampling (Yao et al. 2025, "Your
    Efficient RL Framework Secretly Brings You Off-Policy RL Training"), no gradient;
  KL_t: Schulman's estimators of KL(π_θ || π_ref) from samples of π_θ, with
    log ρ = log π_ref - log π_θ:  k1 = -log ρ,  k2 = ½ (log ρ)²,  k3 = (ρ - 1) - log ρ;
  H_t: entropy of π_θ at the position (reported; a bonus only when α > 0).

Aggregation is a weighted sum Σ_t w_t L_t with per-token weights computed on the host by
``loss_weights`` over the whole batch, so packing rows or splitting the batch into gradient-
accumulation micro-batches never changes the loss:
  "token-mean"               w_t = 1 / (number of loss tokens in the batch)   (DAPO token-level)
  "seq-mean-token-mean"      w_t = 1 / (num sequences · |o_i|)                (original GRPO)
  "seq-mean-token-sum-norm"  w_t = 1 / (num sequences · C)                    (Dr. GRPO, constant C)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3"]
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def token_logprobs(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """log softmax(logits)[target], f32[B, T]; computed in f32 whatever the logits dtype."""
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp_BTV, targets_BT[..., None].astype(jnp.int32), axis=-1)[..., 0]


def token_entropy(logits_BTV: jax.Array) -> jax.Array:
    """Entropy H = -Σ_v p_v log p_v of the next-token distribution, f32[B, T]."""
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.exp(logp_BTV) * logp_BTV, axis=-1)


def token_logprobs_and_entropy(
    logits_BTV: jax.Array, targets_BT: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(log π(target), entropy H), both f32[B, T], from one log-softmax over the vocabulary."""
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    logp = jnp.take_along_axis(logp_BTV, targets_BT[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return logp, -jnp.sum(jnp.exp(logp_BTV) * logp_BTV, axis=-1)


def chunked_token_stats(
    logits_fn: Callable[[jax.Array], jax.Array],
    hidden_BTD: jax.Array,
    targets_BT: jax.Array,
    *,
    chunk: int = 0,
    entropy: bool = True,
) -> tuple[jax.Array, jax.Array | None]:
    """(log π(target), entropy H or None), f32[B, T], from hidden states, ``chunk`` positions at
    a time, so the f32[B, T, V] logits never exist at once.

    ``logits_fn`` maps f32[B, c, D] hidden states to f32[B, c, V] logits (LM head, masking,
    temperature). With ``chunk > 0`` the positions are split into chunks of that many, each
    chunk's logits are computed, reduced and dropped inside a ``lax.map`` whose body is
    rematerialised (``jax.checkpoint``), so forward and backward hold one chunk's logits: at a
    real vocabulary (~152k) a 16k-token row's logits alone are ~10 GB in f32. ``chunk <= 0`` or
    ``chunk >= T`` computes everything in one piece. Both paths give the same values and
    gradients (tests/rl/test_losses.py).
    """

    def stats(h_BcD: jax.Array, t_Bc: jax.Array) -> tuple[jax.Array, jax.Array]:
        if entropy:
            return token_logprobs_and_entropy(logits_fn(h_BcD), t_Bc)
        lp = token_logprobs(logits_fn(h_BcD), t_Bc)
        return lp, jnp.zeros_like(lp)

    b, t = targets_BT.shape
    if chunk <= 0 or chunk >= t:
        lp, ent = stats(hidden_BTD, targets_BT)
        return lp, ent if entropy else None
    n = -(-t // chunk)
    pad = n * chunk - t
    h = jnp.pad(hidden_BTD, ((0, 0), (0, pad), (0, 0)))
    tg = jnp.pad(targets_BT, ((0, 0), (0, pad)))
    # [B, n*c, ...] -> [n, B, c, ...]: lax.map runs over chunks of positions.
    h = h.reshape(b, n, chunk, h.shape[-1]).swapaxes(0, 1)
    tg = tg.reshape(b, n, chunk).swapaxes(0, 1)
    lp, ent = jax.lax.map(lambda xs: jax.checkpoint(stats)(*xs), (h, tg))

    def unchunk(x: jax.Array) -> jax.Array:
        return x.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]

    return unchunk(lp), unchunk(ent) if entropy else None


def loss_weights(
    loss_mask_BT: np.ndarray,
    segment_ids_BT: np.ndarray | None = None,
    mode: AggMode = "token-mean",
    loss_norm: float | None = None,
    *,
    sequence_ids_BT: np.ndarray | None = None,
) -> np.ndarray:
    """Per-token aggregation weights w, f32[B, T] (host numpy), zero where the mask is off.

    A *sequence* (the unit the seq-mean modes average over: one rollout) is a (row, segment id)
    pair; without ``segment_ids_BT`` each row is one sequence. ``sequence_ids_BT`` overrides
    both: tokens with the same id are one sequence wherever they sit (an episode whose history
    window split it into several samples is still one rollout). ``loss_norm`` is Dr. GRPO's
    constant C, required by "seq-mean-token-sum-norm" (e.g. the generation budget: a constant,
    not the row length, which depends on what else is in the batch). Weights of the whole batch
    sum to 1 for "token-mean" and "seq-mean-token-mean".
    """
    mask = np.asarray(loss_mask_BT, dtype=bool)
    if mask.ndim != 2:
        raise ValueError(f"loss_mask_BT must be 2-D [B, T], got shape {mask.shape}")
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; use one of {AGG_MODES}")
    b, t = mask.shape
    w = np.zeros((b, t), np.float32)
    n_tok = mask.sum()
    if n_tok == 0:
        return w
    if mode == "token-mean":
        w[mask] = 1.0 / n_tok
        return w
    if sequence_ids_BT is not None:
        seg = np.asarray(sequence_ids_BT)
        if seg.shape != mask.shape:
            raise ValueError(f"sequence_ids shape {seg.shape} != loss mask {mask.shape}")
    elif segment_ids_BT is None:
        seg = np.broadcast_to(np.arange(b)[:, None], (b, t))
    else:
        seg_ids = np.asarray(segment_ids_BT)
        if seg_ids.shape != mask.shape:
            raise ValueError(f"segment_ids shape {seg_ids.shape} != loss mask {mask.shape}")
        seg = np.arange(b)[:, None] * (int(seg_ids.max()) + 1) + seg_ids
    # Global sequence key per token; count loss tokens per sequence.
    keys, inverse = np.unique(seg[mask], return_inverse=True)
    counts = np.bincount(inverse, minlength=len(keys))
    n_seq = len(keys)
    if mode == "seq-mean-token-mean":
        w[mask] = 1.0 / (n_seq * counts[inverse])
    else:
        if loss_norm is None or loss_norm <= 0:
            raise ValueError(
                f"mode {mode!r} needs loss_norm > 0 (Dr. GRPO's constant, e.g. the generation "
                f"budget max_new_tokens x max_turns); got {loss_norm}"
            )
        c = float(loss_norm)
        w[mask] = 1.0 / (n_seq * c)
    return w


def ppo_clip(
    logprobs_BT: jax.Array,
    old_logprobs_BT: jax.Array,
    advantages_BT: jax.Array,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Per-token PPO-clip loss -min(r Â, clip(r, 1-ε_low, 1+ε_high) Â).

    Returns (loss f32[B,T], ratio f32[B,T], clipped_low bool[B,T], clipped_high bool[B,T]);
    clipped_* marks tokens whose gradient the clip removed (Â<0, r<1-ε_low / Â>0, r>1+ε_high).
    """
    log_ratio = logprobs_BT - old_logprobs_BT
    ratio = jnp.exp(log_ratio)
    clipped_ratio = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = -jnp.minimum(ratio * advantages_BT, clipped_ratio * advantages_BT)
    clipped_low = (advantages_BT < 0) & (ratio < 1.0 - eps_low)
    clipped_high = (advantages_BT > 0) & (ratio > 1.0 + eps_high)
    return loss, ratio, clipped_low, clipped_high


def tis_weight(
    old_logprobs_BT: jax.Array, behaviour_logprobs_BT: jax.Array, cap: float
) -> jax.Array:
    """Truncated importance weight min(π_old/μ, C), no gradient (TIS, Yao et al. 2025)."""
    w = jnp.minimum(jnp.exp(old_logprobs_BT - behaviour_logprobs_BT), cap)
    return jax.lax.stop_gradient(w)


def kl_penalty(
    logprobs_BT: jax.Array, ref_logprobs_BT: jax.Array, estimator: KLEstimator = "k3"
) -> jax.Array:
    """Per-token estimate of KL(π_θ || π_ref) (Schulman, "Approximating KL Divergence", 2020)."""
    log_rho = ref_logprobs_BT - logprobs_BT
    if estimator == "k1":
        return -log_rho
    if estimator == "k2":
        return 0.5 * jnp.square(log_rho)
    if estimator == "k3":
        return jnp.exp(log_rho) - 1.0 - log_rho
    raise ValueError(f"unknown KL estimator {estimator!r}; use 'k1', 'k2' or 'k3'")


def policy_loss(
    logprobs_BT: jax.Array,
    old_logprobs_BT: jax.Array,
    advantages_BT: jax.Array,
    weights_BT: jax.Array,
    mask_BT: jax.Array,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    behaviour_logprobs_BT: jax.Array | None = None,
    tis_cap: float | None = None,
    ref_logprobs_BT: jax.Array | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    entropy_BT: jax.Array | None = None,
    entropy_coef: float = 0.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The full GRPO/DAPO token loss Σ_t w_t L_t (see the module docstring) and metrics.

    ``weights_BT`` come from ``loss_weights`` (zero off the mask); ``mask_BT`` (bool) only
    restricts the metrics, which are means over the masked tokens of this call. Metric sums
    (``*_sum``) and ``num_tokens`` are also returned so callers can combine micro-batches.
    """
    f32 = jnp.float32
    weights = weights_BT.astype(f32)
    mask = mask_BT.astype(f32)
    pg, ratio, clip_lo, clip_hi = ppo_clip(
        logprobs_BT, old_logprobs_BT, advantages_BT.astype(f32), eps_low=eps_low, eps_high=eps_high
    )
    if tis_cap is not None:
        if behaviour_logprobs_BT is None:
            raise ValueError("tis_cap is set but behaviour_logprobs_BT is None; pass the sampler's")
        tis = tis_weight(old_logprobs_BT, behaviour_logprobs_BT, tis_cap)
        pg = pg * tis
    per_token = pg
    n = jnp.maximum(mask.sum(), 1.0)

    def masked_mean(x):
        return jnp.sum(x.astype(f32) * mask) / n

    metrics: dict[str, jax.Array] = {
        "pg_loss": jnp.sum(pg * weights),
        "ratio_mean": masked_mean(ratio),
        "ratio_max": jnp.max(jnp.where(mask > 0, ratio, -jnp.inf)),
        "clip_frac_low": masked_mean(clip_lo),
        "clip_frac_high": masked_mean(clip_hi),
        "num_tokens": mask.sum(),
    }
    if tis_cap is not None:
        metrics["tis_weight_mean"] = masked_mean(tis)
        metrics["tis_capped_frac"] = masked_mean(tis >= tis_cap)
    if behaviour_logprobs_BT is not None:
        # Sampler/learner mismatch, reported whether or not it is corrected.
        learner_logp = jax.lax.stop_gradient(logprobs_BT)
        metrics["behaviour_kl_k3"] = masked_mean(kl_penalty(learner_logp, behaviour_logprobs_BT))
    if ref_logprobs_BT is not None:
        kl = kl_penalty(logprobs_BT, ref_logprobs_BT, kl_estimator)
        metrics["kl"] = masked_mean(kl)
        if kl_coef:
            per_token = per_token + kl_coef * kl
    elif kl_coef:
        raise ValueError("kl_coef > 0 needs ref_logprobs_BT (the reference policy's log-probs)")
    if entropy_BT is not None:
        metrics["entropy"] = masked_mean(entropy_BT)
        if entropy_coef:
            per_token = per_token - entropy_coef * entropy_BT
    elif entropy_coef:
        raise ValueError("entropy_coef > 0 needs entropy_BT (see token_entropy)")
    loss = jnp.sum(per_token * weights)
    metrics["loss"] = loss
    return loss, metrics


def sft_loss(
    logprobs_BT: jax.Array, weights_BT: jax.Array, mask_BT: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Cross-entropy -Σ_t w_t log π_θ(o_t) on loss-masked tokens (behaviour cloning)."""
    mask = mask_BT.astype(jnp.float32)
    loss = -jnp.sum(logprobs_BT * weights_BT.astype(jnp.float32))
    n = jnp.maximum(mask.sum(), 1.0)
    return loss, {
        "loss": loss,
        "nll_mean": -jnp.sum(logprobs_BT * mask) / n,
        "num_tokens": mask.sum(),
    }
