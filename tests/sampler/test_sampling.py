"""Sampling: greedy, temperature, top-k, top-p, per-request keys, log-probs (hand-computed)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cua_jax.sampler.sampling import SamplingParams, SlotSampling, _key_data, sample_tokens

sample = jax.jit(sample_tokens)


def _probs_logits(probs):
    return np.log(np.asarray(probs, np.float64)).astype(np.float32)


def test_greedy_and_logprobs():
    logits = np.asarray([[0.1, 2.0, -1.0, 0.5], [3.0, 0.0, 0.0, 3.5]], np.float32)
    s = SlotSampling.from_params([SamplingParams(temperature=0.0)] * 2)
    tok, lp, mlp = sample(logits, s, jnp.zeros(2, jnp.int32))
    assert tok.tolist() == [1, 3]
    want = jax.nn.log_softmax(logits, axis=-1)[np.arange(2), [1, 3]]
    np.testing.assert_allclose(lp, want, atol=1e-6)
    np.testing.assert_allclose(mlp, want, atol=1e-6)


def test_top_p_keeps_smallest_nucleus_and_renormalises():
    logits = np.tile(_probs_logits([0.5, 0.3, 0.15, 0.05]), (400, 1))
    p = SamplingParams(temperature=1.0, top_p=0.7, seed=1)
    s = SlotSampling.from_params([p] * 400)
    tok, lp, mlp = sample(logits, s, jnp.arange(400, dtype=jnp.int32))
    tok = np.asarray(tok)
    assert set(tok.tolist()) == {0, 1}
    want = np.log(np.where(tok == 0, 0.5 / 0.8, 0.3 / 0.8))
    np.testing.assert_allclose(lp, want, atol=1e-5)
    np.testing.assert_allclose(mlp, np.log(np.where(tok == 0, 0.5, 0.3)), atol=1e-5)


def test_top_k_and_temperature():
    probs = [0.4, 0.3, 0.2, 0.1]
    logits = np.tile(_probs_logits(probs), (300, 1))
    p = SamplingParams(temperature=2.0, top_k=3, seed=5)
    tok, lp, _ = sample(
        logits, SlotSampling.from_params([p] * 300), jnp.arange(300, dtype=jnp.int32)
    )
    tok = np.asarray(tok)
    assert set(tok.tolist()) == {0, 1, 2}
    tempered = np.sqrt(np.asarray(probs[:3]))
    want = np.log(tempered / tempered.sum())[tok]
    np.testing.assert_allclose(lp, want, atol=1e-5)


def test_untruncated_frequencies_and_per_request_keys():
    probs = np.asarray([0.6, 0.25, 0.1, 0.05])
    n = 400  # same shape as the tests above: one compile
    logits = np.tile(_probs_logits(probs), (n, 1))
    s = SlotSampling.from_params([SamplingParams(seed=7)] * n)
    tok, _, _ = sample(logits, s, jnp.arange(n, dtype=jnp.int32))
    freq = np.bincount(np.asarray(tok), minlength=4) / n
    np.testing.assert_allclose(freq, probs, atol=0.075)  # > 3 sigma at n=400
    # Same seed and step -> same token; seeds differ -> streams differ.
    step = jnp.zeros(n, jnp.int32)
    a = sample(logits, SlotSampling.from_params([SamplingParams(seed=1)] * n), step)[0]
    b = sample(logits, SlotSampling.from_params([SamplingParams(seed=1)] * n), step)[0]
    c = sample(logits, SlotSampling.from_params([SamplingParams(seed=i) for i in range(n)]), step)
    assert (np.asarray(a) == np.asarray(b)).all()
    assert len(set(np.asarray(a).tolist())) == 1  # one seed, one step: one draw
    assert len(set(np.asarray(c[0]).tolist())) > 1


def test_params_validation():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    for bad in (float("nan"), float("inf")):  # NaN passed `temperature < 0` unnoticed
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=bad)
        with pytest.raises(ValueError, match="top_p"):
            SamplingParams(top_p=bad)


def test_host_side_keys_equal_jax_keys():
    for seed in (0, 1, 7, 2**31 + 5, 2**32 - 1, 2**32 + 3, -1, 123456789):
        want = np.asarray(jax.random.key_data(jax.random.key(seed)))
        np.testing.assert_array_equal(_key_data(seed), want)


def test_banned_tokens_are_never_sampled_and_logprobs_renormalise():
    # probs 0.5 / 0.3 / 0.15 / 0.05; ban the two most likely in slot 0, nothing in slot 1
    logits = np.tile(_probs_logits([0.5, 0.3, 0.15, 0.05]), (400, 1))
    ps = [SamplingParams(temperature=1.0, seed=3, banned_token_ids=(0, 1))] * 399
    s = SlotSampling.from_params([*ps, SamplingParams(temperature=0.0)])
    tok, lp, mlp = sample(logits, s, jnp.arange(400, dtype=jnp.int32))
    tok = np.asarray(tok)
    assert set(tok[:399].tolist()) == {2, 3} and tok[399] == 0
    want = np.log(np.where(tok[:399] == 2, 0.15 / 0.2, 0.05 / 0.2))
    np.testing.assert_allclose(lp[:399], want, atol=1e-5)
    np.testing.assert_allclose(mlp[:399], want, atol=1e-5)  # the policy without banned ids
    greedy = SlotSampling.from_params([SamplingParams(temperature=0.0, banned_token_ids=(0,))])
    assert int(sample(logits[:1], greedy, jnp.zeros(1, jnp.int32))[0][0]) == 1
    with pytest.raises(ValueError, match="banned_token_ids"):
        SamplingParams(banned_token_ids=tuple(range(9)))
