"""The action space's shared core: the typed actions (GUI and API), key names, the coordinate
space between a model's frame and screen pixels, and the `ActionFormat` protocol every format
implements. Every other module of `cua_jax.actions` builds on this one; it imports none of them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
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


GuiAction = Click | Move | Drag | TypeText | Key | Scroll | MouseDown | MouseUp | KeyDown | KeyUp
ControlAction = Wait | Done | Fail | Answer | InvalidAction
ApiAction = RunShell | OpenApp | WriteFile | SetCell | OpenUrl | Fill | SelectOption
Action = GuiAction | ControlAction | ApiAction  # the three kinds, named for readers
TERMINAL_ACTIONS = (Done, Fail, Answer)


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


def key_action(raw: str, names: Sequence[Any]) -> Key | InvalidAction:
    """A Key action from a model's key names (one name may be a chord: "ctrl+c"), or the
    InvalidAction naming the bad or unknown key."""
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


def to_number(v: Any) -> float | None:
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


def screen_point(raw: str, v: Any, space: CoordinateSpace, what: str) -> tuple[float, float] | str:
    """Model coordinate value -> screen point, or an error reason string."""
    if isinstance(v, str):  # "[12, 34]" or "12, 34" or "(12,34)"
        nums = re.findall(r"-?\d+(?:\.\d+)?", v)
        v = [float(n) for n in nums]
    if not isinstance(v, list | tuple) or len(v) != 2:
        return f"`{what}` must be [x, y], got {v!r}"
    x, y = to_number(v[0]), to_number(v[1])
    if x is None or y is None:
        return f"`{what}` must hold two numbers, got {v!r}"
    if not space.in_bounds(x, y):
        return (
            f"`{what}` {[x, y]} is outside the screen (0..{space.model_w:g} x 0..{space.model_h:g})"
        )
    return space.to_screen(x, y)


def format_number(v: float) -> str:
    """A number as a model writes it: "12" for a whole number, else the shortest form."""
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


def int_if_whole(v: float) -> int | float:
    """An int for a whole number (how it is written back into JSON), else the float."""
    return int(v) if float(v).is_integer() else float(v)


def clip_text(s: str, n: int = 500) -> str:
    """`s` cut to `n` characters (and "...") for an InvalidAction's raw text or a log line."""
    return s if len(s) <= n else s[:n] + "..."
