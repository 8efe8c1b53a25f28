"""The monitor's pages and JSON on a synthetic database (Starlette's TestClient), its guard
(Host, Origin, token) and its command line (bad databases, exposure without a token)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import sqlalchemy as sa
from starlette.testclient import TestClient

from tests.monitor.conftest import GROUP_SIZE, GROUPS, STEPS, fill_run
from tools import monitor
from tools.monitor_app.app import make_app
from tools.monitor_app.security import allowed_hosts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def client(filled):
    url, _ = filled
    return TestClient(make_app(monitor.open_database(url)))


def test_pages(client):
    r = client.get("/")
    assert r.status_code == 200 and "run-a" in r.text and "run-b" in r.text
    assert r.text.count("finished") >= 2
    r = client.get("/runs/1")
    assert r.status_code == 200 and "Learning curves" in r.text and "/static/uPlot" in r.text
    data = client.get("/api/runs/1/steps").json()
    assert [s["step"] for s in data["steps"]] == list(range(STEPS + 1))
    assert data["steps"][1]["groups"] == GROUPS
    assert data["steps"][2]["metrics"]["rollout/reward"] == pytest.approx(0.2)
    assert [s["step"] for s in client.get("/api/runs/1/steps?after=4").json()["steps"]] == [5, 6]
    r = client.get("/runs/1/steps/2")
    assert r.status_code == 200
    assert len(re.findall(r'<section class="group', r.text)) == GROUPS
    assert len(re.findall(r'<a class="rollout', r.text)) == GROUPS * GROUP_SIZE
    assert "dropped: zero_variance" in r.text
    rid = int(re.search(r'href="/rollouts/(\d+)"', r.text).group(1))
    r = client.get(f"/rollouts/{rid}")
    assert r.status_code == 200 and '<g class="act click' in r.text
    # the model's text is escaped, never markup
    assert "&lt;tool_call&gt;" in r.text and "<tool_call>" not in r.text
    shot = re.search(r'href="(/screens/1/[0-9a-f]{64}\.png)"', r.text).group(1)
    img = client.get(shot)
    assert img.status_code == 200 and img.content[:8] == b"\x89PNG\r\n\x1a\n"
    r = client.get("/runs/1/evals/0")
    assert r.status_code == 200 and "By category" in r.text and "form" in r.text
    r = client.get(f"/runs/1/evals/{STEPS}?vs=0")
    assert r.status_code == 200 and "Δ" in r.text
    r = client.get("/runs/1/evals/0?vs_run=2&vs_step=0")
    assert r.status_code == 200 and "vs run 2" in r.text


def test_pages_on_postgres(pg_server, tmp_path):
    """The same queries on PostgreSQL (JSON columns, ordering, 404s)."""
    url = pg_server.new_database()
    fill_run(str(tmp_path / "run"), url, "pg-run", 2)
    c = TestClient(make_app(monitor.open_database(url)))
    assert "pg-run" in c.get("/").text
    assert [s["step"] for s in c.get("/api/runs/1/steps").json()["steps"]] == [0, 1, 2]
    r = c.get("/runs/1/steps/1")
    assert r.status_code == 200 and r.text.count('<a class="rollout') == GROUPS * GROUP_SIZE
    rid = int(re.search(r'href="/rollouts/(\d+)"', r.text).group(1))
    assert '<g class="act click' in c.get(f"/rollouts/{rid}").text
    assert "By category" in c.get("/runs/1/evals/2?vs=0").text
    assert c.get("/runs/1/steps/5").status_code == 404


@pytest.mark.parametrize(
    "path",
    [
        "/runs/99",
        "/runs/1/steps/999",
        "/rollouts/999999",
        "/runs/1/evals/3",
        "/runs/99/evals/0",
        "/runs/1/evals/0?vs=77",
        "/screens/1/" + "0" * 64 + ".png",
        "/screens/1/..%2Fx.png",
        "/nope",
    ],
)
def test_unknown_ids_are_404_pages(client, path):
    r = client.get(path)
    assert r.status_code == 404
    assert "<h1>404" in r.text and "Traceback" not in r.text


def test_guard_host_origin_token(filled):
    url, _ = filled
    hosts = allowed_hosts("127.0.0.1", 8080)
    app = make_app(monitor.open_database(url), token="s3cret", hosts=hosts)
    c = TestClient(app, base_url="http://127.0.0.1:8080", follow_redirects=False)
    assert c.get("/").status_code == 401
    assert c.get("/api/runs").status_code == 401
    r = c.get("/runs/1?token=wrong")
    assert r.status_code == 401
    r = c.get("/runs/1?token=s3cret")
    assert r.status_code == 303 and r.headers["location"] == "/runs/1"
    assert c.get("/runs/1").status_code == 200  # the cookie now
    assert c.get("/", headers={"Authorization": "token s3cret"}).status_code == 200
    bad_host = TestClient(app, base_url="http://evil.example:8080")
    assert bad_host.get("/?token=s3cret").status_code == 403  # DNS rebinding
    r = c.get("/api/runs", headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and "cross-origin" in r.text
    assert c.get("/api/runs", headers={"Origin": "http://127.0.0.1:8080"}).status_code == 200
    assert c.get("/api/runs", headers={"Sec-Fetch-Site": "cross-site"}).status_code == 403


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "monitor.py"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_refuses_bad_databases_with_one_line(tmp_path, capsys):
    other = tmp_path / "other.sqlite"
    e = sa.create_engine(f"sqlite:///{other}")
    with e.begin() as conn:
        conn.execute(sa.text("CREATE TABLE t (x int)"))
    (tmp_path / "junk.sqlite").write_text("not a database at all\n" * 100)
    cases = {
        str(tmp_path / "missing.sqlite"): "no such SQLite file",
        str(other): "not a cua_jax trajectory database",
        str(tmp_path / "junk.sqlite"): "cannot open the database",
        "postgresql://cua@127.0.0.1:9/none": "cannot open the database",
    }
    for db, msg in cases.items():
        with pytest.raises(SystemExit) as exc:
            monitor.main([f"--db={db}"])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1, err


def test_cli_needs_a_token_beyond_loopback(filled, capsys):
    url, _ = filled
    for args in (["--host", "0.0.0.0"], ["--host", "0.0.0.0", "--no-token"]):
        with pytest.raises(SystemExit) as exc:
            monitor.main([f"--db={url}", *args])
        assert exc.value.code == 2
        assert "pass --token" in capsys.readouterr().err


def test_cli_serves_with_a_printed_token(filled):
    import socket
    import time

    import httpx

    url, _ = filled
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            os.path.join(ROOT, "tools", "monitor.py"),
            f"--db={url}",
            f"--port={port}",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stderr.readline()
        m = re.match(
            rf"cua_jax monitor: (http://127\.0\.0\.1:{port}/\?token=([0-9a-f]{{48}}))$",
            line.strip(),
        )
        assert m, line
        deadline = time.monotonic() + 20
        while True:
            try:
                r = httpx.get(m.group(1), follow_redirects=True, timeout=5)
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert r.status_code == 200 and "run-a" in r.text
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=5).status_code == 401
    finally:
        proc.terminate()
        proc.wait(10)
