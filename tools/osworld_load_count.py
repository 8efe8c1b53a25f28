"""How many of OSWorld's task files our loader accepts, and why the others fail.

    python tools/osworld_load_count.py OSWorld/evaluation_examples/examples [--names]

Loads every ``<domain>/<id>.json`` with ``envs.vm.osworld.load_task`` and prints the count that
load, then the failures grouped by their first reason (the setup step, getter or metric the
loader lacks, or the credentials a step needs), most common first. ``--names`` lists the task
ids under each reason. ``--json`` prints the same as one JSON object.

    python tools/osworld_load_count.py OSWorld/evaluation_examples/examples --table

prints a markdown table a domain a row: the task files, how many load without the osworld extra
(this tool rerun with ``--hide-extra``: desktop-env made unimportable, as on a machine without
it) and with it, how many of those find every program they need on a LocalDesktop of this
machine (the apps of their ``related_apps`` and the programs their setup steps start, on the
desktop's PATH with its Chrome and socat stand-ins), and how many of those name no web address
(no download, cloud_file gold or page outside loopback: runnable with no internet and no
filled cache). Programs missing most often are listed under it; `make apt-office` installs the
Debian-packaged ones OSWorld's domains need (LibreOffice, GIMP, VLC, Thunderbird, Evince).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))


if "--hide-extra" in sys.argv[1:]:  # before envs.vm looks for it: as if not installed
    sys.modules["desktop_env"] = None  # type: ignore[assignment] -- find_spec gives None

from envs.vm import osworld  # noqa: E402 -- after the path set-up above

_PATTERNS = (  # message of a TaskFormatError -> a short reason
    (r"has type '([^']+)', which is not supported", "setup step {}"),
    (r"has getter type '([^']+)'", "getter {}"),
    (r"evaluator\.func '([^']+)' is not supported", "metric {}"),
)


def reason_of(e: Exception) -> str:
    """The short reason a task failed to load (the exception's ``reason`` when it has one)."""
    if getattr(e, "reason", None):
        return str(e.reason)  # type: ignore[attr-defined]
    msg = str(e)
    for pat, fmt in _PATTERNS:
        m = re.search(pat, msg)
        if m:
            return fmt.format(m.group(1))
    return msg.split(": ", 1)[-1].split(";")[0][:120]


def count(root: Path) -> tuple[list[str], dict[str, list[str]]]:
    """(loaded ids, {reason: [domain/id, ...]}) over ``root/<domain>/<id>.json``."""
    loaded: list[str] = []
    failed: dict[str, list[str]] = collections.defaultdict(list)
    for f in sorted(root.glob("*/*.json")):
        name = f"{f.parent.name}/{f.stem}"
        try:
            osworld.load_task(f)
        except osworld.TaskFormatError as e:
            failed[reason_of(e)].append(name)
        else:
            loaded.append(name)
    return loaded, dict(sorted(failed.items(), key=lambda kv: (-len(kv[1]), kv[0])))


# related_apps -> the program OSWorld's VM starts for it (None: nothing beyond the desktop)
APP_PROGRAMS = {
    "chrome": "google-chrome",
    "browser": "google-chrome",
    "libreoffice": "libreoffice",
    "libreoffice_calc": "libreoffice",
    "libreoffice calc": "libreoffice",
    "calc": "libreoffice",
    "libreoffice_impress": "libreoffice",
    "libreoffice_writer": "libreoffice",
    "writer": "libreoffice",
    "gimp": "gimp",
    "image": "gimp",
    "vscode": "code",
    "vs_code": "code",
    "thunderbird": "thunderbird",
    "vlc": "vlc",
    "ubuntu_media_player": "vlc",
    "terminal": "gnome-terminal",
    "pdf": "evince",
    "picard": "picard",
    "os": None,
}
# programs a LocalDesktop's own bin provides where the machine has what they stand in for
DESKTOP_BIN = {
    "sudo": True,
    "socat": True,
    "google-chrome": bool(shutil.which("chromium") or shutil.which("chromium-browser")),
    "google-chrome-stable": bool(shutil.which("chromium") or shutil.which("chromium-browser")),
}
SHELL_WORDS = {"export", "cd", "source", ".", "set", "unset", "true", ":", "echo", "exec"}


def _first_word(command: Any) -> str | None:
    words = command if isinstance(command, list) else str(command or "").split()
    for w in words:
        w = str(w)
        if "=" in w.split("/")[0]:  # VAR=value before the program
            continue
        return w
    return None


def programs_needed(raw: dict[str, Any]) -> set[str]:
    """The programs a task file needs on its desktop: its apps' and its steps' first words."""
    need = {
        APP_PROGRAMS.get(str(a).lower().strip(), str(a).lower())
        for a in raw.get("related_apps") or []
    }
    ev = raw.get("evaluator") or {}
    for step in [*(raw.get("config") or []), *(ev.get("postconfig") or [])]:
        if step.get("type") in ("launch", "execute", "command"):
            word = _first_word((step.get("parameters") or {}).get("command"))
            if word and not word.startswith(".") and word not in SHELL_WORDS:
                need.add(word)
    need.discard(None)
    return need


def has_program(name: str) -> bool:
    """On a LocalDesktop of this machine (its PATH: the desktop's bin, this Python's, PATH)."""
    if DESKTOP_BIN.get(os.path.basename(name)):
        return True
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    return shutil.which(name, path=path) is not None


_WEB_URL = re.compile(r"https?://(?!localhost|127\.0\.0\.1)[^\s\"']+")


def needs_web(raw: dict[str, Any]) -> bool:
    """Whether the task reaches the web anywhere (a download, a cloud_file gold, a page to
    open or check): any http(s) address outside loopback in its steps or evaluator."""
    used = {"config": raw.get("config"), "evaluator": raw.get("evaluator")}  # not "source"
    return bool(_WEB_URL.search(json.dumps(used)))


def domain_table(root: Path) -> str:
    """The markdown table of ``--table`` (module docstring)."""
    loaded_with, _ = count(root)
    out = subprocess.run(
        [sys.executable, __file__, str(root), "--json", "--hide-extra"],
        capture_output=True,
        text=True,
        check=True,
    )
    loaded_without = set(json.loads(out.stdout)["loaded_ids"])
    rows: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    missing: collections.Counter = collections.Counter()
    with_set = set(loaded_with)
    for f in sorted(root.glob("*/*.json")):
        name, domain = f"{f.parent.name}/{f.stem}", f.parent.name
        r = rows[domain]
        r["files"] += 1
        r["without"] += name in loaded_without
        if name not in with_set:
            continue
        r["with"] += 1
        raw = json.loads(f.read_text(encoding="utf-8"))
        absent = sorted(p for p in programs_needed(raw) if not has_program(p))
        missing.update(absent)
        if not absent:
            r["programs"] += 1
            r["offline"] += not needs_web(raw)
    cols = ("files", "without", "with", "programs", "offline")
    lines = [
        "| domain | task files | load without the extra | load with it | "
        "programs all on a LocalDesktop here | of those, no web address |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    total: collections.Counter = collections.Counter()
    for domain in sorted(rows):
        total.update(rows[domain])
        lines.append(f"| {domain} | " + " | ".join(str(rows[domain][c]) for c in cols) + " |")
    lines.append("| **all** | " + " | ".join(f"**{total[c]}**" for c in cols) + " |")
    lines.append("")
    lines.append(
        "Programs missing on this machine's LocalDesktop (tasks that need each, among those "
        "that load): " + ", ".join(f"{p} {n}" for p, n in missing.most_common())
    )
    office = ("libreoffice", "gimp", "vlc", "thunderbird", "evince")
    if any(p in missing for p in office):
        lines.append("(`make apt-office` installs LibreOffice, GIMP, VLC, Thunderbird and Evince)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The command line: runs what the module docstring describes."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("root", type=Path, help="OSWorld's evaluation_examples/examples")
    ap.add_argument("--names", action="store_true", help="list the task ids of each reason")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--table", action="store_true", help="the per-domain markdown table")
    ap.add_argument(
        "--hide-extra", action="store_true", help="count as if the osworld extra were missing"
    )
    args = ap.parse_args(argv)
    if not args.root.is_dir():
        ap.error(f"{args.root} is not a directory")
    if args.table:
        print(domain_table(args.root))
        return 0
    loaded, failed = count(args.root)
    total = len(loaded) + sum(len(v) for v in failed.values())
    if args.json:
        print(
            json.dumps(
                {"total": total, "loaded": len(loaded), "failed": failed, "loaded_ids": loaded},
                indent=1,
            )
        )
        return 0
    print(f"{len(loaded)} of {total} task files load")
    for reason, names in failed.items():
        print(f"{len(names):5d}  {reason}")
        if args.names:
            for n in names:
                print(f"         {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
