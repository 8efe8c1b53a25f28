"""`launch/tpu.py --dry_run`: the run's plan (cua_jax/plan/) for the devices present, no training.

Here the devices are this machine's CPU device: the smoke preset's train step and decode chunk
are compiled for it and checked against the host's memory. A pool far too big for the host
exits 1 with one line, before anything is compiled.
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = (  # the smoke preset, shrunk: one compile of each program takes seconds
    "--config.rl.row_lengths=(128,)",
    "--config.rl.rows_per_step=2",
    "--config.sampler.max_seq_len=128",
    "--config.sampler.num_pages=16",
    "--config.sampler.max_slots=2",
)


def _launch(*args: str) -> subprocess.CompletedProcess:
    # one CPU device (the tests' conftest forces 8; the smoke preset's mesh is 1 x 1 x 1)
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "launch", "tpu.py"),
            "--config=configs/qwen3vl_grpo.py:smoke",
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_dry_run_prints_the_plan_for_the_devices_present_and_exits_0(tmp_path):
    workdir = tmp_path / "run"
    r = _launch("--dry_run", f"--workdir={workdir}", *SMALL)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert out.startswith("plan for 1 x cpu (the devices present"), out[:300]
    assert "## train_step  (2 rows x 128 tokens" in out and "## decode_step  (2 slots" in out
    # 16 pages x 16 tokens x 2 kv heads x 32 head_dim x 2 (K, V) x 2 layers x 4 bytes (f32)
    assert "| argument: KV pool (16 pages) | 0.25 MiB |" in out
    assert "\nfits: largest program" in out
    assert not workdir.exists()  # nothing trained, nothing written


def test_dry_run_of_a_run_that_cannot_fit_exits_1_with_one_line():
    r = _launch("--dry_run", "--config.sampler.num_pages=50000000")
    assert r.returncode == 1, r.stderr[-3000:]
    line = [ln for ln in r.stderr.splitlines() if ln.strip()][-1]
    assert line.startswith("launch/tpu.py: train_step does not fit 1 x cpu: needs "), line
    assert "biggest consumer: KV pool (sampler, resident)" in line
    assert "try fewer --config.sampler.num_pages" in line
    assert "does not fit" in r.stdout  # the table too


def test_without_dry_run_the_workdir_is_required():
    r = _launch()
    assert r.returncode == 2
    assert r.stderr.strip().endswith(
        "flag --workdir must have a value other than None (only --dry_run runs without one)"
    ), r.stderr[-500:]
