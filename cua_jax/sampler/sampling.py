"""Token sampling: greedy, temperature, top-k, top-p, a PRNG key per request, and log-probs.

Everything here runs inside the jitted decode loop on a whole batch of slots, each with its own
settings (`SlotSampling`), so one compiled loop serves greedy evaluation and tempered rollouts side
by side. The key of step i of a request is fold_in(key(seed), i): a preempted and recomputed
request draws exactly the same tokens.

Two log-probs come back per token, both f32:
  * `logprobs`: under the distribution actually sampled from (logits / temperature, restricted to
    the top-k / top-p set and renormalised); for greedy requests the untempered model's.
  * `model_logprobs`: log_softmax of the raw logits (temperature 1, no truncation), which is what a
    trainer-side forward pass computes; the PPO ratio starts at exactly 1 against it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from cua_jax.sampler.params import MAX_BANNED, SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotSampling:
    """Sampling settings of every slot, as device arrays (S slots)."""

    temperature: jax.Array  # f32[S]; 0 = greedy
    top_k: jax.Array  # i32[S]; 0 = off
    top_p: jax.Array  # f32[S]; 1 = off
    key_data: jax.Array  # u32[S, 2] raw threefry key of each request
    banned: jax.Array  # i32[S, MAX_BANNED] token ids never sampled; padded with -1

    @staticmethod
    def from_params(params: list[SamplingParams | None]) -> SlotSampling:
        """Packs one SamplingParams per slot (None for empty slots: greedy, seed 0)."""
        ps = [p or SamplingParams(temperature=0.0) for p in params]
        keys = np.stack([_key_data(p.seed) for p in ps])
        banned = np.full((len(ps), MAX_BANNED), -1, np.int32)
        for i, p in enumerate(ps):
            banned[i, : len(p.banned_token_ids)] = p.banned_token_ids
        # Host (numpy) leaves: a jitted call takes them in ~20 us, while jnp.asarray costs ~60 us
        # per field; this runs once per decode chunk.
        return SlotSampling(
            temperature=np.asarray([p.temperature for p in ps], np.float32),
            top_k=np.asarray([p.top_k for p in ps], np.int32),
            top_p=np.asarray([p.top_p for p in ps], np.float32),
            key_data=keys.astype(np.uint32),
            banned=banned,
        )


def ban_tokens(logits_SV: jax.Array, banned_SK: jax.Array) -> jax.Array:
    """Sets logits of the banned ids (i32[S, K], -1 = none) to -inf."""
    V = logits_SV.shape[-1]
    idx = jnp.where(banned_SK < 0, V, banned_SK)  # out of range -> dropped by the scatter
    rows = jnp.arange(logits_SV.shape[0])[:, None]
    return logits_SV.at[rows, idx].set(-jnp.inf, mode="drop")


def _key_data(seed: int) -> np.ndarray:
    """u32[2] raw data of jax.random.key(seed), built on the host (no device op per request).

    For the default threefry2x32 implementation the key of a 32-bit seed is (0, seed); other
    seeds and implementations go through JAX.
    """
    if jax.config.jax_default_prng_impl == "threefry2x32" and 0 <= seed < (1 << 32):
        return np.asarray([0, seed], np.uint32)
    return np.asarray(jax.random.key_data(jax.random.key(seed)))


def _truncate(logits_V: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Sets logits outside the top-k / top-p set to -inf (ties at the threshold are kept)."""
    V = logits_V.shape[-1]
    sorted_V = jnp.sort(logits_V)[::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = sorted_V[k - 1]
    sorted_V = jnp.where(jnp.arange(V) < k, sorted_V, -jnp.inf)
    probs = jax.nn.softmax(sorted_V)
    # Keep the smallest prefix whose mass reaches top_p: token i stays if the mass before it < p.
    before = jnp.cumsum(probs) - probs
    keep = (before < top_p) & (jnp.arange(V) < k)
    thresh = jnp.min(jnp.where(keep, sorted_V, jnp.inf))
    thresh = jnp.maximum(thresh, kth)
    return jnp.where(logits_V >= thresh, logits_V, -jnp.inf)


def sample_tokens(
    logits_SV: jax.Array, sampling: SlotSampling, step_S: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Draws one token per slot. Returns (tokens i32[S], logprobs f32[S], model_logprobs f32[S]).

    step_S (i32[S]) is the index of the token being generated within its request; it is folded
    into the request's key so every step draws fresh, reproducible randomness.
    """
    logits_SV = ban_tokens(logits_SV.astype(jnp.float32), sampling.banned)
    greedy_S = sampling.temperature <= 0.0
    scaled_SV = logits_SV / jnp.where(greedy_S, 1.0, sampling.temperature)[:, None]
    # Sorting the vocabulary is the costly part; skip it when no slot truncates.
    truncate_S = ((sampling.top_k > 0) | (sampling.top_p < 1.0)) & ~greedy_S
    scaled_SV = jax.lax.cond(
        jnp.any(truncate_S),
        lambda x: jax.vmap(_truncate)(x, sampling.top_k, sampling.top_p),
        lambda x: x,
        scaled_SV,
    )

    def draw(key_data, step, scaled_V):
        key = jax.random.fold_in(jax.random.wrap_key_data(key_data), step)
        return jax.random.categorical(key, scaled_V)

    # Random draws over the vocabulary cost more than the argmax; skip them for all-greedy batches.
    all_greedy = jnp.all(greedy_S)
    drawn_S = jax.lax.cond(
        all_greedy,
        lambda: jnp.zeros(greedy_S.shape, jnp.int32),
        lambda: jax.vmap(draw)(sampling.key_data, step_S, scaled_SV).astype(jnp.int32),
    )
    tok_S = jnp.where(greedy_S, jnp.argmax(logits_SV, axis=-1), drawn_S).astype(jnp.int32)
    model_logp_S = _logprob_of(logits_SV, tok_S)
    # Greedy slots report the model's log-prob: skip the second pass when every slot is greedy.
    sampled_logp_S = jax.lax.cond(
        all_greedy, lambda: model_logp_S, lambda: _logprob_of(scaled_SV, tok_S)
    )
    return tok_S, jnp.where(greedy_S, model_logp_S, sampled_logp_S), model_logp_S


def _logprob_of(logits_SV: jax.Array, tok_S: jax.Array) -> jax.Array:
    """log_softmax(logits)[s, tok[s]] without materialising the [S, V] log-probs.

    Same arithmetic as jax.nn.log_softmax: (x - max) - log(sum(exp(x - max))).
    """
    m_S1 = jnp.max(logits_SV, axis=-1, keepdims=True)
    m_S1 = jnp.where(jnp.isfinite(m_S1), m_S1, 0.0)
    lse_S = jnp.log(jnp.sum(jnp.exp(logits_SV - m_S1), axis=-1))
    x_S = jnp.take_along_axis(logits_SV, tok_S[:, None], axis=1)[:, 0]
    return (x_S - m_S1[:, 0]) - lse_S
