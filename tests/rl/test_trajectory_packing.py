"""Trajectory -> samples (chains of extending turns) and packing into rows."""

import numpy as np
import pytest

from cua_jax.rl import packing
from cua_jax.rl.trajectory import Trajectory, Turn, trajectory_to_samples, turn_chains


def _turn(prompt, gen, extends=False, images=0):
    pv = grid = None
    if images:
        grid = np.array([[1, 2, 2]] * images)
        pv = np.arange(images * 4 * 3, dtype=np.float32).reshape(images * 4, 3)
    return Turn(
        prompt_ids=prompt,
        generated_ids=gen,
        logprobs=-0.1 * np.arange(1, len(gen) + 1),
        pixel_values=pv,
        image_grid_thw=grid,
        extends_previous=extends,
    )


def test_extending_turns_make_one_sample_with_every_turn_trained():
    t0 = _turn([1, 2, 3], [10, 11])
    t1 = _turn([1, 2, 3, 10, 11, 4, 5], [12], extends=True)
    t2 = _turn([1, 2, 3, 10, 11, 4, 5, 12, 6], [13, 14, 15], extends=True)
    traj = Trajectory("task", "g0", [t0, t1, t2], reward=1.0, policy_version=3)
    (s,) = trajectory_to_samples(traj, advantage=0.5)
    np.testing.assert_array_equal(s.input_ids, [1, 2, 3, 10, 11, 4, 5, 12, 6, 13, 14, 15])
    np.testing.assert_array_equal(s.loss_mask, [0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1, 1])
    np.testing.assert_allclose(
        s.behaviour_logprobs, [0, 0, 0, -0.1, -0.2, 0, 0, -0.1, 0, -0.1, -0.2, -0.3], rtol=1e-6
    )
    np.testing.assert_array_equal(s.position_ids, np.tile(np.arange(12), (3, 1)))
    assert s.advantage == 0.5 and s.policy_version == 3


def test_cut_history_gives_one_sample_per_chain_with_its_own_context():
    t0 = _turn([1, 2], [10], images=1)
    t1 = _turn([1, 2, 10, 3], [11], extends=True, images=1)
    t2 = _turn([7, 3], [12, 13], images=1)  # history window dropped the first screenshot
    traj = Trajectory("task", "g0", [t0, t1, t2])
    assert [len(c) for c in turn_chains(traj)] == [2, 1]
    s0, s1 = trajectory_to_samples(traj, 1.0, position_fn=lambda ids, g: np.zeros((3, len(ids))))
    np.testing.assert_array_equal(s0.input_ids, [1, 2, 10, 3, 11])
    np.testing.assert_array_equal(s0.loss_mask, [0, 0, 1, 0, 1])
    assert s0.image_grid_thw.shape == (2, 3) and s0.pixel_values.shape == (8, 3)
    np.testing.assert_array_equal(s1.input_ids, [7, 3, 12, 13])
    np.testing.assert_array_equal(s1.loss_mask, [0, 0, 1, 1])
    assert s1.image_grid_thw.shape == (1, 3)
    with pytest.raises(ValueError, match="position_fn"):
        trajectory_to_samples(traj, 1.0)  # images need the model's M-RoPE


def test_false_extends_claim_is_refused():
    t0 = _turn([1, 2], [10])
    t1 = _turn([1, 9, 10, 3], [11], extends=True)
    with pytest.raises(ValueError, match="extends_previous"):
        trajectory_to_samples(Trajectory("t", "g", [t0, t1]), 1.0)
    with pytest.raises(ValueError, match="logprobs"):
        Turn(prompt_ids=[1], generated_ids=[2, 3], logprobs=[0.0])


def _samples(lengths, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        p = n // 2
        t = Turn(
            prompt_ids=rng.integers(1, 50, p),
            generated_ids=rng.integers(1, 50, n - p),
            logprobs=-rng.random(n - p),
        )
        out += trajectory_to_samples(Trajectory("t", "g", [t]), advantage=float(i) - 1.5)
    return out


def test_pack_layout_and_padding_share():
    samples = _samples([60, 30, 20, 50, 10])
    b = packing.pack(samples, seq_len_buckets=(32, 64, 128), row_multiple=2)
    r, l = b.shape
    assert l == 64 and r == 4  # FFD: [60], [50, 10], [30, 20] -> 3 rows, rounded to 2*2
    assert b.padding_share == pytest.approx(1 - 170 / (4 * 64))
    # Every sample's tokens, mask, log-probs and advantage appear intact in one segment.
    found = 0
    for s in samples:
        for row in range(r):
            for k in range(1, b.segment_ids[row].max() + 1):
                sel = b.segment_ids[row] == k
                if sel.sum() == s.length and np.array_equal(b.input_ids[row, sel], s.input_ids):
                    np.testing.assert_array_equal(b.loss_mask[row, sel], s.loss_mask)
                    np.testing.assert_array_equal(
                        b.behaviour_logprobs[row, sel], s.behaviour_logprobs
                    )
                    np.testing.assert_array_equal(b.position_ids[:, row, sel], s.position_ids)
                    assert (b.advantages[row, sel] == s.advantage).all()
                    found += 1
    assert found == len(samples)
    assert b.loss_weights.sum() == pytest.approx(1.0)
    assert b.loss_weights[~b.loss_mask].sum() == 0


def test_pack_errors_name_the_fix():
    with pytest.raises(ValueError, match="bucket"):
        packing.pack(_samples([100]), seq_len_buckets=(32, 64))
    with pytest.raises(ValueError, match="num_rows"):
        packing.pack(_samples([60, 60, 60]), seq_len_buckets=(64,), num_rows=2)


def test_seq_mean_modes_average_over_rollouts_not_chains():
    """A rollout whose history window split it into two samples is still one sequence: under
    "seq-mean-token-mean" rollouts A (one chain) and B (two chains) weigh 1/2 each, and Dr.
    GRPO divides by the 2 rollouts and the constant C, whatever the row length."""
    pos = lambda ids, g: np.zeros((3, len(ids)))  # noqa: E731
    a = Trajectory("task", "g0", [_turn([1, 2, 3], [10, 11, 12, 13])])
    b = Trajectory(
        "task",
        "g0",
        [
            _turn([1, 2], [10], images=1),
            _turn([1, 2, 10, 3], [11], extends=True, images=1),
            _turn([7, 3], [12, 13], images=1),
        ],
    )
    samples = trajectory_to_samples(a, 1.0, pos) + trajectory_to_samples(b, -1.0, pos)
    assert len(samples) == 3 and samples[1].episode == samples[2].episode != samples[0].episode

    def per_rollout(batch):
        w = batch.loss_weights
        a_rows = batch.advantages > 0
        return float(w[a_rows].sum()), float(w[batch.advantages < 0].sum()), w

    for kw in [dict(seq_len_buckets=(16,)), dict(seq_len_buckets=(8,), num_rows=3)]:
        wa, wb, _ = per_rollout(packing.pack(samples, agg_mode="seq-mean-token-mean", **kw))
        assert wa == pytest.approx(0.5) and wb == pytest.approx(0.5)
        wa, wb, w = per_rollout(
            packing.pack(samples, agg_mode="seq-mean-token-sum-norm", loss_norm=10, **kw)
        )
        assert wa == pytest.approx(4 / 20) and wb == pytest.approx(4 / 20)  # tokens / (2 x C)
        np.testing.assert_allclose(w[w > 0], 1 / 20)
    # Samples built by hand (no episode) stay sequences of their own.
    lone = _samples([6, 8])
    assert all(s.episode >= 0 for s in lone)
    for s in lone:
        s.episode = -1
    w = packing.pack(lone, agg_mode="seq-mean-token-mean", seq_len_buckets=(16,)).loss_weights
    assert w.sum() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="needs loss_norm"):
        packing.pack(samples, agg_mode="seq-mean-token-sum-norm", seq_len_buckets=(16,))
