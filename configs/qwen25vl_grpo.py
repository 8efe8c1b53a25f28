r"""Multi-turn GRPO for a Qwen2.5-VL computer-use agent.

    python launch/tpu.py --config=configs/qwen25vl_grpo.py:smoke --workdir=/tmp/cua_smoke25
    python launch/tpu.py --config=configs/qwen25vl_grpo.py:7b \
        --config.model.hf_path=/ckpts/Qwen2.5-VL-7B-Instruct --workdir=/runs/q25_7b
    python tools/plan.py --config=configs/qwen25vl_grpo.py:7b --topology=v5p-8   # will it fit?

Presets:
  learn  the smoke's model and tasks plus two-action ones: a short SFT warm-up, then GRPO
         with dynamic sampling that raises held-out success on a 2-core CPU (BENCHMARKS.md).
  smoke  tiny random Qwen2.5-VL, the shipped tokenizer, built-in browser tasks, 2-core CPU.
  3b, 7b, 32b, 72b  real dense Qwen2.5-VL checkpoints from --config.model.hf_path.

Smallest TPU slice each real preset is meant for (TOPOLOGY), with the settings that make it fit
(FIT). `tools/plan.py` compiles the learner's train step and the sampler's decode chunk for that
slice (3b, 7b: both fit with >= 29% of HBM free; 32b: 68.9 GiB of 95; 72b: 59.8 GiB of 95 on
v5p-16; figures per preset in BENCHMARKS.md "TPU plan"):
  3b  v5p-8    full fine-tuning, fsdp=4; remat=full, 2 micro-batches, 4096 KV pages
  7b  v5p-8    full fine-tuning, fsdp=2 x tensor=2; remat=full, 4 micro-batches, 4096 KV pages
  32b v5p-8    LoRA rank 64 on bf16 weights, tensor=4; remat=full, 8 micro-batches, 4096 pages
  72b v5p-16   LoRA rank 64 on bf16 weights, tensor=8 (2 hosts); splash attention, remat=full,
               8 micro-batches, 4096 KV pages
The KV pool stays resident next to the learner (colocated sampler) and its pages are sharded over
`tensor` only, so it is sized here rather than left at 8192 pages.
"""

from configs import common

PRESETS = ("smoke", "3b", "7b", "32b", "72b")

TOPOLOGY = {"3b": "v5p-8", "7b": "v5p-8", "32b": "v5p-8", "72b": "v5p-16"}
# Overrides of configs/common.py's apply_real that make each preset fit TOPOLOGY (tools/plan.py)
FIT: dict[str, dict] = {}


def get_config(arg=None):
    # learn: CPU-sized like smoke (not a checkpoint size), see common.apply_learn
    c = common.build("qwen2_5_vl", arg, PRESETS + ("learn",))
    for key, value in FIT.get(c.preset, {}).items():
        section, name = key.split(".")
        c[section][name] = value
    return c
