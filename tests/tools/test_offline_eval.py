"""Offline step scoring (cua_jax.evaluation.offline, tools/offline_eval.py): the matching rules,
oracle demonstrations written by the trainer's TrajectoryWriter scored at 1.0, a random clicker
at its computed rate, JSONL screenshot steps with boxes, and agents on them."""

import asyncio
import contextlib
import json

import numpy as np
import pytest

from cua_jax import actions as A
from cua_jax.data.processor import QwenVLProcessor
from cua_jax.env_api import INFO_DONE_REASON, Observation, StepResult, Task
from cua_jax.evaluation import offline as O
from cua_jax.evaluation.openai_chat import encode_image
from cua_jax.rl.rollout import AgentLoop, RolloutSettings
from cua_jax.rl.store import TrajectoryReader, TrajectoryWriter
from tools.agents import AgentReply

W, H = 96, 64


def test_matching_rules():
    scr = (100, 50)
    g = A.Click(50.0, 25.0)
    ok = lambda p, g, **kw: O.action_matches(p, g, scr, **kw)  # noqa: E731
    assert ok(A.Click(53.0, 25.0), g)  # 0.03 of the width
    assert not ok(A.Click(56.0, 25.0), g)  # 0.06
    assert not ok(A.Click(50.0, 28.0), g)  # 3 px of 50 = 0.06 of the height
    assert ok(A.Click(50.0, 28.0), g, radius=0.07)
    assert not ok(A.Click(50.0, 25.0, button="right"), g)
    assert not ok(A.Click(50.0, 25.0, count=2), g)
    assert ok(A.Click(10.0, 10.0), g, bbox=(0, 0, 20, 20)) and not ok(g, g, bbox=(0, 0, 20, 20))
    assert not ok(A.Move(50.0, 25.0), g)
    assert ok(A.TypeText(" hello "), A.TypeText("hello")) and not ok(
        A.TypeText("hell"), A.TypeText("hello")
    )
    assert ok(A.Key(("ctrl", "c")), A.Key(("ctrl", "c"))) and not ok(
        A.Key(("c",)), A.Key(("ctrl", "c"))
    )
    assert ok(A.Scroll(None, None, 0, 3), A.Scroll(None, None, 0, 5))
    assert not ok(A.Scroll(None, None, 0, -3), A.Scroll(None, None, 0, 5))
    assert ok(A.Done(), A.Done()) and not ok(A.Fail(), A.Done())
    assert not ok(A.InvalidAction("x", "bad"), A.InvalidAction("x", "bad"))
    assert ok(A.Drag(50.0, 25.0, 0.0, 0.0), A.Drag(51.0, 25.0, 1.0, 1.0))
    assert not ok(A.Drag(50.0, 25.0, 30.0, 0.0), A.Drag(51.0, 25.0, 1.0, 1.0))
    step = O.Step("t", 0, "", [g, A.TypeText("x")], scr, A.CoordinateSpace.identity(*scr))
    assert O.step_correct([A.Click(50.0, 26.0), A.TypeText("x")], step)
    assert not O.step_correct([A.Click(50.0, 26.0)], step)


class TargetEnv:
    """Click the square (placed by the seed), type its name, say done."""

    def __init__(self):
        self.steps, self.pos, self.hit, self.typed = 0, (0, 0), False, ""

    def _obs(self):
        img = np.full((H, W, 3), 40 + 20 * self.steps, np.uint8)
        x, y = self.pos
        img[y : y + 10, x : x + 10] = (255, 0, 0)
        return Observation(img, "click the square, then type its name")

    async def reset(self, task, seed=None):
        self.steps, self.hit, self.typed = 0, False, ""
        self.pos = (5 + (seed * 17) % (W - 20), 5 + (seed * 11) % (H - 20))
        return self._obs()

    async def step(self, action):
        self.steps += 1
        x, y = self.pos
        if isinstance(action, A.Click):
            self.hit |= x <= action.x < x + 10 and y <= action.y < y + 10
        if isinstance(action, A.TypeText):
            self.typed += action.text
        done = isinstance(action, A.Done)
        return StepResult(self._obs(), done, 0.0, {INFO_DONE_REASON: "done"} if done else {})

    async def oracle_next(self):
        x, y = self.pos
        return [A.Click(x + 5.0, y + 5.0), A.TypeText("square"), A.Done()][min(self.steps, 2)]

    async def evaluate(self):
        return float(self.hit and self.typed == "square")

    async def close(self):
        pass


class Pool:
    def __len__(self):
        return 1

    @contextlib.asynccontextmanager
    async def acquire(self):
        yield TargetEnv()


@pytest.fixture(scope="module")
def proc():
    return QwenVLProcessor.default("qwen3_vl", max_pixels=W * H, min_pixels=32 * 32)


@pytest.fixture(scope="module")
def demo_dir(proc, tmp_path_factory):
    """Oracle demonstrations as the trainer keeps them (WORKDIR/sft_demos)."""
    loop = AgentLoop(None, proc, RolloutSettings(max_turns=4, system_prompt="compact"))
    tasks = [Task(id=f"target/{i}", instruction="x", source="test", seed=i) for i in range(12)]
    demos = asyncio.run(loop.demonstrations(Pool(), tasks))
    assert all(d.success for d in demos)
    out = str(tmp_path_factory.mktemp("sft") / "sft_demos")
    w = TrajectoryWriter(out)
    for d in demos:
        w.write(d)
    w.close()
    return out


def test_oracle_demos_score_one_and_random_clicks_their_rate(demo_dir, proc):
    steps = O.steps_from_trajectories(TrajectoryReader(demo_dir), proc, "qwen3vl")
    assert len(steps) == 36  # 12 episodes x (click, type, done)
    assert [O.kind_of(s.gold) for s in steps[:3]] == ["Click", "TypeText", "Done"]
    # the prompt of step k holds the images the policy saw (the first k+1 screenshots here)
    assert [len(s.image_grid_thw) for s in steps[:3]] == [1, 2, 2]
    rep = asyncio.run(O.evaluate_steps(steps, O.oracle_predictor("qwen3vl")))
    assert rep.accuracy == 1.0 and rep.by_kind["Click"].n == 12
    # random clicks: right only on click steps, with the probability of landing within the
    # radius of the gold point; measured over 40 passes vs the computed rate
    expected = float(np.mean([O.random_click_rate(s) for s in steps]))
    assert 0.002 < expected < 0.04
    got = [
        asyncio.run(O.evaluate_steps(steps, O.random_click_predictor(seed))).accuracy
        for seed in range(40)
    ]
    sd = np.sqrt(expected * (1 - expected) / (len(steps) * 40))
    assert abs(np.mean(got) - expected) < 4 * sd + 1e-3, (np.mean(got), expected)


def _jsonl(tmp_path):
    rng = np.random.default_rng(0)
    lines = []
    for i in range(30):
        img = rng.integers(0, 255, (H, W, 3), dtype=np.uint8)
        ref = f"shot{i}.png" if i % 2 else encode_image(img)
        if i % 2:
            from PIL import Image

            Image.fromarray(img).save(tmp_path / ref)
        lines.append(
            {
                "task_id": f"t{i // 3}",
                "step": i % 3,
                "instruction": "go",
                "screenshot": ref,
                "gold": {"type": "Click", "x": 20.0 + i, "y": 30.0},
                "bbox": [10, 20, 58, 52],
                "history": ["clicked a"] if i % 3 else [],
            }
        )
    lines.append(
        {
            "task_id": "tx",
            "instruction": "type",
            "screenshot": "shot1.png",
            "gold": '<tool_call>{"name": "computer_use", "arguments": '
            '{"action": "type", "text": "hi"}}</tool_call>',
        }
    )
    path = tmp_path / "steps.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return str(path)


def test_jsonl_steps_boxes_and_an_agent(tmp_path, proc):
    path = _jsonl(tmp_path)
    steps = O.steps_from_jsonl(path, "qwen3vl")
    assert len(steps) == 31 and steps[-1].gold == [A.TypeText("hi")]
    assert steps[0].screen == (W, H) and steps[0].bbox == (10, 20, 58, 52)
    assert asyncio.run(O.evaluate_steps(steps, O.oracle_predictor("qwen3vl"))).accuracy == 1.0
    # box of 48 x 32 on 96 x 64 = a quarter of the screen
    assert O.random_click_rate(steps[0]) == pytest.approx(0.25)
    # an agent that clicks the box's corner region, in Qwen3's 0-1000 frame
    from configs.qwen3vl_grpo import get_config
    from tools.agents import agent_predictor

    class Corner:
        name = "corner"
        seen = []

        async def act(self, turn):
            self.seen.append(turn)
            return AgentReply(
                '<tool_call>{"name": "computer_use", "arguments": {"action": '
                '"left_click", "coordinate": [150, 350]}}</tool_call>'
            )

    agent = Corner()
    cfg = get_config("smoke")
    rep = asyncio.run(O.evaluate_steps(steps, agent_predictor(agent, proc, cfg)))
    # (150, 350)/1000 of 96 x 64 = (14.4, 22.4): inside the box; the typing step is missed
    assert rep.correct == 30 and rep.by_kind["TypeText"].successes == 0
    assert "Previous actions: clicked a" in agent.seen[1].instruction
    assert agent.seen[0].screenshots[0].shape == (H, W, 3)
    with pytest.raises(ValueError, match="steps.jsonl:1"):
        bad = tmp_path / "bad" / "steps.jsonl"
        bad.parent.mkdir()
        bad.write_text('{"screenshot": "missing.png", "gold": {"type": "Done"}}\n')
        O.steps_from_jsonl(str(bad), "qwen3vl")
