"""The background writer: the trainer's calls return at once; one thread writes.

    db = open_run(workdir, url, run_name=..., config=..., decode=..., advantage=...)
    db.truncate_after(step)                          # at (re)start, after the resumed step
    db.log_eval(step, tag, trajs, tasks, screens=..., metrics=...)
    db.log_sft(metrics, source=..., steps=...)
    db.log_step(step, row, groups, screens=..., version=...)
    db.close("finished")

Writes never slow or break training. Calls put a reference on a bounded queue (no copy, no
encoding, no I/O in the caller); the writer thread turns it into a JSON record
(`cua_jax.db.records`), saves its screenshots, and writes it in one transaction. When the
database is unreachable the record goes to WORKDIR/trajectories.spill.jsonl instead, the
writer logs it once and retries every `retry_s`; when the database answers again, the spill
file is written first, in order. A spill file left by a process that ended while the database
was away is written by the next `open_run` of the same workdir. Records are idempotent (a step
rewritten replaces its rows), so a replay never duplicates. A full queue (the writer far
behind) or a record the database refuses loses data: each is named in the log and, at close,
in `runs.status` ("finished; lost 2 records: step 7, step 8"). A process killed outright
(SIGKILL) loses what was queued; the next open of a training run's workdir backfills it from
the run's own files (`cua_jax.db.backfill`: metrics.jsonl and, with rl.persist_rollouts, the
groups of those steps).
"""

from __future__ import annotations

import atexit
import copy
import json
import os
import queue
import socket
import subprocess
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import sqlalchemy as sa
from absl import logging
from sqlalchemy.orm import Session

from cua_jax.db import backfill, records
from cua_jax.db.engine import make_engine, migrate, resolve_url, safe_url
from cua_jax.redact import redact

RUN_FILE = "trajectories.run"  # the run's uid: a resumed run continues the same runs row
SPILL_FILE = "trajectories.spill.jsonl"
_STOP = object()
# Writers not closed yet: a process that ends without closing its run (an error before the
# trainer's loop, outside its try/finally) still records that the run failed.
_OPEN: weakref.WeakSet = weakref.WeakSet()
EXIT_STATUS = "failed: the process ended without closing the run (see its log)"
# Errors that mean "the database is not there now" (retried), as opposed to a refused record.
CONNECTION_ERRORS = (sa.exc.OperationalError, sa.exc.InterfaceError, sa.exc.DisconnectionError)


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=os.path.dirname(os.path.abspath(__file__)),
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


_NO_IDS = np.zeros(0, np.int32)


def _light(traj: Any) -> Any:
    """A shallow copy of a Trajectory without what the database never stores (prompt ids,
    pixel values), so a queued step does not keep the batch's images alive."""
    light = copy.copy(traj)
    turns = []
    for turn in traj.turns:
        t = copy.copy(turn)
        t.prompt_ids, t.pixel_values, t.image_grid_thw = _NO_IDS, None, None
        turns.append(t)
    light.turns = turns
    return light


def is_local(workdir: str) -> bool:
    """A path on this machine (not gs://... or another object store)."""
    return "://" not in os.fspath(workdir)


def run_uid(workdir: str, *, create: bool = True) -> tuple[str, bool]:
    """(uid, existed): the uid kept in WORKDIR/trajectories.run (a local path or gs://...),
    made on the first open."""
    if not is_local(workdir):
        from etils import epath  # noqa: PLC0415 -- object stores only

        remote = epath.Path(workdir) / RUN_FILE
        if remote.exists():
            return json.loads(remote.read_text())["uid"], True
        uid = uuid.uuid4().hex
        if create:
            remote.write_text(json.dumps({"uid": uid}))
        return uid, False
    path = os.path.join(workdir, RUN_FILE)
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)["uid"], True
    uid = uuid.uuid4().hex
    if create:
        os.makedirs(workdir, exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump({"uid": uid}, f)
        os.replace(path + ".tmp", path)
    return uid, False


def local_dir(workdir: str, uid: str) -> str:
    """Where a run whose workdir is an object store keeps its spill file on this machine."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cua_jax", "trajectory_db", uid)


class TrajectoryDB:
    """A run's writer (module docstring). Build it with `open_run`."""

    def __init__(
        self,
        url: str,
        workdir: str,
        uid: str,
        open_record: dict[str, Any],
        *,
        decode: Callable[[list[int]], str] | None = None,
        advantage: Any = None,
        queue_size: int = 64,
        retry_s: float = 5.0,
        close_timeout_s: float = 30.0,
        process_index: int = 0,
        backfill: bool = False,
    ) -> None:
        local = is_local(workdir)
        self.url, self.uid = url, uid
        self.workdir = os.path.abspath(workdir) if local else os.fspath(workdir)
        self.process = int(process_index)
        self.backfilled: dict[str, int] = {}  # what the last backfill wrote (backfill.py)
        self._backfill_due = backfill
        self.decode, self.advantage = decode, advantage
        self.retry_s, self.close_timeout_s = retry_s, close_timeout_s
        # each process of a multi-host job spills to its own file
        spill = SPILL_FILE if not self.process else SPILL_FILE.replace(".", f".p{self.process}.", 1)
        spill_dir = self.workdir if local else local_dir(self.workdir, uid)
        if not local:
            os.makedirs(spill_dir, exist_ok=True)
        self.spill_path = os.path.join(spill_dir, spill)
        self.lost: list[str] = []  # records that never reached the database
        self.written = 0  # records written (replays included)
        self.down = False  # the database did not answer the last try
        self._attach = bool(open_record.get("attach"))
        self._lock = threading.Lock()
        self._q: queue.Queue = queue.Queue(maxsize=queue_size)
        self._engine = None
        self._migrated = False
        self._last_try = 0.0
        self._closed = False
        self._q.put_nowait(("record", self._stamp(open_record)))
        self._thread = threading.Thread(target=self._run, name="trajectory-db", daemon=True)
        self._thread.start()
        _OPEN.add(self)

    # ---- the trainer's API (returns at once, never raises) ---------------------------------

    def log_step(
        self,
        step: int,
        metrics: dict[str, Any],
        groups: Sequence[Sequence[Any]] | None = None,
        *,
        screens: Sequence[Sequence[Any]] | None = None,
        version: int | None = None,
    ) -> None:
        """A step's metrics row; with `groups`, its GRPO groups, rollouts and turns (replacing
        any earlier rows of the step). `screens`: per episode of the first groups, flattened
        in group order, the screenshots u8[H, W, 3] of its turns. `version`: the learner
        version the groups were trained against (staleness = version - policy_version)."""
        t = records.now()
        groups = None if groups is None else [[_light(tr) for tr in g] for g in groups]
        self._submit(
            f"step {step}",
            lambda: records.step_record(
                self.uid,
                step,
                metrics,
                groups,
                time=t,
                workdir=self.workdir,
                screens=screens,
                version=version,
                decode=self.decode,
                advantage=self.advantage,
            ),
            dict(metrics),
        )

    def log_eval(
        self,
        step: int,
        tag: str,
        trajs: Sequence[Any],
        tasks: Sequence[Any] | None = None,
        *,
        screens: Sequence[Sequence[Any]] | None = None,
        metrics: dict[str, Any] | None = None,
    ) -> None:
        """An eval's episodes (one per task, tasks give the categories) at `step`, tagged
        (step0, after_sft, step25, ...); `metrics`: `train.success_by_category`'s dict."""
        t = records.now()
        trajs, tasks = [_light(tr) for tr in trajs], None if tasks is None else list(tasks)
        metrics = dict(metrics or {})
        self._submit(
            f"eval {tag}@{step}",
            lambda: records.eval_record(
                self.uid,
                step,
                tag,
                trajs,
                tasks,
                time=t,
                workdir=self.workdir,
                screens=screens,
                metrics=metrics,
                decode=self.decode,
            ),
        )

    def log_sft(
        self, metrics: dict[str, Any], *, source: str | None = None, steps: int | None = None
    ) -> None:
        """The SFT warm-up's summary (`sft/...` metrics of `cua_jax.job.sft.sft_warmup`)."""
        rec = {
            "op": "sft",
            "uid": self.uid,
            "time": records.now(),
            "source": source,
            "steps": steps,
            "metrics": records.clean(dict(metrics)),
        }
        self._submit("sft", lambda: rec)

    def truncate_after(self, step: int) -> None:
        """Drops the steps, groups, rollouts and evals after `step` (a resumed run redoes them)."""
        rec = {"op": "truncate", "uid": self.uid, "time": records.now(), "after": int(step)}
        self._submit(f"truncate after {step}", lambda: rec)

    def close(self, status: str = "finished") -> None:
        """Writes the final status and waits up to `close_timeout_s` for the queue to drain (a
        database still away then keeps the spill file for the next open)."""
        if self._closed:
            return
        rec = {
            "op": "close",
            "uid": self.uid,
            "time": records.now(),
            "status": status,
            "attach": self._attach,
        }
        self._closed = True
        _OPEN.discard(self)
        try:  # the end of the run may wait for the queue (never the steps)
            self._q.put(("make", "close", lambda: self._stamp(rec)), timeout=self.close_timeout_s)
            self._q.put(_STOP, timeout=self.close_timeout_s)
        except queue.Full:
            with self._lock:
                self.lost.append("close")
        self._thread.join(self.close_timeout_s)
        if self._thread.is_alive():
            logging.error(
                "trajectory database %s: the writer did not finish within %.0f s; %d records "
                "still queued are lost",
                safe_url(self.url),
                self.close_timeout_s,
                self._q.qsize(),
            )
        if self.lost:
            logging.error(
                "trajectory database: %d records were lost: %s",
                len(self.lost),
                ", ".join(self.lost[:50]),
            )
        if self._engine is not None:
            self._engine.dispose()

    def flush(self, timeout: float = 30.0) -> bool:
        """Waits until every queued record is written or spilled (tests, tools)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._q.all_tasks_done:
                if not self._q.unfinished_tasks:
                    return True
            time.sleep(0.01)
        return False

    def __enter__(self) -> TrajectoryDB:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close("finished" if exc is None else f"failed: {type(exc).__name__}: {exc}")

    def _stamp(self, rec: dict[str, Any]) -> dict[str, Any]:
        """Marks a record with its process (multi-host: `records.PROCESS_STRIDE`)."""
        if self.process:
            rec["process"] = self.process
            if rec.get("op") == "eval":  # each process's share of an eval is its own row
                rec["tag"] = f"{rec['tag']}/p{self.process}"
        return rec

    def _submit(self, name: str, make: Callable[[], dict], *_keep: Any) -> None:
        if self._closed:
            logging.warning("trajectory database: %s logged after close(); dropped", name)
            return
        try:
            self._q.put_nowait(("make", name, lambda: self._stamp(make())))
        except queue.Full:
            with self._lock:
                self.lost.append(name)
            logging.warning(
                "trajectory database: the writer is %d records behind; %s is not recorded",
                self._q.maxsize,
                name,
            )

    # ---- the writer thread ------------------------------------------------------------------

    def _run(self) -> None:
        if os.path.exists(self.spill_path) and os.path.getsize(self.spill_path):
            self.down = True  # an earlier process left records: they go first
            self._try_recover()
        stopping = False
        while True:
            timeout = self.retry_s if self.down else None
            try:
                item = self._q.get(timeout=timeout)
            except queue.Empty:
                item = None
            try:
                if item is _STOP:
                    stopping = True
                if self.down and time.monotonic() - self._last_try >= self.retry_s:
                    self._try_recover()
                if isinstance(item, tuple):
                    self._handle(item)
                if self._backfill_due and not self.down and item is not None:
                    self._backfill()
            except Exception:  # noqa: BLE001 -- the writer outlives any one failure
                logging.exception("trajectory database writer: unexpected error (it goes on)")
            finally:
                if item is not None:
                    self._q.task_done()
            if stopping:
                deadline = time.monotonic() + self.close_timeout_s * 0.8
                while self.down and time.monotonic() < deadline:
                    time.sleep(min(self.retry_s, max(0.0, deadline - time.monotonic())))
                    self._try_recover()
                if self.down:
                    logging.error(
                        "trajectory database %s is still unreachable at the end of the run: "
                        "the records it missed are in %s and are written at the next open of "
                        "this workdir",
                        safe_url(self.url),
                        self.spill_path,
                    )
                return

    def _handle(self, item: tuple) -> None:
        if item[0] == "record":
            name, rec = records.describe(item[1]), item[1]
        else:
            _, name, make = item
            try:
                rec = make()
            except Exception:  # noqa: BLE001 -- a bad record must not stop the writer
                logging.exception("trajectory database: could not build the record of %s", name)
                with self._lock:
                    self.lost.append(name)
                return
        if self.down:
            self._spill(rec)
        else:
            self._write_or_spill(rec)

    def _write(self, rec: dict[str, Any]) -> None:
        if self._engine is None:
            self._engine = make_engine(self.url)
        if not self._migrated:
            try:
                migrate(self._engine)
            except (sa.exc.ProgrammingError, sa.exc.IntegrityError):
                # another process of the job created the schema at the same moment: its
                # tables now exist, and a second upgrade finds them at head
                time.sleep(1.0)
                migrate(self._engine)
            self._migrated = True
        with self._lock:
            lost = list(self.lost)
        try:
            with Session(self._engine) as session, session.begin():
                records.apply_record(session, rec, lost)
        except sa.exc.IntegrityError:
            if rec["op"] != "open":
                raise
            # another process of the job (or an eval attaching) inserted the run row between
            # this open's SELECT and its INSERT: the row exists now, so the open joins it
            with Session(self._engine) as session, session.begin():
                records.apply_record(session, rec, lost)
        self.written += 1

    def _write_or_spill(self, rec: dict[str, Any]) -> bool:
        try:
            self._write(rec)
            return True
        except CONNECTION_ERRORS as e:
            self._went_down(e)
            self._spill(rec)
        except Exception:  # noqa: BLE001 -- refused: named, never retried forever
            logging.exception(
                "trajectory database refused %s; it is not recorded", records.describe(rec)
            )
            with self._lock:
                self.lost.append(records.describe(rec))
        return False

    def _backfill(self) -> None:
        """Writes what the run's own files hold and the database lacks (`backfill.py`): after
        the open record, before the trainer's first truncate, so steps a resume redoes are
        dropped again by it."""

        if self._engine is None:
            return
        try:
            with Session(self._engine) as session:
                recs = backfill.missing_records(
                    session,
                    self.uid,
                    self.workdir,
                    self.process,
                    decode=self.decode,
                    advantage=self.advantage,
                )
        except CONNECTION_ERRORS as e:
            self._went_down(e)
            return
        except Exception:  # noqa: BLE001 -- a backfill never stops the writer
            logging.exception("trajectory database: backfill from %s failed", self.workdir)
            self._backfill_due = False
            return
        self._backfill_due = False
        for rec in recs:
            if not self._write_or_spill(self._stamp(rec)):
                break
            kind = "groups" if rec.get("groups") else "steps"
            self.backfilled[kind] = self.backfilled.get(kind, 0) + 1
        if recs:
            logging.warning(
                "trajectory database: backfilled %s from %s (records a crash kept from it)",
                ", ".join(records.describe(r) for r in recs[:20]),
                self.workdir,
            )

    def _went_down(self, e: BaseException) -> None:
        self._last_try = time.monotonic()
        if not self.down:
            logging.warning(
                "trajectory database %s is unreachable (%s); the run goes on, its records are "
                "kept in %s and written when the database answers (retry every %.0f s)",
                safe_url(self.url),
                str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__,
                self.spill_path,
                self.retry_s,
            )
        self.down = True

    def _spill(self, rec: dict[str, Any]) -> None:
        try:
            with open(self.spill_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        except OSError as e:
            logging.error("trajectory database: cannot spill %s (%s)", records.describe(rec), e)
            with self._lock:
                self.lost.append(records.describe(rec))

    def _try_recover(self) -> None:
        """Writes the spill file in order; the database is up again once it is empty."""
        self._last_try = time.monotonic()
        try:
            with open(self.spill_path) as f:
                lines = [ln for ln in f if ln.strip()]
        except FileNotFoundError:
            lines = []
        for i, line in enumerate(lines):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a crash mid-write
                logging.error("trajectory database: unreadable spill line %d skipped", i + 1)
                continue
            try:
                self._write(rec)
            except CONNECTION_ERRORS as e:
                self._went_down(e)
                with open(self.spill_path + ".tmp", "w") as f:
                    f.writelines(lines[i:])
                os.replace(self.spill_path + ".tmp", self.spill_path)
                return
            except Exception:  # noqa: BLE001
                logging.exception("trajectory database refused spilled %s", records.describe(rec))
                with self._lock:
                    self.lost.append(records.describe(rec))
        if os.path.exists(self.spill_path):
            os.remove(self.spill_path)
        if self.down:
            logging.warning(
                "trajectory database %s answers again; wrote the %d records it missed",
                safe_url(self.url),
                len(lines),
            )
        self.down = False


@atexit.register
def _close_at_exit() -> None:
    """Closes the runs still open at interpreter exit as failed (atexit runs before daemon
    threads stop; a SIGKILL skips it, and the run stays "running" until it is resumed)."""
    for db in list(_OPEN):
        db.close_timeout_s = min(db.close_timeout_s, 10.0)
        db.close(EXIT_STATUS)


class NullDB:
    """The same API doing nothing (hosts other than process 0; `log.db=False`)."""

    lost: list[str] = []  # noqa: RUF012 -- never mutated

    def log_step(self, *args: Any, **kwargs: Any) -> None:
        pass

    log_eval = log_sft = truncate_after = log_step

    def close(self, status: str = "finished") -> None:
        pass

    def flush(self, timeout: float = 0.0) -> bool:
        return True

    def __enter__(self) -> NullDB:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def open_run(
    workdir: str,
    url: str | None = None,
    *,
    run_name: str | None = None,
    config: dict[str, Any] | None = None,
    kind: str = "train",
    decode: Callable[[list[int]], str] | None = None,
    advantage: Any = None,
    enabled: bool = True,
    process_index: int = 0,
    **writer_kwargs: Any,
) -> TrajectoryDB | NullDB:
    """The run's database writer (module docstring). The run row is WORKDIR's: reopening the
    same workdir (a resumed run) continues it. kind="eval" on a workdir that already holds a
    run (tools/eval.py --workdir) adds its evals to that run and leaves the run's status alone.
    The database itself is opened, and migrated, in the writer thread: an unreachable one never
    delays or fails this call.

    A training run backfills at open what its files hold and the database does not (a crash
    lost the queue): steps of WORKDIR/metrics.jsonl, and the groups of those steps that
    `rl.persist_rollouts` wrote (`cua_jax.db.backfill`). `process_index` > 0 (multi-host, one
    writer a process, one database): that process's groups and eval shares are rows of their
    own (`records.PROCESS_STRIDE`, eval tags "TAG/pN"); process 0 writes the step's metrics,
    the run's status and the truncate of a resume.

    A workdir on object storage (gs://...) is recorded when a database URL is given (`url`,
    $DATABASE_URL; the SQLite default would live in the workdir): its run id and screenshots go
    to the workdir through etils.epath, its spill file to this machine (`local_dir`)."""
    if not enabled:
        return NullDB()
    if not is_local(workdir):
        # gs://...: the run id and screenshots live in the workdir (etils.epath), the spill file
        # on this machine (`local_dir`); the default database (SQLite in the workdir) cannot
        if not (url or os.environ.get("DATABASE_URL")):
            logging.warning(
                "trajectory database: off for this run: its workdir %s is not a local path, "
                "so the SQLite default has no place; set config.log.db_url (or "
                "$DATABASE_URL), e.g. to a PostgreSQL URL, to record it",
                workdir,
            )
            return NullDB()
        workdir = os.fspath(workdir).rstrip("/")
    else:
        workdir = os.path.abspath(workdir)
    uid, existed = run_uid(workdir, create=process_index == 0)
    # process 0 makes the run file; the others read it (a workdir shared by the job's hosts)
    deadline = time.monotonic() + 30
    while process_index and not existed and time.monotonic() < deadline:
        time.sleep(0.2)
        uid, existed = run_uid(workdir, create=False)
    if process_index and not existed:
        logging.error(
            "trajectory database: process %d found no %s in %s after 30 s (process 0 writes "
            "it there: the job's processes need a shared workdir); its groups are not recorded",
            process_index,
            RUN_FILE,
            workdir,
        )
        return NullDB()
    resolved = resolve_url(workdir, url)
    rec = {
        "op": "open",
        "uid": uid,
        "time": records.now(),
        "name": run_name or os.path.basename(workdir),
        "kind": kind,
        "workdir": workdir,
        "config": records.clean(redact(config or {})),  # the monitor shows it: no secrets
        "host": socket.gethostname(),
        "git_commit": _git_commit(),
        "attach": kind == "eval" and existed,
    }
    logging.info("trajectory database: %s (run %s)", safe_url(resolved), uid)
    writer_kwargs.setdefault("backfill", kind == "train")
    return TrajectoryDB(
        resolved,
        workdir,
        uid,
        rec,
        decode=decode,
        advantage=advantage,
        process_index=process_index,
        **writer_kwargs,
    )
