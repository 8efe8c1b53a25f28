"""OSWorld task JSON, setup steps, getters, metrics and action translation (no X needed).

A recording fake client stands in for the VM here; the same code paths run against a real
desktop in test_vm_tasks.py.
"""

from __future__ import annotations

import asyncio
import gc
import io
import json
import os
import time

import pytest
from PIL import Image

from cua_jax.actions import (
    Click,
    Drag,
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
)
from cua_jax.env_api import INFO_ERROR, INFO_INVALID_ACTION, Task
from envs.vm import osworld, osworld_evaluators
from envs.vm.client import VMClient
from envs.vm.env import VMEnv, action_to_pyautogui, computer13_to_action, task_from_osworld


class FakeClient:
    """Records calls; answers execute() from a table of command -> output."""

    def __init__(self, outputs=None, files=None):
        self.calls: list[tuple] = []
        self.outputs = outputs or {}
        self.files = files or {}

    async def execute(self, command, shell=False, timeout=None):
        self.calls.append(("execute", command, shell))
        key = command if isinstance(command, str) else " ".join(command)
        out = self.outputs.get(key, "")
        if callable(out):
            out = out()
        return {"status": "success", "output": out, "error": "", "returncode": 0}

    async def launch(self, command, shell=False):
        self.calls.append(("launch", command, shell))
        return "ok"

    async def upload(self, path, data):
        self.calls.append(("upload", path, data))
        self.files[path] = data
        return "File uploaded"

    async def download(self, path):
        if path not in self.files:
            raise FileNotFoundError(path)
        return self.files[path]

    async def activate_window(self, name, strict=False, by_class=False):
        self.calls.append(("activate_window", name, strict, by_class))

    async def close_window(self, name, strict=False, by_class=False):
        self.calls.append(("close_window", name, strict, by_class))

    async def open_file(self, path):
        self.calls.append(("open", path))

    async def screen_size(self):
        return (1920, 1080)


def _task(**over):
    d = {
        "id": "demo",
        "snapshot": "os",
        "instruction": "do it",
        "source": "test",
        "config": [],
        "evaluator": {
            "func": "exact_match",
            "result": {"type": "vm_command_line", "command": "cat ~/a", "shell": True},
            "expected": {"type": "rule", "rules": {"expected": "x\n"}},
        },
    }
    d.update(over)
    return d


def run(coro):
    return asyncio.run(coro)


# ----------------------------------------------------------------------------- loading


def test_builtin_tasks_load_and_convert():
    tasks = osworld.load_builtin()
    assert len(tasks) >= 10
    for t in tasks:
        task = task_from_osworld(t, "desktop")
        assert task.id == f"desktop/{t.id}" and task.source == "desktop"
        assert task.oracle and not any(isinstance(a, InvalidAction) for a in task.oracle)
        osworld.parse_task(dict(task.spec), where=task.id)  # the spec round-trips


@pytest.mark.parametrize(
    "over, needle",
    [
        ({"config": [{"type": "tidy_desktop", "parameters": {}}]}, "'tidy_desktop'"),
        (
            {"evaluator": {"func": "no_such_metric", "result": {"type": "vm_file"}}},
            "'no_such_metric'",
        ),
        (
            {"evaluator": {"func": "exact_match", "result": {"type": "no_such_getter"}}},
            "'no_such_getter'",
        ),
        (
            {
                "evaluator": {
                    "func": "exact_match",
                    "postconfig": [{"type": "execute_python"}],
                    "result": {"type": "rule", "rules": {}},
                }
            },
            "'execute_python'",
        ),
    ],
)
def test_unsupported_types_name_themselves_and_the_supported_ones(over, needle):
    with pytest.raises(osworld.TaskFormatError) as e:
        osworld.parse_task(_task(**over), where="x.json")
    msg = str(e.value)
    assert needle in msg and "x.json" in msg and "supported" in msg
    supported = (osworld.SETUP_TYPES, osworld.METRICS, osworld.GETTERS)
    assert any(all(s in msg for s in group) for group in supported)


def test_without_desktop_env_its_metrics_and_getters_name_the_extra(monkeypatch):
    why = "desktop-env is not installed: " + osworld_evaluators.INSTALL_HINT
    monkeypatch.setattr(osworld_evaluators, "unavailable", lambda: why)
    monkeypatch.setattr(osworld_evaluators, "catalog", lambda: None)
    for over, reason in (
        ({"func": "compare_table", "result": {"type": "vm_file"}}, "metric compare_table"),
        ({"func": "exact_match", "result": {"type": "vlc_config"}}, "getter vlc_config"),
    ):
        with pytest.raises(osworld.TaskFormatError) as e:
            osworld.parse_task(_task(evaluator=over), where="x.json")
        assert e.value.reason == reason
        assert "pip install -e '.[osworld]' && pip install --no-deps desktop-env==" in str(e.value)
    osworld.parse_task(_task(), where="x.json")  # the built-in subset needs no extra


def test_with_desktop_env_its_names_load_and_a_name_it_lacks_says_so(monkeypatch):
    cat = osworld_evaluators.Catalog("1.0.2", "/x", frozenset({"compare_table"}), frozenset())
    monkeypatch.setattr(osworld_evaluators, "unavailable", lambda: None)
    monkeypatch.setattr(osworld_evaluators, "catalog", lambda: cat)
    osworld.parse_task(
        _task(evaluator={"func": "compare_table", "result": {"type": "vm_file", "path": "~/a"}})
    )
    with pytest.raises(osworld.TaskFormatError, match="desktop-env 1.0.2 .* has no metric"):
        osworld.parse_task(_task(evaluator={"func": "compare_references_gain", "result": None}))


def test_desktop_env_names_are_read_from_its_source_without_importing_it(tmp_path):
    init = tmp_path / "__init__.py"
    init.write_text(
        "from .a import (\n    get_x,\n    get_y as get_z,\n)\ndef infeasible():\n    pass\n"
    )
    assert osworld_evaluators._exported(init) == {"get_x", "get_z", "infeasible"}


def test_malformed_tasks_raise_errors_naming_the_field(tmp_path):
    bad = _task()
    del bad["instruction"]
    with pytest.raises(osworld.TaskFormatError, match="'instruction'"):
        osworld.parse_task(bad)
    p = tmp_path / "broken.json"
    p.write_text("{not json")
    with pytest.raises(osworld.TaskFormatError, match="broken.json: not valid JSON"):
        osworld.load_task(p)
    with pytest.raises(osworld.TaskFormatError, match="conj"):
        osworld.parse_task(_task(evaluator={**_task()["evaluator"], "conj": "xor"}))


def test_load_dir_uses_the_osworld_layout(tmp_path):
    (tmp_path / "os").mkdir()
    (tmp_path / "os" / "abc-123.json").write_text(json.dumps(_task(id="abc-123")))
    [t] = osworld.load_dir(tmp_path)
    assert (t.id, t.domain) == ("abc-123", "os")
    assert task_from_osworld(t).id == "osworld/os/abc-123"


# ----------------------------------------------------------------------------- setup


def test_setup_steps_in_order_with_placeholders_and_uploads(tmp_path):
    (tmp_path / "ref.txt").write_bytes(b"REF")
    steps = [
        {
            "type": "execute",
            "parameters": {
                "command": ["xdotool", "mousemove", "{SCREEN_WIDTH}", "{SCREEN_HEIGHT_HALF}"]
            },
        },
        {"type": "command", "parameters": {"command": "echo hi", "shell": True}},
        {"type": "launch", "parameters": {"command": ["xterm"]}},
        {
            "type": "upload_file",
            "parameters": {"files": [{"local_path": "ref.txt", "path": "~/ref.txt"}]},
        },
        {"type": "activate_window", "parameters": {"window_name": "xterm", "by_class": True}},
        {"type": "close_window", "parameters": {"window_name": "Untitled", "strict": True}},
        {"type": "open", "parameters": {"path": "~/ref.txt"}},
        {"type": "sleep", "parameters": {"seconds": 0.01}},
    ]
    c = FakeClient()
    run(osworld.run_setup(c, steps, screen_size=(1920, 1080), base_dir=str(tmp_path)))
    assert c.calls == [
        ("execute", ["xdotool", "mousemove", "1920", "540"], False),
        ("execute", "echo hi", True),
        ("launch", ["xterm"], False),
        ("upload", "~/ref.txt", b"REF"),
        ("activate_window", "xterm", False, True),
        ("close_window", "Untitled", True, False),
        ("open", "~/ref.txt"),
    ]


def test_execute_until_retries_until_the_condition_holds():
    outs = iter(["", "", "ready\n"])
    c = FakeClient({"check": lambda: next(outs)})
    step = {
        "type": "execute",
        "parameters": {"command": "check", "shell": True, "until": {"stdout": "ready"}},
    }
    run(osworld.run_setup(c, [step], screen_size=(1, 1)))
    assert len(c.calls) == 3


# ----------------------------------------------------------------------------- metrics


def test_metrics_hand_computed(tmp_path):
    assert osworld.exact_match("a\n", {"expected": "a\n"}) == 1.0
    assert osworld.exact_match("a", {"expected": "a\n"}) == 0.0
    assert osworld.check_include_exclude("x y z", {"include": ["x", "z"], "exclude": ["q"]}) == 1
    assert osworld.check_include_exclude("x y z", {"include": ["x"], "exclude": ["y"]}) == 0
    assert osworld.check_include_exclude(None, {"include": []}) == 0
    assert osworld.match_in_list("755\n", {"expected": ["755\n", "775\n"]}) == 1
    assert osworld.is_in_list(["a", "b"], {"expected": "b"}) == 1
    assert osworld.literal_match("ABC", "abc", ignore_case=True) == 1
    assert osworld.literal_match(["A"], ["a"], type="list") == 0
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("Hello  World\n")
    b.write_text("hello world")
    assert osworld.compare_text_file(str(a), str(b)) == 0
    assert osworld.compare_text_file(str(a), str(b), ignore_blanks=True, ignore_case=True) == 1
    assert osworld.compare_text_file(None, str(b)) == 0


def test_osworld_metrics_newer_than_desktop_env_hand_computed(tmp_path):
    """check_play_and_exit and check_structure_sim_with_threshold (OSWorld's, not in
    desktop-env 1.0.2): the last `play-and-exit=` line counts, a commented default too."""
    rc = tmp_path / "vlcrc"
    rc.write_text("[core]\n#play-and-exit=0\n")
    assert osworld.check_play_and_exit(str(rc), {"expected_play_and_exit": 0}) == 1.0
    assert osworld.check_play_and_exit(str(rc), {"expected_play_and_exit": 1}) == 0.0
    rc.write_text("[core]\n#play-and-exit=0\nplay-and-exit=1\n")
    assert osworld.check_play_and_exit(str(rc), {"expected_play_and_exit": 1}) == 1.0
    rc.write_text("[core]\nvolume=3\n")  # no such line: "0"
    assert osworld.check_play_and_exit(str(rc), {"expected_play_and_exit": "0"}) == 1.0
    assert osworld.check_play_and_exit(None, {"expected_play_and_exit": 0}) == 0.0

    pytest.importorskip("skimage", reason="the osworld extra")
    import numpy as np

    ramp = np.tile(np.linspace(0, 255, 64, dtype=np.uint8), (48, 1))
    img = np.stack([ramp, ramp.T[:48, :48].repeat(2, 1)[:, :64], 255 - ramp], -1)
    paths = {}
    for name, arr in {
        "img": img,
        "inverse": 255 - img,
        "twice": np.asarray(Image.fromarray(img).resize((128, 96), Image.Resampling.LANCZOS)),
    }.items():
        paths[name] = str(tmp_path / f"{name}.png")
        Image.fromarray(arr).save(paths[name])
    sim = osworld.check_structure_sim_with_threshold
    assert sim(paths["img"], paths["img"]) == 1.0  # SSIM 1
    assert sim(paths["inverse"], paths["img"]) == 0.0  # SSIM < 0
    assert sim(paths["twice"], paths["img"]) == 1.0  # resized back to the target's size
    assert sim(paths["img"], paths["img"], ssim_threshold=1.01) == 0.0
    assert sim(None, paths["img"]) == 0.0
    (tmp_path / "bad.png").write_bytes(b"not an image")
    assert sim(str(tmp_path / "bad.png"), paths["img"]) == 0.0


def _eval(task_dict, client, last_fail=False):
    t = osworld.parse_task(task_dict)
    return run(osworld.evaluate(client, t, screen_size=(800, 600), last_action_was_fail=last_fail))


def test_evaluate_getters_conj_and_placeholders():
    c = FakeClient(
        {"cat ~/a": "x\n", "echo w": "800", "cat ~/b": "nope"},
        files={"~/f1": b"same", "~/f2": b"same"},
    )
    assert _eval(_task(), c).score == 1.0
    ev = {
        "func": ["exact_match", "compare_text_file", "exact_match"],
        "conj": "and",
        "result": [
            {"type": "vm_command_line", "command": "echo w", "shell": True},
            {"type": "vm_file", "path": "~/f1", "dest": "f.txt"},
            {"type": "vm_command_line", "command": "cat ~/b", "shell": True},
        ],
        "expected": [
            {"type": "rule", "rules": {"expected": "{SCREEN_WIDTH}"}},
            {"type": "vm_file", "path": "~/f2", "dest": "f.txt"},
            {"type": "rule", "rules": {"expected": "yes"}},
        ],
    }
    r = _eval(_task(evaluator=ev), c)
    assert r.score == 0.0 and [d["score"] for d in r.details] == [1.0, 1.0, 0.0]
    assert _eval(_task(evaluator={**ev, "conj": "or"}), c).score == 1.0
    # a missing file is a 0, not a crash
    ev_missing = {
        "func": "compare_text_file",
        "result": {"type": "vm_file", "path": "~/none", "dest": "n"},
        "expected": {"type": "vm_file", "path": "~/f2", "dest": "m"},
    }
    assert _eval(_task(evaluator=ev_missing), c).score == 0.0


def test_infeasible_scores_1_only_after_fail_and_fail_zeroes_feasible():
    inf = _task(evaluator={"func": "infeasible"})
    assert _eval(inf, FakeClient(), last_fail=True).score == 1.0
    assert _eval(inf, FakeClient(), last_fail=False).score == 0.0
    assert _eval(_task(), FakeClient({"cat ~/a": "x\n"}), last_fail=True).score == 0.0


def test_postconfig_runs_before_the_getters():
    state = {"ran": False}

    def out():
        return "x\n" if state["ran"] else ""

    c = FakeClient({"cat ~/a": out})
    orig = c.execute

    async def execute(command, shell=False, timeout=None):
        if command == "fix":
            state["ran"] = True
        return await orig(command, shell, timeout)

    c.execute = execute
    ev = {
        **_task()["evaluator"],
        "postconfig": [{"type": "execute", "parameters": {"command": "fix", "shell": True}}],
    }
    assert _eval(_task(evaluator=ev), c).score == 1.0


# ----------------------------------------------------------------------------- actions


def test_typed_actions_to_pyautogui_code():
    assert (
        action_to_pyautogui(Click(10.4, 20.6)) == "pyautogui.click(10, 21, clicks=1, button='left')"
    )
    assert action_to_pyautogui(Click(None, None, "right", 2)) == (
        "pyautogui.click(clicks=2, button='right')"
    )
    assert action_to_pyautogui(Move(3, 4)) == "pyautogui.moveTo(3, 4)"
    assert action_to_pyautogui(Drag(5, 6, 1, 2)) == (
        "pyautogui.moveTo(1, 2); pyautogui.dragTo(5, 6, duration=0.2, button='left')"
    )
    assert action_to_pyautogui(TypeText("a'b\n")) == 'pyautogui.typewrite("a\'b\\n")'
    assert action_to_pyautogui(Key(("enter",))) == "pyautogui.press('enter')"
    assert action_to_pyautogui(Key(("ctrl", "meta", "c"))) == (
        "pyautogui.hotkey('ctrl', 'win', 'c')"
    )
    # ours: +dy = down; pyautogui: +clicks = up
    assert action_to_pyautogui(Scroll(7, 8, 0, 3)) == "pyautogui.scroll(-3, x=7, y=8)"
    assert action_to_pyautogui(Scroll(None, None, 2, 0)) == "pyautogui.hscroll(2)"
    assert action_to_pyautogui(Scroll(None, None, 0, 1e300)) == "pyautogui.scroll(-50)"  # capped
    assert action_to_pyautogui(Wait(1.0)) is None


def test_computer13_dicts_translate_like_osworld():
    c13 = computer13_to_action
    assert c13({"action_type": "CLICK", "parameters": {"x": 1, "y": 2, "num_clicks": 2}}) == Click(
        1.0, 2.0, "left", 2
    )
    assert c13({"action_type": "RIGHT_CLICK", "parameters": {}}) == Click(None, None, "right", 1)
    assert c13({"action_type": "SCROLL", "parameters": {"dy": 5}}) == Scroll(None, None, 0.0, -5.0)
    assert c13({"action_type": "HOTKEY", "parameters": {"keys": ["Ctrl", "c"]}}) == Key(
        ("ctrl", "c")
    )
    assert c13({"action_type": "KEY_DOWN", "parameters": {"key": "Shift"}}) == KeyDown("shift")
    assert c13({"action_type": "KEY_UP", "parameters": {"key": "win"}}) == KeyUp("meta")
    assert c13({"action_type": "MOUSE_DOWN", "parameters": {}}) == MouseDown(None, None, "left")
    assert c13({"action_type": "MOUSE_UP", "parameters": {"button": "right"}}) == MouseUp(
        None, None, "right"
    )
    assert isinstance(c13({"action_type": "MOUSE_UP", "parameters": {"button": 3}}), InvalidAction)
    # ... and back to the pyautogui code OSWorld's client sends
    assert action_to_pyautogui(KeyDown("meta")) == "pyautogui.keyDown('win')"
    assert action_to_pyautogui(MouseDown(5, 6)) == "pyautogui.mouseDown(5, 6, button='left')"
    assert action_to_pyautogui(MouseUp(button="right")) == "pyautogui.mouseUp(button='right')"
    assert c13({"action_type": "WAIT"}) == Wait(1.0)
    assert isinstance(c13({"action_type": "MOVE_TO", "parameters": {}}), InvalidAction)
    assert isinstance(c13({"nope": 1}), InvalidAction)
    assert isinstance(c13({"action_type": "TYPING", "parameters": {}}), InvalidAction)


# ----------------------------------------------------------------------------- task sources


def test_task_sources_registered_with_envs_tasks(tmp_path, capsys):
    import envs.vm  # noqa: F401  (registers the sources)
    from envs.tasks import TaskSourceError, load_tasks

    all_desktop = load_tasks({"source_type": "desktop"})
    assert len(all_desktop) == len(osworld.load_builtin())
    [t] = load_tasks({"source_type": "ids", "task_ids": ["desktop/terminal-mkdir"]})
    assert t.id == "desktop/terminal-mkdir" and t.oracle
    with pytest.raises(TaskSourceError, match="terminal-mkdir"):
        load_tasks({"source_type": "desktop", "names": ["nope"]})
    # An OSWorld-layout directory with one supported and one unsupported task.
    (tmp_path / "os").mkdir()
    (tmp_path / "os" / "good.json").write_text(json.dumps(_task(id="good")))
    drive = {"settings_file": "evaluation_examples/settings/googledrive/settings.yml"}
    bad = _task(id="bad", config=[{"type": "googledrive", "parameters": drive}])
    (tmp_path / "os" / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(TaskSourceError, match="googledrive needs Google Drive API credentials"):
        load_tasks({"source_type": "osworld", "path": str(tmp_path)})
    got = load_tasks({"source_type": "osworld", "path": str(tmp_path), "skip_unsupported": True})
    assert [t.id for t in got] == ["osworld/os/good"]
    # one line at load names the skipped task's reason
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "setup step googledrive needs Google Drive" in err[0]


@pytest.mark.parametrize(
    "d",
    [
        {"action_type": "CLICK", "parameters": {"x": "nan", "y": 5}},
        {"action_type": "MOVE_TO", "parameters": {"x": float("inf"), "y": 5}},
        {"action_type": "DRAG_TO", "parameters": {"x": 1, "y": "-inf"}},
        {"action_type": "RIGHT_CLICK", "parameters": {"x": 1, "y": float("nan")}},
        {"action_type": "SCROLL", "parameters": {"dx": 0, "dy": float("nan")}},
        {"action_type": "SCROLL", "parameters": {"dx": "1e400"}},
        {"action_type": "CLICK", "parameters": {"num_clicks": float("inf")}},
        {"action_type": "HOTKEY", "parameters": {"keys": "ctrl+nosuchkey"}},
    ],
)
def test_computer13_non_finite_numbers_are_invalid_actions(d):
    assert isinstance(computer13_to_action(d), InvalidAction)


def test_computer13_hotkey_keys_as_a_plus_joined_string():
    c13 = computer13_to_action
    assert c13({"action_type": "HOTKEY", "parameters": {"keys": "ctrl+c"}}) == Key(("ctrl", "c"))
    assert c13({"action_type": "HOTKEY", "parameters": {"keys": "Ctrl+Shift+t"}}) == Key(
        ("ctrl", "shift", "t")
    )
    assert c13({"action_type": "HOTKEY", "parameters": {"keys": ["ctrl", "c"]}}) == Key(
        ("ctrl", "c")
    )


def test_non_ascii_text_is_typed_with_xdotool():
    # pyautogui.typewrite has no key for 'é' or '→' and silently skips them.
    code = action_to_pyautogui(TypeText("café → ok\n"))
    assert "typewrite" not in code
    assert "['xdotool', 'type', '--delay', " in code and "'--', 'café → ok\\n']" in code
    assert "check=True" in code  # no xdotool / a failure -> non-zero return code
    assert action_to_pyautogui(TypeText("plain")) == "pyautogui.typewrite('plain')"


class _ScreenOnlyVM(VMClient):
    """Just enough of a VM for VMEnv.reset/step: a screenshot, a screen size, pyautogui."""

    def __init__(self):
        super().__init__("http://127.0.0.1:9")  # never contacted: every call used is overridden
        buf = io.BytesIO()
        Image.new("RGB", (8, 6)).save(buf, format="PNG")
        self.png, self.codes = buf.getvalue(), []

    async def screen_size(self):
        return (8, 6)

    async def screenshot(self):
        return self.png

    async def pyautogui(self, code, timeout=None):
        self.codes.append(code)
        return {"status": "success", "output": "", "error": "", "returncode": 0}


def _env_step(env, action):
    async def go():
        await env.reset(Task(id="t", instruction="i", source="test", spec=_task()))
        t0 = time.monotonic()
        res = await asyncio.wait_for(env.step(action), 10)
        return res, time.monotonic() - t0

    return run(go())


def test_vm_env_work_dir_is_removed_on_close_and_when_dropped_unclosed():
    closed = VMEnv(_ScreenOnlyVM())
    _env_step(closed, Wait(0.0))
    path = closed._work_dir
    assert path and os.path.isdir(path)
    run(closed.close())
    assert not os.path.exists(path) and closed._work_dir is None
    run(closed.close())  # twice is fine
    dropped = VMEnv(_ScreenOnlyVM())
    _env_step(dropped, Wait(0.0))
    path = dropped._work_dir
    assert path and os.path.isdir(path)
    del dropped
    gc.collect()
    assert not os.path.exists(path)


@pytest.mark.parametrize("seconds", [86400.0, float("inf"), float("nan"), -5.0])
def test_vm_env_wait_is_capped_and_never_raises(seconds):
    assert VMEnv(_ScreenOnlyVM()).max_wait_s == 5.0  # the default, like the browser env's
    res, took = _env_step(VMEnv(_ScreenOnlyVM(), max_wait_s=0.3), Wait(seconds))
    assert took < 2.0 and not res.done and INFO_ERROR not in res.info, (took, res.info)


@pytest.mark.parametrize(
    "d",
    [
        {"action_type": "CLICK", "parameters": {"x": "nan", "y": 5}},
        {"action_type": "SCROLL", "parameters": {"dx": 0, "dy": float("nan")}},
        {"action_type": "MOVE_TO", "parameters": {"x": 1e300 * 1e300, "y": 5}},
    ],
)
def test_vm_env_step_with_non_finite_computer13_never_raises(d):
    vm = _ScreenOnlyVM()
    res, _ = _env_step(VMEnv(vm), d)
    assert INFO_INVALID_ACTION in res.info and not res.done and vm.codes == []
