"""An OSWorld-compatible VM server for any Linux X display.

OSWorld drives its VMs through a small HTTP server (``desktop_env/server/main.py`` in
xlang-ai/OSWorld, see ``OSWORLD_API.md``). This module speaks the same protocol (same paths,
request and response shapes) on the X display in ``$DISPLAY``, so that

* our own containers / VMs / Xvfb desktops become environments (``envs.vm.providers``), and
* OSWorld's own client could drive it, and our client (``envs.vm.client``) drives real OSWorld VMs.

Run it inside the desktop session::

    python -m envs.vm.server --host 127.0.0.1 --port 5000 [--token T] [--allow-root DIR ...]

Differences from OSWorld's server, all on the safe side:

* It binds 127.0.0.1 by default and refuses a non-loopback ``--host`` without ``--token``; with a
  token every request needs ``Authorization: Bearer T`` (else 401). OSWorld's server has no
  authentication and runs any command it is sent, so exposing one must be a deliberate act.
* Command run time is capped (``--exec-limit``, 120 s like OSWorld); a command past its limit is
  killed with its whole process group and answered with HTTP 500 ``{"status": "error",
  "message": "... timed out after N seconds", "timed_out": true}``.
* File endpoints (``/file``, ``/setup/upload``, ``/list_directory``, ``/setup/open_file``) only
  touch paths inside the allowed roots (default: ``$HOME`` and ``/tmp``) after resolving ``..``
  and symlinks; anything else is 403.
* ``/accessibility`` uses AT-SPI (pyatspi) when importable; otherwise it returns a tree of the
  top-level X windows (name, class, geometry) with a ``note`` attribute saying so.

It is an aiohttp.web app (aiohttp is already a project dependency); X work (screenshots, pointer
queries) runs in worker threads so one slow capture never stalls other requests.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import io
import ipaddress
import json
import os
import platform
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from xml.sax.saxutils import quoteattr

import numpy as np
from aiohttp import web

DEFAULT_EXEC_LIMIT_S = 120.0  # OSWorld's /execute limit
RUN_PYTHON_LIMIT_S = 30.0  # OSWorld's /run_python limit
MAX_LIST_ENTRIES = 5000  # /list_directory walks at most this many entries


# ----------------------------------------------------------------------------- X display access


class XScreen:
    """Screenshots (cursor composited in), pointer position and screen size of one X display.

    One python-xlib connection guarded by a lock: python-xlib connections are not thread-safe and
    the handlers call this from worker threads.
    """

    def __init__(self, display_name: str | None = None):
        from Xlib import display as xdisplay  # the server runs where python-xlib is installed

        self.display_name = display_name or os.environ.get("DISPLAY")
        if not self.display_name:
            raise RuntimeError(
                "envs.vm.server needs an X display: set DISPLAY (e.g. start `Xvfb :1` and run "
                "with DISPLAY=:1)"
            )
        self._lock = threading.Lock()
        self._dpy = xdisplay.Display(self.display_name)
        self._root = self._dpy.screen().root
        self._has_xfixes = self._dpy.has_extension("XFIXES")
        if self._has_xfixes:
            self._dpy.xfixes_query_version()

    def size(self) -> tuple[int, int]:
        # The root window's live geometry: screen().width_in_pixels is python-xlib's copy of the
        # connection setup data and stays stale after a resolution change (xrandr).
        with self._lock:
            g = self._root.get_geometry()
            return int(g.width), int(g.height)

    def cursor_position(self) -> tuple[int, int]:
        with self._lock:
            p = self._root.query_pointer()
            return int(p.root_x), int(p.root_y)

    def _cursor_sprite(self) -> tuple[np.ndarray, int, int] | None:
        """(u8[h, w, 4] RGBA sprite, top-left x, top-left y) of the current cursor, or None."""
        if not self._has_xfixes:
            return None
        with self._lock:
            r = self._dpy.xfixes_get_cursor_image(self._root)
        if r.width == 0 or r.height == 0:
            return None
        # XFixes gives premultiplied ARGB as one u32 per pixel.
        argb = np.asarray(r.cursor_image, dtype=np.uint32).reshape(r.height, r.width)
        rgba = np.stack(
            [(argb >> 16) & 255, (argb >> 8) & 255, argb & 255, (argb >> 24) & 255], axis=-1
        ).astype(np.uint8)
        return rgba, int(r.x) - int(r.xhot), int(r.y) - int(r.yhot)

    def screenshot(self):
        """A PIL RGB image of the whole screen with the cursor drawn in (like OSWorld's)."""
        from PIL import Image, ImageGrab

        img = ImageGrab.grab(xdisplay=self.display_name).convert("RGB")
        try:
            sprite = self._cursor_sprite()
        except Exception:  # a cursor-less screenshot beats no screenshot
            sprite = None
        if sprite is not None:
            rgba, x0, y0 = sprite
            cur = Image.fromarray(rgba, "RGBA")
            img.paste(cur, (x0, y0), cur)
        return img

    def screenshot_png(self) -> tuple[bytes, float, float]:
        """(PNG bytes, seconds to capture, seconds to encode)."""
        t0 = time.perf_counter()
        img = self.screenshot()
        t1 = time.perf_counter()
        buf = io.BytesIO()
        # compress_level=1: several times faster than the default on a full screen, and still
        # a plain PNG (OSWorld's clients only decode it).
        img.save(buf, format="PNG", compress_level=1)
        return buf.getvalue(), t1 - t0, time.perf_counter() - t1


# ----------------------------------------------------------------------------- helpers


class PathGuard:
    """Confines file endpoints to allowed root directories (symlinks and ``..`` resolved)."""

    def __init__(self, roots: Sequence[str | os.PathLike]):
        self.roots = [Path(r).expanduser().resolve() for r in roots]

    def check(self, raw: str) -> Path:
        """The resolved path, or raises ``web.HTTPForbidden`` when it leaves every root."""
        if not isinstance(raw, str) or not raw or "\x00" in raw:
            raise web.HTTPForbidden(text=f"bad path {raw!r}")
        p = Path(os.path.expanduser(raw))
        if not p.is_absolute():
            p = Path.home() / p
        resolved = p.resolve()  # follows symlinks, so a link out of a root is caught too
        for root in self.roots:
            if resolved == root or resolved.is_relative_to(root):
                return resolved
        allowed = ", ".join(str(r) for r in self.roots)
        raise web.HTTPForbidden(text=f"path {raw!r} is outside the allowed roots ({allowed})")


def _expand_home(command: Any, shell: bool) -> Any:
    """Like OSWorld: a string command run without a shell is shlex-split (ValueError when it
    cannot be), then a leading ``~/`` is expanded in each argument of the list."""
    if isinstance(command, str) and not shell:
        command = shlex.split(command)
    if isinstance(command, list):
        return [
            os.path.expanduser(a) if isinstance(a, str) and a.startswith("~/") else a
            for a in command
        ]
    return command


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def run_limited(
    command: str | list[str],
    *,
    shell: bool,
    limit_s: float,
    cwd: str | None = None,
    merge_stderr: bool = False,
) -> tuple[int | None, str, str]:
    """Runs a command to completion or until ``limit_s``; returns (returncode, stdout, stderr).

    returncode None means it ran past its limit: its whole process group was killed (commands
    like ``sh -c 'sleep 100 &'`` must not leave children behind).
    """
    stderr = asyncio.subprocess.STDOUT if merge_stderr else asyncio.subprocess.PIPE
    if shell:
        cmd = command if isinstance(command, str) else shlex.join(command)
        proc = await asyncio.create_subprocess_shell(
            cmd,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
            stdin=asyncio.subprocess.DEVNULL,
            cwd=cwd,
            start_new_session=True,
        )
    else:
        argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
            stdin=asyncio.subprocess.DEVNULL,
            cwd=cwd,
            start_new_session=True,
        )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=limit_s)
    except TimeoutError:
        _kill_group(proc)
        await proc.wait()
        return None, "", ""
    except asyncio.CancelledError:
        _kill_group(proc)
        raise
    dec = lambda b: (b or b"").decode("utf-8", errors="replace")
    return proc.returncode, dec(out), dec(err)


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        data = await request.json()
    except Exception as e:
        raise web.HTTPBadRequest(
            text=f"{request.path}: the body must be a JSON object ({e})"
        ) from e
    if not isinstance(data, dict):
        raise web.HTTPBadRequest(text=f"{request.path}: the body must be a JSON object")
    return data


def _error(message: str, status: int = 500, **extra: Any) -> web.Response:
    return web.json_response({"status": "error", "message": message, **extra}, status=status)


async def _wmctrl_windows() -> list[dict[str, Any]]:
    """Top-level windows from ``wmctrl -lGx``: id, desktop, x, y, w, h, class, name."""
    rc, out, _ = await run_limited(["wmctrl", "-lGx"], shell=False, limit_s=10)
    wins = []
    for line in out.splitlines() if rc == 0 else []:
        parts = line.split(None, 8)
        if len(parts) < 8:
            continue
        name = parts[8] if len(parts) > 8 else ""
        wins.append(
            {
                "id": parts[0],
                "desktop": parts[1],
                "x": int(parts[2]),
                "y": int(parts[3]),
                "w": int(parts[4]),
                "h": int(parts[5]),
                "class": parts[6],
                "name": name,
            }
        )
    return wins


# ----------------------------------------------------------------------------- warm pyautogui

# The worker: a Python process with pyautogui already imported that runs one snippet per request
# (newline-delimited JSON on stdin/stdout). Each snippet gets fresh globals and pyautogui's
# defaults (PAUSE=0.1, FAILSAFE=True) reset, so it behaves like the `python -c` process OSWorld's
# client asks for, minus the ~0.3-1 s of interpreter start-up and `import pyautogui`.
# Requests and replies travel on private copies of fds 0 and 1 (os.dup: not inherited), because
# processes a snippet starts (os.system, subprocess) inherit fds 0 and 1: there they get /dev/null
# for input and a temp file for output, whose text joins the snippet's output (as it would in a
# fresh process). Each reply carries its request's id, so a reply out of step is caught.
_WORKER_SRC = r"""
import contextlib, io, json, os, sys, tempfile, traceback
requests, replies = os.fdopen(os.dup(0), "r"), os.fdopen(os.dup(1), "w")
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
child_out = tempfile.TemporaryFile()
os.dup2(child_out.fileno(), 1)
sys.stdout = sys.stderr
import pyautogui
for line in requests:
    req = json.loads(line)
    child_out.seek(0)
    child_out.truncate()
    pyautogui.PAUSE, pyautogui.FAILSAFE = 0.1, True
    o, e, rc = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        try:
            exec(compile(req["code"], "<string>", "exec"), {"__name__": "__main__"})
        except SystemExit as x:
            rc = x.code if isinstance(x.code, int) else (0 if x.code is None else 1)
            if x.code is not None and not isinstance(x.code, int):
                print(x.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            rc = 1
    child_out.seek(0)
    out = child_out.read().decode("utf-8", "replace") + o.getvalue()
    replies.write(json.dumps({"id": req["id"], "output": out, "error": e.getvalue(),
                              "returncode": rc}) + "\n")
    replies.flush()
"""


def is_pyautogui_command(command: Any, shell: bool) -> bool:
    """True for OSWorld's action command ``["python", "-c", "import pyautogui; ..."]``."""
    return (
        not shell
        and isinstance(command, list)
        and len(command) == 3
        and command[0] in ("python", "python3")
        and command[1] == "-c"
        and isinstance(command[2], str)
        and command[2].lstrip().startswith("import pyautogui")
    )


class PyAutoGUIWorker:
    """A warm Python process that runs OSWorld's pyautogui snippets (one at a time)."""

    def __init__(self) -> None:
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self._next_id = 0

    async def _ensure(self) -> asyncio.subprocess.Process:
        if self._proc is None or self._proc.returncode is not None:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                _WORKER_SRC,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
                start_new_session=True,
                limit=64 * 1024 * 1024,
            )
        return self._proc

    async def run(self, code: str, limit_s: float) -> tuple[int | None, str, str]:
        """(returncode, stdout, stderr); returncode None = past the limit (worker killed)."""
        async with self._lock:
            proc = await self._ensure()
            assert proc.stdin is not None and proc.stdout is not None
            self._next_id += 1
            rid = self._next_id
            try:
                proc.stdin.write((json.dumps({"id": rid, "code": code}) + "\n").encode())
                await proc.stdin.drain()
                line = await asyncio.wait_for(proc.stdout.readline(), timeout=limit_s)
            except TimeoutError:
                self.kill()
                return None, "", ""
            except (ConnectionError, OSError) as e:
                self.kill()
                return 1, "", f"pyautogui worker died: {e}"
            if not line:  # the snippet killed the worker (os._exit, a crash)
                self.kill()
                return 1, "", "pyautogui worker exited while running the code"
            try:
                r = json.loads(line)
                ok = r["id"] == rid
            except (ValueError, KeyError, TypeError):
                ok = False
            if not ok:  # never hand back another call's reply: start a fresh worker
                self.kill()
                return 1, "", f"pyautogui worker reply out of step (restarted): {line[:200]!r}"
            return int(r["returncode"]), r["output"], r["error"]

    def kill(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            _kill_group(self._proc)
        self._proc = None


# ----------------------------------------------------------------------------- the app


def make_app(
    *,
    token: str | None = None,
    allowed_roots: Sequence[str | os.PathLike] | None = None,
    exec_limit_s: float = DEFAULT_EXEC_LIMIT_S,
    display: str | None = None,
    warm_pyautogui: bool = True,
) -> web.Application:
    """The aiohttp application serving the OSWorld protocol on ``display`` (default $DISPLAY).

    Args:
      token: when set, every request must carry ``Authorization: Bearer <token>`` (else 401).
      allowed_roots: directories the file endpoints may touch (default: $HOME and /tmp).
      exec_limit_s: the most seconds a command of /execute, /run_python or /run_bash_script may
        run; a request may ask for less (``timeout``), never more.
      display: the X display, e.g. ``":1"``.
      warm_pyautogui: run OSWorld's ``["python", "-c", "import pyautogui; ..."]`` action
        commands in a warm worker process instead of a new interpreter each time (same result,
        several times faster; see ``PyAutoGUIWorker``).
    """
    screen = XScreen(display)
    guard = PathGuard(allowed_roots or [Path.home(), tempfile.gettempdir()])
    launched: set[asyncio.subprocess.Process] = set()
    recording: dict[str, Any] = {}
    worker = PyAutoGUIWorker() if warm_pyautogui else None

    @web.middleware
    async def auth(request: web.Request, handler):
        if token is not None:
            got = request.headers.get("Authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
                return web.json_response(
                    {"status": "error", "message": "missing or wrong bearer token"}, status=401
                )
        t0 = time.perf_counter()
        resp = await handler(request)
        # Time spent inside the VM, so clients can split a round trip into HTTP vs work.
        resp.headers["X-Handler-Seconds"] = f"{time.perf_counter() - t0:.6f}"
        return resp

    app = web.Application(middlewares=[auth], client_max_size=1024**3)
    r = web.RouteTableDef()

    def limit(requested: Any, default: float) -> float:
        try:
            t = float(requested) if requested is not None else default
        except (TypeError, ValueError):
            t = default
        return max(0.1, min(t, exec_limit_s))

    # -- screen ------------------------------------------------------------------------------

    @r.get("/screenshot")
    async def screenshot(request: web.Request) -> web.Response:
        png, t_cap, t_enc = await asyncio.to_thread(screen.screenshot_png)
        headers = {"X-Capture-Seconds": f"{t_cap:.6f}", "X-Encode-Seconds": f"{t_enc:.6f}"}
        return web.Response(body=png, content_type="image/png", headers=headers)

    @r.post("/screen_size")
    async def screen_size(request: web.Request) -> web.Response:
        w, h = await asyncio.to_thread(screen.size)
        return web.json_response({"width": w, "height": h})

    @r.get("/cursor_position")
    async def cursor_position(request: web.Request) -> web.Response:
        x, y = await asyncio.to_thread(screen.cursor_position)
        return web.json_response([x, y])

    @r.get("/platform")
    async def get_platform(request: web.Request) -> web.Response:
        return web.Response(text=platform.system())

    # -- commands ----------------------------------------------------------------------------

    @r.post("/execute")
    @r.post("/setup/execute")
    async def execute(request: web.Request) -> web.Response:
        data = await _json_body(request)
        shell = bool(data.get("shell", False))
        try:
            command = _expand_home(data.get("command", "" if shell else []), shell)
        except ValueError as e:  # an unbalanced quote
            return _error(str(e))
        if not command:
            return _error('no command given: send {"command": [...] or "..."}', 400)
        lim = limit(data.get("timeout"), exec_limit_s)
        try:
            if worker is not None and is_pyautogui_command(command, shell):
                rc, out, err = await worker.run(command[2], lim)
            else:
                rc, out, err = await run_limited(command, shell=shell, limit_s=lim)
        except (OSError, ValueError) as e:  # e.g. the program does not exist
            return _error(str(e))
        if rc is None:
            return _error(f"Command {command!r} timed out after {lim:g} seconds", timed_out=True)
        return web.json_response(
            {"status": "success", "output": out, "error": err, "returncode": rc}
        )

    @r.post("/setup/launch")
    async def launch(request: web.Request) -> web.Response:
        data = await _json_body(request)
        shell = bool(data.get("shell", False))
        try:
            command = _expand_home(data.get("command", ""), shell)
        except ValueError as e:
            return _error(f"failed to launch {data.get('command')!r}: {e}")
        if not command:
            return _error("no command given", 400)
        try:
            if shell:
                cmd = command if isinstance(command, str) else shlex.join(command)
                proc = await asyncio.create_subprocess_shell(
                    cmd,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.DEVNULL,
                    start_new_session=True,
                )
            else:
                argv = list(command)  # _expand_home split a string command
                proc = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.DEVNULL,
                    start_new_session=True,
                )
        except (OSError, ValueError) as e:
            return _error(f"failed to launch {command!r}: {e}")
        launched.add(proc)
        # Reap it when it exits (no zombies), without awaiting it here.
        task = asyncio.ensure_future(proc.wait())
        task.add_done_callback(lambda _t, p=proc: launched.discard(p))
        shown = command if isinstance(command, str) else " ".join(map(str, command))
        return web.Response(text=f"{shown} launched successfully")

    @r.post("/run_python")
    async def run_python(request: web.Request) -> web.Response:
        data = await _json_body(request)
        code = data.get("code")
        if not code:
            return web.json_response(
                {
                    "status": "error",
                    "message": "Code not supplied!",
                    "output": "",
                    "error": "",
                    "return_code": -1,
                },
                status=400,
            )
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            f.write(code)
            path = f.name
        try:
            rc, out, err = await run_limited(
                [sys.executable, path], shell=False, limit_s=limit(None, RUN_PYTHON_LIMIT_S)
            )
        finally:
            os.unlink(path)
        if rc is None:
            return web.json_response(
                {
                    "status": "error",
                    "message": "Execution timeout: Code took too long to execute",
                    "error": "TimeoutExpired",
                    "output": None,
                    "timed_out": True,
                },
                status=500,
            )
        status = "success" if rc == 0 else "error"
        message = out if rc == 0 else (out + ("\n" if out and err else "") + err)
        return web.json_response(
            {"status": status, "message": message, "output": out, "error": err, "return_code": rc}
        )

    @r.post("/run_bash_script")
    async def run_bash_script(request: web.Request) -> web.Response:
        data = await _json_body(request)
        script = data.get("script")
        fail = lambda msg, code: web.json_response(
            {"status": "error", "output": msg, "error": "", "returncode": -1}, status=code
        )
        if not script:
            return fail("Script not supplied!", 400)
        wd = data.get("working_dir")
        if wd:
            wd = os.path.expanduser(wd)
            if not os.path.isdir(wd):
                return fail(f"Working directory does not exist: {wd}", 400)
        lim = limit(data.get("timeout"), 100.0)
        with tempfile.NamedTemporaryFile("w", suffix=".sh", delete=False) as f:
            f.write(script if "#!/bin/bash" in script else "#!/bin/bash\n\n" + script)
            path = f.name
        try:
            rc, out, _ = await run_limited(
                ["/bin/bash", path], shell=False, limit_s=lim, cwd=wd, merge_stderr=True
            )
        finally:
            os.unlink(path)
        if rc is None:
            return web.json_response(
                {
                    "status": "error",
                    "output": f"Script execution timed out after {lim:g} seconds",
                    "error": "",
                    "returncode": -1,
                    "timed_out": True,
                },
                status=500,
            )
        return web.json_response(
            {
                "status": "success" if rc == 0 else "error",
                "output": out,
                "error": "",
                "returncode": rc,
            }
        )

    # -- files -------------------------------------------------------------------------------

    @r.post("/file")
    async def get_file(request: web.Request) -> web.StreamResponse:
        form = await request.post()
        raw = form.get("file_path")
        if not isinstance(raw, str):
            raise web.HTTPBadRequest(text="/file needs the form field file_path")
        path = guard.check(raw)
        if not path.is_file():
            raise web.HTTPNotFound(text=f"file not found: {raw}")
        return web.FileResponse(path)

    @r.post("/setup/upload")
    async def upload(request: web.Request) -> web.Response:
        form = await request.post()
        raw, data = form.get("file_path"), form.get("file_data")
        if not isinstance(raw, str) or data is None:
            raise web.HTTPBadRequest(text="/setup/upload needs form fields file_path and file_data")
        path = guard.check(raw)
        blob = data.file.read() if hasattr(data, "file") else str(data).encode()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(blob)
        return web.Response(text="File uploaded")

    @r.post("/list_directory")
    async def list_directory(request: web.Request) -> web.Response:
        data = await _json_body(request)
        path = guard.check(str(data.get("path", "")))
        if not path.is_dir():
            raise web.HTTPNotFound(text=f"directory not found: {data.get('path')}")
        budget = [MAX_LIST_ENTRIES]

        def tree(p: Path) -> dict[str, Any]:
            node: dict[str, Any] = {"type": "directory", "name": p.name, "children": []}
            try:
                entries = sorted(os.scandir(p), key=lambda e: e.name)
            except OSError:
                return node
            for e in entries:
                if budget[0] <= 0:
                    break
                budget[0] -= 1
                if e.is_dir(follow_symlinks=False):
                    node["children"].append(tree(Path(e.path)))
                else:
                    node["children"].append({"type": "file", "name": e.name})
            return node

        return web.json_response({"directory_tree": await asyncio.to_thread(tree, path)})

    @r.post("/desktop_path")
    async def desktop_path(request: web.Request) -> web.Response:
        return web.json_response({"desktop_path": str(Path.home() / "Desktop")})

    @r.post("/setup/open_file")
    async def open_file(request: web.Request) -> web.Response:
        data = await _json_body(request)
        path = guard.check(str(data.get("path", "")))
        if not path.exists():
            raise web.HTTPNotFound(text=f"file not found: {data.get('path')}")
        opener = shutil.which("xdg-open")
        if opener is None:
            return _error("xdg-open is not installed in the VM (apt-get install xdg-utils)")
        proc = await asyncio.create_subprocess_exec(
            opener,
            str(path),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,
        )
        launched.add(proc)
        asyncio.ensure_future(proc.wait()).add_done_callback(lambda _t: launched.discard(proc))
        # Like OSWorld: wait (bounded) for a window whose title names the file.
        deadline = time.monotonic() + float(data.get("timeout", 10))
        while time.monotonic() < deadline:
            if any(path.name in w["name"] for w in await _wmctrl_windows()):
                return web.Response(text="File opened successfully")
            await asyncio.sleep(0.2)
        return _error(f"File opened but window not found within timeout: {path.name}")

    # -- windows -----------------------------------------------------------------------------

    async def _wm_op(request: web.Request, flag: str, verb: str) -> web.Response:
        data = await _json_body(request)
        name = data.get("window_name")
        if not name:
            return _error("window_name is required", 400)
        args = ["wmctrl"]
        if data.get("by_class"):
            args.append("-x")
        if data.get("strict"):
            args.append("-F")
        rc, _, err = await run_limited([*args, flag, str(name)], shell=False, limit_s=10)
        if rc != 0:
            return _error(f"window {name!r} not found ({err.strip() or 'wmctrl failed'})", 404)
        return web.Response(text=f"Window {verb} successfully")

    @r.post("/setup/activate_window")
    async def activate_window(request: web.Request) -> web.Response:
        return await _wm_op(request, "-a", "activated")

    @r.post("/setup/close_window")
    async def close_window(request: web.Request) -> web.Response:
        return await _wm_op(request, "-c", "closed")

    @r.post("/window_size")
    async def window_size(request: web.Request) -> web.Response:
        form = await request.post()
        cls = form.get("app_class_name")
        if not isinstance(cls, str) or not cls:
            raise web.HTTPBadRequest(text="/window_size needs the form field app_class_name")
        for w in await _wmctrl_windows():
            if cls.lower() in w["class"].lower():
                return web.json_response({"width": w["w"], "height": w["h"]})
        raise web.HTTPNotFound(text=f"no window of class {cls!r}")

    @r.get("/accessibility")
    async def accessibility(request: web.Request) -> web.Response:
        try:  # real AT-SPI when the VM has it (OSWorld's Ubuntu image does)
            xml = await asyncio.to_thread(_atspi_tree)
        except Exception as e:
            note = f"AT-SPI unavailable ({type(e).__name__}); top-level X windows only"
            wins = await _wmctrl_windows()
            items = "".join(
                f"<window name={quoteattr(w['name'])} class={quoteattr(w['class'])} "
                f'x="{w["x"]}" y="{w["y"]}" width="{w["w"]}" height="{w["h"]}"/>'
                for w in wins
            )
            xml = f"<desktop-frame note={quoteattr(note)}>{items}</desktop-frame>"
        return web.json_response({"AT": xml})

    @r.get("/terminal")
    async def terminal(request: web.Request) -> web.Response:
        # OSWorld reads the GNOME terminal's text through AT-SPI; xterm exposes none.
        try:
            out = await asyncio.to_thread(_atspi_terminal_text)
        except Exception as e:
            return web.json_response(
                {
                    "status": "error",
                    "output": None,
                    "message": f"terminal text needs AT-SPI ({type(e).__name__}: {e})",
                },
                status=500,
            )
        return web.json_response({"status": "success", "output": out})

    # -- recording (needs ffmpeg in the VM) --------------------------------------------------

    @r.post("/start_recording")
    async def start_recording(request: web.Request) -> web.Response:
        if "proc" in recording:
            return _error("a recording is already running", 400)
        ffmpeg = shutil.which("ffmpeg")
        if ffmpeg is None:
            return _error("recording needs ffmpeg in the VM (apt-get install ffmpeg)", 501)
        w, h = await asyncio.to_thread(screen.size)
        out = Path(tempfile.gettempdir()) / f"recording-{os.getpid()}.mp4"
        proc = await asyncio.create_subprocess_exec(
            ffmpeg,
            "-y",
            "-f",
            "x11grab",
            "-draw_mouse",
            "1",
            "-video_size",
            f"{w}x{h}",
            "-i",
            screen.display_name,
            "-c:v",
            "libx264",
            "-pix_fmt",
            "yuv420p",
            str(out),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,
        )
        recording.update(proc=proc, path=out)
        return web.json_response({"status": "success", "message": "Started recording."})

    @r.post("/end_recording")
    async def end_recording(request: web.Request) -> web.StreamResponse:
        proc = recording.pop("proc", None)
        if proc is None:
            return _error("no recording is running", 400)
        proc.stdin.write(b"q")  # ffmpeg finishes the file cleanly on 'q'
        await proc.stdin.drain()
        try:
            await asyncio.wait_for(proc.wait(), 15)
        except TimeoutError:
            _kill_group(proc)
        path = recording.pop("path")
        if not path.exists():
            return _error("recording failed: no file was written")
        return web.FileResponse(path)

    async def on_cleanup(_app: web.Application) -> None:
        if worker is not None:
            worker.kill()
        for proc in list(launched) + ([recording["proc"]] if "proc" in recording else []):
            _kill_group(proc)

    app.router.add_routes(r)
    app.on_cleanup.append(on_cleanup)
    return app


def _atspi_tree() -> str:
    """The AT-SPI tree as XML (names/roles/extents); raises when pyatspi is unavailable."""
    import pyatspi  # only in VMs with the accessibility stack (python3-pyatspi)

    def node(acc, depth: int) -> str:
        if depth > 50:
            return ""
        role = acc.getRoleName().replace(" ", "-") or "unknown"
        try:
            ext = acc.queryComponent().getExtents(pyatspi.DESKTOP_COORDS)
            geo = f' x="{ext.x}" y="{ext.y}" width="{ext.width}" height="{ext.height}"'
        except Exception:
            geo = ""
        kids = "".join(node(acc.getChildAtIndex(i), depth + 1) for i in range(acc.childCount))
        return f"<{role} name={quoteattr(acc.name or '')}{geo}>{kids}</{role}>"

    return node(pyatspi.Registry.getDesktop(0), 0)


def _atspi_terminal_text() -> str:
    import pyatspi

    desktop = pyatspi.Registry.getDesktop(0)
    for app in desktop:
        for acc in pyatspi.findAllDescendants(app, lambda a: a.getRoleName() == "terminal"):
            return acc.queryText().getText(0, -1)
    raise LookupError("no terminal found in the AT-SPI tree")


# ----------------------------------------------------------------------------- CLI


def is_loopback(host: str) -> bool:
    """True for localhost / 127.0.0.0/8 / ::1."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m envs.vm.server",
        description="Serve the X display in $DISPLAY over the OSWorld VM protocol.",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="bind address (default loopback; others need --token)"
    )
    p.add_argument("--port", type=int, default=5000, help="port (0 picks a free one)")
    p.add_argument(
        "--token",
        default=os.environ.get("CUA_VM_TOKEN"),
        help="bearer token every request must carry (default $CUA_VM_TOKEN)",
    )
    p.add_argument(
        "--allow-root",
        action="append",
        default=None,
        metavar="DIR",
        help="a directory the file endpoints may touch (repeatable; default: $HOME and /tmp)",
    )
    p.add_argument(
        "--exec-limit",
        type=float,
        default=DEFAULT_EXEC_LIMIT_S,
        help="max seconds a command may run (default 120)",
    )
    p.add_argument("--display", default=None, help="X display (default $DISPLAY)")
    p.add_argument(
        "--no-warm-pyautogui",
        dest="warm_pyautogui",
        action="store_false",
        help="run every pyautogui action in a new `python -c` process, like "
        "OSWorld's server (default: a warm worker process)",
    )
    args = p.parse_args(argv)
    if not is_loopback(args.host) and not args.token:
        p.error(
            f"refusing to bind {args.host}: the server runs any command it is sent, so a "
            "non-loopback address needs --token T (or $CUA_VM_TOKEN); clients then send "
            "'Authorization: Bearer T'"
        )
    return args


async def serve(args: argparse.Namespace) -> None:
    """Runs until SIGTERM/SIGINT; prints ``serving on http://HOST:PORT`` once bound."""
    app = make_app(
        token=args.token,
        allowed_roots=args.allow_root,
        exec_limit_s=args.exec_limit,
        display=args.display,
    )
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # the real port when --port 0
    print(f"serving on http://{args.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> None:
    asyncio.run(serve(parse_args(argv)))


if __name__ == "__main__":
    main()
