"""A run's eval summary from its metrics rows (summary.json's eval fields): success at step 0,
after the SFT warm-up, at the end, the RL phase's gain and best step, and how many GRPO steps
updated the policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def run_summary(rows: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """Eval success of a run from its metrics rows: at step 0 before any training
    (`eval_success_step0`), after the SFT warm-up (`eval_success_after_sft`, the step-0
    checkpoint's policy; None without an SFT phase), the last eval logged
    (`eval_success_final`; a rerun of a finished run evaluates nothing new), and the RL
    phase's own gain `eval_success_rl_gain` = final - after SFT, and `rl_steps_updated`.

    `eval_best_step` / `eval_success_best`: the RL phase's best in-run eval (its first step on a
    tie; step 0 is the policy it started from). The in-run eval tasks are a validation set:
    `tools/eval.py --step=<eval_best_step>` scores that checkpoint (when `ckpt.save_every`
    divides the step and `ckpt.keep` kept it) on held-out tasks."""
    evals = [r for r in rows if "eval/success" in r]
    # (None when log.eval_before_sft=False skipped it: the post-SFT eval is at step 0 too)
    step0 = next(
        (r["eval/success"] for r in evals if r["step"] == 0 and r.get("phase_sft") != 1.0), None
    )
    after_sft = next((r["eval/success"] for r in evals if r.get("phase_sft") == 1.0), None)
    final = evals[-1]["eval/success"] if evals else None
    gain = None if after_sft is None or final is None else final - after_sft
    # the RL phase's evals: from the one it started with (after SFT, or step 0's) on
    start = next((i for i, r in enumerate(evals) if r.get("phase_sft") == 1.0), 0)
    rl_evals = evals[start:]
    best = max(rl_evals, key=lambda r: r["eval/success"], default=None)
    rl_steps = [r for r in rows if r["step"] > 0 and "rollout/groups_sampled" in r]
    return {
        "eval_success_step0": step0,
        "eval_success_after_sft": after_sft,
        "eval_success_final": final,
        "eval_success_rl_gain": gain,
        "eval_best_step": None if best is None else int(best["step"]),
        "eval_success_best": None if best is None else best["eval/success"],
        # GRPO steps that updated the policy (the others had only equal-reward groups)
        "rl_steps_updated": sum("train/skipped_no_signal" not in r for r in rl_steps),
    }
