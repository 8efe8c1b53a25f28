"""The sampler's hybrid cache on tiny random Qwen3.5 models (dense and MoE) built by
transformers: paged K/V for the full-attention layers, per-slot Gated DeltaNet states.

* greedy decoding through `Engine` is token-identical to transformers' `generate` (its own
  hybrid cache), text only and with an image;
* the sampler's log-probs equal the learner's (our model's forward over the whole sequence) to
  1e-5 in f32;
* continuous batching: requests of different lengths, more of them than slots, give each the
  tokens it gets alone (slots are reused, so a stale state would show);
* a session's next turn continues the stored state (only the new tokens prefilled) and equals
  a fresh run over the whole transcript; a next turn that rewrites history is prefilled from 0;
* preemption recomputes from scratch; `update_params` between chunks keeps the states;
* `lengths` (right-padded rows) leave the linear states where the last real token left them.

The MoE model runs the generate and log-prob checks (its routed MLP is per token, the cache
paths are the dense model's) when CUA_LONG_TESTS=1 (~45 s of CPU more at load 10; BENCHMARKS
lists the run); the rest run on the dense model.
"""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec  # noqa: E402

from cua_jax.models import qwen_vl  # noqa: E402
from cua_jax.sampler.engine import Engine  # noqa: E402
from cua_jax.sampler.sampling import SamplingParams  # noqa: E402
from tests.models.hf_tiny import image_inputs, prompt_ids  # noqa: E402
from tests.models.test_qwen35 import make_hf, run  # noqa: E402
from tests.sampler.test_engine_parity import hf_greedy  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)
# 16 usable pages of 8 tokens: one 128-token sequence fits, two long ones preempt
ENGINE_KW = dict(max_slots=2, page_size=8, num_pages=17, max_seq_len=128, decode_chunk=4)


LONG = os.environ.get("CUA_LONG_TESTS") == "1"


@pytest.fixture(scope="module", params=["dense", "moe"])
def setup(request, tmp_path_factory):
    moe = request.param == "moe"
    if moe and not LONG:
        pytest.skip("the MoE repeat of the dense engine checks: set CUA_LONG_TESTS=1")
    hf = make_hf(moe)
    d = tmp_path_factory.mktemp(f"hf_qwen35_engine_{request.param}")
    hf.save_pretrained(str(d))
    model = qwen_vl.from_pretrained(str(d))
    return moe, hf, model, Engine(model, **ENGINE_KW)


FORWARD_LEN = 96  # the learner's forwards are right-padded to one length: one compile


def learner_logprobs(model, seq, n_prompt, pv=None, grid=None) -> np.ndarray:
    """log_softmax of the full-sequence forward at the sampled tokens (what the learner uses;
    right padding changes no earlier position: attention and the linear layers are causal)."""
    ids = np.zeros((1, FORWARD_LEN), np.int64)
    ids[0, : len(seq)] = seq
    logits = run(model, ids, pv=pv, grid=grid)[0]
    lp = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)
    idx = np.arange(n_prompt, len(seq))
    return np.asarray(lp[idx - 1, np.asarray(seq)[idx]])


def test_greedy_matches_generate_and_logprobs_match_learner(setup):
    """Text prompts of three lengths (batched, 2 slots: slots are reused) and one with an
    image: tokens == transformers' generate; log-probs == the learner's forward, 1e-5."""
    moe, hf, model, engine = setup
    pv, grid = image_inputs("qwen3_5", [(60, 90)], seed=7)
    reqs = [dict(prompt_ids=prompt_ids(None, [n], seed=10 + n), params=GREEDY) for n in (5, 19)]
    reqs.append(
        dict(
            prompt_ids=prompt_ids(grid, [4, 3], seed=3),
            pixel_values=pv,
            image_grid_thw=grid,
            params=GREEDY,
        )
    )
    outs = engine.generate_batch(reqs)
    for r, out in zip(reqs, outs, strict=True):
        p, rpv, rgrid = r["prompt_ids"], r.get("pixel_values"), r.get("image_grid_thw")
        assert out.finish_reason == "length"
        assert out.tokens == hf_greedy(hf, p, rpv, rgrid)
        seq = [*p.tolist(), *out.tokens]
        np.testing.assert_allclose(
            out.logprobs, learner_logprobs(model, seq, len(p), rpv, rgrid), atol=1e-5
        )
    if moe:
        assert outs[0].routes is not None and outs[0].routes.shape[0] == 6


def test_continuous_batching_equals_alone(setup):
    """Four sampled requests of different lengths through 2 slots, together and one by one."""
    moe, hf, model, engine = setup
    if moe:
        pytest.skip("the dense model covers the cache paths")
    reqs = [
        dict(
            prompt_ids=prompt_ids(None, [n], seed=40 + n),
            params=SamplingParams(temperature=1.0, seed=n, max_new_tokens=3 + n % 7),
        )
        for n in (3, 17, 9, 30)
    ]
    together = engine.generate_batch(reqs)
    for r, out in zip(reqs, together, strict=True):
        alone = engine.generate_batch([r])[0]
        assert out.tokens == alone.tokens
        np.testing.assert_allclose(out.logprobs, alone.logprobs, atol=1e-6)
        seq = [*r["prompt_ids"].tolist(), *out.tokens]
        np.testing.assert_allclose(
            out.logprobs, learner_logprobs(model, seq, len(r["prompt_ids"])), atol=1e-5
        )
    engine.check_pages()


def test_session_continues_its_state(setup):
    """Turn 2 extends turn 1's transcript: only the new tokens are prefilled, on top of the
    stored state, and it equals transformers over the whole transcript. A turn 3 that rewrites
    the start of the history (no state stored there) is prefilled from token 0."""
    moe, hf, model, engine = setup
    if moe:
        pytest.skip("the dense model covers the cache paths")
    p1 = prompt_ids(None, [11], seed=1)
    out1 = engine.generate_batch([dict(prompt_ids=p1, params=GREEDY, session_id="ep")])[0]
    # another request takes the slot in between: the session's state lives in its own row
    engine.generate_batch([dict(prompt_ids=prompt_ids(None, [7], seed=9), params=GREEDY)])
    seq1 = np.asarray([*p1.tolist(), *out1.tokens])
    p2 = np.concatenate([seq1, prompt_ids(None, [5], seed=2)])
    out2 = engine.generate_batch([dict(prompt_ids=p2, params=GREEDY, session_id="ep")])[0]
    assert out2.num_cached_tokens == len(seq1) - 1  # the state covers the fed tokens
    assert out2.tokens == hf_greedy(hf, p2)
    p3 = np.concatenate([[(p2[0] + 1) % 400], p2[1:], out2.tokens])
    out3 = engine.generate_batch([dict(prompt_ids=p3, params=GREEDY, session_id="ep")])[0]
    assert out3.num_cached_tokens == 0
    assert out3.tokens == hf_greedy(hf, p3)
    engine.drop_session("ep")
    engine.check_pages()
    assert sorted(engine.sched.free_state_rows) == list(range(2, 4))


def test_preemption_recomputes_and_update_params_keeps_states(setup):
    """Two requests that outgrow the page pool together: the newer is preempted and later
    recomputed from scratch; tokens equal each request run alone. New weights (the same
    values) handed over between decode chunks change nothing."""
    moe, hf, model, engine = setup
    if moe:
        pytest.skip("the dense model covers the cache paths")
    before = engine.stats["preemptions"]
    reqs = [
        dict(
            prompt_ids=prompt_ids(None, [n], seed=60 + n),
            params=SamplingParams(temperature=0.0, max_new_tokens=40),
        )
        for n in (30, 35)
    ]
    outs = engine.generate_batch(reqs)
    assert engine.stats["preemptions"] > before
    assert sum(o.num_preemptions for o in outs) == engine.stats["preemptions"] - before
    for r, out in zip(reqs, outs, strict=True):
        assert out.tokens == engine.generate_batch([r])[0].tokens

    r = dict(prompt_ids=prompt_ids(None, [12], seed=5), params=GREEDY)
    want = engine.generate_batch([r])[0].tokens
    got = []
    engine.submit(**r, on_done=got.append)
    engine.step()  # prefill + a first chunk
    engine.update_params(model, version=7)
    while not got:
        engine.step()
    assert got[0].tokens == want
    engine.update_params(model, version=0)


def test_lengths_leave_state_after_last_real_token():
    """Right-padded rows with `lengths` (the sampler's bucketed prefill) end with the linear
    states of the unpadded rows, continued from a non-zero state; a length-0 row keeps it."""
    cfg = qwen_vl.tiny_qwen35()
    model = qwen_vl.init_random(cfg, seed=3)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 400, (3, 12))
    lengths = np.asarray([12, 5, 0], np.int32)
    first = rng.integers(0, 400, (3, 7))
    # history-free attention is enough: only the linear states are compared
    dense = qwen_vl.make_dense_attn_fn()

    @nnx.jit
    def states(model, ids, pos, st, lengths):
        _, out = model.decode(
            model.embed(ids)[0],
            pos,
            dense,
            linear_states=st,
            return_linear_states=True,
            lengths=lengths,
        )
        return out

    pos7 = jnp.broadcast_to(jnp.arange(7)[None, None], (3, 3, 7))
    start = states(model, first, pos7, qwen_vl.initial_linear_states(cfg, 3), None)
    pos = jnp.broadcast_to(7 + jnp.arange(12)[None, None], (3, 3, 12))
    padded = states(model, ids, pos, start, lengths)
    for b, n in enumerate(lengths):
        st = [jax.tree.map(lambda x, b=b: x[b : b + 1], s) for s in start]
        if n:  # the row alone, unpadded
            st = states(model, ids[b : b + 1, :n], pos[:, b : b + 1, :n], st, None)
        for got, want in zip(padded, st, strict=True):
            np.testing.assert_allclose(got.conv[b], want.conv[0], atol=1e-6)
            np.testing.assert_allclose(got.recurrent[b], want.recurrent[0], atol=1e-5)


@pytest.mark.skipif(not LONG, reason="two engines' compiles (~2 min of CPU): CUA_LONG_TESTS=1")
def test_hybrid_cache_on_a_mesh_equals_one_device():
    """The tiny Qwen3.5 sharded data 4 x tensor 2 (the learner's arrays used in place, K/V
    pages split by kv head, linear states by value head / conv channel): two text prompts (one
    sampled) and a two-turn session with a screenshot a turn give what one device gives."""
    from cua_jax import sharding as shd
    from tests.sampler import test_engine_mesh as on_mesh

    want = on_mesh._run(Engine(on_mesh._model("qwen3_5"), **on_mesh.KW), "qwen3_5")
    mesh = shd.make_mesh(4, 1, 2)
    model = on_mesh._model("qwen3_5", mesh)
    engine = Engine(model, **on_mesh.KW)
    assert engine.mesh == mesh
    on_mesh._check_placement(engine, model, mesh)
    for st in engine.cache.linear:  # split by value head / conv channel over `tensor`
        assert st.recurrent.sharding.spec == PartitionSpec(None, "tensor")
        assert st.conv.sharding.spec == PartitionSpec(None, None, "tensor")
    on_mesh._assert_same(on_mesh._run(engine, "qwen3_5"), want)
    for st in engine.cache.linear:  # and kept so through prefill and decode
        assert st.recurrent.sharding.spec == PartitionSpec(None, "tensor")
