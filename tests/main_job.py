"""The main job (`launch/tpu.py`) started as a user starts it, for the end-to-end tests.

r = run_main_job(["--config=configs/qwen3vl_grpo.py:smoke", ...], workdir)
rows = metrics_rows(workdir)
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, "launch", "tpu.py")


def job_env(devices: int | None = None) -> dict[str, str]:
    """This process's environment for a child job on the CPU: one device, as a laptop run has
    (the test session's forced 8 are dropped), or `devices` forced ones."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    if devices is not None:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    return env


def run_main_job(
    args: list[str], workdir: str, *, devices: int | None = None, timeout: float = 900
) -> subprocess.CompletedProcess:
    """`launch/tpu.py ARGS --workdir=WORKDIR` to the end; asserts it exited 0 (the assertion
    shows the end of its stderr)."""
    r = subprocess.run(
        [sys.executable, LAUNCH, *args, f"--workdir={workdir}"],
        cwd=ROOT,
        env=job_env(devices),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return r


def metrics_rows(workdir: str) -> list[dict]:
    """The run's WORKDIR/metrics.jsonl rows."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(ln) for ln in f if ln.strip()]
