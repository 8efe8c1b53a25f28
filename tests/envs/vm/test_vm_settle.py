"""The reset's first screenshot waits for the screen to hold still after a setup that starts a
window (`VMEnv._settle`): an app's window exists before the app has drawn it."""

import io
import json
import pathlib

import numpy as np
import pytest
from PIL import Image

from envs.vm import env as vm_env
from envs.vm import osworld
from envs.vm.client import VMClient

TASKS = pathlib.Path(vm_env.__file__).parent / "tasks"


def _png(img: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(img).save(out, format="PNG")
    return out.getvalue()


class _Screens(VMClient):
    """A client whose screenshots are `frames` in turn, the last one for ever."""

    def __init__(self, frames: list[np.ndarray]):
        super().__init__("http://127.0.0.1:9")
        self.frames, self.shots = [_png(f) for f in frames], 0

    async def screenshot(self) -> bytes:
        self.shots += 1
        return self.frames[min(self.shots - 1, len(self.frames) - 1)]


def _frames(drawing: int, cursor: bool = False) -> list[np.ndarray]:
    """`drawing` changing frames (the app painting), then the drawn screen, whose text cursor
    (8 x 16 pixels of 320 x 240: 0.17%) blinks when `cursor`."""
    rng = np.random.default_rng(0)
    paint = [rng.integers(0, 255, (240, 320, 3), dtype=np.uint8) for _ in range(drawing)]
    drawn = np.full((240, 320, 3), 200, np.uint8)
    blink = drawn.copy()
    blink[100:116, 50:58] = 0
    return paint + ([drawn, blink] * 20 if cursor else [drawn])


def test_the_reset_waits_until_the_screen_holds_still(aio, monkeypatch):
    monkeypatch.setattr(vm_env, "SETTLE_EVERY_S", 0.01)
    client = _Screens(_frames(drawing=5))
    env = vm_env.VMEnv(client, settle_s=0.05, settle_timeout_s=5.0)
    waited = aio(env._settle())
    assert client.shots >= 6  # every painting frame seen, then the drawn one held still
    assert 0.05 <= waited < 5.0


def test_a_blinking_cursor_is_still_and_a_screen_that_never_settles_costs_the_timeout(
    aio, monkeypatch
):
    monkeypatch.setattr(vm_env, "SETTLE_EVERY_S", 0.01)
    blinking = vm_env.VMEnv(_Screens(_frames(drawing=2, cursor=True)), settle_s=0.05)
    assert aio(blinking._settle()) < 1.0
    rng = np.random.default_rng(1)
    video = [rng.integers(0, 255, (24, 32, 3), dtype=np.uint8) for _ in range(400)]
    never = vm_env.VMEnv(_Screens(video), settle_s=0.05, settle_timeout_s=0.3)
    assert 0.3 <= aio(never._settle()) < 1.0
    assert aio(vm_env.VMEnv(_Screens(video), settle_s=0.0)._settle()) == 0.0  # 0: no wait


def test_a_task_s_own_settle_time_replaces_the_env_s_and_a_bad_one_is_refused(aio, monkeypatch):
    monkeypatch.setattr(vm_env, "SETTLE_EVERY_S", 0.01)
    env = vm_env.VMEnv(_Screens(_frames(drawing=0)), settle_s=5.0, settle_timeout_s=10.0)
    assert aio(env._settle(0.05)) < 1.0  # the task's 0.05 s, not the env's 5 s
    # the built-in desktop tasks (xterm windows, drawn at once) hold still for 0.2 s
    tasks = [osworld.load_task(p) for p in sorted(TASKS.glob("*.json"))]
    assert tasks and all(t.settle_s == 0.2 for t in tasks)
    good = json.loads(next(TASKS.glob("*.json")).read_text())
    for bad in (-1, "1", True, None):
        d = {**good, "settle_s": bad}
        if bad is None:
            assert osworld.parse_task(d, where="t.json").settle_s is None  # the env's
            continue
        with pytest.raises(osworld.TaskFormatError, match="t.json: 'settle_s' must be"):
            osworld.parse_task(d, where="t.json")


class _SavingApp(_Screens):
    """An app that draws for 5 screenshots after the agent's last action, then holds still;
    the file it writes exists only once it is done drawing."""

    async def execute(self, command, shell=False, timeout=None):
        return {"status": "success", "returncode": 0, "output": "1" if self.shots > 5 else ""}


def test_the_evaluator_runs_once_the_screen_holds_still_after_the_last_action(aio, monkeypatch):
    monkeypatch.setattr(vm_env, "SETTLE_EVERY_S", 0.01)
    spec = json.loads((TASKS / "terminal-screen-width.json").read_text())
    spec["evaluator"] = {
        "func": "exact_match",
        "result": {"type": "vm_command_line", "command": ["cat", "/tmp/saved"]},
        "expected": {"type": "rule", "rules": {"expected": "1"}},
    }

    def scored(eval_settle_s: float) -> tuple[float, int]:
        env = vm_env.VMEnv(
            app := _SavingApp(_frames(drawing=5)), eval_settle_s=eval_settle_s, settle_timeout_s=5
        )
        env._ot = osworld.parse_task(spec, where="t.json")
        return aio(env.evaluate()), app.shots

    assert scored(0.05)[0] == 1.0 and scored(0.05)[1] >= 6  # waited out the drawing
    assert scored(0.0) == (0.0, 0)  # 0: evaluated at once, before the app finished
