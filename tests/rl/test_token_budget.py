"""The token-budget shape set (`rl.tokens_per_chip`): a batch is as many chunks of a shape as its
samples need, one gradient call a chunk and one optimizer update. On a 4-device mesh with
screens and a KL term, the chunked step gives one device's one-call loss, gradients, updated
parameters and log-probs; every (micro-batch, device) group of every chunk holds at most its
screen budget; the warm-up compiles exactly what the steps run."""

import dataclasses

import jax
import numpy as np
import pytest

from cua_jax import sharding as shd
from cua_jax.job import compile_stats
from cua_jax.rl import batching, image_groups, packing
from cua_jax.rl.learner import APPLY_PROGRAM, Learner, LossConfig, OptimizerConfig
from cua_jax.rl.shapes import Shape, ShapeSet, ShapeSettings
from tests.rl.test_learner import _model, make_groups

GRID = (1, 4, 4)  # tests.rl.test_learner's screens: 16 patches, 4 merged tokens
UNIT = 16
OPT = OptimizerConfig(learning_rate=1e-2, eps=1.0, warmup_steps=1)


def _budget_learner(mesh, group_screens=16, tokens=64):
    learner = Learner(
        _model(),
        mesh=mesh,
        optimizer=OPT,
        loss=LossConfig(kl_coef=0.05),
        seq_len_buckets=(64,),
    )
    rows = max(1, tokens // 64) * learner.row_multiple
    shape = Shape(rows, 64, group_screens * learner.row_multiple * UNIT, group_screens)
    learner.shapes = ShapeSet(
        rl=(shape,), sft=(shape,), grid=GRID, strict=True, tokens_per_chip=tokens
    )
    return learner


@pytest.fixture(scope="module")
def mesh4():
    return shd.make_mesh(1, 4, 1, devices=jax.devices()[:4])


def _close(a, b, rtol=2e-4, atol=2e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def test_budget_shapes_follow_the_token_and_screen_budget():
    c = ShapeSettings(
        row_lengths=(1024, 4096, 16384),
        episodes=8,
        sft_rows=8,
        viewport=(1280, 704),
        max_turns=1,
        max_history_images=1,
        tokens_per_chip=8192,
        screens_per_chip=0,
    )
    grid = (1, 44, 80)  # 1280 x 704 at 16-pixel patches: 880 merged tokens a screen
    shapes = ShapeSet._budget(c, grid, 880, row_multiple=8)
    assert shapes.budgeted and shapes.rl == shapes.sft
    # rows: T // L a group (at least one), x 8 groups; screens: T // 880 = 9 a group, or what
    # one row of L holds when more (16384 // 880 = 18)
    assert [(s.rows, s.length, s.group_screens) for s in shapes.rl] == [
        (64, 1024, 9),
        (16, 4096, 9),
        (8, 16384, 18),
    ]
    assert shapes.rl[0].patches == 9 * 8 * 44 * 80
    c = dataclasses.replace(c, screens_per_chip=12)
    assert [s.group_screens for s in ShapeSet._budget(c, grid, 880, 8).rl] == [12, 12, 18]


def test_chunked_step_equals_one_call_on_one_device(mesh4):
    groups = [make_groups(seed=s, n_groups=3) for s in (11, 12)]
    budget = _budget_learner(mesh4)
    stats = compile_stats.install()
    mark = stats.snapshot()
    times = budget.warmup("rl")
    assert set(times) == {f"rl_grads {budget.shapes.rl[0]}", APPLY_PROGRAM}
    programs = budget.program_names("rl")
    assert programs == ("rl_grads", APPLY_PROGRAM)
    warm = stats.since(mark).per_program
    assert [warm.get(p, 0) for p in programs] == [1, 1]
    stats.expect_no_compiles(programs, strict=True)

    one = Learner(_model(), optimizer=OPT, loss=LossConfig(kl_coef=0.05), seq_len_buckets=(64,))
    for step, g in enumerate(groups):
        batch, info = budget.prepare_batch(g)
        ref, _ = one.prepare_batch(g, num_rows=32)
        assert batch.chunks >= 2 and info["chunks"] == batch.chunks
        assert batch.shape == (batch.chunks * 4, 64)
        assert info["padding_share"] == pytest.approx(batch.padding_share)
        # the chunks split the rows and their screens
        parts = budget.chunks(batch)
        assert sum(p.shape[0] for p, _ in parts) == batch.shape[0]
        assert (
            sum(p.pixel_values.shape[0] for p, _ in parts if p.pixel_values is not None)
            == (batch.pixel_values.shape[0])
        )
        if step == 0:
            m_b, g_b = budget.loss_and_grads(batch)
            m_1, g_1 = one.loss_and_grads(ref)
            assert m_b["num_tokens"] == m_1["num_tokens"]
            for k in ("loss", "pg_loss", "kl", "grad_norm"):
                assert m_b[k] == pytest.approx(m_1[k], rel=1e-4, abs=1e-7), k
            _close(g_b, g_1)
            np.testing.assert_allclose(
                _per_token(budget.token_logprobs(batch), batch),
                _per_token(one.token_logprobs(ref), ref),
                rtol=1e-5,
                atol=1e-6,
            )
        mb, m1 = budget.train_step(batch), one.train_step(ref)
        assert mb["chunks"] == batch.chunks
        for k in ("loss", "grad_norm", "update_norm", "kl", "entropy"):
            assert mb[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-7), (step, k)
        stats.check()  # the warm-up compiled what the steps ran: raises on a new compile
    stats.reset_expectations()
    _close(budget.params_for_sampler(), one.params_for_sampler())
    assert budget.version == one.version == 2
    assert [stats.since(mark).per_program[p] for p in programs] == [1, 1]


def _per_token(lp, batch):
    """Log-probs of the trained tokens, in a layout-free order (sorted)."""
    return np.sort(lp[batch.loss_mask])


def test_screens_add_chunks_so_no_group_overflows(mesh4):
    groups = make_groups(seed=4, n_groups=8)  # 16 screens
    roomy = _budget_learner(mesh4, group_screens=16, tokens=256)
    batch, _ = roomy.prepare_batch(groups)
    merge = roomy.config.vision.spatial_merge_size
    patches_R = packing.row_patches(batch, roomy.config.image_token_id, merge)
    most = int(patches_R.max()) // UNIT  # the fullest packed row's screens
    assert most >= 1
    budget = _budget_learner(mesh4, group_screens=most, tokens=256)
    batch, _ = budget.prepare_batch(groups)
    patches_R = packing.row_patches(batch, budget.config.image_token_id, merge)
    screens = patches_R.sum() // UNIT
    # 4 groups a chunk, at most `most` screens each: screens alone need that many chunks
    assert batch.chunks >= -(-screens // (4 * most)) and batch.chunks > roomy_chunks(roomy, groups)
    groups_R = batching.chunk_groups(batch.shape[0], batch.chunks, 1, 4)
    load = np.bincount(groups_R, weights=patches_R // UNIT)
    assert load.max() <= most
    # and every chunk's screens are grouped (never the replicated flat layout)
    for part, _ in budget.chunks(batch):
        _, images = budget.layout.device_batch(part, 1)
        assert isinstance(images, image_groups.ImageGroups)


def roomy_chunks(learner, groups):
    return learner.prepare_batch(groups)[0].chunks


def test_a_row_no_group_can_hold_is_an_error_naming_the_budget(mesh4):
    from cua_jax.rl.shapes import ShapeError

    # a group holds one screen, and first-fit puts two image samples in one 64-token row
    tight = _budget_learner(mesh4, group_screens=1, tokens=128)
    with pytest.raises(ShapeError, match="holds 2 screens, more than a group's 1"):
        tight.prepare_batch(make_groups(seed=4, n_groups=4))


def test_fill_groups_refuses_what_no_placement_holds():
    groups_R = batching.chunk_groups(8, 2, 1, 2)  # 2 chunks x 2 groups x 2 rows
    assert list(groups_R) == [0, 0, 1, 1, 2, 2, 3, 3]
    perm = batching.fill_groups(groups_R, np.array([3, 3, 2, 2, 1, 1, 0, 0]), budget=4)
    load = np.bincount(groups_R, weights=np.array([3, 3, 2, 2, 1, 1, 0, 0])[perm])
    assert sorted(perm) == list(range(8)) and load.max() <= 4
    assert batching.fill_groups(groups_R, np.array([5, 0, 0, 0, 0, 0, 0, 0]), 4) is None


def test_kv_pages_from_memory_are_what_the_learner_leaves(mesh4):
    """`builders.kv_pages`: with sampler.kv_memory_fraction, N more pages' bytes of device memory
    give exactly N more pages (K and V of every layer, by hand); a budget below one sequence or
    below sampler.kv_min_fraction is an error naming what to change; no memory report (the CPU)
    or fraction 0 keep num_pages."""
    from configs import qwen3vl_grpo
    from cua_jax.job import builders

    learner = _budget_learner(mesh4)
    c = qwen3vl_grpo.get_config("smoke")
    c.sampler.kv_memory_fraction = 0.5
    t = learner.config.text
    page = c.sampler.page_size * t.num_key_value_heads * t.head_dim * 2 * t.num_hidden_layers * 4
    base = {"bytes_limit": 8 << 30, "bytes_in_use": 1 << 30}
    pages = builders.kv_pages(c, learner, None, stats=base)
    more = builders.kv_pages(
        c, learner, None, stats={**base, "bytes_limit": (8 << 30) + 2 * 7 * page}
    )
    assert pages * page < 3 << 30 and more - pages == 7  # half of 14 pages' bytes
    with pytest.raises(ValueError, match="kv_memory_fraction=0.5 leaves"):
        builders.kv_pages(c, learner, None, stats={"bytes_limit": 3 << 30, "bytes_in_use": 3 << 29})
    assert builders.kv_pages(c, learner, None, stats={}) == c.sampler.num_pages
    # sampler.kv_min_fraction: a pool below that share of the device stops the run, naming
    # the token budget (here about 3 GiB of 8: 0.375 asked)
    c.sampler.kv_min_fraction = 0.375
    with pytest.raises(ValueError, match="lower rl.tokens_per_chip"):
        builders.kv_pages(c, learner, None, stats=base)
    c.sampler.kv_min_fraction = 0.25
    assert builders.kv_pages(c, learner, None, stats=base) == pages
    c.sampler.kv_memory_fraction = 0.0
    assert builders.kv_pages(c, learner, None, stats=base) == c.sampler.num_pages


def test_sdpo_step_and_teacher_pass_over_chunks_equal_one_call(mesh4):
    """SDPO on a token-budget batch: the teacher pass runs chunk by chunk and the step splits the
    teacher's targets with the rows; both equal one call on the same rows (the batch taken as
    one flat-layout call by a one-device learner with no shape set: the 4-device programs'
    vocabulary-parallel head against one device's whole head)."""
    import dataclasses

    from cua_jax.rl import sdpo

    budget = _budget_learner(mesh4)
    batch, _ = budget.prepare_batch(make_groups(seed=21, n_groups=3))
    assert batch.chunks >= 2
    flat = Learner(
        _model(),
        optimizer=OPT,
        loss=LossConfig(kl_coef=0.05),
        seq_len_buckets=(64,),
    )
    whole = dataclasses.replace(batch, chunks=1, patch_budget=0, group_screens=0)
    ids_b, lp_b = sdpo.teacher_topk(budget, budget._trainable, batch, 8)
    ids_f, lp_f = sdpo.teacher_topk(flat, flat._trainable, whole, 8)
    np.testing.assert_allclose(lp_b, lp_f, rtol=1e-5, atol=1e-5)
    rng = np.random.default_rng(0)
    mask = batch.loss_mask & (rng.random(batch.loss_mask.shape) < 0.5)
    targets = sdpo.TeacherTargets(ids_b, lp_b, mask, sdpo.distill_weights(mask), "js", 0.5, 0.5)
    mb = budget.train_step(batch, teacher=targets)
    mf = flat.train_step(whole, teacher=targets)
    assert mb["chunks"] == batch.chunks and mb["sdpo_tokens"] == mf["sdpo_tokens"] > 0
    for k in ("loss", "sdpo_loss", "grad_norm", "update_norm"):
        assert mb[k] == pytest.approx(mf[k], rel=1e-4, abs=1e-7), k
