"""API actions as tools (ComputerRL's API-GUI paradigm): the tool table, its schema for the
system prompt, and turning a tool call's arguments into an action. Shared by both formats.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

from cua_jax.actions.core import (
    Action,
    Fill,
    InvalidAction,
    OpenApp,
    OpenUrl,
    RunShell,
    SelectOption,
    SetCell,
    WriteFile,
    format_number,
    to_number,
)


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


def api_action(name: str, args: Any, raw: str) -> Action:
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
            f = to_number(v)
            v = None if f is None else format_number(f)
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
