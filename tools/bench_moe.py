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

Every variant is compiled first (compile times are printed apart); then each round times every
variant once, in turn, so background load on a shared machine hits them alike; medians of the
rounds and the ratios are printed, with the outputs' max |diff| (the two compute the same thing).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from tools import bench_setup
from tools.bench_forward import hf_dicts, inputs

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

    from cua_jax.models import qwen_vl

    hf, image_id, start_id, end_id = hf_moe_model()
    ids, pv, grid = inputs("qwen3_vl", image_id, start_id, end_id)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        model = qwen_vl.from_pretrained(d)
    assert model.config.text.num_experts == MOE["num_experts"]
    hf_call, jax_call, first, out = bench_setup.forward_pair(hf, model, ids, pv, grid, image_id)
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

    from cua_jax.models.qwen_vl import moe

    w_NK, e_NK = moe.route(x_ND @ gate_DE, top_k)
    h = jnp.einsum("nd,edxf->nexf", x_ND, gate_up)
    y = jnp.einsum("nef,efd->ned", jax.nn.silu(h[:, :, 0]) * h[:, :, 1], down)
    comb_NE = jnp.sum(jax.nn.one_hot(e_NK, gate_up.shape[0]) * w_NK[..., None], axis=1)
    return jnp.einsum("ned,ne->nd", y, comb_NE)


def grouped(x_ND, gate_DE, gate_up, down, top_k):
    """The routed experts through `moe.expert_mlp` (the layer's own dispatch)."""
    from cua_jax.models.qwen_vl import moe

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


def main() -> None:
    """The command line: runs what the module docstring describes."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="threads for both (0 = all cores)")
    ap.add_argument("--skip-hf", action="store_true", help="only the dispatch comparison")
    ap.add_argument("--tokens", type=int, default=256, help="dispatch: tokens per block call")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--width", type=int, default=256, help="dispatch: expert MLP width")
    args = ap.parse_args()
    threads = bench_setup.pin_cpu_threads(args.threads)
    import jax

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
