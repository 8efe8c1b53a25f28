"""Read-side queries of the trajectory database for the monitor (plain dicts for templates)."""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session, selectinload

from cua_jax.db.models import Eval, Group, Rollout, Run, SftPhase, Step


class NotFound(LookupError):
    """An unknown run, step, rollout or eval: the monitor answers with a 404 page."""


def _age(t: dt.datetime | None) -> str:
    if t is None:
        return ""
    if t.tzinfo is None:  # SQLite returns naive datetimes (stored as UTC)
        t = t.replace(tzinfo=dt.UTC)
    s = (dt.datetime.now(dt.UTC) - t).total_seconds()
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= n:
            return f"{s / n:.0f} {unit} ago"
    return f"{max(s, 0):.0f} s ago"


def run_dict(run: Run) -> dict[str, Any]:
    """A run's row as the pages and JSON show it."""
    return {
        "id": run.id,
        "name": run.name,
        "kind": run.kind,
        "status": run.status,
        "running": run.status == "running",
        "host": run.host,
        "git_commit": run.git_commit,
        "workdir": run.workdir,
        "started_at": run.started_at.isoformat(timespec="seconds") if run.started_at else "",
        "ended_at": run.ended_at.isoformat(timespec="seconds") if run.ended_at else "",
        "updated": _age(run.updated_at),
        "last_step": run.last_step,
    }


def runs(session: Session) -> list[dict[str, Any]]:
    """Every run, newest first."""
    return [run_dict(r) for r in session.scalars(sa.select(Run).order_by(Run.id.desc()))]


def get_run(session: Session, run_id: int) -> Run:
    """The run `run_id`, or NotFound."""
    run = session.get(Run, run_id)
    if run is None:
        raise NotFound(f"no run {run_id}")
    return run


def steps(
    session: Session, run_id: int, after: int = -1, newest: int | None = None
) -> list[dict[str, Any]]:
    """Steps of a run after `after` (or its `newest` ones): step, metrics, group count (the
    curves' data), oldest first."""
    if newest is not None:
        cut = session.scalar(
            sa.select(Step.step)
            .where(Step.run_id == run_id)
            .order_by(Step.step.desc())
            .offset(newest)
            .limit(1)
        )
        after = -1 if cut is None else cut
    counts = dict(
        session.execute(
            sa.select(Group.step, sa.func.count())
            .where((Group.run_id == run_id) & (Group.step > after))
            .group_by(Group.step)
        ).all()
    )
    rows = session.execute(
        sa.select(Step.step, Step.metrics, Step.created_at)
        .where((Step.run_id == run_id) & (Step.step > after))
        .order_by(Step.step)
    ).all()
    return [
        {"step": s, "metrics": m or {}, "groups": counts.get(s, 0), "time": t.isoformat()}
        for s, m, t in rows
    ]


def evals(session: Session, run_id: int) -> list[dict[str, Any]]:
    """A run's evals by step."""
    rows = session.scalars(
        sa.select(Eval).where(Eval.run_id == run_id).order_by(Eval.step, Eval.created_at)
    )
    return [
        {"id": e.id, "step": e.step, "tag": e.tag, "success": e.success, "num_tasks": e.num_tasks}
        for e in rows
    ]


def sft(session: Session, run_id: int) -> dict[str, Any] | None:
    """A run's SFT warm-up phase, or None when it had none."""
    p = session.scalar(sa.select(SftPhase).where(SftPhase.run_id == run_id))
    if p is None:
        return None
    return {
        "source": p.source,
        "steps": p.steps,
        "loss_first": p.loss_first,
        "loss_last": p.loss_last,
        "metrics": p.metrics,
    }


def step_page(session: Session, run_id: int, step: int) -> dict[str, Any]:
    """What a step's page shows: its metrics, its groups with their rollouts and turns, and the
    previous and next step; NotFound when the run has no such step."""
    row = session.scalar(sa.select(Step).where((Step.run_id == run_id) & (Step.step == step)))
    if row is None:
        raise NotFound(f"run {run_id} has no step {step}")
    groups = session.scalars(
        sa.select(Group)
        .where((Group.run_id == run_id) & (Group.step == step))
        .order_by(Group.index)
        .options(selectinload(Group.rollouts).selectinload(Rollout.turns))
    ).all()
    prev_step = session.scalar(
        sa.select(sa.func.max(Step.step)).where((Step.run_id == run_id) & (Step.step < step))
    )
    next_step = session.scalar(
        sa.select(sa.func.min(Step.step)).where((Step.run_id == run_id) & (Step.step > step))
    )
    return {
        "step": step,
        "metrics": row.metrics or {},
        "groups": groups,
        "prev_step": prev_step,
        "next_step": next_step,
    }


def rollout(session: Session, rollout_id: int) -> Rollout:
    """The rollout `rollout_id` with its turns and group, or NotFound."""
    r = session.scalar(
        sa.select(Rollout)
        .where(Rollout.id == rollout_id)
        .options(selectinload(Rollout.turns), selectinload(Rollout.group))
    )
    if r is None:
        raise NotFound(f"no rollout {rollout_id}")
    return r


def eval_at(session: Session, run_id: int, step: int, tag: str | None = None) -> Eval:
    """The run's eval at `step` (the latest with `tag` when given), or NotFound."""
    q = sa.select(Eval).where((Eval.run_id == run_id) & (Eval.step == step))
    if tag:
        q = q.where(Eval.tag == tag)
    ev = session.scalars(q.order_by(Eval.created_at.desc())).first()
    if ev is None:
        raise NotFound(
            f"run {run_id} has no eval at step {step}" + (f" tagged {tag}" if tag else "")
        )
    return ev


def eval_table(session: Session, ev: Eval) -> dict[str, Any]:
    """Per-category and per-task success of one eval (infra-fault episodes counted apart)."""
    rows = session.scalars(
        sa.select(Rollout).where(Rollout.eval_id == ev.id).order_by(Rollout.index)
    ).all()
    cats: dict[str, list[float]] = defaultdict(list)
    tasks = {}
    faults = 0
    for r in rows:
        if r.infra_fault:
            faults += 1
        else:
            cats[r.category or "all"].append(float(r.success))
        tasks[r.task_id] = {
            "task_id": r.task_id,
            "category": r.category or "all",
            "success": None if r.infra_fault else bool(r.success),
            "score": r.score,
            "length": r.length,
            "rollout_id": r.id,
            "finish_reason": r.finish_reason,
        }
    categories = {k: {"success": sum(v) / len(v), "n": len(v)} for k, v in sorted(cats.items())}
    return {
        "id": ev.id,
        "run_id": ev.run_id,
        "step": ev.step,
        "tag": ev.tag,
        "success": ev.success,
        "num_tasks": ev.num_tasks,
        "infra_faults": faults,
        "categories": categories,
        "tasks": tasks,
    }
