"""Result summaries: cua_jax.evaluation.stats against hand-worked numbers (and scipy where it has
them), the OSWorld-style result directories, tools/show_results.py and the side-by-side page."""

import math

import pytest
from scipy import stats as sps

from cua_jax.evaluation import stats as S


def test_wilson_interval_hand_numbers():
    # 7/10 at 95%: z = 1.959964, center = (0.7 + z^2/20) / (1 + z^2/10) = 0.644490,
    # half = z * sqrt(0.021 + z^2/400) / (1 + z^2/10) = 0.247713 -> [0.396778, 0.892209]
    lo, hi = S.wilson_interval(7, 10)
    assert lo == pytest.approx(0.396778, abs=1e-6) and hi == pytest.approx(0.892209, abs=1e-6)
    # 0/10: the lower end is exactly 0, the upper z^2/(n + z^2) = 3.841459/13.841459
    lo, hi = S.wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(3.841459 / 13.841459, abs=1e-6)
    assert S.wilson_interval(10, 10)[1] == 1.0
    assert S.wilson_interval(0, 0) == (0.0, 1.0)
    # scipy's binomtest Wilson interval agrees
    ci = sps.binomtest(37, 80).proportion_ci(0.9, method="wilson")
    assert S.wilson_interval(37, 80, 0.9) == pytest.approx((ci.low, ci.high), abs=1e-9)
    with pytest.raises(ValueError):
        S.wilson_interval(11, 10)


def test_pass_at_k_hand_numbers():
    assert S.pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # 1 - C(7,5)/C(10,5)
    assert S.pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the success rate
    assert S.pass_at_k(5, 0, 3) == 0.0
    assert S.pass_at_k(5, 3, 3) == 1.0  # n - c < k: every draw of 3 holds a success
    assert S.pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert S.mean_pass_at_k([(4, 1), (10, 3)], 2) == pytest.approx((0.5 + (1 - 21 / 45)) / 2)
    with pytest.raises(ValueError):
        S.pass_at_k(3, 1, 4)


def test_mcnemar_exact_hand_numbers():
    # b=1, c=8: 2 * P(X <= 1 | Bin(9, 1/2)) = 2 * (1 + 9) / 512
    assert S.mcnemar_exact(1, 8) == pytest.approx(20 / 512)
    assert S.mcnemar_exact(8, 1) == S.mcnemar_exact(1, 8)
    assert S.mcnemar_exact(0, 0) == 1.0
    assert S.mcnemar_exact(3, 3) == 1.0
    assert S.mcnemar_exact(0, 5) == pytest.approx(2 / 32)
    assert S.mcnemar_exact(4, 11) == pytest.approx(sps.binomtest(4, 15).pvalue)


def test_paired_comparison_and_category_table():
    a = {"t1": True, "t2": True, "t3": False, "t4": True, "t5": False, "only_a": True}
    b = {"t1": True, "t2": False, "t3": True, "t4": False, "t5": False, "only_b": True}
    cmp = S.compare_paired(a, b)
    assert cmp.n == 5 and (cmp.a.successes, cmp.b.successes) == (3, 2)
    assert (cmp.only_a, cmp.only_b) == (2, 1)
    assert cmp.p_value == pytest.approx(1.0)  # 2 * P(X <= 1 | Bin(3, 1/2)) = 2 * 4/8
    table = S.by_category([True, False, True, True], ["click", "click", "forms", ""])
    assert {k: (r.successes, r.n) for k, r in table.items()} == {
        "click": (1, 2),
        "forms": (1, 1),
        "all": (1, 1),
        "overall": (3, 4),
    }
    assert math.isclose(table["overall"].rate, 0.75)
    text = S.format_table(table)
    assert "click" in text and "0.750" in text and "95% CI" in text


# ------------------------------------------------------------------ result directories

import json  # noqa: E402
import os  # noqa: E402

import numpy as np  # noqa: E402

from cua_jax import actions as A  # noqa: E402
from cua_jax.env_api import Task  # noqa: E402
from cua_jax.evaluation import results as R  # noqa: E402
from cua_jax.rl.trajectory import Trajectory, Turn  # noqa: E402
from tools import show_results  # noqa: E402


def _episode(task_id, score, turns=2, fault=None):
    ts = [
        Turn(
            prompt_ids=[1, 2],
            generated_ids=[3],
            logprobs=[0.0],
            action=[A.Click(10.0 + k, 20.0)] if k % 2 == 0 else [A.TypeText("hi")],
            feedback=f"fb{k}",
        )
        for k in range(turns)
    ]
    t = Trajectory(task_id=task_id, group_id="", turns=ts, score=score, success=score >= 1)
    t.failure_reason = fault
    return t


def _write(result_dir, outcomes, agent):
    """outcomes: {(category, task id): score or "fault"}."""
    rng = np.random.default_rng(0)
    for (cat, tid), score in outcomes.items():
        task = Task(id=tid, instruction=f"do {tid}", source="test", category=cat)
        fault = "env_error: boom" if score == "fault" else None
        traj = _episode(tid, 0.0 if fault else score, fault=fault)
        shots = [rng.integers(0, 255, (40, 60, 3), dtype=np.uint8) for _ in traj.turns]
        R.write_episode(str(result_dir), task, traj, shots, ["text a", "text b"], agent=agent)


A_OUT = {
    ("click", "builtin/click/1"): 1.0,
    ("click", "builtin/click/2"): 0.0,
    ("click", "builtin/click/3"): 1.0,
    ("forms", "builtin/form/1"): 1.0,
    ("forms", "builtin/form/2"): "fault",
    ("", "custom/x"): 0.0,
}
B_OUT = {
    ("click", "builtin/click/1"): 0.0,
    ("click", "builtin/click/2"): 0.0,
    ("click", "builtin/click/3"): 1.0,
    ("forms", "builtin/form/1"): 0.0,
    ("forms", "builtin/form/2"): 1.0,
    ("", "custom/x"): 0.0,
}


def test_result_directories_and_osworld_summary(tmp_path, capsys):
    _write(tmp_path / "a", A_OUT, "agent-a")
    ep = tmp_path / "a" / "click" / "builtin__click__1"
    assert sorted(os.listdir(ep)) == [
        "meta.json",
        "result.txt",
        "step_1.png",
        "step_2.png",
        "traj.jsonl",
    ]
    lines = [json.loads(x) for x in open(ep / "traj.jsonl")]
    assert (
        [x["step_num"] for x in lines] == [1, 2]
        and lines[-1]["done"]
        and lines[-1]["reward"] == 1.0
    )
    assert lines[0]["actions"] == [
        {"type": "Click", "x": 10.0, "y": 20.0, "button": "left", "count": 1}
    ]
    assert R.action_from_json(lines[0]["actions"][0]) == A.Click(10.0, 20.0)
    assert R.action_from_json({"type": "__import__", "x": 1}) is None
    assert lines[0]["response"] == "text a" and lines[1]["feedback"] == "fb1"
    # the faulted episode is written but not scored (as eval.json leaves it out)
    assert not (tmp_path / "a" / "forms" / "builtin__form__2" / "result.txt").exists()
    s = R.summarize(str(tmp_path / "a"))
    assert {d: (r.ran, r.score, r.successes) for d, r in s.domains.items()} == {
        "all": (1, 0.0, 0),
        "click": (3, 2.0, 2),
        "forms": (1, 1.0, 1),
    }
    assert show_results.main([str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "Domain: click Runned: 3 Successully Ran: 2 Success Rate: 66.67 %" in out
    assert "Runned: 5 Current Success Rate: 60.00 %" in out
    assert "overall       5      3   0.600  [0.231, 0.882]" in out
    assert "all           1      0   0.000  [0.000, 0.793]" in out


def test_compare_two_agents_and_the_side_by_side_page(tmp_path, capsys):
    _write(tmp_path / "a", A_OUT, "agent-a")
    _write(tmp_path / "b", B_OUT, "agent-b")
    page = tmp_path / "side.html"
    argv = [str(tmp_path / "a"), f"--compare={tmp_path / 'b'}", f"--html={page}"]
    assert show_results.main(argv) == 0
    out = capsys.readouterr().out
    # common scored tasks: click/1-3, form/1, custom/x (form/2 faulted in A): A 3/5, B 1/5,
    # only A: click/1, form/1; only B: none -> p = 2 * P(X <= 0 | Bin(2, 1/2)) = 0.5
    assert "5 tasks in both" in out and "solved only by A: 2" in out
    assert "solved only by B: 0" in out and "McNemar exact p = 0.5" in out
    html = page.read_text()
    assert "agent-a vs agent-b" in html and html.count("<img src='data:image/png;base64,") == 24
    assert "builtin/click/1" in html and "fb1" in html
    assert show_results.main([str(tmp_path / "nowhere")]) == 2
