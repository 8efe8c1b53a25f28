"""A crash loses no trajectory data the run's files kept, and multi-host processes write rows of
their own: against SQLite and the test PostgreSQL server.

The crash is a real SIGKILL of a process whose writer is behind (its records of steps 4 and 5
still queued); the reference is the same five steps written by an uninterrupted writer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import sqlalchemy as sa

from cua_jax import db as db_lib
from cua_jax.db.engine import normalize_url
from cua_jax.db.records import PROCESS_STRIDE
from tests.db import synth

GROUPS, GROUP_SIZE, STEPS = 3, 4, 5
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The trainer's side of a sync-mode run with rl.persist_rollouts: each step's episodes go to the
# trajectory store's files and its row to metrics.jsonl before the step is logged to the
# database. The writer is made slow from step 4 on, and the process SIGKILLs itself once steps
# 1-3 are in the database: steps 4 and 5 die in its queue.
CRASHING_RUN = """
import json, os, signal, sys, time
from cua_jax import db as db_lib
from cua_jax.db import records
from cua_jax.rl.store import TrajectoryWriter
from tests.db import synth
from tests.db.test_db_backfill import GROUPS, GROUP_SIZE, STEPS, step

wd, url = sys.argv[1:3]
db = db_lib.open_run(wd, url, run_name="crash", decode=synth.decode, retry_s=0.2)
db.truncate_after(-1)
store = TrajectoryWriter(os.path.join(wd, "rollouts"), persist_images=False)
real = records.step_record
records.step_record = lambda uid, s, *a, **k: (time.sleep(60) if s >= 4 else None) or real(
    uid, s, *a, **k
)
for s in range(1, STEPS + 1):
    groups = step(s)
    for g in groups:
        for t in g:
            store.write(t)
    with open(os.path.join(wd, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": s, **synth.metrics_row(s)}) + "\\n")
    db.log_step(s, synth.metrics_row(s), groups, version=s - 1)
deadline = time.monotonic() + 60
while db.written < 5 and time.monotonic() < deadline:  # open, truncate, steps 1-3
    time.sleep(0.05)
os.kill(os.getpid(), signal.SIGKILL)
"""


def step(s: int) -> list[list]:
    """Step s's groups, named as the sync loop names them ("{s - 1}/{k}")."""
    groups, _ = synth.step_groups(s, GROUPS, GROUP_SIZE, version=s - 1)
    for k, g in enumerate(groups):
        for t in g:
            t.group_id = f"{s - 1}/{k}"
    return groups


def _rows(url: str) -> dict[str, list]:
    """Every step, group, rollout and turn of the (one) run, without ids and times."""
    e = db_lib.make_engine(normalize_url(url))
    q = {
        "steps": "SELECT step, metrics, reward, loss FROM steps ORDER BY step",
        "groups": 'SELECT step, "index", group_key, task_id, kept, drop_reason, reward_mean,'
        ' reward_std, staleness FROM groups ORDER BY step, "index"',
        "rollouts": 'SELECT r.step, g."index", r."index", r.task_id, r.reward, r.success,'
        " r.advantage, r.length, r.generated_tokens, r.invalid_actions, r.finish_reason"
        " FROM rollouts r JOIN groups g ON r.group_id = g.id ORDER BY 1, 2, 3",
        "turns": 'SELECT r.step, g."index", r."index", t."index", t.model_text, t.actions,'
        " t.x, t.y, t.logprob_sum, t.feedback FROM turns t JOIN rollouts r ON t.rollout_id ="
        " r.id JOIN groups g ON r.group_id = g.id ORDER BY 1, 2, 3, 4",
    }
    with e.connect() as c:
        out = {k: [tuple(r) for r in c.execute(sa.text(v)).all()] for k, v in q.items()}
    e.dispose()
    for k in ("steps", "turns"):  # JSON columns come back as text on SQLite
        out[k] = [
            tuple(json.loads(x) if isinstance(x, str) and x[:1] in "[{" else x for x in r)
            for r in out[k]
        ]
    return out


def test_a_sigkill_loses_no_step_the_runs_files_kept(db_url, tmp_path):
    if "postgresql" in db_url and os.environ.get("CUA_LONG_TESTS") != "1":
        pytest.skip("the same backfill as on SQLite; its killed run costs ~10 s: CUA_LONG_TESTS=1")
    wd = tmp_path / "run"
    wd.mkdir()
    env = {**os.environ, "PYTHONPATH": ROOT}
    r = subprocess.run(
        [sys.executable, "-c", CRASHING_RUN, str(wd), db_url],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    crashed = _rows(db_url)
    assert [s[0] for s in crashed["steps"]] == [1, 2, 3]  # 4 and 5 died in the queue

    db = db_lib.open_run(str(wd), db_url, decode=synth.decode, retry_s=0.2)
    db.truncate_after(STEPS)  # the resume: the run's checkpoint of step 5
    assert db.flush(60)
    backfilled = dict(db.backfilled)
    db.close("finished")
    got = _rows(db_url)

    ref_url = str(tmp_path / "ref.sqlite")
    ref = db_lib.open_run(str(tmp_path / "ref"), ref_url, decode=synth.decode)
    for s in range(1, STEPS + 1):
        ref.log_step(s, synth.metrics_row(s), step(s), version=s - 1)  # sync: staleness 0
    ref.close("finished")
    want = _rows(ref_url)
    assert backfilled == {"groups": 2}
    assert len(got["rollouts"]) == STEPS * GROUPS * GROUP_SIZE
    for table in ("steps", "groups", "rollouts", "turns"):
        assert got[table] == want[table], table


def test_a_resume_still_drops_the_steps_it_redoes(tmp_path):
    """Backfill runs before the resume's truncate: steps after the checkpoint stay dropped."""
    url, wd = str(tmp_path / "t.sqlite"), tmp_path / "run"
    db = db_lib.open_run(str(wd), url)
    db.truncate_after(-1)
    db.close("failed: killed")
    with open(wd / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps({"step": s, **synth.metrics_row(s)}) + "\n" for s in (1, 2, 3))
    db = db_lib.open_run(str(wd), url)
    db.truncate_after(2)
    db.close("finished")
    assert [s[0] for s in _rows(url)["steps"]] == [1, 2]


def test_multi_host_processes_write_their_own_rows(db_url, tmp_path):
    """Two processes of one run, one writer each: process 1's groups and eval share are rows of
    their own; process 0 writes the metrics, the status and the resume's truncate."""
    wd = str(tmp_path / "run")
    p0 = db_lib.open_run(wd, db_url, decode=synth.decode, retry_s=0.2)
    p1 = db_lib.open_run(wd, db_url, decode=synth.decode, retry_s=0.2, process_index=1)
    for db in (p0, p1):
        db.truncate_after(-1)
    # process 0's truncate (the resume's) is applied before process 1 writes: two writer
    # threads are not ordered, and a late truncate would delete process 1's new rows
    assert p0.flush(60)
    for s in (1, 2):
        p0.log_step(s, synth.metrics_row(s), step(s), version=s)
        p1.log_step(s, {"rollout/reward": -1.0}, step(s + 10), version=s)
    trajs, tasks, _ = synth.eval_batch(2)
    p0.log_eval(2, "step2", trajs[:3], tasks[:3])
    p1.log_eval(2, "step2", trajs[3:], tasks[3:])
    p1.log_step(2, {}, step(20), version=2)  # a rewrite replaces only process 1's rows
    p0.log_sft({"sft/loss_first": 2.0}, steps=3)
    p1.log_sft({"sft/loss_first": 9.0}, steps=3)  # the job's summary is process 0's
    for db in (p1, p0):
        assert db.flush(60)
    p1.close("finished")
    p0.close("finished")
    e = db_lib.make_engine(normalize_url(db_url))
    with e.connect() as c:
        runs = c.execute(sa.text("SELECT count(*), max(status) FROM runs")).one()
        groups = c.execute(sa.text('SELECT step, "index", group_key FROM groups')).all()
        steps = c.execute(sa.text("SELECT step, reward FROM steps ORDER BY step")).all()
        evals = c.execute(sa.text("SELECT tag, num_tasks FROM evals ORDER BY tag")).all()
        sft = c.execute(sa.text("SELECT loss_first FROM sft_phases")).scalars().all()
    e.dispose()
    assert tuple(runs) == (1, "finished")
    assert [tuple(s) for s in steps] == [(1, 0.1), (2, 0.2)]  # process 0's metrics only
    mine = {(s, i, k) for s, i, k in groups if i < PROCESS_STRIDE}
    theirs = {(s, i - PROCESS_STRIDE, k) for s, i, k in groups if i >= PROCESS_STRIDE}
    assert mine == {(s, k, f"{s - 1}/{k}") for s in (1, 2) for k in range(GROUPS)}
    assert theirs == {(1, k, f"10/{k}") for k in range(GROUPS)} | {
        (2, k, f"19/{k}") for k in range(GROUPS)
    }
    assert [tuple(v) for v in evals] == [("step2", 3), ("step2/p1", 3)]
    assert sft == [2.0]
    # a resume at step 1: process 0's truncate drops both processes' step 2
    p0 = db_lib.open_run(wd, db_url, retry_s=0.2)
    p0.truncate_after(1)
    p0.close("finished")
    e = db_lib.make_engine(normalize_url(db_url))
    with e.connect() as c:
        left = c.execute(sa.text("SELECT DISTINCT step FROM groups")).scalars().all()
    e.dispose()
    assert left == [1]


def test_a_workdir_on_object_storage_is_recorded_with_a_database_url(db_url, tmp_path, monkeypatch):
    """gs://... with log.db_url: the run id and screenshots go to the workdir through
    etils.epath (an in-memory fsspec file system stands in for GCS), a resume continues the same
    run and backfills from gs://.../metrics.jsonl; without a URL the database stays off."""
    import fsspec
    from etils import epath
    from fsspec.implementations.memory import MemoryFileSystem

    class FakeGCS(MemoryFileSystem):
        protocol = ("gs", "gcs")
        store: dict = {}  # noqa: RUF012 -- fsspec's class-level store
        pseudo_dirs = [""]  # noqa: RUF012

        def __init__(self, *args, finalize_on_close=None, **kwargs):
            del finalize_on_close  # epath passes it for gcsfs
            super().__init__(*args, **kwargs)

    for name in ("gs", "gcs"):
        fsspec.register_implementation(name, FakeGCS, clobber=True)
    # epath keeps the file system it first made for a protocol (another module's fake GCS)
    from etils.epath.backend import _FileSystemSpecBackend

    _FileSystemSpecBackend._get_filesystem.cache_clear()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    wd = "gs://bucket/run"
    assert isinstance(db_lib.open_run(wd, None), db_lib.NullDB)
    db = db_lib.open_run(wd, db_url, decode=synth.decode, retry_s=0.2)
    db.truncate_after(-1)
    groups, screens = synth.step_groups(1, GROUPS, GROUP_SIZE, version=0)
    db.log_step(1, synth.metrics_row(1), groups, screens=screens, version=1)
    db.close("failed: killed")
    rows = "".join(json.dumps({"step": s, **synth.metrics_row(s)}) + "\n" for s in (1, 2))
    (epath.Path(wd) / "metrics.jsonl").write_text(rows)
    db = db_lib.open_run(wd, db_url, retry_s=0.2)  # the resume: step 2 comes from the file
    db.truncate_after(2)
    db.close("finished")
    e = db_lib.make_engine(normalize_url(db_url))
    with e.connect() as c:
        runs = c.execute(sa.text("SELECT count(*), max(workdir), max(status) FROM runs")).one()
        steps = c.execute(sa.text("SELECT step FROM steps ORDER BY step")).scalars().all()
        shots = c.execute(sa.text("SELECT DISTINCT screenshot FROM turns")).scalars().all()
    e.dispose()
    assert tuple(runs) == (1, wd, "finished") and steps == [1, 2]
    assert shots and all((epath.Path(wd) / s).exists() for s in shots)
    assert not os.path.exists(tmp_path / "gs:")  # nothing written to a local "gs:" folder
    FakeGCS.store.clear()


def test_two_processes_opening_the_run_at_once_lose_no_open(db_url, tmp_path, monkeypatch):
    """Process 1's open finds no run row, and process 0 inserts it before process 1's INSERT:
    process 1 joins that row (an open that lost the race is not a refused record)."""
    from cua_jax.db import writer as writer_mod

    wd = str(tmp_path / "run")
    url = normalize_url(db_url)
    p0 = db_lib.open_run(wd, db_url, retry_s=0.2)  # makes the schema and the run's uid
    assert p0.flush(60)
    uid = p0.uid
    e0 = db_lib.make_engine(url)
    with e0.begin() as c:  # back to "no run row yet": process 0's open has not landed
        c.execute(sa.text("DELETE FROM runs WHERE uid = :u"), {"u": uid})
    raced = []

    def make_engine(u, **kw):
        engine = db_lib.make_engine(u, **kw)

        @sa.event.listens_for(engine, "before_cursor_execute")
        def _race(conn, cursor, statement, params, context, executemany):  # noqa: ANN001, ARG001
            if statement.lstrip().upper().startswith("INSERT INTO RUNS") and not raced:
                raced.append(statement)
                with e0.begin() as c:  # process 0's open lands first
                    c.execute(
                        sa.text(
                            "INSERT INTO runs (uid, name, kind, workdir, status, config, "
                            "started_at, updated_at) VALUES (:u, 'p0', 'train', :w, 'running', "
                            "'{}', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
                        ),
                        {"u": uid, "w": wd},
                    )

        return engine

    monkeypatch.setattr(writer_mod, "make_engine", make_engine)
    p1 = db_lib.open_run(wd, db_url, retry_s=0.2, process_index=1)
    p1.log_step(1, {}, step(1), version=1)
    assert p1.flush(60)
    assert raced, "process 1's open never tried to insert the run row"
    assert p1.lost == []
    p1.close("finished")
    p0.close("finished")
    with e0.connect() as c:
        runs = c.execute(sa.text("SELECT count(*), max(status) FROM runs")).one()
        groups = c.execute(
            sa.text('SELECT count(*) FROM groups WHERE "index" >= :s'), {"s": PROCESS_STRIDE}
        ).scalar()
    e0.dispose()
    assert tuple(runs) == (1, "finished")
    assert groups == GROUPS
