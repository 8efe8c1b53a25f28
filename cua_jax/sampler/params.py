"""A request's sampling settings (`SamplingParams`): plain Python, no JAX, so the servers, the
agents and the scheduler import them without the device side. `cua_jax.sampler.sampling` turns
them into the jitted decode loop's per-slot arrays (`SlotSampling`).
"""

from __future__ import annotations

import dataclasses
import math

MAX_BANNED = 8


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_k: keep the k most likely tokens (0 = off). top_p: nucleus mass to keep (1.0 = off).
    seed: the request's PRNG seed. max_new_tokens: hard cap on generated tokens.
    stop_token_ids: generation ends after emitting one of these (it is kept in the output).
    stop_strings: generation ends once the detokenised output contains one (host-side check;
      needs the engine's `detokenize`); the output is cut after the token that completed it.
    banned_token_ids: never sampled (at most 8): their logits are -inf before everything else,
      so both reported log-probs are of the policy without them. The rollout bans the vision
      placeholder tokens (a generated <|image_pad|> would make the transcript's M-RoPE
      positions ill-defined); the learner masks the same ids (`Learner(banned_token_ids=)`).
    constrained: decode within the engine's grammar (`Engine(grammar=)`, e.g. the action
      format's tool calls): only tokens that keep the output a prefix of the language, a stop
      token only once it is whole. The reported log-probs stay the unconstrained policy's.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    banned_token_ids: tuple[int, ...] = ()
    constrained: bool = False

    def __post_init__(self):
        # NaN passes every comparison: `not (x >= 0)` and isfinite keep NaN and inf out.
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(
                f"temperature={self.temperature} must be finite and >= 0 (0 = greedy)."
            )
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 = off).")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] (1 = off).")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1.")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        banned = tuple(int(t) for t in self.banned_token_ids)
        if len(banned) > MAX_BANNED or any(t < 0 for t in banned):
            raise ValueError(
                f"banned_token_ids={banned}: at most {MAX_BANNED} non-negative token ids"
            )
        object.__setattr__(self, "banned_token_ids", banned)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
