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

Adding an agent (say Anthropic's computer-use tool): write a class with `name` and
`async act(turn) -> AgentReply` that sends `turn.screenshots[-1]` (and whatever history it
keeps) in that API's shape and returns text in the run's action format (or translates the
API's tool call to it: e.g. `cua_jax.actions.get_format("pyautogui").format(action, space)` of
the `cua_jax.actions` action the tool call describes); give it to `AgentEvalLoop.evaluate_agent`.
Tests must run it against a local fake server, never the internet.
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
from cua_jax.rl.policies import Reply, Stop, TurnContext  # noqa: E402
from cua_jax.rl.rollout import OMITTED_SCREENSHOT, AgentLoop, episode_seed  # noqa: E402


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
    name: str

    async def act(self, turn: AgentTurn) -> AgentReply: ...


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
        from cua_jax.sampler import SamplingParams

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
        self._sessions: dict[int, Any] = {}

    def _session(self):
        import aiohttp

        loop = asyncio.get_running_loop()
        s = self._sessions.get(id(loop))
        if s is None or s.closed:
            s = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
            self._sessions[id(loop)] = s
        return s

    async def close(self) -> None:
        for s in self._sessions.values():
            await s.close()
        self._sessions.clear()

    def request_body(self, turn: AgentTurn) -> dict[str, Any]:
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
        import aiohttp

        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        body = self.request_body(turn)
        last = ""
        for attempt in range(self.retries + 1):
            try:
                async with self._session().post(self.url, json=body, headers=headers) as r:
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
        return min(self.versions) if self.versions else 0


class AgentEvalLoop(AgentLoop):
    """The project's episode loop driving an `Agent` (same env stepping, parsing, feedback,
    scoring and infra-fault retry as `AgentLoop.evaluate`). `engine` may be None: the agent
    answers, the processor only renders the local record and the coordinate space."""

    def __init__(self, processor: Any, settings: Any, engine: Any = None):
        super().__init__(engine, processor, settings)

    def feedback_for(self, results):
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


__all__ = [
    "Agent",
    "AgentError",
    "AgentEvalLoop",
    "AgentPolicy",
    "AgentReply",
    "AgentTurn",
    "CheckpointAgent",
    "OpenAIAgent",
    "openai_messages",
    "transcript_messages",
]
