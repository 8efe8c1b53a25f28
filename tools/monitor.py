r"""The live training monitor: a run's trajectory database in the browser.

    python tools/monitor.py --db=WORKDIR/trajectories.sqlite [--port 8080]
    python tools/monitor.py --db=postgresql://user@dbhost/cua [--port 8080]
    python tools/monitor.py --db=WORKDIR --host 0.0.0.0 --token SECRET      # beyond loopback

Serves on 127.0.0.1 unless --host is given, and then only with --token. Without --token a
token is made up and the URL carrying it is printed once (as Jupyter does); --no-token opts
out on loopback. Requests from other origins, or naming another Host, are refused.
Pages: runs, a run's curves and steps (live), a step's groups, a rollout turn by turn with the
clicks drawn on its screenshots, evals by task and category (compared between steps or runs).
A --db that cannot be opened or is not a cua_jax database: one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from cua_jax.db.engine import (  # noqa: E402
    DB_FILENAME,
    NotACuaDatabase,
    check_database,
    head_revision,
    make_engine,
    normalize_url,
    safe_url,
)
from tools.monitor_app.app import make_app  # noqa: E402
from tools.monitor_app.security import allowed_hosts, is_loopback  # noqa: E402

MIN_TOKEN_CHARS = 16  # beyond loopback: a token a network neighbour cannot guess


class MonitorError(SystemExit):
    """A bad command line or database: one clear line on stderr, exit status 2."""

    def __init__(self, msg: str):
        print(f"tools/monitor.py: error: {msg}", file=sys.stderr)
        super().__init__(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The monitor's command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--db",
        default=os.environ.get("DATABASE_URL"),
        help="SQLite file, a run's workdir, or a database URL (default: $DATABASE_URL)",
    )
    p.add_argument("--host", default="127.0.0.1", help="Interface to serve on (default loopback)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--token", default=os.environ.get("CUA_MONITOR_TOKEN"), help="Access token")
    p.add_argument("--no-token", action="store_true", help="No token (loopback only)")
    p.add_argument("--allow-host", action="append", default=[], help="Another Host name to accept")
    p.add_argument("--poll-ms", type=int, default=3000, help="Live pages poll this often")
    return p.parse_args(argv)


def open_database(db: str):
    """An engine on a migrated cua_jax database, or MonitorError naming what is wrong."""
    import sqlalchemy as sa

    if "://" not in db:
        path = os.path.join(db, DB_FILENAME) if os.path.isdir(db) else db
        if not os.path.isfile(path):
            raise MonitorError(f"--db={db}: no such SQLite file (expected WORKDIR/{DB_FILENAME})")
        db = path
    url = normalize_url(db)
    try:
        engine = make_engine(url, connect_timeout_s=5)
        rev = check_database(engine)
    except NotACuaDatabase as e:
        raise MonitorError(str(e)) from None
    except sa.exc.ArgumentError as e:
        raise MonitorError(f"--db={db} is not a database URL ({e})") from None
    except (sa.exc.DBAPIError, ModuleNotFoundError) as e:
        first = str(getattr(e, "orig", e) or e).strip().splitlines()[0]
        raise MonitorError(f"cannot open the database {safe_url(url)}: {first}") from None
    if rev != head_revision():
        print(
            f"tools/monitor.py: note: the database is at schema {rev}, this code at "
            f"{head_revision()}; a run of this code upgrades it",
            file=sys.stderr,
        )
    return engine


def main(argv: list[str] | None = None) -> None:
    """The command line: runs what the module docstring describes."""
    args = parse_args(argv)
    if not args.db:
        raise MonitorError("pass --db=WORKDIR (its trajectories.sqlite) or a database URL")

    if args.no_token and args.token:
        raise MonitorError("pass --token or --no-token, not both")
    if not 1 <= args.port <= 65535:
        raise MonitorError(f"--port {args.port} must be in [1, 65535]")
    if args.poll_ms < 100:
        raise MonitorError(f"--poll-ms {args.poll_ms} must be >= 100 (milliseconds)")
    if not is_loopback(args.host):
        if args.no_token or not args.token:
            raise MonitorError(
                f"--host {args.host} serves beyond this machine: pass --token (or "
                "$CUA_MONITOR_TOKEN); --no-token is for loopback only"
            )
        if len(args.token) < MIN_TOKEN_CHARS:
            raise MonitorError(
                f"--host {args.host} serves beyond this machine: the token must have at least "
                f"{MIN_TOKEN_CHARS} characters (e.g. python -c 'import secrets; "
                "print(secrets.token_hex(24))')"
            )
        if not args.allow_host:
            print(
                f"tools/monitor.py: note: clients beyond this machine must name it by an "
                f"--allow-host (e.g. --allow-host {socket.gethostname()}); other Host names "
                "are refused",
                file=sys.stderr,
            )
    engine = open_database(args.db)
    token = None if args.no_token else (args.token or secrets.token_hex(24))
    hosts = allowed_hosts(args.host, args.port, args.allow_host)
    app = make_app(engine, token=token, hosts=hosts, poll_ms=args.poll_ms)
    shown = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{shown}:{args.port}/"
    print(f"cua_jax monitor: {url}" + (f"?token={token}" if token else ""), file=sys.stderr)
    import uvicorn

    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
