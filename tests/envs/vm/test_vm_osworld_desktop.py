"""Every OSWorld setup step type against our VM server on a real Xvfb desktop, the desktop's
OSWorld assumptions (home folders, sudo with the password), and OSWorld task e0df059f end to
end on a LocalDesktop.

Downloads come from a loopback HTTP server; Chrome's DevTools endpoints from a loopback stand-in
that records the calls (the step's script runs inside the desktop, as in a VM).
"""

from __future__ import annotations

import http.server
import io
import json
import os
import threading
from pathlib import Path

import pytest
from PIL import Image

from cua_jax.actions import Done, RunShell
from cua_jax.env_api import EnvError, Task
from envs.vm import osworld
from envs.vm.env import VMEnv, task_from_osworld
from envs.vm.osworld_setup import ContentCache, SetupOptions
from envs.vm.providers import LocalDesktop


class Web(http.server.BaseHTTPRequestHandler):
    """Files under /files/, and Chrome's DevTools HTTP API under /json/ (tabs in ``tabs``)."""

    files: dict[str, bytes] = {}
    tabs: list[dict] = []
    log: list[str] = []

    def _reply(self, body: bytes, code: int = 200) -> None:
        self.send_response(code)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802 -- http.server's names
        self.log.append(f"{self.command} {self.path}")
        if self.path == "/json/list":
            return self._reply(json.dumps(self.tabs).encode())
        if self.path.startswith("/json/close/"):
            tid = self.path.rsplit("/", 1)[1]
            Web.tabs = [t for t in self.tabs if t["id"] != tid]
            return self._reply(b"Target is closing")
        body = self.files.get(self.path.split("?")[0])
        return self._reply(body or b"", 200 if body is not None else 404)

    def do_PUT(self):  # noqa: N802
        self.log.append(f"{self.command} {self.path}")
        url = self.path.split("?", 1)[1]
        tab = {"id": f"T{len(self.log)}", "type": "page", "url": url}
        self.tabs.append(tab)
        return self._reply(json.dumps(tab).encode())

    def log_message(self, *a):
        pass


@pytest.fixture(scope="module")
def web():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Web)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def desk(xserver, aio):
    d = LocalDesktop(640, 480)
    aio(d.start())
    yield d
    aio(d.stop())


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 30, 30)).save(buf, "PNG")
    return buf.getvalue()


def test_every_setup_step_type_on_a_desktop(desk, web, aio, tmp_path):
    Web.files = {"/files/pic.png": _png(), "/files/notes.txt": b"hello\n"}
    Web.tabs, Web.log = [{"id": "D0", "type": "page", "url": "chrome://newtab/"}], []
    (tmp_path / "local.txt").write_text("from the host\n")
    base = f"http://127.0.0.1:{web}"
    steps = [
        {
            "type": "download",
            "parameters": {
                "files": [
                    {"url": f"{base}/files/pic.png", "path": "~/Desktop/pic.png"},
                    {"url": f"{base}/files/notes.txt?download=true", "path": "~/notes.txt"},
                ]
            },
        },
        {
            "type": "upload_file",
            "parameters": {"files": [{"local_path": "local.txt", "path": "~/l.txt"}]},
        },
        {
            "type": "execute",
            "parameters": {
                "command": "echo {SCREEN_WIDTH}x{SCREEN_HEIGHT_HALF} > ~/size",
                "shell": True,
            },
        },
        {"type": "command", "parameters": {"command": ["mkdir", "-p", "~/made"]}},
        {
            "type": "launch",
            "parameters": {"command": ["xterm", "-class", "StepTerm", "-T", "stepterm"]},
        },
        {"type": "sleep", "parameters": {"seconds": 0.1}},
        {"type": "activate_window", "parameters": {"window_name": "StepTerm", "by_class": True}},
        {"type": "open", "parameters": {"path": "~/Desktop/pic.png"}},
        {"type": "close_window", "parameters": {"window_name": "stepterm", "strict": True}},
        {
            "type": "chrome_open_tabs",
            "parameters": {"urls_to_open": ["https://a.example/x", "https://b.example/"]},
        },
        {"type": "chrome_close_tabs", "parameters": {"urls_to_close": ["https://a.example/x/"]}},
    ]
    opts = SetupOptions(cache=ContentCache(tmp_path / "cache"), chrome_port=web)
    aio(
        osworld.run_setup(
            desk.client,
            steps,
            screen_size=(640, 480),
            base_dir=str(tmp_path),
            task_id="all",
            options=opts,
        )
    )
    home = Path(desk.home)
    assert (home / "Desktop" / "pic.png").read_bytes() == Web.files["/files/pic.png"]
    assert (home / "notes.txt").read_text() == "hello\n"
    assert (home / "l.txt").read_text() == "from the host\n"
    assert (home / "size").read_text() == "640x240\n" and (home / "made").is_dir()
    windows = aio(desk.client.execute(["wmctrl", "-l"]))["output"]
    assert "pic.png" in windows and "stepterm" not in windows  # opened; closed
    # Chrome: the first new tab replaced the default one; a.example closed again
    assert [t["url"] for t in Web.tabs] == ["https://b.example/"]
    assert "GET /json/close/D0" in Web.log


def test_a_failing_step_on_a_desktop_is_an_infrastructure_fault(desk, aio, tmp_path):
    spec = {
        "id": "broken",
        "instruction": "x",
        "config": [{"type": "open", "parameters": {"path": "~/Desktop/no-such-file.docx"}}],
        "evaluator": {"func": "infeasible"},
    }
    env = VMEnv(desk.client, cache=ContentCache(tmp_path))
    task = Task(id="osworld/os/broken", instruction="x", source="osworld", spec=spec)
    with pytest.raises(EnvError, match="no-such-file.docx"):
        aio(env.reset(task))
    with pytest.raises(EnvError, match="faulted"):
        aio(env.evaluate())


E0DF059F = {  # OSWorld's evaluation_examples/examples/os/e0df059f-28a6-4169-924f-b9623e7184cc.json
    "id": "e0df059f-28a6-4169-924f-b9623e7184cc",
    "snapshot": "os",
    "instruction": 'I have a directory named "todo_list_Jan_1". Can you help me change its name '
    'into "todo_list_Jan_2"?',
    "source": "https://help.ubuntu.com/lts/ubuntu-help/files-rename.html.en",
    "trajectory": "trajectories/",
    "config": [
        {
            "type": "execute",
            "parameters": {
                "command": "echo {CLIENT_PASSWORD} | sudo -S mkdir ~/Desktop/todo_list_Jan_1",
                "shell": True,
            },
        },
        {
            "type": "execute",
            "parameters": {
                "command": [
                    "python",
                    "-c",
                    "import pyautogui; import time; "
                    "pyautogui.click({SCREEN_WIDTH_HALF}, {SCREEN_HEIGHT_HALF}); time.sleep(0.5);",
                ]
            },
        },
    ],
    "related_apps": ["os"],
    "evaluator": {
        "func": "exact_match",
        "result": {
            "type": "vm_command_line",
            "command": "[ -d ~/Desktop/todo_list_Jan_2 ] && echo 'Directory exists.' "
            "|| echo 'Directory does not exist.'",
            "shell": True,
        },
        "expected": {"type": "rule", "rules": {"expected": "Directory exists.\n"}},
    },
    "proxy": False,
    "fixed_ip": False,
    "possibility_of_env_change": "low",
}


def test_osworld_e0df059f_end_to_end_on_a_local_desktop(xserver, aio, tmp_path):
    task = task_from_osworld(osworld.parse_task(E0DF059F, domain="os"), api_actions=["run_shell"])

    async def episode(actions):
        async with LocalDesktop(640, 480) as d:
            env = VMEnv(d, cache=ContentCache(tmp_path))
            await env.reset(task)
            made = (Path(d.home) / "Desktop" / "todo_list_Jan_1").is_dir()
            for a in actions:
                await env.step(a)
            return made, await env.evaluate()

    assert aio(episode([Done()])) == (True, 0.0)
    rename = RunShell("mv ~/Desktop/todo_list_Jan_1 ~/Desktop/todo_list_Jan_2")
    assert aio(episode([rename, Done()])) == (True, 1.0)


def test_local_desktop_meets_osworld_assumptions(desk, aio):
    home = Path(desk.home)
    assert all((home / d).is_dir() for d in ("Desktop", "Documents", "Downloads"))
    ex = desk.client.execute
    ok = aio(ex("echo password | sudo -S sh -c 'id -u > ~/Documents/who'", shell=True))
    assert ok["returncode"] == 0, ok
    assert (home / "Documents" / "who").read_text().strip() == str(os.getuid())
    wrong = aio(ex("echo nope | sudo -S true", shell=True))
    assert wrong["returncode"] == 1 and "incorrect password" in wrong["error"]
    no_tty = aio(ex("sudo true < /dev/null", shell=True))
    assert no_tty["returncode"] == 1 and "use the -S option" in no_tty["error"]
