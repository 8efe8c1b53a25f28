"""The Pallas chunked gated delta rule (gated_delta/kernel.py) against its jnp reference, in
interpret mode on CPU, and compiled ahead of time for a TPU (libtpu's topology description).

Inputs cross chunk boundaries, end mid-chunk, carry an initial state and segment changes (one
inside a chunk, one on a chunk boundary), and use decay factors and betas near 0 and 1. 2 q/k
heads serve 4 value heads; H = 16 != V = 8, so a transposed state cannot pass. Tolerance 1e-5
absolute (outputs of scale ~0.1-1).
"""

import numpy as np
import pytest

from cua_jax.models.qwen_vl.gated_delta import kernel as ker
from cua_jax.models.qwen_vl.gated_delta import reference as ref

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
    import jax
    import jax.numpy as jnp
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
        )  # fmt: skip
        .compile()
    )
    assert "tpu_custom_call" in compiled.as_text()  # the Mosaic kernel, not an XLA fallback
    # the state stays in VMEM: no [T, T] or per-chunk [L, L] array goes to HBM
    assert compiled.memory_analysis().temp_size_in_bytes < 1 << 20
