"""The main job (`launch/tpu.py`) started as a user starts it, for the end-to-end tests.

r = run_main_job(["--config=configs/qwen3vl_grpo.py:smoke", ...], workdir)
rows = metrics_rows(workdir)
"""

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, "launch", "tpu.py")
# One persistent compilation cache for every main job of a test session (both xdist workers):
# the smoke preset's sampler buckets and learner steps are compiled once, not once a job.
SESSION_CACHE = os.path.join(
    tempfile.gettempdir(),
    f"cua_test_jax_cache_{os.environ.get('PYTEST_XDIST_TESTRUNUID', os.getpid())}",
)


# The test session's XLA flags (tests/conftest.py), for child jobs too: LLVM's -O0 for the CPU
# backend's code (measured on this machine: test_learner + test_engine_parity 214 -> 156 s; a
# smoke job's first-step compile 164 -> 80 s, its steady step 4.3 -> 6.0 s). A job that runs
# many steps can take XLA's default instead (`optimized=True`): the mesh-parity test's two jobs
# of 40 SFT steps took 272 s of CPU optimized against 291 s at -O0 (one run each, load 9-12).
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"


def xla_flags(devices: int | None = None, *, optimized: bool = False) -> str:
    """XLA_FLAGS for a child job: the tests' flags (none when `optimized`) and `devices` forced
    CPU devices (None: one, as a laptop run has)."""
    forced = f" --xla_force_host_platform_device_count={devices}" if devices else ""
    return ("" if optimized else TEST_XLA_FLAGS) + forced


def job_env(devices: int | None = None, *, optimized: bool = False) -> dict[str, str]:
    """This process's environment for a child job on the CPU: one device, as a laptop run has
    (the test session's forced 8 are dropped), or `devices` forced ones. A job run with
    `--config.compile_cache_dir=` (empty) uses the session's cache (JAX's own default)."""
    env = dict(os.environ)
    env.setdefault("JAX_COMPILATION_CACHE_DIR", SESSION_CACHE)
    env["XLA_FLAGS"] = xla_flags(devices, optimized=optimized)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def run_main_job(
    args: list[str],
    workdir: str,
    *,
    devices: int | None = None,
    optimized: bool = False,
    timeout: float = 900,
) -> subprocess.CompletedProcess:
    """`launch/tpu.py ARGS --workdir=WORKDIR` to the end; asserts it exited 0 (the assertion
    shows the end of its stderr). `optimized`: XLA's default optimization (`xla_flags`)."""
    r = subprocess.run(
        [sys.executable, LAUNCH, *args, f"--workdir={workdir}"],
        cwd=ROOT,
        env=job_env(devices, optimized=optimized),
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
