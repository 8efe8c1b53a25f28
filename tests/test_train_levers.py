"""train.py's lever wiring from config (no environment): estimator, source levers, donation,
and the combinations that cannot work, refused at launch naming the keys."""

import types

import jax
import pytest

from configs.qwen3vl_grpo import get_config
from cua_jax.config.checks import ConfigError
from cua_jax.job.builders import check_levers, source_levers, use_advantage_estimator
from cua_jax.rl.learner import AdvantageConfig


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


@pytest.mark.parametrize(
    "mode, port, sft, donates",
    [
        ("sync", 0, False, True),
        ("sync", 0, True, True),
        ("async", 0, False, False),  # rollouts decode while the step runs
        ("async", 0, True, True),  # the SFT warm-up runs before any rollout
        ("sync", 8123, False, False),  # the live policy server may decode during any step
        ("async", 8123, True, False),
    ],
)
def test_a_step_never_donates_params_the_engine_may_be_decoding(mode, port, sft, donates):
    """A donated param buffer is deleted by the step: an engine still decoding it failed its
    requests with "Array has been deleted" (the live policy server during the SFT warm-up)."""
    from cua_jax.job import builders

    c = get_config("smoke")
    c.rl.mode, c.serve.port = mode, port
    mesh, rules = builders.mesh_and_rules(c, devices=jax.devices()[:1])  # the session forces 8
    model, _ = builders.build_model_and_processor(c, mesh, rules)
    assert builders.build_learner(model, c, mesh, rules, sft=sft).donates is donates
