"""What the planner's tests share (`test_plan.py`, `test_plan_budget.py`): the tiny model with
128-wide heads, written as a checkpoint config, the smoke config over it for v5e-4 on an
fsdp=2 x tensor=2 mesh, and `tools/plan.py` run as a user runs it."""

import json
import os
import subprocess
import sys

from configs import qwen3vl_grpo
from cua_jax.models import qwen_vl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the run: 4 slots x 64 pages of 16 tokens, 4 rows x 256 tokens, bf16 compute, f32 params
PAGES, PAGE, SLOTS, SEQ, ROWS, ROW_LEN = 64, 16, 4, 256, 4, 256


def tiny_128() -> qwen_vl.QwenVLConfig:
    """The tiny model with 128-wide heads (the TPU kernel's minimum), 2 kv heads, 2 layers."""
    cfg = qwen_vl.tiny("qwen3_vl", vocab_size=512)
    d = cfg.to_hf_dict()
    d["text_config"].update(head_dim=128)
    d["text_config"]["rope_parameters"]["mrope_section"] = [24, 20, 20]
    return qwen_vl.QwenVLConfig.from_hf_dict(d)


def write_hf_dir(tmp_path_factory) -> str:
    """A directory holding `tiny_128`'s config.json (the model's `hf_path`)."""
    path = tmp_path_factory.mktemp("tiny128")
    with open(path / "config.json", "w") as f:
        json.dump(tiny_128().to_hf_dict(), f)
    return str(path)


def plan_config(hf_dir: str):
    """The smoke config over the tiny model: bf16, fsdp=2 x tensor=2, the small KV pool."""
    c = qwen3vl_grpo.get_config("smoke")
    c.model.hf_path = hf_dir
    c.model.dtype = "bfloat16"
    c.mesh.fsdp, c.mesh.tensor = 2, 2
    c.sampler.num_pages, c.sampler.page_size = PAGES, PAGE
    c.sampler.max_slots, c.sampler.max_seq_len = SLOTS, SEQ
    return c


def run_tool(*args: str) -> subprocess.CompletedProcess:
    """`python tools/plan.py ARGS` from the repository root."""
    return subprocess.run(
        [sys.executable, "tools/plan.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def last_line(stderr: str) -> str:
    return [ln for ln in stderr.splitlines() if ln.strip()][-1]
