"""Agents for tools/eval.py: anything that writes the next action given the screen.

    agent = OpenAIAgent("http://127.0.0.1:8000/v1", model="qwen3-vl-8b", api_key=TOKEN)
    agent = CheckpointAgent(engine, processor, banned_token_ids=model.config.vision_placeholder_ids)
    loop = AgentEvalLoop(processor, settings)               # the project's episode loop
    trajs, texts = await loop.evaluate_agent(pool, tasks, agent, seed=0, screens=screens)

The adapter interface is one async method, `Agent.act(turn: AgentTurn) -> AgentReply`: given the
task instruction, the screenshots so far (with the feedback shown before each), the agent's own
earlier replies and the action format (its system prompt and coordinate space), return this
turn's model text. The episode loop (`cua_jax.rl.rollout.AgentLoop.play`) parses that text with
the action format (`cua_jax.actions`), steps the env, scores the task; a reply that does not
parse is an invalid action with feedback, as for the project's own policy.

Implemented here:
  * `CheckpointAgent`: the project's sampler `Engine` in-process (the server's renderer, so its
    prompts are the trainer's).
  * `OpenAIAgent`: any OpenAI-compatible chat-completions endpoint (tools/serve.py, vLLM serving
    Qwen-VL or OpenCUA, ...), with the conversation the agent loop builds (system prompt of the
    format's family, screenshots as PNG data URIs, the last `max_history_images` of them, older
    ones as a short text). When the endpoint returns the generated `token_ids` (tools/serve.py
    does) they are recorded as the turn's ids, so episodes compare token for token with the
    checkpoint's.

  * `AnthropicAgent`: Anthropic's Messages API with the computer-use tool; its tool calls are
    translated to `cua_jax.actions` and written in the run's action format.

Adding an agent: write a class with `name` and `async act(turn) -> AgentReply` that sends the
turn (`turn.screenshots`, `turn.instruction`, ...) in that API's shape and returns text in the
run's action format (translate the API's own actions with
`cua_jax.actions.get_format(turn.action_format).format(action, turn.space)`, as
`AnthropicAgent` does); give it to `AgentEvalLoop.evaluate_agent`. Tests run it against a local
fake server, never the internet.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from cua_jax import actions as A  # noqa: E402
from cua_jax.evaluation.openai_chat import MessageRenderer, encode_image  # noqa: E402
from cua_jax.job import builders  # noqa: E402
from cua_jax.rl.policies import Reply, Stop, TurnContext  # noqa: E402
from cua_jax.rl.rollout import OMITTED_SCREENSHOT, AgentLoop, episode_seed  # noqa: E402
from cua_jax.sampler import SamplingParams  # noqa: E402


@dataclasses.dataclass(frozen=True)
class AgentTurn:
    """What an agent sees on one turn.

    screenshots[k] is the screen before step k (the last is the current one); feedback[k] the
    text shown with it (feedback[0] == ""); replies[k] the agent's text of step k (k < turn)."""

    instruction: str
    system_prompt: str  # the action format's prompt (tool schema) for this screen
    action_format: str  # cua_jax.actions format name ("qwen3vl", "qwen25vl", "pyautogui")
    space: A.CoordinateSpace  # the model <-> screen coordinates of this episode
    screenshots: Sequence[np.ndarray]
    feedback: Sequence[str]
    replies: Sequence[str]
    turn: int
    max_history_images: int
    max_tokens: int
    seed: int  # this turn's sampling seed (greedy agents ignore it)


@dataclasses.dataclass(frozen=True)
class AgentReply:
    """An agent's turn: its text; `token_ids` (the model's own ids, stop token included) and
    `logprobs` when the agent knows them; the weights version that wrote it."""

    text: str
    token_ids: Sequence[int] | None = None
    logprobs: Sequence[float] | None = None
    version: int = 0


class AgentError(RuntimeError):
    """The agent could not answer (endpoint down, HTTP error, malformed reply): the episode
    ends as an infrastructure fault (`sampler_error: ...`), not a policy failure."""


class Agent(Protocol):
    """Anything that answers a turn: a name for reports and `act` (the OpenAI, Anthropic and
    local-policy agents of this module)."""

    name: str

    async def act(self, turn: AgentTurn) -> AgentReply:
        """One turn: the agent's reply (its text and parsed action) to the transcript so far."""
        ...


def transcript_messages(turn: AgentTurn, image_part: Callable[[np.ndarray], dict]) -> list[dict]:
    """The conversation the agent loop renders for this turn (`render_transcript`), as chat
    messages: the system prompt, the first user message (screenshot + instruction), then per
    later step the reply and a user message (feedback + screenshot); only the last
    `max_history_images` screenshots are images, older ones a short text."""
    n = len(turn.screenshots)
    keep = set(range(max(0, n - turn.max_history_images), n))
    omitted = {"type": "text", "text": OMITTED_SCREENSHOT}
    msgs: list[dict] = [{"role": "system", "content": turn.system_prompt}]
    for k, shot in enumerate(turn.screenshots):
        img = image_part(shot) if k in keep else omitted
        if k == 0:
            content = [img, {"type": "text", "text": turn.instruction}]
        else:
            msgs.append({"role": "assistant", "content": turn.replies[k - 1]})
            content = [{"type": "text", "text": turn.feedback[k]}, img]
        msgs.append({"role": "user", "content": content})
    return msgs


def openai_messages(turn: AgentTurn) -> list[dict]:
    """`transcript_messages` with screenshots as PNG data URIs (`image_url` parts)."""
    return transcript_messages(
        turn, lambda im: {"type": "image_url", "image_url": {"url": encode_image(im)}}
    )


class CheckpointAgent:
    """The project's policy through its sampler `Engine`, in-process: the prompt is rendered by
    the server's renderer (the trainer's ids, its own earlier replies from their ids, K/V of the
    previous turn reused), greedy unless `temperature` > 0."""

    def __init__(
        self,
        engine: Any,
        processor: Any,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        banned_token_ids: Sequence[int] = (),
        name: str = "checkpoint",
    ):
        self.engine, self.processor, self.name = engine, processor, name
        self.renderer = MessageRenderer(processor)
        self.temperature, self.top_p = temperature, top_p
        self.banned = tuple(banned_token_ids)
        self.stop_ids = tuple(processor.tokenizer.stop_ids)

    async def act(self, turn: AgentTurn) -> AgentReply:
        """Generates the reply with the checkpoint's engine from the rendered transcript."""

        images: list[np.ndarray] = []

        def part(im: np.ndarray) -> dict:
            images.append(np.asarray(im, np.uint8))
            return {"type": "image"}

        msgs = transcript_messages(turn, part)
        prompt = await asyncio.to_thread(self.renderer.render, msgs, images)
        session = prompt.session or self.renderer.new_session()
        params = SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            seed=turn.seed,
            max_new_tokens=turn.max_tokens,
            stop_token_ids=self.stop_ids,
            banned_token_ids=self.banned,
        )
        out = await self.engine.generate(
            prompt.ids, prompt.pixel_values, prompt.grid, params=params, session_id=session
        )
        if out.finish_reason == "error":
            raise AgentError(f"sampler error: {out.error}")
        tokens = [int(t) for t in out.tokens]
        content = tokens[:-1] if tokens and tokens[-1] in self.stop_ids else tokens
        text = self.processor.tokenizer.decode(content)
        self.renderer.remember(msgs, text, tokens, session)
        return AgentReply(text, tokens, [float(x) for x in out.logprobs], int(out.version))


class _Sessions:
    """One aiohttp session per event loop (an agent may be used from several asyncio.run)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._by_loop: dict[int, Any] = {}

    def get(self):
        """This event loop's HTTP session (a new one where it has none or it was closed)."""
        import aiohttp

        loop = asyncio.get_running_loop()
        s = self._by_loop.get(id(loop))
        if s is None or s.closed:
            s = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
            self._by_loop[id(loop)] = s
        return s

    async def close(self) -> None:
        """Closes every loop's session."""
        for s in self._by_loop.values():
            await s.close()
        self._by_loop.clear()


class OpenAIAgent:
    """A model behind an OpenAI-compatible `/chat/completions` endpoint (aiohttp client).

    Args:
      base_url: up to the version prefix, e.g. "http://127.0.0.1:8000/v1".
      model: the model id to ask for (None: leave the field out).
      api_key: sent as `Authorization: Bearer <api_key>` (None: no header).
      temperature: 0 = greedy; `seed` of each turn is sent too.
      timeout_s: per request.
      retries: extra attempts after a connection error or a 5xx answer.
    """

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        api_key: str | None = None,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        timeout_s: float = 600.0,
        retries: int = 2,
        name: str | None = None,
    ):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.api_key = model, api_key
        self.temperature, self.top_p = temperature, top_p
        self.timeout_s, self.retries = timeout_s, retries
        self.name = name or f"openai:{model or base_url}"
        self._http = _Sessions(timeout_s)

    async def close(self) -> None:
        """Closes the HTTP session."""
        await self._http.close()

    def request_body(self, turn: AgentTurn) -> dict[str, Any]:
        """The chat-completions request body for this turn."""
        body: dict[str, Any] = {
            "messages": openai_messages(turn),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": turn.max_tokens,
            "seed": turn.seed,
        }
        if self.model is not None:
            body["model"] = self.model
        return body

    async def act(self, turn: AgentTurn) -> AgentReply:
        """Posts the turn to the chat-completions endpoint (retrying 5xx answers up to `retries`
        times) and parses the reply."""
        import aiohttp

        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        body = self.request_body(turn)
        last = ""
        for attempt in range(self.retries + 1):
            try:
                async with self._http.get().post(self.url, json=body, headers=headers) as r:
                    text = await r.text()
                    if r.status >= 500 and attempt < self.retries:
                        last = f"HTTP {r.status}: {text[:300]}"
                        await asyncio.sleep(0.5 * 2**attempt)
                        continue
                    if r.status != 200:
                        raise AgentError(f"{self.url} answered HTTP {r.status}: {text[:500]}")
                    data = await r.json(content_type=None)
                    break
            except (TimeoutError, aiohttp.ClientError) as e:
                last = f"{type(e).__name__}: {e}"
                if attempt == self.retries:
                    raise AgentError(f"{self.url}: {last}") from None
                await asyncio.sleep(0.5 * 2**attempt)
        else:
            raise AgentError(f"{self.url}: {last}")
        try:
            choice = data["choices"][0]
            content = choice["message"]["content"] or ""
        except (KeyError, IndexError, TypeError) as e:
            raise AgentError(f"{self.url}: malformed reply ({e}): {str(data)[:300]}") from None
        lp = choice.get("logprobs") or {}
        logprobs = [float(e["logprob"]) for e in lp.get("content") or []] or None
        version = choice.get("policy_version", data.get("policy_version", 0))
        return AgentReply(content, choice.get("token_ids"), logprobs, int(version or 0))


class AnthropicAgent:
    """A model behind Anthropic's Messages API with its computer-use tool (aiohttp client).

    Each turn sends the episode so far in that API's shape: the instruction and first
    screenshot, then per earlier step the assistant's `tool_use` of the `computer` tool (rebuilt
    from the reply text of that step, which is in the run's action format) and a user
    `tool_result` with the feedback and the next screenshot (the last `max_history_images`
    screenshots as images, older ones as a short text). The reply's `computer` tool calls are
    translated to `cua_jax.actions` actions in screen pixels (the screenshot is sent at its own
    size: `display_width_px` x `display_height_px`) and written in the run's action format, so
    the loop parses them as any reply; a reply with no tool call means the model is done.

    Args:
      base_url: the API root ("https://api.anthropic.com"; a local fake in tests).
      model, api_key: sent as `model` and the `x-api-key` header.
      tool_type: the computer tool version (e.g. "computer_20250124"); `beta`: the
        `anthropic-beta` header that enables it (None: no header).
    """

    API_VERSION = "2023-06-01"

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        *,
        tool_type: str = "computer_20250124",
        beta: str | None = "computer-use-2025-01-24",
        timeout_s: float = 600.0,
        name: str | None = None,
    ):
        self.url = base_url.rstrip("/") + "/v1/messages"
        self.model, self.api_key = model, api_key
        self.tool_type, self.beta = tool_type, beta
        self.name = name or f"anthropic:{model}"
        self._http = _Sessions(timeout_s)

    async def close(self) -> None:
        """Closes the HTTP session."""
        await self._http.close()

    # ---- translation -------------------------------------------------------------------------

    @staticmethod
    def to_action(inp: dict[str, Any]) -> Any:
        """A `computer` tool input -> a `cua_jax.actions` action (screen pixels)."""
        kind = inp.get("action")
        xy = inp.get("coordinate")
        x, y = (float(xy[0]), float(xy[1])) if xy else (None, None)
        clicks = {
            "left_click": ("left", 1),
            "right_click": ("right", 1),
            "middle_click": ("middle", 1),
            "double_click": ("left", 2),
            "triple_click": ("left", 3),
        }
        if kind in clicks:
            button, count = clicks[kind]
            return A.Click(x, y, button, count)
        if kind == "mouse_move":
            return A.Move(x, y)
        if kind == "left_click_drag":
            start = inp.get("start_coordinate")
            sx, sy = (float(start[0]), float(start[1])) if start else (None, None)
            return A.Drag(x, y, sx, sy)
        if kind == "type":
            return A.TypeText(str(inp.get("text", "")))
        if kind in ("key", "hold_key"):
            keys = [A.normalize_key(k) for k in str(inp.get("text", "")).split("+")]
            if not keys or any(k is None for k in keys):
                return A.InvalidAction(str(inp), f"unknown key in {inp.get('text')!r}")
            return A.Key(tuple(keys))
        if kind == "scroll":
            n = float(inp.get("scroll_amount", 3))
            dx, dy = {"up": (0, -n), "down": (0, n), "left": (-n, 0), "right": (n, 0)}.get(
                inp.get("scroll_direction"), (0, 0)
            )
            return A.Scroll(x, y, dx, dy)
        if kind == "left_mouse_down":
            return A.MouseDown(x, y)
        if kind == "left_mouse_up":
            return A.MouseUp(x, y)
        if kind in ("wait", "screenshot", "cursor_position"):
            return A.Wait(float(inp.get("duration", 1.0)))
        return A.InvalidAction(str(inp), f"unknown computer action {kind!r}")

    @staticmethod
    def to_input(action: Any) -> dict[str, Any] | None:
        """A `cua_jax.actions` action -> the `computer` tool input (None: not expressible)."""

        def at(a):
            return {} if a.x is None else {"coordinate": [round(a.x), round(a.y)]}

        if isinstance(action, A.Click):
            name = {1: "left_click", 2: "double_click", 3: "triple_click"}.get(action.count)
            if action.button != "left" and action.count == 1:
                name = f"{action.button}_click"
            return {"action": name, **at(action)}
        if isinstance(action, A.Move):
            return {"action": "mouse_move", **at(action)}
        if isinstance(action, A.Drag):
            out = {"action": "left_click_drag", **at(action)}
            if action.start_x is not None:
                out["start_coordinate"] = [round(action.start_x), round(action.start_y)]
            return out
        if isinstance(action, A.TypeText):
            return {"action": "type", "text": action.text}
        if isinstance(action, A.Key):
            return {"action": "key", "text": "+".join(action.keys)}
        if isinstance(action, A.Scroll):
            way = (
                ("down" if action.dy > 0 else "up")
                if action.dy
                else ("right" if action.dx > 0 else "left")
            )
            n = abs(action.dy or action.dx)
            return {
                "action": "scroll",
                **at(action),
                "scroll_direction": way,
                "scroll_amount": int(round(n)),
            }
        if isinstance(action, A.Wait):
            return {"action": "wait", "duration": action.seconds}
        return None

    # ---- requests ----------------------------------------------------------------------------

    def request_body(self, turn: AgentTurn) -> dict[str, Any]:
        """The Messages API request body for this turn: the transcript with the `computer` tool, the
        last `max_history_images` screenshots as images."""
        fmt = A.get_format(turn.action_format)
        h, w = np.asarray(turn.screenshots[-1]).shape[:2]
        n = len(turn.screenshots)
        keep = set(range(max(0, n - turn.max_history_images), n))

        def image(k: int) -> dict[str, Any]:
            if k not in keep:
                return {"type": "text", "text": OMITTED_SCREENSHOT}
            data = encode_image(turn.screenshots[k]).partition(",")[2]
            return {
                "type": "image",
                "source": {"type": "base64", "media_type": "image/png", "data": data},
            }

        msgs: list[dict[str, Any]] = [
            {"role": "user", "content": [{"type": "text", "text": turn.instruction}, image(0)]}
        ]
        for k in range(1, n):
            acts = fmt.parse(turn.replies[k - 1], turn.space)
            uses = []
            for j, a in enumerate(acts):
                inp = self.to_input(a)
                if inp is not None:
                    uses.append(
                        {
                            "type": "tool_use",
                            "id": f"toolu_{k}_{j}",
                            "name": "computer",
                            "input": inp,
                        }
                    )
            if uses:
                msgs.append({"role": "assistant", "content": uses})
                results = [
                    {"type": "tool_result", "tool_use_id": u["id"], "content": []} for u in uses
                ]
                results[-1]["content"] = [{"type": "text", "text": turn.feedback[k]}, image(k)]
                msgs.append({"role": "user", "content": results})
            else:  # the step was not a tool call: plain text both ways
                msgs.append({"role": "assistant", "content": turn.replies[k - 1] or "(nothing)"})
                msgs.append(
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": turn.feedback[k]}, image(k)],
                    }
                )
        return {
            "model": self.model,
            "max_tokens": turn.max_tokens,
            "tools": [
                {
                    "type": self.tool_type,
                    "name": "computer",
                    "display_width_px": int(w),
                    "display_height_px": int(h),
                }
            ],
            "messages": msgs,
        }

    async def act(self, turn: AgentTurn) -> AgentReply:
        """Posts the turn to the Messages API and turns its tool call into an action; an answer
        other than 200 is an AgentError."""
        import aiohttp

        headers = {"Content-Type": "application/json", "anthropic-version": self.API_VERSION}
        if self.api_key:
            headers["x-api-key"] = self.api_key
        if self.beta:
            headers["anthropic-beta"] = self.beta
        try:
            async with self._http.get().post(
                self.url, json=self.request_body(turn), headers=headers
            ) as r:
                text = await r.text()
                if r.status != 200:
                    raise AgentError(f"{self.url} answered HTTP {r.status}: {text[:500]}")
                data = await r.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError) as e:
            raise AgentError(f"{self.url}: {type(e).__name__}: {e}") from None
        blocks = data.get("content") if isinstance(data, dict) else None
        if not isinstance(blocks, list):
            raise AgentError(f"{self.url}: malformed reply: {str(data)[:300]}")
        fmt = A.get_format(turn.action_format)
        acts = [
            self.to_action(b.get("input") or {})
            for b in blocks
            if b.get("type") == "tool_use" and b.get("name") == "computer"
        ]
        if not acts:
            acts = [A.Done()]  # no tool call: the model has finished
        texts = []
        for a in acts:
            if isinstance(a, A.InvalidAction):
                texts.append(a.raw)  # the loop parses it into an invalid action with feedback
            else:
                try:
                    texts.append(fmt.format(a, turn.space))
                except ValueError as e:
                    texts.append(f"(cannot write {a!r} in {turn.action_format}: {e})")
        return AgentReply("\n".join(texts))


# ------------------------------------------------------------------------ the episode loop

# The feedback the loop shows before the next screenshot, handed to the episode's policy (each
# episode runs in its own asyncio task, so this is per episode).
_FEEDBACK: contextvars.ContextVar[str] = contextvars.ContextVar("agent_feedback", default="")


class AgentPolicy:
    """A `cua_jax.rl.policies.Policy` over an `Agent`: keeps the episode's screenshots, feedback
    and replies, asks the agent each turn, and hands the loop the reply's ids (the agent's own
    when it gives them, else the text tokenized + the end-of-turn id)."""

    shaped_reward = False

    def __init__(self, agent: Agent, loop: AgentEvalLoop, *, seed: int):
        self.agent, self.loop, self.seed = agent, loop, seed
        self.screens: list[np.ndarray] = []
        self.feedback: list[str] = []
        self.replies: list[str] = []
        self.versions: list[int] = []

    async def act(self, ctx: TurnContext) -> Reply | Stop:
        """Asks the agent for this turn's action, with the feedback and screenshots so far."""
        self.feedback.append(_FEEDBACK.get() if ctx.turn else "")
        self.screens.append(ctx.screenshot)
        s = self.loop.settings
        turn = AgentTurn(
            instruction=getattr(ctx.env, "instruction", None) or ctx.task.instruction,
            system_prompt=self.loop.system_prompt(ctx.space),
            action_format=s.action_format,
            space=ctx.space,
            screenshots=list(self.screens),
            feedback=list(self.feedback),
            replies=list(self.replies),
            turn=ctx.turn,
            max_history_images=s.max_history_images,
            max_tokens=s.max_new_tokens,
            seed=episode_seed(self.seed, ctx.turn),
        )
        try:
            reply = await self.agent.act(turn)
        except AgentError as e:
            return Stop(f"sampler_error: {self.agent.name}: {e}")
        self.replies.append(reply.text)
        self.versions.append(reply.version)
        tok = self.loop.tokenizer
        if reply.token_ids is not None:
            ids = [int(t) for t in reply.token_ids]
        else:
            ids = [*tok.encode(reply.text), tok.im_end_id]
        lps = np.zeros(len(ids), np.float32)
        if reply.logprobs is not None and len(reply.logprobs) == len(ids):
            lps = np.asarray(reply.logprobs, np.float32)
        return Reply(ids, lps)

    def finish(self) -> int:
        """The oldest policy version any turn of the episode used (0 when none was recorded)."""
        return min(self.versions) if self.versions else 0


class AgentEvalLoop(AgentLoop):
    """The project's episode loop driving an `Agent` (same env stepping, parsing, feedback,
    scoring and infra-fault retry as `AgentLoop.evaluate`). `engine` may be None: the agent
    answers, the processor only renders the local record and the coordinate space."""

    def __init__(self, processor: Any, settings: Any, engine: Any = None):
        super().__init__(engine, processor, settings)

    def feedback_for(self, results):
        """The loop's feedback text, also handed to the agent's next turn."""
        text = super().feedback_for(results)
        _FEEDBACK.set(text)
        return text

    async def evaluate_agent(
        self,
        pool: Any,
        tasks: Sequence[Any],
        agent: Agent,
        *,
        seed: int = 0,
        screens: list[list[np.ndarray]] | None = None,
        on_episode: Callable[[Any], None] | None = None,
    ) -> tuple[list[Any], list[list[str]]]:
        """One episode of `agent` per task (in task order) and the agent's texts per episode;
        an infrastructure fault is retried once, as in `AgentLoop.evaluate`."""
        per_task = [[] for _ in tasks] if screens is not None else None
        if screens is not None:
            screens.extend(per_task)
        texts: list[list[str]] = [[] for _ in tasks]

        async def one(i: int, task: Any):
            for _ in range(2):
                if per_task is not None:
                    per_task[i].clear()
                policy = AgentPolicy(agent, self, seed=episode_seed(seed, i))
                async with pool.acquire() as env:
                    traj = await self.play(
                        env,
                        task,
                        policy,
                        group_id=f"eval/{i}",
                        screens=None if per_task is None else per_task[i],
                    )
                texts[i] = policy.replies
                if not traj.infra_fault:
                    break
            if on_episode is not None:
                on_episode(traj)
            return traj

        trajs = list(await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))))
        return trajs, texts


def agent_predictor(agent, processor, config):
    """An `Agent` on a screenshot step: the step's screen and instruction (its history as a
    text line), parsed with the run's action format in the agent's coordinate space."""

    no_model = type("M", (), {"config": type("C", (), {"vision_placeholder_ids": ()})})
    settings = builders.build_rollout_settings(config, no_model)
    loop = AgentEvalLoop(processor, settings)
    fmt = A.get_format(settings.action_format)

    async def predict(step):
        if step.screenshot is None:
            raise ValueError("an agent predicts on screenshot steps (--steps)")
        space = loop.space_for(step.screenshot)
        instruction = step.instruction
        if step.history:
            instruction += "\nPrevious actions: " + "; ".join(step.history)
        turn = AgentTurn(
            instruction=instruction,
            system_prompt=loop.system_prompt(space),
            action_format=settings.action_format,
            space=space,
            screenshots=[step.screenshot],
            feedback=[""],
            replies=[],
            turn=0,
            max_history_images=1,
            max_tokens=settings.max_new_tokens,
            seed=0,
        )
        reply = await agent.act(turn)
        return fmt.parse(reply.text, space)

    return predict


__all__ = [
    "Agent",
    "AgentError",
    "AgentEvalLoop",
    "AgentPolicy",
    "AgentReply",
    "AgentTurn",
    "agent_predictor",
    "AnthropicAgent",
    "CheckpointAgent",
    "OpenAIAgent",
    "openai_messages",
    "transcript_messages",
]
