"""tools/eval.py records only evals that measured something: bad sampling flags are refused
before a model is built, a result that is mostly infrastructure faults (or holds a NaN) goes to
eval.failed.json and exits non-zero naming the cause, and the last good eval.json is kept.
(The rules live in cua_jax.evaluation.verdict; tools/eval.py runs as a subprocess here.)"""

import http.server
import json
import math
import os
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

from cua_jax.evaluation import verdict
from envs.browser.host import CHROMIUM_CANDIDATES
from tests.main_job import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = "--config=" + os.path.join(ROOT, "configs", "qwen3vl_grpo.py") + ":smoke"


def _eval_tool(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags()
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "eval.py"), CONFIG, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def _traj(fault: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(infra_fault=fault is not None, failure_reason=fault)


@pytest.mark.parametrize(
    "samples,temperature,message",
    [
        (2, math.nan, "--temperature=nan"),
        (2, math.inf, "--temperature=inf"),
        (2, -1.0, "--temperature=-1.0"),
        (-1, None, "--samples=-1"),
    ],
)
def test_bad_sampling_flags_are_named(samples, temperature, message):
    with pytest.raises(ValueError, match=message):
        verdict.check_sampling(samples, temperature)
    verdict.check_sampling(0, None)
    verdict.check_sampling(4, 0.0)


def test_the_cli_refuses_a_nan_temperature_before_building_anything(tmp_path):
    r = _eval_tool(f"--out={tmp_path}", "--samples=2", "--temperature=nan")
    assert r.returncode == 2 and "--temperature=nan must be a finite number" in r.stderr, r.stderr
    assert os.listdir(tmp_path) == []


def test_mostly_faults_or_a_nan_is_a_failure_that_keeps_the_last_result(tmp_path):
    out = str(tmp_path)
    good = {"eval/success": 0.4375, "episodes": []}
    assert verdict.eval_failure(good, [_traj(), _traj("sampler_error: x")]) is None
    assert verdict.write_result(out, good) == os.path.join(out, "eval.json")

    dead = "sampler_error: openai:cua: HTTP 404: model 'cua' is not served here"
    why = verdict.eval_failure({"eval/success": 0.0}, [_traj(dead)] * 3 + [_traj()])
    assert why.startswith("3 of 4 episodes were infrastructure faults") and dead in why
    nan = {"eval/success": 0.0, "temperature": math.nan}
    assert verdict.eval_failure(nan, [_traj()]) == "temperature is nan, not a finite number"
    path = verdict.write_result(out, nan, "temperature is nan, not a finite number")
    assert path == os.path.join(out, "eval.failed.json")
    failed = json.loads(open(path).read())  # strict JSON: no bare NaN
    assert failed["temperature"] == "nan" and "temperature is nan" in failed["failure"]
    assert json.load(open(os.path.join(out, "eval.json"))) == good  # the last good one stays
    with pytest.raises(ValueError):
        verdict.write_result(out, nan)  # never a bare NaN in eval.json


class _NoSuchModel(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible endpoint that serves another model: every request is a 404."""

    def do_POST(self):  # noqa: N802 -- http.server's name
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.dumps({"error": {"message": "model 'cua' is not served here"}}).encode()
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.browser
@pytest.mark.skipif(
    not any(map(os.path.exists, CHROMIUM_CANDIDATES)), reason="needs Chromium (make apt)"
)
def test_an_eval_that_evaluated_nothing_exits_non_zero(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoSuchModel)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    out = tmp_path / "out"
    out.mkdir()
    (out / "eval.json").write_text('{"eval/success": 0.4375}')
    try:
        r = _eval_tool(
            "--agent=openai",
            f"--base_url=http://127.0.0.1:{server.server_address[1]}/v1",
            "--model=cua",
            f"--out={out}",
            '--tasks={"source_type": "builtin", "split": "eval", "seed": 1000, "limit": 2}',
            "--config.log.db=False",
        )
    finally:
        server.shutdown()
    assert r.returncode == 1, r.stderr[-3000:]
    assert "2 of 2 episodes were infrastructure faults" in r.stderr and "404" in r.stderr
    assert json.loads((out / "eval.json").read_text()) == {"eval/success": 0.4375}
    assert "infrastructure faults" in json.loads((out / "eval.failed.json").read_text())["failure"]
