"""Action parsing/formatting: round trips, hand-written model outputs, and fuzzing."""

import ast
import importlib.util
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cua_jax import actions as A
from cua_jax.actions import (
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
)

SCREEN = (1280, 720)
# One of every action type (and every click variant), in screen pixels on integer model points.
EVERY_ACTION = [
    Click(100.0, 200.0),
    Click(100.0, 200.0, "right"),
    Click(100.0, 200.0, "middle"),
    Click(100.0, 200.0, "left", 2),
    Click(100.0, 200.0, "left", 3),
    Move(640.0, 360.0),
    Drag(300.0, 400.0),
    Drag(300.0, 400.0, 10.0, 20.0),
    TypeText("hello 'world' \"x\"\nnext"),
    TypeText("ünïcode ✓"),
    Key(("enter",)),
    Key(("ctrl", "shift", "t")),
    Scroll(50.0, 60.0, 0.0, 3.0),
    Scroll(50.0, 60.0, 0.0, -2.0),
    Scroll(50.0, 60.0, 4.0, 0.0),
    Scroll(None, None, 0.0, 5.0),
    Wait(2.0),
    Wait(0.5),
    Done(),
    Fail(),
    Answer("42 apples"),
]
# One of every API action (ComputerRL's API-GUI paradigm), with quotes and newlines in strings.
EVERY_API_ACTION = [
    A.RunShell("mkdir -p ~/a && echo 'ok' \"q\""),
    A.OpenApp("text editor"),
    A.WriteFile("~/notes/todo.txt", "buy milk\nwalk dog\n"),
    A.SetCell("~/data/sheet.csv", "B3", "42"),
    A.OpenUrl("http://cua.local/builtin/task.html?t=nav-link&seed=3"),
    A.Fill("Email", "ada@example.com"),
    A.SelectOption("Size", "XL"),
]
SPACES = {
    "identity": CoordinateSpace.identity(*SCREEN),
    "qwen3_relative": CoordinateSpace.relative(*SCREEN),
    "qwen25_resized": CoordinateSpace.resized(*SCREEN, 1288, 728),
}


def _close(a, b, tol: float) -> bool:
    """Same action, coordinates within ``tol`` pixels (model-space rounding)."""
    if type(a) is not type(b):
        return False
    for f in a.__dataclass_fields__:
        va, vb = getattr(a, f), getattr(b, f)
        if f in ("x", "y", "start_x", "start_y") and va is not None and vb is not None:
            if abs(va - vb) > tol:
                return False
        elif va != vb:
            return False
    return True


@pytest.mark.parametrize("fmt", A.FORMATS)
@pytest.mark.parametrize("space_name", list(SPACES))
@pytest.mark.parametrize("action", EVERY_ACTION, ids=repr)
def test_round_trip(fmt, space_name, action):
    space = SPACES[space_name]
    text = A.format_action(action, fmt, space)
    parsed = A.parse_action(text, fmt, space)
    assert len(parsed) == 1, (text, parsed)
    # One model unit in screen pixels bounds the rounding error.
    tol = 0.5 * max(space.screen_w / space.model_w, space.screen_h / space.model_h) + 1e-6
    assert _close(parsed[0], action, tol), (text, parsed[0], action)


def test_exact_round_trip_identity():
    for fmt in A.FORMATS:
        space = SPACES["identity"]
        for a in EVERY_ACTION:
            assert A.parse_action(A.format_action(a, fmt, space), fmt, space) == [a]


@pytest.mark.parametrize("fmt", A.FORMATS)
@pytest.mark.parametrize("action", EVERY_API_ACTION, ids=repr)
def test_api_action_round_trip(fmt, action):
    space = SPACES["qwen25_resized"]
    text = A.format_action(action, fmt, space)
    assert A.parse_action(text, fmt, space) == [action], text
    assert A.api_name(action) in A.API_TOOLS and A.api_name(Click(1.0, 2.0)) is None
    assert A.describe(action).startswith("API " + A.api_name(action))


def test_api_actions_as_models_write_them():
    space = SPACES["qwen3_relative"]
    q = '<tool_call>\n{"name": "run_shell", "arguments": {"cmd": "ls ~/"}}\n</tool_call>'
    assert A.parse_action("Let me list it.\n" + q, "qwen3vl", space) == [A.RunShell("ls ~/")]
    # two calls in one reply, one GUI and one API
    two = (
        '<tool_call>{"name": "fill", "arguments": {"field_label": "Name", "text": "Bob"}}'
        '</tool_call><tool_call>{"name": "computer_use", "arguments": {"action": "left_click", '
        '"coordinate": [500, 500]}}</tool_call>'
    )
    assert A.parse_action(two, "qwen3vl", space) == [A.Fill("Name", "Bob"), Click(640.0, 360.0)]
    # the API name as a computer_use action, a number as a cell value
    inner = '{"name": "computer_use", "arguments": {"action": "set_cell", "file": "a.csv", '
    inner += '"cell": "A1", "value": 7}}'
    assert A.parse_action(inner, "qwen3vl", space) == [A.SetCell("a.csv", "A1", "7")]
    code = "select_option('Size', option='XL')\nopen_url(url='http://cua.local/')"
    assert A.parse_action(code, "pyautogui", space) == [
        A.SelectOption("Size", "XL"),
        A.OpenUrl("http://cua.local/"),
    ]


@pytest.mark.parametrize(
    "fmt,text,reason_part",
    [
        ("qwen3vl", '<tool_call>{"name": "run_shell", "arguments": {}}</tool_call>', "needs `cmd`"),
        (
            "qwen3vl",
            '<tool_call>{"name": "fill", "arguments": {"label": "a"}}</tool_call>',
            "`text`",
        ),
        ("qwen3vl", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "unknown tool"),
        ("qwen3vl", '<tool_call>{"name": "open_app", "arguments": "x"}</tool_call>', "object"),
        (
            "qwen3vl",
            '<tool_call>{"name": "open_url", "arguments": {"url": "a", "x": 1}}</tool_call>',
            "unexpected",
        ),
        ("pyautogui", "run_shell('a', 'b')", "takes 1 arguments"),
        ("pyautogui", "write_file('a', text=['x'])", "needs `text`"),
        ("pyautogui", "fill('a', 'b', label='c')", "multiple values"),
        ("pyautogui", "open_url(f'{x}')", "literals"),
        # what the trained VM smoke policy wrote: an empty command (the server answered 400,
        # which made the episode an infrastructure fault)
        (
            "qwen3vl",
            '<tool_call>{"name": "run_shell", "arguments": {"cmd": ""}}</tool_call>',
            "`cmd` is empty",
        ),
        ("pyautogui", "open_app('  ')", "`name` is empty"),
        ("pyautogui", "fill('', 'b')", "`label` is empty"),
    ],
)
def test_api_invalid(fmt, text, reason_part):
    (out,) = A.parse_action(text, fmt, SPACES["qwen3_relative"])
    assert isinstance(out, InvalidAction) and reason_part in out.reason, out


def test_api_empty_text_is_an_action():
    (out,) = A.parse_action("write_file('~/a.txt', '')", "pyautogui", SPACES["identity"])
    assert out == A.WriteFile("~/a.txt", "")  # an empty file is a file


def test_api_text_cap():
    long = "x" * (A.MAX_API_TEXT + 1)
    call = {"name": "write_file", "arguments": {"path": "a", "text": long}}
    (out,) = A.parse_action(json.dumps(call), "qwen3vl", SPACES["identity"])
    assert isinstance(out, InvalidAction) and "longer than" in out.reason


@pytest.mark.parametrize("fmt", A.FORMATS)
def test_system_prompt_lists_only_the_allowed_api_tools(fmt):
    f, space = A.get_format(fmt), SPACES["qwen25_resized"]
    plain = f.system_prompt(space)
    assert plain == f.system_prompt(space, ())
    assert not any(n in plain for n in A.API_TOOLS)
    vm = f.system_prompt(space, A.VM_API)
    assert all(n in vm for n in A.VM_API) and not any(n in vm for n in A.BROWSER_API)
    one = f.system_prompt(space, ["fill"])
    assert "fill" in one and "select_option" not in one and "run_shell" not in one
    if fmt != "pyautogui":  # each tool is one JSON per line inside <tools>
        block = one.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
        names = [json.loads(line)["function"]["name"] for line in block]
        assert names == ["computer_use", "fill"]
    with pytest.raises(ValueError, match="unknown API action"):
        f.system_prompt(space, ["rm_rf"])


@pytest.mark.parametrize("fmt", A.FORMATS)
def test_two_axis_scroll_formats_as_two_calls(fmt):
    """A Qwen call (and a pyautogui scroll) moves one axis: a diagonal scroll, which the browser
    oracle emits on pages larger than a small viewport, is written as two calls, vertical first."""
    space = SPACES["identity"]
    text = A.format_action(Scroll(50.0, 60.0, -2.0, 3.0), fmt, space)
    assert A.parse_action(text, fmt, space) == [
        Scroll(50.0, 60.0, 0.0, 3.0),
        Scroll(50.0, 60.0, -2.0, 0.0),
    ]
    with pytest.raises(ValueError, match="one axis"):  # one call's arguments cannot hold both
        A.QwenComputerUse("3").arguments(Scroll(50.0, 60.0, -2.0, 3.0), space)


def test_qwen_real_outputs():
    """Strings in the shape the released checkpoints emit (thinking text, newlines)."""
    q3 = A.get_format("qwen3vl")
    s3 = CoordinateSpace.relative(*SCREEN)
    out = (
        "I will click the Submit button.\n<tool_call>\n"
        '{"name": "computer_use", "arguments": {"action": "left_click", "coordinate": [250, 500]}}'
        "\n</tool_call>"
    )
    assert q3.parse(out, s3) == [Click(320.0, 360.0)]
    two = (
        '<tool_call>{"name": "computer_use", "arguments": {"action": "type", "text": "hi"}}'
        '</tool_call><tool_call>{"name": "computer_use", "arguments": {"action": "key", '
        '"keys": ["Return"]}}</tool_call>'
    )
    assert q3.parse(two, s3) == [TypeText("hi"), Key(("enter",))]
    term = (
        '<tool_call>{"name":"computer_use","arguments":{"action":"terminate","status":"failure"}}'
    )
    assert q3.parse(term, s3) == [Fail()]  # a missing </tool_call> (truncated output) is fine
    q25 = A.get_format("qwen25vl")
    s25 = q25.default_space(*SCREEN, resized_w=640, resized_h=360)
    drag = '<tool_call>{"name": "computer_use", "arguments": {"action": "left_click_drag", '
    drag += '"coordinate": [320, 180]}}</tool_call>'
    assert q25.parse(drag, s25) == [Drag(640.0, 360.0)]
    keys = '<tool_call>{"name": "computer_use", "arguments": {"action": "key", '
    keys += '"keys": ["ctrl+a"]}}</tool_call>'
    assert q25.parse(keys, s25) == [Key(("ctrl", "a"))]
    scroll = '<tool_call>{"name": "computer_use", "arguments": {"action": "scroll", "pixels": -5}}'
    assert q25.parse(scroll, s25) == [Scroll(None, None, 0.0, 5.0)]  # negative pixels = down


@pytest.mark.parametrize(
    "text,reason_part",
    [
        ("", "no <tool_call>"),
        ("<tool_call>not json</tool_call>", "no JSON object"),
        (
            '<tool_call>{"name": "computer_use", "arguments": {"action": "fly"}}</tool_call>',
            "unknown action",
        ),
        (
            '<tool_call>{"name": "computer_use", "arguments": {"action": "left_click"}}'
            "</tool_call>",
            "needs `coordinate`",
        ),
        (
            '<tool_call>{"name": "computer_use", "arguments": {"action": "left_click", '
            '"coordinate": [5000, 10]}}</tool_call>',
            "outside the screen",
        ),
        (
            '<tool_call>{"name": "computer_use", "arguments": {"action": "left_click", '
            '"coordinate": ["a", 10]}}</tool_call>',
            "two numbers",
        ),
        (
            '<tool_call>{"name": "browser", "arguments": {"action": "left_click"}}</tool_call>',
            "unknown tool",
        ),
        (
            '<tool_call>{"name": "computer_use", "arguments": {"action": "key", '
            '"keys": ["hyperspace"]}}</tool_call>',
            "unknown key",
        ),
    ],
)
def test_qwen_invalid(text, reason_part):
    (a,) = A.parse_action(text, "qwen3vl", CoordinateSpace.relative(*SCREEN))
    assert isinstance(a, InvalidAction) and reason_part in a.reason, a


def test_pyautogui_osworld_style():
    space = CoordinateSpace.identity(1920, 1080)
    code = (
        "```python\nimport pyautogui, time\npyautogui.click(100, 200)\ntime.sleep(0.5)\n"
        "pyautogui.typewrite('abc', interval=0.1)\npyautogui.press('enter')\n"
        "pyautogui.hotkey('ctrl', 's')\npyautogui.click(x=5, y=6, clicks=2)\n"
        "pyautogui.rightClick((7, 8))\npyautogui.press(['tab', 'tab'])\n```"
    )
    assert A.parse_action(code, "pyautogui", space) == [
        Click(100.0, 200.0),
        Wait(0.5),
        TypeText("abc"),
        Key(("enter",)),
        Key(("ctrl", "s")),
        Click(5.0, 6.0, "left", 2),
        Click(7.0, 8.0, "right", 1),
        Key(("tab",)),
        Key(("tab",)),
    ]
    assert A.parse_action("WAIT", "pyautogui", space) == [Wait(1.0)]
    assert (
        A.parse_action("pyautogui.press('a', presses=3)", "pyautogui", space) == [Key(("a",))] * 3
    )
    assert A.parse_action("pyautogui.click()", "pyautogui", space) == [Click(None, None)]


# pyautogui (and OSWorld's computer_13) only: Qwen's computer_use has no press / release calls.
HOLD_ACTIONS = [
    A.MouseDown(100.0, 200.0),
    A.MouseDown(None, None, "right"),
    A.MouseUp(300.0, 400.0, "middle"),
    A.MouseUp(),
    A.KeyDown("shift"),
    A.KeyUp("ctrl"),
]


@pytest.mark.parametrize("action", HOLD_ACTIONS, ids=repr)
def test_press_and_release_actions(action):
    space = SPACES["identity"]
    text = A.format_action(action, "pyautogui", space)
    assert A.parse_action(text, "pyautogui", space) == [action]
    for fmt in ("qwen25vl", "qwen3vl"):
        with pytest.raises(ValueError, match="cannot format"):
            A.format_action(action, fmt, space)


def test_pyautogui_hold_sequences_as_osworld_agents_write_them():
    space = CoordinateSpace.identity(1920, 1080)
    code = (
        "pyautogui.keyDown('shift')\npyautogui.click(10, 20)\npyautogui.keyUp('Shift')\n"
        "pyautogui.mouseDown(30, 40)\npyautogui.moveTo(50, 60)\n"
        "pyautogui.mouseUp(x=70, y=80, button='left')\npyautogui.mouseDown(button='right')"
    )
    assert A.parse_action(code, "pyautogui", space) == [
        A.KeyDown("shift"),
        Click(10.0, 20.0),
        A.KeyUp("shift"),
        A.MouseDown(30.0, 40.0),
        Move(50.0, 60.0),
        A.MouseUp(70.0, 80.0),
        A.MouseDown(None, None, "right"),
    ]
    for bad, why in [
        ("pyautogui.keyDown('nokey')", "unknown key"),
        ("pyautogui.mouseDown(1, 2, button='side')", "button must be"),
    ]:
        (a,) = A.parse_action(bad, "pyautogui", space)
        assert isinstance(a, InvalidAction) and why in a.reason, a


@pytest.mark.parametrize(
    "code,reason_part",
    [
        ("import os\nos.system('rm -rf /')", "unsupported call"),
        ("x = 5", "only pyautogui calls"),
        ("pyautogui.click(x, y)", "literals"),
        ("pyautogui.click(5000, 10)", "outside the screen"),
        ("pyautogui.moveRel(5, 5)", "unsupported pyautogui function"),
        ("pyautogui.click(1, 2, clicks=9)", "clicks must be"),
        ("def f(:", "not valid Python"),
        ("__import__('os').system('x')", "only calls like"),
        ("pyautogui.hotkey('ctrl', 'nokey')", "unknown key"),
    ],
)
def test_pyautogui_invalid(code, reason_part):
    (a,) = A.parse_action(code, "pyautogui", CoordinateSpace.identity(*SCREEN))
    assert isinstance(a, InvalidAction) and reason_part in a.reason, a


def test_coordinate_space():
    s = CoordinateSpace.relative(1280, 720)
    assert s.to_screen(1000, 1000) == (1279.0, 719.0)  # clamped into the screen
    assert s.to_screen(500, 250) == (640.0, 180.0)
    assert s.to_model(640.0, 180.0) == (500, 250)
    with pytest.raises(ValueError, match="positive"):
        CoordinateSpace(0, 10, 10, 10)
    with pytest.raises(ValueError, match="resized_w"):
        A.get_format("qwen25vl").default_space(100, 100)
    with pytest.raises(ValueError, match="valid: qwen25vl"):
        A.get_format("claude")


def test_system_prompts_mention_resolution():
    s3 = A.get_format("qwen3vl").system_prompt(CoordinateSpace.relative(*SCREEN))
    assert "1000x1000" in s3 and '"triple_click"' in s3 and "<tool_call>" in s3
    tools = s3.split("<tools>\n")[1].split("\n</tools>")[0]
    assert json.loads(tools)["function"]["name"] == "computer_use"
    s25 = A.get_format("qwen25vl").system_prompt(CoordinateSpace.resized(*SCREEN, 1288, 728))
    assert "1288x728" in s25 and '"answer"' not in s25
    assert "1280x720" in A.get_format("pyautogui").system_prompt(CoordinateSpace.identity(*SCREEN))


def test_key_normalization():
    assert A.normalize_key("Return") == "enter"
    assert A.normalize_key("ArrowUp") == "up"
    assert A.normalize_key("Page_Down") == "pagedown"
    assert A.normalize_key("A") == "A"
    assert A.normalize_key("F5") == "f5"
    assert A.normalize_key("warp") is None


_FUZZ = settings(max_examples=10_000, deadline=None, suppress_health_check=list(HealthCheck))
_PREFIXES = st.sampled_from(
    [
        "",
        "<tool_call>",
        '<tool_call>{"name": "computer_use", "arguments": ',
        "pyautogui.",
        "```python\n",
        "{",
        "pyautogui.click(",
        '{"action": "',
        '<tool_call>{"name": "run_shell", "arguments": {"cmd": ',
        '<tool_call>{"name": "fill", "arguments": ',
        '{"name": "set_cell", "arguments": {"file": "a.csv", "cell": ',
        "write_file(",
        "select_option('Size', ",
        "open_url(",
    ]
)


@_FUZZ
@given(prefix=_PREFIXES, body=st.text(max_size=200))
def test_fuzz_never_raises(prefix, body):
    text = prefix + body
    for fmt in A.FORMATS:
        space = CoordinateSpace.resized(*SCREEN, 1288, 728)
        out = A.parse_action(text, fmt, space)
        assert out and all(isinstance(a, A.Action) for a in out)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12,
)


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    action=st.sampled_from(list(A._QWEN_ACTION_DOCS)) | st.text(max_size=8),
    args=st.dictionaries(
        st.sampled_from(
            ["coordinate", "keys", "text", "pixels", "time", "status", "start_coordinate"]
        ),
        _JSON,
        max_size=4,
    ),
)
def test_fuzz_structured_qwen(action, args):
    """Well-formed JSON with arbitrary argument values: still never raises."""
    call = {"name": "computer_use", "arguments": {"action": action, **args}}
    text = "<tool_call>" + json.dumps(call) + "</tool_call>"
    out = A.parse_action(text, "qwen3vl", CoordinateSpace.relative(*SCREEN))
    assert out and all(isinstance(a, A.Action) for a in out)


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    name=st.sampled_from(list(A.API_TOOLS)) | st.text(max_size=8),
    args=st.dictionaries(
        st.sampled_from(
            ["cmd", "name", "path", "text", "file", "cell", "value", "url", "label", "option"]
            + ["field_label", "command", "action"]
        ),
        _JSON,
        max_size=4,
    ),
)
def test_fuzz_structured_api_calls(name, args):
    """API tool calls with arbitrary JSON arguments (both formats): never raise."""
    call = {"name": name, "arguments": args}
    out = A.parse_action(
        "<tool_call>" + json.dumps(call) + "</tool_call>", "qwen3vl", SPACES["qwen3_relative"]
    )
    assert out and all(isinstance(a, A.Action) for a in out)
    kw = ", ".join(f"{k}={v!r}" for k, v in args.items() if k.isidentifier())
    out = A.parse_action(f"{name}({kw})", "pyautogui", SPACES["identity"])
    assert out and all(isinstance(a, A.Action) for a in out)


# -- '+' as a key ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "chord,keys",
    [
        ("ctrl++", ("ctrl", "+")),
        ("Ctrl + +", ("ctrl", "+")),
        ("ctrl+shift++", ("ctrl", "shift", "+")),
        ("ctrl+plus", ("ctrl", "+")),
        ("+", ("+",)),
        ("ctrl+shift+=", ("ctrl", "shift", "=")),
        ("ctrl+-", ("ctrl", "-")),
    ],
)
def test_plus_key_in_chords(chord, keys):
    """'ctrl++' (zoom in) keeps its '+' in every format that reads chords from one string."""
    call = {"name": "computer_use", "arguments": {"action": "key", "keys": [chord]}}
    text = "<tool_call>" + json.dumps(call) + "</tool_call>"
    for fmt in ("qwen25vl", "qwen3vl"):
        assert A.parse_action(text, fmt, SPACES["qwen25_resized"]) == [Key(keys)], fmt
    space = SPACES["identity"]
    assert A.parse_action(f"pyautogui.press({chord!r})", "pyautogui", space) == [Key(keys)]
    hot = "pyautogui.hotkey(" + ", ".join(repr(k) for k in keys) + ")"
    assert A.parse_action(hot, "pyautogui", space) == [Key(keys)]


@pytest.mark.parametrize("fmt", A.FORMATS)
@pytest.mark.parametrize("action", [Key(("+",)), Key(("ctrl", "+")), Key(("ctrl", "shift", "+"))])
def test_plus_key_round_trip(fmt, action):
    space = SPACES["identity"]
    assert A.parse_action(A.format_action(action, fmt, space), fmt, space) == [action]


# -- pyautogui key names -----------------------------------------------------------------------


def _pyautogui_key_names() -> list[str]:
    """pyautogui.KEY_NAMES, read from its source (importing pyautogui needs an X display)."""
    spec = importlib.util.find_spec("pyautogui")
    if spec is None or spec.origin is None:
        pytest.skip("pyautogui is not installed")
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "KEY_NAMES":
            return ast.literal_eval(node.value)
    raise AssertionError("KEY_NAMES not found in pyautogui's source")


def test_pyautogui_format_writes_pyautogui_key_names():
    """OSWorld runs the code: a key name pyautogui does not know presses nothing."""
    known = set(_pyautogui_key_names())
    space = SPACES["identity"]
    fmt = A.get_format("pyautogui")
    assert fmt.format(Key(("meta",)), space) == "pyautogui.press('win')"
    assert fmt.format(Key(("menu",)), space) == "pyautogui.press('apps')"
    assert fmt.format(Key(("ctrl", "meta")), space) == "pyautogui.hotkey('ctrl', 'win')"
    assert fmt.format(A.KeyDown("meta"), space) == "pyautogui.keyDown('win')"
    for k in sorted(A.KEY_NAMES) + ["+", "a", "A", "/"]:
        for action in (Key((k,)), Key(("ctrl", k)), A.KeyDown(k), A.KeyUp(k)):
            text = fmt.format(action, space)
            call = ast.parse(text, mode="eval").body
            names = {ast.literal_eval(a) for a in call.args}
            assert {n for n in names if len(n) > 1} <= known, (k, text)  # 'A' is a character
            assert fmt.parse(text, space) == [action], (k, text)


def test_pyautogui_key_aliases():
    """pyautogui's own names that have a canonical equivalent parse to it."""
    expect = {
        "apps": "menu",
        "win": "meta",
        "winleft": "meta",
        "winright": "meta",
        "command": "meta",
        "prtscr": "printscreen",
        "prntscrn": "printscreen",
        "prtsc": "printscreen",
        "print": "printscreen",
        "optionleft": "alt",
        "optionright": "alt",
        "escape": "esc",
        "del": "delete",
        "return": "enter",
        "pgup": "pageup",
        "pgdn": "pagedown",
        "add": "+",
        "subtract": "-",
        "plus": "+",
        **{f"num{i}": str(i) for i in range(10)},
    }
    for name, canon in expect.items():
        assert A.normalize_key(name) == canon, name
    space = SPACES["identity"]
    assert A.parse_action("pyautogui.hotkey('winleft', 'apps')", "pyautogui", space) == [
        Key(("meta", "menu"))
    ]
    assert A.parse_action("pyautogui.press('num7')", "pyautogui", space) == [Key(("7",))]
    assert A.parse_action("pyautogui.keyDown('prntscrn')", "pyautogui", space) == [
        A.KeyDown("printscreen")
    ]


# -- pyautogui positional arguments ------------------------------------------------------------


@pytest.mark.parametrize(
    "positional,keyword,expected",
    [
        (
            "pyautogui.press('down', 3)",
            "pyautogui.press(keys='down', presses=3)",
            [Key(("down",))] * 3,
        ),
        (
            "pyautogui.press(['tab', 'enter'], 2, 0.1)",
            "pyautogui.press(['tab', 'enter'], presses=2, interval=0.1)",
            [Key(("tab",)), Key(("enter",))] * 2,
        ),
        (
            "pyautogui.click(100, 200, 1, 0.0, 'right')",
            "pyautogui.click(x=100, y=200, clicks=1, interval=0.0, button='right')",
            [Click(100.0, 200.0, "right", 1)],
        ),
        (
            "pyautogui.click(100, 200, 2, 0.1, 'middle', 0.5)",
            "pyautogui.click(100, 200, clicks=2, button='middle', duration=0.5)",
            [Click(100.0, 200.0, "middle", 2)],
        ),
        (
            "pyautogui.doubleClick(100, 200, 0.1, 'right')",
            "pyautogui.doubleClick(x=100, y=200, interval=0.1, button='right')",
            [Click(100.0, 200.0, "right", 2)],
        ),
        (
            "pyautogui.tripleClick((100, 200), None, 0.1)",
            "pyautogui.tripleClick((100, 200), interval=0.1)",
            [Click(100.0, 200.0, "left", 3)],
        ),
        (
            "pyautogui.rightClick(100, 200, 0.1)",
            "pyautogui.rightClick(x=100, y=200, interval=0.1)",
            [Click(100.0, 200.0, "right", 1)],
        ),
        (
            "pyautogui.moveTo(10, 20, 0.5)",
            "pyautogui.moveTo(x=10, y=20, duration=0.5)",
            [Move(10.0, 20.0)],
        ),
        (
            "pyautogui.dragTo(10, 20, 0.5)",
            "pyautogui.dragTo(x=10, y=20, duration=0.5, button='left')",
            [Drag(10.0, 20.0)],
        ),
        (
            "pyautogui.mouseDown(10, 20, 'right')",
            "pyautogui.mouseDown(x=10, y=20, button='right')",
            [A.MouseDown(10.0, 20.0, "right")],
        ),
        (
            "pyautogui.mouseUp(None, None, 'middle')",
            "pyautogui.mouseUp(button='middle')",
            [A.MouseUp(None, None, "middle")],
        ),
        (
            "pyautogui.scroll(-3, 10, 20)",
            "pyautogui.scroll(clicks=-3, x=10, y=20)",
            [Scroll(10.0, 20.0, 0.0, 3.0)],
        ),
        (
            "pyautogui.hscroll(2, 10, 20)",
            "pyautogui.hscroll(2, x=10, y=20)",
            [Scroll(10.0, 20.0, 2.0, 0.0)],
        ),
        (
            "pyautogui.typewrite('hi', 0.1)",
            "pyautogui.typewrite(message='hi', interval=0.1)",
            [TypeText("hi")],
        ),
        (
            "pyautogui.write('hi', 0.1)",
            "pyautogui.write(message='hi', interval=0.1)",
            [TypeText("hi")],
        ),
        (
            "pyautogui.hotkey('ctrl', 'c')",
            "pyautogui.hotkey('ctrl', 'c', interval=0.1)",
            [Key(("ctrl", "c"))],
        ),
        (
            "pyautogui.keyDown('shift')",
            "pyautogui.keyDown(key='shift')",
            [A.KeyDown("shift")],
        ),
        ("pyautogui.keyUp('shift')", "pyautogui.keyUp(key='shift')", [A.KeyUp("shift")]),
    ],
)
def test_pyautogui_positional_arguments(positional, keyword, expected):
    """Arguments bind by pyautogui's real signatures: positional and keyword forms agree."""
    space = SPACES["identity"]
    assert A.parse_action(positional, "pyautogui", space) == expected
    assert A.parse_action(keyword, "pyautogui", space) == expected


@pytest.mark.parametrize(
    "code,reason_part",
    [
        ("pyautogui.press('a', 'x')", "presses must be"),
        ("pyautogui.press('a', 0)", "presses must be"),
        ("pyautogui.click(1, 2, 1, 0.0, 'left', 0.0, None, None, True, 5)", "at most 9 positional"),
        ("pyautogui.click(1, 2, x=3)", "multiple values"),
        ("pyautogui.rightClick(1, 2, button='left')", "unexpected keyword"),
        ("pyautogui.click(1, 2, 1, 0.0, 'side')", "button must be"),
        ("pyautogui.click((1, 2), 3)", "(x, y)"),
        ("pyautogui.keyDown('shift', key='ctrl')", "multiple values"),
    ],
)
def test_pyautogui_bad_arguments(code, reason_part):
    (a,) = A.parse_action(code, "pyautogui", CoordinateSpace.identity(*SCREEN))
    assert isinstance(a, InvalidAction) and reason_part in a.reason, a


# --------------------------------------------------------------------------------------------
# The lenient JSON search: the same answer as raw_decode at every '{', in linear work
# --------------------------------------------------------------------------------------------


def _json_objects_reference(text):
    """The search as first written: ``raw_decode`` tried at every '{' of the whole text
    (quadratic: each failure scans on, and its error message counts lines up to the failure)."""
    dec = json.JSONDecoder()
    out, i = [], text.find("{")
    while 0 <= i < len(text):
        try:
            obj, end = dec.raw_decode(text, i)
        except (ValueError, RecursionError):
            i = text.find("{", i + 1)
            continue
        out.append(obj)
        i = text.find("{", end)
    return out


# Pieces that make strings start and end at different places for different '{' (quotes,
# escapes), keywords and numbers cut at a window edge, and strings longer than the first window.
_JSON_PIECES = st.sampled_from(
    ["{", "}", '"', "\\", ":", ",", "a", "1", "[", "]", " ", '{"a": ', '"x"', '\\"', "true"]
    + ["tr", "1e5", "-Infinity", "NaN", "\\u00", "\\u0041", '{"action": "wait"}', " " * 250]
    + ['"' + "y" * 300 + '"', '{"k": "' + "z" * 600 + '"}']
)


@settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck))
@given(pieces=st.lists(_JSON_PIECES, max_size=40))
def test_json_search_matches_raw_decode_at_every_brace(pieces):
    text = "".join(pieces)
    assert A._json_objects(text) == _json_objects_reference(text)


_MIB = 2**20
_CALL = '<tool_call>{"name": "computer_use", "arguments": {"action": "wait", "time": 2}}'
_HOSTILE = {
    "open_braces": "{" * _MIB,
    "open_braces_one_close": "{" * (_MIB - 1) + "}",
    "nested_braces": "{" * (_MIB // 2) + "}" * (_MIB // 2),
    "open_action_strings": '{"action":"' * (_MIB // 11),
    "open_action_strings_close": '{"action":"' * (_MIB // 11) + "}",
    "deep_objects": '{"a":' * (_MIB // 6) + "1" + "}" * (_MIB // 6),
    "quotes_and_escapes": '{"\\"' * (_MIB // 4) + "}",
    "nested_tool_call_tags": "<tool_call>{" * (_MIB // 12) + "}" + "</tool_call>" * 8,
    "pyautogui_click_calls": "pyautogui.click(" * (_MIB // 16),
    "pyautogui_fenced": "```python\n" + "pyautogui.click(1, 2)\n" * (_MIB // 22) + "```",
}


@pytest.mark.timeout(60)  # minutes per string before the linear search
@pytest.mark.parametrize("shape", list(_HOSTILE))
def test_hostile_mib_strings_parse_as_invalid(shape, monkeypatch):
    """1 MiB of hostile text is an invalid action (not a hang), and the JSON decoder reads at
    most a fixed multiple of the text (the budget), in at most one call per '{'."""
    text = _HOSTILE[shape]
    calls, chars = [0], [0]

    class CountingDecoder(json.JSONDecoder):
        def raw_decode(self, s, idx=0):
            calls[0] += 1
            chars[0] += len(s)
            return super().raw_decode(s, idx)

    monkeypatch.setattr(A.qwen, "_JSON_DECODER", CountingDecoder())
    space = CoordinateSpace.relative(*SCREEN)
    for fmt in A.FORMATS:
        (a,) = A.parse_action(text, fmt, space)
        assert isinstance(a, InvalidAction), (fmt, a)
    reads_per_char = A._DECODE_BUDGET_PER_CHAR + A._DECODE_BUDGET_MIN / len(text)
    assert chars[0] <= 2 * (reads_per_char * len(text) + 4 * len(text))  # two Qwen formats
    assert calls[0] <= 2 * 4 * text.count("{")  # windows grow x4: a few reads per '{' at most
    # A real call after the junk is still found.
    assert A.parse_action(text + "\n" + _CALL, "qwen3vl", space)[-1] == Wait(2.0)
