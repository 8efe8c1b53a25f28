"""The accelerator benchmark runs end to end on CPU at a tiny size, so the command a GPU session
runs (`python3 tools/bench_paged_decode.py`) has not rotted by the time a GPU is lent; the
forward benchmark's Qwen3.5 models (tools/bench_forward.py) load and agree with transformers;
the sampler benchmark decodes the tiny Qwen3.5 (tools/bench_sampler.py --family=qwen3_5)."""

import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_paged_decode_small_on_cpu():
    args = [
        sys.executable,
        "tools/bench_paged_decode.py",
        "--size=small",
        "--batch=4",
        "--prompt-len=64",
        "--new-tokens=16",
        "--copy-mib=64",
        "--iters=2",
        "--kernel-shape=2,4,2,128,16,48",
        "--backends=auto,interpret",
        "--gpu-options=pages_per_block=1;pages_per_block=2,f32_dots=false",
    ]
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    # kernel part: one row per interpret-mode kernel variant and the reference; bf16 inputs, so
    # equal to the reference within bf16 rounding
    kernel = out.split("== kernel")[1].split("fastest:")[0].splitlines()[2:]
    rows = {line.split("]")[0].strip() + "]": line.split()[-1] for line in kernel if "[" in line}
    assert set(rows) == {"interpret[p1 f32]", "interpret[p2 bf16]"}, out
    assert all(float(d) < 5e-2 for d in rows.values()), out
    # bandwidth part: one row per backend, the same greedy tokens from both
    table = out.split("== bandwidth")[1].splitlines()
    rows = [line.split() for line in table if line.split()[:1] in (["auto"], ["interpret"])]
    assert [r[0] for r in rows] == ["auto", "interpret"], out
    assert all(r[-1] == "100%" for r in rows), out


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_bench_forward_qwen35_models_load_and_agree(family, tmp_path):
    """tools/bench_forward.py's Qwen3.5 configs build in transformers, load into cua_jax with
    the family's layout (3 Gated DeltaNet layers, full attention at 3; the MoE's 8 experts and
    shared expert), and give transformers' logits on a short text (the bench adds an image)."""
    torch = pytest.importorskip("torch")
    from flax import nnx

    from cua_jax.models import qwen_vl
    from tools import bench_forward

    hf, *_ = bench_forward.hf_model(family)
    hf.save_pretrained(str(tmp_path))
    model = qwen_vl.from_pretrained(str(tmp_path))
    t = model.config.text
    assert model.config.model_type == family
    assert [t.layer_type(i) for i in range(4)] == ["linear_attention"] * 3 + ["full_attention"]
    assert (t.num_experts, t.shared_expert_intermediate_size) == (
        (8, 704) if family == "qwen3_5_moe" else (0, 0)
    )
    ids = np.random.default_rng(0).integers(0, 4000, (1, 24))
    with torch.no_grad():
        want = hf(input_ids=torch.as_tensor(ids)).logits.numpy()
    got = nnx.jit(lambda m, ids: m(ids))(model, ids.astype(np.int32))
    assert np.abs(np.asarray(got) - want).max() < 1e-4


def test_bench_sampler_decodes_the_tiny_qwen35_against_transformers():
    """tools/bench_sampler.py --family=qwen3_5: the hybrid model through our Engine and
    transformers' generate (the same weights, greedy), a row per batch with the share of
    sequences whose tokens agree (a near-tie in transformers' cached torch fallback can differ
    on a long run; 8 tokens from one prompt agree)."""
    args = [
        sys.executable,
        "tools/bench_sampler.py",
        "--family=qwen3_5",
        "--parts=decode",
        "--batches=1",
        "--prompt-len=8",
        "--new-tokens=8",
        "--vocab=1536",
        "--threads=1",
    ]
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "model: qwen3_5," in r.stdout, r.stdout
    table = r.stdout.split("== decode")[1].splitlines()
    rows = [line.split() for line in table if line.split()[:1] == ["1"]]
    assert len(rows) == 1, r.stdout
    ours, hf = float(rows[0][1]), float(rows[0][2])
    assert ours > 0 and hf > 0 and rows[0][6] == "100%", r.stdout


def test_bench_turn_prints_its_table_at_a_tiny_size():
    args = [sys.executable, "tools/bench_turn.py", "--viewport=64x64", "--turns=3", "--history=2"]
    r = subprocess.run(
        [*args, "--episodes=2", "--rounds=1"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    rows = [ln for ln in lines if ln.startswith("| ") and "ms a turn" not in ln and "---" not in ln]
    assert [ln.split("|")[1].split()[0] for ln in rows] == ["prompt", "request,", "request,"]
    assert all(float(ln.split("|")[2]) > 0 for ln in rows), r.stdout
