"""Jitted cua_jax QwenVL forward vs transformers forward on CPU, side by side in one run.

    .venv/bin/python tools/bench_forward.py
        [--family qwen2_5_vl|qwen3_vl|qwen3_5|qwen3_5_moe|both|all] [--iters 10] [--threads N]

Same small-but-nontrivial config (text hidden 512, 4 layers, GQA 8/4 heads; vision hidden 256,
4 blocks; "both" is the two Qwen-VL families, "all" adds Qwen3.5 and its MoE), same weights (a
random transformers model is saved to a temp dir and loaded with `qwen_vl.from_pretrained`),
same inputs (one 280x392 image + text, ~300 tokens, batch 1), f32,
equal thread counts (torch.set_num_threads = the CPU count that XLA's CPU client uses, or
`--threads N` for both). The two are timed alternately so background load hits both alike.
Prints compile time apart, steady-state median times, the ratio, and the logits max abs diff.

Qwen3.5 (`Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration`): the same
widths, transformers' default layer pattern (Gated DeltaNet layers 0-2, full attention at 3;
4 q/k and 8 value heads of 64 in the linear layers), rotary on a quarter of each head, Qwen3-VL's
tower without DeepStack; the MoE has 8 experts (top-2, width 352) and a shared expert of 704 in
every layer. transformers runs its torch gated delta rule (no flash-linear-attention kernels on
CPU); cua_jax its jnp reference (`model.gated_delta_impl="reference"`).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import numpy as np

from cua_jax.models import qwen_vl
from tools import bench_setup

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe")
GROUPS = {"both": FAMILIES[:2], "all": FAMILIES}


def hf_dicts(family: str) -> tuple[dict, dict, dict]:
    """The benchmark's transformers config of `family` (one of FAMILIES; text hidden 512, 4
    layers, GQA 8/4 heads; vision hidden 256, 4 blocks), as (special token ids, text_config,
    vision_config) dicts."""
    V = 4096
    ids = dict(
        image_token_id=V - 4,
        video_token_id=V - 3,
        vision_start_token_id=V - 6,
        vision_end_token_id=V - 5,
    )
    text = dict(
        vocab_size=V,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        rms_norm_eps=1e-6,
    )
    vision = dict(
        depth=4,
        hidden_size=256,
        intermediate_size=512,
        num_heads=4,
        out_hidden_size=512,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    if family == "qwen2_5_vl":
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 1e6,
            "mrope_section": [8, 12, 12],
        }
        vision.update(
            patch_size=14, hidden_act="silu", window_size=112, fullatt_block_indexes=[1, 3]
        )
    elif family in ("qwen3_5", "qwen3_5_moe"):
        text.update(
            head_dim=64,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            full_attention_interval=4,
        )
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 1e7,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
            "partial_rotary_factor": 0.25,
        }
        vision.update(patch_size=16, hidden_act="gelu_pytorch_tanh", num_position_embeddings=256)
        if family == "qwen3_5_moe":  # every layer sparse: no dense intermediate_size
            text.pop("intermediate_size")
            text.update(
                num_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=352,
                shared_expert_intermediate_size=704,
            )
    else:
        text.update(head_dim=64)
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 5e6,
            "mrope_section": [12, 10, 10],
            "mrope_interleaved": True,
        }
        vision.update(
            patch_size=16,
            hidden_act="gelu_pytorch_tanh",
            num_position_embeddings=256,
            deepstack_visual_indexes=[0, 1, 2],
        )
    return ids, text, vision


def hf_model(family: str):
    """A random transformers model of `family` (`hf_dicts`) in f32 eval mode, with its image,
    vision-start and vision-end token ids."""
    import torch
    import transformers as tf

    classes = {
        "qwen2_5_vl": (tf.Qwen2_5_VLConfig, tf.Qwen2_5_VLForConditionalGeneration),
        "qwen3_vl": (tf.Qwen3VLConfig, tf.Qwen3VLForConditionalGeneration),
        "qwen3_5": (tf.Qwen3_5Config, tf.Qwen3_5ForConditionalGeneration),
        "qwen3_5_moe": (tf.Qwen3_5MoeConfig, tf.Qwen3_5MoeForConditionalGeneration),
    }
    config_cls, model_cls = classes[family]
    ids, text, vision = hf_dicts(family)
    torch.manual_seed(0)
    model = model_cls(config_cls(text_config=text, vision_config=vision, **ids))
    return (
        model.float().eval(),
        ids["image_token_id"],
        ids["vision_start_token_id"],
        ids["vision_end_token_id"],
    )


def inputs(family: str, image_id: int, start_id: int, end_id: int):
    """One 280x392 random image and text around it: (input ids [1, ~300], pixel values, image
    grid)."""
    from transformers import Qwen2VLImageProcessor

    patch = 14 if family == "qwen2_5_vl" else 16
    proc = Qwen2VLImageProcessor(
        patch_size=patch,
        temporal_patch_size=2,
        merge_size=2,
        min_pixels=56 * 56,
        max_pixels=28 * 28 * 1280,
    )
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (280, 392, 3), dtype=np.uint8)
    out = proc(images=[img], return_tensors="np")
    pv = np.asarray(out["pixel_values"], np.float32)
    grid = np.asarray(out["image_grid_thw"])
    n_img = int(np.prod(grid[0])) // 4
    text_a, text_b = rng.integers(0, 4000, 40), rng.integers(0, 4000, 300 - 42 - n_img)
    ids = np.concatenate([text_a, [start_id], [image_id] * n_img, [end_id], text_b])[None]
    return ids.astype(np.int64), pv, grid


def forward_pair(hf: Any, model: Any, ids: Any, pixel_values: Any, grid: Any, image_id: int):
    """The same image + text forward through a transformers model `hf` and its cua_jax twin
    `model`: the host computes positions and the vision layout, the device runs one jitted
    forward. Compiles and runs the jitted forward once.

    Returns (hf_call, jax_call, first_s, jax_logits): two no-argument callables (jax_call blocks
    until its result is ready; call hf_call under torch.no_grad()), the first jitted call's
    seconds (compile included) and its logits.
    """
    import jax
    import torch
    from flax import nnx

    t_ids = torch.as_tensor(ids)
    kw = dict(
        input_ids=t_ids,
        pixel_values=torch.as_tensor(pixel_values),
        image_grid_thw=torch.as_tensor(grid),
        mm_token_type_ids=(t_ids == image_id).int(),
    )
    pos = model.position_ids_for(ids, None, grid)
    meta = qwen_vl.vision_metadata(model.config, grid)
    fwd = nnx.jit(
        lambda m, ids, pv, pos, meta: m(ids, pixel_values=pv, position_ids=pos, vision_meta=meta)
    )

    def jax_call() -> Any:
        return jax.block_until_ready(fwd(model, ids, pixel_values, pos, meta))

    out, first_s = bench_setup.timed(jax_call)
    return (lambda: hf(**kw)), jax_call, first_s, out


def bench(family: str, iters: int) -> dict:
    """Times both forwards for `family` on $BENCH_THREADS threads; a dict of compile time, median
    milliseconds, their ratio and the logits' max difference."""
    import torch

    threads = int(os.environ["BENCH_THREADS"])
    torch.set_num_threads(threads)
    hf, image_id, start_id, end_id = hf_model(family)
    ids, pv, grid = inputs(family, image_id, start_id, end_id)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        model = qwen_vl.from_pretrained(d)
    hf_call, jax_call, first, out = forward_pair(hf, model, ids, pv, grid, image_id)
    with torch.no_grad():
        ref = hf_call().logits.numpy()  # warm-up too
        # Alternate the two so both see the same background load on a shared machine.
        med = bench_setup.timed_rounds({"transformers": hf_call, "jax": jax_call}, iters)
    hf_med, jax_med = med["transformers"], med["jax"]
    return dict(
        family=family,
        tokens=ids.shape[1],
        patches=pv.shape[0],
        threads=threads,
        compile_s=first - jax_med,
        jax_ms=jax_med * 1e3,
        hf_ms=hf_med * 1e3,
        speedup=hf_med / jax_med,
        max_abs_diff=float(np.abs(np.asarray(out) - ref).max()),
    )


def main() -> None:
    """The command line: runs what the module docstring describes."""
    ap = bench_setup.arg_parser(__doc__)
    ap.add_argument("--family", default="both", choices=[*FAMILIES, *GROUPS])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument(
        "--threads", type=int, default=0, help="threads for both (0 = all cores, XLA's default)"
    )
    args = ap.parse_args()
    threads = bench_setup.pin_cpu_threads(args.threads)
    os.environ["BENCH_THREADS"] = str(threads)
    fams = GROUPS.get(args.family, (args.family,))
    import jax

    print(f"jax {jax.__version__} devices={jax.devices()} cpu_count={os.cpu_count()}")
    for fam in fams:
        r = bench(fam, args.iters)
        print(
            f"{r['family']}: {r['tokens']} tokens, {r['patches']} patches, "
            f"{r['threads']} threads | "
            f"jax compile {r['compile_s']:.1f} s | jax {r['jax_ms']:.1f} ms | "
            f"transformers {r['hf_ms']:.1f} ms | transformers/jax = {r['speedup']:.2f}x | "
            f"logits max|diff| {r['max_abs_diff']:.2e}"
        )


if __name__ == "__main__":
    main()
