"""The RL loop learns: sampler -> trajectories -> GRPO step -> weights back to the sampler.

A one-step bandit on the tiny model: after a fixed prompt, a first sampled token below 64 earns
reward 1, anything else 0 (about a quarter of the vocabulary, so groups have reward variance).
A dozen GRPO steps of 2 groups x 8 rollouts must raise the policy's probability of the rewarded
tokens well above where random init put it, measured exactly from the model's logits. The
learner's own checks (ratio 1 on-policy, packing, sharding) are in test_learner.py; this is the
end-to-end sign and size of the update.
"""

import dataclasses

import jax
import numpy as np
from flax import nnx

from cua_jax.models import qwen_vl
from cua_jax.rl.learner import Learner, OptimizerConfig
from cua_jax.rl.trajectory import Trajectory, Turn
from cua_jax.sampler import Engine, SamplingParams

_TINY = qwen_vl.tiny("qwen3_vl", vocab_size=256)
CFG = _TINY.replace(
    text=dataclasses.replace(_TINY.text, num_hidden_layers=1),
    vision=dataclasses.replace(_TINY.vision, depth=1, deepstack_visual_indexes=(0,)),
)
PROMPT = np.array([5, 17, 42, 8, 99, 3], np.int32)
GOOD = 64  # first tokens below this are rewarded


def _p_good(model) -> float:
    logits = model(PROMPT[None])[0, -1]
    return float(jax.nn.softmax(logits)[:GOOD].sum())


def test_grpo_raises_the_probability_of_rewarded_actions():
    model = qwen_vl.QwenVL(CFG, rngs=nnx.Rngs(0))
    engine = Engine(model, max_slots=16, page_size=8, num_pages=64, max_seq_len=32, decode_chunk=4)
    learner = Learner(
        model,
        optimizer=OptimizerConfig(learning_rate=1e-2),
        seq_len_buckets=(32,),
        banned_token_ids=CFG.vision_placeholder_ids,
    )
    engine.update_params(learner.params_for_sampler(), learner.version)
    p0 = _p_good(model)
    rewards = []
    for step in range(12):
        reqs = [
            dict(
                prompt_ids=PROMPT,
                params=SamplingParams(
                    temperature=1.0,
                    seed=1000 * step + i,
                    max_new_tokens=2,
                    banned_token_ids=CFG.vision_placeholder_ids,
                ),
            )
            for i in range(16)
        ]
        outs = engine.generate_batch(reqs)
        groups = [[], []]
        for i, o in enumerate(outs):
            r = float(o.tokens[0] < GOOD)
            turn = Turn(PROMPT, np.asarray(o.tokens, np.int32), np.asarray(o.logprobs))
            groups[i // 8].append(
                Trajectory("bandit", f"{step}/{i // 8}", [turn], reward=r, policy_version=o.version)
            )
            rewards.append(r)
        batch, info = learner.prepare_batch(groups)
        if batch is not None:
            m = learner.train_step(batch)
            assert abs(m["ratio_mean"] - 1.0) < 1e-4  # on-policy: the sampler's log-probs
        engine.update_params(learner.params_for_sampler(), learner.version)
    p1 = _p_good(model)
    assert p0 < 0.4, p0  # random init: about a quarter of the mass
    assert p1 > 0.8, (p0, p1)  # measured: 0.25 -> 0.96
    assert np.mean(rewards[-32:]) > np.mean(rewards[:32]) + 0.4, rewards  # 0.28 -> 0.88
