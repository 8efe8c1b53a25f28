"""Group-relative advantages for GRPO and its variants (host-side numpy, small pure functions).

Symbols follow the papers. A GRPO *group* is the G rollouts o_1..o_G sampled for one prompt q
(one task), with scalar rewards r_1..r_G. Every generated token of rollout i gets the same
advantage Â_i (outcome supervision).

- GRPO (Shao et al. 2024, "DeepSeekMath", eq. for outcome supervision):
  Â_i = (r_i - mean(r)) / std(r)
- Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): drop the std division,
  Â_i = r_i - mean(r)  (``normalize_std=False``)
- RLOO (Kool et al. 2019; Ahmadian et al. 2024): leave-one-out baseline,
  Â_i = r_i - 1/(G-1) Σ_{j≠i} r_j = G/(G-1) (r_i - mean(r))  (``leave_one_out=True``)
- DAPO dynamic sampling (Yu et al. 2025): groups whose rewards are all equal carry no signal
  (every Â_i = 0); they are filtered out (``zero_variance="filter"``) or kept with Â = 0
  (``zero_variance="keep"``).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

ZeroVariance = Literal["filter", "keep"]

# `rl.advantage` names -> `group_advantages` options (the estimator of each paper above).
ESTIMATORS: dict[str, dict[str, bool]] = {
    "grpo": {"normalize_std": True, "leave_one_out": False},
    "drgrpo": {"normalize_std": False, "leave_one_out": False},
    "rloo": {"normalize_std": False, "leave_one_out": True},
}


def estimator_options(name: str, *, std_normalize: bool = True) -> dict[str, bool]:
    """`group_advantages` keyword options of the estimator `name` ("grpo" | "drgrpo" | "rloo").

    ``std_normalize=False`` (the older `rl.std_normalize` key) turns "grpo" into Dr. GRPO; the
    other two never divide by the std.
    """
    if name not in ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {name!r}; use one of {', '.join(ESTIMATORS)}"
        )
    opts = dict(ESTIMATORS[name])
    opts["normalize_std"] = opts["normalize_std"] and std_normalize
    return opts


def group_advantages(
    rewards_NG: np.ndarray,
    *,
    normalize_std: bool = True,
    leave_one_out: bool = False,
    eps: float = 1e-6,
    std_ddof: int = 1,
    zero_variance: ZeroVariance = "filter",
) -> tuple[np.ndarray, np.ndarray]:
    """Advantages Â for N groups of G rollouts each.

    Args:
      rewards_NG: f[N, G] rewards r, one row per group (task).
      normalize_std: divide by std(r) + eps (GRPO); False gives Dr. GRPO's mean-centering only.
      leave_one_out: use the RLOO baseline mean_{j≠i} r_j instead of mean(r).
      eps: added to std(r) so near-constant groups do not blow up.
      std_ddof: 1 = unbiased std, as torch's ``Tensor.std`` in TRL / verl; 0 = population std.
      zero_variance: "filter" marks groups with all-equal rewards as not kept (DAPO dynamic
        sampling); "keep" keeps them (their advantages are exactly 0 either way).

    Returns:
      (advantages f32[N, G], keep bool[N]). Rows with keep=False must not be trained on.
    """
    r = np.asarray(rewards_NG, dtype=np.float64)
    if r.ndim != 2:
        raise ValueError(f"rewards_NG must be 2-D [num_groups, group_size], got shape {r.shape}")
    n, g = r.shape
    if g < 2:
        raise ValueError(f"group_size must be >= 2 for group-relative advantages, got {g}")
    if zero_variance not in ("filter", "keep"):
        raise ValueError(f"zero_variance must be 'filter' or 'keep', got {zero_variance!r}")
    mean_N1 = r.mean(axis=1, keepdims=True)
    if leave_one_out:
        baseline_NG = (r.sum(axis=1, keepdims=True) - r) / (g - 1)
    else:
        baseline_NG = mean_N1
    adv = r - baseline_NG
    if normalize_std:
        std_N1 = r.std(axis=1, ddof=std_ddof, keepdims=True)
        adv = adv / (std_N1 + eps)
    # Exact equality: rewards are outcomes (0/1, scores); a tolerance would hide real signal.
    constant_N = np.all(r == r[:, :1], axis=1)
    adv[constant_N] = 0.0
    keep_N = np.ones(n, dtype=bool) if zero_variance == "keep" else ~constant_N
    return adv.astype(np.float32), keep_N
