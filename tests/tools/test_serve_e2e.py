"""The command lines end to end on built-in browser tasks: tools/eval.py --agent=openai against
tools/serve.py (separate processes, loopback HTTP) plays the episodes --agent=checkpoint plays,
token for token, and tools/show_results.py on the eval's result folders agrees with eval.json."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.main_job import xla_flags
from tools import show_results

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = "--config=" + os.path.join(ROOT, "configs", "qwen3vl_grpo.py") + ":smoke"
TASKS = (
    '--tasks={"source_type": "builtin", "split": "eval", "difficulty": "easy", "seed": 1000, '
    '"limit": 3}'
)


def _env():
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags()  # one CPU device, as a user's run
    return env


def _run(*args, timeout=300):
    r = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _episodes(out):
    res = {}
    for dom in os.listdir(os.path.join(out, "results")):
        for ex in os.listdir(os.path.join(out, "results", dom)):
            d = os.path.join(out, "results", dom, ex)
            with open(os.path.join(d, "traj.jsonl")) as f:
                res[ex] = [json.loads(x) for x in f]
    return res


@pytest.mark.slow
def test_eval_through_the_server_equals_the_checkpoint_and_show_results_agrees(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "tools/serve.py", CONFIG, f"--port={port}", "--no-token"],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ckpt, remote = str(tmp_path / "ckpt"), str(tmp_path / "openai")
        _run("tools/eval.py", CONFIG, TASKS, f"--out={ckpt}")
        t0 = time.monotonic()
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    assert json.load(r)["status"] == "ok"
                break
            except OSError:
                assert server.poll() is None, server.stderr.read()[-3000:]
                assert time.monotonic() - t0 < 120, "tools/serve.py did not come up"
                time.sleep(0.5)
        _run(
            "tools/eval.py",
            CONFIG,
            TASKS,
            f"--out={remote}",
            "--agent=openai",
            f"--base_url=http://127.0.0.1:{port}/v1",
            "--model=smoke",
        )
    finally:
        server.terminate()
        server.wait(30)
    a, b = _episodes(ckpt), _episodes(remote)
    assert sorted(a) == sorted(b) and len(a) == 3
    for ex in a:
        assert [s["token_ids"] for s in a[ex]] == [s["token_ids"] for s in b[ex]], ex
        assert [s["actions"] for s in a[ex]] == [s["actions"] for s in b[ex]], ex
        assert [s["response"] for s in a[ex]] == [s["response"] for s in b[ex]], ex
    ja = json.load(open(os.path.join(ckpt, "eval.json")))
    jb = json.load(open(os.path.join(remote, "eval.json")))
    assert {k: v for k, v in ja.items() if k.startswith("eval/")} == {
        k: v for k, v in jb.items() if k.startswith("eval/")
    }
    # show_results on the result folders: the counts eval.json has
    s = show_results.R.summarize(os.path.join(ckpt, "results"))
    ran = ja["num_tasks"] - ja["eval/episodes_infra_fault"]
    assert s.ran == ran and s.successes == round(ja["eval/success"] * ran)
    for dom, d in s.domains.items():
        assert d.successes / d.ran == pytest.approx(ja[f"eval/success/{dom}"])
    assert show_results.main([os.path.join(ckpt, "results")]) == 0


@pytest.mark.skipif(
    os.environ.get("CUA_LONG_TESTS") != "1",
    reason="serve.py + an OSWorld-meta eval on a LocalDesktop costs ~40 s of CPU: CUA_LONG_TESTS=1",
)
def test_an_osworld_meta_eval_through_the_server_writes_what_show_results_reads(tmp_path):
    """tools/eval.py --agent=openai --osworld_meta against tools/serve.py (token by environment)
    on a LocalDesktop: one OSWorld-format task whose setup already solves it (the smoke model's
    actions are noise), so result.txt says 1 only if the episode ran through the server."""
    from tests.tools.test_eval_osworld_meta import _task

    ev = tmp_path / "evaluation_examples"
    (ev / "examples" / "os").mkdir(parents=True)
    task = _task("os-1", "echo hi > /home/user/a", "cat ~/a", "hi\n")
    (ev / "examples" / "os" / "os-1.json").write_text(json.dumps(task))
    (ev / "meta.json").write_text(json.dumps({"os": ["os-1"]}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = "a-served-eval-token-0123456789"
    env = {**_env(), "CUA_SERVE_TOKEN": token, "OPENAI_API_KEY": token}
    server = subprocess.Popen(
        [sys.executable, "tools/serve.py", CONFIG, f"--port={port}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    results = tmp_path / "results"
    try:
        t0 = time.monotonic()
        while True:
            try:
                req = urllib.request.Request(
                    f"http://127.0.0.1:{port}/health", headers={"Authorization": f"Bearer {token}"}
                )
                with urllib.request.urlopen(req, timeout=2):
                    break
            except OSError:
                assert server.poll() is None, server.stderr.read()[-3000:]
                assert time.monotonic() - t0 < 120, "tools/serve.py did not come up"
                time.sleep(0.5)
        r = subprocess.run(
            [
                sys.executable,
                "tools/eval.py",
                CONFIG,
                "--config.env.kind=vm",
                "--config.env.concurrency=1",
                "--config.log.db=False",
                "--agent=openai",
                f"--base_url=http://127.0.0.1:{port}/v1",
                "--model=smoke",
                f"--out={tmp_path / 'out'}",
                f"--result_dir={results}",
                f"--osworld_meta={ev / 'meta.json'}",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        server.terminate()
        server.wait(30)
    assert r.returncode == 0, r.stderr[-3000:]
    ep = results / "pyautogui" / "screenshot" / "smoke" / "os" / "os-1"
    assert (ep / "result.txt").read_text().strip() in ("1", "1.0")
    steps = [json.loads(x) for x in (ep / "traj.jsonl").read_text().splitlines()]
    assert steps and all(s["token_ids"] for s in steps)  # replies came from the served engine
    show = subprocess.run(
        [sys.executable, "tools/show_results.py", str(results), "--model=smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert show.returncode == 0 and "Score: 1 / 1" in show.stdout, show.stdout + show.stderr
