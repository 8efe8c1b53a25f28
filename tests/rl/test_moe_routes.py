"""MoE routes from the sampler to the training samples (routing replay's input).

* a Turn's routes are token-aligned into its chain's Sample (-1 on prompt / observation tokens),
  dense trajectories carry none, and a routes array of the wrong length is refused;
* end to end: a sampled episode of the agent loop on a real Engine over a tiny MoE model; every
  generated token's recorded experts in the Sample equal what the learner-side full forward over
  that Sample (images, M-RoPE positions) chooses at the same position.
"""

import asyncio

import numpy as np
import pytest

from cua_jax.data.processor import QwenVLProcessor
from cua_jax.models import qwen_vl
from cua_jax.rl.policies import Reply, SamplerPolicy
from cua_jax.rl.rollout import AgentLoop, RolloutSettings
from cua_jax.rl.trajectory import (
    Trajectory,
    Turn,
    rope_position_fn,
    trajectory_to_samples,
    turn_chains,
)
from cua_jax.sampler import Engine
from tests.rl.test_rollout import TASK, Pool


def _routes(g, seed):
    return np.random.default_rng(seed).integers(0, 8, (g, 2, 2)).astype(np.int32)


def test_turn_routes_are_token_aligned_in_samples():
    t1 = Turn([1, 2, 3], [4, 5], [-0.1, -0.2], routes=_routes(2, 0))
    t2 = Turn(
        [1, 2, 3, 4, 5, 6], [7, 8, 9], [-0.3] * 3, extends_previous=True, routes=_routes(3, 1)
    )
    t3 = Turn([1, 9], [10], [-0.4], routes=_routes(1, 2))  # a cut history: a new chain
    traj = Trajectory("t", "g", [t1, t2, t3])
    s1, s2 = trajectory_to_samples(traj, 1.0)
    assert s1.routes.shape == (9, 2, 2) and s2.routes.shape == (3, 2, 2)
    want = np.full((9, 2, 2), -1, np.int32)
    want[3:5], want[6:9] = t1.routes, t2.routes
    np.testing.assert_array_equal(s1.routes, want)
    np.testing.assert_array_equal(s2.routes[2:], t3.routes)
    assert (s2.routes[:2] == -1).all()
    # Dense: no routes anywhere.
    dense = Trajectory("t", "g", [Turn([1, 2], [3], [-0.1])])
    assert trajectory_to_samples(dense, 0.0)[0].routes is None
    with pytest.raises(ValueError, match="one row of experts per generated token"):
        Turn([1, 2], [3, 4], [-0.1, -0.2], routes=_routes(3, 0))
    assert Reply([1], np.zeros(1)).routes is None


@pytest.fixture(scope="module")
def proc():
    return QwenVLProcessor.default("qwen3_vl", max_pixels=64 * 64, min_pixels=32 * 32)


def test_sampled_episode_routes_equal_the_learner_forward(proc):
    tok = proc.tokenizer
    cfg = qwen_vl.tiny("qwen3_vl", vocab_size=tok.vocab_size, moe=True, **tok.vision_token_ids())
    model = qwen_vl.init_random(cfg, seed=0)
    engine = Engine(model, max_slots=2, page_size=16, num_pages=256, max_seq_len=2048)
    loop = AgentLoop(engine, proc, RolloutSettings(max_turns=2, max_new_tokens=8))
    (traj,) = asyncio.run(loop.run_group(Pool(1), TASK, 1, seed=3, group_id="g"))
    assert len(traj.turns) >= 1 and all(t.routes is not None for t in traj.turns)
    samples = trajectory_to_samples(traj, 1.0, rope_position_fn(cfg))
    checked = 0
    for s, chain in zip(samples, turn_chains(traj), strict=True):
        _, info = model(
            s.input_ids[None],
            pixel_values=s.pixel_values,
            image_grid_thw=s.image_grid_thw,
            position_ids=s.position_ids[:, None],
            return_routing=True,
        )
        experts_TLK = np.transpose(np.asarray(info.experts[:, 0]), (1, 0, 2))
        rec = np.all(s.routes >= 0, axis=(1, 2))
        assert not rec[~s.loss_mask].any()  # only generated tokens carry routes
        # each turn's last token was never fed back: unrecorded
        assert rec.sum() == s.loss_mask.sum() - sum(1 for t in chain if t.generated_ids.size)
        np.testing.assert_array_equal(np.sort(s.routes[rec], -1), np.sort(experts_TLK[rec], -1))
        checked += int(rec.sum())
    assert checked > 0


def test_sampler_policy_hands_on_the_engines_routes():
    class FakeOut:
        tokens, logprobs, finish_reason, version = [3, 4], np.zeros(2), "stop", 1
        routes = _routes(2, 5)

    class FakeEngine:
        version = 1

        async def generate(self, *a, **kw):
            return FakeOut()

    from cua_jax.rl.policies import TurnContext

    policy = SamplerPolicy(FakeEngine(), stop_token_ids=[4], seeds=lambda k: k, session="s")
    ctx = TurnContext(
        env=None,
        task=TASK,
        turn=0,
        screenshot=np.zeros((4, 4, 3), np.uint8),
        space=None,
        prompt_ids=np.asarray([1, 2]),
        pixel_values=None,
        image_grid_thw=None,
    )
    reply = asyncio.run(policy.act(ctx))
    np.testing.assert_array_equal(reply.routes, FakeOut.routes)
