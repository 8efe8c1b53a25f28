"""An OSWorld-compatible VM server for any Linux X display.

OSWorld drives its VMs through a small HTTP server (``desktop_env/server/main.py`` in
xlang-ai/OSWorld, see ``OSWORLD_API.md``). This module speaks the same protocol (same paths,
request and response shapes) on the X display in ``$DISPLAY``, so that

* our own containers / VMs / Xvfb desktops become environments (``envs.vm.providers``), and
* OSWorld's own client could drive it, and our client (``envs.vm.client``) drives real OSWorld VMs.

Run it inside the desktop session::

    python -m envs.vm.server [--host 127.0.0.1] [--port 5000] [--token T | --no-token]
                             [--allow-root DIR ...] [--allow-host NAME ...]

Differences from OSWorld's server, all on the safe side:

* Every request needs ``Authorization: Bearer T`` (else 401). Without ``--token T`` (or
  ``$CUA_VM_TOKEN``) the server makes up a token and prints it on stderr, as Jupyter does;
  ``--no-token`` turns the check off, on loopback only. It binds 127.0.0.1 by default and
  refuses a non-loopback ``--host`` without a given token. OSWorld's server has no
  authentication and runs any command it is sent, so exposing one must be a deliberate act.
* Web pages cannot call it (``server_http``): a request whose ``Origin`` is not the server's own,
  whose ``Host`` is not loopback or the bound host, or that ``Sec-Fetch-Site`` marks as sent by
  another site is 403; JSON endpoints need ``Content-Type: application/json`` (else 415).
* Request bodies are capped per endpoint (413): 64 KiB for small arguments, 4 MiB for a
  command, 16 MiB for a script, 1 GiB for ``/setup/upload`` (``--max-upload-bytes``).
* Command run time is capped (``--exec-limit``, 120 s like OSWorld); a command past its limit is
  killed with its whole process group and answered with HTTP 500 ``{"status": "error",
  "message": "... timed out after N seconds", "timed_out": true}``. ``--command-cpu-s N`` caps
  the CPU seconds of each command it starts (``RLIMIT_CPU``: also what a command leaves running
  in the background, which the process-group kill misses).
* File endpoints (``/file``, ``/setup/upload``, ``/list_directory``, ``/setup/open_file``) only
  touch paths inside the allowed roots (default: ``$HOME`` and ``/tmp``) after resolving ``..``
  and symlinks; anything else is 403.
* ``/accessibility`` uses AT-SPI (pyatspi) when importable; otherwise it returns a tree of the
  top-level X windows (name, class, geometry) with a ``note`` attribute saying so.

It is an aiohttp.web app: ``VMServer``'s methods are the handlers (each callable alone with an
``aiohttp`` request); ``server_screen`` holds the X side, ``server_exec`` the command runners,
``server_files`` the file helpers and ``server_http`` the request guard. X work (screenshots,
pointer queries) runs in worker threads so one slow capture never stalls other requests.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from envs.vm import server_exec
from envs.vm.server_exec import (
    DEFAULT_EXEC_LIMIT_S,
    RUN_BASH_DEFAULT_S,
    RUN_PYTHON_LIMIT_S,
    PyAutoGUIWorker,
    Ran,
    clamp_limit,
    expand_home,
    is_pyautogui_command,
    kill_group,
    run_capped,
    run_limited,
    spawn_detached,
)
from envs.vm.server_files import MAX_LIST_ENTRIES, PathGuard, directory_tree, write_upload
from envs.vm.server_http import (
    COMMAND_MAX_BYTES,
    FORM,
    JSON,
    SCRIPT_MAX_BYTES,
    UPLOAD_MAX_BYTES,
    RequestGuard,
    Route,
    error,
    is_loopback,
    is_wildcard,
    json_body,
)
from envs.vm.server_screen import (
    Screen,
    XScreen,
    atspi_terminal_text,
    atspi_tree,
    windows_xml,
    wmctrl_windows,
)

__all__ = [
    "DEFAULT_EXEC_LIMIT_S",
    "MAX_LIST_ENTRIES",
    "ROUTES",
    "RUN_PYTHON_LIMIT_S",
    "PathGuard",
    "PyAutoGUIWorker",
    "VMServer",
    "XScreen",
    "is_loopback",
    "is_pyautogui_command",
    "main",
    "make_app",
    "parse_args",
    "run_limited",
    "serve",
]

MAX_EXEC_LIMIT_S = 24 * 3600.0  # --exec-limit: a day
MAX_UPLOAD_CAP = 64 * 1024**3  # --max-upload-bytes: the spool is on the VM's disk
MIN_TOKEN_CHARS = 16  # beyond loopback: a token a network neighbour cannot guess

# Every endpoint, what its body is and how big it may be (server_http.Route).
ROUTES: tuple[Route, ...] = (
    Route("GET", "/screenshot", "screenshot"),
    Route("POST", "/screen_size", "screen_size"),
    Route("GET", "/cursor_position", "cursor_position"),
    Route("GET", "/platform", "platform"),
    Route("POST", "/execute", "execute", JSON, COMMAND_MAX_BYTES),
    Route("POST", "/setup/execute", "execute", JSON, COMMAND_MAX_BYTES),
    Route("POST", "/setup/launch", "launch", JSON, COMMAND_MAX_BYTES),
    Route("POST", "/run_python", "run_python", JSON, SCRIPT_MAX_BYTES),
    Route("POST", "/run_bash_script", "run_bash_script", JSON, SCRIPT_MAX_BYTES),
    Route("POST", "/file", "get_file", FORM),
    Route("POST", "/setup/upload", "upload", FORM, None),  # None: the server's upload cap
    Route("POST", "/list_directory", "list_directory", JSON),
    Route("POST", "/desktop_path", "desktop_path"),
    Route("POST", "/setup/open_file", "open_file", JSON),
    Route("POST", "/setup/activate_window", "activate_window", JSON),
    Route("POST", "/setup/close_window", "close_window", JSON),
    Route("POST", "/window_size", "window_size", FORM),
    Route("GET", "/accessibility", "accessibility"),
    Route("GET", "/terminal", "terminal"),
    Route("POST", "/start_recording", "start_recording"),
    Route("POST", "/end_recording", "end_recording"),
)


class VMServer:
    """The OSWorld protocol on one display; ``app()`` is the aiohttp application.

    Args:
      token: when set, every request must carry ``Authorization: Bearer <token>`` (else 401).
      allowed_roots: directories the file endpoints may touch (default: $HOME and /tmp).
      exec_limit_s: the most seconds a command of /execute, /run_python or /run_bash_script may
        run; a request may ask for less (``timeout``), never more.
      display: the X display, e.g. ``":1"`` (default $DISPLAY).
      warm_pyautogui: run OSWorld's ``["python", "-c", "import pyautogui; ..."]`` action
        commands in a warm worker process instead of a new interpreter each time (same result,
        several times faster; see ``PyAutoGUIWorker``).
      allowed_hosts: names the ``Host`` header may carry besides loopback ones (the bound host);
        None: any (a wildcard bind, protected by its token).
      max_upload_bytes: the body cap of ``/setup/upload``.
      open_wait_s: how long ``/setup/open_file`` waits for the file's window when the request
        names no ``timeout`` (OSWorld's client names none), at most ``exec_limit_s``: 60 s covers
        LibreOffice's cold start on a loaded machine; a TCG guest's Calc takes about as long.
      screen: the display object (default ``XScreen(display)``; tests pass a fake).
    """

    def __init__(
        self,
        *,
        token: str | None = None,
        allowed_roots: Sequence[str | os.PathLike] | None = None,
        exec_limit_s: float = DEFAULT_EXEC_LIMIT_S,
        display: str | None = None,
        warm_pyautogui: bool = True,
        allowed_hosts: Sequence[str] | None = (),
        max_upload_bytes: int = UPLOAD_MAX_BYTES,
        screen: Screen | None = None,
        open_wait_s: float = 60.0,
    ):
        self.screen: Screen = screen if screen is not None else XScreen(display)
        self.guard = PathGuard(allowed_roots or [Path.home(), tempfile.gettempdir()])
        self.exec_limit_s = exec_limit_s
        self.open_wait_s = open_wait_s
        self.worker = PyAutoGUIWorker() if warm_pyautogui else None
        self.launched: set[asyncio.subprocess.Process] = set()
        self.recording: dict[str, Any] = {}
        self._routes: dict[Any, Route] = {}
        self.request_guard = RequestGuard(
            token=token,
            allowed_hosts=allowed_hosts,
            route_of=self._routes.get,
            upload_max_bytes=max_upload_bytes,
        )

    def app(self) -> web.Application:
        """A new aiohttp application serving ``ROUTES`` through the request guard."""
        # client_max_size only bounds requests the guard has not capped (it caps them all).
        app = web.Application(
            middlewares=[self.request_guard.middleware], client_max_size=SCRIPT_MAX_BYTES
        )
        for spec in ROUTES:
            route = app.router.add_route(spec.method, spec.path, getattr(self, spec.handler))
            self._routes[route] = spec
            if spec.method == "GET":  # like RouteTableDef.get: HEAD too
                self._routes[app.router.add_route("HEAD", spec.path, route.handler)] = spec
        app.on_cleanup.append(self.on_cleanup)
        return app

    def limit(self, requested: Any, default: float) -> float:
        """A request's command run-time limit (its ``timeout``), capped at ``exec_limit_s``."""
        return clamp_limit(requested, default, self.exec_limit_s)

    def _track(self, proc: asyncio.subprocess.Process) -> None:
        """Keeps a started process to kill at shutdown; reaps it when it exits (no zombies)."""
        self.launched.add(proc)
        task = asyncio.ensure_future(proc.wait())
        task.add_done_callback(lambda _t: self.launched.discard(proc))

    async def on_cleanup(self, _app: web.Application | None = None) -> None:
        if self.worker is not None:
            self.worker.kill()
        for proc in list(self.launched) + (
            [self.recording["proc"]] if "proc" in self.recording else []
        ):
            kill_group(proc)

    # -- screen ------------------------------------------------------------------------------

    async def screenshot(self, request: web.Request) -> web.Response:
        png, t_cap, t_enc = await asyncio.to_thread(self.screen.screenshot_png)
        headers = {"X-Capture-Seconds": f"{t_cap:.6f}", "X-Encode-Seconds": f"{t_enc:.6f}"}
        return web.Response(body=png, content_type="image/png", headers=headers)

    async def screen_size(self, request: web.Request) -> web.Response:
        w, h = await asyncio.to_thread(self.screen.size)
        return web.json_response({"width": w, "height": h})

    async def cursor_position(self, request: web.Request) -> web.Response:
        x, y = await asyncio.to_thread(self.screen.cursor_position)
        return web.json_response([x, y])

    async def platform(self, request: web.Request) -> web.Response:
        return web.Response(text=platform.system())

    # -- commands ----------------------------------------------------------------------------

    async def execute(self, request: web.Request) -> web.Response:
        data = await json_body(request)
        shell = bool(data.get("shell", False))
        command = data.get("command", "" if shell else [])
        if not _is_command(command):
            return error(_COMMAND_SHAPE.format(command), 400)
        try:
            command = expand_home(command, shell)
        except ValueError as e:  # an unbalanced quote
            return error(str(e))
        if not command:
            return error('no command given: send {"command": [...] or "..."}', 400)
        lim = self.limit(data.get("timeout"), self.exec_limit_s)
        try:
            if self.worker is not None and is_pyautogui_command(command, shell):
                ran = await self.worker.run_capped(command[2], lim)
            else:
                ran = await run_capped(command, shell=shell, limit_s=lim)
        except (OSError, ValueError) as e:  # e.g. the program does not exist
            return error(str(e))
        if ran.returncode is None:
            return error(f"Command {command!r} timed out after {lim:g} seconds", timed_out=True)
        return web.json_response(
            {
                "status": "success",
                "output": ran.stdout,
                "error": ran.stderr,
                "returncode": ran.returncode,
                **_truncated(ran),
            }
        )

    async def launch(self, request: web.Request) -> web.Response:
        data = await json_body(request)
        shell = bool(data.get("shell", False))
        if not _is_command(data.get("command", "")):
            return error(_COMMAND_SHAPE.format(data.get("command")), 400)
        try:
            command = expand_home(data.get("command", ""), shell)
        except ValueError as e:
            return error(f"failed to launch {data.get('command')!r}: {e}")
        if not command:
            return error("no command given", 400)
        try:
            proc = await spawn_detached(command, shell=shell)
        except (OSError, ValueError) as e:
            return error(f"failed to launch {command!r}: {e}")
        self._track(proc)
        shown = command if isinstance(command, str) else " ".join(map(str, command))
        return web.Response(text=f"{shown} launched successfully")

    async def run_python(self, request: web.Request) -> web.Response:
        data = await json_body(request)
        code = data.get("code")
        if not code or not isinstance(code, str):
            return web.json_response(
                {
                    "status": "error",
                    "message": "code must be a string" if code else "Code not supplied!",
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
            ran = await run_capped(
                [sys.executable, path], shell=False, limit_s=self.limit(None, RUN_PYTHON_LIMIT_S)
            )
        finally:
            os.unlink(path)
        rc, out, err = ran[:3]
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
            {
                "status": status,
                "message": message,
                "output": out,
                "error": err,
                "return_code": rc,
                **_truncated(ran),
            }
        )

    async def run_bash_script(self, request: web.Request) -> web.Response:
        data = await json_body(request)
        script = data.get("script")

        def fail(msg: str, code: int, **extra: Any) -> web.Response:
            body = {"status": "error", "output": msg, "error": "", "returncode": -1, **extra}
            return web.json_response(body, status=code)

        if not script or not isinstance(script, str):
            return fail("Script not supplied!" if not script else "script must be a string", 400)
        wd = data.get("working_dir")
        if wd is not None and not isinstance(wd, str):
            return fail(f"working_dir must be a string, got {wd!r:.100}", 400)
        if wd:
            wd = os.path.expanduser(wd)
            if not os.path.isdir(wd):
                return fail(f"Working directory does not exist: {wd}", 400)
        lim = self.limit(data.get("timeout"), RUN_BASH_DEFAULT_S)
        with tempfile.NamedTemporaryFile("w", suffix=".sh", delete=False) as f:
            f.write(script if "#!/bin/bash" in script else "#!/bin/bash\n\n" + script)
            path = f.name
        try:
            ran = await run_capped(
                ["/bin/bash", path], shell=False, limit_s=lim, cwd=wd, merge_stderr=True
            )
        finally:
            os.unlink(path)
        rc, out = ran.returncode, ran.stdout
        if rc is None:
            return fail(f"Script execution timed out after {lim:g} seconds", 500, timed_out=True)
        return web.json_response(
            {
                "status": "success" if rc == 0 else "error",
                "output": out,
                "error": "",
                "returncode": rc,
                **_truncated(ran),
            }
        )

    # -- files -------------------------------------------------------------------------------

    async def get_file(self, request: web.Request) -> web.StreamResponse:
        form = await request.post()
        raw = form.get("file_path")
        if not isinstance(raw, str):
            raise web.HTTPBadRequest(text="/file needs the form field file_path")
        path = self.guard.check(raw)
        if not path.is_file():
            raise web.HTTPNotFound(text=f"file not found: {raw}")
        return web.FileResponse(path)

    async def upload(self, request: web.Request) -> web.Response:
        form = await request.post()  # aiohttp spools a file part to a temp file, capped
        raw, data = form.get("file_path"), form.get("file_data")
        if not isinstance(raw, str) or data is None:
            raise web.HTTPBadRequest(text="/setup/upload needs form fields file_path and file_data")
        path = self.guard.check(raw)
        await asyncio.to_thread(write_upload, path, data)
        return web.Response(text="File uploaded")

    async def list_directory(self, request: web.Request) -> web.Response:
        data = await json_body(request)
        path = self.guard.check(str(data.get("path", "")))
        if not path.is_dir():
            raise web.HTTPNotFound(text=f"directory not found: {data.get('path')}")
        tree = await asyncio.to_thread(directory_tree, path, MAX_LIST_ENTRIES)
        return web.json_response({"directory_tree": tree})

    async def desktop_path(self, request: web.Request) -> web.Response:
        return web.json_response({"desktop_path": str(Path.home() / "Desktop")})

    async def open_file(self, request: web.Request) -> web.Response:
        data = await json_body(request)
        path = self.guard.check(str(data.get("path", "")))
        if not path.exists():
            raise web.HTTPNotFound(text=f"file not found: {data.get('path')}")
        opener = shutil.which("xdg-open")
        if opener is None:
            return error("xdg-open is not installed in the VM (apt-get install xdg-utils)")
        self._track(await spawn_detached([opener, str(path)], shell=False))
        # Like OSWorld: wait (bounded) for a window whose title names the file. OSWorld's client
        # sends no timeout and its server waits up to 1800 s; 60 s here (capped at the exec
        # limit) covers LibreOffice's cold start on a loaded machine (1-3 s idle).
        wait = data.get("timeout", self.open_wait_s)
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait < math.inf:
            return error(f"timeout must be a number of seconds >= 0, got {wait!r:.100}", 400)
        deadline = time.monotonic() + min(wait, self.exec_limit_s)
        while time.monotonic() < deadline:
            if any(path.name in w["name"] for w in await wmctrl_windows()):
                return web.Response(text="File opened successfully")
            await asyncio.sleep(0.2)
        return error(f"File opened but window not found within timeout: {path.name}")

    # -- windows -----------------------------------------------------------------------------

    async def _wm_op(self, request: web.Request, flag: str, verb: str) -> web.Response:
        data = await json_body(request)
        name = data.get("window_name")
        if not name:
            return error("window_name is required", 400)
        args = ["wmctrl"]
        if data.get("by_class"):
            args.append("-x")
        if data.get("strict"):
            args.append("-F")
        # LibreOffice >= 24.2 titles its windows "file.xlsx — LibreOffice Calc" (an em dash);
        # OSWorld's tasks, written on LibreOffice 7, name them with " - ": try that title too
        for title in dict.fromkeys([str(name), str(name).replace(" - ", " \u2014 ")]):
            rc, _, err = await run_limited([*args, flag, title], shell=False, limit_s=10)
            if rc == 0:
                break
        if rc != 0:
            return error(f"window {name!r} not found ({err.strip() or 'wmctrl failed'})", 404)
        return web.Response(text=f"Window {verb} successfully")

    async def activate_window(self, request: web.Request) -> web.Response:
        return await self._wm_op(request, "-a", "activated")

    async def close_window(self, request: web.Request) -> web.Response:
        return await self._wm_op(request, "-c", "closed")

    async def window_size(self, request: web.Request) -> web.Response:
        form = await request.post()
        cls = form.get("app_class_name")
        if not isinstance(cls, str) or not cls:
            raise web.HTTPBadRequest(text="/window_size needs the form field app_class_name")
        for w in await wmctrl_windows():
            if cls.lower() in w["class"].lower():
                return web.json_response({"width": w["w"], "height": w["h"]})
        raise web.HTTPNotFound(text=f"no window of class {cls!r}")

    async def accessibility(self, request: web.Request) -> web.Response:
        try:  # real AT-SPI when the VM has it (OSWorld's Ubuntu image does)
            xml = await asyncio.to_thread(atspi_tree)
        except Exception as e:
            note = f"AT-SPI unavailable ({type(e).__name__}); top-level X windows only"
            xml = windows_xml(await wmctrl_windows(), note)
        return web.json_response({"AT": xml})

    async def terminal(self, request: web.Request) -> web.Response:
        # OSWorld reads the GNOME terminal's text through AT-SPI; xterm exposes none.
        try:
            out = await asyncio.to_thread(atspi_terminal_text)
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

    async def start_recording(self, request: web.Request) -> web.Response:
        if "proc" in self.recording:
            return error("a recording is already running", 400)
        ffmpeg = shutil.which("ffmpeg")
        if ffmpeg is None:
            return error("recording needs ffmpeg in the VM (apt-get install ffmpeg)", 501)
        w, h = await asyncio.to_thread(self.screen.size)
        out = Path(tempfile.gettempdir()) / f"recording-{os.getpid()}.mp4"
        grab = ["-f", "x11grab", "-draw_mouse", "1", "-video_size", f"{w}x{h}"]
        encode = ["-c:v", "libx264", "-pix_fmt", "yuv420p"]
        proc = await asyncio.create_subprocess_exec(
            *[ffmpeg, "-y", *grab, "-i", str(self.screen.display_name), *encode, str(out)],
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,
        )
        self.recording.update(proc=proc, path=out)
        return web.json_response({"status": "success", "message": "Started recording."})

    async def end_recording(self, request: web.Request) -> web.StreamResponse:
        proc = self.recording.pop("proc", None)
        if proc is None:
            return error("no recording is running", 400)
        proc.stdin.write(b"q")  # ffmpeg finishes the file cleanly on 'q'
        await proc.stdin.drain()
        try:
            await asyncio.wait_for(proc.wait(), 15)
        except TimeoutError:
            kill_group(proc)
        path = self.recording.pop("path")
        if not path.exists():
            return error("recording failed: no file was written")
        return web.FileResponse(path)


_COMMAND_SHAPE = "command must be a string or a list of strings, got {!r:.100}"


def _is_command(command: Any) -> bool:
    """A command is a string (shlex-split without a shell) or a list of strings; `123` or
    `[[1]]` are a 400, not a 500 from deep inside the process start."""
    if isinstance(command, list):
        return all(isinstance(a, str) for a in command)
    return isinstance(command, str)


def _truncated(ran: Ran) -> dict[str, Any]:
    """Added to a command's reply when an output was cut at ``server_exec.MAX_OUTPUT_BYTES``
    (OSWorld's replies have no such key: it appears only then)."""
    return {"truncated": True} if ran.truncated else {}


def make_app(**kwargs: Any) -> web.Application:
    """``VMServer(**kwargs).app()``: the aiohttp application (see ``VMServer`` for the args)."""
    return VMServer(**kwargs).app()


# ----------------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The CLI; sets ``args.token`` (made up when none is given on loopback) and
    ``args.token_generated``."""
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
        default=None,
        help="bearer token every request must carry (default $CUA_VM_TOKEN; without either, "
        "a random one, printed on stderr)",
    )
    p.add_argument(
        "--no-token",
        action="store_true",
        help="accept requests without a token (loopback only; web pages are still refused)",
    )
    p.add_argument(
        "--allow-root",
        action="append",
        default=None,
        metavar="DIR",
        help="a directory the file endpoints may touch (repeatable; default: $HOME and /tmp)",
    )
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a name clients reach the server by (Host header) besides loopback and --host "
        "(repeatable; with a wildcard --host and no --allow-host any name is accepted)",
    )
    p.add_argument(
        "--exec-limit",
        type=float,
        default=DEFAULT_EXEC_LIMIT_S,
        help="max seconds a command may run (default 120)",
    )
    p.add_argument(
        "--max-upload-bytes",
        type=int,
        default=UPLOAD_MAX_BYTES,
        help=f"the largest /setup/upload body (default {UPLOAD_MAX_BYTES}, 1 GiB)",
    )
    p.add_argument(
        "--command-cpu-s",
        type=float,
        default=None,
        help="CPU seconds each command it starts may use (RLIMIT_CPU; default: no cap)",
    )
    p.add_argument(
        "--open-wait",
        type=float,
        default=60.0,
        help="seconds /setup/open_file waits for the file's window unless the request says "
        "(default 60; at most --exec-limit)",
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
    loopback = is_loopback(args.host)
    if not 0 <= args.port <= 65535:
        p.error(f"--port {args.port} must be in [0, 65535] (0 picks a free one)")
    if not (math.isfinite(args.exec_limit) and 0 < args.exec_limit <= MAX_EXEC_LIMIT_S):
        p.error(f"--exec-limit {args.exec_limit} must be in (0, {MAX_EXEC_LIMIT_S:g}] seconds")
    if args.command_cpu_s is not None and not (
        math.isfinite(args.command_cpu_s) and 1 <= args.command_cpu_s <= 86400
    ):
        p.error(f"--command-cpu-s {args.command_cpu_s} must be in [1, 86400] seconds")
    if not 1 <= args.max_upload_bytes <= MAX_UPLOAD_CAP:
        p.error(f"--max-upload-bytes {args.max_upload_bytes} must be in [1, {MAX_UPLOAD_CAP}]")
    if args.no_token and args.token is not None:
        p.error("--no-token and --token contradict each other: give one")
    if args.token is None and not args.no_token:
        args.token = os.environ.get("CUA_VM_TOKEN")
    if not loopback and args.token and len(args.token) < MIN_TOKEN_CHARS:
        p.error(
            f"--token: a non-loopback address needs a token of at least {MIN_TOKEN_CHARS} "
            "characters (the server runs any command it is sent)"
        )
    if args.no_token and not loopback:
        p.error(
            f"refusing to bind {args.host} with --no-token: the server runs any command it is "
            "sent, so a non-loopback address needs --token T"
        )
    if not loopback and not args.token:
        p.error(
            f"refusing to bind {args.host}: the server runs any command it is sent, so a "
            "non-loopback address needs --token T (or $CUA_VM_TOKEN); clients then send "
            "'Authorization: Bearer T'"
        )
    args.token_generated = False
    if args.no_token:
        args.token = None
    elif not args.token:
        args.token, args.token_generated = secrets.token_urlsafe(32), True
    return args


def allowed_hosts_for(host: str, extra: Sequence[str] = ()) -> list[str] | None:
    """The Host names a server bound to ``host`` accepts besides loopback ones (None: any)."""
    if is_wildcard(host) and not extra:
        return None
    return [h for h in [host, *extra] if not is_wildcard(h)]


async def serve(args: argparse.Namespace) -> None:
    """Runs until SIGTERM/SIGINT; prints ``serving on http://HOST:PORT`` on stdout once bound,
    and on stderr one line with the URL and the token (or where the token came from)."""
    server = VMServer(
        token=args.token,
        allowed_roots=args.allow_root,
        exec_limit_s=args.exec_limit,
        display=args.display,
        warm_pyautogui=args.warm_pyautogui,
        allowed_hosts=allowed_hosts_for(args.host, args.allow_host),
        max_upload_bytes=args.max_upload_bytes,
        open_wait_s=args.open_wait,
    )
    # At SIGTERM a request still running (a 120 s command, a wait for a window) is cancelled
    # after 2 s, its process group killed, instead of holding the server for aiohttp's 60 s.
    runner = web.AppRunner(server.app(), access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # the real port when --port 0
    url = f"http://{args.host}:{port}"
    print(f"serving on {url}", flush=True)
    if args.token is None:
        how = "with no token (--no-token)"
    elif args.token_generated:
        how = f"with token {args.token} (clients send 'Authorization: Bearer {args.token}')"
    else:
        how = "with the token from --token / $CUA_VM_TOKEN"
    print(f"envs.vm.server: {url} {how}", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    server_exec.COMMAND_CPU_S = args.command_cpu_s
    os.environ.pop("CUA_VM_TOKEN", None)  # commands run in the desktop do not inherit it
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
