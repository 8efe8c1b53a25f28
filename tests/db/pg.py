"""A throwaway PostgreSQL server for tests: Debian's postgresql binaries, a temp data directory,
a free loopback port; `kill()` stops it at once (as a crash would) and `start()` brings it back
on the same port with the same data."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid

import sqlalchemy as sa


def pg_bin() -> str | None:
    """The newest installed PostgreSQL bin dir holding initdb and pg_ctl, or None."""
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.access(os.path.join(d, "initdb"), os.X_OK):
            return d
    found = shutil.which("initdb")
    return os.path.dirname(found) if found else None


def unavailable_reason() -> str | None:
    """Why no server can be started here (the skip reason), or None when one can."""
    if pg_bin() is None:
        return "PostgreSQL is not installed (apt-get install postgresql; `make apt` does)"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root (postgres refuses root) and runuser is missing"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgServer:
    def __init__(self) -> None:
        self.bin = pg_bin()
        # postgres refuses to run as root: the server runs as `nobody` in a dir it owns
        self.as_user = ["runuser", "-u", "nobody", "--"] if os.geteuid() == 0 else []
        self.dir = tempfile.mkdtemp(prefix="cua_pg_")
        if self.as_user:
            os.chown(self.dir, *_ids("nobody"))
        self.data = os.path.join(self.dir, "data")
        self.port = _free_port()
        self.user = "cua"
        self._run(
            "initdb", "-D", self.data, "-U", self.user, "--auth=trust", "-E", "UTF8", "--no-sync"
        )
        self.start()

    def _run(self, tool: str, *args: str) -> None:
        out = subprocess.run(
            [*self.as_user, os.path.join(self.bin, tool), *args],
            capture_output=True,
            text=True,
            cwd=self.dir,
            timeout=60,
        )
        if out.returncode != 0:
            raise RuntimeError(f"{tool} failed ({out.returncode}): {out.stderr or out.stdout}")

    def start(self) -> None:
        opts = (
            f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c full_page_writes=off"  # fast; a committed transaction still survives a kill
        )
        self._run(
            "pg_ctl",
            "-D",
            self.data,
            "-o",
            opts,
            "-l",
            os.path.join(self.dir, "log"),
            "-w",
            "start",
        )

    def kill(self) -> None:
        """Stops the server at once: open connections break, nothing is flushed politely."""
        self._run("pg_ctl", "-D", self.data, "-m", "immediate", "-w", "stop")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh, empty database on this server; returns its URL."""
        name = "t_" + uuid.uuid4().hex[:12]
        engine = sa.create_engine(
            self.url().replace("postgresql://", "postgresql+psycopg://"),
            isolation_level="AUTOCOMMIT",
        )
        with engine.connect() as conn:
            conn.execute(sa.text(f"CREATE DATABASE {name}"))
        engine.dispose()
        return self.url(name)

    def close(self) -> None:
        try:
            self.kill()
        except (RuntimeError, subprocess.SubprocessError):
            pass
        shutil.rmtree(self.dir, ignore_errors=True)


def _ids(user: str) -> tuple[int, int]:
    import pwd

    pw = pwd.getpwnam(user)
    return pw.pw_uid, pw.pw_gid
