"""tools/compare_runs.py: the curves of a run from its metrics rows, by hand, and the picture."""

import json

import pytest

from tools import compare_runs


def _run(path, rows, group_size=4):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"rl": {"group_size": group_size}}))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


ROWS = [
    {"step": 0, "time": 100.0, "eval/success": 0.0},  # before SFT: not part of the RL curve
    {"step": 0, "time": 160.0, "phase_sft": 1.0, "eval/success": 0.25},
    {"step": 1, "time": 190.0, "rollout/groups_sampled": 4.0},
    {"step": 2, "time": 220.0, "rollout/groups_sampled": 6.0, "eval/success": 0.5},  # refills
    {"step": 3, "time": 280.0, "rollout/groups_sampled": 4.0, "eval/success": 0.375},
]


def test_curves_start_after_sft_and_count_every_sampled_group(tmp_path):
    c = compare_runs.curves(_run(tmp_path / "a", ROWS))
    assert c == {
        "step": [0.0, 2.0, 3.0],
        "rollouts": [0.0, 40.0, 56.0],  # (4 + 6) x 4, then + 4 x 4
        "minutes": [0.0, 1.0, 2.0],
        "success": [0.25, 0.5, 0.375],
    }
    # a run without SFT starts from its step-0 eval
    c = compare_runs.curves(_run(tmp_path / "b", [ROWS[0], *ROWS[2:]]))
    assert c["step"] == [0.0, 2.0, 3.0] and c["minutes"][1] == pytest.approx(2.0)


def test_picture_and_summary_lines(tmp_path, capsys):
    a = _run(tmp_path / "a", ROWS)
    out = tmp_path / "c.png"
    compare_runs.main([f"GRPO λ=0={a}", f"--out={out}"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "GRPO λ=0: 0:0.250 2:0.500 3:0.375 | best 0.500 at step 2, 40 rollouts, 1.0 min" in (
        capsys.readouterr().out
    )
    with pytest.raises(SystemExit):
        compare_runs.main([f"x={tmp_path}", f"--out={out}"])  # not a workdir


def test_seeds_of_a_method_are_averaged_with_a_band(tmp_path, capsys):
    a = _run(tmp_path / "a", ROWS)
    faster = [{**r, "time": 100.0 + (r["time"] - 100.0) / 2} for r in ROWS]
    b = _run(tmp_path / "b", [{**r, "eval/success": 1.0} if r["step"] == 3 else r for r in faster])
    c = compare_runs.mean_curves([compare_runs.curves(a), compare_runs.curves(b)])
    assert c["success"] == [0.25, 0.5, 0.6875] and c["lo"] == [0.25, 0.5, 0.375]
    assert c["hi"] == [0.25, 0.5, 1.0] and c["rollouts"] == [0.0, 40.0, 56.0]
    assert c["minutes"] == pytest.approx([0.0, 0.75, 1.5])
    out = tmp_path / "m.png"
    compare_runs.main([f"GRPO={a},{b}", f"--out={out}"])
    assert "GRPO: 0:0.250 2:0.500 3:0.688 | best 0.688 at step 3" in capsys.readouterr().out
    short = _run(tmp_path / "short", ROWS[:4])  # no eval at step 3
    with pytest.raises(SystemExit):
        compare_runs.main([f"GRPO={a},{short}", f"--out={out}"])
