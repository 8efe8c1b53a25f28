"""The Qwen-VL ``computer_use`` tool-call format ("qwen25vl", "qwen3vl"): its system prompt,
parser (a bounded search for JSON objects in the text) and formatter.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from typing import Any, Literal

from cua_jax.actions.api import (
    API_TOOLS,
    api_action,
    api_arguments,
    api_name,
    api_tool_schema,
    check_api_names,
)
from cua_jax.actions.core import (
    KEY_NAMES,
    Action,
    Answer,
    Click,
    CoordinateSpace,
    Done,
    Drag,
    Fail,
    InvalidAction,
    Key,
    Move,
    Scroll,
    TypeText,
    Wait,
    clip_text,
    format_number,
    int_if_whole,
    key_action,
    screen_point,
    to_number,
)

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
# Pieces of the action grammars (`action_regex`, here and in `qwen35`): integer coordinates
# (0..1000 relative, or pixels below 10,000), a number of at most 6 digits and 3 decimals, a
# key name as a JSON string (canonical, or one printable ASCII character, " and \ escaped).
COORD_RELATIVE = r"(?:0|[1-9][0-9]{0,2}|1000)"
COORD_PIXELS = r"(?:0|[1-9][0-9]{0,3})"
NUMBER = r"(?:0|[1-9][0-9]{0,5})(?:\.[0-9]{1,3})?"
KEY_STRING = r'"(?:' + "|".join(sorted(KEY_NAMES)) + r'|[ !#-\[\]-~]|\\"|\\\\)"'
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
        res = f"{format_number(space.model_w)}x{format_number(space.model_h)}"
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

    # -- grammar ----------------------------------------------------------------------------
    def action_regex(self, api_actions: Sequence[str] = ()) -> str:
        """The language of the calls ``format`` writes, as one regex (``cua_jax.sampler.grammar``
        constrains decoding to it): one ``<tool_call>`` block of a ``computer_use`` action of
        this version (or of one of ``api_actions``' tools), with ``json.dumps``' separators.
        Coordinates are integers (0..1000 for "3", pixels below 10,000 for "2.5"), numbers
        have at most 6 digits and 3 decimals, key names canonical (``KEY_NAMES``) or one
        printable character, other strings any JSON string."""
        names = _QWEN_ACTIONS_25 if self.version == "2.5" else _QWEN_ACTIONS_3
        coord = COORD_RELATIVE if self.version == "3" else COORD_PIXELS
        pt = rf"\[{coord}, {coord}\]"
        num = NUMBER
        text = r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"'

        key = KEY_STRING

        def q(s: str) -> str:
            return re.escape(json.dumps(s))

        args = {
            **{n: rf'{q(n)}, "coordinate": {pt}' for n in (*_CLICKS, "mouse_move")},
            "left_click_drag": rf'{q("left_click_drag")}, "coordinate": {pt}'
            rf'(?:, "start_coordinate": {pt})?',
            "type": rf'{q("type")}, "text": {text}',
            "answer": rf'{q("answer")}, "text": {text}',
            "key": rf'{q("key")}, "keys": \[{key}(?:, {key})*\]',
            "scroll": rf'{q("scroll")}, "pixels": -?{num}(?:, "coordinate": {pt})?',
            "hscroll": rf'{q("hscroll")}, "pixels": -?{num}(?:, "coordinate": {pt})?',
            "wait": rf'{q("wait")}, "time": {num}',
            "terminate": rf'{q("terminate")}, "status": "(?:success|failure)"',
        }
        calls = [
            r'\{"name": "computer_use", "arguments": \{"action": (?:'
            + "|".join(args[n] for n in names)
            + r")\}\}"
        ]
        for name in check_api_names(api_actions):
            params = ", ".join(f"{q(p)}: {text}" for p, _ in API_TOOLS[name].params)
            calls.append(rf'\{{"name": {q(name)}, "arguments": \{{{params}\}}\}}')
        return r"<tool_call>\n(?:" + "|".join(calls) + r")\n</tool_call>"

    # -- parse ------------------------------------------------------------------------------
    def parse(self, text: str, space: CoordinateSpace) -> list[Action]:
        try:
            return self._parse(text, space)
        except Exception as e:  # noqa: BLE001 -- a model's text must never crash the loop
            return [
                InvalidAction(
                    clip_text(text), f"could not parse the tool call ({type(e).__name__})"
                )
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
            return [InvalidAction(clip_text(text), why)]
        return [
            self._call_to_action(c, space, clip_text(json.dumps(c, default=str))) for c in calls
        ]

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
            return api_action(name, args, raw)
        act = args.get("action")
        if not isinstance(act, str):
            return InvalidAction(raw, "missing `action`")
        act = act.strip().lower()
        if act in API_TOOLS:  # {"action": "run_shell", "cmd": ...} inside computer_use
            return api_action(act, args, raw)
        if act in _CLICKS or act in ("mouse_move", "left_click_drag"):
            if "coordinate" not in args:
                return InvalidAction(raw, f"`{act}` needs `coordinate`: [x, y]")
            p = screen_point(raw, args["coordinate"], space, "coordinate")
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
            s = screen_point(raw, start, space, "start_coordinate")
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
            return key_action(raw, keys)
        if act in ("scroll", "hscroll"):
            amount = to_number(args.get("pixels", args.get("amount")))
            if amount is None:
                return InvalidAction(raw, f"`{act}` needs `pixels`: a number")
            x = y = None
            if args.get("coordinate") is not None:
                p = screen_point(raw, args["coordinate"], space, "coordinate")
                if isinstance(p, str):
                    return InvalidAction(raw, p)
                x, y = p
            # Qwen: positive pixels scroll up (vertical) / right (horizontal).
            if act == "scroll":
                return Scroll(x, y, 0.0, -amount)
            return Scroll(x, y, amount, 0.0)
        if act == "wait":
            t = args.get("time", 1.0)
            secs = to_number(t)
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
                    {"action": "hscroll", "pixels": int_if_whole(dx)}
                    if dx
                    else {"action": "scroll", "pixels": int_if_whole(-dy)}
                )
                if x is not None and y is not None:
                    d["coordinate"] = pt(x, y)
                return d
            case Wait(seconds):
                return {"action": "wait", "time": int_if_whole(seconds)}
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
