"""Trajectories -> JSON-able records -> rows, in the writer thread.

A record is a plain dict (it can be spilled to a JSONL file while the database is away and
replayed later), one per call of the `TrajectoryDB` API: "open", "truncate", "step", "eval",
"sft", "close". `apply_record` writes one record idempotently: a step, an eval or an SFT phase
written twice (a resumed run, a replayed spill file) replaces its rows instead of duplicating.

Screenshots are saved once, content-addressed: WORKDIR/screens/<sha256 of the pixels>.png.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import io
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import sqlalchemy as sa
from sqlalchemy.orm import Session

from cua_jax.db.models import Eval, Group, Rollout, Run, SftPhase, Step, Turn
from cua_jax.rl.advantages import group_advantages
from cua_jax.rl.trajectory import MIN_LIVE_EPISODES, Trajectory, live_episodes

SCREENS_DIR = "screens"
# Multi-host runs: process p's groups of a step take indices [p * PROCESS_STRIDE, (p + 1) *
# PROCESS_STRIDE), so every process writes its own rows and none replaces another's.
PROCESS_STRIDE = 100_000
# Typed Step columns and the metrics they copy.
STEP_COLUMNS = {
    "reward": "rollout/reward",
    "success": "rollout/success",
    "eval_success": "eval/success",
    "loss": "train/loss",
    "step_time_s": "time/step",
}


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat()


def clean(obj: Any) -> Any:
    """`obj` as strict JSON: numpy scalars -> Python, NaN/inf -> "nan"/"inf"/"-inf" strings
    (PostgreSQL's JSON refuses NaN), anything else unknown -> str."""
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [clean(v) for v in obj]
    if isinstance(obj, bool | str) or obj is None:
        return obj
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, int | np.integer):
        return int(obj)
    if isinstance(obj, float | np.floating):
        f = float(obj)
        return f if math.isfinite(f) else str(f)
    if isinstance(obj, np.ndarray):
        return clean(obj.tolist())
    return str(obj)


def _num(v: Any) -> float | None:
    """A finite float, else None (typed columns)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def save_screenshot(workdir: str, screenshot: np.ndarray) -> tuple[str, int, int]:
    """Writes u8[H, W, 3] once as WORKDIR/screens/<sha256>.png; returns (relative path, w, h)."""
    from PIL import Image

    arr = np.ascontiguousarray(np.asarray(screenshot, np.uint8))
    h, w = arr.shape[:2]
    digest = hashlib.sha256(f"{arr.shape}".encode() + arr.tobytes()).hexdigest()
    rel = f"{SCREENS_DIR}/{digest}.png"
    if "://" in workdir:  # gs://...: written once through etils.epath
        from etils import epath  # noqa: PLC0415 -- object stores only

        remote = epath.Path(workdir) / rel
        if not remote.exists():
            buf = io.BytesIO()
            Image.fromarray(arr).save(buf, format="PNG", compress_level=1)
            remote.parent.mkdir(parents=True, exist_ok=True)
            remote.write_bytes(buf.getvalue())
        return rel, int(w), int(h)
    path = os.path.join(workdir, rel)
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        Image.fromarray(arr).save(tmp, format="PNG", compress_level=1)
        os.replace(tmp, path)
    return rel, int(w), int(h)


def action_json(act: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(act) and not isinstance(act, type):
        return {"type": type(act).__name__, **clean(dataclasses.asdict(act))}
    return {"type": type(act).__name__, "repr": repr(act)}


def _point(actions: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    for a in actions:
        if _num(a.get("x")) is not None and _num(a.get("y")) is not None:
            return float(a["x"]), float(a["y"])
    return None, None


def rollout_record(
    traj: Trajectory,
    index: int,
    *,
    workdir: str,
    screens: Sequence[np.ndarray] | None,
    decode: Callable[[list[int]], str] | None,
    advantage: float | None,
    category: str | None = None,
) -> dict[str, Any]:
    turns = []
    for k, turn in enumerate(traj.turns):
        acts = turn.action if isinstance(turn.action, list | tuple) else []
        actions = [action_json(a) for a in acts]
        x, y = _point(actions)
        shot, w, h = (None, None, None)
        if screens is not None and k < len(screens) and screens[k] is not None:
            shot, w, h = save_screenshot(workdir, screens[k])
        text = None
        if decode is not None:
            try:
                text = decode(turn.generated_ids.tolist())
            except Exception as e:  # noqa: BLE001 -- a record without text beats no record
                text = f"(could not decode: {e})"
        turns.append(
            {
                "index": k,
                "model_text": text,
                "actions": actions,
                "x": x,
                "y": y,
                "logprob_sum": _num(np.sum(turn.logprobs, dtype=np.float64)),
                "generated_tokens": int(turn.generated_ids.size),
                # per-turn time when the episode loop records one (it times whole episodes now)
                "timing_s": _num(getattr(turn, "timing_s", None)),
                "feedback": turn.feedback or None,
                "trained": bool(turn.trained),
                "screenshot": shot,
                "screen_w": w,
                "screen_h": h,
            }
        )
    return {
        "index": index,
        "task_id": str(traj.task_id),
        "category": category,
        "reward": _num(traj.reward),
        "score": _num(traj.score),
        "success": bool(traj.success),
        "advantage": advantage,
        "length": len(traj.turns),
        "generated_tokens": int(traj.num_generated),
        "invalid_actions": int(traj.timings.get("invalid_actions", 0) or 0),
        "infra_fault": bool(traj.infra_fault),
        "finish_reason": traj.failure_reason,
        "policy_version": int(traj.policy_version),
        "timings": clean(traj.timings),
        "turns": turns,
    }


def group_outcome(
    group: Sequence[Trajectory], advantage: Any
) -> tuple[list[float | None], bool, str | None]:
    """Per-rollout advantages, kept, drop reason — the learner's rule (`Learner.prepare_batch`):
    infrastructure-fault episodes are left out, a group with fewer than MIN_LIVE_EPISODES
    healthy ones is dropped, then GRPO/RLOO/Dr.GRPO advantages with zero-variance filtering."""
    live = live_episodes(list(group))
    if len(live) < MIN_LIVE_EPISODES:
        return [None] * len(group), False, "infra_fault"
    (adv,), (keep,) = group_advantages(
        np.array([[t.reward for t in live]], np.float32),
        normalize_std=getattr(advantage, "normalize_std", True),
        leave_one_out=getattr(advantage, "leave_one_out", False),
        eps=getattr(advantage, "eps", 1e-6),
        zero_variance=getattr(advantage, "zero_variance", "filter"),
    )
    by_id = {id(t): float(a) for t, a in zip(live, adv, strict=True)}
    out = [by_id.get(id(t)) if keep else None for t in group]
    return out, bool(keep), None if keep else "zero_variance"


def step_record(
    uid: str,
    step: int,
    metrics: dict[str, Any],
    groups: Sequence[Sequence[Trajectory]] | None,
    *,
    time: str,
    workdir: str,
    screens: Sequence[Sequence[np.ndarray]] | None,
    version: int | None,
    decode: Callable | None,
    advantage: Any,
) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "op": "step",
        "uid": uid,
        "step": int(step),
        "time": time,
        "metrics": clean(metrics),
    }
    if groups is None:
        return rec
    out, n = [], 0
    for gi, group in enumerate(groups):
        advs, kept, why = group_outcome(group, advantage)
        oldest = min((t.policy_version for t in group), default=0)
        rewards = [t.reward for t in group]
        rollouts = []
        for mi, traj in enumerate(group):
            shots = screens[n] if screens is not None and n < len(screens) else None
            n += 1
            rollouts.append(
                rollout_record(
                    traj, mi, workdir=workdir, screens=shots, decode=decode, advantage=advs[mi]
                )
            )
        out.append(
            {
                "index": gi,
                "group_key": str(group[0].group_id) if group else "",
                "task_id": str(group[0].task_id) if group else "",
                "policy_version": int(oldest),
                "staleness": int(version - oldest) if version is not None else 0,
                "kept": kept,
                "drop_reason": why,
                "reward_mean": _num(np.mean(rewards)) if rewards else None,
                "reward_std": _num(np.std(rewards)) if rewards else None,
                "rollouts": rollouts,
            }
        )
    rec["groups"] = out
    return rec


def eval_record(
    uid: str,
    step: int,
    tag: str,
    trajs: Sequence[Trajectory],
    tasks: Sequence[Any] | None,
    *,
    time: str,
    workdir: str,
    screens: Sequence[Sequence[np.ndarray]] | None,
    metrics: dict[str, Any] | None,
    decode: Callable | None,
) -> dict[str, Any]:
    rollouts = []
    for i, traj in enumerate(trajs):
        task = tasks[i] if tasks is not None and i < len(tasks) else None
        category = getattr(task, "category", None) or ("all" if task is not None else None)
        shots = screens[i] if screens is not None and i < len(screens) else None
        rollouts.append(
            rollout_record(
                traj,
                i,
                workdir=workdir,
                screens=shots,
                decode=decode,
                advantage=None,
                category=category,
            )
        )
    ran = [r for r in rollouts if not r["infra_fault"]]
    metrics = clean(metrics or {})
    success = metrics.get("eval/success")
    if not isinstance(success, int | float):
        success = float(np.mean([r["success"] for r in ran])) if ran else None
    return {
        "op": "eval",
        "uid": uid,
        "step": int(step),
        "tag": str(tag),
        "time": time,
        "success": success,
        "metrics": metrics,
        "rollouts": rollouts,
    }


# ---- applying records ------------------------------------------------------------------------


def _ts(s: str) -> dt.datetime:
    return dt.datetime.fromisoformat(s)


def run_id_of(session: Session, uid: str) -> int:
    rid = session.scalar(sa.select(Run.id).where(Run.uid == uid))
    if rid is None:
        raise LookupError(f"no run with uid {uid} in the database (its 'open' record is missing)")
    return rid


def _delete_rollouts(session: Session, where: Any) -> None:
    ids = sa.select(Rollout.id).where(where)
    session.execute(sa.delete(Turn).where(Turn.rollout_id.in_(ids)))
    session.execute(sa.delete(Rollout).where(where))


def _insert_rollouts(
    session: Session, run_id: int, step: int, kind: str, recs: list[tuple[dict, dict]]
) -> None:
    """Bulk-inserts (rollout record, extra columns) pairs and their turns: three statements
    per step (Core inserts with RETURNING in parameter order; the ORM's unit of work would
    cost ~10x more per step)."""
    if not recs:
        return
    rows = [
        {
            **{k: v for k, v in r.items() if k != "turns"},
            **extra,
            "run_id": run_id,
            "step": step,
            "kind": kind,
        }
        for r, extra in recs
    ]
    table = Rollout.__table__
    ids = (
        session.execute(sa.insert(table).returning(table.c.id, sort_by_parameter_order=True), rows)
        .scalars()
        .all()
    )
    turns = [
        {**t, "rollout_id": rid} for rid, (r, _) in zip(ids, recs, strict=True) for t in r["turns"]
    ]
    if turns:
        session.execute(sa.insert(Turn.__table__), turns)


def apply_record(session: Session, rec: dict[str, Any], lost: Sequence[str] = ()) -> None:
    """Writes one record (module docstring) in `session`'s transaction."""
    op = rec["op"]
    t = _ts(rec["time"])
    if op == "open":
        run = session.scalar(sa.select(Run).where(Run.uid == rec["uid"]))
        if run is None:
            run = Run(uid=rec["uid"], started_at=t, config={}, status="running")
            session.add(run)
        elif rec.get("attach") or rec.get("process", 0):  # an eval or another process joining
            return
        run.name, run.kind, run.workdir = rec["name"], rec["kind"], rec["workdir"]
        run.config = rec["config"] or run.config or {}
        run.host, run.git_commit = rec["host"], rec["git_commit"]
        run.status, run.updated_at, run.ended_at = "running", t, None
        return
    run_id = run_id_of(session, rec["uid"])
    touch = {"updated_at": t}
    if op == "truncate" and rec.get("process", 0):
        pass  # process 0's truncate drops every process's rows (a resume restarts all of them)
    elif op == "truncate":
        after = int(rec["after"])
        _delete_rollouts(session, (Rollout.run_id == run_id) & (Rollout.step > after))
        for model in (Group, Eval, Step):
            session.execute(sa.delete(model).where((model.run_id == run_id) & (model.step > after)))
        last = session.scalar(sa.select(sa.func.max(Step.step)).where(Step.run_id == run_id))
        touch["last_step"] = last
    elif op == "step":
        step, process = rec["step"], int(rec.get("process", 0))
        if process == 0:  # the job's metrics row is process 0's
            row = session.scalar(
                sa.select(Step).where((Step.run_id == run_id) & (Step.step == step))
            )
            if row is None:
                row = Step(run_id=run_id, step=step, created_at=t, metrics={})
                session.add(row)
            row.metrics = {**(row.metrics or {}), **rec["metrics"]}  # step 0: eval, then SFT
            for col, key in STEP_COLUMNS.items():
                setattr(row, col, _num(row.metrics.get(key)))
        if "groups" in rec:  # replaces this process's groups of the step, no other's
            lo, hi = process * PROCESS_STRIDE, (process + 1) * PROCESS_STRIDE
            mine = (
                (Group.run_id == run_id)
                & (Group.step == step)
                & (Group.index >= lo)
                & (Group.index < hi)
            )
            _delete_rollouts(session, Rollout.group_id.in_(sa.select(Group.id).where(mine)))
            session.execute(sa.delete(Group).where(mine))
            groups = rec["groups"]
            if groups:
                table = Group.__table__
                gids = (
                    session.execute(
                        sa.insert(table).returning(table.c.id, sort_by_parameter_order=True),
                        [
                            {
                                **{k: v for k, v in g.items() if k != "rollouts"},
                                "index": lo + g["index"],
                                "run_id": run_id,
                                "step": step,
                            }
                            for g in groups
                        ],
                    )
                    .scalars()
                    .all()
                )
                pairs = [
                    (r, {"group_id": gid, "eval_id": None})
                    for gid, g in zip(gids, groups, strict=True)
                    for r in g["rollouts"]
                ]
                _insert_rollouts(session, run_id, step, "train", pairs)
        if process == 0:
            last = session.scalar(sa.select(Run.last_step).where(Run.id == run_id))
            touch["last_step"] = step if last is None else max(last, step)
    elif op == "eval":
        step, tag = rec["step"], rec["tag"]
        old = session.scalar(
            sa.select(Eval.id).where(
                (Eval.run_id == run_id) & (Eval.step == step) & (Eval.tag == tag)
            )
        )
        if old is not None:
            _delete_rollouts(session, Rollout.eval_id == old)
            session.execute(sa.delete(Eval).where(Eval.id == old))
        ev = Eval(
            run_id=run_id,
            step=step,
            tag=tag,
            created_at=t,
            success=_num(rec["success"]),
            num_tasks=len(rec["rollouts"]),
            metrics=rec["metrics"],
        )
        session.add(ev)
        session.flush()
        pairs = [(r, {"group_id": None, "eval_id": ev.id}) for r in rec["rollouts"]]
        _insert_rollouts(session, run_id, step, "eval", pairs)
    elif op == "sft" and rec.get("process", 0):
        pass  # the job's SFT summary is process 0's
    elif op == "sft":  # one warm-up per run: a rewrite replaces it
        session.execute(sa.delete(SftPhase).where(SftPhase.run_id == run_id))
        m = rec["metrics"]
        session.add(
            SftPhase(
                run_id=run_id,
                created_at=t,
                source=rec.get("source"),
                steps=rec.get("steps"),
                loss_first=_num(m.get("sft/loss_first")),
                loss_last=_num(m.get("sft/loss_last")),
                metrics=m,
            )
        )
    elif op == "close":
        if not rec.get("attach") and not rec.get("process", 0):
            status = rec["status"]
            if lost:
                status += f"; lost {len(lost)} records: " + ", ".join(lost[:20])
                status += " ..." if len(lost) > 20 else ""
            touch.update(status=status, ended_at=t)
    else:
        raise ValueError(f"unknown record op {op!r}")
    session.execute(sa.update(Run).where(Run.id == run_id).values(**touch))


def describe(rec: dict[str, Any]) -> str:
    """A short name of a record for logs and runs.status ("step 12", "eval step0@0")."""
    op = rec.get("op", "?")
    if op == "step":
        return f"step {rec.get('step')}"
    if op == "eval":
        return f"eval {rec.get('tag')}@{rec.get('step')}"
    return str(op)
