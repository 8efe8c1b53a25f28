"""Engine vs transformers and vs the model's own full forward, on the tiny random Qwen-VL models.

* greedy generation is token-identical to transformers' `generate` (text only, and with images);
* reported log-probs equal the trainer-side forward's log-softmax (our model, 1e-5) and
  transformers' (1e-4, across frameworks);
* a second turn (new screenshot appended) prefilled on top of the first turn's cached K/V equals
  generation over the whole transcript, and the paged K/V equal a contiguous dense forward's K/V;
* a history window that drops the first screenshot recomputes from the first difference.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from cua_jax.models import qwen_vl  # noqa: E402
from cua_jax.models.qwen_vl.rope import get_rope_index  # noqa: E402
from cua_jax.sampler import kv_cache  # noqa: E402
from cua_jax.sampler.engine import Engine  # noqa: E402
from cua_jax.sampler.sampling import SamplingParams  # noqa: E402
from tests.models.hf_tiny import (  # noqa: E402
    hf_logits,
    image_inputs,
    make_hf_model,
    prompt_ids,
)

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def setup(request, tmp_path_factory):
    fam = request.param
    hf = make_hf_model(fam, seed=1)
    d = tmp_path_factory.mktemp(f"hf_{fam}")
    hf.save_pretrained(str(d))
    model = qwen_vl.from_pretrained(str(d))
    engine = Engine(model, max_slots=4, page_size=8, num_pages=64, max_seq_len=128, decode_chunk=4)
    return fam, hf, model, engine


def hf_greedy(hf, ids, pv=None, grid=None, n=6):
    kw = {"input_ids": torch.as_tensor(np.asarray(ids)[None])}
    if pv is not None:
        kw["pixel_values"] = torch.as_tensor(pv)
        kw["image_grid_thw"] = torch.as_tensor(np.asarray(grid))
        kw["mm_token_type_ids"] = (kw["input_ids"] == hf.config.image_token_id).to(torch.int32)
    with torch.no_grad():
        out = hf.generate(
            **kw,
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def our_logprobs(model, seq, n_prompt, pv=None, grid=None):
    """Trainer-side forward: log_softmax of the full-sequence logits at the generated tokens."""
    logits = model(np.asarray(seq)[None], pixel_values=pv, image_grid_thw=grid)[0]
    lp = jax.nn.log_softmax(logits, axis=-1)
    idx = np.arange(n_prompt, len(seq))
    return np.asarray(lp[idx - 1, np.asarray(seq)[idx]])


def hf_logprobs(hf, seq, n_prompt, pv=None, grid=None):
    logits = hf_logits(hf, np.asarray(seq)[None], pixel_values=pv, image_grid_thw=grid)[0]
    lp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    idx = np.arange(n_prompt, len(seq))
    return np.asarray(lp[idx - 1, np.asarray(seq)[idx]])


def test_text_greedy_matches_transformers(setup):
    fam, hf, model, engine = setup
    prompts = [prompt_ids(None, [n], seed=10 + n) for n in (5, 13, 20)]
    outs = engine.generate_batch([dict(prompt_ids=p, params=GREEDY) for p in prompts])
    for p, out in zip(prompts, outs, strict=True):
        assert out.finish_reason == "length"
        assert out.tokens == hf_greedy(hf, p)
        seq = [*p.tolist(), *out.tokens]
        np.testing.assert_allclose(out.logprobs, our_logprobs(model, seq, len(p)), atol=1e-5)
        np.testing.assert_allclose(out.model_logprobs, out.logprobs, atol=0)
        np.testing.assert_allclose(out.logprobs, hf_logprobs(hf, seq, len(p)), atol=1e-4)


def test_sampled_logprobs_match_trainer_forward(setup):
    """Temperature 1 without truncation: sampled log-probs == trainer forward's (ratio 1)."""
    fam, hf, model, engine = setup
    p = prompt_ids(None, [9], seed=3)
    params = SamplingParams(temperature=1.0, seed=11, max_new_tokens=7)
    out = engine.generate_batch([dict(prompt_ids=p, params=params)])[0]
    seq = [*p.tolist(), *out.tokens]
    np.testing.assert_allclose(out.logprobs, our_logprobs(model, seq, len(p)), atol=1e-5)
    np.testing.assert_allclose(out.model_logprobs, out.logprobs, atol=1e-6)
    # Same seed -> same tokens (the engine is deterministic per request).
    again = engine.generate_batch([dict(prompt_ids=p, params=params)])[0]
    assert again.tokens == out.tokens


def _dense_kv(model, seq, pv, grid):
    """Per-layer K/V of a contiguous dense forward over `seq`: list of (k, v) f32[T, K, H]."""
    cfg = model.config
    ids = np.asarray(seq)[None]
    pos, _ = get_rope_index(
        ids,
        grid,
        image_token_id=cfg.image_token_id,
        spatial_merge_size=cfg.vision.spatial_merge_size,
    )
    embeds, mask, ds = model.embed(ids, pv, grid)
    dense = qwen_vl.make_dense_attn_fn()
    kv = {}

    def attn_fn(i, q, k, v):
        kv[i] = (np.asarray(k[0]), np.asarray(v[0]))
        return dense(i, q, k, v)

    model.decode(embeds, jnp.asarray(pos), attn_fn, mask, ds)
    return [kv[i] for i in range(len(kv))]


def test_two_turns_with_images(setup):
    fam, hf, model, engine = setup
    pv, grid = image_inputs(fam, [(56, 56), (56, 56), (56, 56)], seed=4)
    per = int(np.prod(grid[0]))
    pv1, g1 = pv[:per], grid[:1]
    p1 = prompt_ids(g1, [5, 4], seed=1)
    out1 = engine.generate_batch(
        [dict(prompt_ids=p1, pixel_values=pv1, image_grid_thw=g1, params=GREEDY, session_id="ep")]
    )[0]
    assert out1.tokens == hf_greedy(hf, p1, pv1, g1)
    # Turn 2: the transcript so far + new text + a new screenshot + text.
    seq1 = np.asarray([*p1.tolist(), *out1.tokens])
    p2 = np.concatenate([seq1, prompt_ids(grid[1:2], [3, 4], seed=2)])
    pv2, g2 = pv[: 2 * per], grid[:2]
    out2 = engine.generate_batch(
        [dict(prompt_ids=p2, pixel_values=pv2, image_grid_thw=g2, params=GREEDY, session_id="ep")]
    )[0]
    assert out2.num_cached_tokens == len(seq1) - 1  # only the new tokens were prefilled
    assert out2.tokens == hf_greedy(hf, p2, pv2, g2)
    seq2 = [*p2.tolist(), *out2.tokens]
    np.testing.assert_allclose(
        out2.logprobs, our_logprobs(model, seq2, len(p2), pv2, g2), atol=1e-5
    )
    np.testing.assert_allclose(out2.logprobs, hf_logprobs(hf, seq2, len(p2), pv2, g2), atol=1e-4)

    # Paged K/V of the finished session == a contiguous dense forward's K/V.
    sess = engine._sessions["ep"]
    assert sess.kv_len == len(seq2) - 1
    dense = _dense_kv(model, seq2[: sess.kv_len], pv2, g2)
    table = np.zeros((1, engine.pages_per_seq), np.int32)
    table[0, : len(sess.pages)] = sess.pages
    for i, (k, v) in enumerate(dense):
        kp = np.asarray(kv_cache.gather_pages(engine.cache.k[i], jnp.asarray(table)))[0]
        vp = np.asarray(kv_cache.gather_pages(engine.cache.v[i], jnp.asarray(table)))[0]
        np.testing.assert_allclose(kp[: sess.kv_len], k, atol=1e-5)
        np.testing.assert_allclose(vp[: sess.kv_len], v, atol=1e-5)

    # Turn 3 with a history window that dropped the first screenshot: not a prefix of the cached
    # sequence; reused only up to the first difference, and equal to a fresh run.
    img1 = np.nonzero(p2 == hf.config.image_token_id)[0]
    cut_start, cut_end = img1[0] - 1, img1[per // 4 - 1] + 2  # <vs> image-pad* <ve>
    tail = prompt_ids(grid[2:3], [2, 3], seed=3)
    p3 = np.concatenate([np.asarray(seq2)[:cut_start], np.asarray(seq2)[cut_end:], tail])
    pv3, g3 = np.concatenate([pv[per : 2 * per], pv[2 * per :]]), grid[1:]
    out3 = engine.generate_batch(
        [dict(prompt_ids=p3, pixel_values=pv3, image_grid_thw=g3, params=GREEDY, session_id="ep")]
    )[0]
    assert out3.num_cached_tokens == cut_start
    fresh = engine.generate_batch(
        [dict(prompt_ids=p3, pixel_values=pv3, image_grid_thw=g3, params=GREEDY)]
    )[0]
    assert fresh.num_cached_tokens == 0
    assert out3.tokens == fresh.tokens == hf_greedy(hf, p3, pv3, g3)
    np.testing.assert_allclose(out3.logprobs, fresh.logprobs, atol=1e-5)
    engine.drop_session("ep")
    engine.check_pages()
    assert engine.alloc.num_free == engine.num_pages - 1


def test_stop_tokens_strings_and_too_long_prompt(setup):
    fam, hf, model, engine = setup
    p = prompt_ids(None, [7], seed=5)
    full = engine.generate_batch([dict(prompt_ids=p, params=GREEDY)])[0].tokens
    stop_tok = SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=(full[2],))
    out = engine.generate_batch([dict(prompt_ids=p, params=stop_tok)])[0]
    first = full.index(full[2])
    assert out.finish_reason == "stop" and out.tokens == full[: first + 1]

    engine.detokenize = lambda ids: " ".join(f"<{i}>" for i in ids)
    stop_str = SamplingParams(temperature=0.0, max_new_tokens=6, stop_strings=(f"<{full[1]}>",))
    out = engine.generate_batch([dict(prompt_ids=p, params=stop_str)])[0]
    assert out.finish_reason == "stop" and out.tokens == full[: full.index(full[1]) + 1]

    too_long = np.zeros(engine.max_seq_len + 5, np.int64)
    outs = engine.generate_batch([dict(prompt_ids=too_long), dict(prompt_ids=p, params=GREEDY)])
    assert outs[0].finish_reason == "error" and "max_seq_len" in outs[0].error
    assert outs[1].tokens == full
    engine.check_pages()


def test_update_params_swaps_weights(setup):
    fam, hf, model, engine = setup
    other = qwen_vl.init_random(model.config, seed=7)
    p = prompt_ids(None, [6], seed=8)
    before = engine.generate_batch([dict(prompt_ids=p, params=GREEDY)])[0]
    old_state = jax.tree.map(lambda x: x, engine._state)
    engine.update_params(other, version=3)
    out = engine.generate_batch([dict(prompt_ids=p, params=GREEDY)])[0]
    assert out.version == 3
    seq = [*p.tolist(), *out.tokens]
    np.testing.assert_allclose(out.logprobs, our_logprobs(other, seq, len(p)), atol=1e-5)
    # The engine holds the trainer's arrays themselves, not copies.
    leaf_new = jax.tree.leaves(engine._state)[0]
    assert leaf_new is jax.tree.leaves(nnx.state(other))[0]
    engine.update_params(old_state, version=4)
    assert engine.generate_batch([dict(prompt_ids=p, params=GREEDY)])[0].tokens == before.tokens


def test_weights_donated_by_a_train_step_wait_for_update(setup):
    fam, hf, model, engine = setup
    p = prompt_ids(None, [6], seed=9)
    want = engine.generate_batch([dict(prompt_ids=p, params=GREEDY)])[0].tokens
    copy = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    engine.update_params(copy, version=10)
    assert engine.generate_batch([dict(prompt_ids=p, params=GREEDY)])[0].version == 10
    for x in jax.tree.leaves(copy):  # what a donating train step does to the old arrays
        x.delete()
    with pytest.raises(RuntimeError, match="update_params"):
        engine._wait_for_live_params(timeout_s=0.01)
    engine.update_params(model, version=11)
    out = engine.generate_batch([dict(prompt_ids=p, params=GREEDY)])[0]
    assert out.version == 11 and out.tokens == want
