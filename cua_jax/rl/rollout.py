"""The agent loop: episodes of a policy in an environment, recorded as `Trajectory`s.

Each turn renders the conversation, asks the episode's policy for a continuation (the sampler,
or the env's oracle for demonstrations: `cua_jax.rl.policies`), parses the action and steps the
env:

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
with feedback, and the episode goes on (it counts towards `invalid_actions`). Faults of the
infrastructure (the env, the sampler, the task's checker) end the episode without raising and
mark it `Trajectory.infra_fault`, so it is neither trained on nor counted as a failure. A
training episode the env side ended (a dead host, a crashed browser or VM: `env_error`,
`evaluate_error`) is played again on an env from another host (`RolloutSettings.env_retries`
times at most; a fleet's `acquire(avoid=host)`), so a group is not lost to one dead browser; the
attempts are counted (`AgentLoop.env_retries`, `Trajectory.timings["env_attempts"]`), and an
episode still faulted after the last one is returned as the fault it is, never as a failure.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import numpy as np

from cua_jax import actions as A
from cua_jax.data.image import smart_resize
from cua_jax.env_api import (
    INFO_ERROR,
    INFO_INVALID_ACTION,
    CheckerReport,
    Env,
    EnvError,
    Task,
)
from cua_jax.rl.policies import (
    Detour,
    OraclePolicy,
    Policy,
    SamplerPolicy,
    Stop,
    TurnContext,
)
from cua_jax.rl.trajectory import Trajectory, Turn
from cua_jax.sampler.scheduler import image_digest

OMITTED_SCREENSHOT = "(an earlier screenshot, omitted)"


class EnvPool(Protocol):
    """What the loop needs from an env pool (envs.browser.BrowserPool, envs.vm pools). A pool
    that spreads envs over hosts (envs.fleet) also has `host_of(env)` and takes
    `acquire(avoid=host)`, so a retry goes to another host."""

    def acquire(self) -> contextlib.AbstractAsyncContextManager[Env]: ...

    def __len__(self) -> int: ...


def _acquire(pool: EnvPool, avoid: str | None) -> contextlib.AbstractAsyncContextManager[Env]:
    if avoid is not None and callable(getattr(pool, "host_of", None)):
        return pool.acquire(avoid=avoid)  # type: ignore[call-arg]
    return pool.acquire()


def _host_of(pool: EnvPool, env: Env) -> str | None:
    host_of = getattr(pool, "host_of", None)
    return host_of(env) if callable(host_of) else None


def env_side_fault(traj: Trajectory) -> bool:
    """The env side ended the episode (`env_error`, `evaluate_error`: a dead host, a crashed
    browser or VM), not the sampler: playing it again elsewhere can succeed."""
    return (traj.failure_reason or "").startswith(("env_error", "evaluate_error"))


log = logging.getLogger(__name__)


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
    # Decode every turn within the action format's grammar (`Engine(grammar=)`, built from
    # `action_format`'s `action_regex`): each reply is one well-formed tool call, so RL's signal
    # is the pick, not the syntax. Turns of tasks that allow API actions are not constrained
    # (the grammar holds computer_use actions only).
    constrain_actions: bool = False
    # Never sampled: the vision placeholder tokens (`QwenVLConfig.vision_placeholder_ids`); the
    # learner masks the same ids so its log-probs are of the same policy.
    banned_token_ids: tuple[int, ...] = ()
    # Dense shaping (off at 0): a failed episode's reward gains closeness_reward x the checker's
    # closeness in [0, 1] (`CheckerReport.closeness`: how near its clicks came to the task's
    # targets), so groups whose rollouts all fail still rank each other by how close they came.
    # Successes keep their score; eval and `Trajectory.success` use the score itself.
    closeness_reward: float = 0.0
    # Keep the screen after a failed episode's last action (`Trajectory.final_screen`), for
    # SDPO's final_screenshot feedback; one more preprocessed image per failed episode.
    keep_final_screen: bool = False
    # Threads that preprocess each turn's screenshot and render its prompt (numpy and the
    # tokenizer, milliseconds a turn), off the event loop so that hundreds of episodes' HTTP and
    # sampler calls are not held up behind it (tools/bench_fleet.py); 0: on the event loop.
    prompt_threads: int = 1
    # A training episode the env side ended (`env_side_fault`) is played again on an env from
    # another host, at most this many times; then it is returned as an infrastructure fault.
    env_retries: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.prompt_threads, int) or self.prompt_threads < 0:
            raise ValueError(f"prompt_threads={self.prompt_threads!r} must be an integer >= 0")
        if not isinstance(self.env_retries, int) or self.env_retries < 0:
            raise ValueError(f"env_retries={self.env_retries!r} must be an integer >= 0")
        if self.system_prompt not in ("tools", "compact"):
            raise ValueError(f"system_prompt={self.system_prompt!r}: use 'tools' or 'compact'")
        if self.invalid_action_penalty < 0:
            raise ValueError(
                f"invalid_action_penalty={self.invalid_action_penalty} must be >= 0 (it is "
                "subtracted from the reward)"
            )
        if not 0 <= self.closeness_reward < self.success_threshold:
            raise ValueError(
                f"closeness_reward={self.closeness_reward} must be in [0, success_threshold="
                f"{self.success_threshold}): a failed episode must never earn a success's reward"
            )


RewardFn = Callable[[Trajectory, float, RolloutSettings], float]
"""(the finished episode, the task's score from ``env.evaluate()``, settings) -> RL reward.

Called once per episode after the env scored it; ``traj.turns`` holds the parsed actions
(``Turn.action``) and ``traj.timings["invalid_actions"]`` the number of invalid ones. Pass one
as ``AgentLoop(..., reward_fn=...)``; eval and ``Trajectory.success`` use the score itself."""


def default_reward(traj: Trajectory, score: float, settings: RolloutSettings) -> float:
    """The task's score, minus ``settings.invalid_action_penalty`` per invalid action; a failed
    episode whose checker reported a closeness gains ``settings.closeness_reward`` x it."""
    invalid = traj.timings.get("invalid_actions", 0.0)
    reward = float(score) - settings.invalid_action_penalty * float(invalid)
    report = traj.checker_report
    if not traj.success and report is not None and report.closeness is not None:
        reward += settings.closeness_reward * float(report.closeness)
    return reward


COMPACT_SYSTEM_PROMPT = (
    "You operate a computer through the computer_use tool. Look at the screenshot and reply with "
    'one call: <tool_call>{{"name": "computer_use", "arguments": {{"action": ..., ...}}}}'
    "</tool_call>. Actions: left_click, double_click, right_click, mouse_move, left_click_drag, "
    "type, key, scroll, wait, terminate. Coordinates are {coords}."
)
# Qwen3.5's XML call syntax (action format "qwen35")
COMPACT_SYSTEM_PROMPT_XML = COMPACT_SYSTEM_PROMPT.replace(
    '<tool_call>{{"name": "computer_use", "arguments": {{"action": ..., ...}}}}</tool_call>',
    "<tool_call><function=computer_use><parameter=action>...</parameter>...</function></tool_call>",
)
COMPACT_API_LINE = (
    " This task also allows these tools, called the same way with their own name and string "
    "arguments: {tools}."
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
    digest: bytes = b""  # image_digest(pixel_values, grid): the sampler's key for the screen
    generated: list[int] | None = None  # the policy's ids for this turn, once it replied


def render_transcript(
    chat: Any,
    instruction: str,
    system: str,
    records: Sequence[_TurnRecord],
    max_history_images: int,
) -> tuple[Any, np.ndarray | None, np.ndarray | None]:
    """(rendered chat, pixel_values, grids) for the turns in `records` + a generation prompt.

    The last record has no generated ids yet: the prompt ends with the assistant header. Only
    the last `max_history_images` screenshots are images; older ones become a short text.
    """
    n = len(records)
    first_kept = max(0, n - max_history_images)
    rendered = None
    for k in range(n):
        rendered = _render_turn(chat, rendered, instruction, system, records, k, k >= first_kept)
    kept = records[first_kept:]
    pv = np.concatenate([r.pixel_values for r in kept]) if kept else None
    grid = np.concatenate([r.grid for r in kept]).astype(np.int32) if kept else None
    return rendered, pv, grid


def _render_turn(
    chat: Any,
    rendered: Any,
    instruction: str,
    system: str,
    records: Sequence[_TurnRecord],
    k: int,
    image: bool,
) -> Any:
    """`rendered` (the turns before k, ending in a generation prompt; None for k = 0) with turn
    k's reply to it closed and turn k's user message and generation prompt appended; turn k's
    screenshot is an image if `image`, else a short text."""
    rec = records[k]
    if image:
        image_items: list[dict[str, str]] = [{"type": "image"}]
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
        return chat.render(msgs, kgrid, add_generation_prompt=True)
    rendered = chat.append_generated(rendered, records[k - 1].generated)
    content = [{"type": "text", "text": rec.feedback}, *image_items]
    return chat.extend(rendered, [{"role": "user", "content": content}], kgrid, True)


@dataclasses.dataclass
class _Prompt:
    """One turn's prompt and what in it is new since the previous turn's full sequence."""

    ids: np.ndarray  # i32[P]
    pixel_values: np.ndarray | None  # every image of the prompt
    grid: np.ndarray | None  # i32[I, 3]
    extends: bool  # ids start with the previous turn's prompt + generated ids
    new_pixel_values: np.ndarray | None  # the images the sampler has not seen (Turn fields)
    new_grid: np.ndarray | None
    rendered: Any  # the chat rendering `ids` come from (the next turn goes on from it)
    image_hashes: list[bytes] = dataclasses.field(default_factory=list)  # one a kept image


class _Transcript:
    """The conversation of one episode as token ids, one turn at a time: `prompt(feedback,
    screenshot)` renders the next turn's prompt, `reply(ids)` appends the policy's ids."""

    def __init__(self, processor: Any, instruction: str, system: str, max_history_images: int):
        self.processor = processor
        self.instruction = instruction
        self.system = system
        self.max_history_images = max_history_images
        self.records: list[_TurnRecord] = []
        self.prev_full: np.ndarray | None = None  # i32[P + G] of the previous turn
        self.prev_images = 0
        self.last: _Prompt | None = None

    def prompt(self, feedback: str, screenshot: np.ndarray) -> _Prompt:
        images = self.processor.preprocess_images([screenshot])
        pv1, grid1 = images["pixel_values"], images["image_grid_thw"]
        # Hashed here, once, off the loop: the sampler would hash every kept screen each turn.
        rec = _TurnRecord(feedback, pv1, grid1, image_digest(pv1, grid1[0]))
        self.records.append(rec)
        chat, n = self.processor.chat, len(self.records)
        if self.last is not None and n <= self.max_history_images:
            # No screenshot leaves the window: the previous prompt's rendering goes on (what
            # render_transcript would redo from the first turn, a Python-bound ~1 ms a turn).
            args = (self.instruction, self.system, self.records, n - 1, True)
            rendered = _render_turn(chat, self.last.rendered, *args)
            pv = np.concatenate([self.last.pixel_values, rec.pixel_values])
            grid = np.concatenate([self.last.grid, rec.grid]).astype(np.int32)
            hashes = [*self.last.image_hashes, rec.digest]
        else:
            rendered, pv, grid = render_transcript(
                chat, self.instruction, self.system, self.records, self.max_history_images
            )
            kept = self.records[max(0, n - self.max_history_images) :]
            hashes = [r.digest for r in kept]
        ids = rendered.input_ids
        prev = self.prev_full
        extends = prev is not None and (
            ids.size >= prev.size and np.array_equal(ids[: prev.size], prev)
        )
        n_img = 0 if grid is None else len(grid)
        if not extends:
            new_pv, new_grid = pv, grid
        elif n_img == self.prev_images:  # only the images after the previous sequence are new
            new_pv = new_grid = None
        elif n_img == self.prev_images + 1:  # the usual turn: this screenshot alone is new
            new_pv, new_grid = self.records[-1].pixel_values, grid[self.prev_images :]
        else:  # a copy, not a view that would keep the whole prompt's pixels alive
            new_pv = np.ascontiguousarray(_tail_images(pv, grid, self.prev_images))
            new_grid = grid[self.prev_images :]
        self.last = _Prompt(ids, pv, grid, bool(extends), new_pv, new_grid, rendered, hashes)
        return self.last

    def reply(self, generated_ids: list[int]) -> None:
        self.records[-1].generated = generated_ids
        self.prev_full = np.concatenate([self.last.ids, np.asarray(generated_ids, np.int32)])
        self.prev_images = 0 if self.last.grid is None else len(self.last.grid)


def _fault(where: str, e: Exception) -> str:
    """The failure_reason of an env call that raised (an infrastructure fault)."""
    if isinstance(e, EnvError):
        return f"env_error: {where}: {e}"
    return f"env_error: {where}: {type(e).__name__}: {e}"


class AgentLoop:
    """Runs episodes with a sampler `engine` (cua_jax.sampler.Engine) and a `processor`.

    The loop itself (`play`) only resets and steps the env, keeps the transcript, records the
    turns and scores the episode; what is written each turn comes from a per-episode
    `cua_jax.rl.policies.Policy` (`SamplerPolicy` for sampled and greedy episodes,
    `OraclePolicy` for demonstrations). `run_episode` picks the policy from its flags.

    Args:
      engine: has `async generate(prompt_ids, pixel_values, image_grid_thw, params, session_id)`
        and `version`.
      processor: a `cua_jax.data.processor.QwenVLProcessor` (tokenizer, image settings, chat).
      settings: `RolloutSettings`.
      reward_fn: the RL reward of a finished episode from its task score (`RewardFn`);
        `default_reward` subtracts `settings.invalid_action_penalty` per invalid action.
    """

    def __init__(
        self,
        engine: Any,
        processor: Any,
        settings: RolloutSettings,
        reward_fn: RewardFn = default_reward,
    ):
        self.engine = engine
        self.processor = processor
        self.settings = settings
        self.reward_fn = reward_fn
        self.fmt = A.get_format(settings.action_format)
        if settings.constrain_actions and getattr(engine, "grammar", False) is None:
            raise ValueError(
                "constrain_actions=True needs an engine built with the action format's grammar "
                "(Engine(grammar=grammar.action_automaton(tokenizer, format)))"
            )
        self.tokenizer = processor.tokenizer
        self.chat = processor.chat
        self._episodes = 0
        self.env_retries = 0  # training episodes played again after an env-side fault
        self._prompt_pool: concurrent.futures.ThreadPoolExecutor | None = None

    # ---- transcript ----------------------------------------------------------------------------

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the prompt threads (`settings.prompt_threads`; 0: here)."""
        if self.settings.prompt_threads == 0:
            return fn(*args)
        if self._prompt_pool is None:
            self._prompt_pool = concurrent.futures.ThreadPoolExecutor(
                self.settings.prompt_threads, thread_name_prefix="cua-prompt"
            )
        return await asyncio.get_running_loop().run_in_executor(self._prompt_pool, fn, *args)

    def space_for(self, screenshot: np.ndarray) -> A.CoordinateSpace:
        """The model<->screen coordinate mapping for this screenshot (one place: actions.py)."""

        h, w = screenshot.shape[:2]
        cfg = self.processor.image_config
        rh, rw = smart_resize(h, w, cfg.factor, cfg.min_pixels, cfg.max_pixels)
        return self.fmt.default_space(w, h, rw, rh)

    def render(self, instruction: str, system: str, records: Sequence[_TurnRecord]):
        """(rendered chat, pixel_values, grids) for the turns in `records` + a generation prompt
        (`render_transcript` with this loop's history window)."""
        return render_transcript(
            self.chat, instruction, system, records, self.settings.max_history_images
        )

    def system_prompt(self, space: A.CoordinateSpace, api_actions: Sequence[str] = ()) -> str:
        """The action schema for the prompt; the task's allowed API actions (`Task.api_actions`)
        are listed too, as tools of their own."""
        if self.settings.system_prompt == "tools" or not isinstance(self.fmt, A.QwenComputerUse):
            return self.fmt.system_prompt(space, api_actions)
        coords = (
            "0-1000 relative to the screen"
            if self.fmt.version == "3"
            else f"pixels of a {space.model_w:.0f}x{space.model_h:.0f} screen"
        )
        xml = isinstance(self.fmt, A.Qwen35ComputerUse)
        text = (COMPACT_SYSTEM_PROMPT_XML if xml else COMPACT_SYSTEM_PROMPT).format(coords=coords)
        if api_actions:
            text += COMPACT_API_LINE.format(
                tools="; ".join(
                    f"{n}({', '.join(p for p, _ in A.API_TOOLS[n].params)})"
                    for n in A.check_api_names(api_actions)
                )
            )
        return text

    def feedback_for(self, results: Sequence[Any]) -> str:
        """The user text after a step: what went wrong, or a neutral continuation."""
        for res in results:
            reason = res.info.get(INFO_INVALID_ACTION)
            if reason:
                return f"Your last action was invalid: {reason}. Output one tool call."
        return "Here is the screen after your action."

    # ---- policies ------------------------------------------------------------------------------

    def sampler_policy(
        self, *, seed: int, session: str, greedy: bool = False, constrained: bool = False
    ) -> SamplerPolicy:
        """The model through `self.engine`: turn k is sampled with `episode_seed(seed, k)`,
        within the engine's grammar when `constrained`."""
        s = self.settings
        return SamplerPolicy(
            self.engine,
            stop_token_ids=self.tokenizer.stop_ids,
            seeds=lambda turn: episode_seed(seed, turn),
            session=session,
            temperature=s.temperature,
            top_p=s.top_p,
            max_new_tokens=s.max_new_tokens,
            banned_token_ids=s.banned_token_ids,
            greedy=greedy,
            constrained=constrained,
        )

    def oracle_policy(self, detour: Detour | None = None) -> OraclePolicy:
        """The env's oracle in this loop's action format (see `OraclePolicy`)."""
        return OraclePolicy(self.fmt, self.tokenizer, detour)

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
        detour: Detour | None = None,
        screens: list[np.ndarray] | None = None,
    ) -> Trajectory:
        """Plays `task` to the end and returns its trajectory (never raises for env faults).

        seed: the sampling seed of the first turn (turn k uses a seed derived from it).
        oracle: the actions come from the task's oracle instead of the sampler, written as the
          model would write them (its token ids, log-probs 0): SFT demonstrations.
        detour: with `oracle`, the first turn plays this action instead and is marked
          untrained: a recovery demonstration (see `cua_jax.rl.policies.OraclePolicy`).
        screens: when a list is given, the screenshot each turn saw is appended to it (for the
          episode viewer, `cua_jax.viz`); `Turn.action` holds the parsed actions in screen pixels.
        """
        self._episodes += 1
        if oracle:
            policy: Policy = self.oracle_policy(detour)
        else:
            session = f"{group_id}/{seed}/{self._episodes}"
            constrained = self.settings.constrain_actions and not task.api_actions
            policy = self.sampler_policy(
                seed=seed, session=session, greedy=greedy, constrained=constrained
            )
        return await self.play(env, task, policy, group_id=group_id, screens=screens)

    async def play(
        self,
        env: Env,
        task: Task,
        policy: Policy,
        *,
        group_id: str = "",
        screens: list[np.ndarray] | None = None,
        keep_final_screen: bool | None = None,
    ) -> Trajectory:
        """One episode of `policy` in `env`: reset, then per turn prompt -> `policy.act` ->
        parse -> `env.step`, until the env is done, the policy stops, or the turn budget
        (min(settings.max_turns, task.max_steps)) is spent; then `env.evaluate()` scores it.
        A failed episode keeps the screen after its last action (`Trajectory.final_screen`)
        when `keep_final_screen` says so (None: `settings.keep_final_screen`).

        Infrastructure faults never raise: an env that raises in reset or step, or ends a step
        with `info["error"]`, a sampler error, and a checker (`env.evaluate`) that raises each
        end the episode with a `failure_reason` that makes `Trajectory.infra_fault` True.
        """
        t_start = time.perf_counter()
        # Seconds of: the policy's turns, the env's steps, its reset, the prompts (screens into
        # rows and rendering, on the prompt threads, queueing included); and the checker's.
        timings = {"generate": 0.0, "env": 0.0, "reset": 0.0, "prompt": 0.0}
        traj = Trajectory(task_id=task.id, group_id=group_id, turns=[])
        try:
            obs = await env.reset(task, seed=task.seed)
            timings["reset"] = time.perf_counter() - t_start
        except Exception as e:  # noqa: BLE001 -- any env fault ends this episode only
            traj.failure_reason = _fault("reset", e)
            traj.timings = {"total": time.perf_counter() - t_start}
            return traj
        space = self.space_for(obs.screenshot)
        transcript = _Transcript(
            self.processor,
            obs.instruction or task.instruction,
            self.system_prompt(space, task.api_actions),
            self.settings.max_history_images,
        )
        invalid = 0
        feedback = ""
        # The task's own step budget, within the trainer's cap on turns.
        for turn in range(min(self.settings.max_turns, task.max_steps)):
            if screens is not None:
                screens.append(obs.screenshot)
            t0 = time.perf_counter()
            prompt = await self._off_loop(transcript.prompt, feedback, obs.screenshot)
            timings["prompt"] += time.perf_counter() - t0
            ctx = TurnContext(
                env=env,
                task=task,
                turn=turn,
                screenshot=obs.screenshot,
                space=space,
                prompt_ids=prompt.ids,
                pixel_values=prompt.pixel_values,
                image_grid_thw=prompt.grid,
                image_hashes=prompt.image_hashes,
            )
            t0 = time.perf_counter()
            reply = await policy.act(ctx)
            if isinstance(reply, Stop):
                traj.failure_reason = reply.failure_reason
                break
            timings["generate"] += time.perf_counter() - t0
            gen_ids = list(reply.generated_ids)
            transcript.reply(gen_ids)
            acts = self.fmt.parse(self.tokenizer.decode(gen_ids), space)
            t0 = time.perf_counter()
            results, n_invalid, done, fault = await _step_all(env, acts)
            timings["env"] += time.perf_counter() - t0
            invalid += n_invalid
            traj.failure_reason = fault or traj.failure_reason
            feedback = self.feedback_for(results)
            traj.turns.append(
                Turn(
                    prompt_ids=prompt.ids,
                    generated_ids=np.asarray(gen_ids, np.int32),
                    logprobs=reply.logprobs,
                    pixel_values=prompt.new_pixel_values,
                    image_grid_thw=prompt.new_grid,
                    extends_previous=prompt.extends,
                    action=acts,
                    feedback=feedback,
                    trained=reply.trained,
                    routes=reply.routes,
                )
            )
            obs = results[-1].observation if results else obs
            if done:
                break
        else:
            traj.failure_reason = traj.failure_reason or "max_turns"
        traj.policy_version = policy.finish()
        t0 = time.perf_counter()
        score = await _score(env, traj)
        timings["evaluate"] = time.perf_counter() - t0
        timings["total"] = time.perf_counter() - t_start
        timings["invalid_actions"] = float(invalid)
        traj.timings = timings
        traj.score = score
        traj.success = score >= self.settings.success_threshold
        if not traj.infra_fault:
            traj.checker_report = await _report(env, traj)
            if traj.checker_report is not None:
                traj.checker_message = traj.checker_report.message(space.to_model)
            if keep_final_screen is None:
                keep_final_screen = self.settings.keep_final_screen
            if keep_final_screen and not traj.success and traj.turns:
                images = self.processor.preprocess_images([obs.screenshot])
                traj.final_screen = (images["pixel_values"], images["image_grid_thw"])
        # Oracle demonstrations and greedy eval report the score itself.
        shaped = policy.shaped_reward
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
        """`group_size` episodes of one task (a GRPO group), concurrently. A member the env
        side ended (`env_side_fault`) is played again, on another host where the pool has
        hosts, up to `settings.env_retries` times (the module docstring).

        screens: when given, one list of screenshots per member is appended (episode viewer).
        """
        per_member = [[] for _ in range(group_size)] if screens is not None else None
        if screens is not None:
            screens.extend(per_member)

        async def one(member: int) -> Trajectory:
            avoid = None
            for attempt in range(self.settings.env_retries + 1):
                if per_member is not None:
                    per_member[member].clear()
                async with _acquire(pool, avoid) as env:
                    avoid = _host_of(pool, env)
                    traj = await self.run_episode(
                        env,
                        task,
                        seed=episode_seed(seed, member),
                        group_id=group_id,
                        screens=None if per_member is None else per_member[member],
                    )
                if not env_side_fault(traj) or attempt == self.settings.env_retries:
                    break
                self.env_retries += 1
                log.info(
                    "%s member %d: %s on host %s; played again elsewhere (attempt %d of %d)",
                    group_id,
                    member,
                    traj.failure_reason,
                    avoid,
                    attempt + 2,
                    self.settings.env_retries + 1,
                )
            traj.timings["env_attempts"] = float(attempt + 1)
            return traj

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

        An episode ended by an infrastructure fault (`Trajectory.infra_fault`: env, sampler or
        checker) is played once more on an env from the pool; the second attempt is the one
        returned (its screenshots replace the first's). Episodes still `infra_fault` after the
        retry say nothing about the policy: leave them out of the success rate and count them
        (`count_infra_faults`, logged as `eval/episodes_infra_fault`).

        on_episode: called with each task's final trajectory as it finishes (progress bars)."""
        per_task = [[] for _ in tasks] if screens is not None else None
        if screens is not None:
            screens.extend(per_task)

        async def one(i: int, task: Task) -> Trajectory:
            avoid = None
            for _ in range(2):  # one retry after an infrastructure fault, on another host
                if per_task is not None:
                    per_task[i].clear()
                async with _acquire(pool, avoid) as env:
                    avoid = _host_of(pool, env)
                    traj = await self.run_episode(
                        env,
                        task,
                        seed=episode_seed(seed, i),
                        group_id=f"eval/{i}",
                        greedy=True,
                        screens=None if per_task is None else per_task[i],
                    )
                if not traj.infra_fault:
                    break
            if on_episode is not None:
                on_episode(traj)
            return traj

        return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))))

    async def demonstrations(
        self,
        pool: EnvPool,
        tasks: Sequence[Task],
        detours: Sequence[Detour | None] | None = None,
    ) -> list[Trajectory]:
        """Oracle episodes (SFT data): the env's scripted solution, in the model's format.
        `detours[i]`, when given and not None, makes episode i a recovery demonstration (see
        `cua_jax.rl.policies.OraclePolicy`; `policies.recovery_detours` draws them)."""
        detours = list(detours) if detours is not None else [None] * len(tasks)
        if len(detours) != len(tasks):
            raise ValueError(f"{len(detours)} detours for {len(tasks)} tasks")

        return await _on_pooled_envs(
            pool,
            tasks,
            lambda i, task, env: self.run_episode(
                env, task, seed=i, group_id=f"demo/{i}", oracle=True, detour=detours[i]
            ),
        )

    async def failed_attempts(
        self, pool: EnvPool, tasks: Sequence[Task], misses: Sequence[Detour]
    ) -> list[Trajectory]:
        """Scripted failed attempts: episode i plays `misses[i]` (say, a click at a random
        point) and ends. Each keeps its final screen and the checker's report, the feedback an
        SDPO teacher reads (`sft.feedback_share` trains the policy to read it). A miss that
        happens to solve the task comes back as a success; the caller skips it."""
        if len(misses) != len(tasks):
            raise ValueError(f"{len(misses)} misses for {len(tasks)} tasks")

        return await _on_pooled_envs(
            pool,
            tasks,
            lambda i, task, env: self.play(
                env,
                task,
                OraclePolicy(self.fmt, self.tokenizer, misses[i], detour_only=True),
                group_id=f"attempt/{i}",
                keep_final_screen=True,
            ),
        )


async def _on_pooled_envs(
    pool: EnvPool,
    tasks: Sequence[Task],
    play_one: Callable[[int, Task, Env], Awaitable[Trajectory]],
) -> list[Trajectory]:
    """`play_one(i, task, env)` for every task, each on an env acquired from the pool,
    concurrently; the trajectories in task order."""

    async def one(i: int, task: Task) -> Trajectory:
        async with pool.acquire() as env:
            return await play_one(i, task, env)

    return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))))


async def _step_all(env: Env, acts: Sequence[A.Action]) -> tuple[list[Any], int, bool, str | None]:
    """Steps the turn's actions in order until one ends the episode: (step results, invalid
    actions among those stepped, the episode is over, the env fault that ended it or None)."""
    results, invalid = [], 0
    for act in acts:
        try:
            res = await env.step(act)
        except Exception as e:  # noqa: BLE001 -- Env.step must not raise; if it does, the env
            return results, invalid, True, _fault("step", e)  # is broken, not the policy
        results.append(res)
        if isinstance(act, A.InvalidAction):
            invalid += 1
        if res.done:
            error = res.info.get(INFO_ERROR)
            return results, invalid, True, f"env_error: {error}" if error else None
    return results, invalid, False, None


async def _score(env: Env, traj: Trajectory) -> float:
    """The task's score from the env's checker; a checker that raises (say, on a dead browser)
    sets `traj.failure_reason` to an `evaluate_error` (an infrastructure fault) and scores 0."""
    if traj.failure_reason and traj.failure_reason.startswith("env_error"):
        return 0.0  # the env is gone: nothing to score
    try:
        return float(await env.evaluate())
    except Exception as e:  # noqa: BLE001 -- a broken checker fails this episode only
        traj.failure_reason = f"evaluate_error: {type(e).__name__}: {e}"
        return 0.0


async def _report(env: Env, traj: Trajectory) -> CheckerReport | None:
    """The checker's report (`Env.report`, optional) on a scored episode; None for an env
    without one. A report that raises is logged and the episode keeps its score."""
    report = getattr(env, "report", None)
    if report is None:
        return None
    try:
        return await report()
    except Exception as e:  # noqa: BLE001 -- the report is extra: the score stands
        log.warning("checker report for %s failed: %s: %s", traj.task_id, type(e).__name__, e)
        return None


def count_infra_faults(trajs: Sequence[Trajectory]) -> int:
    """How many episodes an infrastructure fault ended (`Trajectory.infra_fault`)."""
    return sum(t.infra_fault for t in trajs)


def _tail_images(pv: np.ndarray, grid: np.ndarray, skip: int) -> np.ndarray:
    """The pixel rows of the images after the first `skip` images."""
    rows = int(np.prod(grid[:skip], axis=1).sum()) if skip else 0
    return pv[rows:]
