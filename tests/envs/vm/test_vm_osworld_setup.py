"""OSWorld's setup steps without a desktop: the download cache (a loopback HTTP server stands in
for the internet), placeholders, loud failures, credentials at load.

The same steps run against our server on a real Xvfb desktop in test_vm_osworld_desktop.py.
"""

from __future__ import annotations

import asyncio
import http.server
import importlib.util
import json
import logging
import socket
import sqlite3
import threading

import pytest

from cua_jax.env_api import EnvError, Task
from envs.vm import osworld, osworld_setup
from envs.vm.env import VMEnv
from envs.vm.osworld_setup import ContentCache, DownloadError, SetupError, SetupOptions


class Client:
    """Records calls; ``execute`` answers from ``results`` (command -> (rc, out, err))."""

    base_url = "http://127.0.0.1:1"

    def __init__(self, results=None):
        self.calls: list[tuple] = []
        self.results = results or {}
        self.files: dict[str, bytes] = {}

    async def execute(self, command, shell=False, timeout=None):
        self.calls.append(("execute", command, shell))
        key = command if isinstance(command, str) else " ".join(command)
        rc, out, err = self.results.get(key, (0, "", ""))
        return {"status": "success", "output": out, "error": err, "returncode": rc}

    async def upload(self, path, data):
        self.calls.append(("upload", path, data))
        self.files[path] = data

    async def screen_size(self):
        return (1000, 800)


class Files(http.server.BaseHTTPRequestHandler):
    files: dict[str, bytes] = {}
    hits: list[str] = []

    def do_GET(self):  # noqa: N802 -- http.server's name
        self.hits.append(self.path)
        body = self.files.get(self.path.split("?")[0])
        self.send_response(200 if body is not None else 404)
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *a):
        pass


@pytest.fixture
def web():
    """A loopback HTTP server: (base url, its files, the paths it was asked for, stop())."""
    Files.files, Files.hits = {}, []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Files)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    stopped = []

    def stop():
        if not stopped:
            srv.shutdown()
            srv.server_close()
            stopped.append(1)

    yield f"http://127.0.0.1:{srv.server_address[1]}", Files.files, Files.hits, stop
    stop()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(coro):
    return asyncio.run(coro)


def _setup(client, steps, **opts):
    task_id = opts.pop("task_id", "t1")
    return run(
        osworld.run_setup(
            client,
            steps,
            screen_size=(1000, 800),
            task_id=task_id,
            options=SetupOptions(**opts),
        )
    )


# ----------------------------------------------------------------------------- download cache


def test_download_goes_through_the_cache_and_then_needs_no_network(web, tmp_path):
    base, files, hits, stop = web
    files["/data/report.xlsx"] = b"XLSX-BYTES"
    url = f"{base}/data/report.xlsx?download=true"
    step = {"type": "download", "parameters": {"files": [{"url": url, "path": "~/r.xlsx"}]}}
    cache = ContentCache(tmp_path)
    c = Client()
    _setup(c, [step], cache=cache)
    assert c.files == {"~/r.xlsx": b"XLSX-BYTES"} and len(hits) == 1
    # OSWorld's layout: <cache>/<task id>/<uuid5(url)>_<basename(path)>
    assert (tmp_path / "t1" / ContentCache.download_name(url, "~/r.xlsx")).read_bytes() == (
        b"XLSX-BYTES"
    )
    stop()  # the network is gone: the cached file is enough
    c2 = Client()
    _setup(c2, [step], cache=ContentCache(tmp_path, offline=True))
    assert c2.files == {"~/r.xlsx": b"XLSX-BYTES"} and len(hits) == 1


def test_a_cache_made_by_hand_by_file_name_is_used_offline(tmp_path):
    (tmp_path / "t1").mkdir()
    (tmp_path / "t1" / "notes.txt").write_bytes(b"by hand")
    url = f"http://127.0.0.1:{_closed_port()}/x/notes.txt"
    step = {"type": "download", "parameters": {"files": [{"url": url, "path": "~/notes.txt"}]}}
    c = Client()
    _setup(c, [step], cache=ContentCache(tmp_path, offline=True))
    assert c.files == {"~/notes.txt": b"by hand"}


def test_a_file_neither_cached_nor_reachable_is_a_fault_naming_the_url(web, tmp_path):
    base, _, _, _ = web
    for url in (f"{base}/missing.docx", f"http://127.0.0.1:{_closed_port()}/gone.docx"):
        step = {"type": "download", "parameters": {"files": [{"url": url, "path": "~/a.docx"}]}}
        with pytest.raises(DownloadError) as e:
            _setup(Client(), [step], cache=ContentCache(tmp_path, tries=1))
        assert url in str(e.value) and e.value.url == url
        assert not list((tmp_path / "t1").glob("*")), "no partial file is left in the cache"


def test_download_fault_through_vmenv_is_an_env_error_not_a_score(tmp_path):
    url = f"http://127.0.0.1:{_closed_port()}/f.pdf"
    spec = {
        "id": "dl-task",
        "instruction": "x",
        "config": [{"type": "download", "parameters": {"files": [{"url": url, "path": "~/f"}]}}],
        "evaluator": {"func": "infeasible"},
    }

    class Desk:
        name, client = "fake", Client()

        async def reset(self):
            pass

    env = VMEnv(Desk(), cache=ContentCache(tmp_path, tries=1))
    task = Task(id="osworld/os/dl-task", instruction="x", source="osworld", spec=spec)
    with pytest.raises(EnvError, match=url.replace(".", r"\.")):
        run(env.reset(task))
    with pytest.raises(EnvError, match="faulted"):
        run(env.evaluate())


def test_cloud_file_getter_uses_the_cache_with_osworld_names(web, tmp_path):
    base, files, hits, stop = web
    files["/gold.csv"] = b"a,b\n"
    t = osworld.parse_task(
        {
            "id": "cf",
            "instruction": "x",
            "evaluator": {
                "func": "compare_text_file",
                "result": {"type": "cache_file", "path": "out.txt"},
                "expected": {"type": "cloud_file", "path": f"{base}/gold.csv", "dest": "g.csv"},
                "postconfig": [
                    {"type": "execute", "parameters": {"command": "cat r", "stdout": "out.txt"}}
                ],
            },
        }
    )
    work = tmp_path / "work"
    work.mkdir()
    opts = SetupOptions(cache=ContentCache(tmp_path / "cache"), work_dir=str(work))

    def score(out):
        c = Client({"cat r": (0, out, "")})
        ev = osworld.evaluate(c, t, screen_size=(1, 1), last_action_was_fail=False, options=opts)
        return run(ev).score

    assert score("a,b\n") == 1.0 and (tmp_path / "cache" / "cf" / "g.csv").is_file()
    stop()
    assert score("a,c\n") == 0.0 and len(hits) == 1  # the second run read the cache


# ----------------------------------------------------------------------------- steps


def test_placeholders_include_the_password_and_it_never_shows_in_errors():
    c = Client({"echo s3cret | sudo -S false": (127, "", "sudo: not found")})
    step = {
        "type": "execute",
        "parameters": {"command": "echo {CLIENT_PASSWORD} | sudo -S true", "shell": True},
    }
    half = {
        "type": "execute",
        "parameters": {
            "command": ["xdotool", "mousemove", "{SCREEN_WIDTH_HALF}", "{SCREEN_HEIGHT}"]
        },
    }
    _setup(c, [step, half], client_password="s3cret")
    assert c.calls == [
        ("execute", "echo s3cret | sudo -S true", True),
        ("execute", ["xdotool", "mousemove", "500", "800"], False),
    ]
    bad = {
        **step,
        "parameters": {**step["parameters"], "command": "echo {CLIENT_PASSWORD} | sudo -S false"},
    }
    with pytest.raises(SetupError) as e:
        _setup(c, [bad], client_password="s3cret")
    assert (
        "s3cret" not in str(e.value) and "127" in str(e.value) and "sudo: not found" in str(e.value)
    )


def test_exit_statuses_a_missing_program_is_a_fault_others_are_logged(caplog):
    c = Client({"gone": (127, "", "gone: not found"), "killall x": (1, "", "no process")})
    with pytest.raises(SetupError, match="exit status 127"):
        _setup(c, [{"type": "execute", "parameters": {"command": "gone", "shell": True}}])
    kill = {"type": "command", "parameters": {"command": "killall x", "shell": True}}
    with caplog.at_level(logging.WARNING):
        _setup(c, [kill])
    assert "exited 1" in caplog.text
    with pytest.raises(SetupError, match="exit status 1: no process"):
        _setup(c, [kill], strict=True)


def test_until_ends_on_any_condition_like_osworld_and_fails_loudly_when_never_met(monkeypatch):
    c = Client({"probe": (0, "nothing", "")})
    step = {"type": "execute", "parameters": {"command": "probe", "shell": True}}
    _setup(
        c,
        [
            {
                **step,
                "parameters": {**step["parameters"], "until": {"returncode": 0, "stdout": "ready"}},
            }
        ],
    )
    assert len(c.calls) == 1  # the returncode matched: OSWorld ORs the conditions
    monkeypatch.setattr(osworld_setup, "UNTIL_TRIES", 3)
    with pytest.raises(SetupError, match="not met after 3 tries"):
        _setup(c, [{**step, "parameters": {**step["parameters"], "until": {"stdout": "ready"}}}])
    assert len(c.calls) == 4


def test_update_browse_history_writes_visits_into_the_cached_history(tmp_path):
    empty = tmp_path / "t1" / "history_new.sqlite"
    empty.parent.mkdir()
    con = sqlite3.connect(empty)
    con.execute(
        "CREATE TABLE urls (id INTEGER PRIMARY KEY, url, title, visit_count, typed_count, "
        "last_visit_time, hidden)"
    )
    con.execute(
        "CREATE TABLE visits (id INTEGER PRIMARY KEY, url, visit_time, from_visit, transition, "
        "segment_id, visit_duration)"
    )
    con.commit()
    con.close()
    hist = [{"url": "https://a.example/", "title": "A", "visit_time_from_now_in_seconds": 60}]
    c = Client()
    _setup(
        c,
        [{"type": "update_browse_history", "parameters": {"history": hist}}],
        cache=ContentCache(tmp_path, offline=True),
    )
    out = tmp_path / "History"
    out.write_bytes(c.files["~/.config/google-chrome/Default/History"])
    rows = sqlite3.connect(out).execute(
        "SELECT u.url, u.title FROM urls u JOIN visits v ON v.url = u.id"
    )
    assert rows.fetchall() == [("https://a.example/", "A")]
    assert empty.stat().st_size > 0 and sqlite3.connect(empty).execute(
        "SELECT count(*) FROM urls"
    ).fetchone() == (0,)  # the cached copy stays empty


# ----------------------------------------------------------------------------- loading


def _osworld_checkout(tmp_path, settings: dict[str, str]):
    """An OSWorld checkout with one multi_apps task that logs in to Google Drive."""
    d = tmp_path / "OSWorld" / "evaluation_examples" / "examples" / "multi_apps"
    d.mkdir(parents=True)
    for rel, text in settings.items():
        p = tmp_path / "OSWorld" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    task = {
        "id": "g1",
        "instruction": "upload it",
        "config": [
            {
                "type": "googledrive",
                "parameters": {
                    "settings_file": "evaluation_examples/settings/googledrive/settings.yml"
                },
            },
            {
                "type": "login",
                "parameters": {
                    "settings_file": "evaluation_examples/settings/google/settings.json"
                },
            },
        ],
        "evaluator": {"func": "infeasible"},
    }
    (d / "g1.json").write_text(json.dumps(task))
    return d / "g1.json"


def test_credential_steps_say_what_they_need_in_one_line_unless_configured(tmp_path, monkeypatch):
    f = _osworld_checkout(tmp_path / "a", {})
    with pytest.raises(osworld.TaskFormatError) as e:
        osworld.load_task(f)
    assert "\n" not in str(e.value)
    assert e.value.reason.startswith("setup step googledrive needs Google Drive API credentials")
    configured = {
        "evaluation_examples/settings/googledrive/settings.yml": (
            "client_config_backend: file\n"
            "client_config_file: evaluation_examples/settings/googledrive/client_secrets.json\n"
        ),
        "evaluation_examples/settings/googledrive/client_secrets.json": "{}",
        "evaluation_examples/settings/google/settings.json": '{"email": "e", "password": "p"}',
    }
    f = _osworld_checkout(tmp_path / "b", configured)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "desktop_env" else real(n, *a)
    )
    with pytest.raises(osworld.TaskFormatError, match="install the osworld extra"):
        osworld.load_task(f)
    monkeypatch.setattr(importlib.util, "find_spec", real)
    if real("desktop_env") is not None:
        assert osworld.load_task(f).id == "g1"


def test_sleep_steps_wait_the_desktops_sleep_scale_times_longer(monkeypatch, tmp_path):
    """A task file's `sleep` waits `seconds` x SetupOptions.sleep_scale; VMEnv takes the scale
    from its desktop (QemuDesktop: TCG_SLEEP_SCALE under TCG, 1 under KVM, or its own)."""
    from envs.vm import qemu

    waits, real_sleep = [], asyncio.sleep

    def fake_sleep(seconds, *a, **k):
        waits.append(seconds)
        return real_sleep(0)

    monkeypatch.setattr(osworld_setup.asyncio, "sleep", fake_sleep)
    step = {"type": "sleep", "parameters": {"seconds": 0.5}}
    _setup(Client(), [step])
    _setup(Client(), [step], sleep_scale=4.0)
    assert waits == [0.5, 2.0]
    monkeypatch.undo()

    class Desk:
        name, client, sleep_scale = "slow", Client(), 4.0

    assert VMEnv(Desk())._setup_options().sleep_scale == 4.0
    image = tmp_path / "guest.qcow2"
    image.write_bytes(b"")
    assert qemu.QemuDesktop(image, accel="tcg").sleep_scale == qemu.TCG_SLEEP_SCALE
    assert qemu.QemuDesktop(image, accel="kvm").sleep_scale == 1.0
    assert qemu.QemuDesktop(image, accel="tcg", sleep_scale=2).sleep_scale == 2.0
    with pytest.raises(ValueError, match="sleep_scale"):
        qemu.QemuDesktop(image, sleep_scale=0.5)
