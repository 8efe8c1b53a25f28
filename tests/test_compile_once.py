"""Compile once (#23): compile accounting from JAX's monitoring events, the learner's fixed shape
set, and a few GRPO steps with varied episodes that compile nothing after the warm-up."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from cua_jax import compile_stats


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
