"""How many of OSWorld's task files our loader accepts, and why the others fail.

    python tools/osworld_load_count.py OSWorld/evaluation_examples/examples [--names]

Loads every ``<domain>/<id>.json`` with ``envs.vm.osworld.load_task`` and prints the count that
load, then the failures grouped by their first reason (the setup step, getter or metric the
loader lacks, or the credentials a step needs), most common first. ``--names`` lists the task
ids under each reason. ``--json`` prints the same as one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

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


def main(argv: list[str] | None = None) -> int:
    """The command line: runs what the module docstring describes."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("root", type=Path, help="OSWorld's evaluation_examples/examples")
    ap.add_argument("--names", action="store_true", help="list the task ids of each reason")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if not args.root.is_dir():
        ap.error(f"{args.root} is not a directory")
    loaded, failed = count(args.root)
    total = len(loaded) + sum(len(v) for v in failed.values())
    if args.json:
        print(json.dumps({"total": total, "loaded": len(loaded), "failed": failed}, indent=1))
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
