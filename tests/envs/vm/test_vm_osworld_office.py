"""OSWorld's office tasks end to end in the real apps: LibreOffice on a LocalDesktop, scored by
OSWorld's own metrics (desktop-env's ``compare_table``, ...) through ``VMEnv``.

Each task is OSWorld's own file, as written (its ``/home/user`` paths, its ``open`` step, its
postconfig that focuses the app's window and saves with ctrl+s). Its download and its gold come
from an offline cache in OSWorld's layout that the test fills with small stand-ins made here
(the originals live on Hugging Face). The solution is GUI actions through ``VMEnv.step``, as a
policy would play them: keys typed into the app, which then saves the file itself.

Needs LibreOffice (``make apt-office``) and the ``osworld`` extra; without either every test
here skips with one line saying which. Timings (reset with the app's start, each action, each
evaluation), for BENCHMARKS.md::

    python tests/envs/vm/test_vm_osworld_office.py --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import io
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cua_jax.actions import Action, Key, TypeText
from envs.vm import osworld
from envs.vm import osworld_evaluators as desktop_env
from envs.vm.env import VMEnv, task_from_osworld
from envs.vm.osworld_setup import ContentCache
from envs.vm.providers import LocalDesktop

NO_OFFICE = (
    None
    if shutil.which("soffice")
    else "LibreOffice is not installed (soffice not on PATH): make apt-office"
)
pytestmark = [
    pytest.mark.osworld,
    pytest.mark.xserver,
    pytest.mark.skipif(NO_OFFICE is not None, reason=str(NO_OFFICE)),
    pytest.mark.skipif(
        desktop_env.unavailable() is not None, reason=str(desktop_env.unavailable())
    ),
]

HF = "https://huggingface.co/datasets/xlangai/ubuntu_osworld_file_cache/resolve/main/"
SCREEN = (1024, 768)

# OSWorld's evaluation_examples/examples/libreoffice_calc/01b269ae-2111-4a07-81fd-3fcd711993b0.json
CALC_01B269AE: dict[str, Any] = {
    "id": "01b269ae-2111-4a07-81fd-3fcd711993b0",
    "snapshot": "libreoffice_calc",
    "instruction": "Fill all the blank cells in B1:E30 with the value in the cell above it. "
    "Finish the work and don't touch irrelevant regions, even if they are blank.",
    "source": "https://www.youtube.com/shorts/VrUzPTIwQ04",
    "config": [
        {
            "type": "download",
            "parameters": {
                "files": [
                    {
                        "url": f"{HF}libreoffice_calc/01b269ae-2111-4a07-81fd-3fcd711993b0/"
                        "Student_Level_Fill_Blank.xlsx",
                        "path": "/home/user/Student_Level_Fill_Blank.xlsx",
                    }
                ]
            },
        },
        {"type": "open", "parameters": {"path": "/home/user/Student_Level_Fill_Blank.xlsx"}},
    ],
    "trajectory": "trajectories/01b269ae-2111-4a07-81fd-3fcd711993b0",
    "related_apps": ["libreoffice calc"],
    "evaluator": {
        "postconfig": [
            {
                "type": "activate_window",
                "parameters": {
                    "window_name": "Student_Level_Fill_Blank.xlsx - LibreOffice Calc",
                    "strict": True,
                },
            },
            {"type": "sleep", "parameters": {"seconds": 0.5}},
            {
                "type": "execute",
                "parameters": {
                    "command": ["python", "-c", 'import pyautogui; pyautogui.hotkey("ctrl", "s");']
                },
            },
            {"type": "sleep", "parameters": {"seconds": 0.5}},
        ],
        "func": "compare_table",
        "expected": {
            "type": "cloud_file",
            "path": f"{HF}libreoffice_calc/01b269ae-2111-4a07-81fd-3fcd711993b0/"
            "Student_Level_Fill_Blank_gold.xlsx",
            "dest": "Student_Level_Fill_Blank_gold.xlsx",
        },
        "result": {
            "type": "vm_file",
            "path": "/home/user/Student_Level_Fill_Blank.xlsx",
            "dest": "Student_Level_Fill_Blank.xlsx",
        },
        "options": {"rules": [{"type": "sheet_data", "sheet_idx0": 0, "sheet_idx1": "EI0"}]},
    },
    "proxy": False,
    "fixed_ip": False,
    "possibility_of_env_change": "low",
}
# A stand-in for the task's sheet (the original is not offline): blanks in B3 and B5.
_SHEET = [["Student", "Level"], ["Ann", "A"], ["Bob", None], ["Cy", "B"], ["Di", None]]
_FILLED = [["Student", "Level"], ["Ann", "A"], ["Bob", "A"], ["Cy", "B"], ["Di", "B"]]


def _xlsx(rows: list[list[Any]]) -> bytes:
    import openpyxl

    wb = openpyxl.Workbook()
    for r in rows:
        wb.active.append(r)
    buf = io.BytesIO()
    wb.save(buf)
    return buf.getvalue()


def _sheet_rows(data: bytes) -> list[list[Any]]:
    import openpyxl

    ws = openpyxl.load_workbook(io.BytesIO(data)).worksheets[0]
    return [list(r) for r in ws.iter_rows(values_only=True)]


def _calc_solution() -> list[Action]:
    """What a person types in Calc: to B3, "A", Enter (now on B4), down to B5, "B", Enter."""
    return [
        Key(("ctrl", "home")),
        Key(("down",)),
        Key(("down",)),
        Key(("right",)),
        TypeText("A\n"),
        Key(("down",)),
        TypeText("B\n"),
    ]


# name -> (task JSON, domain, {cached file name: bytes}, solution, the app's window title,
#          the file the app saved -> its content as openpyxl / python-docx / python-pptx read it,
#          and that content when solved): an independent check beside OSWorld's metric
OfficeCase = tuple[
    dict[str, Any],
    str,
    Callable[[], dict[str, bytes]],
    Callable[[], list],
    str,
    Callable[[bytes], Any],
    Any,
]
CASES: dict[str, OfficeCase] = {
    "calc_01b269ae": (
        CALC_01B269AE,
        "libreoffice_calc",
        lambda: {
            "Student_Level_Fill_Blank.xlsx": _xlsx(_SHEET),
            "Student_Level_Fill_Blank_gold.xlsx": _xlsx(_FILLED),
        },
        _calc_solution,
        "Student_Level_Fill_Blank.xlsx - LibreOffice Calc",
        _sheet_rows,
        _FILLED,
    ),
}


def _cache(root: Path, raw: dict[str, Any], files: dict[str, bytes]) -> ContentCache:
    cache = ContentCache(root, offline=True)
    d = cache.task_dir(raw["id"])
    d.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (d / name).write_bytes(data)
    return cache


async def play(desk: LocalDesktop, case: OfficeCase, cache: ContentCache) -> dict[str, Any]:
    """One episode: reset (desktop, download, the app opening the file), evaluate, the solution,
    evaluate again. Returns the scores, the windows after reset and the times (s)."""
    raw, domain, _, solve, *_ = case
    task = task_from_osworld(osworld.parse_task(raw, where=raw["id"], domain=domain))
    env = VMEnv(desk, cache=cache)
    out: dict[str, Any] = {"step_s": []}
    t = time.monotonic()
    await env.reset(task)
    out["reset_s"] = time.monotonic() - t
    out["windows"] = (await desk.client.execute(["wmctrl", "-l"]))["output"]
    t = time.monotonic()
    out["before"] = await env.evaluate()
    out["eval_before_s"] = time.monotonic() - t
    for a in solve():
        t = time.monotonic()
        r = await env.step(a)
        out["step_s"].append(time.monotonic() - t)
        assert "invalid_action" not in r.info, r.info
    t = time.monotonic()
    out["after"] = await env.evaluate()
    out["eval_after_s"] = time.monotonic() - t
    out["details"] = env.last_eval.details
    out["saved"] = await desk.client.download(raw["evaluator"]["result"]["path"])
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_office_task_in_the_real_app_scores_0_then_1(xserver, aio, tmp_path, name):
    case = CASES[name]
    raw, _, files, _, title, read, solved = case
    cache = _cache(tmp_path / "cache", raw, files())

    async def go() -> dict[str, Any]:
        async with LocalDesktop(*SCREEN) as desk:
            return await play(desk, case, cache)

    out = aio(go(), timeout=240)
    assert title in out["windows"], out["windows"]  # the open step started the app on the file
    assert (out["before"], out["after"]) == (0.0, 1.0), out["details"]
    assert read(out["saved"]) == solved  # the app saved the typed values in the task's format


# ----------------------------------------------------------------------------- timings


async def _timed_episode(case: OfficeCase, cache: ContentCache) -> dict[str, Any]:
    t = time.monotonic()
    async with LocalDesktop(*SCREEN) as desk:
        out = await play(desk, case, cache)
    out["total_s"] = time.monotonic() - t
    return out


def _bench(runs: int) -> None:
    import tempfile

    for name, case in CASES.items():
        rows = []
        for _ in range(runs):
            with tempfile.TemporaryDirectory() as tmp:
                cache = _cache(Path(tmp) / "cache", case[0], case[2]())
                rows.append(asyncio.run(_timed_episode(case, cache)))
        for r in rows:
            print(
                f"{name}: scores {r['before']:g} -> {r['after']:g}; reset {r['reset_s']:.2f} s, "
                f"evaluate {r['eval_before_s']:.2f} s then {r['eval_after_s']:.2f} s, "
                f"{len(r['step_s'])} actions median {statistics.median(r['step_s']):.3f} s, "
                f"episode {r['total_s']:.1f} s"
            )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="episodes per task")
    args = ap.parse_args()
    if NO_OFFICE or desktop_env.unavailable():
        raise SystemExit(NO_OFFICE or desktop_env.unavailable())
    _bench(args.runs)
