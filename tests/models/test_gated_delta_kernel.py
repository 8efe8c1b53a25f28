"""The Pallas chunked gated delta rule (gated_delta/kernel.py) against its jnp reference, in
interpret mode on CPU, and compiled ahead of time for a TPU (libtpu's topology description).

Inputs cross chunk boundaries, end mid-chunk, carry an initial state and segment changes (one
inside a chunk, one on a chunk boundary), and use decay factors and betas near 0 and 1. 2 q/k
heads serve 4 value heads; H = 16 != V = 8, so a transposed state cannot pass. Tolerance 1e-5
absolute (outputs of scale ~0.1-1).

The kernel's gradient (`chunk_gated_delta_rule_trainable`: a Pallas backward kernel over the
chunks in reverse, from the chunk states the forward saves) and its place in the model
(`model.gated_delta_impl="pallas"`): the rule's gradients (q, k, v, g, beta, initial state) on
one device with the same inputs as above and under shard_map on a forced fsdp=2 x tensor=2
mesh, and a tiny Qwen3.5's logits and parameter gradients on packed rows, each against the jnp
reference's VJP, same tolerance; the gradient compiled for a TPU is two Mosaic kernels.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cua_jax import sharding as shd
from cua_jax.config import checks as config_checks
from cua_jax.models import qwen_vl
from cua_jax.models.qwen_vl.gated_delta import kernel as ker
from cua_jax.models.qwen_vl.gated_delta import reference as ref
from cua_jax.models.qwen_vl.gated_deltanet import make_chunk_rule

B, M, N, H, V = 2, 2, 4, 16, 8
TOL = 1e-5


def _inputs(T, gates, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, M, H)).astype(np.float32)
    k = rng.standard_normal((B, T, M, H)).astype(np.float32)
    v = rng.standard_normal((B, T, N, V)).astype(np.float32)
    if gates == "random":
        g, beta = -rng.uniform(0.0, 0.3, (B, T, N)), rng.uniform(0.0, 1.0, (B, T, N))
    else:
        g = rng.choice([-30.0, -1e-4, -0.5], (B, T, N))
        beta = rng.choice([1e-4, 1.0 - 1e-4, 0.5], (B, T, N))
    s0 = rng.standard_normal((B, N, H, V)).astype(np.float32) * 0.5
    return q, k, v, g.astype(np.float32), beta.astype(np.float32), s0


@pytest.mark.parametrize(
    "T,chunk,gates,segments",
    [(37, 16, "random", (5, 11, 21)), (40, 8, "extreme", None)],
    ids=["T37_L16_segments", "T40_L8_extreme_gates"],
)
def test_kernel_equals_reference(T, chunk, gates, segments):
    q, k, v, g, beta, s0 = _inputs(T, gates, seed=T)
    seg = None
    if segments is not None:  # row 0: changes at 5 (in chunk 0) and 16 (a chunk boundary)
        seg = np.stack([np.repeat([1, 2, 3], segments), np.repeat([1, 2, 0], [16, 11, 10])])
        seg = seg.astype(np.int32)
    kw = dict(initial_state=s0, segment_ids=seg, chunk_size=chunk)
    o_k, s_k = ker.chunk_gated_delta_rule(q, k, v, g, beta, interpret=True, **kw)
    o_r, s_r = ref.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    assert np.abs(np.asarray(o_r)).max() > 0.1 and np.abs(np.asarray(s_r)).max() > 0.3
    assert o_k.shape == o_r.shape and s_k.shape == s_r.shape
    assert np.abs(np.asarray(o_k) - np.asarray(o_r)).max() <= TOL
    assert np.abs(np.asarray(s_k) - np.asarray(s_r)).max() <= TOL


def test_a_chunk_size_that_is_not_a_power_of_two_is_refused():
    q, k, v, g, beta, _ = _inputs(8, "random", seed=0)
    with pytest.raises(ValueError, match="power of two"):
        ker.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=24, interpret=True)


def test_kernel_compiles_for_a_tpu_ahead_of_time():
    pytest.importorskip("libtpu", reason="libtpu (the TPU compiler) is not installed")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from cua_jax import plan

    devices = plan.abstract_devices(plan.get_topology("v5e-1"))
    rep = NamedSharding(Mesh(np.array(devices), ("x",)), PartitionSpec())
    T, M_, N_, H_ = 512, 16, 32, 128  # a real layer's heads (Qwen3.5's 128-dim heads)

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rep)

    def fn(q, k, v, g, beta, s0, seg):
        return ker.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, segment_ids=seg)

    compiled = (
        jax.jit(fn)
        .lower(
            sds((1, T, M_, H_), jnp.bfloat16),
            sds((1, T, M_, H_), jnp.bfloat16),
            sds((1, T, N_, H_), jnp.bfloat16),
            sds((1, T, N_), jnp.float32),
            sds((1, T, N_), jnp.float32),
            sds((1, N_, H_, H_), jnp.float32),
            sds((1, T), jnp.int32),
        )
        .compile()
    )
    assert "tpu_custom_call" in compiled.as_text()  # the Mosaic kernel, not an XLA fallback
    # the state stays in VMEM: no [T, T] or per-chunk [L, L] array goes to HBM
    assert compiled.memory_analysis().temp_size_in_bytes < 1 << 20

    def loss(*a):
        o, s = ker.chunk_gated_delta_rule_trainable(*a[:5], initial_state=a[5], segment_ids=a[6])
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(s * s)

    args = (
        sds((1, T, M_, H_), jnp.bfloat16),
        sds((1, T, M_, H_), jnp.bfloat16),
        sds((1, T, N_, H_), jnp.bfloat16),
        sds((1, T, N_), jnp.float32),
        sds((1, T, N_), jnp.float32),
        sds((1, N_, H_, H_), jnp.float32),
        sds((1, T), jnp.int32),
    )
    grad = jax.jit(jax.grad(loss, argnums=tuple(range(6)))).lower(*args).compile()
    # forward and backward are both Mosaic kernels (the reference's VJP would be XLA ops)
    assert grad.as_text().count("tpu_custom_call") == 2
    # the saved chunk states (N x T/64 x [H, H] f32: 16 MiB) and the gradients' f32 copies;
    # no per-chunk [L, L] arrays (the reference's VJP: 49 MiB, BENCHMARKS.md)
    states = N_ * (T // ref.CHUNK) * H_ * H_ * 4
    assert grad.memory_analysis().temp_size_in_bytes < states + (2 << 20)


def _grads(rule, q, k, v, g, beta, s0, seg, chunk):
    """Gradients of a random projection of (o, final state) in q, k, v, g, beta and s0."""
    rng = np.random.default_rng(7)
    w_o = jnp.asarray(rng.standard_normal((B, q.shape[1], N, V)).astype(np.float32))
    w_s = jnp.asarray(rng.standard_normal(s0.shape).astype(np.float32))

    def loss(*a):
        o, s = rule(*a[:5], initial_state=a[5], segment_ids=seg, chunk_size=chunk)
        return jnp.sum(o * w_o) + jnp.sum(s * w_s)

    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6))))(q, k, v, g, beta, s0)


@pytest.mark.parametrize(
    "T,chunk,gates,segments",
    [(37, 16, "random", True), (40, 8, "extreme", False)],
    ids=["T37_L16_segments", "T40_L8_extreme_gates"],
)
def test_pallas_backward_equals_the_reference_vjp(T, chunk, gates, segments):
    """The backward kernel's gradients against `jax.vjp` of the jnp reference: inputs that end
    mid-chunk with segment changes inside a chunk and on a chunk boundary, or decays and betas
    near 0 and 1; cotangents on both the outputs and the final state."""
    q, k, v, g, beta, s0 = (jnp.asarray(x) for x in _inputs(T, gates, seed=T + 1))
    seg = None
    if segments:
        seg = np.stack([np.repeat([1, 2, 3], [5, 11, T - 16]), np.repeat([1, 2, 0], [16, 11, 10])])
        seg = jnp.asarray(seg.astype(np.int32))
    pallas = functools.partial(ker.chunk_gated_delta_rule_trainable, interpret=True)
    loss_p, grads_p = _grads(pallas, q, k, v, g, beta, s0, seg, chunk)
    loss_r, grads_r = _grads(ref.chunk_gated_delta_rule, q, k, v, g, beta, s0, seg, chunk)
    assert abs(float(loss_p) - float(loss_r)) <= TOL * max(1.0, abs(float(loss_r)))
    for name, gp, gr in zip(("q", "k", "v", "g", "beta", "s0"), grads_p, grads_r, strict=True):
        assert np.abs(np.asarray(gr)).max() > 0.05, name
        assert np.abs(np.asarray(gp) - np.asarray(gr)).max() <= TOL, name


def test_pallas_rule_gradients_equal_the_reference_on_a_mesh():
    """Under shard_map: rows over fsdp, the 2 q/k heads (and their value heads) over tensor.
    One device is the model test's case below."""
    T, chunk = 21, 8  # 3 chunks, the last partial; segment changes at 5 and at 16
    q, k, v, g, beta, s0 = (jnp.asarray(x) for x in _inputs(T, "random", seed=3))
    seg = jnp.asarray(np.stack([np.repeat([1, 2, 3], [5, 11, 5]), np.repeat([4, 0], [16, 5])]))
    mesh = shd.make_mesh(1, 2, 2, devices=jax.devices()[:4])
    pallas = make_chunk_rule("pallas", mesh, shd.DEFAULT_RULES)
    loss_p, grads_p = _grads(pallas, q, k, v, g, beta, s0, seg.astype(jnp.int32), chunk)
    loss_r, grads_r = _grads(ref.chunk_gated_delta_rule, q, k, v, g, beta, s0, seg, chunk)
    assert abs(float(loss_p) - float(loss_r)) <= TOL * max(1.0, abs(float(loss_r)))
    for name, gp, gr in zip(("q", "k", "v", "g", "beta", "s0"), grads_p, grads_r, strict=True):
        assert np.abs(np.asarray(gr)).max() > 0.05, name  # every input gets a real gradient
        assert np.abs(np.asarray(gp) - np.asarray(gr)).max() <= TOL, name


def test_qwen35_pallas_path_equals_the_reference_path_logits_and_gradients():
    """A tiny Qwen3.5 (Gated DeltaNet, then full attention) on two rows, row 0 packing two
    samples: the logits and every parameter's gradient of a loss over them, with
    model.gated_delta_impl = "pallas" against "reference"."""
    cfg = qwen_vl.tiny_qwen35()
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 400, (2, 21)).astype(np.int32))
    seg = jnp.asarray(np.stack([np.repeat([1, 2], [9, 12]), np.ones(21, int)]).astype(np.int32))
    w = jnp.asarray(rng.standard_normal((2, 21, cfg.text.vocab_size)).astype(np.float32))

    @nnx.jit
    def loss_and_grads(model):
        def loss(m):
            logits = m(ids, segment_ids=seg)
            return jnp.sum(logits * w) / w.size, logits

        return nnx.value_and_grad(loss, has_aux=True)(model)

    model = qwen_vl.QwenVL(cfg, rngs=nnx.Rngs(0))
    out = {}
    for impl in ("reference", "pallas"):
        model.config = cfg.replace(gated_delta_impl=impl)  # a static field: traced again
        (_, logits), grads = loss_and_grads(model)
        out[impl] = logits, dict(nnx.to_flat_state(grads))
    (logits_r, grads_r), (logits_p, grads_p) = out["reference"], out["pallas"]
    assert np.abs(np.asarray(logits_r)).max() > 0.1
    assert np.abs(np.asarray(logits_p) - np.asarray(logits_r)).max() <= TOL
    linear = [p for p in grads_r if "linear_attn" in map(str, p)]
    assert len(linear) == 9  # 5 projections, conv, dt_bias, A_log, norm
    assert grads_p.keys() == grads_r.keys()
    for path, gr in grads_r.items():
        gr, gp = np.asarray(gr[...]), np.asarray(grads_p[path][...])
        assert np.abs(gp - gr).max() <= TOL * max(1.0, np.abs(gr).max()), path
    for path in linear:
        assert np.abs(np.asarray(grads_r[path][...])).max() > 0, path


def test_a_bad_gated_delta_impl_fails_in_one_line():
    with pytest.raises(ValueError, match=r"^gated_delta_impl='triton': use one of") as e:
        qwen_vl.tiny_qwen35(gated_delta_impl="triton")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"^model.gated_delta_impl='triton': use one of"):
        make_chunk_rule("triton")
    from configs import qwen35_grpo

    c = qwen35_grpo.get_config("smoke")
    config_checks.validate_config(c)  # the default, "reference", passes
    c.model.gated_delta_impl = "triton"
    with pytest.raises(config_checks.ConfigError, match="config.model.gated_delta_impl='triton'"):
        config_checks.validate_config(c)
