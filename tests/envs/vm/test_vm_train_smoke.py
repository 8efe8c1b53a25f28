"""The main job on VM desktops (#19): `launch/tpu.py` with `env.kind=vm` on two local desktops
(Xvfb + openbox + our VM server), built-in desktop tasks that allow API actions.

The run's SFT warm-up plays the tasks' API oracles, the trained policy then writes API actions
(`run_shell`, `write_file`) of its own, and every episode after a desktop's first starts on a
recreated desktop (`rollout/env_resets`). The tiny model, the sampler and the learner are the
real ones; only the number of steps is cut.
"""

import json
import os
import sqlite3

import pytest

from tests.main_job import metrics_rows, run_main_job

TASKS = "('terminal-mkdir', 'terminal-delete-file')"
# the smoke preset on two small local desktops, episodes of two turns; 256x192 screens keep the
# SFT's 40 steps cheap (35 s against 53 s at 384x288, both optimized; session 28)
DESKTOPS = [
    "--config=configs/qwen3vl_grpo.py:smoke",
    "--config.env.kind=vm",
    "--config.env.concurrency=2",
    "--config.env.max_turns=2",
    "--config.env.viewport_width=256",
    "--config.env.viewport_height=192",
]


def test_smoke_run_on_local_desktops_resets_them_and_learns_api_actions(xserver, tmp_path):
    wd = str(tmp_path / "vm")
    args = [
        *DESKTOPS,
        "--config.total_steps=1",
        "--config.rl.group_size=2",
        "--config.rl.groups_per_batch=1",
        "--config.rl.max_tokens=48",
        "--config.sft.steps=40",
        "--config.sft.episodes_per_task=1",
        "--config.sft.recovery_share=0.0",
        "--config.log.eval_every=1",
        "--config.log.progress=False",
        "--config.compile_cache_dir=",
        f"--config.tasks=({{'source_type': 'desktop', 'names': {TASKS}, 'api_actions': 'all'}},)",
        f"--config.eval_tasks=({{'source_type': 'desktop', 'names': {TASKS}, "
        "'api_actions': 'all'},)",
    ]
    # XLA's default optimization: its compile costs less than -O0's slower 40 SFT steps
    run_main_job(args, wd, optimized=True)
    rows = metrics_rows(wd)
    step0, after_sft = rows[0], rows[1]
    (step1,) = [row for row in rows if row["step"] == 1]
    assert after_sft["phase_sft"] == 1.0 and after_sft["sft/demo_success"] == 1.0
    assert after_sft["sft/loss_last"] < after_sft["sft/loss_first"]
    # no episode was an infrastructure fault, in training or in either eval
    assert step1["rollout/env_failures"] == 0.0
    assert step0["eval/episodes_infra_fault"] == after_sft["eval/episodes_infra_fault"] == 0.0
    # two desktops, both up; every episode after a desktop's first ran on a recreated one:
    # the step-0 eval (2), the oracle demonstrations (2), the after-SFT eval (2), step 1 (2)
    assert step1["rollout/env_hosts"] == 2.0 and step1["rollout/env_hosts_down"] == 0.0
    assert step1["rollout/env_resets"] == 8 - 2
    # the trained policy writes API actions: the after-SFT eval's first turns name them
    with sqlite3.connect(os.path.join(wd, "trajectories.sqlite")) as db:
        first_turns = db.execute(
            "SELECT t.model_text FROM turns t JOIN rollouts r ON t.rollout_id = r.id "
            "WHERE r.kind = 'eval' AND r.step = 0 AND t.\"index\" = 0"
        ).fetchall()
    assert len(first_turns) == 4  # two evals at step 0 (before and after SFT), two tasks each
    api = [text for (text,) in first_turns if '"run_shell"' in text or '"write_file"' in text]
    assert len(api) >= 2, first_turns  # the after-SFT eval's (the random policy's: none)
    summary = json.load(open(os.path.join(wd, "summary.json")))
    assert summary["steps"] == 1 and summary["eval_success_after_sft"] is not None


@pytest.mark.skipif(
    not os.environ.get("CUA_LONG_TESTS"),
    reason="a second smoke job on desktops (~3-4 min on 2 cores): CUA_LONG_TESTS=1",
)
def test_sdpo_in_async_mode_on_desktops_shows_the_teacher_the_final_desktop(xserver, tmp_path):
    """rl.algorithm=sdpo with rl.mode=async on two local desktops (#16): with no SFT warm-up the
    tiny policy fails its episodes, so every step has failures to distill, and the teacher of
    every distilled sample is shown that episode's final desktop screenshot and the checker's
    report. The run trains (the distillation moves the policy where GRPO's advantages are all
    zero) and keeps its groups within the staleness bound."""
    wd = str(tmp_path / "vm_sdpo")
    args = [
        *DESKTOPS,
        "--config.total_steps=2",
        "--config.rl.mode=async",
        "--config.rl.max_steps_off_policy=1",
        "--config.rl.algorithm=sdpo",
        "--config.rl.filter_zero_variance=False",
        "--config.rl.group_size=2",
        "--config.rl.groups_per_batch=1",
        "--config.rl.max_tokens=48",
        "--config.sft.steps=0",
        "--config.log.eval_every=100",
        "--config.log.progress=False",
        "--config.log.db=False",
        "--config.compile_cache_dir=",
        f"--config.tasks=({{'source_type': 'desktop', 'names': {TASKS}}},)",
        f"--config.eval_tasks=({{'source_type': 'desktop', 'names': {TASKS}}},)",
    ]
    run_main_job(args, wd)
    steps = [row for row in metrics_rows(wd) if row["step"] >= 1]
    assert [row["step"] for row in steps] == [1, 2]
    distilled = sum(row["train/sdpo/teacher_samples"] for row in steps)
    assert distilled >= 1
    assert sum(row["train/sdpo/feedback_screens"] for row in steps) == distilled
    assert sum(row["train/sdpo/feedback_messages"] for row in steps) == distilled
    for row in steps:
        assert row["rollout/env_failures"] == 0.0
        assert 0.0 <= row["rollout/staleness_max"] <= 1.0
        assert row["train/sdpo/teacher_samples"] == 0 or row["train/sdpo/distilled_tokens"] > 0
