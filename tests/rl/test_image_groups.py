"""Screens grouped by micro-batch and device (`cua_jax.rl.image_groups`): on a 4-device mesh with
2 micro-batches each device holds and encodes only its own rows' screens, and the loss, the
gradients, the log-probs and SDPO's teacher pass equal the flat replicated layout's and one
device's."""

import logging

import jax
import numpy as np
import pytest

from cua_jax import sharding as shd
from cua_jax.rl import image_groups, sdpo
from cua_jax.rl.learner import Learner, LossConfig, OptimizerConfig
from cua_jax.rl.shapes import Shape, ShapeSet
from tests.rl.test_learner import PATCH_DIM, _model, make_groups

GRID = (1, 4, 4)  # tests.rl.test_learner's screens: 16 patches, 4 merged tokens
UNIT = 16


def _learner(mesh=None, substeps=1, patches=16 * UNIT, rows=16):
    learner = Learner(
        _model(),
        mesh=mesh,
        optimizer=OptimizerConfig(learning_rate=1e-3),
        loss=LossConfig(kl_coef=0.05),  # the KL reference's embeddings take the groups too
        num_substeps=substeps,
        seq_len_buckets=(64,),
    )
    learner.shapes = ShapeSet(
        rl=(Shape(rows, 64, patches),), sft=(Shape(4, 64, 4 * UNIT),), grid=GRID, strict=True
    )
    return learner


@pytest.fixture(scope="module")
def mesh4():
    return shd.make_mesh(1, 4, 1, devices=jax.devices()[:4])


@pytest.fixture(scope="module")
def sharded(mesh4):
    # 64 screens over 2 x 4 groups: 64 // 8 + 16 (a 64-token row holds 16 screens) a group
    return _learner(mesh4, substeps=2, patches=64 * UNIT)


def _close(a, b, rtol=2e-4, atol=2e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def test_each_device_holds_its_own_rows_screens(sharded):
    batch, _ = sharded.prepare_batch(make_groups(seed=1, n_groups=3))
    xs, images = sharded.layout.device_batch(batch, sharded.num_substeps)
    assert isinstance(images, image_groups.ImageGroups)
    pv = images.pixel_values
    S, B, Pg, C = pv.shape
    assert (S, B, C) == (2, 4, PATCH_DIM) and Pg == 24 * UNIT  # 64 // 8 + 16 screens
    shards = pv.addressable_shards
    assert len(shards) == 4 and all(s.data.shape == (2, 1, Pg, C) for s in shards)
    # group (j, d) = the rows micro-batch j keeps on device d, their screens in row order
    screens_R = image_groups.screens_per_row(batch, sharded.config.image_token_id, 4)
    groups_R = image_groups.row_groups(16, 2, 4)
    host = np.asarray(pv)
    start = np.r_[0, np.cumsum(screens_R)] * UNIT
    for g in range(8):
        rows = np.flatnonzero(groups_R == g)
        want = np.concatenate([batch.pixel_values[start[r] : start[r + 1]] for r in rows])
        got = host[g // 4, g % 4]
        np.testing.assert_array_equal(got[: len(want)], want)
        assert not got[len(want) :].any()  # then blank screens
    # the rows were balanced: group loads differ by at most one row's screens, and so do the
    # devices' (the groups of one micro-batch)
    load = np.bincount(groups_R, weights=screens_R, minlength=8)
    assert load.max() - load.min() <= screens_R.max() and load.max() > 0
    per_device = load.reshape(2, 4).sum(0)
    assert per_device.max() - per_device.min() <= screens_R.max()


def test_grouped_step_equals_the_flat_layout_and_one_device(sharded):
    batch, _ = sharded.prepare_batch(make_groups(seed=2, n_groups=3))
    assert batch.pixel_values.shape[0] >= 6 * UNIT
    m_g, g_g = sharded.loss_and_grads(batch)
    lp_g = sharded.token_logprobs(batch)
    sharded.group_images = False
    try:
        _, images = sharded.layout.device_batch(batch, sharded.num_substeps)
        assert isinstance(images, tuple)  # the flat replicated layout
        m_f, g_f = sharded.loss_and_grads(batch)
        lp_f = sharded.token_logprobs(batch)
    finally:
        sharded.group_images = True
    one = _learner()  # one device, one micro-batch, the same batch
    m_1, g_1 = one.loss_and_grads(batch)
    for m in (m_f, m_1):
        for k in ("loss", "pg_loss", "kl", "num_tokens"):
            assert m_g[k] == pytest.approx(m[k], rel=1e-4, abs=1e-7), k
    _close(g_g, g_f)
    _close(g_g, g_1)
    np.testing.assert_allclose(lp_g, lp_f, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lp_g, one.token_logprobs(batch), rtol=1e-5, atol=1e-6)
    assert any(np.abs(np.asarray(x)).sum() > 0 for x in jax.tree.leaves(g_g["model"]["visual"]))


def test_sdpo_teacher_pass_with_grouped_screens_is_the_flat_result(sharded):
    batch, _ = sharded.prepare_batch(make_groups(seed=3, n_groups=2))
    ids_g, lp_g = sdpo.teacher_topk(sharded, sharded._trainable, batch, 8)
    sharded.group_images = False
    try:
        ids_f, lp_f = sdpo.teacher_topk(sharded, sharded._trainable, batch, 8)
    finally:
        sharded.group_images = True
    np.testing.assert_allclose(lp_g, lp_f, rtol=1e-5, atol=1e-5)
    same = np.isclose(lp_g, lp_f, atol=1e-5).all(-1)  # ties may order differently
    assert (ids_g == ids_f)[same].mean() > 0.99


def test_screens_a_group_cannot_hold_take_the_flat_layout(sharded, monkeypatch, caplog):
    """A group budget too small for a batch (here forced to one screen): the batch takes the
    flat replicated layout (logged), and still gives the one-device loss."""
    batch, _ = sharded.prepare_batch(make_groups(seed=5, n_groups=3))
    monkeypatch.setattr(image_groups, "group_budget", lambda *a: 1)
    with caplog.at_level(logging.WARNING):
        _, images = sharded.layout.device_batch(batch, sharded.num_substeps)
        m, _ = sharded.loss_and_grads(batch)
    assert isinstance(images, tuple) and "flat layout" in caplog.text
    m_1, _ = _learner(patches=64 * UNIT).loss_and_grads(batch)
    assert m["loss"] == pytest.approx(m_1["loss"], rel=1e-4, abs=1e-7)


def test_balanced_groups_are_at_most_one_row_apart():
    """Round-robin of rows by screens: any loads, the fullest group holds at most
    screens // groups + the largest row (`group_budget`), for 4 x 2 groups and 2 x 1 unions."""
    rng = np.random.default_rng(0)
    groups_R = image_groups.row_groups(32, 4, 2)
    for _ in range(50):
        screens_R = rng.integers(0, 6, 32) * (rng.random(32) < rng.random())
        batch = _fake_batch(screens_R)
        out = image_groups.balance_rows(batch, groups_R, screens_R)
        got_R = (out.input_ids == 9).sum(1)
        assert sorted(got_R) == sorted(screens_R)
        load = np.bincount(groups_R, weights=got_R, minlength=8)
        total, top = int(screens_R.sum()), int(screens_R.max())
        assert load.max() <= image_groups.group_budget(total, 8, top)
        dev = np.bincount(image_groups.row_groups(32, 1, 2), weights=got_R, minlength=2)
        assert dev.max() <= image_groups.group_budget(total, 2, top)
        # each row's pixels moved with it: row r's screens carry r's id
        start = np.r_[0, np.cumsum(got_R)]
        for r in range(32):
            ids = out.pixel_values[start[r] : start[r + 1], 0]
            assert (ids == out.segment_ids[r, 0]).all()


def _fake_batch(screens_R):
    from cua_jax.rl.packing import PackedBatch

    R = len(screens_R)
    ids = np.zeros((R, 8), np.int32)
    for r, n in enumerate(screens_R):
        ids[r, :n] = 9  # one "image token" a screen
    seg = np.repeat(np.arange(R, dtype=np.int32)[:, None], 8, 1)  # the row's id
    pv = np.concatenate([np.full((n, 2), r, np.float32) for r, n in enumerate(screens_R)])
    z = np.zeros((R, 8), np.float32)
    return PackedBatch(
        ids,
        seg,
        np.zeros((3, R, 8), np.int32),
        z > 0,
        z,
        z,
        z,
        pixel_values=pv,
        image_grid_thw=np.ones((int(screens_R.sum()), 3), np.int32),
    )


def test_group_pixels_refuses_an_overfull_group():
    pv = np.arange(3 * UNIT * 2, dtype=np.float32).reshape(3 * UNIT, 2)
    screens_R = np.array([2, 1, 0, 0])
    groups_R = image_groups.row_groups(4, 2, 2)  # rows 0..3 -> groups 0, 2, 1, 3
    assert list(groups_R) == [0, 2, 1, 3]
    assert image_groups.group_pixels(pv, screens_R, groups_R, 2, 2, 1, UNIT) is None
    out = image_groups.group_pixels(pv, screens_R, groups_R, 2, 2, 2, UNIT)
    assert out.shape == (2, 2, 2 * UNIT, 2)
    np.testing.assert_array_equal(out[0, 0], pv[: 2 * UNIT])  # row 0's two screens
    np.testing.assert_array_equal(out[1, 0, :UNIT], pv[2 * UNIT :])  # row 1's, group 2
    assert not out[0, 1].any() and not out[1, 1].any()
