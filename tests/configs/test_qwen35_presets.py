"""configs/qwen35_grpo.py: its presets build and pass the config checks, the real presets' LoRA
targets name modules the Qwen3.5 models have, and the family checks name the fix."""

import json
import re

import pytest
from flax import nnx

from configs import qwen35_grpo
from cua_jax.config import checks as config_checks
from cua_jax.models import lora, qwen_vl


@pytest.mark.parametrize("preset", ["smoke", "smoke_moe"])
def test_smoke_presets_validate(preset):
    c = qwen35_grpo.get_config(preset)
    assert c.model.family == "qwen3_5" and c.env.action_format == "qwen35"
    assert c.model.preset == ("tiny_moe" if preset == "smoke_moe" else "tiny")
    config_checks.validate_config(c)


def test_real_presets_lora_targets_match_the_model():
    """Every target pattern wraps something on the tiny model of the preset's kind: attention,
    Gated DeltaNet and MLP projections (27b); the expert stacks and the shared expert too
    (35b-a3b)."""
    for preset, cfg in (("27b", qwen_vl.tiny_qwen35()), ("35b-a3b", qwen_vl.tiny_qwen35_moe())):
        c = qwen35_grpo.get_config(preset)
        assert c.preset == c.model.preset == preset and c.model.lora_rank > 0
        wrapped: list[str] = []

        def build(cfg=cfg, c=c, wrapped=wrapped):  # abstractly: no weights drawn
            model = qwen_vl.init_random(cfg)
            wrapped += lora.apply_lora(model, 4, 8.0, c.model.lora_targets)
            return model

        nnx.eval_shape(build)
        for pattern in c.model.lora_targets:
            assert any(re.search(pattern, p) for p in wrapped), pattern
    assert qwen35_grpo.get_config("35b-a3b").rl.routing_replay


def test_family_checks_name_the_fix(tmp_path):
    c = qwen35_grpo.get_config("smoke")
    c.model.hf_path = str(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    with pytest.raises(config_checks.ConfigError, match="'qwen3_vl' config file"):
        config_checks.validate_config(c)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe"}))
    c.model.hf_path = None
    c.model.family = "qwen2_5_vl"
    c.model.preset = "tiny_moe"
    with pytest.raises(config_checks.ConfigError, match="tiny_moe.*Qwen3.5-MoE"):
        config_checks.validate_config(c)
