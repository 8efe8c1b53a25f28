"""The trajectory database against SQLite and a real PostgreSQL server: migrations from empty,
counts of a synthetic run built from real Trajectory objects, resume without duplicates, and a
server killed mid-run and restarted with nothing lost."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from cua_jax import db as db_lib
from cua_jax.db.engine import head_revision, normalize_url
from cua_jax.db.models import VERSION_TABLE, Base
from cua_jax.db.writer import SPILL_FILE
from cua_jax.rl.advantages import group_advantages
from tests.db import synth

GROUPS, GROUP_SIZE = 3, 4


def _engine(url: str) -> sa.Engine:
    return db_lib.make_engine(normalize_url(url))


def _count(url: str, table: str, where: str = "") -> int:
    e = _engine(url)
    with e.connect() as c:
        n = c.execute(sa.text(f"SELECT count(*) FROM {table} {where}")).scalar()
    e.dispose()
    return int(n)


def _open(workdir, url, **kw):
    kw.setdefault("retry_s", 0.2)
    kw.setdefault("close_timeout_s", 20)
    return db_lib.open_run(
        str(workdir),
        url,
        run_name="synthetic",
        config={"rl": {"group_size": GROUP_SIZE}},
        decode=synth.decode,
        **kw,
    )


def _log_steps(db, steps, expected_turns: dict[int, int]) -> None:
    for s in steps:
        groups, screens = synth.step_groups(s, GROUPS, GROUP_SIZE, version=s - 1)
        expected_turns[s] = sum(len(t.turns) for g in groups for t in g)
        db.log_step(s, synth.metrics_row(s), groups, screens=screens, version=s)


def test_migrations_from_empty_match_the_models(db_url):
    engine = _engine(db_url)
    db_lib.migrate(engine)
    db_lib.migrate(engine)  # a second open upgrades nothing
    assert db_lib.check_database(engine) == head_revision()
    with engine.connect() as conn:
        names = set(sa.inspect(conn).get_table_names())
        assert {"runs", "steps", "groups", "rollouts", "turns", "evals", "sft_phases"} <= names
        assert VERSION_TABLE in names
        diff = compare_metadata(
            MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}),
            Base.metadata,
        )
    assert diff == [], f"the migrations and cua_jax/db/models.py disagree: {diff}"
    engine.dispose()


def test_not_a_cua_database_is_named(tmp_path):
    other = tmp_path / "other.sqlite"
    e = _engine(str(other))
    with e.begin() as c:
        c.execute(sa.text("CREATE TABLE t (x int)"))
    with pytest.raises(db_lib.NotACuaDatabase, match="not a cua_jax trajectory database"):
        db_lib.check_database(e)


def test_synthetic_run_counts(db_url, tmp_path):
    workdir = tmp_path / "run"
    db = _open(workdir, db_url)
    db.truncate_after(-1)
    trajs, tasks, screens = synth.eval_batch(0)
    db.log_eval(0, "step0", trajs, tasks, screens=screens, metrics={"eval/success": 0.5})
    db.log_step(0, {"eval/success": 0.5, "phase_sft": 0.0})
    db.log_sft({"sft/loss_first": 2.0, "sft/loss_last": 0.5, "sft/steps": 3.0}, source="oracle")
    db.log_step(0, {"phase_sft": 1.0, "sft/loss_last": 0.5})  # merges into step 0
    turns: dict[int, int] = {}
    _log_steps(db, range(1, 5), turns)
    db.close("finished")
    assert db.lost == []

    assert _count(db_url, "runs") == 1
    assert _count(db_url, "steps") == 5
    for s in range(1, 5):  # rows per step = groups x group size; turns = sum of episode lengths
        assert _count(db_url, "groups", f"WHERE step = {s}") == GROUPS
        assert (
            _count(db_url, "rollouts", f"WHERE step = {s} AND kind = 'train'")
            == GROUPS * GROUP_SIZE
        )
        assert (
            _count(
                db_url,
                "turns",
                f"WHERE rollout_id IN (SELECT id FROM rollouts WHERE step = {s} "
                "AND kind = 'train')",
            )
            == turns[s]
        )
    assert _count(db_url, "evals") == 1
    assert _count(db_url, "rollouts", "WHERE kind = 'eval'") == len(trajs)
    assert _count(db_url, "sft_phases") == 1

    e = _engine(db_url)
    with e.connect() as c:
        run = c.execute(sa.text("SELECT status, last_step, name, config FROM runs")).one()
        assert run.status == "finished" and run.last_step == 4 and run.name == "synthetic"
        m0 = c.execute(sa.text("SELECT metrics FROM steps WHERE step = 0")).scalar()
        m0 = m0 if isinstance(m0, dict) else __import__("json").loads(m0)
        assert m0["eval/success"] == 0.5 and m0["phase_sft"] == 1.0  # merged, not replaced
        # kept / dropped and advantages, against the learner's rule computed here
        g = c.execute(
            sa.text(
                "SELECT id, kept, drop_reason, staleness FROM groups WHERE step = 2 "
                'ORDER BY "index"'
            )
        ).all()
        assert [bool(r.kept) for r in g] == [True, False, True]
        assert g[1].drop_reason == "zero_variance" and g[0].staleness == 1
        groups, _ = synth.step_groups(2, GROUPS, GROUP_SIZE, version=1)
        want, _ = group_advantages(np.array([[t.reward for t in groups[0]]], np.float32))
        got = (
            c.execute(
                sa.text(f"SELECT advantage FROM rollouts WHERE group_id = {g[0].id} ORDER BY id")
            )
            .scalars()
            .all()
        )
        np.testing.assert_allclose(got, want[0], rtol=1e-6)
        assert (
            c.execute(
                sa.text(
                    f"SELECT count(*) FROM rollouts WHERE group_id = {g[1].id} "
                    "AND advantage IS NULL"
                )
            ).scalar()
            == GROUP_SIZE
        )
        # a turn: text, parsed action with its screen point, screenshot on disk
        t = c.execute(
            sa.text(
                "SELECT model_text, actions, x, y, screenshot, screen_w, logprob_sum, "
                "generated_tokens "
                "FROM turns ORDER BY id LIMIT 1"
            )
        ).one()
    e.dispose()
    assert t.model_text.startswith("<tool_call>")
    assert t.x == 60.0 and t.y == 50.0 and t.screen_w == 160
    assert t.logprob_sum == pytest.approx(-0.5 * t.generated_tokens)
    path = workdir / t.screenshot
    assert path.is_file() and t.screenshot.startswith("screens/")
    from PIL import Image

    # the first turn written: eval episode 0 (seed 10_000), turn 0
    np.testing.assert_array_equal(np.asarray(Image.open(path)), synth.screen(10_000 * 31))
    # content-addressed: a screenshot shown to several turns is one file
    n_refs = _count(db_url, "turns", "WHERE screenshot IS NOT NULL")
    n_distinct = _count(
        db_url, "(SELECT DISTINCT screenshot FROM turns WHERE screenshot IS NOT NULL) AS d"
    )
    assert len(os.listdir(workdir / "screens")) == n_distinct <= n_refs


def test_resume_continues_the_run_without_duplicates(db_url, tmp_path):
    workdir = tmp_path / "run"
    db = _open(workdir, db_url)
    db.truncate_after(-1)
    turns: dict[int, int] = {}
    _log_steps(db, range(1, 5), turns)
    db.close("failed: killed")
    # the run resumes from its step-2 checkpoint: steps 3.. are redone
    db = _open(workdir, db_url)
    db.truncate_after(2)
    _log_steps(db, range(3, 7), turns)
    db.close("finished")
    assert _count(db_url, "runs") == 1
    assert _count(db_url, "steps") == 6
    assert _count(db_url, "groups") == 6 * GROUPS
    assert _count(db_url, "rollouts") == 6 * GROUPS * GROUP_SIZE
    assert _count(db_url, "turns") == sum(turns.values())
    e = _engine(db_url)
    with e.connect() as c:
        assert c.execute(sa.text("SELECT status FROM runs")).scalar() == "finished"
        dup = c.execute(
            sa.text("SELECT step, count(*) FROM steps GROUP BY step HAVING count(*) > 1")
        ).all()
    e.dispose()
    assert dup == []


def test_a_full_queue_names_what_was_lost(tmp_path):
    """The writer far behind: calls still return at once; the lost steps are in runs.status."""
    gate = threading.Event()

    def slow_decode(ids):
        gate.wait(30)
        return "x"

    url = str(tmp_path / "t.sqlite")
    db = db_lib.open_run(str(tmp_path / "run"), url, decode=slow_decode, queue_size=2)
    # wait until the writer holds step 1 (blocked in decode); then 2 fit, 3 and 4 do not
    groups, _ = synth.step_groups(1, 1, 2, 0)
    db.log_step(1, {}, groups)
    deadline = time.monotonic() + 10
    while db._q.qsize() and time.monotonic() < deadline:
        time.sleep(0.01)
    for s in (2, 3, 4, 5):
        db.log_step(s, {}, groups)
    assert db.lost == ["step 4", "step 5"]
    gate.set()
    db.close("finished")
    e = _engine(url)
    with e.connect() as c:
        status = c.execute(sa.text("SELECT status FROM runs")).scalar()
        steps = c.execute(sa.text("SELECT step FROM steps ORDER BY step")).scalars().all()
    assert status == "finished; lost 2 records: step 4, step 5"
    assert steps == [1, 2, 3]


def test_postgres_killed_mid_run_loses_nothing(pg_server, tmp_path):
    url = pg_server.new_database()
    workdir = tmp_path / "run"
    db = _open(workdir, url)
    db.truncate_after(-1)
    turns: dict[int, int] = {}
    _log_steps(db, [1, 2], turns)
    assert db.flush(30)
    assert _count(url, "steps") == 2
    pg_server.kill()
    try:
        _log_steps(db, [3, 4], turns)  # the run goes on; the writer spills
        assert db.flush(30)
        assert db.down
        assert (workdir / SPILL_FILE).exists()
    finally:
        pg_server.start()
    _log_steps(db, [5], turns)
    db.close("finished")
    assert not db.down and db.lost == []
    assert not (workdir / SPILL_FILE).exists()
    assert _count(url, "steps") == 5
    assert _count(url, "rollouts") == 5 * GROUPS * GROUP_SIZE
    assert _count(url, "turns") == sum(turns.values())
    e = _engine(url)
    with e.connect() as c:
        assert c.execute(sa.text("SELECT status, last_step FROM runs")).one() == ("finished", 5)
    e.dispose()


def test_records_spilled_at_the_end_are_written_at_the_next_open(pg_server, tmp_path):
    """The database is away from the start to the end of a run: the spill file keeps it all,
    and the next open of the workdir writes it."""
    url = pg_server.new_database()
    workdir = tmp_path / "run"
    pg_server.kill()
    try:
        db = _open(workdir, url, close_timeout_s=1.0)
        db.truncate_after(-1)
        turns: dict[int, int] = {}
        _log_steps(db, [1, 2, 3], turns)
        db.close("finished")
        assert db.down and (workdir / SPILL_FILE).exists() and db.lost == []
    finally:
        pg_server.start()
    db = _open(workdir, url, kind="eval")  # e.g. tools/eval.py --workdir on the same run
    trajs, tasks, screens = synth.eval_batch(3)
    db.log_eval(3, "tools_eval", trajs, tasks, screens=screens)
    db.close("finished")
    assert not (workdir / SPILL_FILE).exists()
    assert _count(url, "runs") == 1
    assert _count(url, "steps") == 3 and _count(url, "turns", "") == sum(turns.values()) + sum(
        len(t.turns) for t in trajs
    )
    e = _engine(url)
    with e.connect() as c:  # the eval joined the run and left its status alone
        assert c.execute(sa.text("SELECT status, kind FROM runs")).one() == ("finished", "train")
        assert c.execute(sa.text("SELECT tag FROM evals")).scalar() == "tools_eval"
    e.dispose()


def test_unreachable_database_never_raises_into_the_trainer(tmp_path):
    db = _open(tmp_path / "run", "postgresql://cua@127.0.0.1:9/none", close_timeout_s=0.5)
    groups, screens = synth.step_groups(1, 2, 2, 0)
    db.log_step(1, synth.metrics_row(1), groups, screens=screens, version=1)
    db.close("finished")
    assert db.down and db.lost == []
    assert (tmp_path / "run" / SPILL_FILE).stat().st_size > 0


def test_null_db_when_disabled(tmp_path):
    db = db_lib.open_run(str(tmp_path), enabled=False)
    db.log_step(1, {}, [])
    db.close()
    assert not os.listdir(tmp_path)


def test_log_step_keeps_no_images_and_leaves_the_trajectories_alone(tmp_path):
    import gc
    import weakref

    groups, screens = synth.step_groups(1, 1, 2, 0)
    turn = groups[0][0].turns[0]
    prompt = turn.prompt_ids.copy()
    pixels = np.ones((4, 8), np.float32)
    turn.pixel_values, turn.image_grid_thw = pixels, np.array([[1, 2, 2]])
    ref = weakref.ref(pixels)
    db = _open(tmp_path / "run", str(tmp_path / "t.sqlite"))
    gate = threading.Event()
    db.decode = lambda ids: gate.wait(30) and "x"  # hold the step in the queue
    db.log_step(1, {}, groups, screens=screens, version=1)
    del pixels
    turn.pixel_values = turn.image_grid_thw = None
    gc.collect()
    assert ref() is None  # the queued step does not hold the batch's images
    np.testing.assert_array_equal(turn.prompt_ids, prompt)
    gate.set()
    db.close()
    assert _count(str(tmp_path / "t.sqlite"), "turns") == sum(len(t.turns) for t in groups[0])
