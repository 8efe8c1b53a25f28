"""VMServer's handlers called one at a time, with no X display and no HTTP server.

Each test builds an aiohttp request (``make_mocked_request`` with a real body stream), calls one
handler method, and checks the reply against an independent source: the file system, a shell
run by the test itself, or the bytes the fake screen holds.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import time
from pathlib import Path
from unittest import mock

import pytest
from aiohttp import streams, web
from aiohttp.test_utils import make_mocked_request
from PIL import Image

from envs.vm import server_exec
from envs.vm.server import VMServer
from envs.vm.server_files import PathGuard, directory_tree


class FakeScreen:
    """A 40x30 display whose pixels and pointer the test sets."""

    display_name = ":fake"

    def __init__(self) -> None:
        self.img = Image.new("RGB", (40, 30), (10, 200, 30))
        self.pointer = (7, 9)

    def size(self) -> tuple[int, int]:
        return self.img.size

    def cursor_position(self) -> tuple[int, int]:
        return self.pointer

    def screenshot_png(self) -> tuple[bytes, float, float]:
        buf = io.BytesIO()
        self.img.save(buf, format="PNG")
        return buf.getvalue(), 0.0, 0.0


def _server(tmp_path: Path, **kw) -> VMServer:
    return VMServer(screen=FakeScreen(), allowed_roots=[tmp_path], warm_pyautogui=False, **kw)


def _request(method: str, path: str, body: bytes = b"", content_type: str | None = None):
    """A request whose body is really streamed (as aiohttp's server would feed it)."""
    payload = streams.StreamReader(mock.Mock(), 2**16, loop=asyncio.get_running_loop())
    payload.feed_data(body)
    payload.feed_eof()
    headers = {"Content-Length": str(len(body))}
    if content_type:
        headers["Content-Type"] = content_type
    return make_mocked_request(method, path, headers=headers, payload=payload)


def _json_request(path: str, obj) -> web.Request:
    return _request("POST", path, json.dumps(obj).encode(), "application/json")


def _body(resp: web.Response):
    return json.loads(resp.body)


def test_screen_handlers_report_the_screen(tmp_path):
    srv = _server(tmp_path)

    async def go():
        size = _body(await srv.screen_size(_request("POST", "/screen_size")))
        pos = _body(await srv.cursor_position(_request("GET", "/cursor_position")))
        shot = await srv.screenshot(_request("GET", "/screenshot"))
        return size, pos, shot

    size, pos, shot = asyncio.run(go())
    assert size == {"width": 40, "height": 30} and pos == [7, 9]
    assert shot.content_type == "image/png"
    img = Image.open(io.BytesIO(shot.body))
    assert img.size == (40, 30) and img.getpixel((3, 3)) == (10, 200, 30)


def test_platform_and_desktop_path(tmp_path):
    srv = _server(tmp_path)

    async def go():
        plat = await srv.platform(_request("GET", "/platform"))
        desk = await srv.desktop_path(_request("POST", "/desktop_path"))
        return plat.text, _body(desk)

    plat, desk = asyncio.run(go())
    assert plat == subprocess.run(["uname", "-s"], capture_output=True, text=True).stdout.strip()
    assert desk == {"desktop_path": os.path.expanduser("~/Desktop")}


def test_execute_runs_the_command_and_reports_its_output(tmp_path):
    srv = _server(tmp_path, exec_limit_s=5)
    marker = tmp_path / "ran"

    async def go():
        ok = await srv.execute(
            _json_request(
                "/execute",
                {"command": f"echo hi; echo e >&2; touch {marker}; exit 4", "shell": True},
            )
        )
        missing = await srv.execute(_json_request("/execute", {"command": []}))
        slow = await srv.execute(
            _json_request("/execute", {"command": ["sleep", "30"], "timeout": 0.3})
        )
        return ok, missing, slow

    ok, missing, slow = asyncio.run(go())
    assert _body(ok) == {"status": "success", "output": "hi\n", "error": "e\n", "returncode": 4}
    assert marker.exists()
    assert missing.status == 400 and "no command given" in _body(missing)["message"]
    assert slow.status == 500 and _body(slow)["timed_out"] is True
    assert "timed out after 0.3 seconds" in _body(slow)["message"]


def test_command_output_is_capped_and_the_reply_says_so(tmp_path):
    # `head -c 200M /dev/zero | tr '\0' a` took the server from 60 to 675 MB (all of it was
    # held, then put in the JSON reply); `yes` for the 120 s limit would need tens of GB.
    srv = _server(tmp_path, exec_limit_s=20)
    cap = server_exec.MAX_OUTPUT_BYTES
    big = f"head -c {cap + 3 * 2**20} /dev/zero | tr '\\0' a; echo done >&2"

    async def go():
        out = await srv.execute(_json_request("/execute", {"command": big, "shell": True}))
        bash = await srv.run_bash_script(_json_request("/run_bash_script", {"script": big}))
        small = await srv.execute(_json_request("/execute", {"command": ["echo", "hi"]}))
        worker = server_exec.PyAutoGUIWorker(  # the warm worker, minus the X display
            server_exec.WORKER_SRC.replace("import pyautogui\n", "").replace(
                "pyautogui.PAUSE, pyautogui.FAILSAFE = 0.1, True", "pass"
            )
        )
        try:
            snippet = await worker.run_capped(f"print('b' * {cap})", 20)
        finally:
            worker.kill()
        return _body(out), _body(bash), _body(small), snippet

    out, bash, small, snippet = asyncio.run(go())
    assert out["output"] == "a" * cap and out["error"] == "done\n" and out["truncated"] is True
    assert out["returncode"] == 0 and out["status"] == "success"
    assert len(bash["output"]) == cap and bash["truncated"] is True
    assert "truncated" not in small  # OSWorld's reply shape when nothing was cut
    assert snippet.returncode == 0 and snippet.truncated
    assert snippet.stdout == "b" * (cap // 4)


def test_arguments_of_the_wrong_type_are_400s_not_500s(tmp_path):
    # Each was a 500 from deep inside a handler (TypeError, ValueError), and a 1e308 s
    # open_file timeout waited for a window forever (it is capped at the exec limit now).
    srv = _server(tmp_path, exec_limit_s=1)
    (tmp_path / "f.txt").write_text("x")
    cases = [
        (srv.execute, "/execute", {"command": 123}, "command must be a string or a list"),
        (srv.execute, "/execute", {"command": 123, "shell": True}, "command must be"),
        (srv.execute, "/execute", {"command": [["ls"]]}, "command must be"),
        (srv.launch, "/setup/launch", {"command": {"a": 1}}, "command must be"),
        (srv.run_python, "/run_python", {"code": 123}, "code must be a string"),
        (srv.run_bash_script, "/run_bash_script", {"script": ["ls"]}, "script must be"),
        (
            srv.run_bash_script,
            "/run_bash_script",
            {"script": "ls", "working_dir": 1},
            "working_dir",
        ),
    ]
    path = str(tmp_path / "f.txt")
    for bad in ("x", -1, None, True, [1]):
        cases.append((srv.open_file, "/setup/open_file", {"path": path, "timeout": bad}, "timeout"))

    async def go():
        out = []
        for handler, route, body, _ in cases:
            out.append(await handler(_json_request(route, body)))
        return out

    with mock.patch("shutil.which", return_value="/bin/true"):  # xdg-open: a no-op here
        replies = asyncio.run(go())
    for (_, route, body, message), r in zip(cases, replies, strict=True):
        text = json.dumps(_body(r))
        assert r.status == 400 and message in text, (route, body, r.status, text)


def test_open_file_waits_open_wait_s_for_its_window_unless_the_request_says(tmp_path):
    # OSWorld's client names no timeout: the server's own wait applies (a slow TCG guest runs
    # its server with --open-wait 240, since Calc's cold start there takes about 60 s)
    (tmp_path / "f.txt").write_text("x")
    srv = _server(tmp_path, open_wait_s=0.5)
    body = {"path": str(tmp_path / "f.txt")}

    async def go(body):
        t = time.monotonic()
        with (
            mock.patch("shutil.which", return_value="/bin/true"),  # xdg-open: a no-op here
            mock.patch("envs.vm.server.wmctrl_windows", mock.AsyncMock(return_value=[])),
        ):
            r = await srv.open_file(_json_request("/setup/open_file", body))
        return r, time.monotonic() - t

    r, waited = asyncio.run(go(body))
    assert r.status == 500 and "window not found" in json.dumps(_body(r))
    assert 0.5 <= waited < 5
    r, waited = asyncio.run(go({**body, "timeout": 0}))
    assert r.status == 500 and waited < 0.5


def test_bad_json_is_a_400_naming_the_path(tmp_path):
    srv = _server(tmp_path)

    async def go():
        with pytest.raises(web.HTTPBadRequest) as e:
            await srv.execute(_request("POST", "/execute", b"{not json", "application/json"))
        with pytest.raises(web.HTTPBadRequest) as e2:
            await srv.list_directory(_json_request("/list_directory", ["a", "list"]))
        return e.value.text, e2.value.text

    t1, t2 = asyncio.run(go())
    assert t1.startswith("/execute: the body must be a JSON object")
    assert t2 == "/list_directory: the body must be a JSON object"


def test_run_bash_script_and_run_python(tmp_path):
    srv = _server(tmp_path)

    async def go():
        sh = await srv.run_bash_script(
            _json_request(
                "/run_bash_script",
                {"script": "pwd; echo err >&2; exit 2", "working_dir": str(tmp_path)},
            )
        )
        nodir = await srv.run_bash_script(
            _json_request("/run_bash_script", {"script": "true", "working_dir": "/no/such/dir"})
        )
        py = await srv.run_python(_json_request("/run_python", {"code": "print(6 * 7)"}))
        return sh, nodir, py

    sh, nodir, py = asyncio.run(go())
    assert _body(sh) == {
        "status": "error",
        "output": f"{tmp_path}\nerr\n",
        "error": "",
        "returncode": 2,
    }
    assert nodir.status == 400 and "does not exist" in _body(nodir)["output"]
    assert _body(py)["output"] == "42\n" and _body(py)["return_code"] == 0


def test_launch_starts_without_waiting(tmp_path):
    srv = _server(tmp_path)
    marker = tmp_path / "launched"

    async def go():
        resp = await srv.launch(
            _json_request("/setup/launch", {"command": ["sh", "-c", f"sleep 0.2; touch {marker}"]})
        )
        started_before_done = not marker.exists()
        for _ in range(100):
            if marker.exists():
                break
            await asyncio.sleep(0.05)
        await srv.on_cleanup()
        return resp, started_before_done

    resp, started_before_done = asyncio.run(go())
    assert resp.text.endswith("launched successfully") and started_before_done
    assert marker.exists()


def test_list_directory_matches_the_file_system(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "f.txt").write_text("x")
    (tmp_path / "a" / "b" / "g").write_text("y")
    os.symlink("/etc", tmp_path / "a" / "link")  # a symlinked directory: listed, not followed
    srv = _server(tmp_path)

    async def go():
        ok = await srv.list_directory(
            _json_request("/list_directory", {"path": str(tmp_path / "a")})
        )
        with pytest.raises(web.HTTPForbidden):
            await srv.list_directory(_json_request("/list_directory", {"path": "/etc"}))
        with pytest.raises(web.HTTPNotFound):
            await srv.list_directory(
                _json_request("/list_directory", {"path": str(tmp_path / "nope")})
            )
        return _body(ok)["directory_tree"]

    tree = asyncio.run(go())

    def walk(p: Path):  # independent: pathlib instead of os.scandir
        kids = []
        for c in sorted(p.iterdir(), key=lambda c: c.name):
            if c.is_dir() and not c.is_symlink():
                kids.append(walk(c))
            else:
                kids.append({"type": "file", "name": c.name})
        return {"type": "directory", "name": p.name, "children": kids}

    assert tree == walk(tmp_path / "a")


def test_directory_tree_stops_at_its_entry_budget(tmp_path):
    for i in range(10):
        (tmp_path / f"f{i}").write_text("")
    tree = directory_tree(tmp_path, max_entries=4)
    assert [c["name"] for c in tree["children"]] == ["f0", "f1", "f2", "f3"]


def test_upload_then_file_through_the_handlers(tmp_path):
    from aiohttp import FormData

    srv = _server(tmp_path)
    data = bytes(range(256)) * 50

    async def form_request(path: str, form: FormData):
        payload = form()
        buf = io.BytesIO()

        class W:
            async def write(self, b):
                buf.write(b)

        await payload.write(W())
        return _request("POST", path, buf.getvalue(), payload.content_type)

    async def go():
        up = FormData()
        up.add_field("file_path", str(tmp_path / "d" / "x.bin"))
        up.add_field("file_data", data, filename="x.bin")
        r = await srv.upload(await form_request("/setup/upload", up))
        down = FormData({"file_path": str(tmp_path / "d" / "x.bin")})
        f = await srv.get_file(await form_request("/file", down))
        bad = FormData()
        bad.add_field("file_path", "/etc/evil")
        bad.add_field("file_data", b"x", filename="evil")
        with pytest.raises(web.HTTPForbidden):
            await srv.upload(await form_request("/setup/upload", bad))
        return r.text, f

    text, f = asyncio.run(go())
    assert text == "File uploaded"
    assert (tmp_path / "d" / "x.bin").read_bytes() == data
    assert isinstance(f, web.FileResponse) and Path(f._path) == tmp_path / "d" / "x.bin"
    assert not os.path.exists("/etc/evil")


def test_path_guard_resolves_dotdot_and_symlinks(tmp_path):
    os.symlink("/etc", tmp_path / "out")
    g = PathGuard([tmp_path])
    assert g.check(str(tmp_path / "x" / ".." / "y")) == tmp_path / "y"
    for bad in (str(tmp_path / ".." / "z"), str(tmp_path / "out" / "passwd"), "", "a\x00b"):
        with pytest.raises(web.HTTPForbidden):
            g.check(bad)


def test_window_op_needs_a_name(tmp_path):
    srv = _server(tmp_path)

    async def go():
        return await srv.activate_window(_json_request("/setup/activate_window", {}))

    resp = asyncio.run(go())
    assert resp.status == 400 and _body(resp)["message"] == "window_name is required"


def test_exec_helpers(tmp_path):
    assert server_exec.expand_home("ls '~/a b'", False) == ["ls", os.path.expanduser("~/a b")]
    assert server_exec.expand_home("ls ~/x", True) == "ls ~/x"  # the shell expands it
    with pytest.raises(ValueError):
        server_exec.expand_home("echo 'unbalanced", False)
    assert server_exec.clamp_limit(None, 30, 10) == 10
    assert server_exec.clamp_limit("2.5", 30, 10) == 2.5
    assert server_exec.clamp_limit("soon", 3, 10) == 3
    assert server_exec.clamp_limit(0, 3, 10) == 0.1
    assert server_exec.is_pyautogui_command(["python", "-c", "import pyautogui; x"], False)
    assert not server_exec.is_pyautogui_command(["python", "-c", "import os"], False)
    assert not server_exec.is_pyautogui_command(["python", "-c", "import pyautogui"], True)
