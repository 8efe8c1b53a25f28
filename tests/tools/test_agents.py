"""tools/agents.py: an agent served over HTTP plays the same episodes as the checkpoint.

The project's greedy eval (`AgentLoop.evaluate`, today's `--agent=checkpoint`) and
`OpenAIAgent` against tools/serve.py on a real loopback port (aiohttp client, uvicorn server)
over the same engine give the same episodes token for token: prompts, generated ids, actions,
outcomes. `CheckpointAgent` (the engine in-process behind the Agent interface) too.
"""

import asyncio
import contextlib
import socket
import threading
import time

import numpy as np
import pytest
import uvicorn

from cua_jax import actions as A
from cua_jax.data.processor import QwenVLProcessor
from cua_jax.env_api import INFO_DONE_REASON, INFO_INVALID_ACTION, Observation, StepResult, Task
from cua_jax.models import qwen_vl
from cua_jax.rl.rollout import AgentLoop, RolloutSettings
from cua_jax.sampler import Engine
from tools.agents import AgentEvalLoop, AgentReply, CheckpointAgent, OpenAIAgent
from tools.serve import create_app

W = H = 64


class SquareEnv:
    """Click the square (its place depends on the task seed), then say done."""

    def __init__(self):
        self.steps, self.hit, self.pos = 0, False, (8, 40)

    def _obs(self):
        img = np.full((H, W, 3), 25 * self.steps % 255, np.uint8)
        x, y = self.pos
        img[y : y + 16, x : x + 16] = (255, 0, 0)
        return Observation(img, "click the red square")

    async def reset(self, task, seed=None):
        self.steps, self.hit = 0, False
        self.pos = (8 + 4 * (seed % 5), 40 - 6 * (seed % 4))
        return self._obs()

    async def step(self, action):
        self.steps += 1
        info, done = {}, False
        x, y = self.pos
        if isinstance(action, A.InvalidAction):
            info[INFO_INVALID_ACTION] = action.reason
        elif isinstance(action, A.Click) and action.x is not None:
            self.hit |= x <= action.x < x + 16 and y <= action.y < y + 16
        elif isinstance(action, A.Done):
            done, info[INFO_DONE_REASON] = True, "done"
        return StepResult(self._obs(), done, 0.0, info)

    async def evaluate(self):
        return 1.0 if self.hit else 0.0

    async def close(self):
        pass


class Pool:
    def __init__(self, n):
        self.n, self.free = n, None

    def __len__(self):
        return self.n

    @contextlib.asynccontextmanager
    async def acquire(self):
        if self.free is None:
            self.free = asyncio.Queue()
            for _ in range(self.n):
                self.free.put_nowait(SquareEnv())
        env = await self.free.get()
        try:
            yield env
        finally:
            self.free.put_nowait(env)


TASKS = [
    Task(
        id=f"square/{i}",
        instruction="click the red square",
        source="test",
        category=["a", "b"][i % 2],
        seed=i,
    )
    for i in range(4)
]


@pytest.fixture(scope="module")
def proc():
    return QwenVLProcessor.default("qwen3_vl", max_pixels=64 * 64, min_pixels=32 * 32)


@pytest.fixture(scope="module")
def model(proc):
    tok = proc.tokenizer
    cfg = qwen_vl.tiny("qwen3_vl", vocab_size=tok.vocab_size, **tok.vision_token_ids())
    return qwen_vl.init_random(cfg, seed=1)


@pytest.fixture(scope="module")
def engine(model, proc):
    return Engine(
        model,
        max_slots=8,
        page_size=16,
        num_pages=512,
        max_seq_len=1024,
        decode_chunk=8,
        detokenize=proc.tokenizer.decode,
    )


@pytest.fixture(scope="module")
def settings(model):
    return RolloutSettings(
        max_turns=3,
        max_history_images=2,
        max_new_tokens=10,
        system_prompt="compact",
        banned_token_ids=model.config.vision_placeholder_ids,
    )


@contextlib.contextmanager
def serving(app):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    t0 = time.monotonic()
    while not server.started:
        assert time.monotonic() - t0 < 30 and th.is_alive(), "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        th.join(10)


def _same_episodes(got, want):
    assert [t.task_id for t in got] == [t.task_id for t in want]
    for g, w in zip(got, want, strict=True):
        assert (g.success, g.score, g.failure_reason) == (w.success, w.score, w.failure_reason)
        assert len(g.turns) == len(w.turns) > 0
        for tg, tw in zip(g.turns, w.turns, strict=True):
            np.testing.assert_array_equal(tg.prompt_ids, tw.prompt_ids)
            np.testing.assert_array_equal(tg.generated_ids, tw.generated_ids)
            assert tg.action == tw.action and tg.feedback == tw.feedback


def test_openai_agent_on_our_server_equals_the_checkpoint_eval(engine, proc, model, settings):
    want = asyncio.run(AgentLoop(engine, proc, settings).evaluate(Pool(3), TASKS, seed=5))
    app = create_app(
        engine,
        proc,
        token="tok",
        model_name="tiny",
        banned_token_ids=model.config.vision_placeholder_ids,
    )
    loop = AgentEvalLoop(proc, settings)
    with serving(app) as url:
        agent = OpenAIAgent(url, model="tiny", api_key="tok")

        async def run():
            try:
                return await loop.evaluate_agent(Pool(3), TASKS, agent, seed=5)
            finally:
                await agent.close()

        got, texts = asyncio.run(run())
    _same_episodes(got, want)
    for traj, tx in zip(got, texts, strict=True):
        assert len(tx) == len(traj.turns)
        # the texts are the decoded ids without the stop token
        for turn, text in zip(traj.turns, tx, strict=True):
            ids = [int(t) for t in turn.generated_ids if t not in proc.tokenizer.stop_ids]
            assert proc.tokenizer.decode(ids) == text
    assert app.state.chat.requests == sum(len(t.turns) for t in got)


def test_checkpoint_agent_equals_the_checkpoint_eval(engine, proc, model, settings):
    want = asyncio.run(AgentLoop(engine, proc, settings).evaluate(Pool(2), TASKS[:2], seed=5))
    agent = CheckpointAgent(engine, proc, banned_token_ids=model.config.vision_placeholder_ids)
    got, _ = asyncio.run(AgentEvalLoop(proc, settings).evaluate_agent(Pool(2), TASKS[:2], agent))
    _same_episodes(got, want)


class ScriptedAgent:
    """Answers with fixed texts (no ids): the loop tokenizes them."""

    name = "scripted"

    def __init__(self, texts):
        self.texts, self.seen = texts, []

    async def act(self, turn):
        self.seen.append(turn)
        return AgentReply(self.texts[min(turn.turn, len(self.texts) - 1)])


def test_agent_turns_carry_history_feedback_and_format(proc, settings):
    call = '<tool_call>{"name": "computer_use", "arguments": %s}</tool_call>'
    good = call % '{"action": "left_click", "coordinate": [250, 750]}'
    agent = ScriptedAgent(
        [
            "nonsense",
            good,
            call % '{"action": "terminate", "status": "success"}',
        ]
    )
    trajs, texts = asyncio.run(
        AgentEvalLoop(proc, settings).evaluate_agent(Pool(1), TASKS[:1], agent)
    )
    (traj,) = trajs
    assert traj.success and len(traj.turns) == 3, traj
    assert isinstance(traj.turns[0].action[0], A.InvalidAction)
    assert texts[0] == agent.texts
    t1, t2 = agent.seen[1], agent.seen[2]
    assert t1.feedback[1].startswith("Your last action was invalid") and t1.replies == ["nonsense"]
    assert len(t2.screenshots) == 3 and t2.max_history_images == 2
    assert t2.action_format == "qwen3vl" and "computer_use" in t2.system_prompt
    # no token ids from the agent: the loop records its text tokenized + <|im_end|>
    tok = proc.tokenizer
    assert list(traj.turns[1].generated_ids) == [*tok.encode(good), tok.im_end_id]
