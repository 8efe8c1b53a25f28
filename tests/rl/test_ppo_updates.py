"""Several optimizer updates per batch (`train.ppo_update`, `rl.ppo_epochs` x
`rl.ppo_minibatches`): the first update's PPO ratio and clip fractions equal hand-computed
numbers, later updates move the ratio off them and clip where a separate forward of the updated
policy says, and the learner's version moves by one per batch."""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cua_jax.models import qwen_vl
from cua_jax.rl.learner import Learner, LossConfig, OptimizerConfig
from cua_jax.rl.ppo import ppo_update
from cua_jax.rl.trajectory import Trajectory, Turn

V = 256
_TINY = qwen_vl.tiny("qwen3_vl", vocab_size=V)
CFG = _TINY.replace(
    text=dataclasses.replace(_TINY.text, num_hidden_layers=1),
    vision=dataclasses.replace(_TINY.vision, depth=1, deepstack_visual_indexes=(0,)),
)
EPS_LOW, EPS_HIGH = 0.2, 0.28
# (reward, generated tokens, ratio π/μ at the first update) per episode; two groups of two
EPISODES = [[(1.0, 5, 1.5), (0.0, 3, 0.9)], [(0.0, 4, 0.5), (1.0, 2, 1.1)]]


def _learner():
    model = qwen_vl.QwenVL(CFG, rngs=nnx.Rngs(0))
    # lm_head = 0: every logit is 0, so π(token) = 1/V exactly until the first update
    model.lm_head.kernel[...] = jnp.zeros_like(model.lm_head.kernel[...])
    return Learner(
        model,
        optimizer=OptimizerConfig(learning_rate=0.05, max_grad_norm=None),
        loss=LossConfig(eps_low=EPS_LOW, eps_high=EPS_HIGH, old_logprobs="behaviour"),
        seq_len_buckets=(32,),
    )


def _groups():
    rng = np.random.default_rng(0)
    groups = []
    for g, episodes in enumerate(EPISODES):
        group = []
        for reward, n, ratio in episodes:
            # μ = π / ratio  ->  log μ = -log V - log ratio
            mu = np.full(n, -math.log(V) - math.log(ratio), np.float32)
            turn = Turn(rng.integers(0, 200, 6), rng.integers(0, 200, n), mu)
            group.append(Trajectory("task", f"g{g}", [turn], reward=reward, success=reward > 0))
        groups.append(group)
    return groups


def test_first_update_ratio_and_clipping_equal_hand_numbers_then_the_ratio_moves():
    learner = _learner()
    info, out = ppo_update(learner, _groups(), epochs=2)
    # hand numbers, first update: tokens 5 x 1.5, 3 x 0.9, 4 x 0.5, 2 x 1.1 (14 in all).
    # Advantages: + for reward 1, - for reward 0. Clipped high: Â > 0 and r > 1.28 -> the 5
    # tokens at 1.5 (1.1 is inside). Clipped low: Â < 0 and r < 0.8 -> the 4 tokens at 0.5
    # (0.9 is inside).
    assert out["updates"] == 2.0 and info["samples"] == 4.0
    assert out["ratio_mean_first"] == pytest.approx((7.5 + 2.7 + 2.0 + 2.2) / 14, rel=1e-5)
    assert out["ratio_max"] >= 1.5 - 1e-5
    first = _learner()
    _, one = ppo_update(first, _groups(), epochs=1)
    assert one["ratio_mean"] == pytest.approx(14.4 / 14, rel=1e-5)
    assert one["clip_frac_high"] == pytest.approx(5 / 14, rel=1e-6)
    assert one["clip_frac_low"] == pytest.approx(4 / 14, rel=1e-6)
    assert one["ratio_max"] == pytest.approx(1.5, rel=1e-5)
    # the second pass sees the policy after one update: the ratio is off the hand numbers
    assert abs(out["ratio_mean_last"] - out["ratio_mean_first"]) > 1e-3
    # ... and clips where the updated policy's own log-probs say (a separate forward of `first`,
    # which made exactly the first update): r = exp(log π_1 - log μ)
    batch, _ = first.prepare_batch(_groups())
    logp = first.token_logprobs(batch)
    mask = batch.loss_mask
    r = np.exp(logp - batch.behaviour_logprobs)[mask]
    adv = batch.advantages[mask]
    assert out["ratio_mean_last"] == pytest.approx(r.mean(), rel=1e-4)
    assert out["clip_frac_high_last"] == pytest.approx(np.mean((adv > 0) & (r > 1 + EPS_HIGH)))
    assert out["clip_frac_low_last"] == pytest.approx(np.mean((adv < 0) & (r < 1 - EPS_LOW)))
    # one learner version per batch, however many optimizer updates
    assert learner.version == 1 and first.version == 1


def test_minibatches_split_whole_groups_one_update_each():
    learner = _learner()
    _, out = ppo_update(learner, _groups(), epochs=2, minibatches=2)
    assert out["updates"] == 4.0 and learner.version == 1
    # mini-batch 0 is group 0 alone: tokens 5 x 1.5 and 3 x 0.9 before any update
    assert out["ratio_mean_first"] == pytest.approx((7.5 + 2.7) / 8, rel=1e-5)


def test_no_signal_and_empty_batches_make_no_update():
    learner = _learner()
    flat = [[dataclasses.replace(t, reward=0.0) for t in g] for g in _groups()]
    info, out = ppo_update(learner, flat, epochs=2)
    assert out is None and info["groups_filtered_zero_variance"] == 2.0
    assert ppo_update(learner, [], epochs=2) == ({"groups": 0.0, "samples": 0.0}, None)
    assert learner.version == 0
