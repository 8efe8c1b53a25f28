"""`text.ordered_checkpoint` (model.remat="ordered") against `jax.checkpoint`: the same values and
gradients when only some inputs are differentiated (a frozen weight, an integer input, an
integer output beside the float one), and its two optimization barriers in the backward's HLO.
The memory it saves is a TPU compiler's scheduling (BENCHMARKS.md "MoE rows over the expert
devices"); the learner-level check is tests/rl/test_moe_learner.py."""

import jax
import jax.numpy as jnp
import numpy as np

from cua_jax.models.qwen_vl.text import ordered_checkpoint


def _layer(params, frozen, x, ids):
    h = jnp.tanh(x @ params["w"] + frozen[ids]) * params["s"]
    return h, jnp.argmax(h, axis=-1)  # a float output and an integer one


def _loss(remat):
    def loss(params, frozen, x, ids):
        for _ in range(3):
            x, top = remat(_layer)(params, frozen, x, ids)
        return jnp.sum(x**2) + jnp.sum(top).astype(jnp.float32) * 0.0

    return loss


def test_ordered_checkpoint_equals_jax_checkpoint_on_the_inputs_differentiated():
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(6, 6)), jnp.float32), "s": jnp.float32(0.7)}
    frozen = jnp.asarray(rng.normal(size=(5, 6)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(4, 6)), jnp.float32)
    ids = jnp.asarray([0, 3, 4, 1], jnp.int32)
    want = jax.jit(jax.value_and_grad(_loss(jax.checkpoint), argnums=(0, 2)))
    got = jax.jit(jax.value_and_grad(_loss(ordered_checkpoint), argnums=(0, 2)))
    (v0, g0), (v1, g1) = want(params, frozen, x, ids), got(params, frozen, x, ids)
    np.testing.assert_allclose(v1, v0, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
        assert np.abs(np.asarray(b)).max() > 0
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # the frozen weight differentiated too: its cotangent is the checkpoint's
    both = (0, 1)
    g_frozen = jax.grad(_loss(ordered_checkpoint), argnums=both)(params, frozen, x, ids)[1]
    w_frozen = jax.grad(_loss(jax.checkpoint), argnums=both)(params, frozen, x, ids)[1]
    np.testing.assert_allclose(g_frozen, w_frozen, rtol=1e-5, atol=1e-6)
    hlo = got.lower(params, frozen, x, ids).as_text()
    assert hlo.count("optimization_barrier") >= 6  # two a layer, three layers (checkpoint: 3)
