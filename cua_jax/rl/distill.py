"""SDPO's loss as pure functions: the per-token divergences between the student's and the
teacher's distributions, the distillation term of a micro-batch, and the step modes that name
each loss variant (one compiled learner step each).

`cua_jax.rl.step` adds the term to the policy loss; `cua_jax.rl.sdpo` builds the teacher's
targets (and re-exports these names). No state, no host work beyond `distill_weights`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

Divergence = Literal["kl", "rkl", "js"]
DIVERGENCES = ("kl", "rkl", "js")


# ---------------------------------------------------------------------------------------------
# Divergences (pure jnp; log-probabilities over the same support in the last axis)
# ---------------------------------------------------------------------------------------------


def add_tail(logp_BTK: jax.Array) -> jax.Array:
    """Appends log(1 - Σ_k p_k): top-k log-probs become a distribution over k + 1 buckets."""
    log_s = jnp.minimum(jax.nn.logsumexp(logp_BTK, axis=-1, keepdims=True), -1e-7)
    return jnp.concatenate([logp_BTK, jnp.log(-jnp.expm1(log_s))], axis=-1)


def _kl(logp_a: jax.Array, logp_b: jax.Array) -> jax.Array:
    """KL(a || b) = Σ a (log a - log b) over the last axis; 0 · log 0 = 0."""
    p_a = jnp.exp(logp_a)
    return jnp.sum(jnp.where(p_a > 0, p_a * (logp_a - logp_b), 0.0), axis=-1)


def token_divergence(
    student_logp_BTK: jax.Array,
    teacher_logp_BTK: jax.Array,
    divergence: Divergence = "js",
    js_beta: float = 0.5,
) -> jax.Array:
    """Per-token divergence f32[B, T] between the student's and the (stop-gradient) teacher's
    distributions, both given as log-probabilities over the same K outcomes."""
    s = student_logp_BTK.astype(jnp.float32)
    t = jax.lax.stop_gradient(teacher_logp_BTK.astype(jnp.float32))
    if divergence == "kl":
        return _kl(t, s)
    if divergence == "rkl":
        return _kl(s, t)
    if divergence == "js":
        if not 0.0 < js_beta < 1.0:
            raise ValueError(f"js_beta={js_beta} must be in (0, 1) (0 / 1: use 'rkl' / 'kl')")
        m = jnp.logaddexp(s + np.log1p(-js_beta), t + np.log(js_beta))
        return (1.0 - js_beta) * _kl(s, m) + js_beta * _kl(t, m)
    raise ValueError(f"unknown divergence {divergence!r}; use one of {DIVERGENCES}")


def student_support_logp(
    logits_BTV: jax.Array, teacher_ids_BTK: jax.Array, teacher_logp_BTK: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(student, teacher) log-probs over the teacher's K ids, each with a tail bucket when K is
    less than the vocabulary (over the whole vocabulary the tail is empty and left out)."""
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    s = jnp.take_along_axis(logp_BTV, teacher_ids_BTK.astype(jnp.int32), axis=-1)
    t = teacher_logp_BTK.astype(jnp.float32)
    if teacher_ids_BTK.shape[-1] < logits_BTV.shape[-1]:
        return add_tail(s), add_tail(t)
    return s, t


def distill_loss(
    divergence_BT: jax.Array, weights_BT: jax.Array, mask_BT: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Σ_t w_t D_t (w from `distill_weights`: a token mean over the distilled tokens of the whole
    batch) and metrics, all sums so that micro-batches add up: the loss, the divergence summed
    over the masked tokens, their count."""
    mask = mask_BT.astype(jnp.float32)
    loss = jnp.sum(divergence_BT * weights_BT.astype(jnp.float32))
    return loss, {
        "sdpo_loss": loss,
        "sdpo_div_sum": jnp.sum(divergence_BT * mask),
        "sdpo_tokens": mask.sum(),
    }


def distill_weights(mask_RL: np.ndarray) -> np.ndarray:
    """Token-mean weights f32[R, L]: 1 / (distilled tokens in the batch) on each of them."""
    mask = np.asarray(mask_RL, bool)
    w = np.zeros(mask.shape, np.float32)
    if mask.any():
        w[mask] = 1.0 / mask.sum()
    return w


def chunked_stats_and_divergence(
    logits_fn: Callable[[jax.Array], jax.Array],
    hidden_BTD: jax.Array,
    targets_BT: jax.Array,
    teacher_ids_BTK: jax.Array,
    teacher_logp_BTK: jax.Array,
    *,
    chunk: int = 0,
    entropy: bool = True,
    divergence: Divergence = "js",
    js_beta: float = 0.5,
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """(log π(target), entropy or None, SDPO divergence), each f32[B, T], from one log-softmax
    per chunk of ``chunk`` positions (rematerialised in the backward pass, as
    `losses.chunked_token_stats`): the student's f32[B, T, V] logits never exist at once."""

    def stats(h, tg, tid, tlp):
        logits = logits_fn(h).astype(jnp.float32)
        logp_V = jax.nn.log_softmax(logits, axis=-1)
        lp = jnp.take_along_axis(logp_V, tg[..., None].astype(jnp.int32), axis=-1)[..., 0]
        ent = -jnp.sum(jnp.exp(logp_V) * logp_V, axis=-1) if entropy else jnp.zeros_like(lp)
        s, t = student_support_logp(logits, tid, tlp)
        return lp, ent, token_divergence(s, t, divergence, js_beta)

    b, t = targets_BT.shape
    if chunk <= 0 or chunk >= t:
        lp, ent, div = stats(hidden_BTD, targets_BT, teacher_ids_BTK, teacher_logp_BTK)
        return lp, ent if entropy else None, div
    n = -(-t // chunk)
    pad = n * chunk - t

    def split(x):  # [B, T, ...] -> [n, B, c, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return x.reshape(b, n, chunk, *x.shape[2:]).swapaxes(0, 1)

    xs = tuple(split(x) for x in (hidden_BTD, targets_BT, teacher_ids_BTK, teacher_logp_BTK))
    lp, ent, div = jax.lax.map(lambda a: jax.checkpoint(stats)(*a), xs)

    def unchunk(x):
        return x.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]

    return unchunk(lp), unchunk(ent) if entropy else None, unchunk(div)


# ---------------------------------------------------------------------------------------------
# Step modes and the micro-batch term
# ---------------------------------------------------------------------------------------------


TARGET_KEYS = ("sdpo_ids", "sdpo_logp", "sdpo_mask", "sdpo_weights")  # the step's extra inputs
TOPK_KEYS = ("sdpo_ids", "sdpo_logp")  # [R, L, K]; the others are [R, L]


@dataclasses.dataclass(frozen=True)
class LossVariant:
    """The static part of the SDPO term (one compiled learner step each)."""

    divergence: Divergence
    js_beta: float
    weight: float


def step_mode(divergence: str, js_beta: float, weight: float) -> str:
    """The learner step mode (and jit key) of one SDPO loss variant; `parse_mode` reads it."""
    return f"sdpo:{divergence}:{js_beta}:{weight}"


def topk_width(topk: int, vocab: int) -> int:
    """How many teacher log-probs a position keeps: `topk`, or the whole vocabulary when
    `topk <= 0` or `topk >= vocab`."""
    return vocab if topk <= 0 or topk >= vocab else topk


def parse_mode(mode: str) -> LossVariant | None:
    """The `LossVariant` of a learner step mode (`TeacherTargets.mode`); None for others."""
    if not mode.startswith("sdpo:"):
        return None
    _, div, beta, weight = mode.split(":")
    return LossVariant(div, float(beta), float(weight))  # type: ignore[arg-type]


def micro_loss(
    pg_loss: jax.Array,
    pg_metrics: dict[str, jax.Array],
    divergence_BT: jax.Array,
    mb: dict[str, jax.Array],
    weight: float,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(1 - λ) L_GRPO + λ L_SDPO of one micro-batch from the GRPO loss and its metrics, the
    per-token divergence f32[B, L-1] and the micro-batch's SDPO arrays (`TeacherTargets`)."""
    sd_loss, sd_metrics = distill_loss(
        divergence_BT, mb["sdpo_weights"][:, 1:], mb["sdpo_mask"][:, 1:]
    )
    loss = (1.0 - weight) * pg_loss + weight * sd_loss
    return loss, {**pg_metrics, **sd_metrics, "loss": loss}
