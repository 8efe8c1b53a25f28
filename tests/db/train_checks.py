"""Checks of a training run's trajectory database against its own metrics.jsonl (the metrics
writer is the independent reference): used by tests/test_train_smoke.py on its runs."""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from cua_jax.db import DB_FILENAME, make_engine
from cua_jax.db import models as m


def jsonl_rows(workdir: str) -> list[dict[str, Any]]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(ln) for ln in f if ln.strip()]


def _same(a: Any, b: Any) -> bool:
    """Equal metric values; the database keeps NaN/inf as "nan"/"inf" strings (strict JSON)."""
    if isinstance(b, float) and not math.isfinite(b):
        return a == str(b)
    return a == pytest.approx(b, rel=1e-6, abs=1e-9)


def check_train_database(
    workdir: str, *, group_size: int, groups_per_step: int, logged_groups: int
) -> dict[str, Any]:
    """Asserts what a finished training run in `workdir` must have left in its SQLite database
    and returns a summary (counts) for further checks:

    - one run row, status "finished", last_step the metrics' last step;
    - one steps row per step of metrics.jsonl (the two step-0 rows merged), holding the same
      values (the metrics writer's "time" stamp aside);
    - every GRPO step: groups_per_step groups of group_size rollouts, their staleness and
      zero-variance drops as the metrics count them; turns = the sum of the
      rollouts' lengths = rollout/episode_turns x rollouts; generated tokens and success agree
      with the step's rollout/ metrics; the first `logged_groups` groups' turns carry their
      screenshot files, the others none;
    - every eval logged in metrics.jsonl: an evals row per tag whose rollouts (one per task)
      give its eval/success and per-category successes;
    - the SFT warm-up: a phase row with its steps and losses.
    """
    rows = jsonl_rows(workdir)
    engine = make_engine(os.path.join(workdir, DB_FILENAME))
    try:
        with Session(engine) as s:
            runs = s.scalars(sa.select(m.Run)).all()
            assert len(runs) == 1, [(r.name, r.kind) for r in runs]
            run = runs[0]
            assert run.status == "finished" and run.kind == "train", run.status
            assert run.last_step == rows[-1]["step"] and run.ended_at is not None

            # ---- steps: the same rows as metrics.jsonl ----
            want: dict[int, dict[str, Any]] = defaultdict(dict)
            for r in rows:
                want[r["step"]].update({k: v for k, v in r.items() if k not in ("step", "time")})
            steps = s.scalars(sa.select(m.Step).where(m.Step.run_id == run.id)).all()
            assert sorted(st.step for st in steps) == sorted(want), "one row per step"
            for st in steps:
                got = st.metrics
                assert got.keys() == want[st.step].keys(), st.step
                for k, v in want[st.step].items():
                    assert _same(got[k], v), (st.step, k, got[k], v)
                assert st.reward == got.get("rollout/reward")
                assert st.eval_success == got.get("eval/success")

            # ---- groups, rollouts, turns of every GRPO step ----
            turns_total = 0
            for step, metrics in want.items():
                if step == 0:
                    continue
                groups = s.scalars(
                    sa.select(m.Group)
                    .where(m.Group.run_id == run.id, m.Group.step == step)
                    .order_by(m.Group.index)
                ).all()
                assert len(groups) == groups_per_step, (step, len(groups))
                rollouts = []
                for g in groups:
                    members = s.scalars(
                        sa.select(m.Rollout).where(m.Rollout.group_id == g.id)
                    ).all()
                    assert len(members) == group_size and {r.kind for r in members} == {"train"}
                    assert all(r.step == step for r in members)
                    for r in members:
                        turns = s.scalars(sa.select(m.Turn).where(m.Turn.rollout_id == r.id)).all()
                        assert len(turns) == r.length, (step, r.id)
                        turns_total += len(turns)
                        shots = [t.screenshot for t in turns]
                        if g.index < logged_groups:
                            assert all(shots), (step, g.index)
                            for p in shots:
                                assert os.path.getsize(os.path.join(workdir, p)) > 100, p
                        else:
                            assert not any(shots), (step, g.index)
                    rollouts += members
                # the learner's own counts: staleness and zero-variance filtering agree
                assert max(g.staleness for g in groups) == metrics["rollout/staleness_max"]
                dropped = sum(not g.kept and g.drop_reason == "zero_variance" for g in groups)
                assert dropped == metrics["train/groups_filtered_zero_variance"], step
                n = len(rollouts)
                length = sum(r.length for r in rollouts)
                assert length == pytest.approx(metrics["rollout/episode_turns"] * n), step
                tokens = sum(r.generated_tokens for r in rollouts)
                assert tokens == pytest.approx(metrics["rollout/generated_tokens"]), step
                success = sum(r.success for r in rollouts) / n
                assert success == pytest.approx(metrics["rollout/success"]), step

            # ---- evals: one row per eval of the metrics, per task and category ----
            evals = s.scalars(sa.select(m.Eval).where(m.Eval.run_id == run.id)).all()
            by_tag = {(e.step, e.tag): e for e in evals}
            tags = {0: ["step0"] + (["after_sft"] if "sft/steps" in want[0] else [])}
            for step in want:
                if step and "eval/success" in want[step]:
                    tags[step] = [f"step{step}"]
            for step, names in tags.items():
                for tag in names:
                    e = by_tag[(step, tag)]
                    eps = s.scalars(sa.select(m.Rollout).where(m.Rollout.eval_id == e.id)).all()
                    assert e.num_tasks == len(eps) > 0 and {r.kind for r in eps} == {"eval"}
                    ran = [r for r in eps if not r.infra_fault]
                    assert e.success == pytest.approx(sum(r.success for r in ran) / len(ran))
                    cats: dict[str, list[bool]] = defaultdict(list)
                    for r in ran:
                        cats[r.category].append(r.success)
                    for cat, ok in cats.items():
                        assert e.metrics[f"eval/success/{cat}"] == pytest.approx(
                            sum(ok) / len(ok)
                        ), (tag, cat)
            # the last eval of each step is the one metrics.jsonl holds
            for step, names in tags.items():
                e = by_tag[(step, names[-1])]
                assert e.success == pytest.approx(want[step]["eval/success"]), (step, names)

            # ---- SFT warm-up ----
            phases = s.scalars(sa.select(m.SftPhase).where(m.SftPhase.run_id == run.id)).all()
            if "sft/steps" in want[0]:
                assert len(phases) == 1
                assert phases[0].steps == want[0]["sft/steps"]
                assert phases[0].loss_first == pytest.approx(want[0]["sft/loss_first"])
                assert phases[0].loss_last == pytest.approx(want[0]["sft/loss_last"])
            else:
                assert not phases
            return {
                "run_id": run.id,
                "uid": run.uid,
                "steps": sorted(want),
                "turns": turns_total,
                "evals": sorted(by_tag),
            }
    finally:
        engine.dispose()


def wait_for_db_step(workdir: str, step: int, timeout_s: float = 120.0) -> None:
    """Waits until the run's database holds `step` (the background writer lags the trainer by
    a record or two; a process killed before its writer wrote a record loses that record)."""
    import time

    path = os.path.join(workdir, DB_FILENAME)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.exists(path):
            engine = make_engine(path)
            try:
                with engine.connect() as c:
                    if c.execute(sa.select(m.Step.id).where(m.Step.step == step)).first():
                        return
            except sa.exc.OperationalError:  # the tables are not made yet
                pass
            finally:
                engine.dispose()
        time.sleep(0.2)
    raise AssertionError(f"step {step} did not reach {path} within {timeout_s:.0f} s")
