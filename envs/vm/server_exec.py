"""Running commands for ``envs.vm.server``: time-limited subprocesses and the warm pyautogui worker.

Nothing here touches HTTP or X: the server's command handlers (``/execute``, ``/setup/launch``,
``/run_python``, ``/run_bash_script``) are thin wrappers over these functions.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import sys
from typing import Any, NamedTuple

DEFAULT_EXEC_LIMIT_S = 120.0  # OSWorld's /execute limit
RUN_PYTHON_LIMIT_S = 30.0  # OSWorld's /run_python limit
RUN_BASH_DEFAULT_S = 100.0  # OSWorld's /run_bash_script default timeout
# The most bytes of a command's stdout (and, apart, of its stderr) a reply carries. The rest is
# read and dropped, so the command runs as it would (a full pipe would stall it): `yes` for the
# 120 s limit would otherwise be tens of GB in the server. Replies then say "truncated": true.
MAX_OUTPUT_BYTES = 8 * 1024**2
# The CPU seconds each command the server starts may use (RLIMIT_CPU: SIGXCPU, then SIGKILL at
# the hard limit one second later); None: no cap. `--command-cpu-s` sets it. A busy loop a task
# leaves behind (`nohup sh -c 'while :; do :; done' &`) escapes the run-time limit's killpg, not
# this; works in any desktop (a VM, a container, a LocalDesktop), root or not.
COMMAND_CPU_S: float | None = None


def command_preexec() -> Any:
    """The ``preexec_fn`` of the commands the server starts (None: no cap set)."""
    if COMMAND_CPU_S is None:
        return None
    import resource  # noqa: PLC0415 -- POSIX only, as preexec_fn itself

    soft = max(1, int(COMMAND_CPU_S))

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (soft, soft + 1))

    return apply


def expand_home(command: Any, shell: bool) -> Any:
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


def clamp_limit(requested: Any, default: float, cap: float) -> float:
    """The run-time limit of one command: ``requested`` (or ``default`` when absent or not a
    number), never above ``cap`` and never below 0.1 s."""
    try:
        t = float(requested) if requested is not None else default
    except (TypeError, ValueError):
        t = default
    return max(0.1, min(t, cap))


def kill_group(proc: asyncio.subprocess.Process) -> None:
    """SIGKILLs ``proc``'s whole process group (it was started in a new session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def spawn_detached(command: str | list[str], *, shell: bool) -> asyncio.subprocess.Process:
    """Starts ``command`` in its own session with no stdio, without waiting for it."""
    quiet = dict(
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=command_preexec(),
    )
    if shell:
        cmd = command if isinstance(command, str) else shlex.join(command)
        return await asyncio.create_subprocess_shell(cmd, **quiet)
    argv = shlex.split(command) if isinstance(command, str) else list(command)
    return await asyncio.create_subprocess_exec(*argv, **quiet)


class Ran(NamedTuple):
    """What ``run_capped`` saw: returncode None = past the limit (process group killed);
    ``truncated``: stdout or stderr was longer than the cap and is cut there."""

    returncode: int | None
    stdout: str
    stderr: str
    truncated: bool = False


async def _read_capped(stream: asyncio.StreamReader | None, cap: int) -> tuple[bytes, bool]:
    """The first ``cap`` bytes of ``stream`` and whether there were more (read to EOF)."""
    buf, more = bytearray(), False
    while stream is not None:
        chunk = await stream.read(256 * 1024)
        if not chunk:
            break
        room = cap - len(buf)
        buf += chunk[: max(room, 0)]
        more = more or len(chunk) > room
    return bytes(buf), more


async def run_limited(
    command: str | list[str],
    *,
    shell: bool,
    limit_s: float,
    cwd: str | None = None,
    merge_stderr: bool = False,
) -> tuple[int | None, str, str]:
    """Runs a command to completion or until ``limit_s``; returns (returncode, stdout, stderr),
    each output capped at ``MAX_OUTPUT_BYTES`` (``run_capped`` also says whether it was)."""
    ran = await run_capped(
        command, shell=shell, limit_s=limit_s, cwd=cwd, merge_stderr=merge_stderr
    )
    return ran.returncode, ran.stdout, ran.stderr


async def run_capped(
    command: str | list[str],
    *,
    shell: bool,
    limit_s: float,
    cwd: str | None = None,
    merge_stderr: bool = False,
    max_output_bytes: int = MAX_OUTPUT_BYTES,
) -> Ran:
    """Runs a command to completion or until ``limit_s``, keeping at most ``max_output_bytes``
    of each output.

    returncode None means it ran past its limit: its whole process group was killed (commands
    like ``sh -c 'sleep 100 &'`` must not leave children behind).
    """
    pipes = dict(
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT if merge_stderr else asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.DEVNULL,
        cwd=cwd,
        start_new_session=True,
        preexec_fn=command_preexec(),
    )
    if shell:
        cmd = command if isinstance(command, str) else shlex.join(command)
        proc = await asyncio.create_subprocess_shell(cmd, **pipes)
    else:
        argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
        proc = await asyncio.create_subprocess_exec(*argv, **pipes)
    reading = asyncio.gather(
        _read_capped(proc.stdout, max_output_bytes),
        _read_capped(proc.stderr, max_output_bytes),
        proc.wait(),
    )
    try:
        (out, more_out), (err, more_err), _ = await asyncio.wait_for(reading, timeout=limit_s)
    except TimeoutError:
        kill_group(proc)
        await proc.wait()
        return Ran(None, "", "")
    except asyncio.CancelledError:
        kill_group(proc)
        raise
    return Ran(proc.returncode, _decode(out), _decode(err), more_out or more_err)


def _decode(b: bytes | None) -> str:
    return (b or b"").decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------- warm pyautogui

# The worker: a Python process with pyautogui already imported that runs one snippet per request
# (newline-delimited JSON on stdin/stdout). Each snippet gets fresh globals and pyautogui's
# defaults (PAUSE=0.1, FAILSAFE=True) reset, so it behaves like the `python -c` process OSWorld's
# client asks for, minus the ~0.3-1 s of interpreter start-up and `import pyautogui`.
# Requests and replies travel on private copies of fds 0 and 1 (os.dup: not inherited), because
# processes a snippet starts (os.system, subprocess) inherit fds 0 and 1: there they get /dev/null
# for input and a temp file for output, whose text joins the snippet's output (as it would in a
# fresh process). Each reply carries its request's id, so a reply out of step is caught.
WORKER_SRC = r"""
import contextlib, io, json, os, sys, tempfile, traceback
CAP = {cap}  # characters per output: 2 x CAP x 12 bytes (an escaped surrogate pair) < limit
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
    out = child_out.read(CAP).decode("utf-8", "replace") + o.getvalue()
    cut = child_out.seek(0, 2) > CAP or len(out) > CAP or len(e.getvalue()) > CAP
    replies.write(json.dumps({"id": req["id"], "output": out[:CAP], "error": e.getvalue()[:CAP],
                              "returncode": rc, "truncated": cut}) + "\n")
    replies.flush()
""".replace("{cap}", str(MAX_OUTPUT_BYTES // 4))


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
    """A warm Python process that runs OSWorld's pyautogui snippets (one at a time).

    ``source``: the worker program (default ``WORKER_SRC``; tests pass a misbehaving one).
    """

    def __init__(self, source: str | None = None) -> None:
        self.source = WORKER_SRC if source is None else source
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self._next_id = 0

    async def _ensure(self) -> asyncio.subprocess.Process:
        if self._proc is None or self._proc.returncode is not None:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                self.source,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
                start_new_session=True,
                limit=64 * 1024 * 1024,
            )
        return self._proc

    async def run(self, code: str, limit_s: float) -> tuple[int | None, str, str]:
        """(returncode, stdout, stderr); returncode None = past the limit (worker killed)."""
        return (await self.run_capped(code, limit_s))[:3]

    async def run_capped(self, code: str, limit_s: float) -> Ran:
        """``run``, and whether the worker cut an output at its cap."""
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
                return Ran(None, "", "")
            except (ConnectionError, OSError, ValueError) as e:  # ValueError: a line over limit
                self.kill()
                return Ran(1, "", f"pyautogui worker died: {e}")
            if not line:  # the snippet killed the worker (os._exit, a crash)
                self.kill()
                return Ran(1, "", "pyautogui worker exited while running the code")
            try:
                r = json.loads(line)
                ok = r["id"] == rid
            except (ValueError, KeyError, TypeError):
                ok = False
            if not ok:  # never hand back another call's reply: start a fresh worker
                self.kill()
                return Ran(1, "", f"pyautogui worker reply out of step (restarted): {line[:200]!r}")
            return Ran(int(r["returncode"]), r["output"], r["error"], bool(r.get("truncated")))

    def kill(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            kill_group(self._proc)
        self._proc = None
