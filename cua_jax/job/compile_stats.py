"""Compile accounting from JAX's monitoring events: how many programs were compiled, which, and
how long it took.

    stats = compile_stats.install()        # once per process; idempotent
    mark = stats.snapshot()
    ... run a step ...
    row.update(stats.step_metrics(mark))   # time/compile_s, compile/count, compile/count/<fn>

JAX reports every XLA compile as the event `BACKEND_COMPILE` with the jitted function's name
(``fun_name``, e.g. ``jit(rl_step)``); a program loaded from the persistent compilation cache
goes through the same event (short) and also fires `CACHE_HIT`. Lowering to MLIR
(`LOWER`) is counted in the seconds too: it is part of the stall a new shape costs. Tracing is
left out: its events nest (a jitted function traced inside another one reports its own span
inside its caller's), and for the programs here it is a small part of the time.

Listeners cannot be removed from JAX, so one process-wide `CompileStats` collects everything
and callers take differences between snapshots. Events come from whichever thread compiles
(the learner's worker thread, the sampler's); counting is under a lock.

After a run's warm-up, `expect_no_compiles(programs)` turns every later compile of those
programs into an *unplanned* one: logged with its program name, counted (`compile/unplanned`),
and with ``strict`` raised by `check()` as `UnplannedCompileError` (tests' configs; production
only logs and counts).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Any

from jax import monitoring

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"

_log = logging.getLogger(__name__)


class UnplannedCompileError(RuntimeError):
    """A program was compiled after the warm-up while shapes are strict (`rl.strict_shapes`)."""


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Totals at one moment (see `CompileStats.snapshot`)."""

    count: int
    seconds: float
    lower_seconds: float
    cache_hits: int
    unplanned: int
    per_program: dict[str, int]
    time: float = 0.0  # time.time() when taken

    @property
    def total_seconds(self) -> float:
        """Backend compile + lowering seconds (what ``time/compile_s`` reports)."""
        return self.seconds + self.lower_seconds


def program_name(fun_name: str) -> str:
    """``jit(rl_step)`` (how JAX names the jitted function ``rl_step``'s module) -> ``rl_step``."""
    for head in ("jit(", "pjit("):
        if fun_name.startswith(head) and fun_name.endswith(")"):
            return fun_name[len(head) : -1]
    return fun_name


class CompileStats:
    """Process-wide compile counts and seconds, per program (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()
        self.count = 0
        self.seconds = 0.0
        self.lower_seconds = 0.0
        self.cache_hits = 0
        self.unplanned = 0
        self.per_program: collections.Counter[str] = collections.Counter()
        self.seconds_per_program: collections.Counter[str] = collections.Counter()
        self.cache_hits_per_program: collections.Counter[str] = collections.Counter()
        self._frozen = False
        self._strict = False
        self._watched: set[str] = set()
        self._errors: list[str] = []
        self._spans: list[tuple[float, float]] = []  # (start, end) time.time() of each compile

    # ---- JAX listeners ---------------------------------------------------------------------
    def _on_scalar(self, event: str, value: float, **kw: Any) -> None:
        if event == BACKEND_COMPILE:  # recorded when a backend compile starts
            self._local.current = program_name(str(kw.get("fun_name", "?")))

    def _on_event(self, event: str, **kw: Any) -> None:
        if event == CACHE_HIT:
            with self._lock:
                self.cache_hits += 1
                self.cache_hits_per_program[getattr(self._local, "current", None) or "?"] += 1

    def _on_span(self, event: str, start: float, end: float, **kw: Any) -> None:
        if event in (BACKEND_COMPILE, LOWER):
            with self._lock:
                self._spans.append((start, end))

    def busy_seconds(self, mark: Snapshot) -> float:
        """Wall-clock seconds after `mark` during which anything was compiling: the union of the
        compiles' time spans (compiles in several threads at once count once)."""
        with self._lock:
            spans = sorted((max(a, mark.time), b) for a, b in self._spans if b > mark.time)
        total, end = 0.0, float("-inf")
        for a, b in spans:
            if b > end:
                total += b - max(a, end)
                end = b
        return total

    def _on_duration(self, event: str, duration: float, **kw: Any) -> None:
        if event == LOWER:
            with self._lock:
                self.lower_seconds += duration
            return
        if event != BACKEND_COMPILE:
            return
        name = program_name(str(kw.get("fun_name", "?")))
        self._local.current = None
        with self._lock:
            self.count += 1
            self.seconds += duration
            self.per_program[name] += 1
            self.seconds_per_program[name] += duration
            unplanned = self._frozen and name in self._watched
            if unplanned:
                self.unplanned += 1
                msg = f"unplanned compile of {name} after the warm-up ({duration:.2f} s)"
                self._errors.append(msg)
        if unplanned:
            _log.warning("%s: a shape outside the run's shape set", msg)

    # ---- API -------------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        with self._lock:
            return Snapshot(
                self.count,
                self.seconds,
                self.lower_seconds,
                self.cache_hits,
                self.unplanned,
                dict(self.per_program),
                time.time(),
            )

    def since(self, mark: Snapshot) -> Snapshot:
        """What happened after `mark`."""
        now = self.snapshot()
        per = {k: v - mark.per_program.get(k, 0) for k, v in now.per_program.items()}
        return Snapshot(
            now.count - mark.count,
            now.seconds - mark.seconds,
            now.lower_seconds - mark.lower_seconds,
            now.cache_hits - mark.cache_hits,
            now.unplanned - mark.unplanned,
            {k: v for k, v in per.items() if v},
            now.time,
        )

    def step_metrics(self, mark: Snapshot, step_s: float | None = None) -> dict[str, float]:
        """A metrics row's compile entries for what happened after `mark`: ``time/compile_s``
        (backend compile + lowering seconds), ``compile/count``, ``compile/cache_hits``,
        ``compile/unplanned``, ``compile/count/<program>`` for each program compiled, and
        ``time/step_steady`` = `step_s` when nothing was compiled."""
        d = self.since(mark)
        out = {
            "time/compile_s": d.total_seconds,
            "compile/count": float(d.count),
            "compile/cache_hits": float(d.cache_hits),
            "compile/unplanned": float(d.unplanned),
        }
        out.update({f"compile/count/{k}": float(v) for k, v in sorted(d.per_program.items())})
        if step_s is not None and d.count == 0:
            out["time/step_steady"] = float(step_s)
        return out

    def expect_no_compiles(self, programs: tuple[str, ...], *, strict: bool) -> None:
        """From now on a compile of any of `programs` (names as `program_name` gives them) is
        unplanned: logged and counted; with `strict`, `check()` raises for it."""
        with self._lock:
            self._frozen, self._strict, self._watched = True, strict, set(programs)
            self._errors = []

    def reset_expectations(self) -> None:
        """Compiles are expected again (a new warm-up, or the end of a run)."""
        with self._lock:
            self._frozen, self._strict, self._errors = False, False, []

    def check(self) -> None:
        """Raises `UnplannedCompileError` naming the programs compiled since
        `expect_no_compiles(strict=True)`; logs and counts only when not strict."""
        with self._lock:
            errors, strict = list(self._errors), self._strict
            self._errors = []
        if errors and strict:
            raise UnplannedCompileError(
                "; ".join(errors) + " (rl.strict_shapes=True: every program of a run is compiled "
                "at start-up for the shape set the config decides; see cua_jax/rl/shapes.py)"
            )


_STATS: CompileStats | None = None
_INSTALL_LOCK = threading.Lock()


def install() -> CompileStats:
    """The process's `CompileStats`, registering its JAX listeners on the first call."""
    global _STATS
    with _INSTALL_LOCK:
        if _STATS is None:
            stats = CompileStats()
            monitoring.register_event_duration_secs_listener(stats._on_duration)
            monitoring.register_event_listener(stats._on_event)
            monitoring.register_scalar_listener(stats._on_scalar)
            monitoring.register_event_time_span_listener(stats._on_span)
            _STATS = stats
        return _STATS


def wall_share(rows: list[dict[str, Any]], wall_s: float, total_compile_s: float) -> dict:
    """`summary.json`'s compile entries from a run's metrics rows and the wall-clock seconds it
    spent compiling (`CompileStats.busy_seconds`): those seconds and their share of the run's
    wall time, the steps' compile seconds and their share of the step time
    (``compile_share_steps``), and the median step without a compile."""
    steps = [r for r in rows if "time/step" in r]
    step_compile = sum(float(r.get("time/compile_s", 0.0)) for r in steps)
    step_time = sum(float(r["time/step"]) for r in steps)
    steady = sorted(float(r["time/step"]) for r in steps if not r.get("compile/count"))
    return {
        "compile_s": total_compile_s,
        "compile_s_steps": step_compile,
        "compile_share": total_compile_s / wall_s if wall_s > 0 else 0.0,
        "compile_share_steps": step_compile / step_time if step_time > 0 else 0.0,
        "steps_with_compile": sum(1 for r in steps if r.get("compile/count")),
        "step_steady_median_s": steady[len(steady) // 2] if steady else None,
    }
