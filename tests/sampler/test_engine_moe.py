"""The Engine on a tiny random Qwen3-VL-MoE model (transformers' `Qwen3VLMoe*` the reference).

* greedy generation is token-identical to transformers' `generate` (text prompts batched
  together, and a prompt with an image), with log-probs equal to our full forward's (1e-5) and
  transformers' (1e-4);
* each generated token's recorded experts (`GenerateOutput.routes` i32[T, L, K]) are the expert
  sets the full forward over the finished sequence chooses at that token's position; the last
  token (never fed back) is -1; a config with `mlp_only_layers` records only its sparse layers;
* dense models return no routes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from cua_jax.models import qwen_vl  # noqa: E402
from cua_jax.sampler.engine import Engine  # noqa: E402
from cua_jax.sampler.sampling import SamplingParams  # noqa: E402
from tests.models.hf_tiny import hf_logits, image_inputs, make_hf_model, prompt_ids  # noqa: E402
from tests.sampler.test_engine_parity import hf_greedy  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    hf = make_hf_model("qwen3_vl_moe", seed=1)
    d = tmp_path_factory.mktemp("hf_moe")
    hf.save_pretrained(str(d))
    model = qwen_vl.from_pretrained(str(d))
    engine = Engine(model, max_slots=4, page_size=8, num_pages=64, max_seq_len=128, decode_chunk=4)
    return hf, model, engine


def forward(model, seq, pv=None, grid=None):
    """Our full forward over `seq`: (log-softmax f32[T, V], experts i32[L, T, K])."""
    logits, info = model(
        np.asarray(seq)[None], pixel_values=pv, image_grid_thw=grid, return_routing=True
    )
    return np.asarray(jax.nn.log_softmax(logits[0], axis=-1)), np.asarray(info.experts[:, 0])


def check_output(hf, model, prompt, out, pv=None, grid=None):
    assert out.finish_reason == "length"
    assert out.tokens == hf_greedy(hf, prompt, pv, grid)
    seq = np.asarray([*np.asarray(prompt).tolist(), *out.tokens])
    P, T = len(prompt), len(out.tokens)
    lp, experts_LTK = forward(model, seq, pv, grid)
    idx = np.arange(P, len(seq))
    np.testing.assert_allclose(out.logprobs, lp[idx - 1, seq[idx]], atol=1e-5)
    hf_lp = jax.nn.log_softmax(jnp.asarray(hf_logits(hf, seq[None], None, pv, grid)[0]), axis=-1)
    np.testing.assert_allclose(out.logprobs, np.asarray(hf_lp)[idx - 1, seq[idx]], atol=1e-4)
    # Routes: token i's row is what the full forward chose at its position (as a set).
    L, K = len(experts_LTK), model.config.text.num_experts_per_tok
    assert out.routes.shape == (T, L, K) and out.routes.dtype == np.int32
    want = np.transpose(experts_LTK[:, P : P + T - 1], (1, 0, 2))
    np.testing.assert_array_equal(np.sort(out.routes[:-1], -1), np.sort(want, -1))
    assert (out.routes[-1] == -1).all()


def test_text_greedy_matches_transformers_and_records_routes(setup):
    hf, model, engine = setup
    prompts = [prompt_ids(None, [n], seed=20 + n) for n in (4, 11, 19)]
    outs = engine.generate_batch([dict(prompt_ids=p, params=GREEDY) for p in prompts])
    for p, out in zip(prompts, outs, strict=True):
        check_output(hf, model, p, out)
    # The experts differ between tokens (the record is per token, not one row repeated).
    assert len({r.tobytes() for out in outs for r in out.routes[:-1]}) > 3


def test_image_prompt_greedy_matches_transformers(setup):
    hf, model, engine = setup
    pv, grid = image_inputs("qwen3_vl_moe", [(64, 32)], seed=5)
    p = prompt_ids(grid, [3, 5], seed=6)
    out = engine.generate_batch(
        [dict(prompt_ids=p, pixel_values=pv, image_grid_thw=grid, params=GREEDY)]
    )[0]
    check_output(hf, model, p, out, pv, grid)


def test_routes_of_mlp_only_layers_and_preemption():
    """mlp_only_layers=(0,): one sparse layer recorded. A pool that fits one sequence at a time
    preempts and recomputes a request; its routes are still those of the full forward."""
    cfg = qwen_vl.tiny("qwen3_vl", moe=dict(mlp_only_layers=(0,)))
    model = qwen_vl.init_random(cfg, seed=3)
    engine = Engine(model, max_slots=2, page_size=4, num_pages=9, max_seq_len=32, decode_chunk=4)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    prompts = [prompt_ids(None, [n], seed=n) for n in (9, 10)]
    outs = engine.generate_batch([dict(prompt_ids=p, params=params) for p in prompts])
    assert sum(o.num_preemptions for o in outs) > 0
    for p, out in zip(prompts, outs, strict=True):
        seq = np.asarray([*p.tolist(), *out.tokens])
        _, experts_LTK = forward(model, seq)
        P, T = len(p), len(out.tokens)
        assert out.routes.shape == (T, 1, 2)
        want = np.transpose(experts_LTK[:, P : P + T - 1], (1, 0, 2))
        np.testing.assert_array_equal(np.sort(out.routes[:-1], -1), np.sort(want, -1))


def test_dense_models_return_no_routes():
    model = qwen_vl.init_random(qwen_vl.tiny("qwen3_vl"), seed=0)
    engine = Engine(model, max_slots=2, page_size=8, num_pages=16, max_seq_len=64, decode_chunk=2)
    out = engine.generate_batch([dict(prompt_ids=[1, 2, 3], params=GREEDY)])[0]
    assert len(out.tokens) == 6 and out.routes is None
