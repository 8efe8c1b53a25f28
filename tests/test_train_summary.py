"""summary.json's eval fields and curves.png's SFT marker, from a run's metrics rows as train.py
writes them (random-init eval and after-SFT eval both at step 0, GRPO evals after)."""

import json

from PIL import Image

from cua_jax.evaluation.summary import run_summary
from cua_jax.viz import curve_figure, entropulse_phases, plot_run_curves, sft_end

ROWS = [
    {"step": 0, "eval/success": 0.0, "phase_sft": 0.0},
    {"step": 0, "eval/success": 0.4375, "phase_sft": 1.0, "sft/steps": 150.0},
    {"step": 1, "rollout/reward": 0.25, "rollout/groups_sampled": 4.0, "train/loss": 0.1},
    {
        "step": 4,
        "eval/success": 0.5,
        "rollout/reward": 0.5,
        "rollout/groups_sampled": 4.0,
        "train/skipped_no_signal": 1.0,
    },
    {
        "step": 8,
        "eval/success": 0.625,
        "rollout/reward": 0.5,
        "rollout/groups_sampled": 4.0,
        "train/loss": 0.2,
    },
]


def test_summary_has_after_sft_final_and_the_rl_gain():
    s = run_summary(ROWS)
    assert s == {
        "eval_success_step0": 0.0,
        "eval_success_after_sft": 0.4375,
        "eval_success_final": 0.625,
        "eval_success_rl_gain": 0.1875,
        "eval_best_step": 8,
        "eval_success_best": 0.625,
        "rl_steps_updated": 2,
    }
    # a peak before the end: the best step is the peak's (the first of a tie)
    peaked = [*ROWS, {"step": 12, "eval/success": 0.5}, {"step": 16, "eval/success": 0.625}]
    assert run_summary(peaked)["eval_best_step"] == 8
    assert run_summary(peaked)["eval_success_final"] == 0.625
    json.dumps(s)  # summary.json


def test_summary_without_sft_or_evals():
    no_sft = [{"step": 0, "eval/success": 0.25, "phase_sft": 0.0}, {"step": 2, "eval/success": 0.5}]
    assert run_summary(no_sft) == {
        "eval_success_step0": 0.25,
        "eval_success_after_sft": None,
        "eval_success_final": 0.5,
        "eval_success_rl_gain": None,
        "eval_best_step": 2,
        "eval_success_best": 0.5,
        "rl_steps_updated": 0,
    }
    assert run_summary([{"step": 1, "train/loss": 1.0}])["eval_success_final"] is None
    assert run_summary([{"step": 1, "train/loss": 1.0}])["eval_best_step"] is None
    # the random-init eval before SFT is not a candidate: it is not the RL phase's
    before = [{"step": 0, "eval/success": 0.9, "phase_sft": 0.0}, *ROWS[1:]]
    assert run_summary(before)["eval_best_step"] == 8


def test_curves_mark_where_sft_ended(tmp_path):
    assert sft_end(ROWS) == {"step": 0, "sft_steps": 150.0, "eval_success": 0.4375}
    assert sft_end(ROWS[2:]) is None
    for name, rows in (("with_sft.png", ROWS), ("without.png", ROWS[2:])):
        out = plot_run_curves(rows, ["eval/success", "rollout/reward"], str(tmp_path / name))
        assert Image.open(out).size[0] > 400
    assert plot_run_curves(ROWS, ["missing/key"], str(tmp_path / "none.png")) is None


def test_curves_mark_entropulse_phases_and_their_entropy(tmp_path):
    """A phase that trained is a dotted purple line at its step on every panel, and on
    train/entropy an arrow from the entropy before to the entropy after; a skipped one is not."""
    rows = [
        *ROWS,
        {"step": 9, "train/entropy": 0.2},
        {
            "step": 10,
            "train/entropy": 0.1,
            "entropulse/phase": 1.0,
            "entropulse/sft_steps": 5.0,
            "entropulse/entropy_before": 0.1,
            "entropulse/entropy_after": 0.3,
        },
        {
            "step": 12,
            "train/entropy": 0.25,
            "entropulse/phase": 1.0,
            "entropulse/skipped_no_success": 1.0,
        },
    ]
    assert entropulse_phases(rows) == [
        {"step": 10, "sft_steps": 5.0, "entropy_before": 0.1, "entropy_after": 0.3}
    ]
    fig = curve_figure(rows, ["eval/success", "train/entropy"])
    for ax in fig.axes:
        purple = [ln for ln in ax.get_lines() if ln.get_color() == "tab:purple"]
        assert [ln.get_xdata()[0] for ln in purple if ln.get_linestyle() == ":"] == [10]
        assert "Entropulse SFT (5 steps)" in [t.get_text() for t in ax.get_legend().get_texts()]
    entropy_ax = fig.axes[1]
    (after,) = [ln for ln in entropy_ax.get_lines() if ln.get_marker() == "^"]
    assert list(after.get_xdata()) == [10] and list(after.get_ydata()) == [0.3]
    assert len(entropy_ax.texts) == 1  # the before -> after arrow
    assert plot_run_curves(rows, ["train/entropy"], str(tmp_path / "e.png")) is not None
