"""tools/osworld_load_count.py's per-domain table: what a task needs, judged on hand-made tasks,
and the table and --hide-extra on a small tree of task files."""

from __future__ import annotations

import json
import subprocess
import sys

from tools import osworld_load_count as olc

CHROME_TASK = {
    "id": "c1",
    "instruction": "x",
    "source": "https://example.org/where-the-task-came-from",
    "related_apps": ["chrome"],
    "config": [
        {"type": "launch", "parameters": {"command": ["google-chrome", "--x"]}},
        {"type": "execute", "parameters": {"command": "export A=1; socat a b", "shell": True}},
        {"type": "launch", "parameters": {"command": "VLC_VERBOSE=-1 vlc --x", "shell": True}},
        {"type": "chrome_open_tabs", "parameters": {"urls_to_open": ["http://127.0.0.1:8/"]}},
    ],
    "evaluator": {"func": "is_expected_tabs", "result": {"type": "open_tabs_info"}},
}


def test_programs_and_web_addresses_of_a_task():
    assert olc.programs_needed(CHROME_TASK) == {"google-chrome", "vlc"}  # export: the shell's
    assert olc.programs_needed({"related_apps": ["libreoffice calc", "os"]}) == {"libreoffice"}
    assert not olc.needs_web(CHROME_TASK)  # loopback only; "source" is metadata
    web = {**CHROME_TASK, "evaluator": {"expected": {"type": "cloud_file", "path": "https://a/b"}}}
    assert olc.needs_web(web)
    assert olc.has_program("sudo") and olc.has_program(sys.executable)
    assert not olc.has_program("no-such-program-anywhere")


def test_table_counts_a_tree_with_and_without_the_extra(tmp_path):
    (tmp_path / "os").mkdir()
    (tmp_path / "chrome").mkdir()
    ok = {
        "id": "a",
        "instruction": "make a dir",
        "config": [{"type": "execute", "parameters": {"command": ["mkdir", "-p", "~/d"]}}],
        "evaluator": {
            "func": "exact_match",
            "result": {"type": "vm_command_line", "command": "ls ~"},
            "expected": {"type": "rule", "rules": {"expected": "d"}},
        },
    }
    needs_extra = {
        **ok,
        "id": "b",
        "related_apps": ["chrome"],
        "evaluator": {
            "func": "is_expected_tabs",
            "result": {"type": "open_tabs_info"},
            "expected": {"type": "rule", "rules": {"urls": ["https://x.org"]}},
        },
    }
    (tmp_path / "os" / "a.json").write_text(json.dumps(ok))
    (tmp_path / "chrome" / "b.json").write_text(json.dumps(needs_extra))
    (tmp_path / "chrome" / "bad.json").write_text("{not json")
    tool = [sys.executable, olc.__file__, str(tmp_path)]
    hidden = json.loads(
        subprocess.run(
            [*tool, "--json", "--hide-extra"], capture_output=True, text=True, check=True
        ).stdout
    )
    assert hidden["loaded_ids"] == ["os/a"] and hidden["total"] == 3
    table = olc.domain_table(tmp_path)
    rows = {r.split("|")[1].strip(): r for r in table.splitlines() if r.startswith("| ")}
    extra = olc.osworld.desktop_env.unavailable() is None
    chrome_loads = "1" if extra else "0"
    assert [c.strip() for c in rows["os"].split("|")[2:7]] == ["1", "1", "1", "1", "1"]
    assert [c.strip() for c in rows["chrome"].split("|")[2:5]] == ["2", "0", chrome_loads]
