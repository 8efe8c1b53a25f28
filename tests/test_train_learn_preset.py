"""The `learn` preset of both config files: CPU-sized, valid, the levers on, and every
checkpoint from step 0 (after SFT) to the last kept, so tools/eval.py can score both ends."""

import pytest

from configs import common, qwen3vl_grpo, qwen25vl_grpo
from cua_jax.config.checks import validate_config
from cua_jax.job.builders import check_levers


@pytest.mark.parametrize("module", [qwen3vl_grpo, qwen25vl_grpo])
def test_learn_preset_builds_valid_and_keeps_the_post_sft_checkpoint(module):
    c = module.get_config("learn")
    validate_config(c)
    check_levers(c)
    assert c.preset == "learn" and c.model.preset == "tiny" and c.model.hf_path is None
    assert c.sft.steps > 0 and c.total_steps > 0
    assert 0 < c.sft.num_tasks and c.rl.temperature < 1.0
    assert {t for src in c.tasks for t in src["templates"]} == set(common.LEARN_TEMPLATES)
    # held-out eval tasks: the eval split, seeds the training never sees
    assert all(src["split"] == "eval" for src in c.eval_tasks)
    saves = c.total_steps // c.ckpt.save_every + 1  # step 0 and every save_every steps
    assert saves <= c.ckpt.keep
    with pytest.raises(AttributeError):
        c.rl.dynamic_sampilng = True  # locked like every preset


def test_smoke_keeps_its_settings_and_unknown_presets_still_name_learn():
    smoke, learn = qwen3vl_grpo.get_config("smoke"), qwen3vl_grpo.get_config("learn")
    assert not smoke.rl.dynamic_sampling and smoke.sft.steps == 200 and smoke.total_steps == 16
    # smoke: forgiving pages with room for two more picks, and eval on 128 held-out pages;
    # learn keeps its own templates and in-run eval
    assert smoke.env.max_turns == 3
    assert {t for src in smoke.tasks for t in src["templates"]} == set(common.SMOKE_RL_TEMPLATES)
    assert [src["limit"] for src in smoke.eval_tasks] == [128]
    assert all(src["split"] == "eval" for src in smoke.eval_tasks)
    assert learn.env.max_turns >= smoke.env.max_turns
    with pytest.raises(ValueError, match="unknown preset 'huge'.*learn"):
        qwen3vl_grpo.get_config("huge")
