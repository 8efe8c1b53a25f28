"""The learner's log-prob path on a tiny Qwen3.5 (hybrid Gated DeltaNet / full attention): the
per-token log-probs of a packed batch (several samples a row) equal each sample's log-probs
from a plain forward of the sample alone, so the linear layers' state restarts at every
sample boundary inside the learner's jitted program (the learner passes only segment ids to
`model.attn_fn`; the model hands them to its linear layers)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cua_jax.models import qwen_vl
from cua_jax.rl.learner import Learner, OptimizerConfig
from cua_jax.rl.trajectory import trajectory_to_samples
from tests.models.tiny_learner import random_text_group


@nnx.jit
def _alone_logprobs(model, ids_RL, mask_RL, pos_3RL):
    logits = model(ids_RL, attention_mask=mask_RL, position_ids=pos_3RL)
    lp = jax.nn.log_softmax(logits[:, :-1], -1)
    return jnp.take_along_axis(lp, ids_RL[:, 1:, None], -1)[..., 0]


@pytest.mark.parametrize(
    "moe",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                os.environ.get("CUA_LONG_TESTS") != "1",
                reason="the MoE repeat (routing replay on) costs ~15 s of CPU: CUA_LONG_TESTS=1",
            ),
        ),
    ],
)
def test_packed_learner_logprobs_equal_each_sample_alone(moe):
    cfg = qwen_vl.tiny("qwen3_5", vocab_size=256, moe=moe)
    learner = Learner(
        qwen_vl.QwenVL(cfg, rngs=nnx.Rngs(0)),
        optimizer=OptimizerConfig(learning_rate=1e-3),
        seq_len_buckets=(64,),
    )
    group = random_text_group(prompt_len=(10, 20), gen_len=(4, 9), size=6, seed=3)
    pos = learner.position_fn()
    samples = [s for t in group for s in trajectory_to_samples(t, t.reward - 0.5, pos)]
    batch = learner.pack(samples)
    lp = learner.token_logprobs(batch)

    # every sample of the packed batch, alone in a row of its own (right-padded)
    L = batch.input_ids.shape[1]
    ids, mask, posn, where = [], [], [], []
    for r in range(batch.input_ids.shape[0]):
        for seg in np.unique(batch.segment_ids[r]):
            if seg == 0:
                continue
            cols = np.nonzero(batch.segment_ids[r] == seg)[0]
            n = len(cols)
            ids.append(np.pad(batch.input_ids[r, cols], (0, L - n)))
            mask.append(np.pad(np.ones(n, np.int32), (0, L - n)))
            posn.append(np.pad(batch.position_ids[:, r, cols], ((0, 0), (0, L - n))))
            where.append((r, cols))
    assert len(where) == len(samples) > batch.input_ids.shape[0]  # really packed
    alone = np.asarray(
        _alone_logprobs(learner.model, np.stack(ids), np.stack(mask), np.stack(posn, axis=1))
    )
    for i, (r, cols) in enumerate(where):
        scored = batch.loss_mask[r, cols][1:]
        assert scored.any()
        np.testing.assert_allclose(
            lp[r, cols[1:]][scored], alone[i, : len(cols) - 1][scored], rtol=1e-5, atol=1e-5
        )
