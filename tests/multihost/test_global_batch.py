"""The learner's global batch from several processes' rows equals one process's batch: the
same 8 samples (half with a screenshot) trained as 2 processes x 2 CPU devices (each packing
every other sample: its rows via make_array_from_process_local_data, the images of both
gathered) and as 1 process x 4 devices give the same loss, gradient norm and token count for
two GRPO steps (the second on the parameters the first wrote). The loss aggregation is
seq-mean-token-mean: each share's weights are renormalised by its share of the job's episodes
(token-mean, the default, by its share of tokens: the same code with another count)."""

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.main_job import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LONG = bool(os.environ.get("CUA_LONG_TESTS"))
# Every variant, in this order, in one job of each kind (one process start serves them all);
# SDPO's and Entropulse's (each a learner more to compile in three processes) with
# CUA_LONG_TESTS=1
SPECS = (
    "seq-mean-token-mean:plain",
    "token-mean:shapes",
    *(("token-mean:sdpo", "token-mean:entropulse") if LONG else ()),
    "token-mean:budget",
    "token-mean:budget_mixed",
)
long_only = pytest.mark.skipif(
    not LONG, reason="a learner more in each of three processes (~1-2 min): CUA_LONG_TESTS=1"
)


def _job(processes: int, devices: int) -> list[dict[str, dict]]:
    """Each process's {spec: metrics} for SPECS."""
    port = _free_port()
    procs = []
    for i in range(processes):
        env = dict(os.environ)
        env.update(XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu")
        for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
            env.pop(k, None)
        if processes > 1:
            env.update(
                JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                JAX_NUM_PROCESSES=str(processes),
                JAX_PROCESS_ID=str(i),
            )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.multihost.global_batch_worker", *SPECS],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=900)
        assert p.returncode == 0, stderr[-3000:]
        results = {}
        for ln in stdout.splitlines():
            if ln.startswith("RESULT "):
                spec, payload = ln[len("RESULT ") :].split(" ", 1)
                results[spec] = json.loads(payload)
        assert set(results) == set(SPECS), (sorted(results), stderr[-3000:])
        out.append(results)
    return out


@pytest.fixture(scope="module")
def jobs():
    """The 1-process x 4-device job and the 2-process x 2-device job, each over every variant."""
    (one,) = _job(1, 4)
    return one, _job(2, 2)


def _variant(jobs, spec):
    one, two = jobs
    return one[spec], [two[0][spec], two[1][spec]]


def test_two_processes_train_on_the_batch_one_process_would(jobs):
    one, two = _variant(jobs, "seq-mean-token-mean:plain")
    assert two[0] == two[1]  # every process sees the job's metrics
    assert one.keys() == two[0].keys()
    assert one["rl0/num_tokens"] == 8 * 12
    for k, v in one.items():
        assert two[0][k] == pytest.approx(v, rel=2e-4, abs=1e-6), k


def test_two_processes_pack_their_shares_of_the_shape_set_and_compile_once(jobs):
    """With a strict shape set (#23), each of 2 processes packs its half of the one RL shape
    (4 of 8 rows, the images of both gathered and padded to the shape's budget): the warm-up's
    compile serves both steps, and the loss and gradient norm are the 1-process job's with the
    same shape set."""
    one, two = _variant(jobs, "token-mean:shapes")
    assert two[0] == two[1]
    for r in (one, *two):
        assert r["compiles_after_warmup"] == 0 and r["rl0/rows"] == r["rl1/rows"] == 8
    for k, v in one.items():
        assert two[0][k] == pytest.approx(v, rel=2e-4, abs=1e-6), k


@long_only
def test_two_processes_distill_as_one_process_would(jobs):
    """SDPO (#16) on 2 processes: each packs its share of the failed episodes' teacher
    sequences (its rows, the images of both gathered), the teacher pass runs on the global
    batch, each process reads back its own rows, and the distilled-token mean is over the job:
    the loss, SDPO loss, divergence and gradient norm are the 1-process job's."""
    one, two = _variant(jobs, "token-mean:sdpo")
    assert two[0] == two[1]
    assert one["sdpo0/teacher_samples"] == two[0]["sdpo0/teacher_samples"] == 4
    assert one["sdpo0/sdpo_tokens"] > 0 and one["sdpo0/sdpo_loss"] > 0
    for k, v in one.items():
        assert two[0][k] == pytest.approx(v, rel=2e-4, abs=1e-6), k


@long_only
def test_two_processes_run_the_entropulse_phase_one_process_would(jobs):
    """Entropulse on 2 processes: each keeps the successes of its own groups and packs its share
    of every SFT batch, one with no success of its own packing empty rows; the phase's SFT
    losses and the entropy before and after it are the 1-process job's (2 successes a batch
    there; 2 on the first process and none on the second here)."""
    one, two = _variant(jobs, "token-mean:entropulse")
    assert two[0] == two[1]
    assert one["entropulse/sft_loss_last"] < one["entropulse/sft_loss_first"]
    for k, v in one.items():
        assert two[0][k] == pytest.approx(v, rel=2e-4, abs=1e-6), k


def test_two_processes_take_a_token_budget_step_with_their_own_screens(jobs):
    """A token-budget batch (`rl.tokens_per_chip`) on 2 processes x 2 devices: each process packs
    its samples into the agreed shape and chunk count and gives only its own devices' screen
    groups (`make_array_from_process_local_data`, no gather, nothing replicated); the loss,
    gradient norm and token count of two steps are the 1-process, 4-device job's."""
    one, two = _variant(jobs, "token-mean:budget")
    for k in range(2):
        for r in (one, *two):
            assert r[f"rl{k}/grouped"] and r[f"rl{k}/chunks_gt_1"]
            assert r[f"rl{k}/screen_shard"] == [[1, 1]]  # a device: one micro-batch, one group
    for k in ("rl0/loss", "rl0/grad_norm", "rl0/num_tokens", "rl1/loss", "rl1/grad_norm"):
        assert two[0][k] == pytest.approx(one[k], rel=2e-4, abs=1e-6), k
        assert two[1][k] == pytest.approx(one[k], rel=2e-4, abs=1e-6), k


def test_two_processes_bucket_screens_of_two_sizes(jobs):
    """Screens of two sizes (4x6 and 4x8 patches) in a token-budget batch on 2 processes x 2
    devices: the processes agree on the sizes and on each size's chunk count, every chunk's
    screens are of one size, grouped and sharded (each device its own group, never the
    replicated flat layout), and the loss, gradient norm and token count of two steps are the
    1-process, 4-device job's."""
    one, two = _variant(jobs, "token-mean:budget_mixed")
    for k in range(2):
        for r in (one, *two):
            assert r[f"rl{k}/grouped"] and r[f"rl{k}/chunks_gt_1"]
            assert r[f"rl{k}/chunk_grids"] == ["(1, 4, 6)", "(1, 4, 8)"]
            assert r[f"rl{k}/screen_shard"] == [[1, 1]]
    for k in ("rl0/loss", "rl0/grad_norm", "rl0/num_tokens", "rl1/loss", "rl1/grad_norm"):
        assert two[0][k] == pytest.approx(one[k], rel=2e-4, abs=1e-6), k
        assert two[1][k] == pytest.approx(one[k], rel=2e-4, abs=1e-6), k
