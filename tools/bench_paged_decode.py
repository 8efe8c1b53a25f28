"""Decode on an accelerator: the Pallas paged-attention kernel vs the jnp reference, and the
decode step's memory-bandwidth utilisation (figures go to BENCHMARKS.md).

    python tools/bench_paged_decode.py                       # on a GPU / TPU machine
    .venv/bin/python tools/bench_paged_decode.py --size=small --parts=kernel,bandwidth   # CPU

1. kernel: `paged_attention` through the platform's kernel (Triton on GPU, JAX's shipped Pallas
   kernel on TPU, Pallas interpret mode on CPU) vs the plain-jnp reference, jitted side by side
   on the same random paged K/V (ragged lengths, shuffled pages): compile time apart, median of
   alternating timed calls, max |difference|, and the bandwidth each reaches on the live K/V.
2. bandwidth: an `Engine` per `--backends` entry (default: the platform's kernel, then the jnp
   reference) decoding `--batch` requests at once for a ~2B model (the text tower of
   Qwen3-VL-2B: hidden 2048, 28 layers, GQA 16/8, head_dim 128, vocab 151936, tied embeddings,
   bf16; the vision tower is tiny since decode never runs it), random init, EOS off. Each decode
   step must read the decoder weights, the LM head and every live K/V byte once, so
   utilisation = (those bytes / step time) / (bandwidth of a plain device copy measured in the
   same run). Prefill and compile are excluded: only the engine's decode calls are timed. (On a
   CPU with `--size=small` the weights sit in cache, so "utilisation" can pass 100%.)

Needs jax, flax, numpy, safetensors and pillow, all in the GPU image (checked here under jax 0.11.2,
the image's version); no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def _device() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{d.device_kind}"


def _time(fn, *args, iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out.append(time.perf_counter() - t0)
    return out


def copy_bandwidth(nbytes: int, iters: int = 10) -> float:
    """Bytes read + written per second by a jitted elementwise copy (x + 1) of `nbytes`."""
    x = jnp.zeros((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: a + jnp.ones((), a.dtype))
    jax.block_until_ready(f(x))
    return 2 * nbytes / statistics.median(_time(f, x, iters=iters))


# ------------------------------------------------------------------------------------ kernel
def bench_kernel(args) -> None:
    from cua_jax.sampler.kernels.paged_attention import paged_attention, resolve_backend

    backend = resolve_backend("auto")
    backend = "interpret" if backend == "reference" else backend
    B, N, K, H, L, ctx = args.kernel_shape
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    lengths = rng.integers(ctx // 2, ctx + 1, B).astype(np.int32)
    lengths[0] = 0  # an empty slot, as in a partly filled decode batch
    P = -(-ctx // L)
    total = B * P + 1
    table = rng.permutation(np.arange(1, total))[: B * P].reshape(B, P).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((B, N, H)), dtype)
    k = jnp.asarray(rng.standard_normal((K, total, L, H)), dtype)
    v = jnp.asarray(rng.standard_normal((K, total, L, H)), dtype)
    table, lengths = jnp.asarray(table), jnp.asarray(lengths)
    fns = {
        name: jax.jit(functools.partial(paged_attention, backend=name))
        for name in (backend, "reference")
    }
    compile_s, outs = {}, {}
    for name, f in fns.items():
        t0 = time.perf_counter()
        outs[name] = np.asarray(jax.block_until_ready(f(q, k, v, table, lengths)), np.float32)
        compile_s[name] = time.perf_counter() - t0
    times = {name: [] for name in fns}
    for _ in range(args.iters):  # alternate, so load hits both alike
        for name, f in fns.items():
            times[name] += _time(f, q, k, v, table, lengths, iters=1)
    live = int(np.sum(np.asarray(lengths))) * K * H * 2 * dtype.itemsize
    diff = float(np.max(np.abs(outs[backend] - outs["reference"])))
    print(f"\n== kernel: {_device()}, B={B} q_heads={N} kv_heads={K} head_dim={H} page={L} "
          f"ctx<={ctx} {dtype.name}; live K/V {live / 2**20:.1f} MiB ==")  # fmt: skip
    print(f"{'backend':>10} {'compile+1st s':>13} {'median ms':>10} {'live GB/s':>10}")
    for name in fns:
        med = statistics.median(times[name])
        print(f"{name:>10} {compile_s[name]:>13.2f} {med * 1e3:>10.3f} {live / med / 1e9:>10.1f}")
    ratio = statistics.median(times["reference"]) / statistics.median(times[backend])
    print(f"reference / {backend}: {ratio:.2f}x; max |difference| {diff:.2e}")


# --------------------------------------------------------------------------------- bandwidth
def config_2b(size: str):
    from cua_jax.models import qwen_vl

    base = qwen_vl.tiny("qwen3_vl", vocab_size=151936 if size == "2b" else 4096)
    dims = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                num_attention_heads=16, num_key_value_heads=8)  # fmt: skip
    if size == "small":  # same shape family, CPU-sized: checks the tool, not the hardware
        dims = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                    num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    text = dataclasses.replace(base.text, head_dim=128, mrope_section=(24, 20, 20), **dims)
    vision = dataclasses.replace(base.vision, out_hidden_size=dims["hidden_size"])
    return base.replace(
        text=text, vision=vision, tie_word_embeddings=True, dtype="bfloat16",
        param_dtype="bfloat16",
    )  # fmt: skip


def decode_weight_bytes(model) -> int:
    """Parameter bytes one decode step reads: the decoder layers, the final norm, the LM head."""
    from flax import nnx

    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]:
        name = "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
        head = "lm_head" in name or ("embed_tokens" in name and model.config.tie_word_embeddings)
        if ("language_model" in name and "embed_tokens" not in name) or head:
            total += leaf.size * leaf.dtype.itemsize
    return total


def _decode_run(model, backend: str, args) -> dict:
    """One engine with `backend` decoding args.batch requests twice (the first run compiles);
    the decode calls of the second run are timed one by one."""
    from cua_jax.sampler import Engine, SamplingParams

    t = model.config.text
    B, prompt, new, C = args.batch, args.prompt_len, args.new_tokens, args.decode_chunk
    page = 64
    per_seq = -(-(prompt + new) // page) + 1
    engine = Engine(
        model, max_slots=B, page_size=page, num_pages=B * per_seq + 1,
        max_seq_len=per_seq * page, decode_chunk=C, attn_backend=backend,
    )  # fmt: skip
    calls: list[tuple[float, np.ndarray, np.ndarray]] = []
    decode = engine._decode_fn

    def timed(*a):
        t0 = time.perf_counter()
        out = jax.block_until_ready(decode(*a))
        calls.append((time.perf_counter() - t0, np.asarray(a[3]), np.asarray(a[6])))
        return out

    engine._decode_fn = timed
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_new_tokens=new)  # no stop tokens: EOS off
    reqs = [
        dict(prompt_ids=rng.integers(0, t.vocab_size - 16, prompt), params=params) for _ in range(B)
    ]
    t0 = time.perf_counter()
    engine.generate_batch(reqs)  # compiles prefill and decode
    first_s = time.perf_counter() - t0
    calls.clear()
    t0 = time.perf_counter()
    outs = engine.generate_batch(reqs)
    wall = time.perf_counter() - t0
    assert all(len(o.tokens) == new for o in outs), "a request stopped early"
    kv_per_token = t.num_hidden_layers * 2 * t.num_key_value_heads * t.head_dim
    kv_per_token *= jnp.dtype(engine.cache.k[0].dtype).itemsize
    steps = step_time = kv_bytes = 0.0
    for dt, lengths, n_steps in calls:
        for i in range(int(n_steps.max())):
            live = n_steps > i
            kv_bytes += float(np.sum((lengths + i + 1) * live)) * kv_per_token
        steps += int(n_steps.max())
        step_time += dt
    return dict(
        attn=engine._attn, first_s=first_s, wall=wall, calls=len(calls), steps=steps,
        per_step=step_time / steps, kv_bytes=kv_bytes / steps, tokens=[o.tokens for o in outs],
    )  # fmt: skip


_WIDTHS = (10, 10, 9, 8, 8, 12, 8, 7, 6, 11)


def bench_bandwidth(args) -> None:
    from flax import nnx

    from cua_jax.models import qwen_vl

    cfg = config_2b(args.size)
    t0 = time.perf_counter()
    model = qwen_vl.QwenVL(cfg, rngs=nnx.Rngs(0))
    init_s = time.perf_counter() - t0
    B, new = args.batch, args.new_tokens
    w_bytes = decode_weight_bytes(model)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    runs = {b: _decode_run(model, b, args) for b in args.backends.split(",")}
    copy_bw = copy_bandwidth(args.copy_mib * 2**20)
    print(f"\n== bandwidth: {_device()}, {args.size} ({n_params / 1e6:.0f}M params, bf16, "
          f"init {init_s:.1f} s), batch {B}, prompt {args.prompt_len} + {new} new, "
          f"decode_chunk {args.decode_chunk}; weights read per step {w_bytes / 2**30:.3f} GiB; "
          f"copy bandwidth (read + write) {copy_bw / 1e9:.1f} GB/s ==")  # fmt: skip
    head = ("backend", "attention", "1st run s", "timed s", "ms/step", "decode tok/s", "K/V GiB",
            "GB/s", "util", "same tokens")  # fmt: skip
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, _WIDTHS, strict=True)))
    ref = next(iter(runs.values()))["tokens"]
    for b, r in runs.items():
        step_bytes = w_bytes + r["kv_bytes"]
        achieved = step_bytes / r["per_step"]
        same = np.mean([x == y for x, y in zip(r["tokens"], ref, strict=True)])
        cells = (b, r["attn"], f"{r['first_s']:.1f}", f"{r['wall']:.2f}",
                 f"{r['per_step'] * 1e3:.2f}", f"{B / r['per_step']:.0f}",
                 f"{r['kv_bytes'] / 2**30:.3f}", f"{achieved / 1e9:.1f}",
                 f"{achieved / copy_bw:.1%}", f"{same:.0%}")  # fmt: skip
        print(" ".join(f"{c:>{w}}" for c, w in zip(cells, _WIDTHS, strict=True)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="kernel,bandwidth")
    ap.add_argument("--size", choices=("2b", "small"), default="2b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--decode-chunk", type=int, default=16)
    ap.add_argument(
        "--backends", default="auto,reference",
        help="bandwidth part: engine attention backends, side by side (tokens vs the first)",
    )  # fmt: skip
    ap.add_argument("--copy-mib", type=int, default=2048)
    ap.add_argument("--dtype", default="bfloat16", help="kernel part's q / K / V dtype")
    ap.add_argument(
        "--kernel-shape", default="64,16,8,128,64,2048",
        help="kernel part: batch,q_heads,kv_heads,head_dim,page_size,max_context",
    )  # fmt: skip
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    try:
        args.kernel_shape = tuple(int(x) for x in args.kernel_shape.split(","))
        assert len(args.kernel_shape) == 6
    except (ValueError, AssertionError):
        ap.error(f"--kernel-shape={args.kernel_shape!r}: six comma-separated integers")
    parts = set(args.parts.split(","))
    if parts - {"kernel", "bandwidth"}:
        ap.error(f"--parts={args.parts!r}: choose from kernel,bandwidth")
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"jax {jax.__version__}, devices {jax.devices()}, {now}, "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    if "kernel" in parts:
        bench_kernel(args)
    if "bandwidth" in parts:
        bench_bandwidth(args)


if __name__ == "__main__":
    main()
