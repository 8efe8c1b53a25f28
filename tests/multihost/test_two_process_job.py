"""The main job as 2 processes x 2 forced CPU devices (gloo collectives), as on two hosts.

`launch/tpu.py` joins the job from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID;
each process runs its own Chromium pool on its share of the tasks, its sampler on its own two
devices, and contributes its rows to the learner's global batch. The job is SIGKILLed (both
processes) after its step-1 checkpoint and rerun: the rerun resumes from that checkpoint, each
process with its own share, and the workdir ends with one metrics.jsonl holding each step once.
"""

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time

from cua_jax.db.records import PROCESS_STRIDE
from tests.main_job import SESSION_CACHE, xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CACHE = SESSION_CACHE  # the session's compiled programs (tests/main_job.py)

ARGS = [
    "--config=configs/qwen3vl_grpo.py:smoke",
    "--config.total_steps=2",
    "--config.mesh.fsdp=-1",  # the batch over all 4 devices of the job (2 per process)
    "--config.sft.steps=1",
    "--config.sft.episodes_per_task=1",
    "--config.sft.recovery_share=0.0",  # every oracle demo succeeds: each process has some
    "--config.rl.group_size=2",
    "--config.rl.groups_per_batch=2",  # one group per process
    "--config.rl.max_tokens=24",
    "--config.rl.filter_zero_variance=False",  # train even when a random policy scores 0
    "--config.env.concurrency=2",
    "--config.env.max_turns=1",
    "--config.rl.row_lengths=(512,)",  # one-turn samples: the 1024 rows are never used
    "--config.ckpt.save_every=1",
    "--config.ckpt.keep=5",
    "--config.log.eval_every=2",
    "--config.log.progress=False",
    f"--config.compile_cache_dir={CACHE}",
    "--config.tasks=({'source_type': 'builtin', 'split': 'train', 'templates': "
    "('click-button',), 'seed': 0, 'limit': 4},)",
    "--config.eval_tasks=({'source_type': 'builtin', 'split': 'eval', 'templates': "
    "('click-button',), 'seed': 1000, 'limit': 4},)",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(workdir: str) -> list[subprocess.Popen]:
    port = _free_port()
    procs = []
    for i in range(2):
        env = dict(os.environ)
        env.update(
            XLA_FLAGS=xla_flags(2),
            JAX_PLATFORMS="cpu",
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            JAX_NUM_PROCESSES="2",
            JAX_PROCESS_ID=str(i),
        )
        log = open(os.path.join(os.path.dirname(workdir), f"proc{i}.log"), "a")  # noqa: SIM115
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    os.path.join(ROOT, "launch", "tpu.py"),
                    *ARGS,
                    f"--workdir={workdir}",
                ],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    return procs


def _logs(workdir: str) -> str:
    parent = os.path.dirname(workdir)
    return "\n".join(
        f"--- process {i}:\n" + open(os.path.join(parent, f"proc{i}.log")).read()[-3000:]
        for i in range(2)
    )


def _wait(procs, workdir, timeout=600):
    deadline = time.time() + timeout
    for p in procs:
        p.wait(timeout=max(1, deadline - time.time()))
    assert [p.returncode for p in procs] == [0, 0], _logs(workdir)


def _rows(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(ln) for ln in f if ln.strip()]


def test_two_processes_train_checkpoint_and_resume_after_sigkill(tmp_path):
    wd = str(tmp_path / "run")
    procs = _start(wd)
    marker = os.path.join(wd, "checkpoints", "1", "commit_success.txt")
    deadline = time.time() + 600
    try:
        while not os.path.exists(marker):
            assert all(p.poll() is None for p in procs), _logs(wd)
            assert time.time() < deadline, "no checkpoint at step 1\n" + _logs(wd)
            time.sleep(0.1)
    finally:
        for p in procs:  # both "hosts" die at once
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait()
    killed_at = time.time()
    before = _rows(wd)
    assert [r["step"] for r in before][:3] == [0, 0, 1]  # eval@0, after SFT, GRPO step 1
    assert "2" not in os.listdir(os.path.join(wd, "checkpoints"))

    _wait(_start(wd), wd)
    rows = _rows(wd)
    # one metrics.jsonl, each step once: steps <= 1 kept from before the kill, step 2 resumed
    assert [r["step"] for r in rows] == [0, 0, 1, 2], rows
    assert all(r["time"] < killed_at for r in rows[:3]) and rows[3]["time"] > killed_at
    assert rows[:3] == before[:3]
    for r in rows[2:]:
        # both processes' groups (one each) trained in one global batch, no fault
        assert r["train/groups"] == 2.0, r
        assert r["rollout/env_failures"] == 0.0 and r["rollout/faults_sampler_error"] == 0.0
        assert r["train/version"] == float(r["step"])
        assert r["train/loss"] == r["train/loss"]  # finite (not NaN)
    after_sft = rows[1]
    assert after_sft["sft/steps"] == 1.0 and after_sft["sft/demos"] >= 2  # demos of both
    for r in (rows[0], rows[1], rows[3]):  # eval: 4 tasks split 2 + 2, summed
        assert r["eval/episodes_infra_fault"] == 0.0 and 0.0 <= r["eval/success"] <= 1.0
    assert sorted(os.listdir(os.path.join(wd, "checkpoints"))) == ["0", "1", "2"]
    meta = json.load(open(os.path.join(wd, "checkpoints", "2", "meta", "metadata")))
    shares = meta["processes"]
    assert len(shares) == 2 and all(s["cursor"] == 2 for s in shares)  # one group per step
    summary = json.load(open(os.path.join(wd, "summary.json")))
    assert summary["steps"] == 2
    # the trajectory database: one run, each process's own groups and eval share (#40)
    with sqlite3.connect(os.path.join(wd, "trajectories.sqlite")) as db:
        ((status,),) = db.execute("SELECT status FROM runs").fetchall()
        indices = [i for (i,) in db.execute("SELECT [index] FROM groups WHERE step = 2")]
        tags = {t for (t,) in db.execute("SELECT tag FROM evals WHERE step = 2")}
    assert status == "finished", status
    assert sorted(i // PROCESS_STRIDE for i in indices) == [0, 1], indices  # a group each
    assert len(tags) == 2 and any(t.endswith("/p1") for t in tags), tags
