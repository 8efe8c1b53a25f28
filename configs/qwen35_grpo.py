r"""Multi-turn GRPO for a Qwen3.5 computer-use agent (hybrid Gated DeltaNet / full attention).

    python launch/tpu.py --config=configs/qwen35_grpo.py:smoke --workdir=/tmp/cua_q35_smoke
    python launch/tpu.py --config=configs/qwen35_grpo.py:smoke_moe --workdir=/tmp/cua_q35_moe
    python launch/tpu.py --config=configs/qwen35_grpo.py:27b \
        --config.model.hf_path=/ckpts/Qwen3.5-27B --workdir=gs://bucket/run1

Presets:
  smoke      tiny random Qwen3.5 (`qwen_vl.tiny("qwen3_5")`: a Gated DeltaNet layer, then a
             gated full-attention layer), the shipped tokenizer, built-in browser tasks; SFT
             warm-up on the tasks' oracles, then GRPO, as configs/qwen3vl_grpo.py's smoke. Runs
             on a 2-core CPU. The sampler keeps paged K/V for the attention layer and per-slot
             states for the linear one (cua_jax/sampler/engine.py, the hybrid cache).
  smoke_moe  the same with the tiny Qwen3.5-MoE (8 experts top-2 plus a gated shared expert in
             every layer; `model.preset="tiny_moe"`).
  27b        Qwen3.5-27B (dense, 64 layers, 16 of them full attention) from
             --config.model.hf_path: LoRA rank 64 on bf16 weights, tensor=4, as the 32b presets.
  35b-a3b    Qwen3.5-35B-A3B (MoE: 256 experts top-8 + a shared expert, 40 layers) from
             --config.model.hf_path: LoRA rank 32 on attention, linear attention and every
             expert, expert=4, routing replay, as configs/qwen3vl_grpo.py's 30b-a3b.

The real presets' mesh, LoRA and batch settings are those of the Qwen3-VL presets of the same
class. Both are planned for v5p-8 (TOPOLOGY; `tools/plan.py --config=configs/qwen35_grpo.py:27b`,
BENCHMARKS.md): 35b-a3b's largest program 80.7 GiB of 95 a device, a KV pool of 21,737 pages
(26.5 GiB) beside 7.68 GiB of linear states; 27b's 80.7 GiB, 46,647 pages beside 4.59 GiB of
states, est. MFU 65-69% (replanned 2026-12-04 with screens as bytes, exit 0). 35b-a3b with the
rows over the experts and remat="ordered", as 30b-a3b takes them, planned on one chunk shape:
est. RL step 124 s against 207 s in its own layout, a pool as large; not the preset's layout
until a whole plan of it runs (this VM's 24 GB could not: BENCHMARKS.md, session 31).

Qwen3.5 uses Qwen3-VL's image processing (transformers 5.24 maps model_type qwen3_5 /
qwen3_5_moe to Qwen3VLProcessor: 16-pixel patches, 2x2 merge, the same vision tokens) and its
computer_use tool, with its own chat rendering (the thinking-off "<think>\n\n</think>\n\n"
assistant header) and tool-call syntax ("qwen35": <function=...><parameter=...> XML, as its
chat template writes calls); the image and vision-token ids come from the checkpoint's
config.json (from the shipped tokenizer for the tiny presets).
"""

from configs import common

PRESETS = ("smoke", "27b", "35b-a3b")
# The TPU slice a real preset is planned to fit (tools/plan.py, BENCHMARKS.md)
TOPOLOGY = {"27b": "v5p-8", "35b-a3b": "v5p-8"}

# The Qwen3-VL preset whose mesh, LoRA and batch layout each real preset takes (common._REAL)
_LIKE = {"27b": "32b", "35b-a3b": "30b-a3b"}

# LoRA on the full-attention and the Gated DeltaNet projections, and on the MLPs
_TARGETS = (
    r"language_model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj$",
    r"language_model\.layers\.\d+\.linear_attn\.(in_proj_qkv|in_proj_z|out_proj)$",
    r"language_model\.layers\.\d+\.mlp\.(gate|up|down)_proj$",
)
FIT = {
    # the real presets take the Pallas gated delta kernels (forward and backward) on a TPU
    "27b": {"model.lora_targets": _TARGETS, "model.gated_delta_impl": "auto"},
    "35b-a3b": {
        "model.gated_delta_impl": "auto",
        "mesh.expert": 4,
        "mesh.fsdp": 1,
        "rl.routing_replay": True,
        "model.lora_targets": (
            *_TARGETS[:2],
            r"language_model\.layers\.\d+\.mlp\.experts$",
            r"language_model\.layers\.\d+\.mlp\.shared_expert\.(gate|up|down)_proj$",
        ),
    },
}


def get_config(arg=None):
    name = (arg or "smoke").strip()
    if name == "smoke_moe":  # the smoke with the tiny MoE decoder (not a checkpoint size)
        c = common.build("qwen3_5", "smoke", PRESETS)
        c.preset = "smoke_moe"
        c.model.preset = "tiny_moe"
    elif name in _LIKE:
        c = common.build("qwen3_5", _LIKE[name], tuple(_LIKE.values()))
        c.preset = c.model.preset = name
        c.topology = TOPOLOGY.get(name)
    else:
        c = common.build("qwen3_5", arg, PRESETS)
    c.env.action_format = "qwen35"
    for key, value in FIT.get(c.preset, {}).items():
        section, field = key.split(".")
        c[section][field] = value
    return c
