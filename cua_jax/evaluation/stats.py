"""Evaluation statistics as pure functions: success with a confidence interval, pass@k, tables
per category, and the paired comparison of two runs on the same tasks.

    wilson_interval(7, 10)                 # (0.3968, 0.8922) at 95%
    pass_at_k(n=10, c=3, k=5)              # 1 - C(7,5)/C(10,5) = 0.9167
    mcnemar_exact(b=1, c=8)                # two-sided exact p = 0.0391
    compare_paired(a, b)                   # both runs' rates, discordant counts, p-value
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from statistics import NormalDist


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (n = 0: (0, 1))."""
    if not 0 <= successes <= n:
        raise ValueError(f"successes={successes} must be in [0, n={n}]")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence} must be in (0, 1)")
    if n == 0:
        return 0.0, 1.0
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p = successes / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    low = 0.0 if successes == 0 else max(0.0, center - half)
    high = 1.0 if successes == n else min(1.0, center + half)
    return low, high


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c succeeded (Chen et al. 2021):
    1 - C(n - c, k) / C(n, k)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_pass_at_k(per_task: Sequence[tuple[int, int]], k: int) -> float:
    """pass@k averaged over tasks given (n samples, c successes) per task."""
    if not per_task:
        raise ValueError("no tasks")
    return sum(pass_at_k(n, c, k) for n, c in per_task) / len(per_task)


def binom_two_sided_half(b: int, c: int) -> float:
    """The exact two-sided p-value of b successes in b + c fair coin flips (min(1, 2 * tail))."""
    n = b + c
    if n == 0:
        return 1.0
    m = min(b, c)
    tail = sum(math.comb(n, i) for i in range(m + 1)) / 2**n
    return min(1.0, 2 * tail)


def mcnemar_exact(b: int, c: int) -> float:
    """McNemar's exact test of paired binary outcomes: b tasks only run A solved, c only run B
    solved; returns the two-sided p-value."""
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts must be >= 0 (b={b}, c={c})")
    return binom_two_sided_half(b, c)


@dataclasses.dataclass(frozen=True)
class Rate:
    successes: int
    n: int
    low: float
    high: float

    @property
    def rate(self) -> float:
        return self.successes / self.n if self.n else float("nan")


def rate(successes: int, n: int, confidence: float = 0.95) -> Rate:
    return Rate(successes, n, *wilson_interval(successes, n, confidence))


def by_category(
    outcomes: Sequence[bool], categories: Sequence[str], confidence: float = 0.95
) -> dict[str, Rate]:
    """Success with its interval per category (an empty one is "all", as in eval.json), plus
    "overall" (in first-seen category order)."""
    if len(outcomes) != len(categories):
        raise ValueError(f"{len(outcomes)} outcomes for {len(categories)} categories")
    table: dict[str, list[int]] = {}
    for ok, cat in zip(outcomes, categories, strict=True):
        s = table.setdefault(cat or "all", [0, 0])
        s[0] += bool(ok)
        s[1] += 1
    out = {cat: rate(s, n, confidence) for cat, (s, n) in table.items()}
    out["overall"] = rate(sum(bool(o) for o in outcomes), len(outcomes), confidence)
    return out


def format_table(rates: Mapping[str, Rate], confidence: float = 0.95) -> str:
    """A plain-text table: category, n, successes, rate, interval."""
    w = max([len("category"), *(len(k) for k in rates)])
    pct = f"{confidence:.0%} CI"
    lines = [f"{'category':<{w}}  {'n':>5}  {'ok':>5}  {'rate':>6}  {pct:>15}"]
    for k, r in rates.items():
        lines.append(
            f"{k:<{w}}  {r.n:>5}  {r.successes:>5}  {r.rate:>6.3f}  [{r.low:.3f}, {r.high:.3f}]"
        )
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class PairedComparison:
    n: int  # tasks in both runs
    a: Rate
    b: Rate
    only_a: int  # solved by A, not by B
    only_b: int
    p_value: float  # McNemar's exact two-sided


def compare_paired(
    a: Mapping[str, bool], b: Mapping[str, bool], confidence: float = 0.95
) -> PairedComparison:
    """Two runs (task id -> success) on the tasks both have: rates and McNemar's exact test."""
    common = sorted(set(a) & set(b))
    if not common:
        raise ValueError("the two runs share no task")
    sa = sum(bool(a[t]) for t in common)
    sb = sum(bool(b[t]) for t in common)
    only_a = sum(bool(a[t]) and not b[t] for t in common)
    only_b = sum(bool(b[t]) and not a[t] for t in common)
    n = len(common)
    return PairedComparison(
        n,
        rate(sa, n, confidence),
        rate(sb, n, confidence),
        only_a,
        only_b,
        mcnemar_exact(only_a, only_b),
    )


__all__ = [
    "PairedComparison",
    "Rate",
    "by_category",
    "compare_paired",
    "format_table",
    "mcnemar_exact",
    "mean_pass_at_k",
    "pass_at_k",
    "rate",
    "wilson_interval",
]
