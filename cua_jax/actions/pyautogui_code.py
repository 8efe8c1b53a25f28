"""The pyautogui format (OSWorld): Python code of ``pyautogui`` calls plus ``WAIT`` / ``DONE`` /
``FAIL``, parsed with :mod:`ast` and never executed; and the formatter back to such code.
"""

from __future__ import annotations

import ast
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from cua_jax.actions.api import API_TOOLS, api_action, api_arguments, api_name, check_api_names
from cua_jax.actions.core import (
    BUTTONS,
    PYAUTOGUI_KEY_NAMES,
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
    Scroll,
    TypeText,
    Wait,
    clip_text,
    format_number,
    key_action,
    normalize_key,
    to_number,
)

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
        w, h = format_number(space.model_w), format_number(space.model_h)
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
            return [
                InvalidAction(clip_text(text), f"could not parse the code ({type(e).__name__})")
            ]

    def _parse(self, text: str, space: CoordinateSpace) -> list[Action]:
        if not isinstance(text, str):
            return [InvalidAction(repr(text)[:200], "model output is not a string")]
        raw = clip_text(text)
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
            s = to_number(args[0] if args else kwargs.get("secs"))
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
            got = api_action(fn, {**bound, **kwargs}, raw)
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
                    lines.append(f"pyautogui.scroll({format_number(-dy)}{where})")
                if dx:
                    lines.append(f"pyautogui.hscroll({format_number(dx)}{where})")
                return "\n".join(lines) or f"pyautogui.scroll(0{where})"
            case MouseDown(x, y, button) | MouseUp(x, y, button):
                fn = "mouseDown" if isinstance(action, MouseDown) else "mouseUp"
                p = xy(x, y)
                return f"pyautogui.{fn}({p}{', ' if p else ''}button={button!r})"
            case KeyDown(key) | KeyUp(key):
                fn = "keyDown" if isinstance(action, KeyDown) else "keyUp"
                return f"pyautogui.{fn}({PYAUTOGUI_KEY_NAMES.get(key, key)!r})"
            case Wait(seconds):
                return f"time.sleep({format_number(seconds)})"
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
    fx, fy = to_number(x), to_number(y)
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
            key = key_action(raw, [k]) if len(k) > 1 else Key((normalize_key(k) or k,))
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
        k = key_action(raw, [n])
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
        clicks = to_number(a.get("clicks"))
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
