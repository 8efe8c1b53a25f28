"""Where desktops come from: local Xvfb desktops, remote VMs, and a pool over either.

* :class:`LocalDesktop`: one Xvfb display (number picked by Xvfb itself via ``-displayfd``),
  openbox, and ``python -m envs.vm.server`` on a free loopback port (``--port 0``), with a fresh
  home directory copied from a template. ``reset()`` after an episode kills all three and
  recreates them, so every episode starts from the same state (the local stand-in for OSWorld's
  snapshot revert). Like OSWorld's VMs, the home has ``Desktop/``, ``Documents/`` and
  ``Downloads/``, and ``sudo`` takes the desktop's ``client_password`` (see :data:`SUDO_SHIM`).
* :class:`RemoteDesktop`: a server somebody else runs (a real OSWorld VM on port 5000, a cloud
  machine running our server). ``reset()`` checks it answers and calls the user's ``revert``
  hook if given (e.g. ``vmrun revertToSnapshot``); we cannot revert a machine we do not own.
* :class:`DesktopPool`: hands out desktops to episodes (least-used free one first), recreates a
  desktop whose episode hit a fault, and retires one that cannot be brought back, reporting it
  (``pool.report()``) instead of failing the whole run.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Protocol

from envs.docker.provider import DockerAPI
from envs.vm.client import VMClient, VMError, VMGoneError
from envs.vm.limits import DesktopLimits, warn_once

_REPO_ROOT = Path(__file__).resolve().parents[2]  # so the server imports this checkout's envs

XVFB_INSTALL_HINT = (
    "install the desktop packages: `make apt` (or apt-get install -y xvfb xdotool wmctrl "
    "x11-utils x11-xserver-utils openbox xterm nano)"
)


class Desktop(Protocol):
    """A desktop an episode runs on."""

    name: str
    client: VMClient

    async def start(self) -> None: ...

    async def reset(self) -> None:
        """Brings the desktop to its initial state for a new episode (may recreate it)."""
        ...

    async def recover(self) -> None:
        """Brings a desktop back after a fault (raises when it cannot)."""
        ...

    async def stop(self) -> None: ...


# LocalDesktop's ``sudo``: OSWorld's tasks run ``echo {CLIENT_PASSWORD} | sudo -S <cmd>`` and
# expect a user whose password sudo takes. A desktop runs as this process's own user and cannot
# give more rights than that user has, so the shim checks the password (-S: from stdin; else
# from the terminal, as sudo asks) and runs the command as that same user. On this project's
# machines that user is root, and the command gets root's rights as with real sudo.
SUDO_SHIM = r"""#!/bin/sh
want=@SHA256@
from_stdin=0
while [ $# -gt 0 ]; do
  case "$1" in
    -S|--stdin) from_stdin=1; shift ;;
    -k|-K|-E|-H|-n|-b|-i|-s|--preserve-env|--preserve-env=*|--reset-timestamp) shift ;;
    -u|-g|-p|-C|-D|--user|--group|--prompt) shift 2 ;;
    -u*|-g*|-p*|--user=*|--group=*|--prompt=*) shift ;;
    --) shift; break ;;
    -*) echo "sudo: unsupported option $1 (this desktop's sudo takes -S, -u, -E, -H, -k)" >&2
        exit 1 ;;
    *) break ;;
  esac
done
if [ $# -eq 0 ]; then echo "usage: sudo [-S] command [args...]" >&2; exit 1; fi
if [ $from_stdin = 1 ]; then
  IFS= read -r pw || [ -n "$pw" ] || pw=""
elif [ -t 0 ]; then
  printf '[sudo] password for %s: ' "$(id -un)" >&2
  stty -echo; IFS= read -r pw; stty echo; echo >&2
else
  echo "sudo: a terminal is required to read the password; use the -S option" >&2
  exit 1
fi
if [ "$(printf %s "$pw" | sha256sum | cut -d' ' -f1)" != "$want" ]; then
  echo "sudo: 1 incorrect password attempt" >&2
  exit 1
fi
exec "$@"
"""


# OSWorld's tasks name their files by absolute paths in the VM user's home (/home/user/...).
# A LocalDesktop's home is a fresh directory per desktop; everything its server starts sees it
# at /home/user as well, in a private mount namespace: a tmpfs over /home (the host's other
# homes are hidden, nothing on the host changes) with the desktop's home bound at /home/user.
# Root needs `unshare -m`; another user a user namespace that maps it to root (`-r`).
HOME_ALIAS_SCRIPT = (
    'set -e; mount -t tmpfs -o mode=755 cua-home "${CUA_ALIAS%/*}"; mkdir "$CUA_ALIAS"; '
    'mount --bind "$CUA_HOME" "$CUA_ALIAS"; exec "$@"'
)
_unshare_argv: list[str] | None = None


def _succeeds(argv: list[str]) -> bool:
    """Whether `argv` exits 0 within 10 s, quietly (a probe of what this machine allows)."""
    try:
        run = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return run.returncode == 0


def _home_alias_argv() -> list[str]:
    """The `unshare` prefix that gives the desktop's processes a private /home ([] where this
    machine allows no mount namespace: no unshare, no privilege, no user namespaces)."""
    global _unshare_argv
    if _unshare_argv is None:
        argv = ["unshare", "-m", "--propagation", "private"]
        if os.geteuid() != 0:
            argv.insert(1, "-r")
        ok = shutil.which("unshare") is not None and _succeeds(
            [*argv, "sh", "-c", "mount -t tmpfs cua-probe /home"]
        )
        _unshare_argv = argv if ok else []
    return list(_unshare_argv)


# OSWorld's Chrome tasks launch `google-chrome --remote-debugging-port=1337` and forward its
# DevTools port with `socat tcp-listen:9222,fork tcp:localhost:1337`. Where the machine has
# Debian's Chromium and no Chrome (or no socat), a LocalDesktop's bin holds stand-ins: Chromium
# with Chrome's profile directory (OSWorld reads ~/.config/google-chrome/Default/...), and a TCP
# forwarder for the one socat form OSWorld uses.
CHROME_SHIM = r"""#!/bin/sh
# Chromium refuses root without --no-sandbox (root here, or root in the desktop's namespace)
if [ "$(id -u)" = 0 ]; then set -- --no-sandbox "$@"; fi
exec @CHROMIUM@ --no-first-run --no-default-browser-check --password-store=basic \
  --user-data-dir="$HOME/.config/google-chrome" "$@"
"""
SOCAT_SHIM = r"""#!/usr/bin/env python3
# socat's one form in OSWorld's tasks: socat tcp-listen:PORT[,fork,...] tcp:HOST:PORT
import socket, sys, threading
if len(sys.argv) != 3 or not sys.argv[1].lower().startswith("tcp-listen:") or not (
    sys.argv[2].lower().startswith("tcp:")
):
    sys.exit("socat (this desktop's stand-in) takes: tcp-listen:PORT[,fork] tcp:HOST:PORT")
port = int(sys.argv[1].split(":", 1)[1].split(",")[0])
host, to = sys.argv[2].split(":", 1)[1].rsplit(":", 1)
def pipe(a, b):
    try:
        while data := a.recv(65536):
            b.sendall(data)
    except OSError:
        pass
    finally:
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
srv = socket.create_server(("127.0.0.1", port))
while True:
    c, _ = srv.accept()
    try:
        u = socket.create_connection((host, int(to)), timeout=10)
    except OSError:
        c.close()
        continue
    u.settimeout(None)
    threading.Thread(target=pipe, args=(c, u), daemon=True).start()
    threading.Thread(target=pipe, args=(u, c), daemon=True).start()
"""


# Debian builds VLC without --enable-run-as-root: as root (a desktop of a root process) it prints
# "VLC is not supposed to be run as root" and exits. The desktop's `vlc` then runs the real one in
# a user namespace as uid 1000, mapped back to root, so it starts and the desktop's files (its
# ~/.config/vlc/vlcrc, which OSWorld's VLC tasks read) stay the desktop's.
VLC_SHIM = r"""#!/bin/sh
exec unshare --user --map-user=1000 --map-group=1000 @VLC@ "$@"
"""


@functools.cache
def _user_namespace_ok() -> bool:
    """Whether `unshare --user --map-user=1000` works here (util-linux >= 2.38, userns allowed)."""
    return _succeeds(["unshare", "--user", "--map-user=1000", "--map-group=1000", "true"])


def _write_app_shims(bin_dir: Path) -> None:
    """Stand-ins for OSWorld's apps where the real ones are missing or refuse to run: Chrome and
    socat for its Chrome tasks, VLC as root."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium and not (shutil.which("google-chrome") or shutil.which("google-chrome-stable")):
        text = CHROME_SHIM.replace("@CHROMIUM@", chromium)
        for name in ("google-chrome", "google-chrome-stable"):
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
    if not shutil.which("socat"):
        (bin_dir / "socat").write_text(SOCAT_SHIM)
        (bin_dir / "socat").chmod(0o755)
    vlc = shutil.which("vlc")
    if vlc and os.geteuid() == 0 and _user_namespace_ok():
        (bin_dir / "vlc").write_text(VLC_SHIM.replace("@VLC@", vlc))
        (bin_dir / "vlc").chmod(0o755)


# OSWorld's images run LibreOffice with a used profile: its tasks' postconfig saves with ctrl+s
# alone (no Enter for the "Keep current format?" dialog), and its screens show no first-run Tip
# of the Day or what's-new bar. A fresh LocalDesktop home gets the same settings wherever
# LibreOffice is installed (``make apt-office``); a template_home that has a profile keeps its own.
LIBREOFFICE_PROFILE = """<?xml version="1.0" encoding="UTF-8"?>
<oor:items xmlns:oor="http://openoffice.org/2001/registry" \
xmlns:xs="http://www.w3.org/2001/XMLSchema" xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance">
<item oor:path="/org.openoffice.Office.Common/Save/Document">\
<prop oor:name="WarnAlienFormat" oor:op="fuse"><value>false</value></prop></item>
<item oor:path="/org.openoffice.Office.Common/Misc">\
<prop oor:name="ShowTipOfTheDay" oor:op="fuse"><value>false</value></prop></item>
<item oor:path="/org.openoffice.Office.Common/Misc">\
<prop oor:name="FirstRun" oor:op="fuse"><value>false</value></prop></item>
<item oor:path="/org.openoffice.Setup/Product">\
<prop oor:name="ooSetupLastVersion" oor:op="fuse"><value>@VERSION@</value></prop></item>
</oor:items>
"""
LIBREOFFICE_PROFILE_PATH = ".config/libreoffice/4/user/registrymodifications.xcu"


@functools.cache
def libreoffice_version() -> str | None:
    """This machine's LibreOffice major.minor (``soffice --version``), None when absent."""
    soffice = shutil.which("soffice")
    if soffice is None:
        return None
    try:
        out = subprocess.run(
            [soffice, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"\b(\d+\.\d+)\.\d", out)
    return m.group(1) if m else None


# VLC's first start asks about its privacy and network policy in a dialog over the player;
# OSWorld's image has answered it.
VLC_PROFILE = "[qt]\nqt-privacy-ask=0\n"


def _seed_app_profiles(home: Path) -> None:
    """The app settings OSWorld's images have, for the apps installed here (LIBREOFFICE_PROFILE,
    VLC_PROFILE); a template_home's own files are kept."""
    version = libreoffice_version()
    profile = home / LIBREOFFICE_PROFILE_PATH
    if version is not None and not profile.exists():
        profile.parent.mkdir(parents=True, exist_ok=True)
        profile.write_text(LIBREOFFICE_PROFILE.replace("@VERSION@", version))
    vlcrc = home / ".config" / "vlc" / "vlcrc"
    if shutil.which("vlc") and not vlcrc.exists():
        vlcrc.parent.mkdir(parents=True, exist_ok=True)
        vlcrc.write_text(VLC_PROFILE)


def missing_programs(
    programs: Iterable[str] = ("Xvfb", "openbox", "xdotool", "wmctrl"),
) -> list[str]:
    """The programs LocalDesktop needs that are not on PATH."""
    return [p for p in programs if shutil.which(p) is None]


def _kill(proc: subprocess.Popen | None, sig: int = signal.SIGTERM) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


async def _reap(proc: subprocess.Popen | None, timeout: float = 3.0) -> None:
    if proc is None:
        return
    _kill(proc, signal.SIGTERM)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while proc.poll() is None and loop.time() < deadline:
        await asyncio.sleep(0.02)
    if proc.poll() is None:
        _kill(proc, signal.SIGKILL)
        await asyncio.to_thread(proc.wait)


class LocalDesktop:
    """Xvfb + openbox + our server on this machine, one per environment.

    Args:
      width, height: the screen size (Xvfb geometry, 24-bit colour).
      template_home: a directory copied to a fresh home for every (re)creation; None = empty.
      token: bearer token for the server; None: a random one (the server refuses requests
        without a token even on loopback, so a web page in a browser cannot drive the desktop).
      exec_limit_s: the server's command run-time cap.
      window_manager: the WM command (None = no WM).
      start_timeout: seconds to wait for each process to come up.
      warm_pyautogui: the server runs pyautogui actions in a warm worker (False: a new
        ``python -c`` process per action, exactly like OSWorld's server).
      memory_mb: a cap on the address space of the server and of every process it starts
        (the apps, the commands of run_shell / execute; ``RLIMIT_AS``, inherited): a runaway
        command in one desktop fails with out-of-memory instead of taking the machine's
        memory from the other desktops. None: no cap.
      client_password: the password this desktop's ``sudo`` takes (OSWorld's
        ``{CLIENT_PASSWORD}``; ``VMEnv`` fills the placeholder with it).
      max_processes, cpus: the desktop's process (task) budget and CPU-core quota, in a cgroup
        of its own where the machine allows one (``envs.vm.limits``; ``limits_mode`` says which
        applied); everything in it is killed when the desktop stops or resets, background
        processes included. A fork bomb then fails to fork inside its desktop; a busy loop
        gets at most ``cpus`` cores and dies with its episode. None: no cap.
      command_cpu_s: the CPU seconds each command the server starts may use (the server's
        ``--command-cpu-s``, ``RLIMIT_CPU``; works without a cgroup). None: no cap.
      host: the address the desktop's server binds (default loopback; another, e.g. this
        machine's address for a trainer elsewhere, as a desktop in a Ray actor serves).
      home_alias: where the server and everything it starts also see the desktop's home, and
        their $HOME (OSWorld's "/home/user": its tasks' paths, a model typing them). A private
        mount namespace per desktop (``HOME_ALIAS_SCRIPT``), so parallel desktops each have
        their own; where the machine allows none (``home_alias_active`` False, a warning),
        $HOME is the desktop's own directory and /home/user paths do not resolve. None: off.
    """

    def __init__(
        self,
        width: int = 1280,
        height: int = 720,
        *,
        template_home: str | Path | None = None,
        token: str | None = None,
        exec_limit_s: float = 120.0,
        window_manager: Sequence[str] | None = ("openbox",),
        start_timeout: float = 30.0,
        name: str | None = None,
        warm_pyautogui: bool = True,
        memory_mb: int | None = None,
        client_password: str = "password",
        max_processes: int | None = 4096,
        cpus: float | None = None,
        command_cpu_s: float | None = None,
        home_alias: str | None = "/home/user",
        host: str = "127.0.0.1",
    ):
        if width < 64 or height < 64:
            raise ValueError(f"LocalDesktop screen {width}x{height} is too small (min 64x64)")
        self.width, self.height = int(width), int(height)
        self.template_home = Path(template_home) if template_home else None
        if self.template_home is not None and not self.template_home.is_dir():
            raise ValueError(f"template_home {self.template_home} is not a directory")
        self.token = token or secrets.token_urlsafe(24)
        self.exec_limit_s = exec_limit_s
        self.window_manager = list(window_manager) if window_manager else None
        self.start_timeout = start_timeout
        self.warm_pyautogui = warm_pyautogui
        if memory_mb is not None and memory_mb < 256:
            raise ValueError(f"LocalDesktop memory_mb must be >= 256 (MiB), got {memory_mb}")
        self.memory_mb = memory_mb
        self.client_password = client_password
        if command_cpu_s is not None and not 1 <= command_cpu_s <= 86400:
            raise ValueError(
                f"LocalDesktop command_cpu_s must be in [1, 86400], got {command_cpu_s}"
            )
        self.max_processes, self.cpus, self.command_cpu_s = max_processes, cpus, command_cpu_s
        DesktopLimits("check", max_processes=max_processes, cpus=cpus)  # bad values fail here
        self._limits: DesktopLimits | None = None
        if home_alias is not None:
            parts = Path(home_alias).parts
            if len(parts) != 3 or parts[:2] != ("/", "home") or parts[2] in (".", ".."):
                raise ValueError(f"LocalDesktop home_alias must be /home/NAME, got {home_alias!r}")
        self.home_alias = home_alias
        self.host = host
        self.home_alias_active = False  # set by start()
        self.limits_mode = "none"  # set by start(): "cgroup v2" | "cgroup v1" | "rlimit" | "none"
        self._name = name
        self.display: str | None = None
        self.home: Path | None = None
        self.tmp: Path | None = None
        self.url: str | None = None
        self.client: VMClient = VMClient("http://127.0.0.1:1")  # replaced by start()
        self._xvfb: subprocess.Popen | None = None
        self._wm: subprocess.Popen | None = None
        self._server: subprocess.Popen | None = None
        self._root: Path | None = None
        self._used = False
        self.restarts = 0

    @property
    def name(self) -> str:
        return self._name or f"local{self.display or ''}"

    @property
    def server_pid(self) -> int | None:
        return self._server.pid if self._server is not None else None

    def __repr__(self) -> str:
        return f"LocalDesktop(display={self.display!r}, url={self.url!r})"

    async def __aenter__(self) -> LocalDesktop:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def alive(self) -> bool:
        return all(p is not None and p.poll() is None for p in (self._xvfb, self._server))

    async def start(self) -> None:
        """Starts Xvfb, the window manager and the server; returns when the server answers."""
        missing = missing_programs(["Xvfb"] + (self.window_manager or [])[:1])
        if missing:
            raise RuntimeError(f"LocalDesktop needs {', '.join(missing)}: {XVFB_INSTALL_HINT}")
        self._root = Path(tempfile.mkdtemp(prefix="cua-desktop-"))
        self.home = self._root / "home"
        if self.template_home is not None:
            shutil.copytree(self.template_home, self.home, symlinks=True)
        else:
            self.home.mkdir()
        for d in ("Desktop", "Documents", "Downloads"):  # OSWorld's tasks assume them
            (self.home / d).mkdir(exist_ok=True)
        _seed_app_profiles(self.home)
        bin_dir = self._root / "bin"
        bin_dir.mkdir()
        digest = hashlib.sha256(self.client_password.encode()).hexdigest()
        (bin_dir / "sudo").write_text(SUDO_SHIM.replace("@SHA256@", digest))
        (bin_dir / "sudo").chmod(0o755)
        _write_app_shims(bin_dir)
        self.tmp = self._root / "tmp"  # a private /tmp: parallel desktops never see each other
        self.tmp.mkdir()
        self._limits = DesktopLimits(
            self._root.name, max_processes=self.max_processes, cpus=self.cpus
        )
        try:
            self.limits_mode = await asyncio.to_thread(self._limits.create)
            await self._start_xvfb()
            env = self._child_env()
            if self.window_manager:
                self._wm = subprocess.Popen(
                    self.window_manager,
                    env=env,
                    cwd=self.home,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                    preexec_fn=self._limits.preexec(),
                )
            await self._start_server(env)
            if self.window_manager:
                await self._wait_wm()
        except BaseException:
            await self.stop()
            raise
        self._used = False

    async def _start_xvfb(self) -> None:
        r, w = os.pipe()
        try:
            self._xvfb = subprocess.Popen(
                [
                    "Xvfb",
                    "-displayfd",
                    str(w),
                    "-screen",
                    "0",
                    f"{self.width}x{self.height}x24",
                    "-nolisten",
                    "tcp",
                    "-noreset",
                ],
                pass_fds=(w,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=self._limits.preexec() if self._limits else None,
            )
        finally:
            os.close(w)
        # Xvfb writes the display number it bound once it accepts connections.
        try:
            num = await asyncio.wait_for(asyncio.to_thread(_read_line_fd, r), self.start_timeout)
        except TimeoutError as e:
            raise RuntimeError(f"Xvfb did not start within {self.start_timeout:g} s") from e
        finally:
            os.close(r)
        if not num.strip().isdigit():
            err = self._xvfb.stderr.read().decode(errors="replace") if self._xvfb.stderr else ""
            raise RuntimeError(f"Xvfb failed to start: {err[-500:]}")
        self.display = f":{num.strip()}"
        # Xvfb's default keymap has an extra key (keycode 94, "<>" on ISO keyboards) whose
        # unshifted symbol is '<'. pyautogui finds '<' there, then holds shift for it as it does
        # for every shifted character, and types '>'. Mapping that key to '<' in both levels makes
        # pyautogui.typewrite('<') type '<' (its '>' already comes from shift+period).
        if shutil.which("xmodmap"):
            await asyncio.to_thread(
                subprocess.run,
                ["xmodmap", "-e", "keycode 94 = less less"],
                env={**os.environ, "DISPLAY": self.display},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=10,
                check=False,
            )

    def _child_env(self) -> dict[str, str]:
        assert self.home is not None, "start() makes the home first"
        env = dict(os.environ)
        env.update(
            DISPLAY=self.display or "",
            HOME=str(self.home),
            TMPDIR=str(self.tmp),
            # the desktop's own bin (its sudo), then a `python` with pyautogui (OSWorld's action
            # command runs `python`)
            PATH=os.pathsep.join(
                [
                    str(self.home.parent / "bin"),
                    os.path.dirname(sys.executable),
                    env.get("PATH", ""),
                ]
            ),
            PYTHONPATH=str(_REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        )
        env.pop("XAUTHORITY", None)
        env.pop("WAYLAND_DISPLAY", None)
        return env

    async def _start_server(self, env: dict[str, str]) -> None:
        cmd = [
            sys.executable,
            "-m",
            "envs.vm.server",
            "--host",
            self.host,
            "--port",
            "0",
            "--exec-limit",
            str(self.exec_limit_s),
            "--display",
            self.display or "",
            "--allow-root",
            str(self.home),
            "--allow-root",
            str(self.tmp),
        ]
        if not self.warm_pyautogui:
            cmd.append("--no-warm-pyautogui")
        if self.command_cpu_s is not None:
            cmd += ["--command-cpu-s", str(self.command_cpu_s)]
        env = {**env, "CUA_VM_TOKEN": self.token}  # not on the command line (ps shows it)
        prefix = _home_alias_argv() if self.home_alias else []
        self.home_alias_active = bool(prefix)
        if prefix:
            cmd = [*prefix, "sh", "-c", HOME_ALIAS_SCRIPT, "sh", *cmd, "--allow-root"]
            cmd.append(self.home_alias)
            env.update(HOME=self.home_alias, CUA_HOME=str(self.home), CUA_ALIAS=self.home_alias)
        elif self.home_alias:
            warn_once(
                f"LocalDesktop: this machine allows no mount namespace (unshare), so "
                f"{self.home_alias} paths of OSWorld's tasks do not resolve on local desktops "
                "(their home is a directory of their own)"
            )
        self._server = subprocess.Popen(
            cmd,
            env=env,
            cwd=self.home,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=self._limits.preexec(memory_mb=self.memory_mb) if self._limits else None,
        )
        try:
            line = await asyncio.wait_for(
                asyncio.to_thread(_read_serving_line, self._server), self.start_timeout
            )
        except TimeoutError as e:
            raise RuntimeError(
                f"the VM server did not start within {self.start_timeout:g} s"
            ) from e
        if line is None:
            raise RuntimeError(f"the VM server exited during start-up:\n{self._server_output()}")
        self.url = line
        old = self.client
        self.client = VMClient(self.url, token=self.token, timeout=60.0, retries=2, backoff=0.2)
        await old.close()
        # Drain the server's output so a chatty server never blocks on a full pipe.
        asyncio.get_running_loop().run_in_executor(None, _drain, self._server)

    def _server_output(self) -> str:
        try:
            return self._server.stdout.read().decode(errors="replace")[-2000:]
        except Exception:
            return ""

    async def _wait_wm(self) -> None:
        # A window manager sets _NET_SUPPORTING_WM_CHECK on the root once it manages windows;
        # wmctrl -m succeeds from then on. Windows created earlier would not be decorated/placed.
        for _ in range(int(self.start_timeout / 0.05)):
            r = await self.client.execute(["wmctrl", "-m"], timeout=5)
            if r.get("returncode") == 0:
                return
            await asyncio.sleep(0.05)
        raise RuntimeError(f"window manager {self.window_manager} did not start")

    async def stop(self) -> None:
        """Kills the server, the WM and Xvfb (X clients die with Xvfb) and removes the home."""
        await self.client.close()
        for p in (self._server, self._wm, self._xvfb):
            await _reap(p)
        self._server = self._wm = self._xvfb = None
        if self._limits is not None:  # what left the process groups (setsid, nohup ... &)
            await asyncio.to_thread(self._limits.remove)
            self._limits = None
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None
        self.url = None

    async def restart(self) -> None:
        """Kill and recreate everything from the template home."""
        await self.stop()
        await self.start()
        self.restarts += 1

    async def recover(self) -> None:
        """After a fault: recreate now, so the next episode finds a fresh desktop."""
        await self.restart()

    async def reset(self) -> None:
        """Recreates the desktop unless it is fresh (no episode has run on it since start)."""
        if self._used or not self.alive():
            await self.restart()
        self._used = True


class RemoteDesktop:
    """A server at ``url`` run by somebody else (an OSWorld VM, a cloud machine).

    ``revert``: optional ``async (desktop) -> None`` that restores the machine's initial state
    (a hypervisor snapshot revert); without it, reset() only checks the server answers and the
    task's setup steps are all that prepare the episode.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        revert: Callable[[RemoteDesktop], Awaitable[None]] | None = None,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = 2.0,
        ready_timeout: float = 60.0,
    ):
        self.url = url.rstrip("/")
        self.name = self.url
        self.client = VMClient(
            self.url, token=token, timeout=timeout, retries=retries, backoff=backoff
        )
        self.revert = revert
        self.ready_timeout = ready_timeout
        self.restarts = 0  # reverts run (the desktops' common reset count)

    def __repr__(self) -> str:
        return f"RemoteDesktop({self.url!r})"

    async def start(self) -> None:
        await self.client.wait_ready(self.ready_timeout)

    async def reset(self) -> None:
        if self.revert is not None:
            await self.revert(self)
            self.restarts += 1
            # a snapshot revert or a restart drops the connections the client keeps alive
            # (QEMU's loadvm restores its user network as of the snapshot: a request on such a
            # connection hangs until its timeout); the next request opens a fresh one
            await self.client.close()
        await self.client.wait_ready(self.ready_timeout)

    async def recover(self) -> None:
        await self.reset()

    async def stop(self) -> None:
        await self.client.close()


def Remote(endpoints: Sequence[str | tuple[str, str | None]], **kw) -> list[RemoteDesktop]:  # noqa: N802
    """RemoteDesktops for a list of ``"http://host:port"`` or ``(url, token)`` endpoints."""
    out = []
    for e in endpoints:
        url, token = (e, None) if isinstance(e, str) else (e[0], e[1])
        out.append(RemoteDesktop(url, token, **kw))
    if not out:
        raise ValueError("Remote(...) needs at least one endpoint URL")
    return out


class PoolExhaustedError(VMError):
    """Every desktop of a pool has been retired."""


@dataclasses.dataclass
class _Slot:
    desktop: Desktop
    busy: bool = False
    episodes: int = 0
    faults: int = 0


class DesktopPool:
    """Spreads episodes over desktops; recreates a faulty one; retires a dead one.

    ``acquire()`` waits for a free desktop (the least-used first), ``release(d, fault=None)``
    gives it back; a ``fault`` (why the episode broke) makes the pool try ``d.reset()`` right
    away and retire ``d`` if that fails. ``report()`` says what was retired and why.
    """

    def __init__(self, desktops: Sequence[Desktop], max_faults: int = 3):
        if not desktops:
            raise ValueError("DesktopPool needs at least one desktop")
        self._slots = [_Slot(d) for d in desktops]
        self.max_faults = max_faults
        self.retired: dict[str, str] = {}
        self._cond: asyncio.Condition | None = None

    @property
    def desktops(self) -> list[Desktop]:
        return [s.desktop for s in self._slots]

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def start(self) -> None:
        """Starts every desktop concurrently; one that fails to start is retired."""
        results = await asyncio.gather(
            *(s.desktop.start() for s in self._slots), return_exceptions=True
        )
        for s, r in zip(self._slots, results, strict=True):
            if isinstance(r, BaseException):
                self._retire(s, f"failed to start: {r}")
        if not self._live():
            raise PoolExhaustedError(f"no desktop could start: {self.retired}")

    async def stop(self) -> None:
        await asyncio.gather(*(s.desktop.stop() for s in self._slots), return_exceptions=True)

    async def __aenter__(self) -> DesktopPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _live(self) -> list[_Slot]:
        return [s for s in self._slots if s.desktop.name not in self.retired]

    def _retire(self, slot: _Slot, reason: str) -> None:
        self.retired[slot.desktop.name] = reason
        print(f"[DesktopPool] retired {slot.desktop.name}: {reason}", file=sys.stderr, flush=True)

    async def acquire(self) -> Desktop:
        cond = self._condition()
        async with cond:
            while True:
                live = self._live()
                if not live:
                    raise PoolExhaustedError(
                        f"all {len(self._slots)} desktops are retired: {self.retired}"
                    )
                free = [s for s in live if not s.busy]
                if free:
                    slot = min(free, key=lambda s: s.episodes)
                    slot.busy = True
                    slot.episodes += 1
                    return slot.desktop
                await cond.wait()

    async def release(self, desktop: Desktop, fault: str | None = None) -> None:
        slot = next(s for s in self._slots if s.desktop is desktop)
        if fault is not None:
            slot.faults += 1
            try:
                if slot.faults > self.max_faults:
                    raise VMError(f"{slot.faults} faults")
                await desktop.recover()
            except (VMError, RuntimeError, OSError) as e:
                self._retire(slot, f"{fault}; recovery failed: {e}")
        cond = self._condition()
        async with cond:
            slot.busy = False
            cond.notify_all()

    @contextlib.asynccontextmanager
    async def lease(self):
        """``async with pool.lease() as desktop:`` (a VMGoneError inside counts as a fault)."""
        d = await self.acquire()
        fault = None
        try:
            yield d
        except VMGoneError as e:
            fault = str(e)
            raise
        finally:
            await self.release(d, fault)

    def metrics(self) -> dict[str, float]:
        """What the trainer logs each step under ``rollout/``: ``env_hosts`` (desktops not
        retired), ``env_hosts_down`` (retired), ``env_resets`` (desktops recreated, restarted
        or reverted so far: before an episode that follows another, and after a fault)."""
        return {
            "env_hosts": float(len(self._live())),
            "env_hosts_down": float(len(self.retired)),
            "env_resets": float(sum(getattr(s.desktop, "restarts", 0) for s in self._slots)),
        }

    def report(self) -> dict[str, object]:
        return {
            "desktops": len(self._slots),
            "live": len(self._live()),
            "retired": dict(self.retired),
            "episodes": {s.desktop.name: s.episodes for s in self._slots},
            "faults": {s.desktop.name: s.faults for s in self._slots},
        }


def _read_line_fd(fd: int) -> str:
    buf = b""
    while not buf.endswith(b"\n"):
        c = os.read(fd, 64)
        if not c:
            break
        buf += c
    return buf.decode(errors="replace")


def _read_serving_line(proc: subprocess.Popen) -> str | None:
    """The URL from the server's ``serving on URL`` line, or None if it exited first."""
    assert proc.stdout is not None
    for raw in iter(proc.stdout.readline, b""):
        line = raw.decode(errors="replace").strip()
        if line.startswith("serving on "):
            return line.removeprefix("serving on ")
    return None


def _drain(proc: subprocess.Popen) -> None:
    try:
        assert proc.stdout is not None
        for _ in iter(lambda: proc.stdout.read(4096), b""):
            pass
    except (OSError, ValueError):
        pass


# ------------------------------------------------------------------------------------------
# Reset between episodes: a revert hook per provider, chosen by a config string
# ------------------------------------------------------------------------------------------

REVERT_KINDS = ("libvirt", "qemu", "docker", "cmd")
RevertHook = Callable[[RemoteDesktop], Awaitable[None]]


def revert_hook(spec: str, index: int = 0) -> RevertHook | None:
    """The ``revert`` of a remote desktop (restore its initial state before each episode; the
    task's own OSWorld setup steps run after it), from a config string (``env.vm_revert``):

      ""                            none: setup steps are all the reset
      "libvirt:DOMAIN@SNAPSHOT"     ``virsh snapshot-revert DOMAIN SNAPSHOT --running``
      "qemu:MONITOR_SOCKET@SNAPSHOT" QEMU's human monitor on a unix socket: ``loadvm SNAPSHOT``
      "docker:CONTAINER"            container restart (Docker Engine API, $DOCKER_HOST or
                                    /var/run/docker.sock)
      "cmd:SHELL COMMAND"           any command (exit status 0 = reverted)

    ``{index}`` (the desktop's position in ``env.vm_endpoints``), ``{url}``, ``{host}`` and
    ``{port}`` in the string are filled in per desktop, e.g. ``"libvirt:osworld-{index}@init"``.
    """
    spec = (spec or "").strip()
    if not spec:
        return None
    kind, sep, arg = spec.partition(":")
    if not sep or kind not in REVERT_KINDS or not arg:
        raise ValueError(
            f"env.vm_revert={spec!r}: expected KIND:ARGUMENT with KIND one of "
            f"{', '.join(REVERT_KINDS)} (e.g. 'libvirt:osworld-{{index}}@init')"
        )

    def fill(d: RemoteDesktop) -> str:
        from urllib.parse import urlsplit  # noqa: PLC0415

        u = urlsplit(d.url)
        return arg.format(index=index, url=d.url, host=u.hostname or "", port=u.port or "")

    if kind in ("libvirt", "qemu") and "@" not in arg:
        raise ValueError(f"env.vm_revert={spec!r}: {kind} needs TARGET@SNAPSHOT")

    async def revert(d: RemoteDesktop) -> None:
        a = fill(d)
        if kind == "libvirt":
            dom, snap = a.rsplit("@", 1)
            await run_revert_command(["virsh", "snapshot-revert", dom, snap, "--running"], d)
        elif kind == "qemu":
            sock, snap = a.rsplit("@", 1)
            await qemu_monitor(sock, f"loadvm {snap}")
        elif kind == "docker":
            async with DockerAPI() as api:
                await api.restart(a)
        else:
            await run_revert_command(a, d)

    return revert


async def run_revert_command(cmd: str | Sequence[str], d: RemoteDesktop) -> None:
    """Runs a revert command here (not in the VM); VMError naming it when it fails."""
    if isinstance(cmd, str):
        proc = await asyncio.create_subprocess_shell(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
    else:
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise VMError(
            f"reverting {d.url} failed: {cmd!r} exited {proc.returncode}: "
            f"{out.decode(errors='replace')[-500:]}"
        )


async def qemu_monitor(socket_path: str, command: str, timeout: float = 120.0) -> str:
    """Sends one command to QEMU's human monitor (``-monitor unix:PATH,server,nowait``) and
    returns its output; VMError when it reports an error."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(socket_path), 10)
    except (OSError, TimeoutError) as e:
        raise VMError(f"QEMU monitor {socket_path}: cannot connect ({e})") from e
    try:
        await asyncio.wait_for(reader.readuntil(b"(qemu) "), 10)  # the banner and prompt
        writer.write(command.encode() + b"\n")
        await writer.drain()
        out = await asyncio.wait_for(reader.readuntil(b"(qemu) "), timeout)
    except (OSError, TimeoutError, asyncio.IncompleteReadError) as e:
        raise VMError(f"QEMU monitor {socket_path}: {command!r} got no answer ({e})") from e
    finally:
        writer.close()
    text = out.decode(errors="replace").removesuffix("(qemu) ")
    # the monitor echoes the command line first; errors read "Error: ..." / "... not found"
    body = text.split("\n", 1)[1] if "\n" in text else ""
    if "rror" in body or "not found" in body:
        raise VMError(f"QEMU monitor {socket_path}: {command!r}: {body.strip()}")
    return body
