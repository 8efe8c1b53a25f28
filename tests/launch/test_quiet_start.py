"""A start on a machine with no TPU and no GPU stays on the CPU without asking libtpu (installed
for TPU plans), so it prints none of libtpu's TPU_WORKER_HOSTNAMES errors; a JAX_PLATFORMS the
user set, or an accelerator, leaves JAX's choice alone."""

import os
import subprocess
import sys

from launch import tpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_cpu_only_machine_without_jax_platforms_gets_cpu():
    env = {}
    assert tpu.cpu_unless_accelerated(env, accelerated=False)
    assert env == {"JAX_PLATFORMS": "cpu"}


def test_a_set_jax_platforms_or_an_accelerator_is_left_alone():
    env = {"JAX_PLATFORMS": "cuda"}
    assert not tpu.cpu_unless_accelerated(env, accelerated=False)
    assert env == {"JAX_PLATFORMS": "cuda"}
    env = {}
    assert not tpu.cpu_unless_accelerated(env, accelerated=True)
    assert env == {}


def test_a_launch_on_this_machine_prints_no_libtpu_lines():
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["XLA_FLAGS"] = ""  # one CPU device, as a user's run has
    launch = [sys.executable, os.path.join(ROOT, "launch", "tpu.py")]
    # a pool too big for any host: exits 1 before anything is compiled
    args = [
        "--config=configs/qwen3vl_grpo.py:smoke",
        "--dry_run",
        "--config.sampler.num_pages=50000000",
    ]
    r = subprocess.run(
        launch + args, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300
    )
    assert r.returncode == 1, r.stderr[-3000:]
    if tpu.accelerator_present():  # the devices are this machine's chips: nothing to check
        return
    assert "plan for 1 x cpu" in r.stdout, r.stdout[:300]
    for noise in ("TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE", "Source Location Trace"):
        assert noise not in r.stderr, r.stderr[-3000:]
