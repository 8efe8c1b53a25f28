"""The agent loop: episodes of a policy in an environment, recorded as `Trajectory`s.

Each turn renders the conversation, asks the sampler for a continuation, parses the action and
steps the env:

    system: the action tool's schema (from cua_jax.actions)
    user:   [screenshot_0] instruction
    assistant: <tool_call>{...}</tool_call>            <- sampled tokens, kept as ids
    user:   feedback_1 [screenshot_1]
    assistant: ...

Token ids are never re-tokenized: the transcript is built with `ChatRenderer.extend` /
`append_generated`, so turn k+1's prompt starts with turn k's prompt + generated ids and the
sampler reuses its KV cache (`session_id`). Only the last `max_history_images` screenshots stay
in the prompt (older ones become a short text); the instruction always stays. When a screenshot
is dropped the prompt no longer extends the previous sequence, the turn is recorded with
`extends_previous=False`, and the sampler recomputes.

A model output that does not parse is not an error: the env receives the `InvalidAction`, answers
with feedback, and the episode goes on (it counts towards `invalid_actions`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from cua_jax import actions as A
from cua_jax.env_api import INFO_ERROR, INFO_INVALID_ACTION, Env, EnvError, Task
from cua_jax.rl.trajectory import Trajectory, Turn

OMITTED_SCREENSHOT = "(an earlier screenshot, omitted)"


class EnvPool(Protocol):
    """What the loop needs from an env pool (envs.browser.BrowserPool, envs.vm pools)."""

    def acquire(self) -> contextlib.AbstractAsyncContextManager[Env]: ...

    def __len__(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
    """How episodes are run (typed; train.py fills it from the config)."""

    max_turns: int = 5
    max_history_images: int = 2
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    action_format: str = "qwen3vl"
    success_threshold: float = 1.0  # a task score >= this counts as success
    # Subtracted from the reward once per invalid action (unparseable or impossible model
    # output); the success flag and eval metrics still use the task's own score. With a binary
    # score, groups whose rollouts all fail still rank each other by how well-formed they were.
    invalid_action_penalty: float = 0.0
    # "tools": the format's full tool schema (what the real Qwen-VL checkpoints were trained on);
    # "compact": one short paragraph, for tiny models trained from scratch (smoke runs), where
    # a ~1500-token schema would be most of every sequence.
    system_prompt: str = "tools"
    # Never sampled: the vision placeholder tokens (`QwenVLConfig.vision_placeholder_ids`); the
    # learner masks the same ids so its log-probs are of the same policy.
    banned_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.system_prompt not in ("tools", "compact"):
            raise ValueError(f"system_prompt={self.system_prompt!r}: use 'tools' or 'compact'")
        if self.invalid_action_penalty < 0:
            raise ValueError(
                f"invalid_action_penalty={self.invalid_action_penalty} must be >= 0 (it is "
                "subtracted from the reward)"
            )


RewardFn = Callable[[Trajectory, float, RolloutSettings], float]
"""(the finished episode, the task's score from ``env.evaluate()``, settings) -> RL reward.

Called once per episode after the env scored it; ``traj.turns`` holds the parsed actions
(``Turn.action``) and ``traj.timings["invalid_actions"]`` the number of invalid ones. Pass one
as ``AgentLoop(..., reward_fn=...)``; eval and ``Trajectory.success`` use the score itself."""


def default_reward(traj: Trajectory, score: float, settings: RolloutSettings) -> float:
    """The task's score, minus ``settings.invalid_action_penalty`` per invalid action."""
    invalid = traj.timings.get("invalid_actions", 0.0)
    return float(score) - settings.invalid_action_penalty * float(invalid)


COMPACT_SYSTEM_PROMPT = (
    "You operate a computer through the computer_use tool. Look at the screenshot and reply with "
    'one call: <tool_call>{{"name": "computer_use", "arguments": {{"action": ..., ...}}}}'
    "</tool_call>. Actions: left_click, double_click, right_click, mouse_move, left_click_drag, "
    "type, key, scroll, wait, terminate. Coordinates are {coords}."
)


def episode_seed(*parts: Any) -> int:
    """A stable 31-bit seed from any parts (step, task, member, turn): resumable sampling."""
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF


@dataclasses.dataclass
class _TurnRecord:
    feedback: str  # user text shown before this turn's screenshot ("" for the first turn)
    pixel_values: np.ndarray  # f32[N, D] of this turn's screenshot
    grid: np.ndarray  # i32[1, 3]
    generated: list[int] | None = None  # the policy's ids for this turn, once sampled


class AgentLoop:
    """Runs episodes with a sampler `engine` (cua_jax.sampler.Engine) and a `processor`.

    Args:
      engine: has `async generate(prompt_ids, pixel_values, image_grid_thw, params, session_id)`
        and `version`.
      processor: a `cua_jax.data.processor.QwenVLProcessor` (tokenizer, image settings, chat).
      settings: `RolloutSettings`.
      reward_fn: the RL reward of a finished episode from its task score (`RewardFn`);
        `default_reward` subtracts `settings.invalid_action_penalty` per invalid action.
      sampling_params: `cua_jax.sampler.SamplingParams` class (injected to keep this module free
        of the sampler import at definition time).
    """

    def __init__(
        self,
        engine: Any,
        processor: Any,
        settings: RolloutSettings,
        reward_fn: RewardFn = default_reward,
    ):
        from cua_jax.sampler import SamplingParams

        self.engine = engine
        self.processor = processor
        self.settings = settings
        self.reward_fn = reward_fn
        self.fmt = A.get_format(settings.action_format)
        self.tokenizer = processor.tokenizer
        self.chat = processor.chat
        self._SamplingParams = SamplingParams
        self._episodes = 0

    # ---- transcript ----------------------------------------------------------------------------

    def space_for(self, screenshot: np.ndarray) -> A.CoordinateSpace:
        """The model<->screen coordinate mapping for this screenshot (one place: actions.py)."""
        from cua_jax.data.image import smart_resize

        h, w = screenshot.shape[:2]
        cfg = self.processor.image_config
        rh, rw = smart_resize(h, w, cfg.factor, cfg.min_pixels, cfg.max_pixels)
        return self.fmt.default_space(w, h, rw, rh)

    def render(self, instruction: str, system: str, records: Sequence[_TurnRecord]):
        """(rendered chat, pixel_values, grids) for the turns in `records` + a generation prompt.

        The last record has no generated ids yet: the prompt ends with the assistant header.
        """
        n = len(records)
        keep = set(range(max(0, n - self.settings.max_history_images), n))
        rendered = None
        pix, grids = [], []
        for k, rec in enumerate(records):
            if k in keep:
                image_items = [{"type": "image"}]
                pix.append(rec.pixel_values)
                grids.append(rec.grid)
                kgrid = rec.grid
            else:
                image_items = [{"type": "text", "text": OMITTED_SCREENSHOT}]
                kgrid = np.zeros((0, 3), np.int32)
            if k == 0:
                content = [*image_items, {"type": "text", "text": instruction}]
                msgs = [
                    {"role": "system", "content": system},
                    {"role": "user", "content": content},
                ]
                rendered = self.chat.render(msgs, kgrid, add_generation_prompt=True)
            else:
                rendered = self.chat.append_generated(rendered, records[k - 1].generated)
                content = [{"type": "text", "text": rec.feedback}, *image_items]
                rendered = self.chat.extend(
                    rendered, [{"role": "user", "content": content}], kgrid, True
                )
        pv = np.concatenate(pix) if pix else None
        grid = np.concatenate(grids).astype(np.int32) if grids else None
        return rendered, pv, grid

    def system_prompt(self, space: A.CoordinateSpace) -> str:
        if self.settings.system_prompt == "tools" or not isinstance(self.fmt, A.QwenComputerUse):
            return self.fmt.system_prompt(space)
        coords = (
            "0-1000 relative to the screen"
            if self.fmt.version == "3"
            else f"pixels of a {space.model_w:.0f}x{space.model_h:.0f} screen"
        )
        return COMPACT_SYSTEM_PROMPT.format(coords=coords)

    def feedback_for(self, results: Sequence[Any]) -> str:
        """The user text after a step: what went wrong, or a neutral continuation."""
        for res in results:
            reason = res.info.get(INFO_INVALID_ACTION)
            if reason:
                return f"Your last action was invalid: {reason}. Output one tool call."
        return "Here is the screen after your action."

    # ---- one episode ---------------------------------------------------------------------------

    async def run_episode(
        self,
        env: Env,
        task: Task,
        *,
        seed: int,
        group_id: str = "",
        greedy: bool = False,
        oracle: bool = False,
        detour: A.Action | Callable[[int, int], A.Action] | None = None,
        screens: list[np.ndarray] | None = None,
    ) -> Trajectory:
        """Plays `task` to the end and returns its trajectory (never raises for env faults).

        seed: the sampling seed of the first turn (turn k uses a seed derived from it).
        oracle: the actions come from the task's oracle instead of the sampler, written as the
          model would write them (its token ids, log-probs 0): SFT demonstrations.
        detour: with `oracle`, the first turn plays this action instead (say, a click that
          misses) and is marked untrained; the oracle then recovers from the state it left: a
          recovery demonstration, which teaches what to do after a mistake. A callable gets
          the first screenshot's (width, height) and returns the action (so a random click
          lands on the screen the env really has, whatever its size).
        screens: when a list is given, the screenshot each turn saw is appended to it (for the
          episode viewer, `cua_jax.viz`); `Turn.action` holds the parsed actions in screen pixels.
        """
        t_start = time.perf_counter()
        timings = {"generate": 0.0, "env": 0.0}
        self._episodes += 1
        session = f"{group_id}/{seed}/{self._episodes}"
        traj = Trajectory(task_id=task.id, group_id=group_id, turns=[])
        # The oldest weights that produced any token (from the sampler's outputs: a weight update
        # handed to the engine is applied at its next scheduling step, not at once).
        versions: list[int] = []
        try:
            obs = await env.reset(task, seed=task.seed)
        except EnvError as e:
            traj.failure_reason = f"env_error: reset: {e}"
            traj.timings = {"total": time.perf_counter() - t_start}
            return traj
        instruction = obs.instruction or task.instruction
        space = self.space_for(obs.screenshot)
        system = self.system_prompt(space)
        records: list[_TurnRecord] = []
        prev_full: np.ndarray | None = None
        prev_images = 0
        invalid = 0
        done = False
        feedback = ""
        # The task's own step budget, within the trainer's cap on turns.
        for turn in range(min(self.settings.max_turns, task.max_steps)):
            scripted = oracle and detour is not None and turn == 0  # a recovery demo's miss
            if screens is not None:
                screens.append(obs.screenshot)
            images = self.processor.preprocess_images([obs.screenshot])
            records.append(_TurnRecord(feedback, images["pixel_values"], images["image_grid_thw"]))
            rendered, pv, grid = self.render(instruction, system, records)
            prompt = rendered.input_ids
            extends = prev_full is not None and (
                prompt.size >= prev_full.size
                and np.array_equal(prompt[: prev_full.size], prev_full)
            )
            n_img = 0 if grid is None else len(grid)
            if extends:  # only the images after the previous sequence are new
                new_pv = None if n_img == prev_images else _tail_images(pv, grid, prev_images)
                new_grid = None if n_img == prev_images else grid[prev_images:]
            else:
                new_pv, new_grid = pv, grid
            t0 = time.perf_counter()
            if not oracle:
                params = self._SamplingParams(
                    temperature=0.0 if greedy else self.settings.temperature,
                    top_p=1.0 if greedy else self.settings.top_p,
                    seed=episode_seed(seed, turn),
                    max_new_tokens=self.settings.max_new_tokens,
                    stop_token_ids=tuple(self.tokenizer.stop_ids),
                    banned_token_ids=self.settings.banned_token_ids,
                )
                out = await self.engine.generate(
                    prompt, pv, grid, params=params, session_id=session
                )
                if out.finish_reason == "error":
                    traj.failure_reason = f"sampler_error: {getattr(out, 'error', '')}"
                    break
                gen_ids = [int(t) for t in out.tokens]
                logprobs = np.asarray(out.logprobs, np.float32)
                versions.append(int(out.version))
            else:
                # A fixed oracle sequence starts over after the detour.
                step = turn - (detour is not None)
                if scripted and callable(detour):
                    h, w = obs.screenshot.shape[:2]
                    action = detour(w, h)
                else:
                    action = detour if scripted else await _oracle_next(env, task, step)
                if action is None:
                    records.pop()
                    break
                try:
                    text = self.fmt.format(action, space)
                except ValueError as e:  # the format cannot express this oracle action
                    traj.failure_reason = f"oracle_unformattable: {e}"
                    records.pop()
                    break
                gen_ids = [*self.tokenizer.encode(text), self.tokenizer.im_end_id]
                logprobs = np.zeros(len(gen_ids), np.float32)
            timings["generate"] += time.perf_counter() - t0
            records[-1].generated = gen_ids
            text = self.tokenizer.decode(gen_ids)
            acts = self.fmt.parse(text, space)
            t0 = time.perf_counter()
            results = []
            for act in acts:
                res = await env.step(act)
                results.append(res)
                if isinstance(act, A.InvalidAction):
                    invalid += 1
                if res.done:
                    done = True
                    if res.info.get(INFO_ERROR):
                        traj.failure_reason = f"env_error: {res.info[INFO_ERROR]}"
                    break
            timings["env"] += time.perf_counter() - t0
            feedback = self.feedback_for(results)
            traj.turns.append(
                Turn(
                    prompt_ids=prompt,
                    generated_ids=np.asarray(gen_ids, np.int32),
                    logprobs=logprobs,
                    pixel_values=new_pv,
                    image_grid_thw=new_grid,
                    extends_previous=bool(extends),
                    action=acts,
                    feedback=feedback,
                    trained=not scripted,
                )
            )
            prev_full = np.concatenate([prompt, np.asarray(gen_ids, np.int32)])
            prev_images = n_img
            obs = results[-1].observation if results else obs
            if done:
                break
        else:
            traj.failure_reason = traj.failure_reason or "max_turns"
        if versions:
            traj.policy_version = min(versions)
        elif not oracle:
            traj.policy_version = int(getattr(self.engine, "version", 0))
        drop = getattr(self.engine, "drop_session", None)
        if drop is not None and not oracle:
            drop(session)
        t0 = time.perf_counter()
        if traj.failure_reason and traj.failure_reason.startswith("env_error"):
            score = 0.0
        else:
            try:
                score = float(await env.evaluate())
            except Exception as e:  # noqa: BLE001 -- a broken checker fails this episode only
                traj.failure_reason = f"evaluate_error: {type(e).__name__}: {e}"
                score = 0.0
        timings["evaluate"] = time.perf_counter() - t0
        timings["total"] = time.perf_counter() - t_start
        timings["invalid_actions"] = float(invalid)
        traj.timings = timings
        traj.score = score
        traj.success = score >= self.settings.success_threshold
        # Oracle demonstrations and greedy eval report the score itself.
        shaped = not (oracle or greedy)
        traj.reward = float(self.reward_fn(traj, score, self.settings)) if shaped else score
        return traj

    # ---- many episodes -------------------------------------------------------------------------

    async def run_group(
        self,
        pool: EnvPool,
        task: Task,
        group_size: int,
        *,
        seed: int,
        group_id: str,
        screens: list[list[np.ndarray]] | None = None,
    ) -> list[Trajectory]:
        """`group_size` episodes of one task (a GRPO group), concurrently.

        screens: when given, one list of screenshots per member is appended (episode viewer).
        """
        per_member = [[] for _ in range(group_size)] if screens is not None else None
        if screens is not None:
            screens.extend(per_member)

        async def one(member: int) -> Trajectory:
            async with pool.acquire() as env:
                return await self.run_episode(
                    env,
                    task,
                    seed=episode_seed(seed, member),
                    group_id=group_id,
                    screens=None if per_member is None else per_member[member],
                )

        return list(await asyncio.gather(*(one(m) for m in range(group_size))))

    async def evaluate(
        self,
        pool: EnvPool,
        tasks: Sequence[Task],
        *,
        seed: int = 0,
        screens: list[list[np.ndarray]] | None = None,
        on_episode: Callable[[Trajectory], None] | None = None,
    ) -> list[Trajectory]:
        """Greedy episodes of every task; returns their trajectories (in task order).

        on_episode: called with each trajectory as it finishes (progress bars)."""
        per_task = [[] for _ in tasks] if screens is not None else None
        if screens is not None:
            screens.extend(per_task)

        async def one(i: int, task: Task) -> Trajectory:
            async with pool.acquire() as env:
                traj = await self.run_episode(
                    env,
                    task,
                    seed=episode_seed(seed, i),
                    group_id=f"eval/{i}",
                    greedy=True,
                    screens=None if per_task is None else per_task[i],
                )
            if on_episode is not None:
                on_episode(traj)
            return traj

        return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))))

    async def demonstrations(
        self,
        pool: EnvPool,
        tasks: Sequence[Task],
        detours: Sequence[A.Action | Callable[[int, int], A.Action] | None] | None = None,
    ) -> list[Trajectory]:
        """Oracle episodes (SFT data): the env's scripted solution, in the model's format.
        `detours[i]`, when given and not None, makes episode i a recovery demonstration (see
        `run_episode`)."""
        detours = list(detours) if detours is not None else [None] * len(tasks)
        if len(detours) != len(tasks):
            raise ValueError(f"{len(detours)} detours for {len(tasks)} tasks")

        async def one(i: int, task: Task) -> Trajectory:
            async with pool.acquire() as env:
                return await self.run_episode(
                    env, task, seed=i, group_id=f"demo/{i}", oracle=True, detour=detours[i]
                )

        return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))))


async def _oracle_next(env: Any, task: Task, turn: int) -> A.Action | None:
    """The oracle's action for this turn: from the live page (`env.oracle_next()`, which looks
    at the current state) or from the task's fixed sequence; None when the sequence is over."""
    fn = getattr(env, "oracle_next", None)
    if fn is not None:
        return await fn()
    if task.oracle is not None:
        return task.oracle[turn] if turn < len(task.oracle) else None
    raise ValueError(f"task {task.id} has no oracle; SFT from oracles needs tasks that have one")


def _tail_images(pv: np.ndarray, grid: np.ndarray, skip: int) -> np.ndarray:
    """The pixel rows of the images after the first `skip` images."""
    rows = int(np.prod(grid[:skip], axis=1).sum()) if skip else 0
    return pv[rows:]
