"""The decode chunk's memory: its K/V writes keep the page pools in place, and remat is off.

* `steps.write_kv` writes the same cells with the same values as `kv_cache.write_kv` (the
  reference scatter), but as single head_dim rows, so the TPU compiler keeps the pools in the
  Pallas kernel's layout: the engine's decode chunk, compiled for a TPU v5e chip with libtpu
  (ahead of time, no TPU needed), holds no second copy of a pool and reads far less than one
  pool per step. With the reference scatter it copied every layer's pool into the kernel's
  layout at every step (XLA: ~9x the pool's bytes per step here; a whole second pool of temp
  for the 2b preset on v5p-8, BENCHMARKS.md "TPU plan").
* A model with remat (every real preset trains with remat) samples exactly as without it: the
  engine's model runs with remat off (under jax.checkpoint the K/V writes leaked out of the
  trace: UnexpectedTracerError), and the caller's model keeps its remat.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cua_jax.models import qwen_vl
from cua_jax.sampler import kv_cache, steps
from cua_jax.sampler.engine import Engine
from cua_jax.sampler.sampling import SamplingParams


def test_write_kv_writes_the_reference_cells():
    rng = np.random.default_rng(0)
    K, P, L, H, B, T = 3, 10, 4, 8, 3, 5
    kp = jnp.asarray(rng.normal(size=(K, P, L, H)), jnp.float32)
    vp = jnp.asarray(rng.normal(size=(K, P, L, H)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32)
    cells = rng.permutation((P - 1) * L)[: B * T].reshape(B, T) + L  # distinct, not page 0
    page, off = jnp.asarray(cells // L), jnp.asarray(cells % L)
    page = page.at[2, 3:].set(0)  # padding tokens: the trash page 0 (duplicates)
    got = jax.jit(steps.write_kv)(kp, vp, k, v, page, off)
    want = kv_cache.write_kv(kp, vp, k, v, page, off)
    for g, w, before in zip(got, want, (kp, vp), strict=True):
        # page 0 takes duplicate writes in either order; every other cell must be equal
        np.testing.assert_array_equal(np.asarray(g)[:, 1:], np.asarray(w)[:, 1:])
        assert not np.array_equal(np.asarray(g)[:, 1:], np.asarray(before)[:, 1:])


def _cfg(remat: str = "none", head_dim: int | None = None) -> qwen_vl.QwenVLConfig:
    cfg = qwen_vl.tiny("qwen3_vl")
    if head_dim is not None:  # 128: the TPU kernel's minimum (every real checkpoint's)
        text = dataclasses.replace(cfg.text, head_dim=head_dim, mrope_section=(24, 20, 20))
        cfg = dataclasses.replace(cfg, text=text)
    return cfg.replace(remat=remat)


def test_a_model_with_remat_samples_as_without():
    remat = "full"  # the real presets' (FIT); "dots" goes through the same jax.checkpoint
    sp = SamplingParams(temperature=1.0, seed=3, max_new_tokens=10)
    reqs = [{"prompt_ids": [1, 5, 7, 9, 11], "params": sp}, {"prompt_ids": [3, 4], "params": sp}]
    outs = {}
    for r in ("none", remat):
        model = qwen_vl.QwenVL(_cfg(r), rngs=nnx.Rngs(0))
        engine = Engine(
            model,
            max_slots=2,
            num_pages=32,
            max_seq_len=64,
            decode_chunk=4,
            attn_backend="reference",
        )
        outs[r] = engine.generate_batch(reqs)
        assert model.config.remat == r and model.model.language_model.cfg.remat == r
    for a, b in zip(outs["none"], outs[remat], strict=True):
        assert len(a.tokens) == 10 and list(a.tokens) == list(b.tokens)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)


def test_decode_chunk_for_tpu_keeps_the_pools_in_place():
    pytest.importorskip("libtpu", reason="libtpu (the TPU compiler) is not installed")
    from cua_jax import plan as plan_lib
    from cua_jax import sharding as shd
    from cua_jax.sampler import placement

    devices = plan_lib.abstract_devices(plan_lib.get_topology("v5e-1"))
    mesh = shd.make_mesh(1, 1, 1, devices=devices)
    # 2 kv heads on the device (the layout copy needs K > 1), remat on as in the real presets
    cfg = _cfg("dots", head_dim=128).replace(dtype="bfloat16")
    model = nnx.eval_shape(lambda: qwen_vl.QwenVL(cfg, rngs=nnx.Rngs(0)))
    model_def, params = steps.ModelDef.of(model)
    param_sh = placement.target_shardings(params, mesh, shd.DEFAULT_RULES)
    params = plan_lib.with_shardings(params, param_sh)
    t, S, pages, L, P = cfg.text, 4, 1024, 16, 16
    kv_sh = placement.kv_sharding(mesh)
    cache = steps.abstract_cache(
        t.num_hidden_layers, t.num_key_value_heads, pages, L, t.head_dim, jnp.bfloat16, kv_sh
    )
    step_cfg = steps.StepConfig(
        page_size=L, decode_chunk=4, head_dim=t.head_dim, attn_backend="tpu", mesh=mesh
    )
    sh = steps.StepShardings(param_sh, kv_sh, placement.replicated(mesh))
    fns = steps.build_step_fns(model_def, step_cfg, sh, t.num_hidden_layers)
    # Mosaic cannot compile the kernel's dot of bf16 K/V at "highest" (the tests' default)
    with jax.default_matmul_precision("default"):
        compiled = fns.decode_paged.lower(params, cache, *steps.decode_arg_shapes(S, P)).compile()
    text = compiled.as_text()
    assert "tpu_custom_call" in text  # the Pallas TPU kernel is in the loop
    pool = f"bf16[{t.num_key_value_heads},{pages},{L},{t.head_dim}]"
    copies = [
        ln
        for ln in text.splitlines()
        if re.search(re.escape(pool) + r"\{[^}]*\} copy(-start)?\(", ln)
    ]
    assert not copies, copies[:2]
    pool_bytes = plan_lib.tree_shard_bytes(cache)
    m = compiled.memory_analysis()
    assert m.alias_size_in_bytes == pool_bytes  # donated, updated in place
    assert m.temp_size_in_bytes < pool_bytes / 8
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    # one loop step reads the params, the live K/V (inside the kernel: not counted) and writes
    # S tokens' K/V; the reference scatter made it ~9 pools' worth
    assert cost["bytes accessed"] < pool_bytes / 2
