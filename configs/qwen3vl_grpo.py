r"""Multi-turn GRPO for a Qwen3-VL computer-use agent.

    python launch/tpu.py --config=configs/qwen3vl_grpo.py:smoke --workdir=/tmp/cua_smoke
    python launch/tpu.py --config=configs/qwen3vl_grpo.py:8b \
        --config.model.hf_path=/ckpts/Qwen3-VL-8B-Instruct --workdir=gs://bucket/run1
    python tools/plan.py --config=configs/qwen3vl_grpo.py:8b --topology=v5p-8   # will it fit?

Presets:
  learn  the smoke's model and tasks plus two-action ones: a short SFT warm-up, then GRPO
         with dynamic sampling that raises held-out success on a 2-core CPU (BENCHMARKS.md).
  smoke  tiny random Qwen3-VL, the shipped tokenizer, built-in browser tasks; SFT warm-up on the
         tasks' oracles, then GRPO. Runs on a 2-core CPU.
  2b, 4b, 8b, 32b  real dense Qwen3-VL checkpoints from --config.model.hf_path (a local directory).
  30b-a3b  Qwen3-VL-30B-A3B-Instruct (MoE: 128 experts, top-8), the cua_rl recipe's model, with
         its LoRA rank 32 on attention and every expert; --config.model.preset=tiny_moe on the
         smoke preset runs a tiny random MoE end to end on a CPU.

Smallest TPU slice each real preset is meant for (TOPOLOGY). Every real preset takes the
token-budget learner (configs/common.py apply_real: 16384 tokens a batch-parallel device a
chunk, splash attention, remat=full, the KV pool from 85% of HBM). `tools/plan.py` with no other
flag compiles what the run compiles, each chunk program with its screens, the update and the
decode step, and a batch drawn from the preset's env settings (BENCHMARKS.md "Every preset's
real RL step", 2026-11-27):
  2b  v5p-8    full fine-tuning, fsdp=4: largest program 80.7 GiB of 95, KV pool 8503 pages
               (7319 before the vocabulary-parallel head); 474 samples in 30 chunks, padding
               0.062, est. step 27 s, est. MFU 47-49% (replanned 2026-12-04, exit 0)
  4b  v5p-8    full fine-tuning, fsdp=4: 80.7 GiB, 5439 pages (4618 with f32 screens and the
               gathered head); 30 chunks, padding 0.062, est. step 54 s, est. MFU 57-59%
               (replanned 2026-12-04, exit 0)
  8b  v5p-8    full fine-tuning, fsdp=2 x tensor=2: 80.7 GiB, 7153 pages (6610 before the
               training layout); 59 chunks, padding 0.046, est. step 83 s, est. MFU 66-69%
               (replanned 2026-12-04, exit 0)
  2b on v5e-8 (16 GiB chips), --config.rl.tokens_per_chip=8192 --config.rl.row_lengths='(4096,
               8192)' (the least the 15-turn, three-screen samples allow): every program fits
               the chip since the learner's FSDP training layout; with the vocabulary-parallel
               head the largest learner program is 12.11 GiB without the pool (13.21 before;
               rl_grads 16x4096 13.6 GiB, 8x8192 12.2 GiB with it, est. MFU 35-40%), but the
               plan exits 1: the KV pool left is 1.48 GiB (217 pages; 0.39 before), under
               sampler.kv_min_fraction (4 GiB) (planned 2026-12-04); with
               --config.model.freeze_vision=True (no other flag) it fits: the planner fits 8192
               tokens a chip itself, largest program 13.6 GiB, KV pool 771 pages (5.2 GiB),
               est. step 23.4 s (planned 2026-12-04, exit 0)
  32b v5p-8    LoRA rank 64 on bf16 weights, tensor=4: largest program 80.7 GiB of 95, KV
               pool 12610 pages (49.3 GiB); 118 chunks of 2 x 8192, padding 0.046, est. step
               242 s, est. MFU 64-68% (planned 2026-12-04, screens as bytes, exit 0)
  30b-a3b v5p-8  LoRA rank 32 (attention + experts) on bf16 weights, expert=4 (32 experts on
         each chip, attention and embeddings replicated), the rows over expert too (the MoE
         blocks dispatch by all-to-all), remat="ordered", routing replay: largest program
         80.7 GiB of 95, KV pool 5947 pages (34.9 GiB); 474 samples in 30 chunks of 8 x 8192,
         padding 0.062, est. step 130 s, est. MFU 15-26% (planned 2026-12-04, exit 0; with the
         rows over data x fsdp only and jax.checkpoint remat: 7718 pages, est. step 176 s, est.
         MFU 11-20%; rows over expert with jax.checkpoint: 100 GiB, does not fit; BENCHMARKS.md)
The KV pool stays resident next to the learner (colocated sampler), its pages sharded over
`tensor` only: the plan and the run size it from what the learner leaves.
"""

from configs import common

PRESETS = ("smoke", "2b", "4b", "8b", "32b", "30b-a3b")

TOPOLOGY = {"2b": "v5p-8", "4b": "v5p-8", "8b": "v5p-8", "32b": "v5p-8", "30b-a3b": "v5p-8"}
# Overrides of configs/common.py's apply_real that make each preset fit TOPOLOGY (tools/plan.py)
FIT = {
    # MoE: the experts split over expert=4 (32 on each device), attention and embeddings
    # replicated (with FSDP over 2, 66-72 GiB of temporaries whatever the micro-batching), the
    # rows split over expert too (each chip its own rows outside the MoE blocks, tokens to their
    # experts by all-to-all), each layer's remat ordered (remat="ordered": the all-to-all's
    # weight gradients otherwise keep every layer's gathered rows live, 2.3 GiB a layer);
    # LoRA on the expert stacks too (cua_jax.models.lora.MOE_TARGETS), routing replay on
    "30b-a3b": {
        "mesh.expert": 4,
        "mesh.fsdp": 1,
        "mesh.rules": (("batch", ("data", "fsdp", "expert")),),
        "model.remat": "ordered",
        "rl.routing_replay": True,
        "model.lora_targets": (
            r"language_model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj$",
            r"language_model\.layers\.\d+\.mlp\.(gate|up|down)_proj$",
            r"language_model\.layers\.\d+\.mlp\.experts$",
        ),
    },
}


def get_config(arg=None):
    # learn: CPU-sized like smoke (not a checkpoint size), see common.apply_learn
    c = common.build("qwen3_vl", arg, PRESETS + ("learn",), TOPOLOGY)
    for key, value in FIT.get(c.preset, {}).items():
        section, name = key.split(".")
        c[section][name] = value
    return c
