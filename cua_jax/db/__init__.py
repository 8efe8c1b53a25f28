"""The trajectory database: every run, step, GRPO group, rollout, turn, eval and SFT phase.

    from cua_jax import db as db_lib
    db = db_lib.open_run(workdir, url, run_name=..., config=..., decode=..., advantage=...)
    db.log_step(step, row, groups, screens=..., version=...); db.close("finished")

SQLite in WORKDIR/trajectories.sqlite by default; `url` or $DATABASE_URL selects PostgreSQL.
Models: `cua_jax.db.models`; migrations (applied at every open): `cua_jax/db/migrations`;
the background writer: `cua_jax.db.writer`. `tools/monitor.py` shows it in a browser.
No HTTP server here: the monitor lives in tools/.
"""

from cua_jax.db.engine import (
    DB_FILENAME,
    NotACuaDatabase,
    check_database,
    make_engine,
    migrate,
    resolve_url,
)
from cua_jax.db.writer import NullDB, TrajectoryDB, open_run

__all__ = [
    "DB_FILENAME",
    "NotACuaDatabase",
    "NullDB",
    "TrajectoryDB",
    "check_database",
    "make_engine",
    "migrate",
    "open_run",
    "resolve_url",
]
