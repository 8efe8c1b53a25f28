"""Decode on an accelerator: the Pallas paged-attention kernel vs the jnp reference, and the
decode step's memory-bandwidth utilisation (figures go to BENCHMARKS.md).

    python tools/bench_paged_decode.py                       # on a GPU / TPU machine
    .venv/bin/python tools/bench_paged_decode.py --size=small --parts=kernel,bandwidth   # CPU

1. kernel: `paged_attention` through the platform's kernel (Triton on GPU, JAX's shipped Pallas
   kernel on TPU, Pallas interpret mode on CPU) vs the plain-jnp reference, jitted side by side
   on the same random paged K/V (ragged lengths, shuffled pages): compile time apart, median of
   alternating timed calls, max |difference|, and the bandwidth each reaches on the live K/V.
   On a GPU every tuning variant in `GPU_SWEEP` (pages per loop step, bf16 or f32 dots, Triton
   warps) gets its own row; a variant that fails to compile is reported, not fatal.
2. bandwidth: an `Engine` per `--backends` entry (default: the platform's kernel with default
   options, with the kernel part's fastest options if they differ, then the jnp reference)
   decoding `--batch` requests at once for a ~2B model (the text tower of Qwen3-VL-2B: hidden
   2048, 28 layers, GQA 16/8, head_dim 128, vocab 151936, tied embeddings, bf16; the vision
   tower is tiny since decode never runs it), random init, EOS off. Each decode step must read
   the decoder weights, the LM head and every live K/V byte once, so utilisation = (those bytes
   / step time) / (bandwidth of a plain device copy measured in the same run). Prefill and
   compile are excluded: only the engine's decode calls are timed. (On a CPU with `--size=small`
   the weights sit in cache, so "utilisation" can pass 100%.)

Needs jax, flax, numpy, safetensors and pillow, all in the GPU image (checked here under jax 0.11.2,
the image's version); no torch.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from cua_jax.models import qwen_vl
from cua_jax.sampler import Engine, SamplingParams
from cua_jax.sampler.kernels.paged_attention import (
    GpuKernelOptions,
    paged_attention,
    resolve_backend,
)
from tools import bench_setup


def _device() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{d.device_kind}"


def copy_bandwidth(nbytes: int, iters: int = 10) -> float:
    """Bytes read + written per second by a jitted elementwise copy (x + 1) of `nbytes`."""
    x = jnp.zeros((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: a + jnp.ones((), a.dtype))
    jax.block_until_ready(f(x))
    return 2 * nbytes / bench_setup.median_s(lambda: jax.block_until_ready(f(x)), iters)


# ------------------------------------------------------------------------------------ kernel
# GPU kernel variants the kernel part times side by side (`GpuKernelOptions.parse` specs; the
# first is the default). `tests/sampler/test_kernel_lowering.py` lowers each one for an H100.
GPU_SWEEP = tuple(
    f"pages_per_block={n},f32_dots={d},num_warps={w}"
    for d in ("true", "false")
    for n in (1, 2, 4)
    for w in ("none", 8)
)


def bench_kernel(args) -> str | None:
    """Returns the fastest GPU kernel variant's spec (None off a GPU)."""

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
    # One row per variant: the platform's kernel (every GPU variant on a GPU), then the reference.
    # Off a GPU only an explicit --gpu-options list is swept (interpret mode is slow).
    sweep = backend == "gpu" or (backend == "interpret" and args.gpu_options != "sweep")
    specs = _gpu_specs(args) if sweep else [""]
    fns = {}
    for spec in specs:
        opts = GpuKernelOptions.parse(spec)
        name = backend if len(specs) == 1 else f"{backend}[{_short(opts)}]"
        fns[name] = jax.jit(functools.partial(paged_attention, backend=backend, gpu_options=opts))
    fns["reference"] = jax.jit(functools.partial(paged_attention, backend="reference"))
    spec_of = dict(zip(fns, [*specs, None], strict=True))
    compile_s, outs, failed = {}, {}, {}
    for name, f in fns.items():
        t0 = time.perf_counter()
        try:
            outs[name] = np.asarray(jax.block_until_ready(f(q, k, v, table, lengths)), np.float32)
        except Exception as e:  # one variant failing to compile (e.g. shared memory) is a result
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            continue
        compile_s[name] = time.perf_counter() - t0
    fns = {n: f for n, f in fns.items() if n not in failed}
    calls = {
        n: lambda f=f: jax.block_until_ready(f(q, k, v, table, lengths)) for n, f in fns.items()
    }
    med = bench_setup.timed_rounds(calls, args.iters)  # alternate, so load hits all alike
    live = int(np.sum(np.asarray(lengths))) * K * H * 2 * dtype.itemsize
    print(
        f"\n== kernel: {_device()}, B={B} q_heads={N} kv_heads={K} head_dim={H} page={L} "
        f"ctx<={ctx} {dtype.name}; live K/V {live / 2**20:.1f} MiB =="
    )
    w = max(10, *(len(n) for n in spec_of))
    print(
        f"{'backend':>{w}} {'compile+1st s':>13} {'median ms':>10} {'live GB/s':>10} "
        f"{'ref / this':>10} {'max |diff|':>10}"
    )
    for name in fns:
        diff = float(np.max(np.abs(outs[name] - outs["reference"])))
        print(
            f"{name:>{w}} {compile_s[name]:>13.2f} {med[name] * 1e3:>10.3f} "
            f"{live / med[name] / 1e9:>10.1f} {med['reference'] / med[name]:>9.2f}x "
            f"{diff:>10.2e}"
        )
    for name, why in failed.items():
        print(f"{name:>{w}} failed: {why}")
    kernels = [n for n in fns if n != "reference"]
    if not kernels:
        return None
    best = min(kernels, key=med.get)
    print(
        f"fastest: {best} ({spec_of[best] or 'defaults'}), reference / fastest "
        f"{med['reference'] / med[best]:.2f}x"
    )
    return spec_of[best] if backend == "gpu" else None


def _gpu_specs(args) -> list[str]:

    specs = GPU_SWEEP if args.gpu_options == "sweep" else args.gpu_options.split(";")
    by_options = {GpuKernelOptions.parse(s): s.strip() for s in reversed(specs)}  # first wins
    return list(reversed(by_options.values()))


def _short(opts) -> str:
    """ "p4 bf16 w8" for pages_per_block=4, f32_dots=False, num_warps=8."""
    parts = [f"p{opts.pages_per_block}", "f32" if opts.f32_dots else "bf16"]
    parts += [f"w{opts.num_warps}"] * bool(opts.num_warps)
    parts += [f"s{opts.num_stages}"] * bool(opts.num_stages)
    return " ".join(parts)


# --------------------------------------------------------------------------------- bandwidth
def config_2b(size: str):
    """Qwen3-VL 2B's text shape (28 layers, hidden 2048); `size` "2b" keeps its vocabulary, else a
    4096 one."""

    base = qwen_vl.tiny("qwen3_vl", vocab_size=151936 if size == "2b" else 4096)
    dims = dict(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
    )
    if size == "small":  # same shape family, CPU-sized: checks the tool, not the hardware
        dims = dict(
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    text = dataclasses.replace(base.text, head_dim=128, mrope_section=(24, 20, 20), **dims)
    vision = dataclasses.replace(base.vision, out_hidden_size=dims["hidden_size"])
    return base.replace(
        text=text,
        vision=vision,
        tie_word_embeddings=True,
        dtype="bfloat16",
        param_dtype="bfloat16",
    )


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


def _decode_run(model, backend: str, args, gpu_options: str = "") -> dict:
    """One engine with `backend` decoding args.batch requests twice (the first run compiles);
    the decode calls of the second run are timed one by one."""

    t = model.config.text
    B, prompt, new, C = args.batch, args.prompt_len, args.new_tokens, args.decode_chunk
    page = 64
    per_seq = -(-(prompt + new) // page) + 1
    engine = Engine(
        model,
        max_slots=B,
        page_size=page,
        num_pages=B * per_seq + 1,
        max_seq_len=per_seq * page,
        decode_chunk=C,
        attn_backend=backend,
        attn_options=gpu_options,
    )
    calls: list[tuple[float, np.ndarray, np.ndarray]] = []
    decode = engine._decode_fn

    def timed(*a):
        out, dt = bench_setup.timed(lambda: jax.block_until_ready(decode(*a)))
        calls.append((dt, np.asarray(a[3]), np.asarray(a[6])))
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
        attn=engine._attn,
        first_s=first_s,
        wall=wall,
        calls=len(calls),
        steps=steps,
        per_step=step_time / steps,
        kv_bytes=kv_bytes / steps,
        tokens=[o.tokens for o in outs],
    )


_WIDTHS = (10, 10, 9, 8, 8, 12, 8, 7, 6, 11)


def bench_bandwidth(args, best_spec: str | None = None) -> None:
    """Decodes with the 2B-shaped model through an Engine per `--backends` entry and prints a
    table: ms/step, tokens/s, the bytes read per step (weights + K/V) over the step time, and
    that as a share of the device's measured copy bandwidth."""
    from flax import nnx

    cfg = config_2b(args.size)
    t0 = time.perf_counter()
    model = qwen_vl.QwenVL(cfg, rngs=nnx.Rngs(0))
    init_s = time.perf_counter() - t0
    B, new = args.batch, args.new_tokens
    w_bytes = decode_weight_bytes(model)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    runs = {}
    for b in args.backends.split(","):
        if b != "best":
            runs[b] = _decode_run(model, b, args)
        elif best_spec is None or GpuKernelOptions.parse(best_spec) == GpuKernelOptions():
            print(
                f"(backend 'best' skipped: the kernel part found no GPU variant faster than the "
                f"defaults{'' if best_spec is None else ' (' + best_spec + ')'})"
            )
        else:
            runs[f"gpu[{_short(GpuKernelOptions.parse(best_spec))}]"] = _decode_run(
                model, "gpu", args, best_spec
            )
    copy_bw = copy_bandwidth(args.copy_mib * 2**20)
    print(
        f"\n== bandwidth: {_device()}, {args.size} ({n_params / 1e6:.0f}M params, bf16, "
        f"init {init_s:.1f} s), batch {B}, prompt {args.prompt_len} + {new} new, "
        f"decode_chunk {args.decode_chunk}; weights read per step {w_bytes / 2**30:.3f} GiB; "
        f"copy bandwidth (read + write) {copy_bw / 1e9:.1f} GB/s =="
    )
    head = (
        "backend",
        "attention",
        "1st run s",
        "timed s",
        "ms/step",
        "decode tok/s",
        "K/V GiB",
        "GB/s",
        "util",
        "same tokens",
    )
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, _WIDTHS, strict=True)))
    ref = next(iter(runs.values()))["tokens"]
    for b, r in runs.items():
        step_bytes = w_bytes + r["kv_bytes"]
        achieved = step_bytes / r["per_step"]
        same = np.mean([x == y for x, y in zip(r["tokens"], ref, strict=True)])
        cells = (
            b,
            r["attn"],
            f"{r['first_s']:.1f}",
            f"{r['wall']:.2f}",
            f"{r['per_step'] * 1e3:.2f}",
            f"{B / r['per_step']:.0f}",
            f"{r['kv_bytes'] / 2**30:.3f}",
            f"{achieved / 1e9:.1f}",
            f"{achieved / copy_bw:.1%}",
            f"{same:.0%}",
        )
        print(" ".join(f"{c:>{w}}" for c, w in zip(cells, _WIDTHS, strict=True)))


def main() -> None:
    """The command line: runs what the module docstring describes."""
    ap = bench_setup.arg_parser(__doc__, paragraph=True)
    ap.add_argument("--parts", default="kernel,bandwidth")
    ap.add_argument("--size", choices=("2b", "small"), default="2b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--decode-chunk", type=int, default=16)
    ap.add_argument(
        "--backends",
        default="auto,best,reference",
        help="bandwidth part: engine attention backends, side by side (tokens vs the first); "
        "'best' is the GPU kernel with the kernel part's fastest options (run when they differ "
        "from the defaults)",
    )
    ap.add_argument(
        "--gpu-options",
        default="sweep",
        help="kernel part: GPU kernel variants to time, ';'-separated GpuKernelOptions specs "
        "(e.g. 'pages_per_block=1;pages_per_block=4,f32_dots=false'), or 'sweep' for GPU_SWEEP; "
        "off a GPU, an explicit list runs in interpret mode",
    )
    ap.add_argument("--copy-mib", type=int, default=2048)
    ap.add_argument("--dtype", default="bfloat16", help="kernel part's q / K / V dtype")
    ap.add_argument(
        "--kernel-shape",
        default="64,16,8,128,64,2048",
        help="kernel part: batch,q_heads,kv_heads,head_dim,page_size,max_context",
    )
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
    print(
        f"jax {jax.__version__}, devices {jax.devices()}, {now}, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    best_spec = bench_kernel(args) if "kernel" in parts else None
    if "bandwidth" in parts:
        bench_bandwidth(args, best_spec)


if __name__ == "__main__":
    main()
