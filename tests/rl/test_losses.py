"""Each loss term against hand-computed numbers; gradient properties of the policy loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cua_jax.rl import losses

L = np.log


def test_ppo_clip_hand_numbers():
    # ratio 1.25 (0.5/0.4) and 0.5 (0.2/0.4), A = ±1, eps_low = eps_high = 0.2
    logp = jnp.array([[L(0.5), L(0.5), L(0.2), L(0.2)]])
    old = jnp.array([[L(0.4)] * 4])
    adv = jnp.array([[1.0, -1.0, -1.0, 1.0]])
    loss, ratio, lo, hi = losses.ppo_clip(logp, old, adv, eps_low=0.2, eps_high=0.2)
    np.testing.assert_allclose(ratio, [[1.25, 1.25, 0.5, 0.5]], rtol=1e-6)
    # -min(1.25, 1.2) = -1.2 ; -min(-1.25, -1.2) = 1.25 ; -min(-0.5, -0.8) = 0.8 ; -min(.5,.8)=-.5
    np.testing.assert_allclose(loss, [[-1.2, 1.25, 0.8, -0.5]], rtol=1e-6)
    assert hi.tolist() == [[True, False, False, False]]
    assert lo.tolist() == [[False, False, True, False]]


def test_clip_higher_separate_eps():
    logp = jnp.array([[L(0.5), L(0.2)]])
    old = jnp.array([[L(0.4), L(0.4)]])
    # eps_high = 0.28 -> 1.25 inside; eps_low = 0.6 -> 0.5 inside: nothing clipped
    loss, _, lo, hi = losses.ppo_clip(
        logp, old, jnp.array([[1.0, -1.0]]), eps_low=0.6, eps_high=0.28
    )
    np.testing.assert_allclose(loss, [[-1.25, 0.5]], rtol=1e-6)
    assert not bool(lo.any()) and not bool(hi.any())


def test_kl_estimators_hand_numbers():
    logp = jnp.array([L(0.5)])
    ref = jnp.array([L(0.25)])
    # log rho = log(0.25/0.5) = -0.6931472
    np.testing.assert_allclose(losses.kl_penalty(logp, ref, "k1"), [0.6931472], rtol=1e-6)
    np.testing.assert_allclose(losses.kl_penalty(logp, ref, "k2"), [0.2402265], rtol=1e-6)
    np.testing.assert_allclose(losses.kl_penalty(logp, ref, "k3"), [0.1931472], rtol=1e-5)
    with pytest.raises(ValueError, match="k4"):
        losses.kl_penalty(logp, ref, "k4")


def test_tis_weight_truncated():
    old = jnp.array([L(0.4), L(0.4)])
    beh = jnp.array([L(0.1), L(0.8)])
    np.testing.assert_allclose(losses.tis_weight(old, beh, 2.0), [2.0, 0.5], rtol=1e-6)


def test_entropy_and_logprobs():
    logits = jnp.array([[[0.0, L(3.0)]]])
    np.testing.assert_allclose(losses.token_entropy(logits), [[0.5623351]], rtol=1e-6)
    np.testing.assert_allclose(
        losses.token_logprobs(logits, jnp.array([[1]])), [[L(0.75)]], rtol=1e-6
    )


def test_aggregation_modes_hand_numbers():
    per_tok = np.array([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]], np.float32)
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0]], bool)
    w = losses.loss_weights(mask, mode="token-mean")
    assert np.sum(w * per_tok) == pytest.approx(2.5)  # (1+2+3+4)/4
    w = losses.loss_weights(mask, mode="seq-mean-token-mean")
    assert np.sum(w * per_tok) == pytest.approx(3.0)  # (6/3 + 4/1) / 2
    w = losses.loss_weights(mask, mode="seq-mean-token-sum-norm", loss_norm=4)
    assert np.sum(w * per_tok) == pytest.approx(1.25)  # (6/4 + 4/4) / 2
    # The same two sequences packed in one row with segment ids give the same numbers.
    packed = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
    pmask = np.ones((1, 4), bool)
    seg = np.array([[1, 1, 1, 2]])
    for mode, want in [
        ("token-mean", 2.5),
        ("seq-mean-token-mean", 3.0),
        ("seq-mean-token-sum-norm", 1.25),
    ]:
        w = losses.loss_weights(pmask, seg, mode=mode, loss_norm=4)
        assert np.sum(w * packed) == pytest.approx(want), mode
    with pytest.raises(ValueError, match="aggregation mode"):
        losses.loss_weights(mask, mode="sum")
    with pytest.raises(ValueError, match="needs loss_norm"):  # never a batch-dependent C
        losses.loss_weights(mask, mode="seq-mean-token-sum-norm")
    # sequence ids join tokens of different rows into one sequence (one rollout, two chains)
    w = losses.loss_weights(mask, mode="seq-mean-token-mean", sequence_ids_BT=np.zeros((2, 4)))
    assert np.sum(w * per_tok) == pytest.approx(2.5)  # one sequence: the token mean


def _setup(seed=0, b=2, t=5, v=7):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    logits = jax.random.normal(k1, (b, t, v))
    targets = jax.random.randint(k2, (b, t), 0, v)
    mask = np.array([[0, 1, 1, 0, 1], [0, 0, 1, 1, 0]], bool)
    adv = jnp.array([[0.0, 1.5, 1.5, 0.0, 1.5], [0.0, 0.0, -0.7, -0.7, 0.0]])
    ref = losses.token_logprobs(logits + 0.3 * jax.random.normal(k3, logits.shape), targets)
    return logits, targets, mask, adv, ref


def test_full_loss_hand_composition():
    logits, targets, mask, adv, ref = _setup()
    logp = losses.token_logprobs(logits, targets)
    old = logp - 0.1  # ratio exp(0.1) = 1.105 everywhere
    beh = old - 1.0  # pi_old / mu = e = 2.718 -> truncated to 2
    ent = losses.token_entropy(logits)
    w = losses.loss_weights(mask)
    loss, m = losses.policy_loss(
        logp,
        old,
        adv,
        jnp.asarray(w),
        jnp.asarray(mask),
        eps_low=0.2,
        eps_high=0.05,
        behaviour_logprobs_BT=beh,
        tis_cap=2.0,
        ref_logprobs_BT=ref,
        kl_coef=0.1,
        kl_estimator="k3",
        entropy_BT=ent,
        entropy_coef=0.01,
    )
    r = np.exp(0.1)
    a = np.asarray(adv)
    pg = -np.minimum(r * a, np.clip(r, 0.8, 1.05) * a) * 2.0
    lr = np.asarray(ref) - np.asarray(logp)
    kl = np.exp(lr) - 1 - lr
    want = np.sum(w * (pg + 0.1 * kl - 0.01 * np.asarray(ent)))
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    # positive-advantage tokens have ratio 1.105 > 1.05: clipped high; no low clips.
    assert float(m["clip_frac_high"]) == pytest.approx(3 / 5)
    assert float(m["clip_frac_low"]) == 0.0
    assert float(m["tis_weight_mean"]) == pytest.approx(2.0)
    np.testing.assert_allclose(m["kl"], np.sum(kl * mask) / mask.sum(), rtol=1e-5)


def _pg_grad(logits, targets, adv, mask, behaviour=None):
    w = jnp.asarray(losses.loss_weights(np.asarray(mask)))

    def f(lg):
        logp = losses.token_logprobs(lg, targets)
        old = jax.lax.stop_gradient(logp) if behaviour is None else behaviour
        return losses.policy_loss(logp, old, adv, w, jnp.asarray(mask))

    return jax.grad(f, has_aux=True)(logits)


def test_zero_advantage_gives_zero_gradient():
    logits, targets, mask, adv, _ = _setup()
    g, _ = _pg_grad(logits, targets, jnp.zeros_like(adv), mask)
    assert float(jnp.abs(g).max()) == 0.0
    g, _ = _pg_grad(logits, targets, adv, mask)
    assert float(jnp.abs(g).max()) > 0.0


def test_masked_tokens_get_zero_gradient():
    logits, targets, mask, adv, _ = _setup()
    g, _ = _pg_grad(logits, targets, adv + 1.0, mask)  # nonzero advantage on masked tokens too
    g_tok = np.abs(np.asarray(g)).sum(-1)
    assert (g_tok[~mask] == 0).all()
    assert (g_tok[mask] > 0).all()


def test_on_policy_ratio_exactly_one_and_no_clipping():
    logits, targets, mask, adv, _ = _setup()
    behaviour = losses.token_logprobs(logits, targets)  # the sampler's log-probs, bit-equal
    g, m = _pg_grad(logits, targets, adv, mask, behaviour=behaviour)
    assert float(m["ratio_mean"]) == 1.0 and float(m["ratio_max"]) == 1.0
    assert float(m["clip_frac_low"]) == 0.0 and float(m["clip_frac_high"]) == 0.0
    # On-policy, PPO-clip's gradient is the vanilla policy gradient -Σ w A ∇log π.
    w = jnp.asarray(losses.loss_weights(mask))
    g_pg = jax.grad(lambda lg: -jnp.sum(w * adv * losses.token_logprobs(lg, targets)))(logits)
    np.testing.assert_allclose(g, g_pg, rtol=1e-6, atol=1e-8)


def test_sft_loss():
    logits, targets, mask, _, _ = _setup()
    logp = losses.token_logprobs(logits, targets)
    w = losses.loss_weights(mask)
    loss, m = losses.sft_loss(logp, jnp.asarray(w), jnp.asarray(mask))
    want = -np.asarray(logp)[mask].mean()
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    np.testing.assert_allclose(m["nll_mean"], want, rtol=1e-6)


def test_logprobs_and_entropy_in_one_pass():
    logits, targets, _, _, _ = _setup()
    lp, ent = losses.token_logprobs_and_entropy(logits, targets)
    np.testing.assert_allclose(lp, losses.token_logprobs(logits, targets), rtol=1e-6)
    np.testing.assert_allclose(ent, losses.token_entropy(logits), rtol=1e-6)


@pytest.mark.parametrize("chunk", [0, 1, 3, 5, 16])
def test_chunked_token_stats_equal_one_piece(chunk):
    """Chunked log-probs / entropies (lax.map over position chunks, rematerialised) give the same
    values and gradients as one [B, T, V] log-softmax; T=13 is not a multiple of 3 or 5."""
    rng = np.random.default_rng(0)
    b, t, d, v = 2, 13, 8, 32
    h = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(d, v)), jnp.float32)
    tg = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
    c = jnp.asarray(rng.normal(size=(b, t)), jnp.float32)

    def objective(h, w, chunk):
        lp, ent = losses.chunked_token_stats(lambda x: (x @ w) / 0.7, h, tg, chunk=chunk)
        return jnp.sum(c * lp) + 0.3 * jnp.sum(ent), (lp, ent)

    (f0, (lp0, ent0)), g0 = jax.value_and_grad(objective, (0, 1), has_aux=True)(h, w, 0)
    (f1, (lp1, ent1)), g1 = jax.value_and_grad(objective, (0, 1), has_aux=True)(h, w, chunk)
    want_lp, want_ent = losses.token_logprobs_and_entropy((h @ w) / 0.7, tg)
    np.testing.assert_allclose(lp0, want_lp, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lp1, want_lp, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ent1, want_ent, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(f1, f0, rtol=1e-5)
    for a, b_ in zip(g1, g0, strict=True):
        np.testing.assert_allclose(a, b_, rtol=1e-4, atol=1e-5)
    lp_only, none = losses.chunked_token_stats(lambda x: x @ w, h, tg, chunk=chunk, entropy=False)
    assert none is None and lp_only.shape == (b, t)


def test_chunked_token_stats_never_hold_all_logits():
    """The compiled gradient of the chunked version needs far less scratch memory than the
    one-piece version, whose f32[B, T, V] logits (and their cotangent) dominate it."""
    b, t, d, v = 2, 512, 16, 4096
    h = jnp.ones((b, t, d), jnp.float32)
    w = jnp.ones((d, v), jnp.float32) * 0.01
    tg = jnp.zeros((b, t), jnp.int32)

    def temp_bytes(chunk):
        def f(h, w):
            lp, ent = losses.chunked_token_stats(lambda x: x @ w, h, tg, chunk=chunk)
            return jnp.sum(lp) + jnp.sum(ent)

        compiled = jax.jit(jax.grad(f, (0, 1))).lower(h, w).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    logits_bytes = b * t * v * 4  # 16 MiB
    one_piece, c64, c32 = temp_bytes(0), temp_bytes(64), temp_bytes(32)
    assert one_piece >= logits_bytes
    # a few chunk-sized buffers (logits, probabilities, cotangents of one chunk) instead
    assert c64 <= one_piece / 6, (c64, one_piece)
    assert c32 < 0.6 * c64, (c32, c64)  # and they shrink with the chunk
