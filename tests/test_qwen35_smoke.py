"""`launch/tpu.py --config=configs/qwen35_grpo.py:smoke` (and `:smoke_moe`) trains on the CPU:
the tiny random Qwen3.5 (hybrid Gated DeltaNet / full attention; and its MoE), the shipped
tokenizer, the hybrid-cache sampler, the learner, built-in browser tasks in Chromium. Shortened
to an SFT step and a GRPO step of two episodes, one turn each, so the test is about whether the
whole job runs for this family (the full-length smoke is the preset itself). Zero-variance
groups are kept (advantage 0), so the GRPO step runs its update whatever the rewards.

The MoE run is the dense one with the sparse blocks (8 experts top-2 and the gated shared
expert): the same Gated DeltaNet and full-attention layers, cache and job path, so the default
suite runs it and the dense run is opt-in (`CUA_LONG_TESTS=1`, ~1.5 min of CPU); the dense MLP
is Qwen3-VL's, trained by the smoke job of tests/test_train_smoke.py."""

import math
import os

import pytest

from tests.main_job import metrics_rows, run_main_job

SHORT = [
    "--config.total_steps=1",
    "--config.sft.steps=1",
    "--config.sft.episodes_per_task=1",
    "--config.sft.num_tasks=1",
    "--config.rl.group_size=2",
    "--config.rl.groups_per_batch=1",
    "--config.rl.max_tokens=24",
    "--config.env.concurrency=2",
    "--config.env.max_turns=1",
    "--config.ckpt.save_every=1",
    "--config.log.eval_every=100",
    "--config.log.progress=False",
    "--config.rl.filter_zero_variance=False",
    "--config.compile_cache_dir=",
    "--config.tasks=({'source_type': 'builtin', 'split': 'train', 'difficulty': 'easy', "
    "'category': 'click', 'seed': 0, 'limit': 1},)",
    "--config.eval_tasks=({'source_type': 'builtin', 'split': 'eval', 'difficulty': 'easy', "
    "'seed': 1000, 'limit': 1},)",
]


@pytest.mark.parametrize(
    "preset",
    [
        pytest.param(
            "smoke",
            marks=pytest.mark.skipif(
                not os.environ.get("CUA_LONG_TESTS"),
                reason="the dense repeat of the MoE job (~1.5 min of CPU): CUA_LONG_TESTS=1",
            ),
        ),
        "smoke_moe",
    ],
)
def test_qwen35_smoke_trains(preset, tmp_path):
    run_main_job([f"--config=configs/qwen35_grpo.py:{preset}", *SHORT], str(tmp_path))
    rows = metrics_rows(str(tmp_path))
    sft = [r for r in rows if r.get("phase_sft") == 1.0]
    assert sft and sft[0]["sft/demos"] >= 1 and math.isfinite(sft[0]["sft/loss_last"])
    r = [r for r in rows if r["step"] == 1][-1]
    assert r["train/samples"] == 2 and "skipped_no_signal" not in str(r), r
    assert math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"]), r
    # the padding share of the step's packed batch (#34) is in its metrics row
    assert 0.0 <= r["train/padding_share"] < 1.0, r
    assert r["rollout/faults_sampler_error"] == 0.0
