"""The jitted GRPO learner on the tiny Qwen3-VL: sharded == single device, packed == unpacked,
gradient accumulation, zero advantage, on-policy ratio, images through the vision tower."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cua_jax import sharding as shd
from cua_jax.models import qwen_vl
from cua_jax.rl import packing
from cua_jax.rl.layout import BatchLayout
from cua_jax.rl.learner import Learner, LossConfig, OptimizerConfig, pad_images_to_bucket
from cua_jax.rl.trajectory import Trajectory, Turn, trajectory_to_samples

_TINY = qwen_vl.tiny("qwen3_vl", vocab_size=256)
# One decoder layer and one vision block (with DeepStack): each compile stays short on CPU.
CFG = _TINY.replace(
    text=dataclasses.replace(_TINY.text, num_hidden_layers=1),
    vision=dataclasses.replace(_TINY.vision, depth=1, deepstack_visual_indexes=(0,)),
)
PATCH_DIM = 3 * 2 * 16 * 16  # channels x temporal patch x patch x patch


def _image_prompt(rng, n_text):
    c = CFG
    # one 4x4-patch image = 4 merged tokens, between vision start/end
    return np.r_[
        rng.integers(0, 200, n_text),
        c.vision_start_token_id,
        [c.image_token_id] * 4,
        c.vision_end_token_id,
        rng.integers(0, 200, 2),
    ]


def make_groups(seed=0, n_groups=2, group_size=4, images=True):
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        grp = []
        for i in range(group_size):
            with_img = images and i % 2 == 0
            prompt = (
                _image_prompt(rng, rng.integers(2, 8))
                if with_img
                else rng.integers(0, 200, rng.integers(4, 14))
            )
            gen = rng.integers(0, 200, rng.integers(3, 9))
            t0 = Turn(
                prompt,
                gen,
                -rng.random(gen.size) * 3,
                pixel_values=rng.normal(size=(16, PATCH_DIM)).astype(np.float32)
                if with_img
                else None,
                image_grid_thw=np.array([[1, 4, 4]]) if with_img else None,
            )
            gen2 = rng.integers(0, 200, 3)
            t1 = Turn(
                np.r_[t0.full_ids, rng.integers(0, 200, 3)],
                gen2,
                -rng.random(3),
                extends_previous=True,
            )
            grp.append(
                Trajectory("task", f"g{g}", [t0, t1], reward=float(rng.random()), policy_version=0)
            )
        groups.append(grp)
    return groups


def _model(seed=0):
    return qwen_vl.QwenVL(CFG, rngs=nnx.Rngs(seed))


def _leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(state)]


def test_sharded_8_devices_equals_1_device_with_accumulation():
    """fsdp=4 x tensor=2 (one substep) == 1 device (two accumulated substeps), two steps, with
    images, KL to a frozen reference copy, entropy bonus, TIS and clip-higher all on; the
    8-device learner computes its log-probs 16 positions at a time (`logits_chunk`), the other
    in one piece."""
    assert len(jax.devices()) == 8
    loss = LossConfig(
        eps_high=0.28, old_logprobs="learner", tis_cap=2.0, kl_coef=0.05, entropy_coef=0.01
    )
    # eps=1 makes Adam's first steps ~ lr * g (a sign-like update would hide small errors)
    opt = OptimizerConfig(
        learning_rate=0.05,
        eps=1.0,
        warmup_steps=1,
        schedule="cosine",
        decay_steps=10,
        max_grad_norm=1.0,
    )
    groups = make_groups()
    one = Learner(_model(), optimizer=opt, loss=loss, num_substeps=2, seq_len_buckets=(64,))
    eight = Learner(
        _model(),
        mesh=shd.make_mesh(1, 4, 2),
        optimizer=opt,
        loss=loss,
        num_substeps=1,
        seq_len_buckets=(64,),
        logits_chunk=16,
    )
    b1, info = one.prepare_batch(groups, num_rows=8)
    b8, _ = eight.prepare_batch(groups, num_rows=8)
    assert b1.pixel_values is not None and info["samples"] == 8
    np.testing.assert_array_equal(b1.input_ids, b8.input_ids)
    for step in range(3):
        m1, m8 = one.train_step(b1), eight.train_step(b8)
        assert m1["loss"] == pytest.approx(m8["loss"], rel=1e-4, abs=1e-6), step
        assert m1["grad_norm"] == pytest.approx(m8["grad_norm"], rel=1e-4)
        for k in ("tis_weight_mean", "entropy", "kl", "ratio_mean", "clip_frac_high"):
            assert m1[k] == pytest.approx(m8[k], rel=1e-4, abs=1e-7), (step, k)
    assert m1["kl"] > 0  # the policy moved away from the frozen reference
    assert one.version == eight.version == 3
    p1, p8 = one.params_for_sampler(), eight.params_for_sampler()
    for a, b in zip(_leaves(p1), _leaves(p8), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)
    k = eight.model.model.language_model.layers[0].mlp.gate_proj.kernel[...]
    assert k.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    # the params did move
    p0 = nnx.state(_model(), nnx.Param)
    assert max(np.abs(a - b).max() for a, b in zip(_leaves(p0), _leaves(p1), strict=True)) > 1e-4


@pytest.fixture(scope="module")
def learner():
    return Learner(_model(), optimizer=OptimizerConfig(learning_rate=1e-3), seq_len_buckets=(64,))


@pytest.fixture(scope="module")
def samples(learner):
    groups = make_groups(seed=1)
    pos = learner.position_fn()
    return [s for g in groups for t in g for s in trajectory_to_samples(t, t.reward - 0.5, pos)]


def test_packed_equals_unpacked_loss_and_grads(learner, samples):
    packed = learner.pack(samples)
    flat = packing.unpacked(samples, seq_len_buckets=(64,))
    used_rows = int((packed.segment_ids.max(axis=1) > 0).sum())
    assert used_rows < len(samples) and packed.padding_share < flat.padding_share
    # image order follows the rows, so the vision inputs are permuted between the two layouts
    assert packed.pixel_values.shape == flat.pixel_values.shape
    mp, gp = learner.loss_and_grads(packed)
    mu, gu = learner.loss_and_grads(flat)
    assert mp["loss"] == pytest.approx(mu["loss"], rel=1e-5)
    assert mp["num_tokens"] == mu["num_tokens"] == sum(s.loss_mask[1:].sum() for s in samples)
    for a, b in zip(_leaves(gp), _leaves(gu), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
    assert mp["grad_norm"] > 0


def test_zero_advantage_gives_zero_gradient(learner, samples):
    batch = learner.pack(samples)
    zero = dataclasses.replace(batch, advantages=np.zeros_like(batch.advantages))
    _, g = learner.loss_and_grads(zero)
    assert all(np.abs(x).max() == 0 for x in _leaves(g))


def test_on_policy_ratio_is_one_and_nothing_clips(learner, samples):
    batch = learner.pack(samples)
    lp = learner.token_logprobs(batch)
    on = dataclasses.replace(batch, behaviour_logprobs=np.where(batch.loss_mask, lp, 0.0))
    m, _ = learner.loss_and_grads(on)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert m["clip_frac_low"] == 0.0 and m["clip_frac_high"] == 0.0
    assert m["behaviour_kl_k3"] == pytest.approx(0.0, abs=1e-8)
    # the learner's log-probs equal a plain eager forward of the same model
    logits = learner.model(
        jnp.asarray(batch.input_ids),
        pixel_values=batch.pixel_values,
        image_grid_thw=batch.image_grid_thw,
        position_ids=batch.position_ids,
        segment_ids=batch.segment_ids,
    )
    want = jax.nn.log_softmax(logits[:, :-1], -1)
    want = np.take_along_axis(np.asarray(want), batch.input_ids[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(
        lp[:, 1:][batch.loss_mask[:, 1:]], want[batch.loss_mask[:, 1:]], rtol=1e-5, atol=1e-5
    )


def test_bad_batches_are_refused(learner, samples):
    with pytest.raises(ValueError, match="same size"):
        learner.prepare_batch([make_groups()[0], make_groups()[0][:2]])
    big = BatchLayout.__new__(BatchLayout)  # only the row check is exercised
    big.batch_parallel = 4
    big.processes = 1
    with pytest.raises(ValueError, match="row_multiple"):
        big.device_batch(learner.pack(samples[:2], num_rows=6), 1)


def test_tempered_rollouts_start_at_ratio_one():
    """Rollouts sampled at temperature 0.7: the sampler's reported log-probs equal the learner's
    tempered log-probs of the same tokens, so the PPO ratio starts at exactly 1 (as at T=1)."""
    from cua_jax.sampler import Engine, SamplingParams

    model = _model(seed=3)
    engine = Engine(model, max_slots=4, page_size=8, num_pages=32, max_seq_len=64, decode_chunk=4)
    rng = np.random.default_rng(5)
    group = []
    for i in range(2):
        prompt = rng.integers(0, 200, 6 + 3 * i)
        params = SamplingParams(temperature=0.7, seed=i, max_new_tokens=8)
        out = engine.generate_batch([dict(prompt_ids=prompt, params=params)])[0]
        np.testing.assert_raises(
            AssertionError, np.testing.assert_allclose, out.logprobs, out.model_logprobs, atol=1e-3
        )
        turn = Turn(prompt, np.asarray(out.tokens), out.logprobs)
        group.append(Trajectory("t", "g", [turn], reward=float(i), policy_version=0))
    tempered = Learner(model, loss=LossConfig(temperature=0.7), seq_len_buckets=(64,), donate=False)
    batch, _ = tempered.prepare_batch([group])
    m, _ = tempered.loss_and_grads(batch)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert m["behaviour_kl_k3"] == pytest.approx(0.0, abs=1e-8)
    # the untempered learner sees a different policy: the ratio moves away from 1
    plain = Learner(model, seq_len_buckets=(64,), donate=False)
    m1, _ = plain.loss_and_grads(plain.prepare_batch([group])[0])
    assert abs(m1["ratio_max"] - 1.0) > 1e-2


def test_nonpositive_temperature_is_refused():
    with pytest.raises(ValueError, match="temperature"):
        Learner(_model(), loss=LossConfig(temperature=0.0), seq_len_buckets=(64,))


def test_padding_patches_to_a_bucket_changes_nothing(learner):
    """5 images = 20 merge units -> padded to 32 with one blank image: same loss and grads."""
    groups = make_groups(seed=4, n_groups=5, group_size=2)  # one image per group (member 0)
    pos = learner.position_fn()
    samples = [s for g in groups for t in g for s in trajectory_to_samples(t, t.reward - 0.5, pos)]
    batch = learner.pack(samples)
    assert batch.pixel_values.shape[0] == 5 * 16
    padded, grid = pad_images_to_bucket(batch.pixel_values, batch.image_grid_thw, 2)
    assert padded.shape[0] == 32 * 4 and grid.tolist()[-1] == [1, 2, 24]
    m_pad, g_pad = learner.loss_and_grads(batch)
    learner.layout.bucket_shapes = False
    try:
        m_raw, g_raw = learner.loss_and_grads(batch)
    finally:
        learner.layout.bucket_shapes = True
    assert m_pad["loss"] == pytest.approx(m_raw["loss"], rel=1e-5)
    for a, b in zip(_leaves(g_pad), _leaves(g_raw), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def test_row_count_is_rounded_to_a_shape_bucket(learner, samples):
    from cua_jax.rl.learner import shape_bucket

    sizes = (1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33)
    assert [shape_bucket(n) for n in sizes] == [1, 2, 4, 4, 8, 8, 16, 16, 32, 32, 64]
    for n in range(1, len(samples) + 1):
        rows = learner.pack(samples[:n]).shape[0]
        assert rows == shape_bucket(rows)
        learner.layout.bucket_shapes = False
        try:
            assert learner.pack(samples[:n]).shape[0] <= rows
        finally:
            learner.layout.bucket_shapes = True


def test_infra_faults_are_left_out_of_groups(learner):
    """An episode ended by an env / sampler / checker fault gets no samples and does not enter
    its group's statistics (reward 0 there would be a fake failure); a group left with one
    episode is dropped. Hand numbers: rewards [1, 0, 0.5] of the live episodes."""
    groups = make_groups(images=False)
    g0, g1 = groups
    for t, r in zip(g0, [1.0, 0.0, 0.5, 0.0], strict=True):
        t.reward = r
    g0[3].failure_reason = "env_error: step: browser crashed"
    g1[0].failure_reason = "sampler_error: out of pages"
    g1[1].failure_reason = "evaluate_error: RuntimeError: checker"
    g1[2].failure_reason = "env_error: reset: timeout"
    g1[3].failure_reason = "max_turns"  # the policy's own failure: not a fault
    assert [t.infra_fault for t in g0 + g1] == [False] * 3 + [True] * 4 + [False]
    batch, info = learner.prepare_batch(groups)
    assert info["episodes_infra_fault"] == 4 and info["groups_dropped_infra_fault"] == 1
    want = (np.array([1.0, 0.0, 0.5]) - 0.5) / (np.std([1.0, 0.0, 0.5], ddof=1) + 1e-6)
    n_samples = [len(trajectory_to_samples(t, 0.0)) for t in g0[:3]]
    assert info["samples"] == sum(n_samples)
    got = sorted({round(float(a), 5) for a in batch.advantages[batch.loss_mask]})
    np.testing.assert_allclose(got, sorted(np.round(want, 5)), atol=1e-5)


def test_an_update_too_large_for_the_params_is_not_applied(samples):
    """optim.max_update_ratio: a step whose update exceeds the bound x the parameters' norm
    (here a learning rate of 1e30) leaves the params and the optimizer state as they were and
    reports update_rejected, which `check_finite` turns into the run's stop; a normal step
    applies its update and reports its ratio."""
    from cua_jax.rl.learner import NonFiniteError, check_finite

    wild = Learner(_model(), optimizer=OptimizerConfig(learning_rate=1e30), seq_len_buckets=(64,))
    batch = wild.pack(samples)
    before = _leaves(wild.params_for_sampler())
    m = wild.train_step(batch)
    assert m["update_rejected"] == 1.0 and m["update_ratio"] > 1e20 and np.isfinite(m["loss"])
    for a, b in zip(before, _leaves(wild.params_for_sampler()), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(NonFiniteError, match="GRPO step 3: its update was .*not applied.*ckpt/2"):
        check_finite(m, step=3, phase="GRPO", last_checkpoint="ckpt/2")
    calm = Learner(_model(), optimizer=OptimizerConfig(learning_rate=1e-3), seq_len_buckets=(64,))
    m = calm.train_step(batch)
    assert m["update_rejected"] == 0.0 and 0 < m["update_ratio"] < 1
    check_finite(m, step=1, phase="GRPO", last_checkpoint=None)
    assert any(
        np.abs(a - b).max() > 0
        for a, b in zip(before, _leaves(calm.params_for_sampler()), strict=True)
    )
