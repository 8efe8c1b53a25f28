"""What the benchmark scripts (tools/bench_*.py) share: the platform and thread set-up, the timing
protocols, and the side-by-side transformers / cua_jax forward.

    from tools import bench_setup

    bench_setup.cpu_unless_set()       # before the script first imports jax
    import jax                         # noqa: E402

Only timing and set-up live here; what each script measures stays in the script. Nothing in this
module imports jax at import time, so a script can still choose the platform and XLA's flags
first.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Hashable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


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
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_cpu_multi_thread_eigen={'true' if n > 1 else 'false'}"
            + f" intra_op_parallelism_threads={n}"
        )
    return n


def median_s(fn: Callable[[], Any], n: int) -> float:
    """Median wall seconds of `n` calls of `fn` (the caller warms it up first)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timed_rounds(fns: dict[Hashable, Callable[[], Any]], rounds: int) -> dict[Hashable, float]:
    """Median seconds of each fn over `rounds` rounds; every round runs each fn once, in the
    dict's order, so load from other jobs on a shared machine hits all of them alike."""
    times: dict[Hashable, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


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


def forward_pair(hf: Any, model: Any, ids: Any, pixel_values: Any, grid: Any, image_id: int):
    """The same image + text forward through a transformers model `hf` and its cua_jax twin
    `model`: the host computes positions and the vision layout, the device runs one jitted
    forward. Compiles and runs the jitted forward once.

    Returns (hf_call, jax_call, first_s, jax_logits): two no-argument callables (jax_call blocks
    until its result is ready; call hf_call under torch.no_grad()), the first jitted call's
    seconds (compile included) and its logits.
    """
    import jax
    import torch
    from flax import nnx

    from cua_jax.models import qwen_vl

    t_ids = torch.as_tensor(ids)
    kw = dict(
        input_ids=t_ids,
        pixel_values=torch.as_tensor(pixel_values),
        image_grid_thw=torch.as_tensor(grid),
        mm_token_type_ids=(t_ids == image_id).int(),
    )
    pos = model.position_ids_for(ids, None, grid)
    meta = qwen_vl.vision_metadata(model.config, grid)
    fwd = nnx.jit(
        lambda m, ids, pv, pos, meta: m(ids, pixel_values=pv, position_ids=pos, vision_meta=meta)
    )
    t0 = time.perf_counter()
    out = jax.block_until_ready(fwd(model, ids, pixel_values, pos, meta))
    first_s = time.perf_counter() - t0

    def jax_call() -> Any:
        return jax.block_until_ready(fwd(model, ids, pixel_values, pos, meta))

    return (lambda: hf(**kw)), jax_call, first_s, out
