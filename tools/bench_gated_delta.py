"""The chunked gated delta rule's gradient compiled for a TPU (libtpu, ahead of time, on this
CPU machine): the Pallas backward kernel against the reference's VJP, side by side.

    .venv/bin/python tools/bench_gated_delta.py [--topology v5e-1] [--tokens 512,4096,16384]

One Qwen3.5 linear-attention layer's rule (16 q/k heads, 32 value heads, 128-dim heads, bf16
inputs, an initial state and packed-row segment ids), one row of T tokens: the gradient of a
loss of the outputs and the final state in q, k, v, g, beta and the initial state, compiled
two ways:

- "pallas bwd": `kernel.chunk_gated_delta_rule_trainable`, the forward kernel saving each
  chunk's incoming state and the backward kernel walking the chunks in reverse (what the model
  runs with model.gated_delta_impl="pallas");
- "reference VJP": the Pallas forward with the backward of session 23-29, which recomputed the
  jnp reference (`reference.chunk_gated_delta_rule`) and took its VJP.

Printed for each: the compiled program's temporaries (`memory_analysis`), the bytes XLA's cost
model says it touches (`cost_analysis`; Mosaic kernels' own traffic is not in it), its Mosaic
kernels, and the compile time. No chip runs here: a TPU run is what would time them.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from cua_jax import plan
from cua_jax.models.qwen_vl.gated_delta import kernel as ker
from cua_jax.models.qwen_vl.gated_delta import reference as ref

M, N, H = 16, 32, 128  # Qwen3.5's linear layers: q/k heads, value heads, head dim


@functools.partial(jax.custom_vjp, nondiff_argnums=())
def _reference_vjp(q, k, v, g, beta, s0, seg):
    return ker.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, segment_ids=seg)


def _reference_vjp_fwd(*args):
    return _reference_vjp(*args), args


def _reference_vjp_bwd(res, cts):
    q, k, v, g, beta, s0, seg = res

    def rule(*x):
        return ref.chunk_gated_delta_rule(*x[:5], initial_state=x[5], segment_ids=seg)

    _, vjp = jax.vjp(rule, q, k, v, g, beta, s0)
    return (*vjp(cts), np.zeros(seg.shape, jax.dtypes.float0))


_reference_vjp.defvjp(_reference_vjp_fwd, _reference_vjp_bwd)


def _pallas(q, k, v, g, beta, s0, seg):
    return ker.chunk_gated_delta_rule_trainable(q, k, v, g, beta, initial_state=s0, segment_ids=seg)


def compile_gradient(rule, T: int, devices) -> dict:
    rep = NamedSharding(Mesh(np.array(devices[:1]), ("x",)), PartitionSpec())

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rep)

    def loss(*a):
        o, s = rule(*a)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(s * s)

    t0 = time.perf_counter()
    compiled = (
        jax.jit(jax.grad(loss, argnums=tuple(range(6))))
        .lower(
            sds((1, T, M, H), jnp.bfloat16),
            sds((1, T, M, H), jnp.bfloat16),
            sds((1, T, N, H), jnp.bfloat16),
            sds((1, T, N), jnp.float32),
            sds((1, T, N), jnp.float32),
            sds((1, N, H, H), jnp.float32),
            sds((1, T), jnp.int32),
        )
        .compile()
    )
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "mosaic_kernels": compiled.as_text().count("tpu_custom_call"),
        "compile_s": time.perf_counter() - t0,
    }


def main(argv=None) -> int:
    """Compiles both gradients for each --tokens on --topology and prints them side by side."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--topology", default="v5e-1")
    p.add_argument("--tokens", default="512,4096,16384")
    a = p.parse_args(argv)
    try:
        tokens = [int(t) for t in a.tokens.split(",")]
    except ValueError:
        p.error(f"--tokens={a.tokens!r}: comma-separated integers")
    try:
        devices = plan.abstract_devices(plan.get_topology(a.topology))
    except plan.PlanInputError as e:
        print(f"bench_gated_delta: {e}")
        return 2
    print(f"{a.topology}, one row, {M} q/k heads, {N} value heads, head dim {H}, chunk {ref.CHUNK}")
    print("| tokens | backward | temporaries | XLA bytes accessed | Mosaic kernels | compile |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for T in tokens:
        rows = {
            name: compile_gradient(rule, T, devices)
            for name, rule in (("reference VJP", _reference_vjp), ("pallas bwd", _pallas))
        }
        for name, r in rows.items():
            print(
                f"| {T} | {name} | {r['temp_bytes'] / 2**20:,.0f} MiB | "
                f"{r['bytes_accessed'] / 2**20:,.0f} MiB | {r['mosaic_kernels']} | "
                f"{r['compile_s']:.1f} s |"
            )
        old, new = rows["reference VJP"], rows["pallas bwd"]
        print(
            f"|  | ratio | {new['temp_bytes'] / old['temp_bytes']:.2f}x | "
            f"{new['bytes_accessed'] / max(old['bytes_accessed'], 1):.2f}x |  |  |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
