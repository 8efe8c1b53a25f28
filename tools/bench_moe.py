"""Qwen3-VL-MoE on CPU: the jitted cua_jax forward vs transformers, and the expert dispatch
(grouped matmuls, `jax.lax.ragged_dot`) vs a dense all-experts einsum, side by side.

    .venv/bin/python tools/bench_moe.py [--rounds 7] [--threads N] [--skip-hf]

1. Forward: tools/bench_forward.py's Qwen3-VL config (text hidden 512, 4 layers, GQA 8/4 heads;
   vision hidden 256, 4 blocks) with every decoder MLP a sparse MoE block (8 experts, top-2,
   expert width 352), the same weights (a random transformers `Qwen3VLMoeForConditionalGeneration`
   saved and loaded with `qwen_vl.from_pretrained`), the same inputs (one 280x392 image + text,
   300 tokens, batch 1), f32.
2. Dispatch: one MoE block's expert MLPs on N tokens (router, top-k, experts, combine), jitted:
   `moe.expert_mlp` (tokens sorted by expert, two grouped matmuls over the N*K routed rows) vs
   every expert on every token (einsums over E, one-hot combine): E=8 top-2 and E=64 top-8.

3. Expert parallelism (`--ep`, on 8 forced host devices, `moe_dispatch` "all_gather" vs
   "all_to_all"): one MoE block's forward + backward on a mesh with expert=8, tokens arriving
   split over the expert axis ("split") or replicated over it ("replicated", the default rules'
   batch axes without "expert"); from each compiled program's HLO, the collectives with their
   buffer sizes and a per-device byte model (`cua_jax.plan.collectives`: all-gather (g-1)/g of
   the result, all-reduce 2(g-1)/g, all-to-all (g-1)/g, g the group size); the rows the routing
   actually sends off device (what `ragged_all_to_all` moves on TPU, where the CPU's dense
   emulation moves padded buffers); CPU wall time of both. `--ep-tpu v5e-8` also compiles both
   for that TPU topology (libtpu, ahead of time) to show the ragged-all-to-all and its buffers.

Every variant is compiled first (compile times are printed apart); then each round times every
variant once, in turn, so background load on a shared machine hits them alike; medians of the
rounds and the ratios are printed, with the outputs' max |diff| (the two compute the same thing).
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from cua_jax import plan
from cua_jax import sharding as shd
from cua_jax.models import qwen_vl
from cua_jax.models.qwen_vl import moe
from cua_jax.plan.collectives import hlo_collectives
from tools import bench_setup
from tools.bench_forward import forward_pair, hf_dicts, inputs

MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=352, decoder_sparse_step=1)


def hf_moe_model():
    """A random transformers Qwen3-VL MoE model: bench_forward's Qwen3-VL config with 8 experts,
    top-2, in every layer; with its image, vision-start and vision-end token ids."""
    import torch
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    ids, text, vision = hf_dicts("qwen3_vl")
    text.update(MOE)
    torch.manual_seed(0)
    cfg = Qwen3VLMoeConfig(text_config=text, vision_config=vision, **ids)
    model = Qwen3VLMoeForConditionalGeneration(cfg).float().eval()
    return model, ids["image_token_id"], ids["vision_start_token_id"], ids["vision_end_token_id"]


def bench_forward(rounds: int) -> dict:
    """The MoE model's forward through transformers and cua_jax (bench_forward's inputs); compile
    time, median milliseconds, their ratio and the logits' difference."""
    import torch

    hf, image_id, start_id, end_id = hf_moe_model()
    ids, pv, grid = inputs("qwen3_vl", image_id, start_id, end_id)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        model = qwen_vl.from_pretrained(d)
    assert model.config.text.num_experts == MOE["num_experts"]
    hf_call, jax_call, first, out = forward_pair(hf, model, ids, pv, grid, image_id)
    with torch.no_grad():
        ref = hf_call().logits.numpy()  # warm-up too
        med = bench_setup.timed_rounds({"transformers": hf_call, "jax": jax_call}, rounds)
    return dict(
        tokens=ids.shape[1],
        compile_s=first - med["jax"],
        jax_ms=med["jax"] * 1e3,
        hf_ms=med["transformers"] * 1e3,
        ratio=med["transformers"] / med["jax"],
        max_abs_diff=float(np.abs(np.asarray(out) - ref).max()),
        max_abs_logit=float(np.abs(ref).max()),
    )


def dense_all_experts(x_ND, gate_DE, gate_up, down, top_k):
    """Every expert on every token, combined by the routed (renormalised top-k) weights."""
    import jax
    import jax.numpy as jnp

    w_NK, e_NK = moe.route(x_ND @ gate_DE, top_k)
    h = jnp.einsum("nd,edxf->nexf", x_ND, gate_up)
    y = jnp.einsum("nef,efd->ned", jax.nn.silu(h[:, :, 0]) * h[:, :, 1], down)
    comb_NE = jnp.sum(jax.nn.one_hot(e_NK, gate_up.shape[0]) * w_NK[..., None], axis=1)
    return jnp.einsum("ned,ne->nd", y, comb_NE)


def grouped(x_ND, gate_DE, gate_up, down, top_k):
    """The routed experts through `moe.expert_mlp` (the layer's own dispatch)."""

    w_NK, e_NK = moe.route(x_ND @ gate_DE, top_k)
    return moe.expert_mlp(x_ND, w_NK, e_NK, {"gate_up": gate_up, "down": down}, 0)


def bench_dispatch(rounds: int, tokens: int, dim: int, width: int, cases) -> list[dict]:
    """Grouped dispatch vs every expert on every token, for each (experts, top_k) of `cases`: one
    dict a case with median milliseconds, compile seconds and their max difference."""
    import functools

    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(tokens, dim)), jnp.float32)
    fns, args, compile_s, outs = {}, {}, {}, {}
    for E, K in cases:
        a = (
            x,
            jnp.asarray(rng.normal(size=(dim, E)) / np.sqrt(dim), jnp.float32),
            jnp.asarray(rng.normal(size=(E, dim, 2, width)) / np.sqrt(dim), jnp.float32),
            jnp.asarray(rng.normal(size=(E, width, dim)) / np.sqrt(width), jnp.float32),
        )
        for name, impl in (("grouped", grouped), ("dense", dense_all_experts)):
            f = jax.jit(functools.partial(impl, top_k=K))
            t0 = time.perf_counter()
            outs[E, K, name] = np.asarray(jax.block_until_ready(f(*a)))
            compile_s[E, K, name] = time.perf_counter() - t0
            fns[E, K, name] = functools.partial(lambda f, a: jax.block_until_ready(f(*a)), f, a)
            args[E, K, name] = a
    med = bench_setup.timed_rounds(fns, rounds)
    rows = []
    for E, K in cases:
        g, d = med[E, K, "grouped"], med[E, K, "dense"]
        rows.append(
            dict(
                experts=E,
                top_k=K,
                tokens=tokens,
                dim=dim,
                width=width,
                grouped_ms=g * 1e3,
                dense_ms=d * 1e3,
                dense_over_grouped=d / g,
                compile_grouped_s=compile_s[E, K, "grouped"],
                compile_dense_s=compile_s[E, K, "dense"],
                max_abs_diff=float(np.abs(outs[E, K, "grouped"] - outs[E, K, "dense"]).max()),
            )
        )
    return rows


def _ep_block(E, K, D, F, dtype, devices, tokens, layout, dispatch, abstract):
    """A jitted forward+backward of one MoE block on an expert=len(devices) mesh, its abstract
    arguments, and the block (random weights; abstract when `devices` are a TPU topology's)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    cfg = qwen_vl.tiny("qwen3_vl", moe=dict(num_experts=E, num_experts_per_tok=K))
    text = dataclasses.replace(cfg.text, hidden_size=D, moe_intermediate_size=F)
    vision = dataclasses.replace(cfg.vision, out_hidden_size=D)
    cfg = cfg.replace(
        text=text, vision=vision, param_dtype=dtype, dtype=dtype, moe_dispatch=dispatch
    )
    mesh = shd.make_mesh(1, 1, 1, devices=devices, expert=len(devices))
    make = lambda: moe.SparseMoeBlock(cfg, rngs=nnx.Rngs(0))  # noqa: E731
    block = nnx.eval_shape(make) if abstract else make()
    if not abstract:
        shd.shard_model(block, mesh)
    block.use_mesh(mesh)
    graphdef, state = nnx.split(block)

    def placed(path, var):
        v = var.get_value()
        sharding = shd.named_sharding(shd.logical_axes(var), tuple(v.shape), mesh)
        return var.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding))

    state_abs = nnx.map_state(placed, state)
    x_sh = NamedSharding(mesh, P("expert" if layout == "split" else None, None, None))
    x_abs = jax.ShapeDtypeStruct((8, tokens // 8, D), jnp.dtype(dtype), sharding=x_sh)

    def step(state, x):
        def loss(state, x):
            y, _, _ = nnx.merge(graphdef, state)(x)
            return jnp.sum(jnp.square(y.astype(jnp.float32))), y

        (_, y), g = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(state, x)
        return y, g

    fn = jax.jit(step, out_shardings=(x_sh, None))
    return fn, state_abs, x_abs, state, x_sh


def _call(compiled, state, x):
    import jax

    return jax.block_until_ready(compiled(state, x))


def bench_expert_parallel(rounds, tokens, E, K, D, F, dtype, devices, run):
    """Both dispatches of one MoE block in both token layouts on `devices` (expert axis =
    all of them): compiled HLO collectives, and (run=True, CPU) median wall milliseconds, the
    outputs' difference and the share of routed rows that leave their device. One dict a
    (layout, dispatch)."""
    import functools

    import jax
    import jax.numpy as jnp

    rows, fns, outs = [], {}, {}
    n_dev = len(devices)
    off = (n_dev - 1) / n_dev
    x_np = np.random.default_rng(0).normal(size=(8, tokens // 8, D))
    gate = None
    for layout in ("split", "replicated"):
        for dispatch in ("all_gather", "all_to_all"):
            fn, state_abs, x_abs, state, x_sh = _ep_block(
                E, K, D, F, dtype, devices, tokens, layout, dispatch, abstract=not run
            )
            t0 = time.perf_counter()
            compiled = fn.lower(state_abs, x_abs).compile()
            compile_s = time.perf_counter() - t0
            colls = hlo_collectives(compiled.as_text())
            mem = compiled.memory_analysis()
            temp = getattr(mem, "temp_size_in_bytes", None) if mem is not None else None
            row = dict(layout=layout, dispatch=dispatch, compile_s=compile_s, collectives=colls)
            rows.append(row | dict(temp_bytes=temp))
            if run:
                x = jax.device_put(jnp.asarray(x_np, x_abs.dtype), x_sh)
                y, _ = compiled(state, x)
                outs[layout, dispatch] = np.asarray(y, np.float32)
                fns[layout, dispatch] = functools.partial(_call, compiled, state, x)
                gate = np.asarray(state["gate"]["kernel"].get_value(), np.float32)
    if run:
        med = bench_setup.timed_rounds(fns, rounds)
        ref = outs["split", "all_gather"]
        # rows the routing sends off their device (what the ragged op moves), same inputs
        x = x_np.reshape(-1, D).astype(np.float32)
        _, e = moe.route(jnp.asarray(x @ gate), K)
        src = np.repeat(np.arange(x.shape[0]) // (x.shape[0] // n_dev), K)
        off = float(np.mean(src != np.asarray(e).reshape(-1) // (E // n_dev)))
        for r in rows:
            key = r["layout"], r["dispatch"]
            r["ms"] = med[key] * 1e3
            r["max_abs_diff"] = float(np.abs(outs[key] - ref).max())
    # The ragged op's traffic per device, forward + backward: each direction's rows off device,
    # there and back (the measured share with run=True, else a uniform router's (P-1)/P).
    for r in rows:
        r["rows_off_device_share"] = off
        r["ragged_bytes"] = 4 * off * (tokens // n_dev) * K * D * jnp.dtype(dtype).itemsize
    return rows


def _print_ep(rows, label):
    for r in rows:
        by = {}
        for c in r["collectives"]:
            k = by.setdefault(c["kind"], [0, 0.0, 0])
            k[0] += 1
            # the ragged op's bytes are the routing's (below), measured rather than uniform
            k[1] += 0.0 if c["kind"] == "ragged-all-to-all" else c["moved"] * c["runs"]
            k[2] += c["bytes"]
        total = sum(v[1] for v in by.values())
        parts = " ".join(
            f"{k} x{v[0]} (buffers {v[2] / 2**20:.2f} MiB, moved {v[1] / 2**20:.2f} MiB)"
            for k, v in sorted(by.items())
        )
        if "ragged-all-to-all" in by:
            total += r["ragged_bytes"]
            parts += (
                f" [ragged moved: {r['rows_off_device_share']:.1%} of rows off device -> "
                f"{r['ragged_bytes'] / 2**20:.2f} MiB]"
            )
        extra = ""
        if "ms" in r:
            extra = f" | CPU {r['ms']:.1f} ms | max|diff| {r['max_abs_diff']:.1e}"
        temp = "?" if r["temp_bytes"] is None else f"{r['temp_bytes'] / 2**20:.1f} MiB"
        print(
            f"{label} tokens {r['layout']:10s} {r['dispatch']:10s}: moved "
            f"{total / 2**20:.2f} MiB/device | temp {temp} | {parts} | compile "
            f"{r['compile_s']:.1f} s{extra}"
        )


def main() -> None:
    """The command line: runs what the module docstring describes."""
    ap = bench_setup.arg_parser(__doc__)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="threads for both (0 = all cores)")
    ap.add_argument("--skip-hf", action="store_true", help="only the dispatch comparison")
    ap.add_argument("--tokens", type=int, default=256, help="dispatch: tokens per block call")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--width", type=int, default=256, help="dispatch: expert MLP width")
    ap.add_argument("--ep", action="store_true", help="only the expert-parallel comparison")
    ap.add_argument("--ep-tokens", type=int, default=1024, help="--ep: tokens per block call")
    ap.add_argument("--ep-shape", default="32,4,256,128", help="--ep: E,K,D,F")
    ap.add_argument("--ep-hlo-shape", default="128,8,2048,768", help="--ep: HLO-only E,K,D,F")
    ap.add_argument("--ep-hlo-tokens", type=int, default=32768)
    ap.add_argument("--ep-tpu", default="", help="--ep: also compile for this TPU topology")
    args = ap.parse_args()
    if args.ep and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        bench_setup.add_xla_flags(bench_setup.host_devices_flag(8))
    threads = bench_setup.pin_cpu_threads(args.threads)
    import jax

    if args.ep:
        print(f"jax {jax.__version__} devices={len(jax.devices())} threads={threads}")
        devs = jax.devices()[:8]
        E, K, D, F = map(int, args.ep_shape.split(","))
        label = f"[cpu x8, E={E} K={K} D={D} F={F}, {args.ep_tokens} tokens, f32, fwd+bwd]"
        _print_ep(
            bench_expert_parallel(args.rounds, args.ep_tokens, E, K, D, F, "float32", devs, True),
            label,
        )
        if not args.ep_hlo_tokens:
            return
        E, K, D, F = map(int, args.ep_hlo_shape.split(","))
        label = f"[cpu x8 HLO, E={E} K={K} D={D} F={F}, {args.ep_hlo_tokens} tokens, bf16]"
        rows = bench_expert_parallel(0, args.ep_hlo_tokens, E, K, D, F, "bfloat16", devs, False)
        _print_ep(rows, label)
        if args.ep_tpu:
            tpu = plan.abstract_devices(plan.get_topology(args.ep_tpu))
            label = (
                f"[{args.ep_tpu} HLO, E={E} K={K} D={D} F={F}, {args.ep_hlo_tokens} tokens, bf16]"
            )
            rows = bench_expert_parallel(0, args.ep_hlo_tokens, E, K, D, F, "bfloat16", tpu, False)
            _print_ep(rows, label)
        return

    print(
        f"jax {jax.__version__} devices={jax.devices()} cpu_count={os.cpu_count()} "
        f"threads={threads} rounds={args.rounds}"
    )
    if not args.skip_hf:
        import torch
        import transformers

        torch.set_num_threads(threads)
        r = bench_forward(args.rounds)
        print(
            f"forward (transformers {transformers.__version__}, MoE 8 experts top-2, "
            f"{r['tokens']} tokens): jax compile {r['compile_s']:.1f} s | jax {r['jax_ms']:.1f} ms"
            f" | transformers {r['hf_ms']:.1f} ms | transformers/jax = {r['ratio']:.2f}x | "
            f"logits max|diff| {r['max_abs_diff']:.2e} (max |logit| {r['max_abs_logit']:.2f})"
        )
    for r in bench_dispatch(args.rounds, args.tokens, args.dim, args.width, [(8, 2), (64, 8)]):
        print(
            f"dispatch E={r['experts']} top-{r['top_k']} ({r['tokens']} tokens, D={r['dim']}, "
            f"F={r['width']}): grouped {r['grouped_ms']:.1f} ms | dense all-experts "
            f"{r['dense_ms']:.1f} ms | dense/grouped = {r['dense_over_grouped']:.2f}x | compile "
            f"{r['compile_grouped_s']:.1f} / {r['compile_dense_s']:.1f} s | max|diff| "
            f"{r['max_abs_diff']:.1e}"
        )


if __name__ == "__main__":
    main()
