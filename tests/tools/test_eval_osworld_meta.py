"""tools/eval.py over OSWorld's meta file (`{domain: [ids]}`) with a domain filter: OSWorld's
result layout `RESULT_DIR/<action_space>/<observation_type>/<model>/<domain>/<id>/result.txt`,
and tools/show_results.py's OSWorld numbers from it. The agent is a loopback OpenAI-compatible
stand-in; the desktops are LocalDesktops (Xvfb); the tasks' scores come from their setups."""

import http.server
import json
import os
import subprocess
import sys
import threading

import pytest

from envs.vm.providers import missing_programs
from tests.main_job import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = "--config=" + os.path.join(ROOT, "configs", "qwen3vl_grpo.py") + ":smoke"


class _Agent(http.server.BaseHTTPRequestHandler):
    """Answers every chat request with the same short reply."""

    def do_POST(self):  # noqa: N802 -- http.server's name
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        msg = {"role": "assistant", "content": "DONE"}
        body = json.dumps(
            {
                "id": "x",
                "object": "chat.completion",
                "model": "cua",
                "choices": [{"index": 0, "message": msg, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _task(tid: str, setup: str, check: str, expected: str) -> dict:
    return {
        "id": tid,
        "instruction": "Nothing to do.",
        "max_steps": 1,
        "config": [{"type": "execute", "parameters": {"command": setup, "shell": True}}],
        "evaluator": {
            "func": "exact_match",
            "result": {"type": "vm_command_line", "command": check, "shell": True},
            "expected": {"type": "rule", "rules": {"expected": expected}},
        },
    }


@pytest.mark.xserver
def test_eval_takes_a_meta_file_and_writes_osworld_layout_that_show_results_reads(tmp_path):
    missing = missing_programs(("Xvfb", "openbox", "xdotool", "wmctrl", "xdpyinfo"))
    assert not missing, f"needs {missing} (make apt)"
    ev = tmp_path / "evaluation_examples"
    tasks = {
        "os": [
            _task("os-1", "echo hi > ~/a", "cat ~/a", "hi\n"),
            _task("os-2", "true", "cat ~/b", "x"),
        ],
        "chrome": [_task("chrome-1", "echo c > ~/c", "cat ~/c", "c\n")],
        "gimp": [_task("gimp-1", "echo g > ~/g", "cat ~/g", "g\n")],
    }
    for domain, ts in tasks.items():
        (ev / "examples" / domain).mkdir(parents=True)
        for t in ts:
            (ev / "examples" / domain / f"{t['id']}.json").write_text(json.dumps(t))
    meta = {d: [t["id"] for t in ts] for d, ts in tasks.items()}
    (ev / "test_small.json").write_text(json.dumps(meta))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Agent)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    out, results = tmp_path / "out", tmp_path / "results"
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags()
    try:
        r = subprocess.run(
            [
                sys.executable,
                os.path.join(ROOT, "tools", "eval.py"),
                CONFIG,
                "--config.env.kind=vm",
                "--config.env.concurrency=1",
                "--config.log.db=False",
                "--agent=openai",
                f"--base_url=http://127.0.0.1:{server.server_address[1]}/v1",
                "--model=cua/v1",
                f"--out={out}",
                f"--result_dir={results}",
                f"--osworld_meta={ev / 'test_small.json'}",
                "--domain=os,chrome",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        server.shutdown()
    assert r.returncode == 0, r.stderr[-3000:]
    model_dir = results / "pyautogui" / "screenshot" / "cua_v1"
    scores = {
        f"{d.name}/{t.name}": float((t / "result.txt").read_text())
        for d in model_dir.iterdir()
        for t in d.iterdir()
    }
    assert scores == {"os/os-1": 1.0, "os/os-2": 0.0, "chrome/chrome-1": 1.0}  # gimp filtered
    show = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "show_results.py"), str(results)]
        + ["--model=cua_v1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert show.returncode == 0, show.stderr
    lines = show.stdout.splitlines()
    assert "Domain: os Runned: 2 Successully Ran: 1 Success Rate: 50.00 %" in lines
    assert "Domain: chrome Runned: 1 Successully Ran: 1 Success Rate: 100.00 %" in lines
    assert "Runned: 3 Current Success Rate: 66.67 %" in lines and "Score: 2 / 3" in lines


def test_a_meta_file_names_tasks_that_are_not_there(tmp_path):
    from envs.tasks import TaskSourceError
    from envs.vm.sources import osworld_tasks

    (tmp_path / "os").mkdir()
    (tmp_path / "os" / "a.json").write_text(json.dumps(_task("a", "true", "true", "")))
    src = {"source_type": "osworld", "path": str(tmp_path)}
    assert [t.id for t in osworld_tasks({**src, "meta": {"os": ["a"]}})] == ["osworld/os/a"]
    with pytest.raises(TaskSourceError, match=r"not under .*\['os/b'\]"):
        osworld_tasks({**src, "meta": {"os": ["a", "b"]}})
    with pytest.raises(TaskSourceError, match=r"\['vlc'\] are not in the meta file"):
        osworld_tasks({**src, "meta": {"os": ["a"]}, "domains": ["vlc"]})
    assert osworld_tasks({**src, "meta": {"os": ["a"]}, "domains": "all"})
