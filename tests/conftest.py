"""Test set-up shared by every test.

8 host (CPU) devices are forced before JAX is imported anywhere, so the sharding tests can build an
`fsdp x tensor` mesh on a laptop. Everything else runs on device 0 as usual. The tests' programs,
and their child jobs', are compiled at XLA's backend optimisation level 0 (`TEST_XLA_FLAGS`): the
same operations, LLVM optimising less; on this 2-core machine it halves most tests' compile time,
which is most of their time, and numerics move by float reassociation only.
"""

import os

from tests.main_job import TEST_XLA_FLAGS  # noqa: E402

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " " + TEST_XLA_FLAGS
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# As launch/tpu.py: OpenBLAS's own thread pool (XLA:CPU's triangular solves) spins against the
# two pytest workers' XLA threads on a 2-core machine.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# Tests never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# Silent broadcasting bugs fail fast (STYLE.md): operands of different ranks must be broadcast
# explicitly.
jax.config.update("jax_numpy_rank_promotion", "raise")

# The modules that take the longest (minutes of CPU each in a full run, longest first) start
# first: `pytest -n 2 --dist loadscope --no-loadscope-reorder` (make test) hands whole modules to
# the workers in collection order, and a long module collected last runs alone at the end while
# the other worker idles (xdist's own reorder, by test count, put the one-test end-to-end modules
# last: a 20-minute tail).
SLOW_FIRST = (
    "tests/envs/vm/test_vm_train_smoke.py",
    "tests/test_train_smoke.py",
    "tests/test_qwen35_smoke.py",
    "tests/tools/test_plan.py",
    "tests/multihost/test_global_batch.py",
    "tests/rl/test_token_budget.py",
    "tests/tools/test_plan_budget.py",
    "tests/multihost/test_two_process_job.py",
    "tests/rl/test_moe_learner.py",
    "tests/rl/test_learner.py",
    "tests/test_train_forced_mesh.py",
    "tests/launch/test_launch_flags.py",
    "tests/envs/test_ray_fleet.py",
    "tests/rl/test_sdpo.py",
    "tests/envs/vm/test_vm_tasks.py",
    "tests/envs/browser/test_suite.py",
)


def pytest_collection_modifyitems(session, config, items):
    """Collection order with the `SLOW_FIRST` modules ahead, each kept whole and in order."""
    rank = {m: i for i, m in enumerate(SLOW_FIRST)}
    items.sort(key=lambda it: rank.get(it.nodeid.split("::")[0], len(rank)))
