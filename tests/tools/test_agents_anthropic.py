"""AnthropicAgent against a local fake of the Messages API (never the internet): the request
shape (headers, computer tool, tool_use / tool_result history rebuilt from the run's action
format), and its tool calls played in the project's episode loop."""

import asyncio
import base64
import io

import numpy as np
import pytest
from PIL import Image
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from cua_jax import actions as A
from cua_jax.data.processor import QwenVLProcessor
from cua_jax.rl.rollout import RolloutSettings
from tests.tools.test_agents import TASKS, Pool, serving
from tools.agents import AgentEvalLoop, AnthropicAgent


class FakeAnthropic:
    """Step 0: press ctrl+a; step 1: click the red square it finds in the screenshot; then
    answer with text only (done). Checks every request as the real API would."""

    def __init__(self):
        self.sent: list[list[dict]] = []  # its tool_use blocks, per step
        self.requests: list[dict] = []
        self.errors: list[str] = []

    async def messages(self, request: Request) -> JSONResponse:
        h = request.headers
        body = await request.json()
        self.requests.append(body)
        try:
            assert h["x-api-key"] == "key" and h["anthropic-version"] == "2023-06-01"
            assert h["anthropic-beta"] == "computer-use-2025-01-24"
            (tool,) = body["tools"]
            assert tool["type"] == "computer_20250124" and tool["name"] == "computer"
            msgs = body["messages"]
            roles = [m["role"] for m in msgs]
            assert roles == ["user", "assistant"] * (len(msgs) // 2) + ["user"]
            step = len(msgs) // 2
            for k in range(step):  # the history: our tool calls, and results for each id
                uses = msgs[2 * k + 1]["content"]
                assert [u["input"] for u in uses] == [u["input"] for u in self.sent[k]]
                ids = [r["tool_use_id"] for r in msgs[2 * k + 2]["content"]]
                assert ids == [u["id"] for u in uses]
            last = msgs[-1]["content"]
            if step:
                last = last[-1]["content"]
            (img,) = [b for b in last if b["type"] == "image"]
            shot = np.asarray(Image.open(io.BytesIO(base64.b64decode(img["source"]["data"]))))
            assert tool["display_width_px"] == shot.shape[1]
            assert tool["display_height_px"] == shot.shape[0]
            # history window of 2: at step 2 the first screenshot is a text
            if step == 2:
                assert msgs[0]["content"][1] == {
                    "type": "text",
                    "text": "(an earlier screenshot, omitted)",
                }
        except (AssertionError, KeyError, ValueError) as e:
            self.errors.append(f"{type(e).__name__}: {e}")
            return JSONResponse({"type": "error", "error": {"message": str(e)}}, 400)
        if step == 0:
            uses = [{"action": "key", "text": "ctrl+a"}]
        elif step == 1:
            ys, xs = np.nonzero((shot[..., 0] == 255) & (shot[..., 1] == 0))
            uses = [{"action": "left_click", "coordinate": [int(xs.mean()), int(ys.mean())]}]
        else:
            return JSONResponse({"content": [{"type": "text", "text": "Done."}]})
        blocks = [
            {"type": "tool_use", "id": f"srv_{step}_{j}", "name": "computer", "input": u}
            for j, u in enumerate(uses)
        ]
        self.sent.append(blocks)
        return JSONResponse({"content": [{"type": "text", "text": "ok"}, *blocks]})


def test_anthropic_agent_plays_an_episode_against_a_fake_api():
    proc = QwenVLProcessor.default("qwen3_vl", max_pixels=64 * 64, min_pixels=32 * 32)
    settings = RolloutSettings(max_turns=4, max_history_images=2, max_new_tokens=64)
    fake = FakeAnthropic()
    app = Starlette(routes=[Route("/v1/messages", fake.messages, methods=["POST"])])
    with serving(app) as url:
        agent = AnthropicAgent(url.removesuffix("/v1"), "claude-test", "key")

        async def run():
            try:
                return await AgentEvalLoop(proc, settings).evaluate_agent(
                    Pool(1), TASKS[1:2], agent
                )
            finally:
                await agent.close()

        (traj,), (texts,) = asyncio.run(run())
    assert not fake.errors, fake.errors
    assert traj.success and traj.failure_reason is None, traj
    assert [type(t.action[0]) for t in traj.turns] == [A.Key, A.Click, A.Done]
    assert traj.turns[0].action[0] == A.Key(("ctrl", "a"))
    assert len(texts) == 3 and "<tool_call>" in texts[1]


@pytest.mark.parametrize(
    "inp, action",
    [
        ({"action": "left_click", "coordinate": [3, 4]}, A.Click(3.0, 4.0)),
        ({"action": "right_click", "coordinate": [3, 4]}, A.Click(3.0, 4.0, "right")),
        ({"action": "double_click", "coordinate": [3, 4]}, A.Click(3.0, 4.0, "left", 2)),
        ({"action": "mouse_move", "coordinate": [5, 6]}, A.Move(5.0, 6.0)),
        (
            {"action": "left_click_drag", "start_coordinate": [1, 2], "coordinate": [5, 6]},
            A.Drag(5.0, 6.0, 1.0, 2.0),
        ),
        ({"action": "type", "text": "hi"}, A.TypeText("hi")),
        ({"action": "key", "text": "ctrl+shift+t"}, A.Key(("ctrl", "shift", "t"))),
        (
            {
                "action": "scroll",
                "coordinate": [5, 6],
                "scroll_direction": "up",
                "scroll_amount": 2,
            },
            A.Scroll(5.0, 6.0, 0, -2.0),
        ),
        ({"action": "wait", "duration": 2}, A.Wait(2.0)),
    ],
)
def test_computer_tool_translation_round_trips(inp, action):
    assert AnthropicAgent.to_action(inp) == action
    assert AnthropicAgent.to_action(AnthropicAgent.to_input(action)) == action
    assert isinstance(AnthropicAgent.to_action({"action": "fly"}), A.InvalidAction)
