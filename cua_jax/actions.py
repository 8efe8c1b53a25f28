"""The action space: typed actions, and parsers/formatters for the formats models speak.

Actions are small frozen dataclasses in **screen pixel coordinates** (pixels of the observation's
screenshot). Models speak in their own coordinate frame; :class:`CoordinateSpace` is the one place
that maps between the two:

* Qwen2.5-VL: absolute pixels of the *resized* image the model saw (``smart_resize`` output), so
  ``CoordinateSpace.resized(screen_w, screen_h, resized_w, resized_h)``.
* Qwen3-VL: 0..1000 relative coordinates, ``CoordinateSpace.relative(screen_w, screen_h)``.
* pyautogui (OSWorld): screen pixels, ``CoordinateSpace.identity(screen_w, screen_h)``.

Formats (``get_format(name)``; names in ``FORMATS``):

* ``"qwen25vl"`` / ``"qwen3vl"``: the Qwen-VL ``computer_use`` tool call::

      <tool_call>
      {"name": "computer_use", "arguments": {"action": "left_click", "coordinate": [x, y]}}
      </tool_call>

* ``"pyautogui"``: Python code of ``pyautogui`` calls plus OSWorld's ``WAIT`` / ``DONE`` /
  ``FAIL``. Parsed with :mod:`ast`, never executed.

Usage in a rollout loop::

    fmt = get_format("qwen3vl")
    space = CoordinateSpace.relative(*obs.screen_size)
    system_prompt = fmt.system_prompt(space)          # the tool schema text
    actions = fmt.parse(model_text, space)            # list[Action], screen pixels, never raises
    text = fmt.format(Click(10, 20), space)           # an action back as model text (SFT data)

A malformed string never raises: it parses to ``[InvalidAction(raw, reason)]``.

Key names are canonical lowercase names (``KEY_NAMES``: "ctrl", "shift", "alt", "meta", "enter",
"esc", "tab", "backspace", "delete", "up", "pagedown", "f5", ...) or a single character; each env
maps them to its backend (Playwright key names, xdotool keysyms).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

# --------------------------------------------------------------------------------------------
# Action types
# --------------------------------------------------------------------------------------------

Button = Literal["left", "right", "middle"]
BUTTONS = ("left", "right", "middle")

# Wheel notches (pyautogui clicks) one Scroll sends at most a direction, in every env: a model's
# scroll(1e300) would loop pyautogui until the action timeout in a VM, and is a wheel delta that
# hangs Chromium's next input event in the browser.
MAX_SCROLL_NOTCHES = 50


def clamp_scroll(notches: float) -> float:
    """A Scroll amount within +-MAX_SCROLL_NOTCHES."""
    return min(max(notches, -MAX_SCROLL_NOTCHES), MAX_SCROLL_NOTCHES)


@dataclasses.dataclass(frozen=True)
class Click:
    """Click ``count`` times (1 single, 2 double, 3 triple) at (x, y); None = at the pointer."""

    x: float | None
    y: float | None
    button: Button = "left"
    count: int = 1


@dataclasses.dataclass(frozen=True)
class Move:
    """Move the pointer to (x, y)."""

    x: float
    y: float


@dataclasses.dataclass(frozen=True)
class Drag:
    """Press the left button, move to (x, y), release. Starts at (start_x, start_y), or at the
    current pointer position when those are None (what ``left_click_drag`` / ``dragTo`` mean)."""

    x: float
    y: float
    start_x: float | None = None
    start_y: float | None = None


@dataclasses.dataclass(frozen=True)
class TypeText:
    """Type ``text`` (``\\n`` presses Enter)."""

    text: str


@dataclasses.dataclass(frozen=True)
class Key:
    """Press a key or a chord: keys go down in order and come up in reverse (``("ctrl", "c")``)."""

    keys: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Scroll:
    """Scroll the wheel at (x, y) (None = at the pointer) by (dx, dy) wheel notches.

    Positive ``dy`` scrolls down (content moves up), positive ``dx`` scrolls right, as in DOM
    wheel events. (pyautogui and Qwen's ``pixels`` use the opposite sign for vertical scrolls;
    the parsers convert.) Envs map one notch to their own distance (browser: 100 CSS px).
    """

    x: float | None
    y: float | None
    dx: float = 0.0
    dy: float = 0.0


@dataclasses.dataclass(frozen=True)
class MouseDown:
    """Press and hold a mouse button at (x, y) (None = at the pointer) until `MouseUp`
    (pyautogui ``mouseDown``, OSWorld ``MOUSE_DOWN``): drags that need steps in between."""

    x: float | None = None
    y: float | None = None
    button: Button = "left"


@dataclasses.dataclass(frozen=True)
class MouseUp:
    """Release a mouse button at (x, y) (None = at the pointer)."""

    x: float | None = None
    y: float | None = None
    button: Button = "left"


@dataclasses.dataclass(frozen=True)
class KeyDown:
    """Press and hold one key until `KeyUp` (pyautogui ``keyDown``, OSWorld ``KEY_DOWN``)."""

    key: str


@dataclasses.dataclass(frozen=True)
class KeyUp:
    """Release a key held by `KeyDown`."""

    key: str


@dataclasses.dataclass(frozen=True)
class Wait:
    """Do nothing for ``seconds`` and take a new screenshot."""

    seconds: float = 1.0


@dataclasses.dataclass(frozen=True)
class Done:
    """The policy claims the task is finished (Qwen ``terminate`` status=success, OSWorld DONE)."""


@dataclasses.dataclass(frozen=True)
class Fail:
    """The policy declares the task infeasible (Qwen ``terminate`` status=failure, OSWorld FAIL)."""


@dataclasses.dataclass(frozen=True)
class Answer:
    """The policy answers a question with ``text`` (ends the episode)."""

    text: str


@dataclasses.dataclass(frozen=True)
class InvalidAction:
    """The model's output could not be turned into an action; ``reason`` is feedback for it."""

    raw: str
    reason: str


# ---- API actions (ComputerRL's API-GUI paradigm) -------------------------------------------
# Typed calls the model may make instead of a run of GUI actions, each a tool of its own in the
# Qwen tool schema. A task says which ones it allows (``Task.api_actions``); the system prompt
# lists only those, and an env answers any other one as an invalid action.


@dataclasses.dataclass(frozen=True)
class RunShell:
    """API (desktop): run ``cmd`` in a shell in the VM; its output is the step's api_result."""

    cmd: str


@dataclasses.dataclass(frozen=True)
class OpenApp:
    """API (desktop): start the application ``name`` ("terminal", "text editor", "xterm", ...)."""

    name: str


@dataclasses.dataclass(frozen=True)
class WriteFile:
    """API (desktop): write ``text`` to the file ``path`` (``~`` is the home dir), replacing it."""

    path: str
    text: str


@dataclasses.dataclass(frozen=True)
class SetCell:
    """API (desktop): set ``cell`` (A1 notation) of the spreadsheet ``file`` to ``value``."""

    file: str
    cell: str
    value: str


@dataclasses.dataclass(frozen=True)
class OpenUrl:
    """API (browser): load ``url`` in the page."""

    url: str


@dataclasses.dataclass(frozen=True)
class Fill:
    """API (browser): replace the text of the form field labelled ``label`` with ``text``."""

    label: str
    text: str


@dataclasses.dataclass(frozen=True)
class SelectOption:
    """API (browser): choose ``option`` in the select box / dropdown labelled ``label``."""

    label: str
    option: str


Action = (
    Click | Move | Drag | TypeText | Key | Scroll | MouseDown | MouseUp | KeyDown | KeyUp
    | Wait | Done | Fail | Answer | InvalidAction
    | RunShell | OpenApp | WriteFile | SetCell | OpenUrl | Fill | SelectOption
)  # fmt: skip
TERMINAL_ACTIONS = (Done, Fail, Answer)


@dataclasses.dataclass(frozen=True)
class ApiTool:
    """One API action as a tool: its name, class, parameters (name, description) and use."""

    name: str
    cls: type
    params: tuple[tuple[str, str], ...]
    doc: str
    env: Literal["vm", "browser"]


API_TOOLS: dict[str, ApiTool] = {
    t.name: t
    for t in (
        ApiTool(
            "run_shell",
            RunShell,
            (("cmd", "The shell command line to run (bash)."),),
            "Run a shell command on the computer and get its output.",
            "vm",
        ),
        ApiTool(
            "open_app",
            OpenApp,
            (("name", "The application, e.g. 'terminal', 'text editor', 'browser'."),),
            "Open an application.",
            "vm",
        ),
        ApiTool(
            "write_file",
            WriteFile,
            (("path", "The file's path ('~/' is the home directory)."), ("text", "The content.")),
            "Write text to a file, replacing what it held (creates it and its directories).",
            "vm",
        ),
        ApiTool(
            "set_cell",
            SetCell,
            (
                ("file", "The spreadsheet file (.csv or .tsv)."),
                ("cell", "The cell in A1 notation, e.g. 'B3'."),
                ("value", "The new value."),
            ),
            "Set one cell of a spreadsheet file.",
            "vm",
        ),
        ApiTool(
            "open_url",
            OpenUrl,
            (("url", "The address to open."),),
            "Open a web address in the browser page.",
            "browser",
        ),
        ApiTool(
            "fill",
            Fill,
            (("label", "The field's label as shown on the page."), ("text", "The text.")),
            "Fill the form field with the given label with text (replacing its content).",
            "browser",
        ),
        ApiTool(
            "select_option",
            SelectOption,
            (("label", "The select box's or dropdown's label."), ("option", "The option's text.")),
            "Choose an option of the select box or dropdown with the given label.",
            "browser",
        ),
    )
}
API_ACTION_TYPES = tuple(t.cls for t in API_TOOLS.values())
VM_API = tuple(n for n, t in API_TOOLS.items() if t.env == "vm")
BROWSER_API = tuple(n for n, t in API_TOOLS.items() if t.env == "browser")
_API_BY_CLASS = {t.cls: t for t in API_TOOLS.values()}
MAX_API_TEXT = 100_000  # chars of one API argument (a file's text); longer is an invalid action
_MAY_BE_EMPTY = ("text", "value")  # a file's or a field's text, a cell's value; others may not


def api_name(action: Any) -> str | None:
    """The tool name of an API action (``"run_shell"``, ...), None for a GUI action."""
    t = _API_BY_CLASS.get(type(action))
    return t.name if t is not None else None


def check_api_names(names: Sequence[str], where: str = "api_actions") -> tuple[str, ...]:
    """``names`` as a tuple after checking each is an API tool (ValueError naming the bad one)."""
    if isinstance(names, str):
        names = (names,)
    bad = [n for n in names if n not in API_TOOLS]
    if bad:
        raise ValueError(f"{where}: unknown API action(s) {bad}; valid: {', '.join(API_TOOLS)}")
    return tuple(dict.fromkeys(names))


def api_refusal(
    action: Any, allowed: Sequence[str], supported: Sequence[str], env_kind: str
) -> str | None:
    """Why an env refuses the API ``action`` (its invalid-action reason), or None to run it:
    ``supported`` are the API actions this kind of env runs, ``allowed`` the task's."""
    name = api_name(action)
    if name not in supported:
        return f"{name} is not a {env_kind} API action; {env_kind} API: {', '.join(supported)}"
    if name not in allowed:
        return f"this task does not allow the API action {name}; " + (
            f"allowed: {', '.join(allowed)}" if allowed else "use GUI actions"
        )
    return None


def api_arguments(action: Any) -> dict[str, str]:
    """The tool-call arguments of an API action (its fields by parameter name)."""
    t = _API_BY_CLASS[type(action)]
    return {p: getattr(action, p) for p, _ in t.params}


def _api_action(name: str, args: Any, raw: str) -> Action:
    """An API tool's arguments (a dict by parameter name) -> its action, or InvalidAction."""
    t = API_TOOLS[name]
    if not isinstance(args, dict):
        return InvalidAction(raw, f"`{name}` arguments must be an object")
    aliases = {"field_label": "label", "command": "cmd", "app": "name", "content": "text"}
    args = {aliases.get(k, k) if aliases.get(k) not in args else k: v for k, v in args.items()}
    vals = []
    for p, _ in t.params:
        v = args.get(p)
        if isinstance(v, int | float) and not isinstance(v, bool) and p in ("value", "text"):
            f = _num(v)
            v = None if f is None else _fmt_num(f)
        if not isinstance(v, str):
            sig = ", ".join(q for q, _ in t.params)
            return InvalidAction(raw, f"`{name}` needs `{p}`: a string ({name}({sig}))")
        if len(v) > MAX_API_TEXT:
            return InvalidAction(raw, f"`{name}`: `{p}` is longer than {MAX_API_TEXT} chars")
        if p not in _MAY_BE_EMPTY and not v.strip():
            return InvalidAction(raw, f"`{name}`: `{p}` is empty")
        vals.append(v)
    extra = [k for k in args if k not in dict(t.params) and k != "action"]
    if extra:
        return InvalidAction(raw, f"`{name}` got unexpected argument(s) {extra}")
    return t.cls(*vals)


def api_tool_schema(name: str) -> dict[str, Any]:
    """The function schema of one API tool (the JSON a chat template renders in <tools>)."""
    t = API_TOOLS[name]
    props = {p: {"description": d, "type": "string"} for p, d in t.params}
    return {
        "type": "function",
        "function": {
            "name": t.name,
            "description": t.doc,
            "parameters": {
                "properties": props,
                "required": [p for p, _ in t.params],
                "type": "object",
            },
        },
    }


# --------------------------------------------------------------------------------------------
# Keys
# --------------------------------------------------------------------------------------------

# Canonical multi-character key names. Single characters ("a", "A", "1", "/") are keys as well.
KEY_NAMES = frozenset(
    ["ctrl", "shift", "alt", "meta", "enter", "esc", "tab", "backspace", "delete", "space"]
    + ["up", "down", "left", "right", "home", "end", "pageup", "pagedown", "insert"]
    + ["capslock", "printscreen", "numlock", "scrolllock", "pause", "menu"]
    + [f"f{i}" for i in range(1, 13)]
)
_KEY_ALIASES = {
    "control": "ctrl",
    "ctl": "ctrl",
    "lctrl": "ctrl",
    "rctrl": "ctrl",
    "ctrlleft": "ctrl",
    "ctrlright": "ctrl",
    "control_l": "ctrl",
    "control_r": "ctrl",
    "shiftleft": "shift",
    "shiftright": "shift",
    "shift_l": "shift",
    "shift_r": "shift",
    "option": "alt",
    "altleft": "alt",
    "altright": "alt",
    "alt_l": "alt",
    "alt_r": "alt",
    "cmd": "meta",
    "command": "meta",
    "win": "meta",
    "windows": "meta",
    "super": "meta",
    "winleft": "meta",
    "winright": "meta",
    "super_l": "meta",
    "super_r": "meta",
    "os": "meta",
    "return": "enter",
    "kp_enter": "enter",
    "escape": "esc",
    "del": "delete",
    "bksp": "backspace",
    "back_space": "backspace",
    "spacebar": "space",
    "arrowup": "up",
    "arrowdown": "down",
    "arrowleft": "left",
    "arrowright": "right",
    "pgup": "pageup",
    "pgdn": "pagedown",
    "page_up": "pageup",
    "page_down": "pagedown",
    "prior": "pageup",
    "next": "pagedown",
    "prtsc": "printscreen",
    "print": "printscreen",
    "ins": "insert",
    "caps_lock": "capslock",
    "plus": "+",
    "minus": "-",
    # pyautogui's names (pyautogui.KEY_NAMES) that have a canonical equivalent:
    "apps": "menu",
    "prtscr": "printscreen",
    "prntscrn": "printscreen",
    "optionleft": "alt",
    "optionright": "alt",
    "add": "+",
    "subtract": "-",
    "multiply": "*",
    "divide": "/",
    "decimal": ".",
    **{f"num{i}": str(i) for i in range(10)},
}
# Canonical names that pyautogui spells differently (the rest are pyautogui names as they are).
PYAUTOGUI_KEY_NAMES = {"meta": "win", "menu": "apps"}


def normalize_key(name: str) -> str | None:
    """Canonical key name for ``name`` (case-insensitive, common aliases), or None if unknown."""
    if not isinstance(name, str) or not name:
        return None
    if len(name) == 1:
        return name if name != " " else "space"
    low = name.strip().lower()
    if low in KEY_NAMES:
        return low
    low = _KEY_ALIASES.get(low, low.replace("-", "").replace(" ", ""))
    low = _KEY_ALIASES.get(low, low)
    return low if low in KEY_NAMES or low in _KEY_ALIASES.values() else None  # '+' for 'plus'


def _split_chord(text: str) -> list[str]:
    """'ctrl+c' / 'ctrl c' / 'Ctrl-Shift-T' -> parts; a single '+' or '-' stays a key.

    A '+' where a key name is expected is the '+' key: 'ctrl++' / 'ctrl + +' -> ['ctrl', '+'].
    """
    t = text.strip()
    if len(t) <= 1:
        return [t] if t else []
    if "+" in t:
        parts: list[str] = []
        for p in re.sub(r"\s*\+\s*", "+", t).split("+"):
            if p:
                parts.append(p)
            elif parts[-1:] != ["+"]:  # empty pieces around a '+' key: one '+'
                parts.append("+")
        return parts
    if " " in t:
        return [p for p in t.split(" ") if p]
    if "-" in t and all(normalize_key(p) for p in t.split("-") if p):
        return [p for p in t.split("-") if p]
    return [t]


def _make_key(raw: str, names: Sequence[Any]) -> Key | InvalidAction:
    parts: list[str] = []
    for n in names:
        if not isinstance(n, str):
            return InvalidAction(raw, f"key names must be strings, got {n!r}")
        parts.extend(_split_chord(n) if len(names) == 1 else [n])
    if not parts:
        return InvalidAction(raw, "no key given")
    keys = []
    for p in parts:
        k = normalize_key(p)
        if k is None:
            return InvalidAction(raw, f"unknown key {p!r}; use names like 'enter', 'ctrl', 'a'")
        keys.append(k)
    return Key(tuple(keys))


# --------------------------------------------------------------------------------------------
# Coordinates
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CoordinateSpace:
    """Maps the model's coordinate frame to screen pixels and back (the only place that does).

    A model point (mx, my) in [0, model_w] x [0, model_h] maps to screen
    (mx * screen_w / model_w, my * screen_h / model_h), clamped inside the screen. Points outside
    the model frame (beyond a small tolerance) are invalid actions, not silently clamped.
    """

    screen_w: int
    screen_h: int
    model_w: float
    model_h: float

    def __post_init__(self) -> None:
        if min(self.screen_w, self.screen_h, self.model_w, self.model_h) <= 0:
            raise ValueError(f"CoordinateSpace sizes must be positive, got {self}")

    @classmethod
    def identity(cls, screen_w: int, screen_h: int) -> CoordinateSpace:
        """Model coordinates are screen pixels (pyautogui / OSWorld, or an unresized image)."""
        return cls(screen_w, screen_h, screen_w, screen_h)

    @classmethod
    def relative(cls, screen_w: int, screen_h: int, scale: float = 1000.0) -> CoordinateSpace:
        """Model coordinates are 0..scale on both axes (Qwen3-VL: 0..1000)."""
        return cls(screen_w, screen_h, scale, scale)

    @classmethod
    def resized(
        cls, screen_w: int, screen_h: int, resized_w: int, resized_h: int
    ) -> CoordinateSpace:
        """Model coordinates are pixels of the resized image the model saw (Qwen2.5-VL)."""
        return cls(screen_w, screen_h, resized_w, resized_h)

    def in_bounds(self, mx: float, my: float) -> bool:
        tol = 0.01 * max(self.model_w, self.model_h) + 1  # a hair past the edge is still ok
        return -tol <= mx <= self.model_w + tol and -tol <= my <= self.model_h + tol

    def to_screen(self, mx: float, my: float) -> tuple[float, float]:
        """Model point -> screen pixel (float), clamped to [0, W-1] x [0, H-1]."""
        sx = mx * self.screen_w / self.model_w
        sy = my * self.screen_h / self.model_h
        return (min(max(sx, 0.0), self.screen_w - 1.0), min(max(sy, 0.0), self.screen_h - 1.0))

    def to_model(self, sx: float, sy: float) -> tuple[int, int]:
        """Screen pixel -> model point, rounded to the integers models emit."""
        return (
            int(round(sx * self.model_w / self.screen_w)),
            int(round(sy * self.model_h / self.screen_h)),
        )


def _num(v: Any) -> float | None:
    """A finite float from an int/float/numeric string, else None (bool is not a number)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int | float):
        f = float(v)
    elif isinstance(v, str):
        try:
            f = float(v.strip())
        except ValueError:
            return None
    else:
        return None
    return f if math.isfinite(f) else None


def _point(raw: str, v: Any, space: CoordinateSpace, what: str) -> tuple[float, float] | str:
    """Model coordinate value -> screen point, or an error reason string."""
    if isinstance(v, str):  # "[12, 34]" or "12, 34" or "(12,34)"
        nums = re.findall(r"-?\d+(?:\.\d+)?", v)
        v = [float(n) for n in nums]
    if not isinstance(v, list | tuple) or len(v) != 2:
        return f"`{what}` must be [x, y], got {v!r}"
    x, y = _num(v[0]), _num(v[1])
    if x is None or y is None:
        return f"`{what}` must hold two numbers, got {v!r}"
    if not space.in_bounds(x, y):
        return (
            f"`{what}` {[x, y]} is outside the screen (0..{space.model_w:g} x 0..{space.model_h:g})"
        )
    return space.to_screen(x, y)


def _fmt_num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


# --------------------------------------------------------------------------------------------
# Format protocol
# --------------------------------------------------------------------------------------------


class ActionFormat(Protocol):
    """One text format for actions: a parser, a formatter, and its system-prompt text."""

    name: str

    def system_prompt(self, space: CoordinateSpace, api_actions: Sequence[str] = ()) -> str:
        """Text for the system prompt that tells the model the tool/action schema; the API
        actions named in ``api_actions`` (the task's ``Task.api_actions``) are listed too."""
        ...

    def parse(self, text: str, space: CoordinateSpace) -> list[Action]:
        """Model output -> actions in screen pixels; never raises, never returns []."""
        ...

    def format(self, action: Action, space: CoordinateSpace) -> str:
        """An action in screen pixels -> model output text (demonstrations, logs)."""
        ...

    def default_space(
        self,
        screen_w: int,
        screen_h: int,
        resized_w: int | None = None,
        resized_h: int | None = None,
    ) -> CoordinateSpace:
        """The coordinate space this format's models use for a screen of this size."""
        ...


# --------------------------------------------------------------------------------------------
# Qwen-VL computer_use tool calls
# --------------------------------------------------------------------------------------------

_QWEN_ACTIONS_25 = (
    "key",
    "type",
    "mouse_move",
    "left_click",
    "left_click_drag",
    "right_click",
    "middle_click",
    "double_click",
    "scroll",
    "wait",
    "terminate",
)
_QWEN_ACTIONS_3 = (
    "key",
    "type",
    "mouse_move",
    "left_click",
    "left_click_drag",
    "right_click",
    "middle_click",
    "double_click",
    "triple_click",
    "scroll",
    "hscroll",
    "wait",
    "terminate",
    "answer",
)
_QWEN_ACTION_DOCS = {
    "key": "Performs key down presses on the arguments passed in order, then performs key "
    "releases in reverse order.",
    "type": "Type a string of text on the keyboard.",
    "mouse_move": "Move the cursor to a specified (x, y) pixel coordinate on the screen.",
    "left_click": "Click the left mouse button at a specified (x, y) pixel coordinate on the "
    "screen.",
    "left_click_drag": "Click and drag the cursor to a specified (x, y) pixel coordinate on the "
    "screen.",
    "right_click": "Click the right mouse button at a specified (x, y) pixel coordinate on the "
    "screen.",
    "middle_click": "Click the middle mouse button at a specified (x, y) pixel coordinate on the "
    "screen.",
    "double_click": "Double-click the left mouse button at a specified (x, y) pixel coordinate "
    "on the screen.",
    "triple_click": "Triple-click the left mouse button at a specified (x, y) pixel coordinate "
    "on the screen.",
    "scroll": "Performs a scroll of the mouse scroll wheel.",
    "hscroll": "Performs a horizontal scroll of the mouse scroll wheel.",
    "wait": "Wait specified seconds for the change to happen.",
    "terminate": "Terminate the current task and report its completion status.",
    "answer": "Answer a question.",
}
_CLICKS = {
    "left_click": ("left", 1),
    "right_click": ("right", 1),
    "middle_click": ("middle", 1),
    "double_click": ("left", 2),
    "triple_click": ("left", 3),
}
_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


# Every '{' is a place the lenient parser tries a JSON object (the model's text may hold junk
# before, between and inside its calls). Trying each with the decoder on the whole text is
# quadratic (each failure scans on, and its error message counts lines up to the failure), so
# one pass first finds, for every '{', the '}' that would close its object, and the decoder
# then reads only those spans, in growing windows, within a budget linear in the text.
_JSON_SPECIAL_RE = re.compile(r'\{+|\}+|["\\]')  # runs of braces come as one match
_JSON_DECODER = json.JSONDecoder()
_DECODE_WINDOW = 256  # first window read at a '{'; then x4 until the error is conclusive
_DECODE_LOOKAHEAD = 16  # the decoder looks at most this far past the char an error names
_DECODE_BUDGET_PER_CHAR = 8  # decoded chars per char of text, at most (plus the floor below)
_DECODE_BUDGET_MIN = 1 << 16


def _object_ends(text: str, start: int, stop: int) -> dict[int, int]:
    """For each '{' in text[start:stop], the index of the '}' that closes the object a decoder
    started at that '{' reads, where there is one (braces inside strings do not count).

    A decoder started at a '{' lexes strings from there, so a '{' inside a string for one start
    is outside every string for another. Starts whose lexers are in the same state at a char
    agree from then on: they share a *track*, a stack of levels (each level: the starts that
    close at the same '}'). The lexer has three states (outside a string, inside one, right
    after a backslash in one), so there are at most three tracks, one per state; tracks that
    reach the same state merge. One pass, O(len) plus small-to-large merges.
    """
    ends: dict[int, int] = {}
    out: list[list[int]] | None = None  # the track outside a string
    inside: list[list[int]] | None = None  # the track inside a string
    esc: list[list[int]] | None = None  # the track right after a backslash in a string
    esc_at = -1  # the char that `esc` skips
    for m in _JSON_SPECIAL_RE.finditer(text, start, stop):
        q = m.start()
        c = text[q]
        escaped = None
        if esc is not None:
            if q == esc_at:  # `esc` skips this char, then is inside a string again
                escaped, esc = esc, None
            else:  # an ordinary char was escaped
                inside, esc = _merge_levels(inside, esc), None
        if c == "{":  # a run of '{': each opens a level and starts an object
            opened = [[q + j] for j in range(m.end() - q)]
            if out is None:
                out = opened
            else:
                out.extend(opened)
        elif c == "}":  # a run of '}': each closes a level
            if out is not None:
                for j in range(min(m.end() - q, len(out))):
                    for s in out.pop():
                        ends[s] = q + j
                if not out:
                    out = None
        elif c == '"':
            out, inside = inside, out
        elif inside is not None:  # a backslash in a string
            esc, inside, esc_at = inside, None, q + 1
        if escaped is not None:
            inside = _merge_levels(inside, escaped)
    return ends


def _merge_levels(a: list[list[int]] | None, b: list[list[int]] | None) -> list[list[int]] | None:
    """Two tracks in the same lexer state as one: levels aligned at the top (starts at the same
    depth close at the same '}'), the smaller lists merged into the larger."""
    if a is None or b is None:
        return a if b is None else b
    if len(a) < len(b):
        a, b = b, a
    for k in range(1, len(b) + 1):
        x, y = a[-k], b[-k]
        if len(x) < len(y):
            a[-k], x, y = y, y, x
        x.extend(y)
    return a


_NOTHING = object()


def _decode_at(text: str, s: int, e: int) -> tuple[Any, int, int]:
    """(value, end, chars read) of the JSON object text[s:e] (``e`` past its closing '}'), or
    (_NOTHING, -1, chars read) if it does not decode: what ``raw_decode(text, s)`` gives, read
    in windows that grow only while the decoder's error may lie beyond the window."""
    n, w, cost = e - s, min(e - s, _DECODE_WINDOW), 0
    while True:
        cost += w
        try:
            obj, end = _JSON_DECODER.raw_decode(text[s : s + w])
            return obj, s + end, cost
        except RecursionError:  # as deep in any longer window
            return _NOTHING, -1, cost
        except json.JSONDecodeError as err:
            inside = err.pos < w - _DECODE_LOOKAHEAD and not err.msg.startswith("Unterminated")
            if w == n or inside:
                return _NOTHING, -1, cost
        except ValueError:  # e.g. an int past the digit limit: as long in any longer window
            return _NOTHING, -1, cost
        w = min(n, 4 * w)


def _json_objects(text: str) -> list[Any]:
    """Every top-level JSON value decodable at a '{' in ``text`` (lenient: skips junk).

    The first '{' where an object decodes gives one, the search goes on after its end: the
    result of ``raw_decode`` tried at every '{' in turn, in time linear in ``len(text)`` (past a
    budget of decoded chars, which only hostile text reaches, the rest is not searched).
    """
    first, last = text.find("{"), text.rfind("}")
    if first < 0 or last < first:
        return []
    ends = _object_ends(text, first, last + 1)
    budget = _DECODE_BUDGET_PER_CHAR * len(text) + _DECODE_BUDGET_MIN
    out: list[Any] = []
    resume = 0
    for s in sorted(ends):
        if s < resume:
            continue
        obj, end, cost = _decode_at(text, s, ends[s] + 1)
        if obj is not _NOTHING:
            out.append(obj)
            resume = end
        budget -= cost
        if budget <= 0:
            break
    return out


class QwenComputerUse:
    """The ``computer_use`` tool-call format of the Qwen2.5-VL / Qwen3-VL checkpoints.

    ``version="2.5"``: coordinates are pixels of the resized image; ``"3"``: 0..1000 relative.
    The parser accepts every action name of both versions; the system prompt lists the ones the
    version was trained on.
    """

    def __init__(self, version: Literal["2.5", "3"] = "3"):
        if version not in ("2.5", "3"):
            raise ValueError(f"Qwen computer_use version must be '2.5' or '3', got {version!r}")
        self.version = version
        self.name = "qwen25vl" if version == "2.5" else "qwen3vl"

    # -- prompt -----------------------------------------------------------------------------
    def tool_schema(self, space: CoordinateSpace) -> dict[str, Any]:
        """The ``computer_use`` function schema (the JSON a chat template renders in <tools>)."""
        names = _QWEN_ACTIONS_25 if self.version == "2.5" else _QWEN_ACTIONS_3
        res = f"{_fmt_num(space.model_w)}x{_fmt_num(space.model_h)}"
        desc = (
            "Use a mouse and keyboard to interact with a computer, and take screenshots.\n"
            "* This is an interface to a desktop GUI. You do not have access to a terminal or "
            "applications menu. You must click on desktop icons to start applications.\n"
            "* Some applications may take time to start or process actions, so you may need to "
            "wait and take successive screenshots to see the results of your actions.\n"
            f"* The screen's resolution is {res}.\n"
            "* Whenever you intend to move the cursor to click on an element like an icon, you "
            "should consult a screenshot to determine the coordinates of the element before "
            "moving the cursor.\n"
            "* Make sure to click any buttons, links, icons, etc with the cursor tip in the "
            "center of the element. Don't click boxes on their edges."
        )
        action_desc = "The action to perform. The available actions are:\n" + "\n".join(
            f"* `{n}`: {_QWEN_ACTION_DOCS[n]}" for n in names
        )
        text_req = "`action=type` and `action=answer`" if "answer" in names else "`action=type`"
        scroll_req = (
            "`action=scroll` and `action=hscroll`" if "hscroll" in names else "`action=scroll`"
        )
        props: dict[str, Any] = {
            "action": {"description": action_desc, "enum": list(names), "type": "string"},
            "keys": {"description": "Required only by `action=key`.", "type": "array"},
            "text": {"description": f"Required only by {text_req}.", "type": "string"},
            "coordinate": {
                "description": "(x, y): The x (pixels from the left edge) and y (pixels from the "
                "top edge) coordinates to move the mouse to.",
                "type": "array",
            },
            "pixels": {
                "description": "The amount of scrolling to perform. Positive values scroll up, "
                f"negative values scroll down. Required only by {scroll_req}.",
                "type": "number",
            },
            "time": {
                "description": "The seconds to wait. Required only by `action=wait`.",
                "type": "number",
            },
            "status": {
                "description": "The status of the task. Required only by `action=terminate`.",
                "type": "string",
                "enum": ["success", "failure"],
            },
        }
        return {
            "type": "function",
            "function": {
                "name": "computer_use",
                "description": desc,
                "parameters": {"properties": props, "required": ["action"], "type": "object"},
            },
        }

    def system_prompt(self, space: CoordinateSpace, api_actions: Sequence[str] = ()) -> str:
        """The Qwen (Hermes-style) tools block, as the Qwen chat templates render tools: the
        ``computer_use`` tool, then one tool per allowed API action (one JSON per line)."""
        tools = [self.tool_schema(space)] + [
            api_tool_schema(n) for n in check_api_names(api_actions)
        ]
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
            + "\n</tools>\n\nFor each function call, return a json object with function name and "
            "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )

    def default_space(
        self,
        screen_w: int,
        screen_h: int,
        resized_w: int | None = None,
        resized_h: int | None = None,
    ) -> CoordinateSpace:
        if self.version == "3":
            return CoordinateSpace.relative(screen_w, screen_h)
        if resized_w is None or resized_h is None:
            raise ValueError(
                "Qwen2.5-VL coordinates are pixels of the resized image: pass resized_w and "
                "resized_h (the smart_resize output for this screenshot)"
            )
        return CoordinateSpace.resized(screen_w, screen_h, resized_w, resized_h)

    # -- parse ------------------------------------------------------------------------------
    def parse(self, text: str, space: CoordinateSpace) -> list[Action]:
        try:
            return self._parse(text, space)
        except Exception as e:  # noqa: BLE001 -- a model's text must never crash the loop
            return [
                InvalidAction(_clip(text), f"could not parse the tool call ({type(e).__name__})")
            ]

    def _parse(self, text: str, space: CoordinateSpace) -> list[Action]:
        if not isinstance(text, str):
            return [InvalidAction(repr(text)[:200], "model output is not a string")]
        blocks = _TOOL_CALL_RE.findall(text)
        candidates: list[Any] = []
        for b in blocks or [text]:
            candidates.extend(_json_objects(b))
        calls = [
            c for c in candidates if isinstance(c, dict) and ("arguments" in c or "action" in c)
        ]
        if not calls:
            why = (
                "the <tool_call> block holds no JSON object with `arguments`"
                if blocks
                else "no <tool_call>{...}</tool_call> found"
            )
            return [InvalidAction(_clip(text), why)]
        return [self._call_to_action(c, space, _clip(json.dumps(c, default=str))) for c in calls]

    def _call_to_action(self, call: dict, space: CoordinateSpace, raw: str) -> Action:
        name = call.get("name", "computer_use")
        if not isinstance(name, str) or (name != "computer_use" and name not in API_TOOLS):
            return InvalidAction(
                raw, f"unknown tool {name!r}; tools: computer_use, {', '.join(API_TOOLS)}"
            )
        args = call.get("arguments", call)
        if isinstance(args, str):
            objs = _json_objects(args)
            args = objs[0] if objs else None
        if not isinstance(args, dict):
            return InvalidAction(raw, "`arguments` must be a JSON object")
        if name in API_TOOLS:
            return _api_action(name, args, raw)
        act = args.get("action")
        if not isinstance(act, str):
            return InvalidAction(raw, "missing `action`")
        act = act.strip().lower()
        if act in API_TOOLS:  # {"action": "run_shell", "cmd": ...} inside computer_use
            return _api_action(act, args, raw)
        if act in _CLICKS or act in ("mouse_move", "left_click_drag"):
            if "coordinate" not in args:
                return InvalidAction(raw, f"`{act}` needs `coordinate`: [x, y]")
            p = _point(raw, args["coordinate"], space, "coordinate")
            if isinstance(p, str):
                return InvalidAction(raw, p)
            if act in _CLICKS:
                button, count = _CLICKS[act]
                return Click(p[0], p[1], button, count)
            if act == "mouse_move":
                return Move(*p)
            start = args.get("start_coordinate")
            if start is None:
                return Drag(p[0], p[1])
            s = _point(raw, start, space, "start_coordinate")
            return InvalidAction(raw, s) if isinstance(s, str) else Drag(p[0], p[1], s[0], s[1])
        if act == "type":
            t = args.get("text")
            return TypeText(t) if isinstance(t, str) else InvalidAction(raw, "`type` needs `text`")
        if act == "key":
            keys = args.get("keys", args.get("key", args.get("text")))
            if isinstance(keys, str):
                keys = [keys]
            if not isinstance(keys, list):
                return InvalidAction(raw, "`key` needs `keys`: a list of key names")
            return _make_key(raw, keys)
        if act in ("scroll", "hscroll"):
            amount = _num(args.get("pixels", args.get("amount")))
            if amount is None:
                return InvalidAction(raw, f"`{act}` needs `pixels`: a number")
            x = y = None
            if args.get("coordinate") is not None:
                p = _point(raw, args["coordinate"], space, "coordinate")
                if isinstance(p, str):
                    return InvalidAction(raw, p)
                x, y = p
            # Qwen: positive pixels scroll up (vertical) / right (horizontal).
            if act == "scroll":
                return Scroll(x, y, 0.0, -amount)
            return Scroll(x, y, amount, 0.0)
        if act == "wait":
            t = args.get("time", 1.0)
            secs = _num(t)
            if secs is None or secs < 0:
                return InvalidAction(raw, "`wait` needs `time`: seconds >= 0")
            return Wait(secs)
        if act == "terminate":
            status = str(args.get("status", "success")).strip().lower()
            if status == "success":
                return Done()
            if status in ("failure", "fail", "failed"):
                return Fail()
            return InvalidAction(raw, "`terminate` needs `status`: 'success' or 'failure'")
        if act == "answer":
            t = args.get("text")
            return Answer(t) if isinstance(t, str) else InvalidAction(raw, "`answer` needs `text`")
        return InvalidAction(raw, f"unknown action {act!r}; valid: {', '.join(_QWEN_ACTIONS_3)}")

    # -- format -----------------------------------------------------------------------------
    def arguments(self, action: Action, space: CoordinateSpace) -> dict[str, Any]:
        """The ``arguments`` dict of the tool call for ``action`` (model coordinates)."""

        def pt(x: float | None, y: float | None) -> list[int]:
            if x is None or y is None:
                raise ValueError(f"{action} has no coordinate; Qwen actions need one")
            return list(space.to_model(x, y))

        match action:
            case Click(x, y, button, count):
                names = {
                    ("left", 1): "left_click",
                    ("right", 1): "right_click",
                    ("middle", 1): "middle_click",
                    ("left", 2): "double_click",
                    ("left", 3): "triple_click",
                }
                if (button, count) not in names:
                    raise ValueError(f"Qwen computer_use has no action for {action}")
                return {"action": names[(button, count)], "coordinate": pt(x, y)}
            case Move(x, y):
                return {"action": "mouse_move", "coordinate": pt(x, y)}
            case Drag(x, y, sx, sy):
                d: dict[str, Any] = {"action": "left_click_drag", "coordinate": pt(x, y)}
                if sx is not None and sy is not None:
                    d["start_coordinate"] = pt(sx, sy)
                return d
            case TypeText(text):
                return {"action": "type", "text": text}
            case Key(keys):
                return {"action": "key", "keys": list(keys)}
            case Scroll(x, y, dx, dy):
                if dx and dy:
                    raise ValueError(
                        f"{action}: one Qwen call scrolls one axis; format() writes two calls"
                    )
                d = (
                    {"action": "hscroll", "pixels": _int_or(dx)}
                    if dx
                    else {"action": "scroll", "pixels": _int_or(-dy)}
                )
                if x is not None and y is not None:
                    d["coordinate"] = pt(x, y)
                return d
            case Wait(seconds):
                return {"action": "wait", "time": _int_or(seconds)}
            case Done():
                return {"action": "terminate", "status": "success"}
            case Fail():
                return {"action": "terminate", "status": "failure"}
            case Answer(text):
                return {"action": "answer", "text": text}
        raise ValueError(f"cannot format {action!r} as a Qwen tool call")

    def format(self, action: Action, space: CoordinateSpace) -> str:
        """One ``<tool_call>`` block; a two-axis ``Scroll`` becomes two blocks (vertical, then
        horizontal), since a Qwen call scrolls one axis and ``parse`` reads every block."""
        if isinstance(action, Scroll) and action.dx and action.dy:
            parts = (
                dataclasses.replace(action, dx=0.0),
                dataclasses.replace(action, dy=0.0),
            )
            return "\n".join(self.format(a, space) for a in parts)
        name = api_name(action)
        if name is not None:
            call = {"name": name, "arguments": api_arguments(action)}
        else:
            call = {"name": "computer_use", "arguments": self.arguments(action, space)}
        return "<tool_call>\n" + json.dumps(call, ensure_ascii=False) + "\n</tool_call>"


def _int_or(v: float) -> int | float:
    return int(v) if float(v).is_integer() else float(v)


def _clip(s: str, n: int = 500) -> str:
    return s if len(s) <= n else s[:n] + "..."


# --------------------------------------------------------------------------------------------
# pyautogui code (OSWorld)
# --------------------------------------------------------------------------------------------

_FENCE_RE = re.compile(r"```(?:python|py)?\s*\n?(.*?)```", re.DOTALL)
_SPECIAL = {"WAIT": Wait(1.0), "DONE": Done(), "FAIL": Fail()}


class PyAutoGUI:
    """pyautogui code, as OSWorld agents send it. Parsed with ``ast``; nothing is executed.

    Supported: click/doubleClick/tripleClick/rightClick/middleClick, moveTo, dragTo (a ``moveTo``
    right before a ``dragTo`` becomes the drag's start), typewrite/write, press, hotkey,
    scroll/vscroll/hscroll, ``time.sleep``, ``WAIT``/``DONE``/``FAIL``, and ``answer(text)``
    (our extension: OSWorld has no answer action). Arguments must be literals.
    """

    name = "pyautogui"

    def system_prompt(self, space: CoordinateSpace, api_actions: Sequence[str] = ()) -> str:
        w, h = _fmt_num(space.model_w), _fmt_num(space.model_h)
        api = check_api_names(api_actions)
        extra = ""
        if api:
            extra = (
                "\nThis task also allows these API calls (one per line, literal arguments):\n"
                + (
                    "\n".join(
                        f"{n}({', '.join(p for p, _ in API_TOOLS[n].params)}): {API_TOOLS[n].doc}"
                        for n in api
                    )
                )
            )
        return self._prompt(w, h) + extra

    def _prompt(self, w: str, h: str) -> str:
        return (
            "You control the computer by writing Python code that uses `pyautogui`. The screen "
            f"is {w}x{h} pixels; (0, 0) is the top-left corner.\n"
            "Return one ```python ...``` block per turn using only these calls with literal "
            "arguments:\n"
            "pyautogui.click(x, y, clicks=1, button='left'), pyautogui.doubleClick(x, y), "
            "pyautogui.tripleClick(x, y), pyautogui.rightClick(x, y), pyautogui.moveTo(x, y), "
            "pyautogui.dragTo(x, y), pyautogui.typewrite('text'), pyautogui.press('enter'), "
            "pyautogui.hotkey('ctrl', 'c'), pyautogui.scroll(clicks, x=x, y=y) (positive "
            "scrolls up), pyautogui.hscroll(clicks), pyautogui.mouseDown(x, y, button='left'), "
            "pyautogui.mouseUp(x, y), pyautogui.keyDown('shift'), pyautogui.keyUp('shift'), "
            "time.sleep(seconds), answer('text').\n"
            "Or return exactly WAIT (wait and look again), DONE (the task is complete) or FAIL "
            "(the task cannot be done)."
        )

    def default_space(
        self,
        screen_w: int,
        screen_h: int,
        resized_w: int | None = None,
        resized_h: int | None = None,
    ) -> CoordinateSpace:
        return CoordinateSpace.identity(screen_w, screen_h)

    # -- parse ------------------------------------------------------------------------------
    def parse(self, text: str, space: CoordinateSpace) -> list[Action]:
        try:
            return self._parse(text, space)
        except Exception as e:  # noqa: BLE001 -- a model's text must never crash the loop
            return [InvalidAction(_clip(text), f"could not parse the code ({type(e).__name__})")]

    def _parse(self, text: str, space: CoordinateSpace) -> list[Action]:
        if not isinstance(text, str):
            return [InvalidAction(repr(text)[:200], "model output is not a string")]
        raw = _clip(text)
        fences = _FENCE_RE.findall(text)
        code = "\n".join(fences) if fences else text
        stripped = code.strip()
        if stripped in _SPECIAL:
            return [_SPECIAL[stripped]]
        if not stripped:
            return [InvalidAction(raw, "empty action; write pyautogui code or WAIT/DONE/FAIL")]
        if len(code) > 20_000:
            return [InvalidAction(raw, "code too long")]
        try:
            with warnings.catch_warnings():  # e.g. SyntaxWarning for "\-" in model text
                warnings.simplefilter("ignore")
                tree = ast.parse(code, mode="exec")
        except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
            return [InvalidAction(raw, f"not valid Python: {type(e).__name__}")]
        actions: list[Action] = []
        for stmt in tree.body:
            if isinstance(stmt, ast.Import | ast.ImportFrom):
                continue
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Name):
                if stmt.value.id in _SPECIAL:
                    actions.append(_SPECIAL[stmt.value.id])
                    continue
            if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
                return [InvalidAction(raw, "only pyautogui calls with literal arguments allowed")]
            got = self._call(stmt.value, space, raw)
            if isinstance(got, InvalidAction):
                return [got]
            for a in got:
                # moveTo(x0, y0) then dragTo(x1, y1): one drag from (x0, y0).
                if (
                    isinstance(a, Drag)
                    and a.start_x is None
                    and actions
                    and isinstance(actions[-1], Move)
                ):
                    m = actions.pop()
                    a = Drag(a.x, a.y, m.x, m.y)
                actions.append(a)
        if not actions:
            return [InvalidAction(raw, "no action in the code")]
        return actions

    def _call(
        self, call: ast.Call, space: CoordinateSpace, raw: str
    ) -> list[Action] | InvalidAction:
        f = call.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            mod, fn = f.value.id, f.attr
        elif isinstance(f, ast.Name):
            mod, fn = "", f.id
        else:
            return InvalidAction(raw, "only calls like pyautogui.click(...) are allowed")
        try:
            args = [ast.literal_eval(a) for a in call.args]
            kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg}
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return InvalidAction(raw, f"arguments of {fn}() must be literals (numbers, strings)")
        if len(call.keywords) != len(kwargs):
            return InvalidAction(raw, f"{fn}() does not accept **kwargs")
        if mod == "time" and fn == "sleep":
            s = _num(args[0] if args else kwargs.get("secs"))
            return [Wait(s)] if s is not None and s >= 0 else InvalidAction(raw, "bad sleep time")
        if mod == "" and fn == "answer":
            t = args[0] if args else kwargs.get("text")
            return [Answer(t)] if isinstance(t, str) else InvalidAction(raw, "answer needs text")
        if mod == "" and fn in API_TOOLS:
            params = [p for p, _ in API_TOOLS[fn].params]
            if len(args) > len(params):
                return InvalidAction(raw, f"{fn}() takes {len(params)} arguments, got {len(args)}")
            bound = dict(zip(params, args, strict=False))
            dup = [k for k in kwargs if k in bound]
            if dup:
                return InvalidAction(raw, f"{fn}() got multiple values for {dup[0]!r}")
            got = _api_action(fn, {**bound, **kwargs}, raw)
            return got if isinstance(got, InvalidAction) else [got]
        if mod != "pyautogui":
            return InvalidAction(raw, f"unsupported call {mod + '.' if mod else ''}{fn}()")
        handler = _PYAUTOGUI.get(fn)
        if handler is None:
            return InvalidAction(raw, f"unsupported pyautogui function {fn!r}")
        try:
            return handler(_bind(fn, args, kwargs), space, raw)
        except _Bad as e:
            return InvalidAction(raw, str(e))

    # -- format -----------------------------------------------------------------------------
    def format(self, action: Action, space: CoordinateSpace) -> str:
        def xy(x: float | None, y: float | None) -> str:
            if x is None or y is None:
                return ""
            mx, my = space.to_model(x, y)
            return f"{mx}, {my}"

        match action:
            case Click(x, y, button, count):
                p = xy(x, y)
                sep = ", " if p else ""
                if button == "left" and count == 1:
                    return f"pyautogui.click({p})"
                if button == "left" and count == 2:
                    return f"pyautogui.doubleClick({p})"
                if button == "left" and count == 3:
                    return f"pyautogui.tripleClick({p})"
                if count == 1:
                    return f"pyautogui.{button}Click({p})"
                return f"pyautogui.click({p}{sep}clicks={count}, button={button!r})"
            case Move(x, y):
                return f"pyautogui.moveTo({xy(x, y)})"
            case Drag(x, y, sx, sy):
                pre = (
                    f"pyautogui.moveTo({xy(sx, sy)})\n" if sx is not None and sy is not None else ""
                )
                return pre + f"pyautogui.dragTo({xy(x, y)}, button='left')"
            case TypeText(text):
                return f"pyautogui.typewrite({text!r})"
            case Key(keys):
                names = [PYAUTOGUI_KEY_NAMES.get(k, k) for k in keys]
                if len(names) == 1:
                    return f"pyautogui.press({names[0]!r})"
                return "pyautogui.hotkey(" + ", ".join(repr(k) for k in names) + ")"
            case Scroll(x, y, dx, dy):
                where = (
                    f", x={space.to_model(x, y)[0]}, y={space.to_model(x, y)[1]}"
                    if (x is not None and y is not None)
                    else ""
                )
                lines = []
                if dy:
                    lines.append(f"pyautogui.scroll({_fmt_num(-dy)}{where})")
                if dx:
                    lines.append(f"pyautogui.hscroll({_fmt_num(dx)}{where})")
                return "\n".join(lines) or f"pyautogui.scroll(0{where})"
            case MouseDown(x, y, button) | MouseUp(x, y, button):
                fn = "mouseDown" if isinstance(action, MouseDown) else "mouseUp"
                p = xy(x, y)
                return f"pyautogui.{fn}({p}{', ' if p else ''}button={button!r})"
            case KeyDown(key) | KeyUp(key):
                fn = "keyDown" if isinstance(action, KeyDown) else "keyUp"
                return f"pyautogui.{fn}({PYAUTOGUI_KEY_NAMES.get(key, key)!r})"
            case Wait(seconds):
                return f"time.sleep({_fmt_num(seconds)})"
            case Done():
                return "DONE"
            case Fail():
                return "FAIL"
            case Answer(text):
                return f"answer({text!r})"
        name = api_name(action)
        if name is not None:
            return f"{name}(" + ", ".join(repr(v) for v in api_arguments(action).values()) + ")"
        raise ValueError(f"cannot format {action!r} as pyautogui code")


class _Bad(Exception):
    pass


# pyautogui's parameters, in positional order, of the functions parsed here (hotkey takes *keys).
_TAIL = ("logScreenshot", "_pause")
_CLICK_1 = ("x", "y", "interval", "duration", "tween", *_TAIL)  # leftClick / rightClick / ...
_CLICK_N = ("x", "y", "interval", "button", "duration", "tween", *_TAIL)  # doubleClick / triple
_BUTTON = ("x", "y", "button", "duration", "tween", *_TAIL)  # mouseDown / mouseUp
_SCROLL = ("clicks", "x", "y", *_TAIL)
_TYPE = ("message", "interval", *_TAIL)
_KEY_HOLD = ("key", *_TAIL)
_PYAUTOGUI_PARAMS: dict[str, tuple[str, ...]] = {
    "click": ("x", "y", "clicks", "interval", "button", "duration", "tween", *_TAIL),
    "leftClick": _CLICK_1,
    "doubleClick": _CLICK_N,
    "tripleClick": _CLICK_N,
    "rightClick": _CLICK_1,
    "middleClick": _CLICK_1,
    "moveTo": ("x", "y", "duration", "tween", *_TAIL),
    "dragTo": ("x", "y", "duration", "tween", "button", *_TAIL, "mouseDownUp"),
    "typewrite": _TYPE,
    "write": _TYPE,
    "press": ("keys", "presses", "interval", *_TAIL),
    "scroll": _SCROLL,
    "vscroll": _SCROLL,
    "hscroll": _SCROLL,
    "mouseDown": _BUTTON,
    "mouseUp": _BUTTON,
    "keyDown": _KEY_HOLD,
    "keyUp": _KEY_HOLD,
}


def _bind(fn: str, args: list, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by parameter name, bound by pyautogui's signature of ``fn``."""
    if fn == "hotkey":  # hotkey(*keys, interval=0.0, ...); it ignores other keywords
        return {**kwargs, "keys": list(args)}
    params = _PYAUTOGUI_PARAMS[fn]
    if len(args) > len(params):
        raise _Bad(f"{fn}() takes at most {len(params)} positional arguments, got {len(args)}")
    bound = dict(zip(params, args, strict=False))
    for k, v in kwargs.items():
        if k not in params:
            raise _Bad(f"{fn}() got an unexpected keyword argument {k!r}")
        if k in bound:
            raise _Bad(f"{fn}() got multiple values for argument {k!r}")
        bound[k] = v
    return bound


def _xy(a: dict, space: CoordinateSpace) -> tuple[float, float] | None:
    """The screen point of pyautogui's x, y (or x=(x, y)); None when both are absent."""
    x, y = a.get("x"), a.get("y")
    if isinstance(x, list | tuple):
        if len(x) != 2 or y is not None:
            raise _Bad(f"a point is x, y or x=(x, y); got x={x!r}, y={y!r}")
        x, y = x
    if x is None and y is None:
        return None
    fx, fy = _num(x), _num(y)
    if fx is None or fy is None:
        raise _Bad(f"coordinates must be numbers, got x={x!r}, y={y!r}")
    if not space.in_bounds(fx, fy):
        raise _Bad(
            f"({fx:g}, {fy:g}) is outside the screen (0..{space.model_w:g} x 0..{space.model_h:g})"
        )
    return space.to_screen(fx, fy)


def _click_handler(button: str, count: int | None) -> Callable:
    def h(a, space, raw):
        p = _xy(a, space)
        n = count if count is not None else a.get("clicks", 1)
        b = a.get("button", button)  # only click / doubleClick / tripleClick take a button
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 3:
            raise _Bad(f"clicks must be 1, 2 or 3, got {n!r}")
        if b not in BUTTONS:
            raise _Bad(f"button must be one of {BUTTONS}, got {b!r}")
        return [Click(p[0] if p else None, p[1] if p else None, b, n)]

    return h


def _move(a, space, raw):
    p = _xy(a, space)
    if p is None:
        raise _Bad("moveTo needs x, y")
    return [Move(*p)]


def _drag(a, space, raw):
    p = _xy(a, space)
    if p is None:
        raise _Bad("dragTo needs x, y")
    if a.get("button", "left") != "left":
        raise _Bad("only left-button drags are supported")
    return [Drag(*p)]


def _type(a, space, raw):
    msg = a.get("message")
    if isinstance(msg, str):
        return [TypeText(msg)]
    if isinstance(msg, list | tuple) and msg and all(isinstance(k, str) for k in msg):
        out = []
        for k in msg:
            key = _make_key(raw, [k]) if len(k) > 1 else Key((normalize_key(k) or k,))
            if isinstance(key, InvalidAction):
                raise _Bad(key.reason)
            out.append(key)
        return out
    raise _Bad("typewrite needs a string (or a list of key names)")


def _press(a, space, raw):
    keys = a.get("keys")
    presses = a.get("presses", 1)
    if not isinstance(presses, int) or isinstance(presses, bool) or not 1 <= presses <= 50:
        raise _Bad(f"presses must be an int in 1..50, got {presses!r}")
    names = [keys] if isinstance(keys, str) else keys
    if not isinstance(names, list | tuple) or not names:
        raise _Bad("press needs a key name")
    out = []
    for n in names:
        k = _make_key(raw, [n])
        if isinstance(k, InvalidAction):
            raise _Bad(k.reason)
        out.append(k)
    return out * presses  # press(keys, presses=n): one Key per press, in pyautogui's order


def _hotkey(a, space, raw):
    names = a["keys"]
    if len(names) == 1 and isinstance(names[0], list | tuple):
        names = list(names[0])
    if not names:
        raise _Bad("hotkey needs key names")
    keys = []
    for n in names:
        k = normalize_key(n) if isinstance(n, str) else None
        if k is None:
            raise _Bad(f"unknown key {n!r}")
        keys.append(k)
    return [Key(tuple(keys))]


def _scroll_handler(horizontal: bool) -> Callable:
    def h(a, space, raw):
        clicks = _num(a.get("clicks"))
        if clicks is None:
            raise _Bad("scroll needs clicks: a number")
        x, y = _xy(a, space) or (None, None)
        # pyautogui: positive clicks scroll up / right.
        return [Scroll(x, y, clicks, 0.0) if horizontal else Scroll(x, y, 0.0, -clicks)]

    return h


def _button_handler(cls: type) -> Callable:
    def h(a, space, raw):
        p = _xy(a, space)
        b = a.get("button", "left")
        if b not in BUTTONS:
            raise _Bad(f"button must be one of {BUTTONS}, got {b!r}")
        return [cls(p[0] if p else None, p[1] if p else None, b)]

    return h


def _key_hold_handler(cls: type) -> Callable:
    def h(a, space, raw):
        name = a.get("key")
        k = normalize_key(name) if isinstance(name, str) else None
        if k is None:
            raise _Bad(f"unknown key {name!r}; use names like 'shift', 'ctrl', 'a'")
        return [cls(k)]

    return h


# Handlers take (arguments bound by name, space, raw) and return actions or raise _Bad.
_PYAUTOGUI: dict[str, Callable] = {
    "click": _click_handler("left", None),
    "leftClick": _click_handler("left", 1),
    "doubleClick": _click_handler("left", 2),
    "tripleClick": _click_handler("left", 3),
    "rightClick": _click_handler("right", 1),
    "middleClick": _click_handler("middle", 1),
    "moveTo": _move,
    "dragTo": _drag,
    "typewrite": _type,
    "write": _type,
    "press": _press,
    "hotkey": _hotkey,
    "scroll": _scroll_handler(False),
    "vscroll": _scroll_handler(False),
    "hscroll": _scroll_handler(True),
    "mouseDown": _button_handler(MouseDown),
    "mouseUp": _button_handler(MouseUp),
    "keyDown": _key_hold_handler(KeyDown),
    "keyUp": _key_hold_handler(KeyUp),
}

# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------

FORMATS = ("qwen25vl", "qwen3vl", "pyautogui")


def get_format(name: str) -> ActionFormat:
    """The action format called ``name``: "qwen25vl", "qwen3vl" or "pyautogui"."""
    if name == "qwen25vl":
        return QwenComputerUse("2.5")
    if name == "qwen3vl":
        return QwenComputerUse("3")
    if name == "pyautogui":
        return PyAutoGUI()
    raise ValueError(f"unknown action format {name!r}; valid: {', '.join(FORMATS)}")


def parse_action(text: str, fmt: str | ActionFormat, space: CoordinateSpace) -> list[Action]:
    """Model output -> actions in screen pixels (never raises; [InvalidAction] on garbage)."""
    f = get_format(fmt) if isinstance(fmt, str) else fmt
    return f.parse(text, space)


def format_action(action: Action, fmt: str | ActionFormat, space: CoordinateSpace) -> str:
    """An action in screen pixels -> model output text in ``fmt``."""
    f = get_format(fmt) if isinstance(fmt, str) else fmt
    return f.format(action, space)


def describe(action: Action) -> str:
    """A short human-readable line for logs and trajectory viewers."""
    match action:
        case Click(x, y, button, count):
            kind = {1: "click", 2: "double-click", 3: "triple-click"}.get(count, f"{count}x click")
            where = f" at ({x:.0f}, {y:.0f})" if x is not None and y is not None else ""
            return f"{button} {kind}{where}" if button != "left" else f"{kind}{where}"
        case MouseDown(x, y, button) | MouseUp(x, y, button):
            what = "press" if isinstance(action, MouseDown) else "release"
            where = f" at ({x:.0f}, {y:.0f})" if x is not None and y is not None else ""
            return f"{what} {button} button{where}"
        case KeyDown(key) | KeyUp(key):
            return f"{'hold' if isinstance(action, KeyDown) else 'release'} {key}"
        case InvalidAction(_, reason):
            return f"invalid action: {reason}"
    name = api_name(action)
    if name is not None:
        args = ", ".join(_clip(repr(v), 80) for v in api_arguments(action).values())
        return f"API {name}({args})"
    return repr(action)


def action_to_dict(action: Action) -> dict[str, Any]:
    """``{"type": class name, **fields}``: an action as JSON (wire formats, logs)."""
    return {"type": type(action).__name__, **dataclasses.asdict(action)}


_ACTION_CLASSES = {
    c.__name__: c
    for c in (Click, Move, Drag, TypeText, Key, Scroll, MouseDown, MouseUp, KeyDown, KeyUp)
    + (Wait, Done, Fail, Answer, InvalidAction, *API_ACTION_TYPES)
}


def action_from_dict(d: Any) -> Action:
    """The action ``action_to_dict`` wrote; anything else is an InvalidAction (never raises)."""
    if not isinstance(d, dict) or d.get("type") not in _ACTION_CLASSES:
        return InvalidAction(_clip(repr(d)), "not an action dict ({'type': ..., fields})")
    cls = _ACTION_CLASSES[d["type"]]
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name in d:
            v = d[f.name]
            kw[f.name] = tuple(v) if isinstance(v, list) else v
    for k, v in kw.items():
        ok = (
            (v is None or _num(v) is not None and not isinstance(v, str))
            if k in ("x", "y", "start_x", "start_y", "dx", "dy", "seconds")
            else v in BUTTONS
            if k == "button"
            else (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 3)
            if k == "count"
            else isinstance(v, tuple) and all(isinstance(x, str) for x in v)
            if k == "keys"
            else isinstance(v, str)
        )
        if not ok:
            return InvalidAction(_clip(repr(d)), f"bad {d['type']} field {k}={v!r}")
    try:
        return cls(**kw)
    except TypeError as e:
        return InvalidAction(_clip(repr(d)), f"bad {d['type']} fields: {e}")
