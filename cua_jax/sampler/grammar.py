"""Decoding constrained to a regular language over token ids: the action format's grammar.

A small model's tool calls break on later turns (a missing quote, a stray brace) long before its
picks stop improving, and every broken call is an invalid action that teaches RL nothing about
the pick. With a `TokenAutomaton` the sampler only draws tokens that keep the output a prefix of
the format's language (`QwenComputerUse.action_regex`), and a stop token only once it is whole:
every reply parses, and the RL signal is the pick.

`outlines_core` (the Rust core of Outlines, what vLLM's guided decoding uses) builds the
token-level automaton from the regex and the tokenizer's bytes; this module renumbers its
states and packs it into dense tables the decode loop indexes on the device:

  * ``token_class`` i32[V]: tokens with the same transitions from every state share a class
    (the whole vocabulary outside the format's alphabet is class 0, allowed nowhere);
  * ``allow`` bool[N, C] and ``next_state`` i32[N, C] (-1 where not allowed).

A slot's state is an index into them (-1: unconstrained). The sampler masks the logits of the
tokens its state does not allow before drawing; both reported log-probs stay those of the
unmasked policy, which is what the learner scores (so the PPO ratio starts at 1, as with top-p:
the mask is part of how the rollout explores, not of the policy being trained).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from outlines_core import Index, Vocabulary


@dataclasses.dataclass(frozen=True)
class TokenAutomaton:
    """A token-level DFA as dense tables (see the module docstring)."""

    token_class: np.ndarray  # i32[V]
    allow: np.ndarray  # bool[N, C]
    next_state: np.ndarray  # i32[N, C]; -1: the token is not allowed there
    initial: int
    final: np.ndarray  # bool[N]: the output may stop here (a stop token is allowed)
    regex: str = ""

    @property
    def num_states(self) -> int:
        return int(self.allow.shape[0])

    @property
    def vocab_size(self) -> int:
        return int(self.token_class.shape[0])

    def step(self, state: int, token: int) -> int:
        """The state after `token` (-1 if it was not allowed, or the slot was unconstrained)."""
        if state < 0 or not 0 <= token < self.vocab_size:
            return -1
        return int(self.next_state[state, self.token_class[token]])

    def walk(self, tokens: Sequence[int], state: int | None = None) -> int:
        """The state after `tokens` from `state` (default: the initial one)."""
        s = self.initial if state is None else state
        for t in tokens:
            s = self.step(s, int(t))
        return s

    def allowed(self, state: int) -> np.ndarray:
        """bool[V]: the tokens `state` allows."""
        return self.allow[state][self.token_class]

    def accepts(self, tokens: Sequence[int]) -> bool:
        """Whether `tokens` (without a stop token) is a whole sentence of the language."""
        s = self.walk(tokens)
        return s >= 0 and bool(self.final[s])

    @classmethod
    def build(
        cls, regex: str, token_bytes: Sequence[bytes | None], stop_ids: Sequence[int]
    ) -> TokenAutomaton:
        """The automaton of `regex` over a vocabulary: `token_bytes[i]` is what token i writes
        (None: a control token, never allowed), `stop_ids` end the output (allowed in final
        states only; the first is the one outlines_core is told about)."""
        if not stop_ids:
            raise ValueError("TokenAutomaton.build: at least one stop id is needed")
        stops = [int(t) for t in stop_ids]
        V = len(token_bytes)
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(token_bytes):
            if b and i not in stops:
                by_bytes.setdefault(b, []).append(i)
        try:
            index = Index(regex, Vocabulary(stops[0], by_bytes))
        except ValueError as e:  # newer outlines_core refuses a dead state itself
            raise ValueError(
                f"TokenAutomaton: this vocabulary cannot write {regex[:80]!r}: {e}"
            ) from None
        trans = index.get_transitions()
        order = sorted(set(trans) | {n for moves in trans.values() for n in moves.values()})
        num = {s: k for k, s in enumerate(order)}
        live = sorted({t for moves in trans.values() for t in moves} | set(stops))
        col = {t: j for j, t in enumerate(live)}
        dense = np.full((len(order), len(live)), -1, np.int32)
        for s, moves in trans.items():  # (a state with no moves of its own has no entry)
            for t, nxt in moves.items():
                dense[num[s], col[t]] = num[nxt]
        final = np.zeros(len(order), bool)
        for s in index.get_final_states():
            if s in num:
                final[num[s]] = True
        for t in stops:  # every stop id ends the output where the first one does
            dense[final, col[t]] = dense[final, col[stops[0]]]
        # Class 0: allowed nowhere (every token the transitions never name); then one class per
        # distinct column of the live tokens.
        cols, inverse = np.unique(dense, axis=1, return_inverse=True)
        nxt = np.concatenate([np.full((len(order), 1), -1, np.int32), cols], axis=1)
        token_class = np.zeros(V, np.int32)
        token_class[np.asarray(live, np.int64)] = inverse.reshape(-1).astype(np.int32) + 1
        allow = nxt >= 0
        stuck = np.nonzero(~allow.any(axis=1))[0]
        if stuck.size:
            raise ValueError(
                f"TokenAutomaton: this vocabulary cannot write {regex[:80]!r}: {stuck.size} "
                "state(s) allow no token (a character the format needs has no token)"
            )
        return cls(
            token_class=token_class,
            allow=allow,
            next_state=nxt.astype(np.int32),
            initial=num[index.get_initial_state()],
            final=final,
            regex=regex,
        )


def action_automaton(tokenizer, action_format, api_actions: Sequence[str] = ()) -> TokenAutomaton:
    """The automaton of `action_format`'s tool calls (its ``action_regex``) over `tokenizer`,
    ending at the tokenizer's stop ids."""
    regex = action_format.action_regex(api_actions)
    return TokenAutomaton.build(regex, tokenizer.token_bytes(), tokenizer.stop_ids)
