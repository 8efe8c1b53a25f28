"""Compile once (#23): compile accounting from JAX's monitoring events, the learner's fixed shape
set, and a few GRPO steps with varied episodes that compile nothing after the warm-up."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cua_jax.job import compile_stats


def _named(name):
    def fn(x):
        return jnp.sin(x) * 2.0

    fn.__name__ = name
    return jax.jit(fn)


def test_counts_compiles_per_program_and_a_call_after_lower_compile_reuses_it():
    stats = compile_stats.install()
    assert compile_stats.install() is stats  # one process-wide collector
    f = _named("cs_prog_a")
    x3, x4, x5 = (jax.device_put(jnp.zeros(n)) for n in (3, 4, 5))
    mark = stats.snapshot()
    f(x3)
    f(x3)  # same shape: no compile
    f(x4)
    f.lower(x5).compile()
    f(x5)  # the ahead-of-time compile serves the call
    m = stats.step_metrics(mark, step_s=1.0)
    assert m["compile/count/cs_prog_a"] == 3.0
    assert m["compile/count"] >= 3.0
    assert m["time/compile_s"] > 0
    assert "time/step_steady" not in m  # the step compiled
    assert 0 < stats.busy_seconds(mark) <= m["time/compile_s"] + 1e-6
    mark = stats.snapshot()
    f(x4)
    m = stats.step_metrics(mark, step_s=2.5)
    assert m["compile/count"] == 0.0 and m["time/step_steady"] == 2.5


def test_unplanned_compile_is_counted_and_strict_raises_naming_the_program():
    stats = compile_stats.install()
    f, g = _named("cs_prog_watched"), _named("cs_prog_other")
    f(jnp.zeros(2))
    stats.expect_no_compiles(("cs_prog_watched",), strict=True)
    try:
        mark = stats.snapshot()
        f(jnp.zeros(2))
        g(jnp.zeros(7))  # not watched: counted, not unplanned
        stats.check()
        assert stats.step_metrics(mark)["compile/unplanned"] == 0.0
        f(jnp.zeros(9))  # a new shape of a watched program
        assert stats.step_metrics(mark)["compile/unplanned"] == 1.0
        with pytest.raises(compile_stats.UnplannedCompileError, match="cs_prog_watched"):
            stats.check()
        stats.check()  # reported once
        stats.expect_no_compiles(("cs_prog_watched",), strict=False)
        f(jnp.zeros(11))
        stats.check()  # production: logged and counted only
        assert stats.step_metrics(mark)["compile/unplanned"] == 2.0
    finally:
        stats.reset_expectations()


def test_busy_seconds_count_overlapping_compiles_once():
    """Compiles in several threads at once: the wall time spent compiling is their union."""
    stats = compile_stats.CompileStats()  # not installed: spans fed by hand
    mark = stats.snapshot()
    t = mark.time
    for event, a, b in [
        (compile_stats.BACKEND_COMPILE, t + 1, t + 4),
        (compile_stats.LOWER, t + 2, t + 3),  # inside the first
        (compile_stats.BACKEND_COMPILE, t + 3.5, t + 6),  # overlaps it
        (compile_stats.BACKEND_COMPILE, t + 10, t + 11),
        (compile_stats.BACKEND_COMPILE, t - 5, t - 1),  # before the mark
        (compile_stats.BACKEND_COMPILE, t - 1, t + 0.5),  # straddles the mark
        ("/jax/core/compile/jaxpr_trace_duration", t + 20, t + 30),  # not counted
    ]:
        stats._on_span(event, a, b)
    assert stats.busy_seconds(mark) == pytest.approx(0.5 + 5 + 1)


def test_a_cancelled_warm_up_stops_before_its_next_program():
    """A run that fails during its warm-up (every rollout an env fault) does not wait for the
    rest of it: `Warmup.cancel` lets the program compiling finish and starts no other."""
    from cua_jax.job import warmup

    compiling, release, compiled = threading.Event(), threading.Event(), []

    class _Program:
        def __init__(self, name):
            self.name = name

        def lower(self):
            return self

        def compile(self):
            compiled.append(self.name)
            compiling.set()
            assert release.wait(10)

    programs = [(n, _Program(n), ()) for n in ("a", "b", "c")]
    warm = warmup.Warmup(lambda stop: warmup.compile_all(programs, stop), (), False, overlap=True)
    assert compiling.wait(10)
    warm.cancel()
    release.set()
    assert list(warm.wait()) == ["a"] and compiled == ["a"]


def test_a_second_wait_returns_the_same_programs_and_keeps_the_unplanned_compiles():
    """`Warmup.wait` twice (the SFT warm-up waits before its first step and after it): the
    second returns the first's times and does not re-arm `stats`, which would drop the
    unplanned compiles counted in between."""
    from cua_jax.job import warmup

    class _Stats:
        def __init__(self):
            self.armed = 0

        def expect_no_compiles(self, programs, *, strict):
            self.armed += 1

    warm = warmup.Warmup(lambda stop: {"a": 1.0}, ("a",), True, overlap=True)
    stats = _Stats()
    first = warm.wait(stats)
    assert warm.wait(stats) is first and first == {"a": 1.0} and stats.armed == 1


def test_wall_share_from_metrics_rows():
    rows = [
        {"step": 1, "time/step": 10.0, "time/compile_s": 6.0, "compile/count": 2.0},
        {"step": 2, "time/step": 4.0, "time/compile_s": 0.0, "compile/count": 0.0},
        {"step": 3, "time/step": 6.0, "time/compile_s": 0.0, "compile/count": 0.0},
        {"step": 3, "eval/success": 0.5},
    ]
    s = compile_stats.wall_share(rows, wall_s=40.0, total_compile_s=10.0)
    assert s["compile_share"] == pytest.approx(0.25)
    assert s["compile_s_steps"] == pytest.approx(6.0)
    assert s["compile_share_steps"] == pytest.approx(6.0 / 20.0)
    assert s["steps_with_compile"] == 1
    assert s["step_steady_median_s"] == 6.0


# ---- the learner's shape set (cua_jax.rl.shapes) ---------------------------------------------


def _sample(n, images=0, task="t", unit=16, dim=8):
    from cua_jax.rl.trajectory import Sample

    return Sample(
        input_ids=np.ones(n, np.int32),
        loss_mask=np.zeros(n, bool),
        behaviour_logprobs=np.zeros(n, np.float32),
        position_ids=np.zeros((3, n), np.int32),
        advantage=1.0,
        pixel_values=np.ones((images * unit, dim), np.float32) if images else None,
        image_grid_thw=np.asarray([[1, 4, 4]] * images, np.int32) if images else None,
        task_id=task,
    )


def _shape_set(strict=True):
    from cua_jax.rl.shapes import Shape, ShapeSet

    rl = (Shape(4, 64, 4 * 2 * 16), Shape(4, 128, 4 * 2 * 16), Shape(8, 128, 8 * 2 * 16))
    return ShapeSet(rl=rl, sft=(Shape(2, 128, 2 * 2 * 16),), grid=(1, 4, 4), strict=strict)


def test_a_batch_goes_to_the_smallest_shape_that_holds_its_rows_and_patches():
    from cua_jax.rl.shapes import Shape

    s = _shape_set()
    assert s.pick("rl", [_sample(30), _sample(30), _sample(60)]) == Shape(4, 64, 128)
    # 5 rows of 64 do not fit 4 rows; at 128 they pack into 3
    assert s.pick("rl", [_sample(40)] * 5) == Shape(4, 128, 128)
    # 9 patches-units of images (144 patches) overflow 4 rows' budget of 128
    assert s.pick("rl", [_sample(20, images=3)] * 3) == Shape(8, 128, 256)
    assert s.pick("rl", [_sample(100)] * 9) is None  # 9 rows: none holds it
    assert "rl.learner_rows" in s.miss_message("rl", [_sample(100)] * 9)
    assert s.pick("sft", [_sample(100)] * 2) == Shape(2, 128, 64)


def test_a_sample_that_can_never_fit_is_an_error_naming_it():
    from cua_jax.rl.shapes import ShapeError

    s = _shape_set()
    with pytest.raises(ShapeError, match="sample 1 .*task 'long'.* 129 tokens"):
        s.pick("rl", [_sample(10), _sample(129, task="long")])
    with pytest.raises(ShapeError, match="task 'pics'.* 272 image patches"):
        s.pick("rl", [_sample(50, images=17, task="pics")])


def test_first_fit_rows_equals_packing():
    from cua_jax.rl import packing
    from cua_jax.rl.shapes import first_fit_rows

    rng = np.random.default_rng(0)
    for _ in range(20):
        lengths = rng.integers(1, 64, rng.integers(1, 30))
        batch = packing.pack([_sample(int(n)) for n in lengths], seq_len_buckets=(64,))
        assert first_fit_rows(lengths, 64) == int((batch.segment_ids.max(axis=1) > 0).sum())


def test_images_are_padded_to_the_budget_with_blank_screens():
    from cua_jax.rl.shapes import ShapeError, pad_images

    pv = np.ones((2 * 16, 8), np.float32)
    grid = np.asarray([[1, 4, 4]] * 2, np.int32)
    out, g = pad_images(pv, grid, 5 * 16 + 8, (1, 4, 4), 2, 8)
    assert out.shape == (88, 8) and (out[32:] == 0).all() and (out[:32] == 1).all()
    assert g.tolist() == [[1, 4, 4]] * 5 + [[1, 2, 4]]
    out, g = pad_images(None, None, 32, (1, 4, 4), 2, 8)  # a text-only batch: all blank
    assert out.shape == (32, 8) and g.tolist() == [[1, 4, 4]] * 2
    with pytest.raises(ShapeError, match="exceed"):
        pad_images(pv, grid, 16, (1, 4, 4), 2, 8)


# ---- GRPO steps on the tiny learner ---------------------------------------------------------


def _tiny_learner():
    from cua_jax.rl.learner import Learner, OptimizerConfig
    from cua_jax.rl.shapes import Shape, ShapeSet
    from tests.rl.test_learner import _model

    learner = Learner(
        _model(), optimizer=OptimizerConfig(learning_rate=1e-3), seq_len_buckets=(64,)
    )
    # 4x4-patch screens (16 patches, 4 merged tokens) as tests.rl.test_learner's images
    learner.shapes = ShapeSet(
        rl=(Shape(12, 64, 8 * 16),), sft=(Shape(4, 64, 4 * 16),), grid=(1, 4, 4), strict=True
    )
    return learner


@pytest.fixture(scope="module")
def tiny_learner():
    return _tiny_learner()


def test_grpo_steps_with_varied_episodes_compile_nothing_after_the_warm_up(tiny_learner):
    from cua_jax.rl.shapes import ShapeError
    from tests.rl.test_learner import make_groups

    learner = tiny_learner
    stats = compile_stats.install()
    mark = stats.snapshot()
    times = learner.warmup("rl")
    warm = stats.since(mark).per_program.get("rl_step", 0)
    assert warm == len(times) == 1
    stats.expect_no_compiles(("rl_step",), strict=True)
    varied = set()
    try:
        for seed, n_groups in [(1, 1), (2, 3), (3, 2), (5, 3)]:
            groups = make_groups(seed=seed, n_groups=n_groups)
            for g in groups[1:]:  # fewer screenshots in later groups: image counts vary too
                for t in g[2:]:
                    t.turns[0].pixel_values = None
                    t.turns[0].image_grid_thw = None
                    t.turns[0].prompt_ids = np.arange(20, 20 + 3 * seed, dtype=np.int32)
                    t.turns[1].prompt_ids = np.r_[t.turns[0].full_ids, 7, 8, 9].astype(np.int32)
            batch, info = learner.prepare_batch(groups)
            m = learner.train_step(batch)
            assert np.isfinite(m["loss"]) and batch.shape == (12, 64)
            varied.add((info["samples"], batch.pixel_values.shape[0], int(batch.segment_ids.sum())))
            stats.check()  # raises on a compile of rl_step
        assert stats.since(mark).per_program["rl_step"] == warm
        assert len(varied) == 4  # every batch differed in samples, screenshots or tokens
        with pytest.raises(ShapeError, match="fits none of the run's rl shapes"):
            learner.prepare_batch(make_groups(seed=9, n_groups=8))  # 32 episodes > 12 rows
    finally:
        stats.reset_expectations()


def test_the_patch_budget_padding_changes_no_loss_or_gradient(tiny_learner):
    """A batch padded to its shape's patch budget with blank screens == the same batch with only
    its own images (the reference layout without a shape set)."""
    from tests.rl.test_learner import make_groups

    learner = tiny_learner
    batch, _ = learner.prepare_batch(make_groups(seed=4, n_groups=2))
    assert 0 < batch.pixel_values.shape[0] < batch.patch_budget
    m_pad, g_pad = learner.loss_and_grads(batch)
    batch.patch_budget, learner.layout.bucket_shapes = 0, False
    try:
        m_raw, g_raw = learner.loss_and_grads(batch)
    finally:
        learner.layout.bucket_shapes = True
    assert m_pad["loss"] == pytest.approx(m_raw["loss"], rel=1e-5)
    for a, b in zip(jax.tree.leaves(g_pad), jax.tree.leaves(g_raw), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)


def test_the_config_shape_set_has_rows_for_every_turn_when_history_drops_screens():
    """`builders.shape_set`: one row per episode, and when the history window drops screens
    (env.max_history_images < env.max_turns: each turn its own sample) as many rows again per
    turn, so a step of multi-turn episodes always has a shape (the learn preset's run fell off
    its 16 rows with 41 turn samples and recompiled)."""
    from configs.qwen3vl_grpo import get_config
    from cua_jax.data.processor import QwenVLProcessor
    from cua_jax.job import builders

    c = get_config("learn")
    c.rl.groups_per_batch = 4  # 16 episodes a step
    ic = QwenVLProcessor.default("qwen3_vl", max_pixels=384 * 288, min_pixels=32 * 32).image_config
    rl = builders.shape_set(c, ic).rl
    assert [(s.rows, s.length) for s in rl] == [(16, 512), (16, 1024), (48, 512), (48, 1024)]
    # 3 screens a row (3 turns x 1 screen); the turn rows' budget stays 16 episodes x 3 turns
    # x 1 screen, not 48 rows x 3 screens of blank padding through the vision tower
    assert rl[0].patches == 16 * 3 * 432 and rl[2].patches == rl[0].patches
    c.env.max_history_images = c.env.max_turns  # turns extend one sample: one row per episode
    assert [(s.rows, s.length) for s in builders.shape_set(c, ic).rl] == [(16, 512), (16, 1024)]
    c.rl.learner_rows = 24  # a configured row count is the only one
    assert {s.rows for s in builders.shape_set(c, ic).rl} == {24}


def test_sdpo_teacher_batches_get_the_rl_rows_and_a_feedback_screen_each():
    """SDPO's teacher batches (a step's failed samples with their feedback) have shapes of their
    own: the RL rows, one screen more a sample for the final screenshot. The learn preset's
    SDPO run packed 10-19 teacher samples into the 8-row SFT shapes and recompiled each step."""
    from configs.qwen3vl_grpo import get_config
    from cua_jax.data.processor import QwenVLProcessor
    from cua_jax.job import builders

    c = get_config("learn")
    c.rl.groups_per_batch = 4  # 16 episodes a step
    ic = QwenVLProcessor.default("qwen3_vl", max_pixels=384 * 288, min_pixels=32 * 32).image_config
    assert builders.shape_set(c, ic).teacher == ()  # GRPO: no teacher pass
    c.rl.algorithm = "sdpo"
    shapes = builders.shape_set(c, ic)
    teacher = shapes.teacher
    # and one row length more: 1024 + the feedback (192 tokens of text, a 108-token screen and
    # its 2 markers, 3 peer calls of 48 + 8 tokens) = 1494, rounded up to a multiple of 128
    assert [(s.rows, s.length) for s in teacher] == [
        (16, 512),
        (16, 1024),
        (16, 1536),
        (48, 512),
        (48, 1024),
        (48, 1536),
    ]
    # 4 screens a row (3 turns x 1 screen + the final one); 16 episodes x 3 turns x 2 screens
    assert teacher[0].patches == 16 * 4 * 432 and teacher[3].patches == 16 * 3 * 2 * 432
    assert max(s.length for s in shapes.rl) == 1024
    assert shapes.of("teacher") == teacher and "teacher 16x512" in shapes.describe()
    # feedback demonstrations in SFT (sft.feedback_share) carry the final screenshot as well
    assert shapes.sft[0].patches == 8 * 3 * 432
    c.sft.feedback_share = 0.5
    assert builders.shape_set(c, ic).sft[0].patches == 8 * 4 * 432
    c.rl.sdpo_feedback = "checker_message"  # no screen added, no peer calls
    assert builders.shape_set(c, ic).teacher[0].patches == 16 * 3 * 432
    assert builders.shape_set(c, ic).teacher[2].length == 1280  # 1024 + 192, rounded up
    assert builders.shape_set(c, ic).sft[0].patches == 8 * 3 * 432
