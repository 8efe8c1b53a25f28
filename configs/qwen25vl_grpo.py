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

Smallest TPU slice each real preset is meant for (TOPOLOGY). Every real preset takes the
token-budget learner (configs/common.py apply_real: 16384 tokens a batch-parallel device a
chunk, splash attention, remat=full, the KV pool from 85% of HBM). `tools/plan.py` with no other
flag compiles what the run compiles (BENCHMARKS.md "Every preset's real RL step", 2026-11-27):
  3b  v5p-8    full fine-tuning, fsdp=4: largest program 80.7 GiB of 95, KV pool 22059
               pages; 474 samples in 39 chunks of 4 x 16384, padding 0.144, est. step 73 s,
               est. MFU 40-42% (replanned 2026-12-04, exit 0)
  7b  v5p-8    full fine-tuning, fsdp=2 x tensor=2: largest program 80.7 GiB of 95, KV pool
               20175 pages; 474 samples in 78 chunks, padding 0.144, est. step 119 s, est. MFU
               56-57% (replanned 2026-12-04, exit 0)
  32b v5p-8    LoRA rank 64 on bf16 weights, tensor=4: largest program 80.7 GiB of 95, KV
               pool 11581 pages (45.2 GiB); 474 samples in 156 chunks of 1 x 16384, padding
               0.144, est. step 336 s, est. MFU 59-62% (planned 2026-12-04, screens as bytes,
               exit 0)
  72b v5p-16   LoRA rank 64 on bf16 weights, fsdp=2 (one a host) x tensor=4: not yet planned
               with the token budget (with tensor=8 the rows' batch axes were 1, which the
               two hosts' processes cannot split: the plan and the run refuse it)
"""

from configs import common

PRESETS = ("smoke", "3b", "7b", "32b", "72b")

TOPOLOGY = {"3b": "v5p-8", "7b": "v5p-8", "32b": "v5p-8", "72b": "v5p-16"}
# Overrides of configs/common.py's apply_real that make each preset fit TOPOLOGY (tools/plan.py)
FIT: dict[str, dict] = {}


def get_config(arg=None):
    # learn: CPU-sized like smoke (not a checkpoint size), see common.apply_learn
    c = common.build("qwen2_5_vl", arg, PRESETS + ("learn",), TOPOLOGY)
    for key, value in FIT.get(c.preset, {}).items():
        section, name = key.split(".")
        c[section][name] = value
    return c
