"""VMEnv: the ``cua_jax.env_api.Env`` contract over an OSWorld-protocol VM.

Acting works exactly like OSWorld's client in the ``pyautogui`` action space: every action
becomes pyautogui code run in the VM as
``["python", "-c", "import pyautogui; import time; pyautogui.FAILSAFE = False; <code>"]`` over
``/execute``; then (after an optional pause) a ``/screenshot`` (and ``/accessibility`` when asked)
is the next observation. OSWorld's ``computer_13`` dicts (``{"action_type": "CLICK",
"parameters": {...}}``) are accepted too and translated the way OSWorld translates them.

Episodes::

    pool = DesktopPool([LocalDesktop(800, 600) for _ in range(4)])
    async with pool, VMEnv(pool) as env:
        obs = await env.reset(task)        # task.spec is an OSWorld task JSON
        res = await env.step(Click(100, 200))
        score = await env.evaluate()

Faults (the VM's server dies, a request times out) never raise out of ``step``: the episode ends
with ``done=True`` and ``info["error"]`` naming the VM; the next ``reset`` hands the desktop back
to the pool as faulty (which recreates or retires it) and takes another.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import math
import posixpath
import re
import shutil
import tempfile
import time
import weakref
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
from absl import logging

from cua_jax.actions import (
    API_ACTION_TYPES,
    API_TOOLS,
    PYAUTOGUI_KEY_NAMES,
    VM_API,
    Action,
    Answer,
    Click,
    CoordinateSpace,
    Done,
    Drag,
    Fail,
    InvalidAction,
    Key,
    KeyDown,
    KeyUp,
    MouseDown,
    MouseUp,
    Move,
    OpenApp,
    PyAutoGUI,
    RunShell,
    Scroll,
    SetCell,
    TypeText,
    Wait,
    WriteFile,
    api_refusal,
    check_api_names,
    clamp_scroll,
    normalize_key,
)
from cua_jax.env_api import (
    INFO_ANSWER,
    INFO_API_RESULT,
    INFO_DONE_REASON,
    INFO_ERROR,
    INFO_INVALID_ACTION,
    INFO_TIMING,
    EnvError,
    Observation,
    StepResult,
    Task,
)
from envs.screenshots import decode_screenshot
from envs.vm import osworld
from envs.vm.client import VMClient, VMError, VMFileNotFoundError
from envs.vm.osworld_setup import DEFAULT_CLIENT_PASSWORD
from envs.vm.providers import Desktop, DesktopPool

# Setup steps that start or show a window: the reset's screenshot waits for it to be drawn
# (`VMEnv._settle`). A screen is still when under STILL_SHARE of its pixels changed between two
# screenshots SETTLE_EVERY_S apart (a blinking text cursor is a few hundred pixels).
WINDOW_STEPS = frozenset({"launch", "open", "chrome_open_tabs", "activate_window"})
STILL_SHARE = 0.002
SETTLE_EVERY_S = 0.2


def _key(k: str) -> str:
    """Our canonical key name -> pyautogui's."""
    return PYAUTOGUI_KEY_NAMES.get(k, k)


def _n(v: float) -> str:
    """Coordinates as ints (pyautogui rounds anyway; ints keep the code readable)."""
    return str(int(round(v)))


def _clicks(v: float) -> int:
    return int(round(clamp_scroll(v)))


def action_to_pyautogui(action: Action) -> str | None:
    """pyautogui code for an action, or None for actions that run nothing in the VM."""
    match action:
        case Click(x, y, button, count):
            at = f"{_n(x)}, {_n(y)}, " if x is not None and y is not None else ""
            return f"pyautogui.click({at}clicks={int(count)}, button={button!r})"
        case Move(x, y):
            return f"pyautogui.moveTo({_n(x)}, {_n(y)})"
        case Drag(x, y, sx, sy):
            pre = (
                f"pyautogui.moveTo({_n(sx)}, {_n(sy)}); "
                if sx is not None and sy is not None
                else ""
            )
            # A short duration: X apps need intermediate motion events to see a drag.
            return pre + f"pyautogui.dragTo({_n(x)}, {_n(y)}, duration=0.2, button='left')"
        case TypeText(text):
            if text.isascii():
                return f"pyautogui.typewrite({text!r})"
            # pyautogui.typewrite silently skips characters it has no key for ('é', '→');
            # xdotool types any character. Without xdotool in the VM this fails (returncode 1),
            # which step() reports as invalid-action feedback.
            # xdotool types a character the keymap lacks by remapping a spare keycode for it;
            # with 12 ms between keys an app under load sometimes read the event after the
            # remap was undone and dropped the character (1 in 6 test runs); 50 ms: 0 in 10.
            argv = ["xdotool", "type", "--delay", "50", "--", text]
            return f"import subprocess; subprocess.run({argv!r}, check=True)"
        case Key(keys):
            if len(keys) == 1:
                return f"pyautogui.press({_key(keys[0])!r})"
            return "pyautogui.hotkey(" + ", ".join(repr(_key(k)) for k in keys) + ")"
        case MouseDown(x, y, button) | MouseUp(x, y, button):
            fn = "mouseDown" if isinstance(action, MouseDown) else "mouseUp"
            at = f"{_n(x)}, {_n(y)}, " if x is not None and y is not None else ""
            return f"pyautogui.{fn}({at}button={button!r})"
        case KeyDown(key) | KeyUp(key):
            fn = "keyDown" if isinstance(action, KeyDown) else "keyUp"
            return f"pyautogui.{fn}({_key(key)!r})"
        case Scroll(x, y, dx, dy):
            at = f", x={_n(x)}, y={_n(y)}" if x is not None and y is not None else ""
            code = []
            # X scrolls one wheel event per click: capped (actions.MAX_SCROLL_NOTCHES).
            if dy:  # ours: +dy scrolls down; pyautogui: +clicks scrolls up
                code.append(f"pyautogui.scroll({_clicks(-dy)}{at})")
            if dx:
                code.append(f"pyautogui.hscroll({_clicks(dx)}{at})")
            return "; ".join(code) or None
    return None


def _finite(v: Any) -> float:
    """float(v), or ValueError for NaN / infinity (they would crash the pyautogui code later)."""
    f = float(v)
    if not math.isfinite(f):
        raise ValueError(f"{v!r} is not a finite number")
    return f


def computer13_to_action(d: dict[str, Any]) -> Action:
    """An OSWorld ``computer_13`` dict -> a typed action. Malformed -> InvalidAction."""
    raw = repr(d)[:300]
    if not isinstance(d, dict) or "action_type" not in d:
        return InvalidAction(raw, "a computer_13 action is {'action_type': ..., 'parameters': {}}")
    t = str(d["action_type"]).upper()
    p = d.get("parameters") or {}
    if not isinstance(p, dict):
        return InvalidAction(raw, "parameters must be an object")
    xy = (p.get("x"), p.get("y"))
    has_xy = xy[0] is not None and xy[1] is not None
    try:
        if t == "MOVE_TO":
            return (
                Move(_finite(p["x"]), _finite(p["y"]))
                if has_xy
                else InvalidAction(raw, "MOVE_TO needs x, y")
            )
        if t == "CLICK":
            return Click(
                _finite(xy[0]) if has_xy else None,
                _finite(xy[1]) if has_xy else None,
                p.get("button", "left"),
                int(p.get("num_clicks", 1)),
            )
        if t in ("RIGHT_CLICK", "DOUBLE_CLICK"):
            x, y = (_finite(xy[0]), _finite(xy[1])) if has_xy else (None, None)
            return Click(x, y, "right", 1) if t == "RIGHT_CLICK" else Click(x, y, "left", 2)
        if t == "DRAG_TO":
            return Drag(_finite(p["x"]), _finite(p["y"]))
        if t == "SCROLL":
            return Scroll(None, None, _finite(p.get("dx", 0)), -_finite(p.get("dy", 0)))
        if t == "TYPING":
            return TypeText(str(p["text"]))
        if t in ("PRESS", "HOTKEY"):
            names = [p["key"]] if t == "PRESS" else p["keys"]
            # HOTKEY keys: ["ctrl", "c"] or "ctrl+c" (list() of the string would be its letters)
            names = names.split("+") if isinstance(names, str) else list(names)
            keys = tuple(normalize_key(str(k)) for k in names)
            if not keys or None in keys:
                return InvalidAction(raw, f"unknown key in {names}; use names like 'enter', 'a'")
            return Key(keys)  # type: ignore[arg-type]
        if t in ("MOUSE_DOWN", "MOUSE_UP"):
            button = p.get("button", "left")
            if button not in ("left", "right", "middle"):
                return InvalidAction(raw, f"{t}: button must be left, right or middle")
            return MouseDown(button=button) if t == "MOUSE_DOWN" else MouseUp(button=button)
        if t in ("KEY_DOWN", "KEY_UP"):
            k = normalize_key(str(p["key"]))
            if k is None:
                return InvalidAction(raw, f"unknown key {p['key']!r}")
            return KeyDown(k) if t == "KEY_DOWN" else KeyUp(k)
        if t == "WAIT":
            return Wait(float(p.get("seconds", 1.0)))
        if t == "DONE":
            return Done()
        if t == "FAIL":
            return Fail()
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        return InvalidAction(raw, f"bad parameters for {t}: {type(e).__name__} {e}")
    return InvalidAction(raw, f"unknown computer_13 action_type {t!r}")


def task_from_osworld(
    ot: osworld.OSWorldTask, source: str = "osworld", api_actions: Sequence[str] | bool = ()
) -> Task:
    """Wraps a parsed OSWorld task as a ``Task`` (spec = the JSON; oracle = typed actions).

    api_actions: the desktop API actions the task allows (names, or True for every one the
    task's JSON lists in ``"api_actions"``); the oracle is then the task's ``api_oracle`` when
    it uses only allowed ones, else its GUI oracle. Empty (the default): GUI only.
    """

    if api_actions is True:
        api = ot.api_actions
    else:
        api = check_api_names(list(api_actions or ()), where=f"task {ot.id} api_actions")
        bad_kind = [n for n in api if n not in VM_API]
        if bad_kind:
            raise osworld.TaskFormatError(
                f"task {ot.id}: desktop tasks allow only desktop API actions "
                f"({', '.join(VM_API)}), got {bad_kind}"
            )

    def parse(strings: Sequence[str], what: str) -> list[Action]:
        fmt, space = PyAutoGUI(), CoordinateSpace.identity(10**6, 10**6)
        acts = [a for s in strings for a in fmt.parse(s, space)]
        bad = [a for a in acts if isinstance(a, InvalidAction)]
        if bad:
            raise osworld.TaskFormatError(
                f"task {ot.id}: {what} action {bad[0].raw!r}: {bad[0].reason}"
            )
        return acts

    oracle = parse(ot.oracle, "oracle") if ot.oracle is not None else None
    if api and ot.api_oracle is not None:
        api_oracle = parse(ot.api_oracle, "api_oracle")
        used = {type(a) for a in api_oracle if isinstance(a, API_ACTION_TYPES)}
        if all(_api_of(c) in api for c in used):
            oracle = api_oracle
    spec = dict(ot.raw)
    spec.pop("oracle", None)
    spec.pop("api_oracle", None)
    if ot.base_dir is not None:
        spec["_base_dir"] = ot.base_dir
    return Task(
        id="/".join(p for p in (source, ot.domain if ot.domain != source else "", ot.id) if p),
        instruction=ot.instruction,
        source=source,
        category=ot.domain,
        difficulty=str(ot.raw.get("difficulty", "easy")),
        split=str(ot.raw.get("split", "train")),
        spec=spec,
        max_steps=ot.max_steps,
        oracle=oracle,
        api_actions=tuple(api),
    )


def _api_of(cls: type) -> str:

    return next(n for n, t in API_TOOLS.items() if t.cls is cls)


# Application names open_app knows -> the command that starts them (anything else must be an
# executable's bare name on the VM's PATH).
APPS: dict[str, list[str]] = {
    "terminal": ["xterm"],
    "xterm": ["xterm"],
    "text editor": ["xterm", "-e", "nano"],
    "editor": ["xterm", "-e", "nano"],
    "nano": ["xterm", "-e", "nano"],
    "browser": ["chromium"],
    "web browser": ["chromium"],
    "chromium": ["chromium"],
    "chrome": ["chromium"],
}
_MAX_API_OUTPUT = 4000  # chars of a command's output returned as the api_result
_CELL_RE = re.compile(r"\s*([A-Za-z]{1,3})\s*([0-9]{1,6})\s*")
_MAX_SHEET = (100_000, 1_000)  # rows, columns set_cell grows a sheet to at most


class _Refused(Exception):
    """An API action the desktop cannot carry out (no such app or file): an invalid action."""


def set_cell_text(text: str, cell: str, value: str, delimiter: str) -> str:
    """The CSV/TSV ``text`` with ``cell`` (A1 notation) set to ``value`` (rows and columns grow
    as needed; other cells are kept as they were)."""
    m = _CELL_RE.fullmatch(cell)
    if m is None:
        raise _Refused(f"set_cell: {cell!r} is not a cell in A1 notation (e.g. 'B3')")
    col = 0
    for ch in m.group(1).upper():
        col = col * 26 + (ord(ch) - ord("A") + 1)
    col, row = col - 1, int(m.group(2)) - 1
    if row < 0 or row >= _MAX_SHEET[0] or col >= _MAX_SHEET[1]:
        raise _Refused(f"set_cell: {cell!r} is outside the sheet (at most {_MAX_SHEET})")
    rows = list(csv.reader(io.StringIO(text), delimiter=delimiter))
    while len(rows) <= row:
        rows.append([])
    rows[row] = rows[row] + [""] * (col + 1 - len(rows[row]))
    rows[row][col] = value
    out = io.StringIO()
    csv.writer(out, delimiter=delimiter, lineterminator="\n").writerows(rows)
    return out.getvalue()


class VMEnv:
    """``Env`` over a desktop (LocalDesktop, RemoteDesktop), a DesktopPool, or a bare VMClient.

    Args:
      target: where episodes run. A pool: each ``reset`` takes a desktop from it (giving the
        previous one back, as faulty if its episode hit a fault). A desktop: ``reset`` calls its
        ``reset()`` (LocalDesktop recreates itself). A VMClient: setup steps are all the reset.
      observe_a11y: also fetch ``/accessibility`` into ``Observation.text`` every step.
      pause_s: seconds to wait after an action before the screenshot (OSWorld waits 2 s; our
        local apps settle in well under 0.1 s).
      action_timeout: the run-time limit of one action's pyautogui command in the VM.
      max_wait_s: cap on ``Wait`` actions (the model picks their length).
      cache: OSWorld's file cache for ``download`` steps and ``cloud_file`` getters (a
        ``ContentCache`` or its directory; None: ``~/.cache/cua_jax/osworld``).
      client_password: fills ``{CLIENT_PASSWORD}``; None: the desktop's own
        (``LocalDesktop.client_password``), else OSWorld's "password".
      strict_setup: any non-zero exit of a setup command is a fault (default: the exits that
        say a program is missing; see ``envs.vm.osworld_setup``).
      chrome_port: the DevTools port of the desktop's Chrome that ``chrome_open_tabs`` and
        OSWorld's Chrome getters use (OSWorld's VMs: 9222, its tasks' socat forward).
      settle_s: after a setup that starts or shows a window (``launch``, ``open``, ...), the
        reset's screenshot waits until the screen has held still this long (``_settle``), at
        most ``settle_timeout_s``: ``open`` returns when the app's window exists, before the
        app has drawn it (OSWorld's runner sleeps 60 s after every reset instead). 0: no wait.
        A task's own ``settle_s`` (``OSWorldTask.settle_s``) takes its place.
      eval_settle_s: before the evaluator runs, the screen must hold still this long (at most
        ``settle_timeout_s``): an agent may say DONE while the command it typed still runs or
        an app still saves (OSWorld's runner sleeps 20 s before every evaluation). 0: no wait.
    """

    def __init__(
        self,
        target: DesktopPool | Desktop | VMClient,
        *,
        observe_a11y: bool = False,
        pause_s: float = 0.0,
        action_timeout: float = 30.0,
        max_wait_s: float = 5.0,
        cache: osworld.ContentCache | str | None = None,
        client_password: str | None = None,
        strict_setup: bool = False,
        chrome_port: int = 9222,
        settle_s: float = 1.0,
        settle_timeout_s: float = 20.0,
        eval_settle_s: float = 0.5,
    ):
        self._pool = target if isinstance(target, DesktopPool) else None
        self._desktop: Desktop | None = (
            None if self._pool else (None if isinstance(target, VMClient) else target)
        )
        self._client: VMClient | None = target if isinstance(target, VMClient) else None
        self.observe_a11y = observe_a11y
        self.pause_s = pause_s
        self.action_timeout = action_timeout
        self.max_wait_s = max_wait_s
        self.cache = cache if isinstance(cache, osworld.ContentCache | None) else None
        if isinstance(cache, str):
            self.cache = osworld.ContentCache(cache)
        self.client_password = client_password
        self.strict_setup = strict_setup
        self.chrome_port = int(chrome_port)
        self.settle_s, self.settle_timeout_s = float(settle_s), float(settle_timeout_s)
        self.eval_settle_s = float(eval_settle_s)
        self.last_settle_s = 0.0  # what the last reset waited for the screen to hold still
        self.last_eval_settle_s = 0.0  # what the last evaluate waited for it
        self._setup = osworld.SetupOptions()
        self._work_dir: str | None = None
        # removes the work dir when the env is dropped unclosed (a test's bare env, a crash)
        self._work_dir_cleanup: weakref.finalize | None = None
        self._task: Task | None = None
        self._ot: osworld.OSWorldTask | None = None
        self._screen: tuple[int, int] = (0, 0)
        self._last_obs: Observation | None = None
        self._last_action: Any = None
        self._fault: str | None = None
        self._done = False
        self._steps = 0
        self.last_eval: osworld.EvalResult | None = None

    async def __aenter__(self) -> VMEnv:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def client(self) -> VMClient:
        if self._client is not None:
            return self._client
        if self._desktop is None:
            raise EnvError("VMEnv has no desktop: call reset(task) first")
        return self._desktop.client

    @property
    def desktop(self) -> Desktop | None:
        return self._desktop

    # ------------------------------------------------------------------------- reset

    async def reset(self, task: Task, seed: int | None = None) -> Observation:
        """Prepares a desktop and runs the task's setup steps; the first screenshot."""
        spec = dict(task.spec)
        base_dir = spec.pop("_base_dir", None)
        try:
            ot = osworld.parse_task(spec, where=f"task {task.id}", base_dir=base_dir)
        except osworld.TaskFormatError as e:
            raise EnvError(str(e)) from e
        self._task, self._ot = task, ot
        self._done, self._steps, self._last_action, self.last_eval = False, 0, None, None
        fault, self._fault = self._fault, None
        try:
            if self._pool is not None:
                if self._desktop is not None:
                    await self._pool.release(self._desktop, fault)
                    self._desktop = None
                self._desktop = await self._pool.acquire()
            if self._desktop is not None:
                await self._desktop.reset()
            self._screen = await self.client.screen_size()
            self._setup = self._setup_options()
            await osworld.run_setup(
                self.client,
                ot.config,
                screen_size=self._screen,
                base_dir=ot.base_dir,
                task_id=ot.id,
                options=self._setup,
            )
            if any(st.get("type") in WINDOW_STEPS for st in ot.config):
                self.last_settle_s = await self._settle(ot.settle_s)
            obs, _ = await self._observe()
        except (VMError, osworld.SetupError, RuntimeError, OSError) as e:
            self._fault = f"{type(e).__name__}: {e}"
            self._done = True
            raise EnvError(f"could not start task {task.id}: {e}") from e
        self._last_obs = obs
        return obs

    # ------------------------------------------------------------------------- step

    async def step(self, action: Action | dict[str, Any]) -> StepResult:
        """Runs one action (typed, or an OSWorld computer_13 dict); never raises for faults."""
        if self._task is None or self._last_obs is None:
            raise EnvError("VMEnv.step() before reset(): call reset(task) first")
        if self._done:
            return StepResult(
                self._last_obs,
                True,
                0.0,
                {
                    INFO_DONE_REASON: "error" if self._fault else "env_done",
                    INFO_ERROR: self._fault or "the episode is over; call reset()",
                },
            )
        self._steps += 1
        act = computer13_to_action(action) if isinstance(action, dict) else action
        self._last_action = act
        info: dict[str, Any] = {}
        t0 = time.perf_counter()
        if isinstance(act, InvalidAction):
            info[INFO_INVALID_ACTION] = act.reason
            return StepResult(self._last_obs, False, 0.0, info)
        if isinstance(act, API_ACTION_TYPES):
            why = api_refusal(act, self._task.api_actions, VM_API, "desktop")
            if why is not None:
                info[INFO_INVALID_ACTION] = why
                return StepResult(self._last_obs, False, 0.0, info)
        if isinstance(act, Done | Fail | Answer):
            self._done = True
            info[INFO_DONE_REASON] = type(act).__name__.lower()
            if isinstance(act, Answer):
                info[INFO_ANSWER] = act.text
            return StepResult(self._last_obs, True, 0.0, info)
        code = act if isinstance(act, str) else action_to_pyautogui(act)
        try:
            if isinstance(act, Wait):
                await asyncio.sleep(self._wait_seconds(act.seconds))
            elif isinstance(act, API_ACTION_TYPES):
                try:
                    info[INFO_API_RESULT] = await self._api(act)
                except _Refused as e:
                    info[INFO_INVALID_ACTION] = str(e)
            elif code is not None:
                r = await self.client.pyautogui(code, timeout=self.action_timeout)
                if r.get("status") != "success" or r.get("returncode", 0) != 0:
                    err = r.get("message") or (r.get("error") or "").strip().splitlines()[-1:]
                    info[INFO_INVALID_ACTION] = f"the action failed in the VM: {err}"
            t1 = time.perf_counter()
            if self.pause_s:
                await asyncio.sleep(self.pause_s)
            obs, t_obs = await self._observe()
        except VMError as e:
            return self._fault_result(e)
        self._last_obs = obs
        info[INFO_TIMING] = {
            "action": t1 - t0,
            "screenshot": t_obs,
            "total": time.perf_counter() - t0,
        }
        if self._steps >= self._task.max_steps:
            self._done = True
            info[INFO_DONE_REASON] = "max_steps"
        return StepResult(obs, self._done, 0.0, info)

    async def _api(self, act: Action) -> str:
        """Runs a desktop API action through the VM's HTTP API; what it did, as text.

        run_shell: ``/execute`` with a shell (the action time-out); open_app: ``/setup/launch``,
        then waits (up to 5 s) for a new window; write_file: ``mkdir -p`` + ``/setup/upload``;
        set_cell: ``/file`` -> the cell set here -> ``/setup/upload`` (.csv / .tsv files)."""
        c = self.client
        match act:
            case RunShell(cmd) if not cmd.strip():
                raise _Refused("run_shell: the command is empty")
            case RunShell(cmd):
                r = await c.execute(cmd, shell=True, timeout=self.action_timeout)
                if r.get("status") != "success" and "returncode" not in r:
                    return f"the command failed: {r.get('message') or r.get('error')}"[:800]
                out = (r.get("output") or "") + (r.get("error") or "")
                if len(out) > _MAX_API_OUTPUT:
                    out = out[:_MAX_API_OUTPUT] + f"... ({len(out)} chars)"
                return f"exit code {r.get('returncode')}\n{out}"
            case OpenApp(name):
                argv = APPS.get(name.strip().lower())
                if argv is None:
                    exe = name.strip()
                    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}", exe):
                        raise _Refused(
                            f"open_app: unknown application {name!r}; known: "
                            f"{', '.join(APPS)}, or a program's name"
                        )
                    found = await c.execute(["which", exe], timeout=10)
                    if found.get("returncode") != 0:
                        raise _Refused(f"open_app: no application {name!r} on this computer")
                    argv = [exe]
                before = await self._window_count()
                await c.launch(argv)
                for _ in range(50):
                    if before is None or (await self._window_count() or 0) > before:
                        break
                    await asyncio.sleep(0.1)
                return f"started {' '.join(argv)}"
            case WriteFile(path, text):
                d = posixpath.dirname(path.strip())
                if d:
                    await c.execute(["mkdir", "-p", d], timeout=10)
                await c.upload(path.strip(), text.encode("utf-8"))
                return f"wrote {len(text.encode('utf-8'))} bytes to {path}"
            case SetCell(file, cell, value):
                ext = posixpath.splitext(file.strip())[1].lower()
                if ext not in (".csv", ".tsv"):
                    raise _Refused(f"set_cell: {file!r} is not a .csv or .tsv file")
                try:
                    data = await c.download(file.strip())
                except VMFileNotFoundError as e:
                    raise _Refused(f"set_cell: there is no file {file!r}") from e
                new = set_cell_text(
                    data.decode("utf-8", "replace"), cell, value, "\t" if ext == ".tsv" else ","
                )
                await c.upload(file.strip(), new.encode("utf-8"))
                return f"set {cell.strip().upper()} of {file} to {value!r}"
        raise ValueError(f"VMEnv cannot run {act!r}")

    async def _window_count(self) -> int | None:
        """How many top-level windows ``wmctrl -l`` lists (None without wmctrl)."""
        try:
            r = await self.client.execute(["wmctrl", "-l"], timeout=5)
        except VMError:
            raise
        except Exception:  # noqa: BLE001 -- a VM without wmctrl: do not wait
            return None
        if r.get("returncode") != 0:
            return None
        return len((r.get("output") or "").splitlines())

    def _wait_seconds(self, seconds: Any) -> float:
        """A model-chosen wait within [0, max_wait_s]: NaN, negative or junk -> 0, inf -> cap."""
        try:
            s = float(seconds)
        except (TypeError, ValueError):
            return 0.0
        return 0.0 if math.isnan(s) else min(max(s, 0.0), self.max_wait_s)

    def _fault_result(self, e: BaseException) -> StepResult:
        self._fault = f"{type(e).__name__}: {e}"
        self._done = True
        obs = self._last_obs
        assert obs is not None
        return StepResult(obs, True, 0.0, {INFO_ERROR: self._fault, INFO_DONE_REASON: "error"})

    async def _settle(self, settle_s: float | None = None, after: str = "its setup") -> float:
        """Waits until the screen holds still for `settle_s` (None: the env's; under
        `STILL_SHARE` of its pixels change between screenshots `SETTLE_EVERY_S` apart: a
        blinking text cursor is still), at most `settle_timeout_s`; returns the seconds waited.
        A screen that never holds still (a video) costs the timeout, and the episode goes on
        with what it shows then."""
        settle_s = self.settle_s if settle_s is None else settle_s
        if settle_s <= 0:
            return 0.0
        t0 = time.monotonic()
        last = await self._pixels()
        still_since = t0
        while (now := time.monotonic()) - t0 < self.settle_timeout_s:
            if now - still_since >= settle_s:
                return now - t0
            await asyncio.sleep(SETTLE_EVERY_S)
            shot = await self._pixels()
            if shot.shape != last.shape or float((shot != last).any(axis=-1).mean()) >= STILL_SHARE:
                still_since = time.monotonic()
            last = shot
        logging.warning(
            "VMEnv: the screen of task %s did not hold still within %.0f s of %s",
            self._task.id if self._task else "?",
            self.settle_timeout_s,
            after,
        )
        return time.monotonic() - t0

    async def _pixels(self) -> np.ndarray:
        return await asyncio.to_thread(decode_screenshot, await self.client.screenshot())

    async def _observe(self) -> tuple[Observation, float]:
        t0 = time.perf_counter()
        png = await self.client.screenshot()
        self.last_screenshot_bytes = png  # the encoded screen, as BrowserEnv keeps it
        text = await self.client.accessibility() if self.observe_a11y else None
        img = await asyncio.to_thread(decode_screenshot, png)
        assert self._task is not None
        obs = Observation(
            img, self._task.instruction, text, {"step": self._steps, "vm": self.client.base_url}
        )
        return obs, time.perf_counter() - t0

    # ------------------------------------------------------------------------- evaluate

    async def evaluate(self) -> float:
        """The task's evaluator on the current VM state. A VM that faulted during the episode,
        or that fails while the evaluator runs, raises `EnvError`: the episode is an
        infrastructure fault, never a 0-score failure."""
        if self._ot is None:
            raise EnvError("VMEnv.evaluate() before reset()")
        if self._fault is not None:
            self.last_eval = osworld.EvalResult(0.0, [{"error": self._fault}])
            raise EnvError(f"cannot evaluate: the VM faulted in this episode: {self._fault}")
        try:
            self.last_eval_settle_s = await self._settle(self.eval_settle_s, "its last action")
            self.last_eval = await osworld.evaluate(
                self.client,
                self._ot,
                screen_size=self._screen,
                last_action_was_fail=isinstance(self._last_action, Fail),
                options=self._setup,
            )
        except (VMError, osworld.SetupError, OSError) as e:
            self._fault = f"{type(e).__name__}: {e}"
            self.last_eval = osworld.EvalResult(0.0, [{"error": self._fault}])
            raise EnvError(f"the VM failed while the evaluator ran: {self._fault}") from e
        return self.last_eval.score

    async def oracle_actions(self) -> list[Action]:
        """The task's fixed oracle (built-in desktop tasks)."""
        if self._task is None or self._task.oracle is None:
            raise EnvError("this task has no oracle")
        return list(self._task.oracle)

    def _setup_options(self) -> osworld.SetupOptions:
        """This episode's setup options: a fresh work dir (``execute`` outputs), the password
        the desktop's sudo takes (its own, e.g. ``LocalDesktop.client_password``), and how much
        longer its ``sleep`` steps wait (``QemuDesktop.sleep_scale`` under TCG)."""
        self._drop_work_dir()
        self._work_dir = tempfile.mkdtemp(prefix="osworld-episode-")
        self._work_dir_cleanup = weakref.finalize(
            self, shutil.rmtree, self._work_dir, ignore_errors=True
        )
        password = (
            self.client_password
            or getattr(self._desktop, "client_password", None)
            or DEFAULT_CLIENT_PASSWORD
        )
        return osworld.SetupOptions(
            client_password=password,
            cache=self.cache,
            work_dir=self._work_dir,
            strict=self.strict_setup,
            chrome_port=self.chrome_port,
            sleep_scale=float(getattr(self._desktop, "sleep_scale", 1.0)),
        )

    def _drop_work_dir(self) -> None:
        if self._work_dir_cleanup is not None:
            self._work_dir_cleanup()  # runs once: the rmtree, then detaches
            self._work_dir_cleanup = None
        self._work_dir = None

    async def close(self) -> None:
        """Gives a pooled desktop back (as faulty if the episode broke). Safe to call twice."""
        self._drop_work_dir()
        if self._pool is not None and self._desktop is not None:
            d, self._desktop = self._desktop, None
            await self._pool.release(d, self._fault)
            self._fault = None


class VMEnvPool:
    """What the rollout loop wants from an env pool, over a :class:`DesktopPool`.

    ``async with VMEnvPool(desktops) as pool:`` starts the desktops; ``async with
    pool.acquire() as env:`` lends a :class:`VMEnv` that takes a desktop on ``reset`` and gives it
    back (as faulty if its episode broke) when the block ends. ``len(pool)`` is how many episodes
    can run at once.
    """

    def __init__(self, desktops: Sequence[Desktop], **env_kwargs: Any):
        self.desktops = DesktopPool(desktops)
        self._env_kwargs = env_kwargs

    def __len__(self) -> int:
        return len(self.desktops.desktops) - len(self.desktops.retired)

    async def __aenter__(self) -> VMEnvPool:
        await self.desktops.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.desktops.stop()

    @contextlib.asynccontextmanager
    async def acquire(self) -> AsyncIterator[VMEnv]:
        env = VMEnv(self.desktops, **self._env_kwargs)
        try:
            yield env
        finally:
            await env.close()

    def report(self) -> dict[str, Any]:
        return self.desktops.report()

    def metrics(self) -> dict[str, float]:
        """``rollout/env_*`` metrics of the trainer (``DesktopPool.metrics``)."""
        return self.desktops.metrics()
