"""One measurement protocol for the learner benchmarks (bench_learner_memory, bench_smoke_step)."""

from __future__ import annotations

import statistics
import time
from typing import Any


def compile_and_time(learner: Any, batch: Any, steps: int) -> tuple[int, float, float, dict]:
    """Compiles `learner`'s train step for `batch` ahead of time and reads XLA's scratch bytes,
    then runs the step `steps + 1` times. Returns (scratch bytes, compile seconds, median
    seconds of the `steps` calls after the first, the last call's metrics)."""
    t0 = time.perf_counter()
    compiled = learner.lower_step(batch).compile()
    compile_s = time.perf_counter() - t0
    temp = compiled.memory_analysis().temp_size_in_bytes
    del compiled
    times, metrics = [], {}
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        metrics = learner.train_step(batch)
        times.append(time.perf_counter() - t0)
    return temp, compile_s, statistics.median(times[1:]), metrics
