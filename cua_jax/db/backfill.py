"""What a crash kept in the run's own files and the database never got, as records to write.

The writer's queue lives in memory: a SIGKILL (a preempted TPU VM, the OOM killer) loses the
records queued then, and a full queue drops records by design. Two files of the run are written
by the trainer itself before it moves on, so they survive that:

- WORKDIR/metrics.jsonl (`cua_jax.metrics.MetricsWriter`): every step's metrics row;
- WORKDIR/rollouts[/pN] (`rl.persist_rollouts`, `cua_jax.rl.store.TrajectoryWriter`): every
  episode put into the trajectory store, with its tokens, actions, rewards and timings.

`missing_records` compares them with the database and gives the "step" records it lacks: a step
of metrics.jsonl with no steps row, and the groups of such a logged step when the database holds
none of this process's groups for it. Groups are rebuilt only where their step is known: the
synchronous loop names a group "S/K" (step S + 1, group K of that step); the async loop's "aK"
groups are not tied to a step and are not backfilled. Screenshots are not in either file, so a
backfilled episode has its turns without them; evals' episodes are in neither file, so only
their numbers (eval/success in the metrics row) come back.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import json
import os
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from cua_jax import actions as A
from cua_jax.db import records
from cua_jax.db.models import Group, Run, Step
from cua_jax.rl.store import TrajectoryReader

METRICS_FILE = "metrics.jsonl"
ROLLOUTS_DIR = "rollouts"


def logged_steps(workdir: str) -> dict[int, dict[str, Any]]:
    """{step: metrics} of WORKDIR/metrics.jsonl (rows of one step merged; a line cut by a
    crash mid-write is skipped)."""
    out: dict[int, dict[str, Any]] = {}
    if "://" in workdir:  # gs://...: the trainer writes it there through etils.epath
        from etils import epath  # noqa: PLC0415 -- object stores only

        remote = epath.Path(workdir) / METRICS_FILE
        lines = remote.read_text().splitlines() if remote.exists() else []
    else:
        path = os.path.join(workdir, METRICS_FILE)
        if not os.path.exists(path):
            return out
        with open(path) as f:
            lines = f.readlines()
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            step = row["step"]
            out[step] = {**out.get(step, {}), **{k: v for k, v in row.items() if k != "step"}}
    return out


def rollouts_dir(workdir: str, process: int) -> str | None:
    """This process's persisted-rollouts directory (train.py: WORKDIR/rollouts, or
    WORKDIR/rollouts/pN on multi-host), None when there is none (rl.persist_rollouts writes
    local files only)."""
    if "://" in workdir:
        return None
    base = os.path.join(workdir, ROLLOUTS_DIR)
    for d in (os.path.join(base, f"p{process}"), base):
        if os.path.exists(os.path.join(d, "index.jsonl")):
            return d
    return None


def _sync_step(group_id: str) -> tuple[int, int] | None:
    """(the step the group was logged at, its index in the step) of a sync-loop group id."""
    head, sep, tail = str(group_id).partition("/")
    if not sep or not head.isdigit() or not tail.isdigit():
        return None
    return int(head) + 1, int(tail)


def actions_from_repr(text: Any) -> list[Any]:
    """The actions of a turn the trajectory store kept as ``repr([Click(x=.., ..), ..])``,
    rebuilt without eval: a list of calls of `cua_jax.actions` dataclasses with literal keyword
    arguments; anything else gives [] (the turn then shows no actions)."""

    if isinstance(text, list):
        return text
    try:
        tree = ast.parse(str(text), mode="eval").body
    except SyntaxError:
        return []
    if not isinstance(tree, ast.List):
        return []
    out = []
    for call in tree.elts:
        cls = (
            getattr(A, call.func.id, None)
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
            else None
        )
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)) or call.args:
            return []
        try:
            out.append(cls(**{kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}))
        except (ValueError, TypeError, SyntaxError):
            return []
    return out


def persisted_groups(directory: str, steps: set[int]) -> dict[int, list[list[Any]]]:
    """{step: its groups in index order} of the trajectories persisted in `directory`, for
    `steps` only (each a complete group: the step was logged, so all its episodes were put)."""

    reader = TrajectoryReader(directory)
    where: dict[int, dict[int, list[int]]] = collections.defaultdict(
        lambda: collections.defaultdict(list)
    )
    for i in range(len(reader)):
        key = _sync_step(reader.metadata(i)["group_id"])
        if key is not None and key[0] in steps:
            where[key[0]][key[1]].append(i)
    out: dict[int, list[list[Any]]] = {}
    for step, groups in where.items():
        n = max(groups) + 1
        if sorted(groups) != list(range(n)):  # a gap: not the whole step, leave it
            continue
        out[step] = [[_episode(reader, i) for i in groups[k]] for k in range(n)]
    return out


def _episode(reader: Any, i: int) -> Any:
    traj = reader[i]
    for turn in traj.turns:
        turn.action = actions_from_repr(turn.action)
    return traj


def missing_records(
    session: Session,
    uid: str,
    workdir: str,
    process: int = 0,
    *,
    decode: Any = None,
    advantage: Any = None,
) -> list[dict[str, Any]]:
    """The "step" records (`records.step_record`) of what the run's files hold and the
    database lacks (module docstring), in step order."""
    run_id = session.scalar(sa.select(Run.id).where(Run.uid == uid))
    if run_id is None:
        return []
    logged = logged_steps(workdir)
    if not logged:
        return []
    have_steps = set(session.scalars(sa.select(Step.step).where(Step.run_id == run_id)))
    lo, hi = process * records.PROCESS_STRIDE, (process + 1) * records.PROCESS_STRIDE
    have_groups = set(
        session.scalars(
            sa.select(Group.step)
            .where((Group.run_id == run_id) & (Group.index >= lo) & (Group.index < hi))
            .distinct()
        )
    )
    directory = rollouts_dir(workdir, process)
    groups = persisted_groups(directory, set(logged) - have_groups) if directory is not None else {}
    out = []
    for step in sorted(logged):
        missing_row = process == 0 and step not in have_steps
        if not missing_row and step not in groups:
            continue
        out.append(
            records.step_record(
                uid,
                step,
                logged[step] if process == 0 else {},
                groups.get(step),
                time=records.now(),
                workdir=workdir,
                screens=None,
                version=None,
                decode=decode,
                advantage=advantage,
            )
        )
    return out
