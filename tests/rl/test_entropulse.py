"""Entropulse: SFT phases at the configured steps, on this run's successes only (deduplicated
per task, most recent first), entropy measured before and after; the entropy probe against the
learner's own step metric."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from cua_jax.models import qwen_vl
from cua_jax.rl.entropulse import Entropulse, policy_entropy
from cua_jax.rl.learner import Learner, OptimizerConfig
from cua_jax.rl.trajectory import Trajectory, Turn, text_position_ids


def _traj(task, gen, *, success, version, fault=None):
    prompt = np.array([1, 2, 3, 4], np.int32)
    turn = Turn(prompt, np.asarray(gen, np.int32), np.zeros(len(gen), np.float32))
    return Trajectory(
        task,
        "g",
        [turn],
        reward=float(success),
        success=success,
        policy_version=version,
        failure_reason=fault,
    )


class FakeLearner:
    """Records what the SFT steps train on (pack returns the samples themselves)."""

    def __init__(self):
        self.sft_batches = []

    def position_fn(self):
        return text_position_ids

    def pack(self, samples):
        return list(samples)

    def sft_step(self, batch):
        self.sft_batches.append([tuple(s.input_ids[4:]) for s in batch])
        return {"loss": 1.0 / len(self.sft_batches)}


def test_phases_alternate_and_train_only_on_this_runs_successes():
    learner = FakeLearner()
    pulse = Entropulse(
        every=2, sft_steps=3, rows=2, entropy_fn=lambda lr, b: float(len(lr.sft_batches))
    )
    steps = {
        1: [
            [
                _traj("a", [10, 11], success=True, version=0),
                _traj("a", [10, 11], success=True, version=0),  # a duplicate
                _traj("a", [12], success=False, version=0),
                _traj("b", [20], success=True, version=0, fault="env_error: gone"),
            ]
        ],
        2: [[_traj("b", [21], success=True, version=1), _traj("a", [13], success=True, version=1)]],
        3: [
            [_traj("c", [30], success=True, version=2), _traj("c", [31], success=False, version=2)]
        ],
        4: [
            [_traj("c", [32], success=False, version=3), _traj("c", [33], success=False, version=3)]
        ],
        5: [
            [_traj("d", [40], success=False, version=3), _traj("d", [41], success=False, version=3)]
        ],
        6: [
            [_traj("d", [42], success=False, version=4), _traj("d", [43], success=False, version=4)]
        ],
    }
    rows = {s: pulse.after_step(s, learner, g) for s, g in steps.items()}
    assert [s for s, r in rows.items() if r] == [2, 4, 6]  # a phase after every 2 RL steps
    first, second, third = rows[2], rows[4], rows[6]
    # Phase 1: the successes of steps 1-2, once each, task a's newest first, tasks interleaved.
    assert first["entropulse/episodes"] == 3 and first["entropulse/tasks"] == 2
    trained1 = learner.sft_batches[:3]
    assert trained1 == [[(13,), (21,)], [(10, 11), (13,)], [(21,), (10, 11)]]
    assert first["entropulse/entropy_before"] == 0.0 and first["entropulse/entropy_after"] == 3.0
    assert first["entropulse/phase"] == 1.0 and first["entropulse/sft_steps"] == 3
    # Phase 2 sees only what succeeded since phase 1 (step 3's one success, not a/b again).
    assert second["entropulse/episodes"] == 1
    assert learner.sft_batches[3:] == [[(30,)]] * 3
    # Phase 3: nothing succeeded since phase 2, so no SFT step runs.
    assert third["entropulse/skipped_no_success"] == 1.0 and len(learner.sft_batches) == 6
    assert pulse.phases == 3


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="every"):
        Entropulse(every=0, sft_steps=3)
    with pytest.raises(ValueError, match="rows"):
        Entropulse(every=2, sft_steps=3, rows=0)


def test_entropy_probe_equals_the_step_metric_and_optimizer_reset():
    tiny = qwen_vl.tiny("qwen3_vl", vocab_size=256)
    cfg = tiny.replace(
        text=dataclasses.replace(tiny.text, num_hidden_layers=1),
        vision=dataclasses.replace(tiny.vision, depth=1, deepstack_visual_indexes=(0,)),
    )
    learner = Learner(
        qwen_vl.QwenVL(cfg, rngs=nnx.Rngs(0)),
        optimizer=OptimizerConfig(learning_rate=1e-3),
        seq_len_buckets=(64,),
    )
    rng = np.random.default_rng(0)
    groups = [
        [
            _traj("a", rng.integers(5, 200, 6), success=True, version=0),
            _traj("a", rng.integers(5, 200, 5), success=False, version=0),
        ]
    ]
    batch, _ = learner.prepare_batch(groups)
    metrics, _ = learner.loss_and_grads(batch)
    assert policy_entropy(learner, batch) == pytest.approx(metrics["entropy"], rel=1e-5)
    # An SFT phase on the success moves the policy; a reset leaves a fresh optimizer state.
    pulse = Entropulse(every=1, sft_steps=2, rows=2, reset_optimizer=True)
    row = pulse.after_step(1, learner, groups)
    assert row["entropulse/entropy_after"] != row["entropulse/entropy_before"]
    fresh = learner._tx.init(learner._trainable)
    for x, y in zip(jax.tree.leaves(learner._opt_state), jax.tree.leaves(fresh), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
