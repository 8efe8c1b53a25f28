"""train.py's lever wiring from config (no model, no environment): estimator, source levers,
and the combinations that cannot work, refused at launch naming the keys."""

import types

import pytest

from configs.qwen3vl_grpo import get_config
from cua_jax.config.checks import ConfigError
from cua_jax.rl.learner import AdvantageConfig
from cua_jax.rl.levers import check_levers, source_levers, use_advantage_estimator


@pytest.mark.parametrize(
    "name, std, expected",
    [("grpo", True, (True, False)), ("grpo", False, (False, False)), ("rloo", True, (False, True))],
)
def test_advantage_estimator_reaches_the_learner(name, std, expected):
    c = get_config("smoke")
    c.rl.advantage, c.rl.std_normalize = name, std
    learner = types.SimpleNamespace(advantage_config=AdvantageConfig(zero_variance="keep"))
    use_advantage_estimator(learner, c)
    a = learner.advantage_config
    assert (a.normalize_std, a.leave_one_out) == expected and a.zero_variance == "keep"


def test_source_levers_from_config(tmp_path):
    c = get_config("smoke")
    assert source_levers(c, str(tmp_path)) == {
        "dynamic_sampling": False,
        "max_sampling_rounds": 3,
        "replay_successes": False,
        "replay_max_staleness": None,  # -1: the groups' own bound
        "persist_dir": None,
    }
    c.rl.dynamic_sampling, c.rl.max_sampling_rounds = True, 5
    c.rl.replay_successes, c.rl.replay_max_staleness = True, 7
    c.rl.persist_rollouts = True
    out = source_levers(c, str(tmp_path))
    assert out["dynamic_sampling"] and out["max_sampling_rounds"] == 5
    assert out["replay_successes"] and out["replay_max_staleness"] == 7
    assert out["persist_dir"] == str(tmp_path / "rollouts")


def test_levers_that_cannot_work_are_refused_by_name():
    c = get_config("smoke")
    check_levers(c)
    c.rl.ppo_epochs, c.rl.old_logprobs = 2, "learner"
    with pytest.raises(ConfigError, match="ppo_epochs=2 x ppo_minibatches=1.*'behaviour'"):
        check_levers(c)
    c = get_config("smoke")
    c.rl.advantage = "ppo"
    with pytest.raises(ConfigError, match="rl.advantage='ppo' is not one of grpo, drgrpo, rloo"):
        check_levers(c)
