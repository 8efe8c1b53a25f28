"""The GPU and TPU decode paths, checked without a GPU or TPU: ahead-of-time lowering.

`jit(...).trace(...).lower(lowering_platforms=...)` under an abstract H100 / TPU v5e device runs
the whole Pallas -> Triton / Mosaic lowering on this CPU. That catches what interpret mode cannot:
block shapes a backend refuses, ops its lowering lacks. It does not run the backend compiler
(ptxas / libtpu), so a kernel that lowers can still fail to compile or be slow there; only a
machine with the accelerator shows that (BENCHMARKS.md).

* the shape rule `unsupported_reason` agrees with the real lowering on a grid of shapes, so the
  engine's up-front check and fallback track the installed JAX;
* the engine's whole jitted decode chunk lowers for both platforms, the shipped TPU kernel or our
  Triton kernel inside, for both model families;
* "auto" falls back to the jnp reference where the platform's kernel cannot take the shapes
  (the tiny smoke model's head_dim 32 on TPU), an explicit backend fails at Engine construction.
"""

import dataclasses
import functools
import logging
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

from cua_jax.models import qwen_vl
from cua_jax.sampler import steps
from cua_jax.sampler.engine import Engine
from cua_jax.sampler.kernels import paged_attention as pa
from cua_jax.sampler.sampling import SamplingParams, SlotSampling
from tools.bench_paged_decode import GPU_SWEEP

# lowering platform, abstract device kind
TARGETS = {"gpu": ("cuda", "NVIDIA H100"), "tpu": ("tpu", "TPU v5 lite")}


def _lower(backend: str, fn, *args) -> str:
    """Text of `fn` lowered for `backend`'s platform; raises what the lowering raises."""
    platform, kind = TARGETS[backend]
    device = AbstractDevice(
        device_kind=kind, num_cores=1, platform="gpu" if backend == "gpu" else "tpu"
    )
    mesh = AbstractMesh((1,), ("x",), axis_types=(AxisType.Explicit,), abstract_device=device)
    with use_abstract_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Pallas Triton's deprecation notice
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))
    return lowered.as_text()


def _kernel_fn(backend: str):
    """The backend's kernel itself, bypassing the dispatcher's shape check."""
    if backend == "tpu":
        return lambda q, k, v, t, n: pa._tpu(q, k, v, t, n, 0.1)
    return lambda q, k, v, t, n: pa.paged_attention_kernel(q, k, v, t, n, scale=0.1, min_block_g=16)


def _structs(B, N, K, H, L, P, dtype, total_pages=64):
    sds = jax.ShapeDtypeStruct
    pages = sds((K, total_pages, L, H), dtype)
    return sds((B, N, H), dtype), pages, pages, sds((B, P), jnp.int32), sds((B,), jnp.int32)


# (q_heads, kv_heads, head_dim, page_size, pages per sequence, dtype): the real presets' shapes
# (head_dim 128, page_size 64; Qwen2.5-VL-3B/7B GQA 16/2 and 28/4, Qwen3-VL-2B/4B 16/8 and 32/8),
# the tiny model's, and shapes one rule or the other refuses.
GRID = [
    (16, 2, 128, 64, 8, jnp.bfloat16),
    (28, 4, 128, 64, 4, jnp.bfloat16),
    (16, 8, 128, 64, 16, jnp.bfloat16),
    (32, 8, 128, 16, 7, jnp.float32),
    (16, 2, 256, 16, 8, jnp.float32),
    (4, 2, 32, 16, 8, jnp.float32),
    (16, 2, 64, 16, 8, jnp.float32),
    (16, 2, 96, 16, 8, jnp.float32),
    (16, 2, 128, 12, 8, jnp.float32),
    (16, 2, 128, 8, 1, jnp.float32),
]


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("N,K,H,L,P,dtype", GRID)
def test_shape_rule_agrees_with_the_lowering(backend, N, K, H, L, P, dtype):
    why = pa.unsupported_reason(backend, head_dim=H, page_size=L)
    args = _structs(3, N, K, H, L, P, dtype)
    if why is None:
        text = _lower(backend, _kernel_fn(backend), *args)
        assert ("xla.gpu.triton" if backend == "gpu" else "tpu_custom_call") in text
    else:
        with pytest.raises(Exception, match="Pallas (TPU|Triton) lowering currently requires"):
            _lower(backend, _kernel_fn(backend), *args)


def _model(family: str, head_dim: int) -> nnx.Module:
    cfg = qwen_vl.config.tiny(family)
    if head_dim != cfg.text.head_dim:
        section = (24, 20, 20) if family == "qwen3_vl" else (16, 24, 24)  # sums to head_dim / 2
        text = dataclasses.replace(cfg.text, head_dim=head_dim, mrope_section=section)
        cfg = dataclasses.replace(cfg, text=text)
    return qwen_vl.QwenVL(cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_engine_decode_lowers_for_the_accelerator(family, backend):
    # head_dim 128 as in every real Qwen-VL checkpoint (the TPU kernel needs it).
    engine = Engine(
        _model(family, 128),
        max_slots=4,
        page_size=16,
        num_pages=64,
        max_seq_len=256,
        decode_chunk=4,
        attn_backend=backend,
    )
    S, P = 4, 8
    host = (
        np.zeros((S, P), np.int32),
        *[np.zeros(S, np.int32)] * 5,
        np.full((S, 4), -1, np.int32),
        SlotSampling.from_params([SamplingParams()] * S),
    )
    args = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), (engine._state, engine.cache, *host)
    )
    decode = functools.partial(steps.decode_paged, model=engine._model_def, cfg=engine.step_config)
    text = _lower(backend, decode, *args)
    assert ("xla.gpu.triton" if backend == "gpu" else "tpu_custom_call") in text


def test_auto_falls_back_explicit_backend_fails_up_front(caplog):
    with caplog.at_level(logging.WARNING):
        assert pa.select_backend("auto", head_dim=32, page_size=16, platform="tpu") == "reference"
    assert "head_dim % 128" in caplog.text
    assert pa.select_backend("auto", head_dim=128, page_size=64, platform="tpu") == "tpu"
    assert pa.select_backend("auto", head_dim=32, page_size=16, platform="cuda") == "gpu"
    assert pa.select_backend("auto", head_dim=128, page_size=12, platform="gpu") == "reference"
    assert pa.select_backend("auto", head_dim=32, page_size=12, platform="cpu") == "reference"
    with pytest.raises(ValueError, match=r"backend='tpu'.*head_dim % 128 == 0 \(got head_dim=32\)"):
        Engine(
            _model("qwen3_vl", 32), max_slots=2, num_pages=16, max_seq_len=128, attn_backend="tpu"
        )
    with pytest.raises(ValueError, match=r"power-of-two head_dim and page_size.*page_size=12"):
        pa.paged_attention(
            *[jnp.zeros(s.shape, s.dtype) for s in _structs(1, 4, 2, 32, 12, 2, jnp.float32)],
            backend="gpu",
        )


@pytest.mark.parametrize("spec", GPU_SWEEP)
def test_every_gpu_option_in_the_bench_sweep_lowers(spec):
    """What `tools/bench_paged_decode.py --parts=kernel` will compile on a GPU lowers to Triton
    here, so a GPU session's one bench call does not end in a lowering error."""
    opts = pa.GpuKernelOptions.parse(spec)
    args = _structs(3, 16, 8, 128, 64, 16, jnp.bfloat16)
    fn = lambda q, k, v, t, n: pa.paged_attention(q, k, v, t, n, backend="gpu", gpu_options=opts)  # noqa: E731
    text = _lower("gpu", fn, *args)
    assert "xla.gpu.triton" in text
    if opts.num_warps:
        assert f"num_warps = {opts.num_warps}" in text or f'"num_warps": {opts.num_warps}' in text
