"""Fixtures: a PostgreSQL server started in a temp dir for the session, and `db_url`, which
runs a test against SQLite and against that server."""

import pytest

from tests.db.pg import PgServer, unavailable_reason


@pytest.fixture(scope="session")
def pg_server():
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no PostgreSQL server for the database tests: {reason}")
    server = PgServer()
    yield server
    server.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """An empty database: a SQLite file, or a fresh database on the test PostgreSQL server."""
    if request.param == "sqlite":
        return str(tmp_path / "db" / "trajectories.sqlite")
    return request.getfixturevalue("pg_server").new_database()
