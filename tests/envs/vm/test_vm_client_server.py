"""VMClient against envs.vm.server on a real Xvfb desktop, endpoint by endpoint.

Every check compares against an independent source: X tools run inside the desktop (xdpyinfo,
xdotool, wmctrl, sha256sum), the bytes we sent, or the kernel's socket table.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import time

import numpy as np
import pytest
from PIL import Image

from envs.vm import server as vm_server
from envs.vm.client import VMClient, VMFileNotFoundError, VMGoneError, VMRequestError
from envs.vm.providers import LocalDesktop

W, H = 640, 480
TOKEN = "test-token-123"


@pytest.fixture(scope="module")
def desk(xserver, aio):
    d = LocalDesktop(W, H, token=TOKEN, exec_limit_s=3.0)
    aio(d.start())
    yield d
    aio(d.stop())


def _sh(aio, desk, cmd: str) -> str:
    r = aio(desk.client.execute(["bash", "-c", cmd]))
    assert r["status"] == "success", r
    return r["output"]


async def _wait_window(client: VMClient, title: str, present: bool = True, tries: int = 100):
    import asyncio

    for _ in range(tries):
        r = await client.execute(["wmctrl", "-l"])
        if (title in r["output"]) == present:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"window {title!r} present={present} never happened")


def test_screen_size_equals_xvfb_geometry(desk, aio):
    assert aio(desk.client.screen_size()) == (W, H)
    # Independent: the X server's own report, queried from inside the desktop.
    assert f"dimensions:    {W}x{H} pixels" in _sh(aio, desk, "xdpyinfo")
    png = aio(desk.client.screenshot())
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    img = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    assert img.shape == (H, W, 3)


def test_pyautogui_move_then_cursor_position(desk, aio):
    r = aio(desk.client.pyautogui("pyautogui.moveTo(123, 77)"))
    assert r["status"] == "success" and r["returncode"] == 0, r
    assert aio(desk.client.cursor_position()) == (123, 77)
    assert _sh(aio, desk, "xdotool getmouselocation --shell").startswith("X=123\nY=77\n")


def test_screenshot_has_cursor_drawn_in(desk, aio):
    aio(desk.client.pyautogui("pyautogui.moveTo(600, 440)"))  # bottom-right: empty black root
    img = np.asarray(Image.open(io.BytesIO(aio(desk.client.screenshot()))).convert("RGB"))
    near = img[430:455, 590:615].astype(int).sum()
    aio(desk.client.pyautogui("pyautogui.moveTo(20, 440)"))
    img2 = np.asarray(Image.open(io.BytesIO(aio(desk.client.screenshot()))).convert("RGB"))
    assert near > 0, "no cursor pixels where the pointer is"
    assert img2[430:455, 590:615].astype(int).sum() == 0, "the cursor did not move away"


def test_type_into_app_and_read_back(desk, aio):
    text = 'Hello, VM 42! <typed> & {braces} | ~ "q"'
    aio(
        desk.client.launch(
            [
                "xterm",
                "-geometry",
                "60x10+0+0",
                "-T",
                "typer",
                "-e",
                "sh",
                "-c",
                "cat > ~/typed.txt",
            ]
        )
    )
    aio(_wait_window(desk.client, "typer"))
    aio(desk.client.activate_window("typer", strict=True))
    aio(desk.client.pyautogui(f"pyautogui.click(100, 80); pyautogui.typewrite({text + chr(10)!r})"))
    aio(desk.client.pyautogui("pyautogui.hotkey('ctrl', 'd')"))  # EOF: cat exits, xterm closes
    aio(_wait_window(desk.client, "typer", present=False))
    assert aio(desk.client.download("~/typed.txt")) == (text + "\n").encode()


def test_launch_then_find_window(desk, aio):
    aio(desk.client.launch("xterm -geometry 40x5+300+300 -T findme", shell=True))
    aio(_wait_window(desk.client, "findme"))
    assert (
        aio(desk.client.activate_window("findme", strict=True)) == "Window activated successfully"
    )
    active = _sh(aio, desk, "xdotool getactivewindow getwindowname")
    assert active.strip() == "findme"
    w, h = aio(desk.client.window_size("XTerm"))
    assert w > 100 and h > 30
    tree = aio(desk.client.accessibility())
    assert 'name="findme"' in tree  # AT-SPI is absent here: the X window fallback tree
    aio(desk.client.close_window("findme", strict=True))
    aio(_wait_window(desk.client, "findme", present=False))
    with pytest.raises(VMRequestError) as e:
        aio(desk.client.activate_window("no-such-window-xyz"))
    assert e.value.status == 404


def test_a_window_named_with_a_hyphen_is_found_under_its_em_dash_title(desk, aio):
    """OSWorld's tasks (LibreOffice 7) name "f.xlsx - LibreOffice Calc"; LibreOffice >= 24.2
    titles it "f.xlsx — LibreOffice Calc". A strict activate_window finds it either way."""
    aio(desk.client.launch("xterm -geometry 40x5+300+300 -T emdash-probe", shell=True))
    aio(_wait_window(desk.client, "emdash-probe"))
    # xterm's -T title is not UTF-8; xdotool sets the UTF-8 title (_NET_WM_NAME) as LibreOffice's
    _sh(aio, desk, "xdotool search --name emdash-probe set_window --name 'f.xlsx — Calc'")
    aio(_wait_window(desk.client, "f.xlsx"))
    assert aio(desk.client.activate_window("f.xlsx - Calc", strict=True)).endswith("successfully")
    active = _sh(aio, desk, "xdotool getactivewindow getwindowname")
    assert active.strip() == "f.xlsx — Calc"
    aio(desk.client.close_window("f.xlsx - Calc", strict=True))
    aio(_wait_window(desk.client, "f.xlsx", present=False))


def test_upload_then_file_round_trip(desk, aio):
    data = np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    assert aio(desk.client.upload("~/up/dir/blob.bin", data)) == "File uploaded"
    assert aio(desk.client.download("~/up/dir/blob.bin")) == data
    in_vm = _sh(aio, desk, "sha256sum ~/up/dir/blob.bin").split()[0]
    assert in_vm == hashlib.sha256(data).hexdigest()
    tree = aio(desk.client.list_directory("~/up"))
    assert tree == {
        "type": "directory",
        "name": "up",
        "children": [
            {"type": "directory", "name": "dir", "children": [{"type": "file", "name": "blob.bin"}]}
        ],
    }
    with pytest.raises(VMFileNotFoundError):
        aio(desk.client.download("~/up/missing.bin"))


def test_misc_endpoints(desk, aio):
    # the desktop's processes see its home at /home/user where a mount namespace is allowed
    home = desk.home_alias if desk.home_alias_active else str(desk.home)
    assert aio(desk.client.platform()) == "Linux"
    assert aio(desk.client.desktop_path()) == f"{home}/Desktop"
    r = aio(desk.client.run_python("import os\nprint(6 * 7, os.environ['HOME'])"))
    assert r["status"] == "success" and r["output"] == f"42 {home}\n", r
    r = aio(desk.client.run_bash_script("cd ~ && pwd && echo err >&2 && exit 3"))
    assert r["status"] == "error" and r["returncode"] == 3
    assert r["output"] == f"{home}\nerr\n"
    r = aio(desk.client.execute("echo a b | wc -w", shell=True))
    assert r == {"status": "success", "output": "2\n", "error": "", "returncode": 0}
    _sh(aio, desk, "mkdir -p ~/misc/sub")
    r = aio(desk.client.execute(["ls", "~/misc"]))  # ~/ expanded in list commands, like OSWorld
    assert r["output"] == "sub\n"


def test_command_past_its_limit_is_killed(desk, aio):
    t0 = time.monotonic()
    # The desktop's server caps commands at 3 s; this one asks for 100 s and gets 3.
    r = aio(desk.client.execute(["bash", "-c", "sleep 31.25; echo never"], timeout=100))
    took = time.monotonic() - t0
    assert r["status"] == "error" and r["timed_out"] is True
    assert "timed out after 3 seconds" in r["message"]
    assert 2.5 < took < 20
    assert "sleep 31.25" not in _sh(aio, desk, "ps -eo args")  # the process group was killed
    r = aio(desk.client.run_bash_script("sleep 31.5", timeout=0.5))
    assert r["status"] == "error" and r["timed_out"] is True and r["returncode"] == -1


def test_wrong_or_missing_token_gets_401(desk, aio):
    for token in ("wrong", None):
        c = VMClient(desk.url, token=token, retries=0)
        with pytest.raises(VMRequestError) as e:
            aio(c.screen_size())
        assert e.value.status == 401 and "token" in str(e.value)
        aio(c.close())
    assert aio(desk.client.screen_size()) == (W, H)


@pytest.mark.parametrize(
    "path",
    [
        "/etc/passwd",
        "~/../../../../etc/passwd",
        "/tmp/../etc/passwd",
        "~/link-out/passwd",
    ],
)
def test_file_endpoints_confined_to_allowed_roots(desk, aio, path):
    _sh(aio, desk, "ln -sfn /etc ~/link-out")  # a symlink inside home that points outside
    with pytest.raises(VMRequestError) as e:
        aio(desk.client.download(path))
    assert e.value.status == 403
    with pytest.raises(VMRequestError) as e:
        aio(desk.client.upload(path.replace("passwd", "evil"), b"x"))
    assert e.value.status == 403
    with pytest.raises(VMRequestError) as e:
        aio(desk.client.list_directory(os.path.dirname(path)))
    assert e.value.status == 403
    assert not os.path.exists("/etc/evil")


def test_default_bind_is_loopback_and_exposure_needs_token(desk, capsys):
    assert vm_server.parse_args([]).host == "127.0.0.1"
    with pytest.raises(SystemExit):
        vm_server.parse_args(["--host", "0.0.0.0", "--token", ""])
    assert "needs --token" in capsys.readouterr().err
    long = "a-token-of-16+chars"  # shorter ones are refused beyond loopback
    assert vm_server.parse_args(["--host", "0.0.0.0", "--token", long]).host == "0.0.0.0"
    # Independent: the kernel's table of listening sockets for the running server's port.
    port = int(desk.url.rsplit(":", 1)[1])
    with open("/proc/net/tcp") as f:
        rows = [ln.split() for ln in f.readlines()[1:]]
    listening = [r[1] for r in rows if r[3] == "0A" and int(r[1].split(":")[1], 16) == port]
    assert listening == [f"0100007F:{port:04X}"]


def test_unreachable_vm_raises_vm_gone_naming_the_url(aio):
    c = VMClient("http://127.0.0.1:9", retries=2, backoff=0.01)
    t0 = time.monotonic()
    with pytest.raises(VMGoneError) as e:
        aio(c.screenshot())
    assert "http://127.0.0.1:9/screenshot" in str(e.value) and e.value.attempts == 3
    assert time.monotonic() - t0 < 10
    aio(c.close())


def test_transient_5xx_is_retried_then_succeeds(aio):
    from aiohttp import web

    calls = {"n": 0}

    async def flaky(request):
        calls["n"] += 1
        if calls["n"] <= 2:
            return web.Response(status=503, text="busy")
        return web.json_response({"width": 7, "height": 9})

    async def go():
        app = web.Application()
        app.router.add_post("/screen_size", flaky)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        c = VMClient(f"http://127.0.0.1:{port}", retries=3, backoff=0.01)
        try:
            return await c.screen_size()
        finally:
            await c.close()
            await runner.cleanup()

    assert aio(go()) == (7, 9)
    assert calls["n"] == 3


def _cold(code: str) -> list[str]:
    # Not starting with "import pyautogui": the server runs it as a new `python -c` process.
    return ["python", "-c", "import time; import pyautogui; pyautogui.FAILSAFE = False; " + code]


@pytest.mark.parametrize(
    "code",
    [
        "pyautogui.moveTo(31, 41); print(pyautogui.position(), pyautogui.PAUSE)",
        "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)",
        "pyautogui.click(5, 5, button='sideways')",  # raises inside pyautogui
        "print(undefined_name)",
        "raise SystemExit('bye')",
    ],
)
def test_warm_pyautogui_worker_matches_a_fresh_process(desk, aio, code):
    warm = aio(desk.client.pyautogui(code))
    cold = aio(desk.client.execute(_cold(code)))
    assert warm["returncode"] == cold["returncode"]
    assert warm["output"] == cold["output"]
    last = lambda r: r["error"].strip().splitlines()[-1] if r["error"].strip() else ""  # noqa: E731
    assert last(warm) == last(cold)


def test_warm_worker_state_does_not_leak_between_actions(desk, aio):
    aio(desk.client.pyautogui("pyautogui.PAUSE = 0; leaked = 1"))
    r = aio(desk.client.pyautogui("print(pyautogui.PAUSE, pyautogui.FAILSAFE, 'leaked' in dir())"))
    assert r["output"] == "0.1 False False\n"  # fresh defaults; FAILSAFE set by the prefix


def test_warm_worker_recovers_from_timeout_and_exit(desk, aio):
    t0 = time.monotonic()
    r = aio(desk.client.pyautogui("time.sleep(30)", timeout=1))
    assert r["timed_out"] is True and time.monotonic() - t0 < 15
    r = aio(desk.client.pyautogui("import os; os._exit(0)"))
    assert r["returncode"] == 1 and "exited" in r["error"]
    r = aio(desk.client.pyautogui("pyautogui.moveTo(50, 60)"))
    assert r["returncode"] == 0 and aio(desk.client.cursor_position()) == (50, 60)


def test_warm_worker_replies_stay_in_step_when_child_processes_write_to_stdout(desk, aio):
    # A child process inherits the worker's fd 1; writing there must not become the next reply.
    r1 = aio(desk.client.pyautogui("import os; os.system('echo hi-from-child')"))
    r2 = aio(desk.client.pyautogui("print('second')"))
    r3 = aio(desk.client.pyautogui("print('third')"))
    assert r1["returncode"] == 0 and r1["output"] == "hi-from-child\n", r1
    assert r2["output"] == "second\n" and r3["output"] == "third\n", (r2, r3)
    # Same as a fresh `python -c` process (whose child output goes to the same pipe).
    assert aio(desk.client.execute(_cold("import os; os.system('echo hi-from-child')")))[
        "output"
    ] == ("hi-from-child\n")
    # A child reading stdin gets end-of-file, not the worker's next request.
    r = aio(
        desk.client.pyautogui(
            "import subprocess; print(repr(subprocess.run(['cat'], capture_output=True).stdout))"
        )
    )
    assert r["output"] == "b''\n", r
    assert aio(desk.client.pyautogui("print('fourth')"))["output"] == "fourth\n"


def test_warm_worker_with_a_mismatched_reply_id_is_restarted(aio):
    # A worker that answers with someone else's reply id: detected, never returned as ours.
    worker = vm_server.PyAutoGUIWorker(
        source="import json, sys\n"
        "for line in sys.stdin:\n"
        "    print(json.dumps({'id': -1, 'output': 'stale', 'error': '', 'returncode': 0}),"
        " flush=True)\n"
    )

    async def go():
        rc, out, err = await worker.run("print('mine')", 10)
        proc_after = worker._proc
        worker.kill()
        return rc, out, err, proc_after

    rc, out, err, proc_after = aio(go())
    assert rc == 1 and out == "" and "out of step" in err
    assert proc_after is None  # killed: the next call starts a fresh worker


def test_screen_size_follows_a_resolution_change(desk, aio):
    try:
        aio(desk.client.execute(["xrandr", "--fb", "320x240"]))  # complains, but resizes Xvfb
        assert "dimensions:    320x240 pixels" in _sh(aio, desk, "xdpyinfo")
        assert aio(desk.client.screen_size()) == (320, 240)
        assert Image.open(io.BytesIO(aio(desk.client.screenshot()))).size == (320, 240)
    finally:
        aio(desk.client.execute(["xrandr", "--fb", f"{W}x{H}"]))
    assert aio(desk.client.screen_size()) == (W, H)


def test_string_command_without_shell_expands_home_after_splitting(desk, aio):
    _sh(aio, desk, "mkdir -p ~/tilde_dir/inner")
    # OSWorld shlex-splits a string command run without a shell, then expands each "~/" arg.
    r = aio(desk.client.execute("ls '~/tilde_dir'"))
    assert r["returncode"] == 0 and r["output"] == "inner\n", r
    aio(desk.client.launch("touch ~/tilde_dir/launched"))
    for _ in range(100):
        if (desk.home / "tilde_dir" / "launched").exists():
            break
        time.sleep(0.05)
    assert (desk.home / "tilde_dir" / "launched").exists()


def test_type_non_ascii_text_through_the_env_code(desk, aio):
    from cua_jax.actions import TypeText
    from envs.vm.env import action_to_pyautogui

    text = "café naïve → ok 'q' \"dq\" \\ end"
    aio(
        desk.client.launch(
            ["xterm", "-geometry", "60x10+0+0", "-T", "utyper", "-e", "sh", "-c", "cat > ~/u.txt"]
        )
    )
    aio(_wait_window(desk.client, "utyper"))
    aio(desk.client.activate_window("utyper", strict=True))
    aio(desk.client.pyautogui("pyautogui.click(100, 80)"))
    r = aio(desk.client.pyautogui(action_to_pyautogui(TypeText(text + "\n"))))
    assert r["returncode"] == 0, r
    aio(desk.client.pyautogui("pyautogui.hotkey('ctrl', 'd')"))
    aio(_wait_window(desk.client, "utyper", present=False))
    assert aio(desk.client.download("~/u.txt")).decode() == text + "\n"


def test_cross_origin_post_to_the_running_server_is_refused_and_runs_nothing(desk, aio):
    import aiohttp

    marker = desk.home / "pwned"

    async def go():
        # A web page's no-cors fetch: text/plain body, its own Origin (and no token).
        headers = {"Origin": "http://evil.example", "Content-Type": "text/plain;charset=UTF-8"}
        body = json.dumps({"command": ["touch", str(marker)]})
        async with aiohttp.ClientSession() as s:
            async with s.post(desk.url + "/execute", data=body, headers=headers) as r:
                return r.status, await r.text()

    status, text = aio(go())
    assert status == 403 and "cross-origin" in text
    assert not marker.exists()
    assert _sh(aio, desk, "echo ok") == "ok\n"  # the token-carrying client still works


def test_server_without_a_given_token_prints_the_one_it_made_up(desk, aio):
    import subprocess
    import sys

    env = {**desk._child_env(), "PYTHONUNBUFFERED": "1"}
    env.pop("CUA_VM_TOKEN", None)
    cmd = [sys.executable, "-m", "envs.vm.server", "--port", "0", "--display", desk.display]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip().removeprefix("serving on ")
        line = proc.stderr.readline()
        assert url.startswith("http://127.0.0.1:") and f"{url} with token " in line, line
        token = line.split(" with token ", 1)[1].split()[0]
        anon, client = VMClient(url, retries=0), VMClient(url, token=token, retries=0)
        with pytest.raises(VMRequestError) as e:
            aio(anon.screen_size())
        assert e.value.status == 401
        assert aio(client.screen_size()) == (W, H)
        # The token is not handed on to the commands the server runs.
        r = aio(client.execute(["sh", "-c", "echo ${CUA_VM_TOKEN:-unset}"]))
        assert r["output"] == "unset\n"
        aio(anon.close())
        aio(client.close())
    finally:
        proc.terminate()
        proc.wait(10)
