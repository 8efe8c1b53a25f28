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

* ``"qwen35"``: the same ``computer_use`` tool (Qwen3-VL's actions and 0..1000 coordinates) in
  Qwen3.5's XML call syntax::

      <tool_call>
      <function=computer_use>
      <parameter=action>
      left_click
      </parameter>
      <parameter=coordinate>
      [x, y]
      </parameter>
      </function>
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

The package: `core` (the action types, key names, `CoordinateSpace`, the `ActionFormat`
protocol), `api` (API actions as tools), one module a format (`qwen`: the Qwen-VL tool call for
"qwen25vl" and "qwen3vl"; `qwen35`: "qwen35"; `pyautogui_code`: "pyautogui"), `registry`
(formats by name) and `records` (actions as JSON dicts and log lines). Import names from the
package:
``from cua_jax.actions import Click, get_format``.
"""

from __future__ import annotations

from cua_jax.actions.api import (
    API_ACTION_TYPES,
    API_TOOLS,
    BROWSER_API,
    MAX_API_TEXT,
    VM_API,
    ApiTool,
    api_arguments,
    api_name,
    api_refusal,
    api_tool_schema,
    check_api_names,
)
from cua_jax.actions.core import (
    BUTTONS,
    KEY_NAMES,
    MAX_SCROLL_NOTCHES,
    PYAUTOGUI_KEY_NAMES,
    TERMINAL_ACTIONS,
    Action,
    ActionFormat,
    Answer,
    Button,
    Click,
    CoordinateSpace,
    Done,
    Drag,
    Fail,
    Fill,
    InvalidAction,
    Key,
    KeyDown,
    KeyUp,
    MouseDown,
    MouseUp,
    Move,
    OpenApp,
    OpenUrl,
    RunShell,
    Scroll,
    SelectOption,
    SetCell,
    TypeText,
    Wait,
    WriteFile,
    clamp_scroll,
    normalize_key,
)
from cua_jax.actions.pyautogui_code import PyAutoGUI

# Read by tests/test_actions.py (the JSON search and the Qwen action table).
from cua_jax.actions.qwen import (  # noqa: F401
    _DECODE_BUDGET_MIN,
    _DECODE_BUDGET_PER_CHAR,
    _QWEN_ACTION_DOCS,
    QwenComputerUse,
    _json_objects,
)
from cua_jax.actions.qwen35 import Qwen35ComputerUse
from cua_jax.actions.records import (
    action_from_dict,
    action_to_dict,
    describe,
)
from cua_jax.actions.registry import (
    FORMATS,
    format_action,
    get_format,
    parse_action,
)

__all__ = [
    "API_ACTION_TYPES",
    "API_TOOLS",
    "Action",
    "ActionFormat",
    "Answer",
    "ApiTool",
    "BROWSER_API",
    "BUTTONS",
    "Button",
    "Click",
    "CoordinateSpace",
    "Done",
    "Drag",
    "FORMATS",
    "Fail",
    "Fill",
    "InvalidAction",
    "KEY_NAMES",
    "Key",
    "KeyDown",
    "KeyUp",
    "MAX_API_TEXT",
    "MAX_SCROLL_NOTCHES",
    "MouseDown",
    "MouseUp",
    "Move",
    "OpenApp",
    "OpenUrl",
    "PYAUTOGUI_KEY_NAMES",
    "PyAutoGUI",
    "QwenComputerUse",
    "Qwen35ComputerUse",
    "RunShell",
    "Scroll",
    "SelectOption",
    "SetCell",
    "TERMINAL_ACTIONS",
    "TypeText",
    "VM_API",
    "Wait",
    "WriteFile",
    "action_from_dict",
    "action_to_dict",
    "api_arguments",
    "api_name",
    "api_refusal",
    "api_tool_schema",
    "check_api_names",
    "clamp_scroll",
    "describe",
    "format_action",
    "get_format",
    "normalize_key",
    "parse_action",
]
