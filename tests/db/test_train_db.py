"""The trainer's database switches: `log.db` / `log.db_url` in every config, `log.db=False` (and
processes other than 0) writing nothing, a non-local workdir without a database URL turning
the database off.

The trainer's database end to end (a smoke run, a SIGKILL + resume, tools/eval.py joining the
run) is checked in tests/test_train_smoke.py with tests/db/train_checks.py."""

from __future__ import annotations

import os

import numpy as np

from configs import common
from cua_jax import db as db_lib
from cua_jax.db import writer as writer_lib


def test_every_config_has_the_database_switches():
    c = common.base_config("qwen3_vl")
    assert c.log.db is True and c.log.db_url is None
    c.log.db_url = "postgresql://user@host/cua"  # a typed string field: overridable
    assert c.log.db_url == "postgresql://user@host/cua"
    from configs import qwen3vl_grpo

    smoke = qwen3vl_grpo.get_config("smoke")
    assert smoke.log.db is True and not smoke.log.db_url


def test_db_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("DATABASE_URL", raising=False)
    db = db_lib.open_run(str(tmp_path), None, run_name="x", enabled=False)
    assert isinstance(db, db_lib.NullDB)
    db.truncate_after(-1)
    db.log_step(1, {"rollout/reward": 1.0}, [], screens=[[np.zeros((4, 4, 3), np.uint8)]])
    db.log_eval(1, "step1", [], [], metrics={"eval/success": 1.0})
    db.log_sft({"sft/loss_first": 1.0}, source="oracle", steps=1)
    db.close("finished")
    assert os.listdir(tmp_path) == []


def test_a_non_local_workdir_turns_the_database_off(tmp_path, monkeypatch):
    """Without a database URL (the default SQLite file has no place in gs://...); with one,
    tests/db/test_db_backfill.py records it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    db = db_lib.open_run("gs://bucket/run", None, run_name="x")
    assert isinstance(db, db_lib.NullDB)
    assert os.listdir(tmp_path) == []  # no local "gs:" directory made


def test_the_default_database_is_the_workdir_sqlite_file(tmp_path, monkeypatch):
    monkeypatch.delenv("DATABASE_URL", raising=False)
    db = db_lib.open_run(str(tmp_path), None, run_name="x", config={"a": 1})
    assert isinstance(db, writer_lib.TrajectoryDB)
    db.close("finished")
    assert db.url == "sqlite:///" + str(tmp_path / db_lib.DB_FILENAME)
    assert os.path.getsize(tmp_path / db_lib.DB_FILENAME) > 0
    assert os.path.exists(tmp_path / writer_lib.RUN_FILE)


def test_a_process_that_ends_without_closing_its_run_marks_it_failed(tmp_path):
    """An error before the trainer's loop (outside its try/finally) still ends the run row."""
    import subprocess
    import sys

    import sqlalchemy as sa

    from cua_jax.db import models as m

    code = (
        "from cua_jax import db\n"
        f"d = db.open_run({str(tmp_path)!r}, None, run_name='x')\n"
        "d.log_step(0, {'eval/success': 0.5})\n"
        "raise RuntimeError('the env pool did not start')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True)
    assert r.returncode == 1 and b"the env pool did not start" in r.stderr
    engine = db_lib.make_engine(str(tmp_path / db_lib.DB_FILENAME))
    with engine.connect() as c:
        status = c.execute(sa.select(m.Run.status)).scalar_one()
        steps = c.execute(sa.select(m.Step.step)).scalars().all()
    engine.dispose()
    assert status == writer_lib.EXIT_STATUS and steps == [0]
