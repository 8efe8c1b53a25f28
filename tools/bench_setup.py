"""What the benchmark scripts (tools/bench_*.py) share: the command line's parser, the platform and
thread set-up, the timing protocols and a loopback server for the HTTP benchmarks.

    from tools import bench_setup

    bench_setup.cpu_unless_set()       # before the script first imports jax
    import jax                         # noqa: E402

Only timing and set-up live here; what each script measures stays in the script. Nothing in this
module imports jax at import time, so a script can still choose the platform and XLA's flags
first.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import time
from collections.abc import Awaitable, Callable, Hashable, Iterable, Iterator
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


def arg_parser(doc: str, *, paragraph: bool = False) -> argparse.ArgumentParser:
    """The bench script's command line, described by the first line of its docstring `doc` (by
    its whole first paragraph with `paragraph`), as `--help` shows it."""
    return argparse.ArgumentParser(description=doc.split("\n\n" if paragraph else "\n")[0])


def cpu_unless_set() -> None:
    """JAX on the CPU unless $JAX_PLATFORMS says otherwise; call it before jax is imported."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pin_cpu_threads(threads: int) -> int:
    """The thread count for a CPU comparison: `threads`, or all cores for 0; call it before jax
    is imported. A nonzero `threads` sets XLA_FLAGS as bench_forward and bench_moe always have:
    `--xla_cpu_multi_thread_eigen=false` for 1 makes XLA:CPU single-threaded, as
    torch.set_num_threads(1) does torch. For 2 or more, XLA takes every core whatever the flags
    say: the `intra_op_parallelism_threads=N` word is not an XLA flag (no leading --) and XLA
    ignores it; it is kept so the scripts measure what their published figures measured."""
    n = threads or os.cpu_count() or 1
    # OpenBLAS (the LAPACK XLA:CPU calls for triangular solves) keeps a pool of its own, which
    # torch's set_num_threads does not reach: held to the same count, before numpy loads it.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(n))
    if threads:
        add_xla_flags(eigen_flag(n), f"intra_op_parallelism_threads={n}")
    return n


def eigen_flag(threads: int) -> str:
    """XLA:CPU's `--xla_cpu_multi_thread_eigen` for `threads`: false (single-threaded) for 1,
    true for more."""
    return f"--xla_cpu_multi_thread_eigen={'true' if threads > 1 else 'false'}"


def host_devices_flag(n: int) -> str:
    """The XLA flag that makes XLA:CPU show `n` devices (a mesh of host devices on one CPU)."""
    return f"--xla_force_host_platform_device_count={n}"


def add_xla_flags(*flags: str) -> None:
    """Appends `flags` to $XLA_FLAGS, after whatever it holds; call it before jax is imported."""
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + "".join(f" {f}" for f in flags)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """(`fn()`'s result, the wall seconds the call took): one timed call, a compile included if
    it is the first."""
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


async def timed_await(aw: Awaitable[Any]) -> tuple[Any, float]:
    """(what `aw` gives, the wall seconds from here until it does): `timed` for a coroutine."""
    t0 = time.perf_counter()
    out = await aw
    return out, time.perf_counter() - t0


def timed_calls(fn: Callable[[], Any], n: int) -> tuple[list[float], Any]:
    """(the wall seconds of each of `n` calls of `fn`, the last call's result); the caller warms
    `fn` up first. A call's result is dropped before the next call starts, as a bare loop drops
    it (a large output is not held through the next call's allocation)."""
    times, out = [], None
    for _ in range(n):
        out = None
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return times, out


def median_s(fn: Callable[[], Any], n: int) -> float:
    """Median wall seconds of `n` calls of `fn` (the caller warms it up first)."""
    return statistics.median(timed_calls(fn, n)[0])


def round_times(
    fns: dict[Hashable, Callable[[], Any]],
    rounds: int,
    *,
    after_round: Callable[[dict[Hashable, list[float]]], Any] | None = None,
    clock: Callable[[], float] | None = None,
) -> tuple[dict[Hashable, list[float]], dict[Hashable, Any]]:
    """Every fn's seconds in each of `rounds` rounds, and each fn's last result; every round runs
    each fn once, in the dict's order, so load from other jobs on a shared machine hits all of
    them alike (a fn's result is dropped before its next call). `after_round(times so far)` runs
    after each round (a progress line); `clock` is time.perf_counter (wall seconds) unless given
    (time.process_time: this process's CPU)."""
    clock = clock or time.perf_counter
    times: dict[Hashable, list[float]] = {k: [] for k in fns}
    last: dict[Hashable, Any] = {}
    for _ in range(rounds):
        for k, fn in fns.items():
            last.pop(k, None)
            t0 = clock()
            last[k] = fn()
            times[k].append(clock() - t0)
        if after_round is not None:
            after_round(times)
    return times, last


def timed_rounds(
    fns: dict[Hashable, Callable[[], Any]],
    rounds: int,
    *,
    clock: Callable[[], float] | None = None,
) -> dict[Hashable, float]:
    """Median seconds of each fn over `rounds` rounds of `round_times` (each round runs each fn
    once, in the dict's order, so load from other jobs on a shared machine hits all alike)."""
    times, _ = round_times(fns, rounds, clock=clock)
    return {k: statistics.median(v) for k, v in times.items()}


def median_ratio(nums: Iterable[float], dens: Iterable[float]) -> float:
    """The median of the per-round ratios nums[i] / dens[i] of two sides measured in alternating
    rounds: a load that drifts from round to round moves it less than a ratio of medians."""
    return statistics.median(a / b for a, b in zip(nums, dens, strict=True))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on at the moment of asking."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def uvicorn_thread(app: Any, what: str = "the server") -> Iterator[int]:
    """Serves the ASGI `app` with uvicorn on a free loopback port in a daemon thread; yields the
    port once the server has started (SystemExit, naming `what`, if it dies first) and stops it
    on exit."""
    import threading

    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise SystemExit(f"{what} did not start on port {port}")
        time.sleep(0.05)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(30)


def compile_and_time(learner: Any, batch: Any, steps: int) -> tuple[int, float, float, dict]:
    """Compiles `learner`'s train step for `batch` ahead of time and reads XLA's scratch bytes,
    then runs the step `steps + 1` times. Returns (scratch bytes, compile seconds, median
    seconds of the `steps` calls after the first, the last call's metrics)."""
    compiled, compile_s = timed(lambda: learner.lower_step(batch).compile())
    temp = compiled.memory_analysis().temp_size_in_bytes
    del compiled
    times, metrics = timed_calls(lambda: learner.train_step(batch), steps + 1)
    return temp, compile_s, statistics.median(times[1:]), metrics
