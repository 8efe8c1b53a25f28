"""Compile once, sampler side (#23): a multi-turn workload with varied prompt lengths and
screenshots calls the engine's programs only at shapes of its bucket set, and after the
warm-up (`cua_jax.job.warmup`) compiles nothing."""

from __future__ import annotations

import asyncio
import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from cua_jax.job import compile_stats, warmup
from cua_jax.models import qwen_vl
from cua_jax.sampler import Engine, SamplingParams
from cua_jax.sampler.scheduler import BucketSet, batch_bucket, pages_bucket, token_bucket
from cua_jax.sharding import make_mesh

_T = qwen_vl.tiny("qwen2_5_vl", vocab_size=256)
CFG = _T.replace(
    text=dataclasses.replace(_T.text, num_hidden_layers=1),
    vision=dataclasses.replace(_T.vision, depth=2),
)
SCREEN = (1, 4, 4)  # 16 patches, 4 merged tokens
PATCH_DIM = 3 * 2 * 14 * 14
PROGRAMS = ("prefill", "decode_paged", "decode_contiguous", "sample_first", "copy_pages")


def test_bucket_rules():
    """The scheduler's bucket rules (the engine's calls use the same functions)."""
    assert [token_bucket(n) for n in (1, 16, 17, 1000)] == [16, 16, 32, 1024]
    assert [token_bucket(n, 4) for n in (1, 5)] == [4, 8]
    assert [batch_bucket(n) for n in (1, 2, 4, 5, 17)] == [1, 4, 4, 16, 64]
    b = BucketSet.of(max_slots=16, max_seq_len=1024, page_size=16)
    assert b.prefill_rows == (1, 4, 16)
    assert b.prefill_tokens == (16, 32, 64, 128, 256, 512, 1024)
    assert b.table_cols == (8, 16, 32, 64)
    assert b.copies == (4, 8, 16)
    assert pages_bucket(1, 16, 64) == 8 and pages_bucket(129, 16, 64) == 16


def _recording(engine):
    """Wraps the engine's jitted programs to record the shape of every call."""
    seen: dict[str, set] = {k: set() for k in ("prefill", "decode", "copy", "first")}
    fns = engine._fns

    def prefill_for(grid):
        f = fns.prefill(grid)

        def call(state, cache, ids, pix, pos, table, start, n, dst, src):
            seen["prefill"].add((grid, ids.shape[0], ids.shape[1], table.shape[1]))
            return f(state, cache, ids, pix, pos, table, start, n, dst, src)

        return call

    def decode(f):
        def call(state, cache, table, *rest):
            seen["decode"].add(table.shape[1])
            return f(state, cache, table, *rest)

        return call

    def copy(cache, src, dst):
        seen["copy"].add(len(src))
        return fns.copy_pages(cache, src, dst)

    def first(logits, idx, sampling, step):
        seen["first"].add((logits.shape[0], idx.shape[0]))
        return fns.sample_first(logits, idx, sampling, step)

    engine._fns = dataclasses.replace(
        fns,
        prefill=prefill_for,
        decode_paged=decode(fns.decode_paged),
        decode_contiguous=decode(fns.decode_contiguous),
        copy_pages=copy,
        sample_first=first,
    )
    return seen


def _episode_turn(rng, history, with_image):
    text = list(rng.integers(3, 200, int(rng.integers(2, 26))))
    if not with_image:
        return history + text, None
    img = [CFG.vision_start_token_id] + [CFG.image_token_id] * 4 + [CFG.vision_end_token_id]
    return history + text + img, rng.normal(size=(16, PATCH_DIM)).astype(np.float32)


async def _workload(engine, seed, episodes=6, turns=3):
    """Episodes of `turns` turns each (one session per episode): every turn appends text of a
    random length and, on even turns, a screenshot; greedy or sampled, varied budgets."""
    rng = np.random.default_rng(seed)

    async def episode(e):
        ids, pixels = [], []
        for t in range(turns):
            ids, pv = _episode_turn(rng, ids, with_image=(e + t) % 2 == 0)
            if pv is not None:
                pixels.append(pv)
            params = SamplingParams(
                temperature=0.0 if e % 2 else 0.9, seed=e, max_new_tokens=int(rng.integers(1, 9))
            )
            out = await engine.generate(
                np.asarray(ids, np.int32),
                np.concatenate(pixels) if pixels else None,
                np.asarray([SCREEN] * len(pixels)) if pixels else None,
                params=params,
                session_id=f"ep{seed}-{e}",
            )
            ids = ids + list(out.tokens)

    await asyncio.gather(*(episode(e) for e in range(episodes)))


@pytest.fixture(scope="module", params=["device", "mesh"])
def engine(request):
    """One engine on a device, one on a (1-device) mesh as the main job builds it: a prefill's
    logits then carry the mesh, which the warm-up's first-token programs must match."""
    model = qwen_vl.QwenVL(CFG, rngs=nnx.Rngs(0))
    mesh = make_mesh(devices=jax.devices()[:1]) if request.param == "mesh" else None
    return Engine(
        model, max_slots=4, page_size=8, num_pages=160, max_seq_len=128, decode_chunk=4, mesh=mesh
    )


def test_multi_turn_workload_compiles_only_the_warmed_bucket_set(engine):
    stats = compile_stats.install()
    buckets = warmup.sampler_buckets(engine)
    programs = warmup.sampler_programs(engine, SCREEN, max_images=1)
    mark = stats.snapshot()
    warmup.compile_all(programs)
    warmed = stats.since(mark)
    # every program of the set compiled now, or earlier in this process (the step functions are
    # module-level jits: another test's engine with the same tiny model fills the same cache)
    assert 0 < sum(warmed.per_program.get(p, 0) for p in PROGRAMS) <= len(programs)

    seen = _recording(engine)
    stats.expect_no_compiles(PROGRAMS, strict=True)
    try:
        mark = stats.snapshot()
        for seed in (1, 2):
            asyncio.run(_workload(engine, seed))
        after = stats.since(mark)
        stats.check()  # no unplanned compile of a sampler program
    finally:
        stats.reset_expectations()
    assert {p: after.per_program.get(p, 0) for p in PROGRAMS} == dict.fromkeys(PROGRAMS, 0)

    # the calls were the bucket set's shapes, and the workload was varied
    text = {(b, t, p) for g, b, t, p in seen["prefill"] if g == ()}
    assert text <= set(buckets.prefill_shapes())
    images = {(g, b, t, p) for g, b, t, p in seen["prefill"] if g != ()}
    assert images and all(b == 1 and set(g) == {SCREEN} for g, b, _, _ in images)
    assert seen["decode"] <= set(buckets.table_cols)
    assert seen["copy"] <= set(buckets.copies)
    firsts = {(x, n) for x in buckets.prefill_rows for n in buckets.prefill_rows if n <= x}
    assert seen["first"] and seen["first"] <= firsts
    assert len(seen["prefill"]) >= 4 and engine.stats["cached_tokens"] > 0
