"""Token sampling: greedy, temperature, top-k, top-p, a PRNG key per request, and log-probs.

Everything here runs inside the jitted decode loop on a whole batch of slots, each with its own
settings (`SlotSampling`), so one compiled loop serves greedy evaluation and tempered rollouts side
by side. The key of step i of a request is fold_in(key(seed), i): a preempted and recomputed
request draws exactly the same tokens.

A slot may be constrained to a grammar (`cua_jax.sampler.grammar`): its state indexes the
engine's `GrammarTables`, the tokens the state does not allow are masked before the draw (and
the argmax), and the state follows the drawn token inside the decode loop. The mask enters
neither log-prob: both are of the unconstrained policy, which is what the learner scores.

Two log-probs come back per token, both f32:
  * `logprobs`: under the distribution actually sampled from (logits / temperature, restricted to
    the top-k / top-p set and renormalised); for greedy requests the untempered model's.
  * `model_logprobs`: log_softmax of the raw logits (temperature 1, no truncation), which is what a
    trainer-side forward pass computes; the PPO ratio starts at exactly 1 against it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cua_jax.sampler.params import MAX_BANNED, SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GrammarTables:
    """A `TokenAutomaton`'s tables for the decode loop (host numpy or device arrays)."""

    allow: Any  # bool[N, C]
    next_state: Any  # i32[N, C]; -1: not allowed
    token_class: Any  # i32[V]; [1] in the no-grammar placeholder

    @staticmethod
    def none() -> GrammarTables:
        """The placeholder of an engine without a grammar (no slot is ever constrained)."""
        return GrammarTables(
            np.ones((1, 1), bool), np.full((1, 1), -1, np.int32), np.zeros((1,), np.int32)
        )

    @staticmethod
    def of(automaton: Any, vocab_size: int) -> GrammarTables:
        """`automaton`'s tables over a model of `vocab_size` logits (ids past the tokenizer's,
        the embedding's padding, are class 0: never allowed)."""
        V0 = automaton.vocab_size
        if V0 > vocab_size:
            raise ValueError(
                f"the grammar's tokenizer has {V0} ids but the model only {vocab_size} logits"
            )
        cls = np.zeros((vocab_size,), np.int32)
        cls[:V0] = automaton.token_class
        return GrammarTables(automaton.allow, automaton.next_state, cls)

    @property
    def has_grammar(self) -> bool:
        """False for the placeholder (static: decided when the decode loop is traced)."""
        return self.token_class.shape[0] > 1

    def abstract(self, sharding: Any = None) -> GrammarTables:
        """ShapeDtypeStructs of these tables (for `.lower`)."""
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), self
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotSampling:
    """Sampling settings of every slot, as device arrays (S slots)."""

    temperature: jax.Array  # f32[S]; 0 = greedy
    top_k: jax.Array  # i32[S]; 0 = off
    top_p: jax.Array  # f32[S]; 1 = off
    key_data: jax.Array  # u32[S, 2] raw threefry key of each request
    banned: jax.Array  # i32[S, MAX_BANNED] token ids never sampled; padded with -1
    grammar_state: jax.Array  # i32[S]: each slot's state in `grammar`; -1 = unconstrained
    grammar: GrammarTables

    @staticmethod
    def from_params(
        params: list[SamplingParams | None],
        grammar_states: Sequence[int] | None = None,
        grammar: GrammarTables | None = None,
    ) -> SlotSampling:
        """Packs one SamplingParams per slot (None for empty slots: greedy, seed 0), with each
        slot's grammar state (default: none constrained) in `grammar` (default: none)."""
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
            grammar_state=np.asarray(
                [-1] * len(ps) if grammar_states is None else grammar_states, np.int32
            ),
            grammar=GrammarTables.none() if grammar is None else grammar,
        )

    @staticmethod
    def abstract(n: int, grammar: GrammarTables | None = None) -> SlotSampling:
        """ShapeDtypeStructs of `n` slots' settings (`grammar`: abstract tables; default the
        no-grammar placeholder's), for `.lower`."""
        sds, i32 = jax.ShapeDtypeStruct, jnp.int32
        return SlotSampling(
            temperature=sds((n,), jnp.float32),
            top_k=sds((n,), i32),
            top_p=sds((n,), jnp.float32),
            key_data=sds((n, 2), jnp.uint32),
            banned=sds((n, MAX_BANNED), i32),
            grammar_state=sds((n,), i32),
            grammar=GrammarTables.none().abstract() if grammar is None else grammar,
        )


def ban_tokens(logits_SV: jax.Array, banned_SK: jax.Array) -> jax.Array:
    """Sets logits of the banned ids (i32[S, K], -1 = none) to -inf."""
    V = logits_SV.shape[-1]
    idx = jnp.where(banned_SK < 0, V, banned_SK)  # out of range -> dropped by the scatter
    rows = jnp.arange(logits_SV.shape[0])[:, None]
    return logits_SV.at[rows, idx].set(-jnp.inf, mode="drop")


def constrain(logits_SV: jax.Array, sampling: SlotSampling) -> jax.Array:
    """-inf for the tokens each constrained slot's grammar state does not allow (no-op, and no
    [S, V] gather, when no slot is constrained)."""
    on_S = sampling.grammar_state >= 0
    g = sampling.grammar

    def mask(x):
        rows_SC = jnp.asarray(g.allow)[jnp.maximum(sampling.grammar_state, 0)]
        ok_SV = jnp.take(rows_SC, jnp.asarray(g.token_class), axis=1) | ~on_S[:, None]
        return jnp.where(ok_SV, x, -jnp.inf)

    return jax.lax.cond(jnp.any(on_S), mask, lambda x: x, logits_SV)


def advance(sampling: SlotSampling, state_S: jax.Array, tok_S: jax.Array) -> jax.Array:
    """Each constrained slot's grammar state after `tok_S` (unconstrained slots stay -1)."""
    g = sampling.grammar
    if not g.has_grammar:
        return state_S
    cls_S = jnp.asarray(g.token_class)[jnp.clip(tok_S, 0, None)]
    nxt_S = jnp.asarray(g.next_state)[jnp.maximum(state_S, 0), cls_S]
    return jnp.where(state_S >= 0, nxt_S, state_S)


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
    temp_S1 = jnp.where(greedy_S, 1.0, sampling.temperature)[:, None]
    # Sorting the vocabulary is the costly part; skip it when no slot truncates.
    truncate_S = ((sampling.top_k > 0) | (sampling.top_p < 1.0)) & ~greedy_S

    def truncate(x):
        return jax.lax.cond(
            jnp.any(truncate_S),
            lambda x: jax.vmap(_truncate)(x, sampling.top_k, sampling.top_p),
            lambda x: x,
            x,
        )

    if sampling.grammar.has_grammar:
        # Constrained slots draw from the allowed tokens (masked before truncation, so the kept
        # set is never empty); their log-probs are of the unmasked distribution.
        constrained = jnp.any(sampling.grammar_state >= 0)
        allowed_SV = constrain(logits_SV, sampling)
        draw_SV = truncate(allowed_SV / temp_S1)
        scaled_SV = jax.lax.cond(
            constrained, lambda: truncate(logits_SV / temp_S1), lambda: draw_SV
        )
    else:  # an engine without a grammar traces none of it
        allowed_SV, scaled_SV = logits_SV, truncate(logits_SV / temp_S1)
        draw_SV = scaled_SV

    def draw(key_data, step, scaled_V):
        key = jax.random.fold_in(jax.random.wrap_key_data(key_data), step)
        return jax.random.categorical(key, scaled_V)

    # Random draws over the vocabulary cost more than the argmax; skip them for all-greedy batches.
    all_greedy = jnp.all(greedy_S)
    drawn_S = jax.lax.cond(
        all_greedy,
        lambda: jnp.zeros(greedy_S.shape, jnp.int32),
        lambda: jax.vmap(draw)(sampling.key_data, step_S, draw_SV).astype(jnp.int32),
    )
    tok_S = jnp.where(greedy_S, jnp.argmax(allowed_SV, axis=-1), drawn_S).astype(jnp.int32)
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
