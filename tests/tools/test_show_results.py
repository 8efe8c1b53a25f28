"""Result summaries: cua_jax.evaluation.stats against hand-worked numbers (and scipy where it has
them), the OSWorld-style result directories, tools/show_results.py and the side-by-side page."""

import math

import pytest
from scipy import stats as sps

from cua_jax.evaluation import stats as S


def test_wilson_interval_hand_numbers():
    # 7/10 at 95%: z = 1.959964, center = (0.7 + z^2/20) / (1 + z^2/10) = 0.644490,
    # half = z * sqrt(0.021 + z^2/400) / (1 + z^2/10) = 0.247713 -> [0.396778, 0.892209]
    lo, hi = S.wilson_interval(7, 10)
    assert lo == pytest.approx(0.396778, abs=1e-6) and hi == pytest.approx(0.892209, abs=1e-6)
    # 0/10: the lower end is exactly 0, the upper z^2/(n + z^2) = 3.841459/13.841459
    lo, hi = S.wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(3.841459 / 13.841459, abs=1e-6)
    assert S.wilson_interval(10, 10)[1] == 1.0
    assert S.wilson_interval(0, 0) == (0.0, 1.0)
    # scipy's binomtest Wilson interval agrees
    ci = sps.binomtest(37, 80).proportion_ci(0.9, method="wilson")
    assert S.wilson_interval(37, 80, 0.9) == pytest.approx((ci.low, ci.high), abs=1e-9)
    with pytest.raises(ValueError):
        S.wilson_interval(11, 10)


def test_pass_at_k_hand_numbers():
    assert S.pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # 1 - C(7,5)/C(10,5)
    assert S.pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the success rate
    assert S.pass_at_k(5, 0, 3) == 0.0
    assert S.pass_at_k(5, 3, 3) == 1.0  # n - c < k: every draw of 3 holds a success
    assert S.pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert S.mean_pass_at_k([(4, 1), (10, 3)], 2) == pytest.approx((0.5 + (1 - 21 / 45)) / 2)
    with pytest.raises(ValueError):
        S.pass_at_k(3, 1, 4)


def test_mcnemar_exact_hand_numbers():
    # b=1, c=8: 2 * P(X <= 1 | Bin(9, 1/2)) = 2 * (1 + 9) / 512
    assert S.mcnemar_exact(1, 8) == pytest.approx(20 / 512)
    assert S.mcnemar_exact(8, 1) == S.mcnemar_exact(1, 8)
    assert S.mcnemar_exact(0, 0) == 1.0
    assert S.mcnemar_exact(3, 3) == 1.0
    assert S.mcnemar_exact(0, 5) == pytest.approx(2 / 32)
    assert S.mcnemar_exact(4, 11) == pytest.approx(sps.binomtest(4, 15).pvalue)


def test_paired_comparison_and_category_table():
    a = {"t1": True, "t2": True, "t3": False, "t4": True, "t5": False, "only_a": True}
    b = {"t1": True, "t2": False, "t3": True, "t4": False, "t5": False, "only_b": True}
    cmp = S.compare_paired(a, b)
    assert cmp.n == 5 and (cmp.a.successes, cmp.b.successes) == (3, 2)
    assert (cmp.only_a, cmp.only_b) == (2, 1)
    assert cmp.p_value == pytest.approx(1.0)  # 2 * P(X <= 1 | Bin(3, 1/2)) = 2 * 4/8
    table = S.by_category([True, False, True, True], ["click", "click", "forms", ""])
    assert {k: (r.successes, r.n) for k, r in table.items()} == {
        "click": (1, 2),
        "forms": (1, 1),
        "default": (1, 1),
        "all": (3, 4),
    }
    assert math.isclose(table["all"].rate, 0.75)
    text = S.format_table(table)
    assert "click" in text and "0.750" in text and "95% CI" in text
