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

Smallest TPU slice each real preset is meant for (TOPOLOGY), with the settings that make it fit
(FIT). `tools/plan.py` compiles the learner's train step and the sampler's decode chunk for that
slice (2b, 4b: both fit with >= 30% of HBM free; 8b: compiled with 4096 pages, 86.0 GiB, so the
pool was cut to 3072 pages = 81.5 GiB of the 85.5 GiB budget; 32b: 73.3 GiB of 95; 30b-a3b: 69.8
GiB; figures per preset in BENCHMARKS.md "TPU plan"):
  2b  v5p-8    full fine-tuning, fsdp=4; remat=full, 2 micro-batches, 4096 KV pages
  4b  v5p-8    full fine-tuning, fsdp=2 x tensor=2; remat=full, 4 micro-batches, 4096 KV pages
  8b  v5p-8    full fine-tuning, fsdp=2 x tensor=2; remat=full, 4 micro-batches, 3072 KV pages
  32b v5p-8    LoRA rank 64 on bf16 weights, tensor=4; remat=full, 8 micro-batches, 4096 pages
  30b-a3b v5p-8  LoRA rank 32 (attention + experts) on bf16 weights, expert=4 (32 experts on
         each chip, attention and embeddings replicated); splash attention, remat=full, 4
         micro-batches, 2048 KV pages, routing replay: 69.8 GiB (train) / 44.7 GiB (decode).
         With fsdp=2 x expert=2 it did not fit: 72 / 66 GiB of temporaries at 2 / 4
         micro-batches, so not activations (most likely the FSDP-gathered frozen weights)
The KV pool stays resident next to the learner (colocated sampler) and its pages are sharded over
`tensor` only, so it is sized here rather than left at 8192 pages (60-77 GB on one device).
"""

from configs import common

PRESETS = ("smoke", "2b", "4b", "8b", "32b", "30b-a3b")

TOPOLOGY = {"2b": "v5p-8", "4b": "v5p-8", "8b": "v5p-8", "32b": "v5p-8", "30b-a3b": "v5p-8"}
# Overrides of configs/common.py's apply_real that make each preset fit TOPOLOGY (tools/plan.py)
FIT = {
    # MoE: the experts split over expert=4 (32 on each device), attention and embeddings
    # replicated (with FSDP over 2, 66-72 GiB of temporaries whatever the micro-batching);
    # LoRA on the expert stacks too (cua_jax.models.lora.MOE_TARGETS), routing replay on
    "30b-a3b": {
        "mesh.expert": 4,
        "mesh.fsdp": 1,
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
    c = common.build("qwen3_vl", arg, PRESETS + ("learn",))
    for key, value in FIT.get(c.preset, {}).items():
        section, name = key.split(".")
        c[section][name] = value
    return c
