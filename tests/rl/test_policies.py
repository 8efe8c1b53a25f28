"""Per-turn policies and recovery detours (cua_jax.rl.policies)."""

import asyncio
import dataclasses

import numpy as np
import pytest

from configs.qwen3vl_grpo import get_config
from cua_jax import actions as A
from cua_jax.data.processor import QwenVLProcessor
from cua_jax.env_api import Task
from cua_jax.rl import policies
from cua_jax.rl.policies import OraclePolicy, Reply, SamplerPolicy, Stop, TurnContext

W, H = 200, 100
SPACE = A.CoordinateSpace.relative(W, H)
FMT = A.get_format("qwen3vl")
TASK = Task(id="t/0", instruction="do it", source="test")


@pytest.fixture(scope="module")
def tok():
    return QwenVLProcessor.default("qwen3_vl", max_pixels=64 * 64, min_pixels=32 * 32).tokenizer


def _ctx(turn, env=None, task=TASK):
    prompt = np.arange(5 + turn, dtype=np.int32)
    pv, grid = np.ones((16, 8), np.float32), np.array([[1, 4, 4]], np.int32)
    return TurnContext(env, task, turn, np.zeros((H, W, 3), np.uint8), SPACE, prompt, pv, grid)


def _text(tok, reply):
    assert reply.generated_ids[-1] == tok.im_end_id
    assert reply.logprobs.dtype == np.float32 and not reply.logprobs.any()
    assert len(reply.logprobs) == len(reply.generated_ids)
    return tok.decode(list(reply.generated_ids[:-1]))


def test_oracle_policy_writes_the_task_oracle_in_the_models_format(tok):
    oracle = [A.Click(100, 50), A.TypeText("hi"), A.Done()]
    task = dataclasses.replace(TASK, oracle=oracle)
    policy = OraclePolicy(FMT, tok)
    assert policy.shaped_reward is False and policy.finish() == 0
    for k, want in enumerate(oracle):
        reply = asyncio.run(policy.act(_ctx(k, task=task)))
        assert reply.trained and _text(tok, reply) == FMT.format(want, SPACE)
        assert FMT.parse(_text(tok, reply), SPACE) == [want]
    assert asyncio.run(policy.act(_ctx(3, task=task))) == Stop(None)  # the sequence is over
    with pytest.raises(ValueError, match="t/0 has no oracle"):
        asyncio.run(policy.act(_ctx(0)))


def test_oracle_policy_asks_a_live_env_and_plays_the_detour_first(tok):
    class Env:
        def __init__(self):
            self.asked = 0

        async def oracle_next(self):
            self.asked += 1
            return A.Key("enter")

    env = Env()
    sizes = []
    detour = policies.ScreenFractionClick(0.5, 0.25)
    policy = OraclePolicy(FMT, tok, lambda w, h: sizes.append((w, h)) or detour(w, h))
    first = asyncio.run(policy.act(_ctx(0, env)))
    assert not first.trained and sizes == [(W, H)] and env.asked == 0
    assert FMT.parse(_text(tok, first), SPACE) == [A.Click(100.0, 25.0)]
    second = asyncio.run(policy.act(_ctx(1, env)))
    assert second.trained and env.asked == 1
    assert _text(tok, second) == FMT.format(A.Key("enter"), SPACE)
    # a fixed sequence starts over after the detour; a plain action works as a detour too
    task = dataclasses.replace(TASK, oracle=[A.Done()])
    policy = OraclePolicy(FMT, tok, A.Click(1, 2))
    assert FMT.parse(_text(tok, asyncio.run(policy.act(_ctx(0, task=task)))), SPACE) == [
        A.Click(1.0, 2.0)
    ]
    assert FMT.parse(_text(tok, asyncio.run(policy.act(_ctx(1, task=task)))), SPACE) == [A.Done()]
    assert asyncio.run(policy.act(_ctx(2, task=task))) == Stop(None)


def test_oracle_policy_stops_on_an_action_the_format_cannot_write(tok):
    task = dataclasses.replace(TASK, oracle=[A.MouseDown()])
    with pytest.raises(ValueError) as e:
        FMT.format(A.MouseDown(), SPACE)
    stop = asyncio.run(OraclePolicy(FMT, tok).act(_ctx(0, task=task)))
    assert stop == Stop(f"oracle_unformattable: {e.value}")


class FakeEngine:
    version = 9

    def __init__(self, outs):
        self.outs, self.calls, self.dropped = list(outs), [], []

    async def generate(
        self, prompt_ids, pixel_values, image_grid_thw, params, session_id, image_hashes=None
    ):
        self.calls.append((prompt_ids, pixel_values, image_grid_thw, params, session_id))
        return self.outs.pop(0)

    def drop_session(self, session_id):
        self.dropped.append(session_id)


@dataclasses.dataclass
class Out:
    tokens: list
    logprobs: list
    version: int
    finish_reason: str = "stop"
    error: str = ""


@pytest.mark.parametrize("greedy", [False, True])
def test_sampler_policy_sends_the_prompt_and_labels_the_weights(greedy):
    engine = FakeEngine([Out([5, 6, 2], [-0.1, -0.2, -0.3], 4), Out([7, 2], [-1.0, -2.0], 3)])
    policy = SamplerPolicy(
        engine,
        stop_token_ids=[2, 3],
        seeds=lambda k: 100 + k,
        session="g/1/1",
        temperature=0.7,
        top_p=0.9,
        max_new_tokens=12,
        banned_token_ids=[11],
        greedy=greedy,
    )
    assert policy.shaped_reward is (not greedy)
    replies = [asyncio.run(policy.act(_ctx(k))) for k in range(2)]
    assert replies[0] == Reply([5, 6, 2], replies[0].logprobs) and replies[1].generated_ids == [
        7,
        2,
    ]
    np.testing.assert_array_equal(replies[0].logprobs, np.float32([-0.1, -0.2, -0.3]))
    assert replies[0].logprobs.dtype == np.float32 and replies[0].trained
    for k, (prompt, pv, grid, params, session) in enumerate(engine.calls):
        ctx = _ctx(k)
        np.testing.assert_array_equal(prompt, ctx.prompt_ids)
        assert pv is not None and grid.tolist() == [[1, 4, 4]] and session == "g/1/1"
        assert params.seed == 100 + k and params.max_new_tokens == 12
        assert params.temperature == (0.0 if greedy else 0.7)
        assert params.top_p == (1.0 if greedy else 0.9)
        assert params.stop_token_ids == (2, 3) and params.banned_token_ids == (11,)
    assert policy.finish() == 3 and engine.dropped == ["g/1/1"]  # the oldest weights


def test_sampler_policy_reports_sampler_errors_and_the_engine_version_without_tokens():
    engine = FakeEngine([Out([], [], 4, "error", "out of pages")])
    policy = SamplerPolicy(engine, stop_token_ids=[2], seeds=lambda k: k, session="s")
    assert asyncio.run(policy.act(_ctx(0))) == Stop("sampler_error: out of pages")
    assert policy.finish() == 9 and engine.dropped == ["s"]


def test_recovery_detours_pick_the_share_and_land_on_the_episodes_screen():
    detours = policies.recovery_detours(40, share=0.5, seed=1)
    clicks = [d for d in detours if d is not None]
    assert len(detours) == 40 and len(clicks) == 20
    for w, h in [(1920, 1080), (640, 480), (64, 64)]:
        pts = np.array([[c.x, c.y] for c in (d(w, h) for d in clicks)])
        assert (pts >= 0).all() and (pts[:, 0] < w).all() and (pts[:, 1] < h).all()
        assert pts[:, 0].max() > 0.75 * w and pts[:, 1].max() > 0.75 * h  # spread over the screen
        assert pts[:, 0].min() < 0.25 * w and pts[:, 1].min() < 0.25 * h
    for d in clicks:
        c = d(1000, 1000)
        assert isinstance(c, A.Click) and c.button == "left" and c.count == 1
        assert (c.x, c.y) == (float(int(d.fx * 1000)), float(int(d.fy * 1000)))
    assert policies.recovery_detours(40, share=0.0, seed=1) == [None] * 40
    assert None not in policies.recovery_detours(5, share=1.0, seed=1)
    assert len([d for d in policies.recovery_detours(8, share=0.25, seed=9) if d]) == 2
    # deterministic in (n, share, seed); another seed picks other episodes
    assert policies.recovery_detours(40, share=0.5, seed=1) == detours
    assert policies.recovery_detours(40, share=0.5, seed=2) != detours
    with pytest.raises(ValueError, match="share=1.5 must be in"):
        policies.recovery_detours(4, share=1.5, seed=0)


def test_recovery_detours_equal_the_trainers_former_draw():
    """Pinned to what train._recovery_detours(config, 8) drew for the smoke config (seed 0,
    recovery_share 0.25), i.e. numpy's default_rng(config.seed + 1): episodes 3 and 4."""
    detours = policies.recovery_detours(8, share=0.25, seed=1)
    got = [None if d is None else d(1000, 1000) for d in detours]
    assert got == [None] * 3 + [A.Click(549.0, 27.0), A.Click(753.0, 538.0)] + [None] * 3
    assert [detours[3](1920, 1080), detours[4](1920, 1080)] == [
        A.Click(1055.0, 29.0),
        A.Click(1446.0, 581.0),
    ]


def _former_train_recovery_detours(config, n):
    """train._recovery_detours as it was (commit a34a024), before it moved here: the reference."""
    rng = np.random.default_rng(config.seed + 1)
    k = round(config.sft.recovery_share * n)
    which = set(rng.choice(n, size=k, replace=False).tolist()) if k else set()
    fractions = rng.random((n, 2))

    def click_at(fx, fy):
        return lambda w, h: A.Click(float(int(fx * w)), float(int(fy * h)))

    return [click_at(*fractions[i]) if i in which else None for i in range(n)]


@pytest.mark.parametrize("share,n,seed", [(0.5, 40, 0), (0.25, 8, 0), (1.0, 5, 3), (0.0, 7, 1)])
def test_recovery_detours_match_the_former_trainer_helper(share, n, seed):
    config = get_config("smoke")
    config.sft.recovery_share, config.seed = share, seed
    ref = _former_train_recovery_detours(config, n)
    mine = policies.recovery_detours(n, share=share, seed=config.seed + 1)
    for w, h in [(1920, 1080), (1280, 800), (64, 64)]:
        assert [d and d(w, h) for d in mine] == [d and d(w, h) for d in ref]
