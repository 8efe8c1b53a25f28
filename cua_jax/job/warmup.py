"""Warm-up: compile a run's programs ahead, before the first step, for the shape set the
config decides: the learner's RL / SFT steps (`cua_jax.rl.shapes`) and the sampler's bucket set
(`cua_jax.sampler.scheduler.BucketSet`: prefill rows x tokens x table columns, image prefills
of 1..max_history_images screens, the decode chunk per table width, page copies, first-token
sampling). Each program is `jax.jit(...).lower(...).compile()`d from abstract arguments; the
later call with real arrays of the same shape finds it compiled (JAX's compile cache), and on a
rerun the persistent compilation cache (`compile_cache_dir`) serves it.

    report = warmup.warm_up(learner, engine, modes=("rl",), screens=shapes.grid, images=2)

`train.py` runs it in a thread while the environments start, the step-0 eval runs and (with
`rl.warmup='learner'`) the first step's rollouts are sampled (`begin` ... `Warmup.wait`, just
before the first update); after it, a compile of a warmed program is unplanned
(`compile_stats`: logged and counted, an error with `rl.strict_shapes`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging

from cua_jax.job import compile_stats
from cua_jax.rl import sdpo
from cua_jax.rl.shapes import ShapeSet
from cua_jax.sampler import engine as engine_mod
from cua_jax.sampler import steps
from cua_jax.sampler.sampling import SlotSampling
from cua_jax.sampler.scheduler import BucketSet


def sampler_buckets(engine: Any) -> BucketSet:
    return BucketSet.of(engine.max_slots, engine.max_seq_len, engine.page_size)


def _contiguous_decode(engine: Any, table_cols: int) -> bool:
    """Which decode program the engine runs at this table width (as `Engine._decode_fn`)."""
    return (
        engine._attn == "reference"
        and steps.contiguous_bytes(engine.cache, engine.max_slots, table_cols)
        <= engine_mod._MAX_GATHERED_BYTES
    )


def sampler_programs(
    engine: Any, screen: tuple[int, int, int] | None = None, max_images: int = 0
) -> list[tuple[str, Any, tuple]]:
    """(name, jitted fn, abstract args after none) of every program of the engine's bucket
    set. Text prefills skip widths too narrow for their token bucket (a call of T tokens holds
    more than T/2, so it reads at least that many tokens' pages). With `screen` (a screenshot's
    patch grid), image prefills of 1..`max_images` such screens (one row)."""
    b = sampler_buckets(engine)
    fns, state, cache = engine._fns, engine._state, engine.cache
    page = engine.page_size
    out: list[tuple[str, Any, tuple]] = []

    def wide_enough(t: int, p: int) -> bool:
        return p * page >= min(t // 2 + 1, engine.max_seq_len)

    for rows, t, p in b.prefill_shapes():
        if wide_enough(t, p):
            args = (state, cache, *steps.prefill_arg_shapes(rows, t, p))
            out.append((f"prefill {rows}x{t} cols {p}", fns.prefill(()), args))
    if screen is not None and max_images > 0:
        cfg = engine.config
        v = cfg.vision
        unit = screen[0] * screen[1] * screen[2]
        dim = cfg.pixel_width
        tokens = unit // v.spatial_merge_size**2
        for k in range(1, max_images + 1):
            for t in b.prefill_tokens:
                if t < k * (tokens + 2):
                    continue
                for p in b.table_cols:
                    if wide_enough(t, p):
                        args = (
                            state,
                            cache,
                            *steps.prefill_arg_shapes(1, t, p, (k * unit, dim), cfg.pixel_dtype),
                        )
                        out.append(
                            (
                                f"prefill {k} screens 1x{t} cols {p}",
                                fns.prefill((screen,) * k),
                                args,
                            )
                        )
    S = engine.max_slots
    for p in b.table_cols:
        fn = fns.decode_contiguous if _contiguous_decode(engine, p) else fns.decode_paged
        args = (state, cache, *steps.decode_arg_shapes(S, p, engine.abstract_grammar()))
        out.append((f"decode cols {p}", fn, args))
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    for n in b.copies:
        out.append((f"copy {n}", fns.copy_pages, (cache, sds((n,), i32), sds((n,), i32))))
    return out + _first_token_programs(engine, b)


def _first_token_programs(engine: Any, b: BucketSet) -> list[tuple[str, Any, tuple]]:
    """First tokens: one sampling call per prefill call, on its logits (X = its rows, n <= X
    sampled, both prefill row buckets)."""
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    V = engine.config.text.vocab_size
    pairs = {(x, n) for x in b.prefill_rows for n in b.prefill_rows if n <= x}
    out = []
    for x, n in sorted(pairs):
        samp = SlotSampling.abstract(n, engine.abstract_grammar())
        # the logits are a prefill's output, on the engine's devices: a committed array's
        # sharding (its mesh) is part of jit's cache key, host arrays' is not
        logits = sds((x, V), jnp.float32, sharding=engine.shardings.small)
        args = (logits, sds((n,), i32), samp, sds((n,), i32))
        out.append((f"sample_first {x}->{n}", engine._fns.sample_first, args))
    return out


def compile_all(
    programs: Sequence[tuple[str, Any, tuple]], stop: threading.Event | None = None
) -> dict[str, float]:
    """Lowers and compiles each program; {name: seconds}. A set `stop` ends it before the next."""
    times = {}
    for name, fn, args in programs:
        if stop is not None and stop.is_set():
            break
        t0 = time.perf_counter()
        fn.lower(*args).compile()
        times[name] = time.perf_counter() - t0
    return times


def warm_up(
    learner: Any,
    engine: Any | None,
    *,
    modes: Sequence[str] = ("rl",),
    screen: tuple[int, int, int] | None = None,
    max_images: int = 0,
    stop: threading.Event | None = None,
) -> dict[str, float]:
    """Compiles the learner's steps for its shape set in `modes` (`Learner.warmup`) and, with
    an `engine`, the sampler's bucket set; returns {program: seconds}. A set `stop` ends it
    before the next program."""
    t0 = time.perf_counter()
    times: dict[str, float] = {}
    for mode in modes:
        times.update(learner.warmup(mode, stop))
    if engine is not None:
        times.update(compile_all(sampler_programs(engine, screen, max_images), stop))
    logging.info("warm-up: %d programs compiled in %.1f s", len(times), time.perf_counter() - t0)
    return times


SAMPLER_PROGRAMS = ("prefill", "decode_paged", "decode_contiguous", "sample_first", "copy_pages")
WARMUP_CHOICES = ("none", "learner", "all")


class Warmup:
    """A warm-up compiling in a background thread (`begin`); `wait` joins it, `cancel` (a run
    that failed before it needed the programs) stops it at the next program. `fn` takes the
    stop event."""

    def __init__(self, fn, watched: tuple[str, ...], strict: bool, *, overlap: bool) -> None:
        self._stop = threading.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="warmup")
        self._future = self._pool.submit(fn, self._stop)
        self.watched, self.strict = watched, strict
        self._times: dict[str, float] | None = None  # set by the first `wait`
        # the first step's rollouts may run before `wait` (only the learner is compiling: a
        # sampler program compiled by both threads would be compiled twice)
        self.overlap = overlap

    def cancel(self) -> None:
        """Stops the warm-up before its next program (the one compiling finishes; XLA cannot
        interrupt it) and does not wait for it."""
        self._stop.set()
        self._pool.shutdown(wait=False)

    def wait(self, stats: compile_stats.CompileStats | None = None) -> dict[str, float]:
        """Waits for the compiles (re-raising their error); from then on a compile of a warmed
        program is unplanned in `stats`. A later call returns the same times and leaves
        `stats` as it is (the unplanned compiles it has counted since are kept)."""
        if self._times is None:
            try:
                self._times = self._future.result()
            finally:
                self._pool.shutdown(wait=False)
            if stats is not None and self.watched:
                stats.expect_no_compiles(self.watched, strict=self.strict)
        return self._times


@dataclasses.dataclass(frozen=True)
class WarmupSettings:
    """What `begin` compiles (`cua_jax.job.builders.warmup_settings` reads them from the
    config): `mode` one of `WARMUP_CHOICES` (rl.warmup), the SFT step beside the RL step
    (`entropulse`: rl.entropulse_every > 0), a later compile of a warmed program an error
    (`strict`: rl.strict_shapes), image prefills of up to `max_images` screens
    (env.max_history_images)."""

    mode: str
    entropulse: bool
    strict: bool
    max_images: int

    def __post_init__(self) -> None:
        if self.mode not in WARMUP_CHOICES:
            raise ValueError(f"config.rl.warmup={self.mode!r} is not one of {WARMUP_CHOICES}")


def begin(
    settings: WarmupSettings,
    learner: Any,
    engine: Any | None,
    shapes: ShapeSet,
    *,
    sft_phase: bool,
    distiller: Any = None,
) -> Warmup:
    """Gives `learner` its shape set `shapes` (`cua_jax.job.builders.learner_shapes`), logs
    it, and starts the warm-up `settings.mode` asks for in a thread: the learner's SFT step
    (`sft_phase`: the SFT warm-up's learner) or its RL step (and SFT step with Entropulse;
    with SDPO's `distiller`, its SDPO step and teacher pass instead of the RL step), and with
    "all" the sampler's bucket set. Multi-process jobs use the same global shapes (rows
    rounded to a multiple of the process count), each process packing its 1/n share of a
    shape's rows (`BatchPacker.agreed_shape`), compiled before returning rather than in a
    thread."""
    n = jax.process_count()
    learner.shapes = shapes
    logging.info("%s", learner.shapes.describe())
    if engine is not None:
        logging.info("%s", sampler_buckets(engine))
    if settings.mode == "none":
        return Warmup(lambda stop: {}, (), False, overlap=True)
    modes = ("sft",) if sft_phase else ("rl", "sft") if settings.entropulse else ("rl",)
    sdpo_warm = distiller is not None and not sft_phase
    if sdpo_warm:  # every update is an SDPO step: the plain RL step never runs
        modes = tuple(m for m in modes if m != "rl")
    sampler = engine if settings.mode == "all" else None
    names = dict.fromkeys(name for m in modes for name in learner.program_names(m))
    watched = tuple(names) + (SAMPLER_PROGRAMS if sampler else ())
    if sdpo_warm:
        watched += (*learner.program_names(distiller.step_mode), sdpo.TEACHER_PROGRAM)
    screens = settings.max_images

    def run(stop: threading.Event | None = None) -> dict[str, float]:
        times = warm_up(
            learner, sampler, modes=modes, screen=learner.shapes.grid, max_images=screens, stop=stop
        )
        if sdpo_warm and not (stop is not None and stop.is_set()):
            times.update(distiller.warmup(learner, stop))
        return times

    strict = settings.strict
    if n > 1:
        # Multi-process: placing the blank batches' images on the job's replicated sharding is
        # a collective, which must not interleave with the main thread's (gloo would pair the
        # wrong messages): compile here, in program order on every process.
        done = run()
        return Warmup(lambda stop: done, watched, strict, overlap=True)

    return Warmup(run, watched, strict, overlap=sampler is None)
