"""Actions as records: JSON dicts for wire formats and logs (`action_to_dict`,
`action_from_dict`) and one-line descriptions (`describe`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from cua_jax.actions.api import API_ACTION_TYPES, api_arguments, api_name
from cua_jax.actions.core import (
    BUTTONS,
    Action,
    Answer,
    Click,
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
    to_number,
)


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
        args = ", ".join(clip_text(repr(v), 80) for v in api_arguments(action).values())
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
        return InvalidAction(clip_text(repr(d)), "not an action dict ({'type': ..., fields})")
    cls = _ACTION_CLASSES[d["type"]]
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name in d:
            v = d[f.name]
            kw[f.name] = tuple(v) if isinstance(v, list) else v
    for k, v in kw.items():
        ok = (
            (v is None or to_number(v) is not None and not isinstance(v, str))
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
            return InvalidAction(clip_text(repr(d)), f"bad {d['type']} field {k}={v!r}")
    try:
        return cls(**kw)
    except TypeError as e:
        return InvalidAction(clip_text(repr(d)), f"bad {d['type']} fields: {e}")
