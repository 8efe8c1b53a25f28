"""The formats by name: `get_format`, and parse/format through a format given by name."""

from __future__ import annotations

from cua_jax.actions.core import Action, ActionFormat, CoordinateSpace
from cua_jax.actions.pyautogui_code import PyAutoGUI
from cua_jax.actions.qwen import QwenComputerUse
from cua_jax.actions.qwen35 import Qwen35ComputerUse

FORMATS = ("qwen25vl", "qwen3vl", "qwen35", "pyautogui")


def get_format(name: str) -> ActionFormat:
    """The action format called ``name``: "qwen25vl", "qwen3vl", "qwen35" or "pyautogui"."""
    if name == "qwen25vl":
        return QwenComputerUse("2.5")
    if name == "qwen3vl":
        return QwenComputerUse("3")
    if name == "qwen35":
        return Qwen35ComputerUse()
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
