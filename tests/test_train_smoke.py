"""The main job end to end: launch/tpu.py on the smoke preset (shortened), then SIGKILL + resume.

Real pieces only: the tiny Qwen3-VL, the shipped tokenizer, the paged sampler, the learner, and
built-in tasks in Debian's Chromium through Playwright. The full-length smoke run (SFT, then GRPO
until the eval success rate rises) is `make smoke`; its figures are in BENCHMARKS.md.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.db.train_checks import check_train_database, wait_for_db_step
from tests.main_job import LAUNCH, ROOT, SESSION_CACHE, job_env, metrics_rows, run_main_job

# One persistent compilation cache for this module's runs: the killed and resumed runs load the
# steps the first run compiled.
CACHE = SESSION_CACHE  # the session's compiled programs (tests/main_job.py)

SHORT = [
    "--config=configs/qwen3vl_grpo.py:smoke",
    "--config.total_steps=3",
    "--config.sft.steps=2",
    "--config.sft.episodes_per_task=1",
    "--config.sft.num_tasks=2",  # demonstrations of 2 of the 4 training tasks
    "--config.rl.group_size=2",
    "--config.rl.groups_per_batch=2",
    "--config.rl.max_tokens=40",
    "--config.env.concurrency=4",
    "--config.env.max_turns=1",
    "--config.rl.row_lengths=(512,)",  # one-turn samples: the 1024 rows are never used
    "--config.ckpt.save_every=1",
    "--config.log.eval_every=3",
    "--config.log.progress=False",
    f"--config.compile_cache_dir={CACHE}",
    "--config.tasks=({'source_type': 'builtin', 'split': 'train', 'difficulty': 'easy', "
    "'category': 'click', 'seed': 0, 'limit': 4},)",
    "--config.eval_tasks=({'source_type': 'builtin', 'split': 'eval', 'difficulty': 'easy', "
    "'seed': 1000, 'limit': 4},)",
]


# SHORT's shape, for the trajectory database checks (smoke preset: log.num_groups_to_log=1)
DB_SHAPE = {"group_size": 2, "groups_per_step": 2, "logged_groups": 1}


def _cmd(workdir, *extra):
    return [sys.executable, LAUNCH, *SHORT, *extra, f"--workdir={workdir}"]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    wd = str(tmp_path_factory.mktemp("smoke"))
    # Rows of an earlier attempt that died before its first checkpoint: the run starts afresh.
    with open(os.path.join(wd, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 0, "stale_attempt": 1.0}) + "\n")
    run_main_job(SHORT, wd)
    return wd


def test_smoke_run_writes_everything(full_run):
    wd = full_run
    rows = metrics_rows(wd)
    assert [r["step"] for r in rows] == [0, 0, 1, 2, 3]
    assert not any("stale_attempt" in r for r in rows)
    step0, after_sft = rows[0], rows[1]
    assert step0["phase_sft"] == 0.0 and "eval/success" in step0
    assert after_sft["phase_sft"] == 1.0 and after_sft["sft/demos"] >= 1
    # sft.num_tasks=2: 2 of the 4 training tasks demonstrated (some demonstrations may fail)
    assert round(after_sft["sft/demos"] / after_sft["sft/demo_success"]) == 2
    assert after_sft["sft/loss_last"] < after_sft["sft/loss_first"]
    for r in rows[2:]:
        assert r["rollout/staleness_max"] == 0.0  # sync mode is on-policy
        assert r["store/put"] == r["store/trained"] + r["store/dropped_stale"] + r["store/pending"]
        assert 0.0 <= r["rollout/invalid_action_rate"] <= 1.0
    assert "eval/success" in rows[-1]
    summary = json.load(open(os.path.join(wd, "summary.json")))
    assert summary["steps"] == 3 and summary["eval_success_step0"] == step0["eval/success"]
    assert summary["eval_success_final"] == rows[-1]["eval/success"]
    assert os.path.getsize(os.path.join(wd, "curves.png")) > 1000
    pages = os.listdir(os.path.join(wd, "episodes"))
    assert "eval_step0.html" in pages and "eval_step3.html" in pages
    assert any(p.startswith("train_step") for p in pages)
    assert sorted(os.listdir(os.path.join(wd, "checkpoints"))) == ["2", "3"]  # keep=2
    assert os.listdir(os.path.join(wd, "tb"))
    assert any(f.startswith("jit_") for f in os.listdir(CACHE))  # compiled steps were cached
    # the oracle demonstrations are kept for reuse: --config.sft.source=WORKDIR/sft_demos
    index = os.path.join(wd, "sft_demos", "index.jsonl")
    assert sum(1 for _ in open(index)) == after_sft["sft/demos"]


def test_smoke_run_database_matches_its_metrics(full_run):
    """The trajectory database of the run (SQLite in the workdir, the default) holds every
    metrics row, each step's groups, rollouts and turns, every eval and the SFT phase, and the
    run finished (tests/db/train_checks.py)."""
    info = check_train_database(full_run, **DB_SHAPE)
    assert info["steps"] == [0, 1, 2, 3]
    assert {(0, "step0"), (0, "after_sft"), (3, "step3")} <= set(info["evals"])


def _comparable(row):
    """What a resumed run must reproduce: not timings, nor compile counts (a resumed process
    compiles its programs afresh, or loads them from the persistent cache)."""
    return {k: v for k, v in row.items() if not k.startswith(("time", "compile/")) and k != "step"}


def test_resume_after_sigkill_reproduces_the_following_steps(full_run, tmp_path):
    wd = str(tmp_path / "killed")
    proc = subprocess.Popen(
        _cmd(wd),
        cwd=ROOT,
        env=job_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    done_marker = os.path.join(wd, "checkpoints", "1", "commit_success.txt")
    deadline = time.time() + 900
    while not os.path.exists(done_marker):
        assert proc.poll() is None, proc.stderr.read()[-4000:]
        assert time.time() < deadline, "no checkpoint at step 1"
        time.sleep(0.2)
    wait_for_db_step(wd, 1)  # (a record still queued at a SIGKILL is lost: see the DB check)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    run_main_job(SHORT, wd)
    resumed = {row["step"]: row for row in metrics_rows(wd) if row["step"] >= 2}
    reference = {row["step"]: row for row in metrics_rows(full_run) if row["step"] >= 2}
    assert sorted(resumed) == sorted(reference) == [2, 3]
    for step in (2, 3):
        a, b = _comparable(resumed[step]), _comparable(reference[step])
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-5), (step, k)
    # the database: the resumed process continued the killed one's run row; the steps it redid
    # replaced what the killed one had logged (one row per step, the resumed values)
    uid = open(os.path.join(wd, "trajectories.run")).read()
    info = check_train_database(wd, **DB_SHAPE)
    assert info["steps"] == [0, 1, 2, 3] and info["uid"] in uid


def _ask_live_policy(wd, proc):
    """A client of the run's live policy server (config.serve.port) until the run exits: greedy
    requests naming the server's model, answered by the weights version the run has then."""
    import httpx

    path = os.path.join(wd, "serve.json")
    while not os.path.exists(path):
        if proc.poll() is not None:
            return None, []
        time.sleep(0.2)
    time.sleep(0.2)  # written whole before the loop goes on; read it once it is there
    info = json.load(open(path))
    auth = {"Authorization": f"Bearer {info['token']}"}
    body = {"messages": [{"role": "user", "content": "click OK"}], "max_tokens": 3}
    replies = []
    with httpx.Client(timeout=120) as client:
        while proc.poll() is None:
            try:
                r = client.post(info["url"] + "/chat/completions", json=body, headers=auth)
            except httpx.TransportError:  # the run stopped serving as it finished
                break
            replies.append((r.status_code, r.json()))
            time.sleep(0.3)
    return info, replies


def test_async_mode_keeps_staleness_within_the_bound(tmp_path):
    """Rollouts keep running while the learner trains; the staleness gate and the store keep
    every trained group within max_steps_off_policy, and the learner's idle share is logged.
    Entropulse phases run between the async steps. With log.eval_before_sft=False (`make
    smoke`'s setting) the random-init policy is not scored: the post-SFT eval is the first.
    The run serves its live policy (config.serve.port) to a client meanwhile: the replies come
    from the rollouts' engine and name the learner version that wrote them."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    wd = str(tmp_path / "async")
    extra = (
        f"--config.serve.port={port}",
        "--config.rl.mode=async",
        "--config.total_steps=5",
        "--config.log.eval_every=5",
        "--config.rl.filter_zero_variance=False",
        "--config.env.max_turns=2",
        "--config.rl.max_steps_off_policy=1",
        "--config.ckpt.save_every=100",
        "--config.log.db=False",
        # Entropulse in async mode (#16): a phase after steps 2 and 4, on this run's successes
        "--config.rl.entropulse_every=2",
        "--config.rl.entropulse_sft_steps=2",
        "--config.log.eval_before_sft=False",
    )
    proc = subprocess.Popen(
        _cmd(wd, *extra),
        cwd=ROOT,
        env=job_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        info, replies = _ask_live_policy(wd, proc)
        _, err = proc.communicate(timeout=900)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-4000:]
    assert info is not None and info["url"] == f"http://127.0.0.1:{port}/v1"
    assert (
        info["model"] == "async" and f"serving the live policy as 'async' at {info['url']}" in err
    )
    assert len(replies) >= 2 and all(code == 200 for code, _ in replies), replies[:3]
    versions = [reply["policy_version"] for _, reply in replies]
    assert versions == sorted(versions) and versions[-1] >= 1, versions  # served while training
    assert all(reply["model"] == "async" for _, reply in replies)
    assert all(
        reply["system_fingerprint"] == f"cua_jax-v{reply['policy_version']}" for _, reply in replies
    )
    with pytest.raises(OSError):  # the server stopped with the run
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    step0 = [row for row in metrics_rows(wd) if row["step"] == 0]
    assert [row["phase_sft"] for row in step0] == [1.0] and "eval/success" in step0[0]
    summary = json.load(open(os.path.join(wd, "summary.json")))
    assert summary["eval_success_step0"] is None
    assert summary["eval_success_after_sft"] == step0[0]["eval/success"]
    gain = summary["eval_success_final"] - summary["eval_success_after_sft"]
    assert summary["eval_success_rl_gain"] == pytest.approx(gain)
    rows = [row for row in metrics_rows(wd) if row["step"] >= 1]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]
    for row in rows:
        assert 0.0 <= row["rollout/staleness_max"] <= 1.0
        assert 0.0 <= row["time/learner_idle_share"] <= 1.0
        s = {k[len("store/") :]: v for k, v in row.items() if k.startswith("store/")}
        assert s["put"] == s["trained"] + s["dropped_stale"] + s["pending"]
        assert s["trained"] == 4 * row["step"]  # 2 groups of 2 per step
        # an Entropulse phase after every second step: SFT on the successes since the last
        # one, or skipped (and said so) when there were none
        phase = row.get("entropulse/phase", 0.0)
        assert phase == (1.0 if row["step"] in (2, 4) else 0.0)
        if phase:
            assert row["entropulse/phases"] == row["step"] // 2
            trained = row.get("entropulse/sft_steps") == 2.0
            assert trained or row.get("entropulse/skipped_no_success") == 1.0, row
    assert not any(f.startswith("trajectories") for f in os.listdir(wd))  # log.db=False


def _eval_tool(*args):
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "eval.py"), *args],
        cwd=ROOT,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_eval_tool_reproduces_the_runs_eval(full_run, tmp_path):
    """tools/eval.py on the run's step-3 checkpoint gives the success its training-time eval
    logged at step 3 (same config, tasks and seed; greedy)."""
    out = str(tmp_path / "eval")
    r = _eval_tool(f"--workdir={full_run}", "--step=3", f"--out={out}")
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.load(open(os.path.join(out, "eval.json")))
    logged = {row["step"]: row for row in metrics_rows(full_run)}[3]
    want = {k: v for k, v in logged.items() if k.startswith("eval/success")}
    assert {k: v for k, v in got.items() if k.startswith("eval/success")} == want
    assert got["step"] == 3 and got["num_tasks"] == len(got["episodes"]) == 4
    assert os.path.getsize(os.path.join(out, "episodes.html")) > 1000
    # ... and goes into the run's database as an eval of its run row (status untouched)
    import sqlalchemy as sa

    from cua_jax.db import make_engine
    from cua_jax.db import models as m

    engine = make_engine(os.path.join(full_run, "trajectories.sqlite"))
    with engine.connect() as c:
        runs = c.execute(sa.select(m.Run.id, m.Run.status)).all()
        ev = c.execute(sa.select(m.Eval).where(m.Eval.tag == "tools_step_3")).one()
        n = c.execute(sa.select(sa.func.count()).where(m.Rollout.eval_id == ev.id)).scalar()
    engine.dispose()
    assert [r.status for r in runs] == ["finished"] and ev.run_id == runs[0].id
    assert ev.step == 3 and ev.success == got["eval/success"] and n == 4


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--workdir=/nope/run"], "/nope/run/config.json does not exist"),
        ([], "pass exactly one of --workdir"),
        (["--config=configs/qwen3vl_grpo.py:smoke"], "--out is required with --config"),
        (["--workdir={wd}", "--tasks={{not json"], "--tasks is not JSON"),
        (["--workdir={wd}", "--step=99"], "no checkpoint at step 99"),
    ],
)
def test_eval_tool_bad_input_fails_with_a_clear_message(full_run, args, expected):
    r = _eval_tool(*(a.format(wd=full_run) for a in args))
    assert r.returncode != 0
    assert expected in r.stderr, r.stderr[-2000:]
