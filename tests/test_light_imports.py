"""The host-side modules import without JAX: the monitor and the trajectory database, the
trajectory record and store, the processor, the OpenAI-compatible server, the rollout's policies
and the sampler's host side (the scheduler, the page allocator, `SamplingParams`). The project
imports its own modules at the top (no function-local imports to defer JAX); this is the line
that keeps the device side out of these."""

from __future__ import annotations

import subprocess
import sys

LIGHT = (
    "tools.monitor_app.app",
    "cua_jax.db",
    "cua_jax.rl.store",
    "cua_jax.rl.rollout",
    "cua_jax.data.processor",
    "cua_jax.evaluation.server",
    "cua_jax.evaluation.offline",
    "cua_jax.sampler.scheduler",
    "cua_jax.sampler.params",
    "envs.tasks",
    "envs.vm.server",
)


def test_host_side_modules_import_without_jax():
    code = (
        f"import importlib, sys\nfor m in {LIGHT!r}: importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'flax')))\n"
        "assert not bad, bad[:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
