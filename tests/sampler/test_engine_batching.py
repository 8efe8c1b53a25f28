"""Continuous batching, preemption and prefix sharing give exactly what each request gets alone."""

import asyncio

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from cua_jax.sampler import Engine, SamplingParams  # noqa: E402
from tests.models.hf_tiny import image_inputs, prompt_ids  # noqa: E402

FAM = "qwen2_5_vl"


@pytest.fixture(scope="module")
def model(hf_model_qwen25):
    return hf_model_qwen25


def _requests(n=64):
    rng = np.random.default_rng(0)
    reqs = []
    for i in range(n):
        p = prompt_ids(None, [int(rng.integers(3, 40))], seed=100 + i)
        new = int(rng.integers(1, 17))
        if i % 3 == 0:  # a third sampled, with per-request seeds and truncation
            params = SamplingParams(
                temperature=0.8, top_k=50 * (i % 2), top_p=0.9, seed=i, max_new_tokens=new
            )
        else:
            params = SamplingParams(temperature=0.0, max_new_tokens=new)
        reqs.append(dict(prompt_ids=p, params=params))
    return reqs


async def _concurrent(engine, reqs):
    return await asyncio.gather(*(engine.generate(**r) for r in reqs))


def _assert_same(outs, alone):
    for o, a in zip(outs, alone, strict=True):
        assert o.finish_reason == a.finish_reason == "length"
        assert o.tokens == a.tokens
        np.testing.assert_allclose(o.logprobs, a.logprobs, atol=1e-5)


@pytest.fixture(scope="module")
def alone(model):
    engine = Engine(model, max_slots=16, page_size=4, num_pages=256, max_seq_len=64, decode_chunk=4)
    reqs = _requests()
    return engine, reqs, [engine.generate_batch([r])[0] for r in reqs]


def test_64_concurrent_requests_equal_each_alone(alone):
    engine, reqs, solo = alone
    outs = asyncio.run(_concurrent(engine, reqs))
    _assert_same(outs, solo)
    assert [len(o.tokens) for o in outs] == [r["params"].max_new_tokens for r in reqs]
    engine.check_pages()
    assert engine.alloc.num_free == engine.num_pages - 1


def test_too_few_pages_preempts_and_still_completes(model, alone):
    _, reqs, solo = alone
    # 19 usable pages of 4 tokens for 16 slots; the longest request alone needs 14 pages.
    engine = Engine(model, max_slots=16, page_size=4, num_pages=20, max_seq_len=64, decode_chunk=4)
    outs = asyncio.run(_concurrent(engine, reqs))
    _assert_same(outs, solo)
    assert engine.stats["preemptions"] > 0
    assert sum(o.num_preemptions for o in outs) == engine.stats["preemptions"]
    engine.check_pages()
    assert engine.alloc.num_free == engine.num_pages - 1


def test_pool_must_hold_one_max_length_sequence(model):
    """Refused at construction (as vLLM refuses a max_model_len its cache cannot hold): else a
    request within max_seq_len could fail half-way through its output."""
    with pytest.raises(ValueError, match=r"max_seq_len=64 tokens needs 16 KV pages.*>= 17"):
        Engine(model, max_slots=2, page_size=4, num_pages=16, max_seq_len=64)
    Engine(model, max_slots=2, page_size=4, num_pages=17, max_seq_len=64)


def test_group_prefix_is_prefilled_once(model):
    """8 rollouts of one GRPO group: the shared prompt (with a screenshot) is prefilled once."""
    pv, grid = image_inputs(FAM, [(56, 84)], seed=1)
    p = prompt_ids(grid, [6, 5], seed=2)
    assert len(p) % 4 != 0  # the last prompt page is partial: copy-on-write is exercised
    group = [
        dict(
            prompt_ids=p,
            pixel_values=pv,
            image_grid_thw=grid,
            params=SamplingParams(temperature=1.0, seed=s, max_new_tokens=6),
        )
        for s in range(8)
    ]
    engine = Engine(model, max_slots=8, page_size=4, num_pages=64, max_seq_len=64, decode_chunk=4)
    outs = asyncio.run(_concurrent(engine, group))
    assert sorted(o.num_cached_tokens for o in outs) == [0] + [len(p) - 1] * 7
    assert engine.stats["prefill_tokens"] == len(p) + 7
    assert engine.stats["page_copies"] >= 7
    solo = [engine.generate_batch([r])[0] for r in group]
    assert all(o.num_cached_tokens == 0 for o in solo)
    _assert_same(outs, solo)
    assert len({tuple(o.tokens) for o in outs}) > 1  # different seeds, different rollouts
    engine.check_pages()


def test_decode_through_pallas_kernel_interpret(model, alone):
    """The engine's decode loop with the Pallas kernel (interpret mode, a non-default tuning
    given as the config's string form) == the jnp reference."""
    _, reqs, solo = alone
    picked = [1, 2]  # greedy requests
    assert all(reqs[i]["params"].greedy for i in picked)
    engine = Engine(
        model,
        max_slots=2,
        page_size=4,
        num_pages=32,
        max_seq_len=64,
        decode_chunk=4,
        attn_backend="interpret",
        attn_options="pages_per_block=3",
    )
    assert engine.attn_options.pages_per_block == 3
    outs = engine.generate_batch([reqs[i] for i in picked])
    _assert_same(outs, [solo[i] for i in picked])


def test_decode_gathering_pages_in_every_step_equals_contiguous_buffers(model, alone, monkeypatch):
    """On CPU the decode loop gathers pages into contiguous buffers once per chunk; above a size
    limit it gathers them in every step (the paged path the kernels use). Same outputs."""
    from cua_jax.sampler import engine as engine_mod

    _, reqs, solo = alone
    monkeypatch.setattr(engine_mod, "_MAX_GATHERED_BYTES", 0)
    engine = Engine(model, max_slots=4, page_size=4, num_pages=64, max_seq_len=64, decode_chunk=4)
    picked = [0, 1, 5, 7]
    outs = engine.generate_batch([reqs[i] for i in picked])
    _assert_same(outs, [solo[i] for i in picked])


def test_kv_heads_sharded_over_tensor_axis(model, alone):
    """On a 2-device `tensor` mesh (KV pages split by kv-head) outputs equal the 1-device run."""
    import jax
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    _, reqs, solo = alone
    mesh = Mesh(np.asarray(jax.devices()[:2]), ("tensor",))
    graphdef, state = nnx.split(model)
    replicated = nnx.merge(graphdef, jax.device_put(state, NamedSharding(mesh, PartitionSpec())))
    kv_sh = NamedSharding(mesh, PartitionSpec("tensor"))
    engine = Engine(
        replicated,
        max_slots=2,
        page_size=4,
        num_pages=32,
        max_seq_len=64,
        decode_chunk=4,
        kv_sharding=kv_sh,
    )
    picked = [4, 5]
    assert all(reqs[i]["params"].greedy for i in picked)
    outs = engine.generate_batch([reqs[i] for i in picked])
    _assert_same(outs, [solo[i] for i in picked])
    assert all(k.sharding == kv_sh for k in engine.cache.k)


def test_failed_step_ends_requests_in_flight_with_error_and_engine_recovers(model, alone):
    """An exception inside a decode call (e.g. the weights were deleted under it) must not leave
    awaiting callers hanging: they get finish_reason "error", and the next requests run normally."""
    _, reqs, solo = alone
    engine = Engine(model, max_slots=16, page_size=4, num_pages=256, max_seq_len=64, decode_chunk=4)
    real, calls = engine._decode_fn, []

    def flaky(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected device failure")
        return real(*args)

    engine._decode_fn = flaky
    outs = asyncio.run(_concurrent(engine, reqs[:16]))
    errors = [o for o in outs if o.finish_reason == "error"]
    assert errors, "the injected failure reached no request"
    assert all("injected device failure" in o.error for o in errors)
    for o, a in zip(outs, solo[:16], strict=True):
        if o.finish_reason != "error":  # finished before the failure: untouched
            assert o.tokens == a.tokens
    engine._decode_fn = real
    _assert_same(asyncio.run(_concurrent(engine, reqs[:16])), solo[:16])
    engine.check_pages()


def test_prefill_of_requests_admitted_together_is_batched(model, alone):
    """16 requests admitted in one round share a few prefill calls (one per length bucket, padded
    to a batch bucket) and give exactly what each gets alone (prefilled one by one)."""
    _, reqs, solo = alone
    engine = Engine(model, max_slots=16, page_size=4, num_pages=256, max_seq_len=64, decode_chunk=4)
    outs = engine.generate_batch(reqs[:16])
    _assert_same(outs, solo[:16])
    lengths = [len(r["prompt_ids"]) for r in reqs[:16]]
    buckets = {max(16, 1 << (n - 1).bit_length()) for n in lengths}
    assert engine.stats["prefill_calls"] == len(buckets) < 16
    assert engine.stats["prefill_tokens"] == sum(lengths)
    engine.check_pages()


def test_attention_over_a_pages_bucket_equals_the_full_table(model, alone, monkeypatch):
    """Decode and prefill read only a power-of-two bucket of page-table columns (here 1..16 pages
    of 4 tokens, growing as sequences grow, in a table of 256 columns): same outputs as the
    full-table runs of `alone` (max_seq_len=64: one bucket = the whole 16-column table)."""
    from cua_jax.sampler import scheduler

    _, reqs, solo = alone
    monkeypatch.setattr(scheduler, "MIN_ATTN_TOKENS", 4)
    engine = Engine(
        model, max_slots=8, page_size=4, num_pages=257, max_seq_len=1024, decode_chunk=4
    )
    assert engine.pages_per_seq == 256
    assert [engine._pages_bucket(n) for n in (1, 4, 5, 9, 33, 1024)] == [1, 1, 2, 4, 16, 256]
    seen = []
    real = engine._decode_fn
    engine._decode_fn = lambda *a: seen.append(a[2].shape[1]) or real(*a)
    for picked in ([16, 38, 4], [4, 10, 16, 12, 5, 9, 38, 26]):  # short ones alone, then mixed
        outs = engine.generate_batch([reqs[i] for i in picked])
        _assert_same(outs, [solo[i] for i in picked])
    assert set(seen) == {4, 8, 16}  # the bucket grew with the sequences, never the whole table
    engine.check_pages()
