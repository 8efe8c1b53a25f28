"""Qwen3.5's tool-call format ("qwen35"): the ``computer_use`` tool of Qwen3-VL (0..1000
relative coordinates, the same actions) called in the XML syntax Qwen3.5's chat template writes
and its checkpoints were trained on, instead of Hermes JSON:

    <tool_call>
    <function=computer_use>
    <parameter=action>
    left_click
    </parameter>
    <parameter=coordinate>
    [500, 300]
    </parameter>
    </function>
    </tool_call>

A parameter's value is written as the template writes it (``tojson`` for lists and objects,
the plain string otherwise: numbers as Python prints them, text as it is), one newline on each
side. transformers' response parser for the family (``cli/serving/utils.py``, model types
``qwen3_5`` / ``qwen3_5_moe``) reads the same markup; the tests parse our output with it.

The system prompt lists the tools as Qwen3.5's template does (a ``<tools>`` block of one JSON
schema a line, leading the system turn) and explains the call syntax in a few lines of its own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from cua_jax.actions.api import (
    API_TOOLS,
    api_arguments,
    api_name,
    api_tool_schema,
    check_api_names,
)
from cua_jax.actions.core import (
    Action,
    CoordinateSpace,
    InvalidAction,
    Scroll,
    clip_text,
)
from cua_jax.actions.qwen import (
    _CLICKS,
    _QWEN_ACTIONS_3,
    COORD_RELATIVE,
    KEY_STRING,
    NUMBER,
    QwenComputerUse,
)

_CALL_RE = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAM_RE = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)
# Parameters whose value is text, kept as written; the others are read as JSON when they parse.
_TEXT_PARAMS = frozenset({"action", "text", "status"})


def _value_text(value: Any) -> str:
    """A parameter value as Qwen3.5's template writes it."""
    if isinstance(value, dict | list | tuple):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def _value_of(name: str, raw: str, text_params: frozenset[str]) -> Any:
    """A parameter's value from its text: one newline the template adds on each side removed;
    JSON where it parses (numbers, lists), except for text parameters."""
    v = raw[1:] if raw.startswith("\n") else raw
    v = v[:-1] if v.endswith("\n") else v
    if name in text_params:
        return v
    try:
        return json.loads(v)
    except ValueError:
        return v.strip()


class Qwen35ComputerUse(QwenComputerUse):
    """The ``computer_use`` tool in Qwen3.5's XML call syntax (see the module docstring)."""

    def __init__(self):
        super().__init__("3")
        self.name = "qwen35"

    # -- prompt -----------------------------------------------------------------------------
    def system_prompt(self, space: CoordinateSpace, api_actions: Sequence[str] = ()) -> str:
        tools = [self.tool_schema(space)] + [
            api_tool_schema(n) for n in check_api_names(api_actions)
        ]
        example = self.format_call(
            "computer_use", {"action": "left_click", "coordinate": [500, 300]}
        )
        return (
            "# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
            + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
            + "\n</tools>\n\nTo call a function, reply with one block like this one, a "
            "<parameter=...> element for each argument (lists as JSON, other values as plain "
            "text):\n\n" + example
        )

    # -- parse ------------------------------------------------------------------------------
    def _parse(self, text: str, space: CoordinateSpace) -> list[Action]:
        if not isinstance(text, str):
            return [InvalidAction(repr(text)[:200], "model output is not a string")]
        calls = _CALL_RE.findall(text)
        if not calls:
            return [InvalidAction(clip_text(text), "no <tool_call><function=...> found")]
        out = []
        for name, body in calls:
            name = name.strip()
            tool = API_TOOLS.get(name)
            text_params = frozenset(p for p, _ in tool.params) if tool else _TEXT_PARAMS
            args = {
                k.strip(): _value_of(k.strip(), v, text_params) for k, v in _PARAM_RE.findall(body)
            }
            raw = clip_text(f"<function={name}>{body}</function>")
            out.append(self._call_to_action({"name": name, "arguments": args}, space, raw))
        return out

    # -- format -----------------------------------------------------------------------------
    @staticmethod
    def format_call(name: str, arguments: dict[str, Any]) -> str:
        """One call as Qwen3.5's template renders an assistant's ``tool_calls`` entry."""
        params = "".join(
            f"<parameter={k}>\n{_value_text(v)}\n</parameter>\n" for k, v in arguments.items()
        )
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"

    def format(self, action: Action, space: CoordinateSpace) -> str:
        """One call; a two-axis ``Scroll`` is two (vertical, then horizontal)."""
        if isinstance(action, Scroll) and action.dx and action.dy:
            return super().format(action, space)  # the two calls, each through this format
        name = api_name(action)
        if name is not None:
            return self.format_call(name, api_arguments(action))
        return self.format_call("computer_use", self.arguments(action, space))

    # -- grammar ----------------------------------------------------------------------------
    def action_regex(self, api_actions: Sequence[str] = ()) -> str:
        """The language of the calls ``format`` writes (see ``QwenComputerUse.action_regex``):
        one block, its parameters in ``arguments``' order; text values any text without a
        ``</parameter>`` or a newline at either end."""
        pt = rf"\[{COORD_RELATIVE}, {COORD_RELATIVE}\]"
        num = NUMBER
        # text: no '<' (so no closing tag inside), no newline at the ends
        text = r"(?:[^<\n](?:[^<]*[^<\n])?)?"
        key = KEY_STRING

        def p(name: str, value: str) -> str:
            return rf"<parameter={name}>\n{value}\n</parameter>\n"

        def act(n: str) -> str:
            return p("action", n)

        args = {
            **{n: act(n) + p("coordinate", pt) for n in (*_CLICKS, "mouse_move")},
            "left_click_drag": act("left_click_drag")
            + p("coordinate", pt)
            + rf"(?:{p('start_coordinate', pt)})?",
            "type": act("type") + p("text", text),
            "answer": act("answer") + p("text", text),
            "key": act("key") + p("keys", rf"\[{key}(?:, {key})*\]"),
            "scroll": act("scroll") + p("pixels", rf"-?{num}") + rf"(?:{p('coordinate', pt)})?",
            "hscroll": act("hscroll") + p("pixels", rf"-?{num}") + rf"(?:{p('coordinate', pt)})?",
            "wait": act("wait") + p("time", num),
            "terminate": act("terminate") + p("status", "(?:success|failure)"),
        }
        calls = ["<function=computer_use>\\n(?:" + "|".join(args[n] for n in _QWEN_ACTIONS_3) + ")"]
        for name in check_api_names(api_actions):
            params = "".join(p(q, text) for q, _ in API_TOOLS[name].params)
            calls.append(rf"<function={name}>\n{params}")
        return r"<tool_call>\n(?:" + "|".join(calls) + r")</function>\n</tool_call>"
