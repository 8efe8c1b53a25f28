r"""Sync vs async GRPO on the same start: wall time per step, learner idle share, staleness.

Both modes resume from the same checkpoint (e.g. a smoke run's post-SFT step-0 checkpoint, made
with `--config.total_steps=0`) and run the same number of GRPO steps without eval:

    python launch/tpu.py --config=configs/qwen3vl_grpo.py:smoke --config.total_steps=0 \
        --workdir=/tmp/sft0
    python tools/bench_rl_modes.py --from_workdir=/tmp/sft0 --steps=12

Step 1 of each run includes compiles; the table reports steps 2.. (the steady state).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from tools import bench_setup
from tools.bench_setup import ROOT


def run(mode: str, src: str, steps: int, extra: list[str]) -> list[dict]:
    """Runs the smoke preset for `steps` steps in `mode` from a copy of the workdir `src`; its
    metrics rows after step 0."""
    wd = tempfile.mkdtemp(prefix=f"bench_{mode}_")
    shutil.rmtree(wd)
    shutil.copytree(src, wd, ignore=shutil.ignore_patterns("episodes", "tb"))
    overrides = {
        "rl.mode": mode,
        "total_steps": steps,
        "log.eval_every": 10 * steps,
        "log.progress": False,
    }
    cmd = [sys.executable, os.path.join(ROOT, "launch", "tpu.py")]
    cmd += ["--config=configs/qwen3vl_grpo.py:smoke"]
    cmd += [f"--config.{k}={v}" for k, v in overrides.items()]
    cmd += [f"--workdir={wd}", *extra]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    print(f"{mode}: {time.perf_counter() - t0:.0f} s in all (startup + final eval included)")
    with open(os.path.join(wd, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    shutil.rmtree(wd, ignore_errors=True)
    return [r for r in rows if r["step"] >= 1]


def main() -> None:
    """The command line: runs what the module docstring describes."""
    ap = bench_setup.arg_parser(__doc__)
    ap.add_argument("--from_workdir", required=True, help="a workdir holding a checkpoint")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--extra", nargs="*", default=[], help="more --config.* overrides")
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()}")
    print(
        "| mode | s / step (steps 2..) | rollout s | train s | learner idle share | "
        "staleness max | dropped stale / put | rollout success |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for mode in ("sync", "async"):
        rows = run(mode, args.from_workdir, args.steps, args.extra)
        steady = rows[1:]

        def mean(key: str, rs=steady) -> float:
            vals = [r[key] for r in rs if key in r]
            return float(np.mean(vals)) if vals else float("nan")

        last = rows[-1]
        put = last["store/put"] - rows[0]["store/put"] + 1e-9
        dropped = last["store/dropped_stale"] - rows[0]["store/dropped_stale"]
        idle = mean("time/learner_idle_share") if mode == "async" else float("nan")
        print(
            f"| {mode} | {mean('time/step'):.2f} | {mean('time/rollout'):.2f} | "
            f"{mean('time/train'):.2f} | {idle:.2f} | "
            f"{max(r['rollout/staleness_max'] for r in rows):.0f} | {dropped / put:.2f} | "
            f"{mean('rollout/success', rows):.3f} |"
        )


if __name__ == "__main__":
    main()
