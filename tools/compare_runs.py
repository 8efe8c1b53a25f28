r"""Learning curves of several runs side by side: eval success per RL step, per rollout and per
wall-clock minute (a picture for BENCHMARKS.md and for choosing between algorithms).

    python tools/compare_runs.py --out=curves.png GRPO=/tmp/w/grpo SDPO=/tmp/w/sdpo [...]

Each NAME=WORKDIR is a run's workdir (`launch/tpu.py --workdir`); NAME=DIR1,DIR2,... is the
mean of several runs (seeds of one method, with the same eval steps), drawn with a band from
the lowest to the highest run. The curves are its in-run
eval (`eval/success` of WORKDIR/metrics.jsonl; the after-SFT eval is the RL phase's step 0),
against (a) the RL step, (b) rollouts so far (`rollout/groups_sampled` x `rl.group_size` of
WORKDIR/config.json, summed over the steps: dynamic sampling's extra groups count) and (c)
minutes since the RL phase began (the rows' `time` stamps). Prints one line a run: its evals
and how many rollouts and minutes it took to reach its best.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import Any


def _rows(workdir: str) -> list[dict[str, Any]]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(ln) for ln in f if ln.strip()]


def curves(workdir: str) -> dict[str, list[float]]:
    """{"step", "rollouts", "minutes", "success"}: one entry per eval of the RL phase, the first
    the policy it started from (after SFT, or a run's step-0 eval)."""
    with open(os.path.join(workdir, "config.json")) as f:
        group_size = int(json.load(f)["rl"]["group_size"])
    rows = _rows(workdir)
    evals = [r for r in rows if "eval/success" in r]
    if not evals:
        raise ValueError(f"{workdir}/metrics.jsonl has no eval/success row")
    start = next((r for r in evals if r.get("phase_sft") == 1.0), evals[0])
    out: dict[str, list[float]] = {"step": [], "rollouts": [], "minutes": [], "success": []}
    rollouts = 0.0
    for r in rows:
        if r["step"] > 0:
            rollouts += r.get("rollout/groups_sampled", 0.0) * group_size
        if "eval/success" in r and (r is start or r["step"] > 0):
            out["step"].append(float(r["step"]))
            out["rollouts"].append(rollouts)
            out["minutes"].append((r["time"] - start["time"]) / 60.0)
            out["success"].append(float(r["eval/success"]))
    return out


def mean_curves(runs: Sequence[dict[str, list[float]]]) -> dict[str, list[float]]:
    """The pointwise mean of several runs' `curves` (their eval steps must agree), with "lo" and
    "hi": the lowest and highest run's success at each eval (one run: its curves as they are)."""
    if len(runs) == 1:
        return runs[0]
    steps = runs[0]["step"]
    for c in runs[1:]:
        if c["step"] != steps:
            raise ValueError(
                f"runs with different eval steps cannot be averaged: {steps} vs {c['step']}"
            )
    n = len(runs)
    out = {k: [sum(c[k][i] for c in runs) / n for i in range(len(steps))] for k in runs[0]}
    out["lo"] = [min(c["success"][i] for c in runs) for i in range(len(steps))]
    out["hi"] = [max(c["success"][i] for c in runs) for i in range(len(steps))]
    return out


def plot(runs: dict[str, dict[str, list[float]]], path: str) -> None:
    """Each run's eval success against RL steps, rollouts and minutes (three panels sharing the
    y axis; the lowest-highest band where several seeds were averaged), saved to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    for ax, key, label in zip(
        axes,
        ("step", "rollouts", "minutes"),
        ("RL step", "rollouts", "minutes since RL began"),
        strict=True,
    ):
        for name, c in runs.items():
            (line,) = ax.plot(c[key], c["success"], marker="o", label=name)
            if "lo" in c:
                ax.fill_between(c[key], c["lo"], c["hi"], color=line.get_color(), alpha=0.15)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("eval success (in-run eval tasks)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    """The command line: runs what the module docstring describes."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="NAME=WORKDIR or NAME=WORKDIR1,WORKDIR2,...")
    ap.add_argument("--out", required=True, help="the PNG to write")
    args = ap.parse_args(argv)
    runs = {}
    for spec in args.runs:
        name, sep, dirs = spec.rpartition("=")
        workdirs = [d for d in dirs.split(",") if d]
        if not sep or not name or not workdirs:
            ap.error(f"{spec!r}: expected NAME=WORKDIR or NAME=WORKDIR1,WORKDIR2,...")
        for workdir in workdirs:
            if not os.path.isfile(os.path.join(workdir, "metrics.jsonl")):
                ap.error(f"{spec!r}: {workdir} has no metrics.jsonl (not a run's workdir)")
        try:
            runs[name] = mean_curves([curves(w) for w in workdirs])
        except ValueError as e:
            ap.error(f"{spec!r}: {e}")
    plot(runs, args.out)
    for name, c in runs.items():
        c = {k: v for k, v in c.items() if k not in ("lo", "hi")}
        best = max(range(len(c["success"])), key=c["success"].__getitem__)
        evals = " ".join(f"{s:g}:{v:.3f}" for s, v in zip(c["step"], c["success"], strict=True))
        print(
            f"{name}: {evals} | best {c['success'][best]:.3f} at step {c['step'][best]:g}, "
            f"{c['rollouts'][best]:g} rollouts, {c['minutes'][best]:.1f} min"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
