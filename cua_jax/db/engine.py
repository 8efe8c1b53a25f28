"""Database URLs, engines and migrations.

url = resolve_url(workdir, url)   # explicit URL > $DATABASE_URL > WORKDIR/trajectories.sqlite
engine = make_engine(url)          # SQLite in WAL mode (the monitor reads while a run writes)
migrate(engine)                    # Alembic upgrade to head (applied at every open)
check_database(engine)             # raises NotACuaDatabase for a database without our schema
"""

from __future__ import annotations

import os
import threading
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from cua_jax.db.models import VERSION_TABLE

DB_FILENAME = "trajectories.sqlite"
MIGRATIONS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "migrations")


class NotACuaDatabase(RuntimeError):
    """The database holds no cua_jax schema (its Alembic version table is missing)."""


def resolve_url(workdir: str | None, url: str | None = None) -> str:
    """The database URL of a run: `url`, else $DATABASE_URL, else WORKDIR/trajectories.sqlite.

    A bare file path is taken as a SQLite file; "postgresql://" gets the psycopg 3 driver.
    """
    url = url or os.environ.get("DATABASE_URL") or ""
    if not url:
        if workdir is None:
            raise ValueError("no database: pass a URL, set DATABASE_URL, or give a workdir")
        return "sqlite:///" + os.path.abspath(os.path.join(workdir, DB_FILENAME))
    return normalize_url(url)


def normalize_url(url: str) -> str:
    """SQLAlchemy URL of `url`: a path -> sqlite, postgres(ql):// -> postgresql+psycopg://."""
    if "://" not in url:
        return "sqlite:///" + os.path.abspath(url)
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def safe_url(url: str) -> str:
    """`url` with its password hidden, for messages and logs."""
    try:
        return sa.engine.make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 -- a message helper must not raise
        return url


def make_engine(url: str, *, connect_timeout_s: float = 5.0, **kwargs: Any) -> Engine:
    """An engine for `url`; SQLite files get WAL, a busy timeout and foreign keys."""
    url = normalize_url(url)
    if url.startswith("sqlite"):
        path = sa.engine.make_url(url).database
        if path and path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
        engine = sa.create_engine(
            url, connect_args={"timeout": 30, "check_same_thread": False}, **kwargs
        )

        @sa.event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record):  # noqa: ANN001
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    connect_args = {}
    if url.startswith("postgresql"):
        connect_args["connect_timeout"] = max(1, int(connect_timeout_s))
    return sa.create_engine(url, pool_pre_ping=True, connect_args=connect_args, **kwargs)


_MIGRATE_LOCK = threading.Lock()


def migrate(engine: Engine) -> None:
    """Upgrades the schema to the newest migration (creates it in an empty database)."""
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", MIGRATIONS_DIR)
    # Alembic keeps its context in module globals: one migration at a time in a process (the
    # writers of several processes of a job may share one; tests run them as threads).
    with _MIGRATE_LOCK, engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")


def head_revision() -> str:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    cfg = Config()
    cfg.set_main_option("script_location", MIGRATIONS_DIR)
    return ScriptDirectory.from_config(cfg).get_current_head()


def check_database(engine: Engine) -> str:
    """The schema revision of a cua_jax database; raises `NotACuaDatabase` for any other one
    (and SQLAlchemy's OperationalError when it cannot be reached)."""
    with engine.connect() as conn:
        if not sa.inspect(conn).has_table(VERSION_TABLE):
            raise NotACuaDatabase(
                f"{safe_url(str(engine.url))} is not a cua_jax trajectory database (no "
                f"{VERSION_TABLE} table); point --db at WORKDIR/{DB_FILENAME} or the run's "
                "DATABASE_URL"
            )
        rev = conn.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar()
    return str(rev)
