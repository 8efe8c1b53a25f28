r"""Success per domain and overall of an OSWorld-style result directory, and two agents compared.

    python tools/show_results.py RESULT_DIR
    python tools/show_results.py RESULTS --action_space=pyautogui --observation_type=screenshot \
        --model=MODEL        # OSWorld's layout: RESULTS/<action_space>/<observation_type>/<model>
    python tools/show_results.py RESULT_DIR --compare=OTHER_RESULT_DIR [--html=PAGE.html]

RESULT_DIR is what tools/eval.py writes (OUT/results, `RESULT_DIR/<domain>/<task>/result.txt`)
or an OSWorld run's `results/<action_space>/<observation_type>/<model>/` (or its `results/` with
--model, as OSWorld's show_result.py takes it). The first lines are OSWorld's show_result.py
output (episodes run, score sum and rate per domain; its Office / Daily / Professional rates
where all their domains ran; then overall, with the score sum out of the episodes run);
then a table of successes (score >= 1) per domain with 95% Wilson intervals. With --compare:
the tasks both directories ran, each one's success, the tasks only one of them solved and
McNemar's exact p-value, and (--html) a page with the two trajectories of every common task
side by side.
"""

from __future__ import annotations

import argparse
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from cua_jax.evaluation import results as R  # noqa: E402
from cua_jax.evaluation import stats as S  # noqa: E402

# OSWorld's show_result.py: its domain groups (a group's rate: its scores' sum over its episodes).
GROUPS = {
    "Office": ("libreoffice_calc", "libreoffice_impress", "libreoffice_writer"),
    "Daily": ("vlc", "thunderbird", "chrome"),
    "Professional": ("gimp", "vs_code"),
}


def osworld_lines(s: R.Summary) -> list[str]:
    """The group rates and the closing score OSWorld's show_result.py adds."""
    lines = []
    for name, members in GROUPS.items():
        if all(m in s.domains for m in members):
            ran = sum(s.domains[m].ran for m in members)
            score = sum(s.domains[m].score for m in members)
            lines.append(f"{name} Success Rate: {100.0 * score / ran:.2f} %")
    if s.ran:
        lines.append(f"Score: {round(s.score, 2):g} / {s.ran}")
    return lines


def report(result_dir: str) -> str:
    """OSWorld's lines, then the success table with intervals."""
    s = R.summarize(result_dir)
    out = [R.format_summary(s), *osworld_lines(s)]
    if s.ran:
        rates = {d: S.rate(r.successes, r.ran) for d, r in s.domains.items()}
        rates["overall"] = S.rate(s.successes, s.ran)
        out += ["", S.format_table(rates)]
    return "\n".join(out)


def outcomes(result_dir: str) -> dict[str, bool]:
    """domain/task -> success (score >= 1) of every episode with a result.txt."""
    s = R.summarize(result_dir)
    return {f"{d}/{t}": v >= 1.0 for d, tasks in s.scores.items() for t, v in tasks.items()}


def compare(a_dir: str, b_dir: str) -> str:
    """Two result directories' success on their shared tasks, paired (McNemar exact test)."""
    a, b = outcomes(a_dir), outcomes(b_dir)
    c = S.compare_paired(a, b)
    only_a = sorted(t for t in set(a) & set(b) if a[t] and not b[t])
    only_b = sorted(t for t in set(a) & set(b) if b[t] and not a[t])
    return "\n".join(
        [
            f"{c.n} tasks in both",
            f"A {a_dir}: {c.a.successes}/{c.n} = {c.a.rate:.3f} [{c.a.low:.3f}, {c.a.high:.3f}]",
            f"B {b_dir}: {c.b.successes}/{c.n} = {c.b.rate:.3f} [{c.b.low:.3f}, {c.b.high:.3f}]",
            f"solved only by A: {c.only_a} {only_a[:20]}",
            f"solved only by B: {c.only_b} {only_b[:20]}",
            f"McNemar exact p = {c.p_value:.4g}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """The command line: runs what the module docstring describes."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("result_dir")
    p.add_argument("--compare", help="a second result directory (same tasks)")
    p.add_argument("--html", help="with --compare: write the side-by-side page here")
    p.add_argument("--tasks", nargs="*", help="task ids for the page (default: all common)")
    p.add_argument("--model", help="OSWorld's layout: read RESULT_DIR/<as>/<obs>/<model>")
    p.add_argument("--action_space", default="pyautogui", help="with --model (OSWorld's default)")
    p.add_argument("--observation_type", default="screenshot", help="with --model")
    args = p.parse_args(argv)
    if args.model:
        args.result_dir = os.path.join(
            args.result_dir, args.action_space, args.observation_type, args.model
        )
    try:
        print(report(args.result_dir))
        if args.compare:
            print()
            print(report(args.compare))
            print()
            print(compare(args.result_dir, args.compare))
            if args.html:
                page = R.side_by_side_html([args.result_dir, args.compare], args.tasks)
                with open(args.html, "w") as f:
                    f.write(page)
                print(f"wrote {args.html}")
        elif args.html:
            p.error("--html needs --compare")
    except (FileNotFoundError, ValueError) as e:
        print(f"tools/show_results.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
