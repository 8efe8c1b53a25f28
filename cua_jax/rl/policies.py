"""Per-turn policies of the agent loop, and the recovery detours of SFT demonstrations.

The episode loop (`cua_jax.rl.rollout.AgentLoop.play`) resets and steps the env, keeps the
transcript, records turns and scores the episode; what the agent writes each turn comes from a
`Policy`, which sees the turn's rendered prompt (`TurnContext`) and answers with token ids
(`Reply`) or ends the episode (`Stop`):

* `SamplerPolicy`: the model, through the sampler `Engine` (sampled, or greedy for eval).
* `OraclePolicy`: the env's oracle actions written as the model would write them (SFT targets,
  log-probs 0), optionally after a scripted first miss that gets no loss (a recovery
  demonstration; `recovery_detours` draws those misses).

The loop parses the reply's text into actions with the action format; a policy never steps the
env (the oracle only asks it for the next oracle action).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from cua_jax import actions as A
from cua_jax.env_api import Task
from cua_jax.sampler import SamplingParams

Detour = A.Action | Callable[[int, int], A.Action]
"""A recovery demonstration's scripted first action: an action in screen pixels, or a callable
that gets the first screenshot's (width, height) and returns one."""


@dataclasses.dataclass(frozen=True)
class TurnContext:
    """What a policy sees on one turn."""

    env: Any  # the episode's Env (the oracle asks it for the next action; never stepped here)
    task: Task
    turn: int  # 0-based index of this turn in the episode
    screenshot: np.ndarray  # u8[H, W, 3] this turn's screen
    space: A.CoordinateSpace  # model <-> screen coordinates of this episode
    prompt_ids: np.ndarray  # i32[P] the rendered conversation, ending with the assistant header
    pixel_values: np.ndarray | None  # f32[N, D] every image kept in the prompt, in order
    image_grid_thw: np.ndarray | None  # i32[I, 3]
    # Each image's `cua_jax.sampler.scheduler.image_digest`, kept from the turn it came in
    # (None: the engine hashes the pixels itself).
    image_hashes: Sequence[bytes] | None = None


@dataclasses.dataclass(frozen=True)
class Reply:
    """A policy's turn: the ids it wrote (the end-of-turn id included) and their behaviour
    log-probs; `trained=False` makes the turn context only (no loss on its tokens); `routes`:
    a MoE sampler's experts per generated token (GenerateOutput.routes), for routing replay."""

    generated_ids: Sequence[int]
    logprobs: np.ndarray  # f32[G]
    trained: bool = True
    routes: np.ndarray | None = None  # i32[G, L, K]; None for dense models


@dataclasses.dataclass(frozen=True)
class Stop:
    """The policy ends the episode before this turn: `failure_reason` None when it simply has
    nothing more to do (an oracle sequence is over), else why (say, "sampler_error: ...")."""

    failure_reason: str | None = None


class Policy(Protocol):
    """One episode's actor. A fresh policy object is made for every episode."""

    # The episode's reward goes through the loop's reward_fn (sampled training episodes); False:
    # the reward is the task's score itself (greedy eval, oracle demonstrations).
    shaped_reward: bool

    async def act(self, ctx: TurnContext) -> Reply | Stop:
        """This turn's reply to the prompt in `ctx`, or `Stop`."""
        ...

    def finish(self) -> int:
        """Called once after the last turn (not when reset failed): frees per-episode state and
        returns the policy version that wrote the episode (0 for scripted policies)."""
        ...


class SamplerPolicy:
    """The model, through the sampler: each turn's prompt goes to `engine.generate` under one
    KV-cache session (`session_id`), turn k sampled with seed `seeds(k)`.

    Args:
      engine: a `cua_jax.sampler.Engine` (`async generate(prompt_ids, pixel_values,
        image_grid_thw, params=, session_id=)`, `version`, optional `drop_session`).
      stop_token_ids: the tokenizer's end-of-turn ids.
      seeds: turn index -> sampling seed (resumable sampling: `rollout.episode_seed`).
      session: the engine's session id for this episode.
      greedy: temperature 0, top_p 1 (eval); the reward is then the task's score, unshaped.
      constrained: decode within the engine's grammar (`SamplingParams.constrained`).
    """

    def __init__(
        self,
        engine: Any,
        *,
        stop_token_ids: Sequence[int],
        seeds: Callable[[int], int],
        session: str,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 128,
        banned_token_ids: Sequence[int] = (),
        greedy: bool = False,
        constrained: bool = False,
    ):

        self.engine = engine
        self.session = session
        self.seeds = seeds
        self.shaped_reward = not greedy
        # Every turn's settings but the seed.
        self.params = SamplingParams(
            temperature=0.0 if greedy else temperature,
            top_p=1.0 if greedy else top_p,
            max_new_tokens=max_new_tokens,
            stop_token_ids=tuple(stop_token_ids),
            banned_token_ids=tuple(banned_token_ids),
            constrained=constrained,
        )
        # The weights that produced each turn (from the sampler's outputs: a weight update
        # handed to the engine is applied at its next scheduling step, not at once).
        self.versions: list[int] = []

    async def act(self, ctx: TurnContext) -> Reply | Stop:
        out = await self.engine.generate(
            ctx.prompt_ids,
            ctx.pixel_values,
            ctx.image_grid_thw,
            params=dataclasses.replace(self.params, seed=self.seeds(ctx.turn)),
            session_id=self.session,
            image_hashes=ctx.image_hashes,
        )
        if out.finish_reason == "error":
            return Stop(f"sampler_error: {getattr(out, 'error', '')}")
        self.versions.append(int(out.version))
        return Reply(
            [int(t) for t in out.tokens],
            np.asarray(out.logprobs, np.float32),
            routes=getattr(out, "routes", None),
        )

    def finish(self) -> int:
        """The oldest weights that produced any token (the engine's version if none did)."""
        version = min(self.versions) if self.versions else int(getattr(self.engine, "version", 0))
        drop = getattr(self.engine, "drop_session", None)
        if drop is not None:
            drop(self.session)
        return version


class OraclePolicy:
    """The task's oracle, written in the model's action format as the model would write it
    (its token ids + the end-of-turn id, log-probs 0): SFT demonstrations.

    detour: the first turn plays this action instead (say, a click that misses) and is marked
      untrained; the oracle then recovers from the state it left: a recovery demonstration,
      which teaches what to do after a mistake. A callable gets the first screenshot's
      (width, height) and returns the action (so a random click lands on the screen the env
      really has, whatever its size).
    detour_only: the episode ends after the detour (no recovery): a scripted failed attempt,
      whose final screen and checker report are SDPO-style feedback for SFT
      (`AgentLoop.failed_attempts`).
    """

    shaped_reward = False

    def __init__(
        self,
        fmt: A.ActionFormat,
        tokenizer: Any,
        detour: Detour | None = None,
        *,
        detour_only: bool = False,
    ):
        if detour_only and detour is None:
            raise ValueError("detour_only needs a detour")
        self.fmt = fmt
        self.tokenizer = tokenizer
        self.detour = detour
        self.detour_only = detour_only

    async def act(self, ctx: TurnContext) -> Reply | Stop:
        if self.detour_only and ctx.turn > 0:
            return Stop()
        scripted = self.detour is not None and ctx.turn == 0
        if scripted:
            if callable(self.detour):
                h, w = ctx.screenshot.shape[:2]
                action = self.detour(w, h)
            else:
                action = self.detour
        else:  # a fixed oracle sequence starts over after the detour
            action = await oracle_next(ctx.env, ctx.task, ctx.turn - (self.detour is not None))
        if action is None:
            return Stop()
        try:
            text = self.fmt.format(action, ctx.space)
        except ValueError as e:  # the format cannot express this oracle action
            return Stop(f"oracle_unformattable: {e}")
        ids = [*self.tokenizer.encode(text), self.tokenizer.im_end_id]
        return Reply(ids, np.zeros(len(ids), np.float32), trained=not scripted)

    def finish(self) -> int:
        return 0


async def oracle_next(env: Any, task: Task, step: int) -> A.Action | None:
    """The oracle's action for this step: from the live page (`env.oracle_next()`, which looks
    at the current state) or from the task's fixed sequence; None when the sequence is over."""
    fn = getattr(env, "oracle_next", None)
    if fn is not None:
        return await fn()
    if task.oracle is not None:
        return task.oracle[step] if step < len(task.oracle) else None
    raise ValueError(f"task {task.id} has no oracle; SFT from oracles needs tasks that have one")


@dataclasses.dataclass(frozen=True)
class ScreenFractionClick:
    """A left click at a fixed fraction (fx, fy) of whatever screen the episode has: called with
    the first screenshot's (width, height), it returns ``Click(int(fx * w), int(fy * h))``."""

    fx: float
    fy: float

    def __call__(self, w: int, h: int) -> A.Click:
        return A.Click(float(int(self.fx * w)), float(int(self.fy * h)))


def recovery_detours(n: int, *, share: float, seed: int) -> list[ScreenFractionClick | None]:
    """Detours for `n` demonstrations: round(`share` * n) of them, chosen at random, start with
    a click at a uniformly random point of the screen (a miss, mostly), the rest are None (the
    oracle from the first turn). The point is a screen fraction placed on the size the
    episode's first screenshot has, so it lands on a VM's 1920x1080 screen as well as on the
    browser's viewport. The same (n, share, seed) give the same detours.
    """
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"recovery share={share} must be in [0, 1]")
    rng = np.random.default_rng(seed)
    k = round(share * n)
    which = set(rng.choice(n, size=k, replace=False).tolist()) if k else set()
    fractions = rng.random((n, 2))
    return [
        ScreenFractionClick(float(fractions[i, 0]), float(fractions[i, 1])) if i in which else None
        for i in range(n)
    ]
