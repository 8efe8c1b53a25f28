"""`rl.advantage` names -> `group_advantages` options, against hand-computed advantages."""

import numpy as np
import pytest

from cua_jax.rl.advantages import estimator_options, group_advantages

R = np.array([[1.0, 0.0, 0.0, 1.0, 1.0]])  # mean 0.6


@pytest.mark.parametrize(
    "name, expected",
    [
        # (r - 0.6) / std; unbiased std = sqrt((3 * 0.16 + 2 * 0.36) / 4) = sqrt(0.3)
        ("grpo", [0.4 / 0.3**0.5, -0.6 / 0.3**0.5, -0.6 / 0.3**0.5] + [0.4 / 0.3**0.5] * 2),
        ("drgrpo", [0.4, -0.6, -0.6, 0.4, 0.4]),
        # leave-one-out: 1 - 2/4 = 0.5;  0 - 3/4 = -0.75
        ("rloo", [0.5, -0.75, -0.75, 0.5, 0.5]),
    ],
)
def test_estimators_by_name(name, expected):
    adv, keep = group_advantages(R, eps=0.0, **estimator_options(name))
    np.testing.assert_allclose(adv[0], expected, rtol=1e-6)
    assert keep.tolist() == [True]


def test_std_normalize_false_turns_grpo_into_dr_grpo_only():
    assert estimator_options("grpo", std_normalize=False) == estimator_options("drgrpo")
    assert estimator_options("rloo", std_normalize=False) == estimator_options("rloo")


def test_unknown_estimator_is_named():
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'.*grpo, drgrpo, rloo"):
        estimator_options("ppo")
