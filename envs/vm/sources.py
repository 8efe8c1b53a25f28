"""Task sources for ``envs.tasks.load_tasks``: the built-in desktop suite and OSWorld task dirs.

Importing ``envs.vm`` registers them (lazily: this module loads on first use)::

    import envs.vm  # noqa: F401  (registers "desktop" and "osworld")
    from envs.tasks import load_tasks
    load_tasks({"source_type": "desktop"})                               # 12 built-in tasks
    load_tasks({"source_type": "desktop", "names": ["terminal-mkdir"]})
    load_tasks({"source_type": "osworld", "path": "OSWorld/evaluation_examples/examples",
                "domains": ["os"], "skip_unsupported": True})
    load_tasks({"source_type": "osworld", "path": "OSWorld/evaluation_examples/examples",
                "meta": "OSWorld/evaluation_examples/test_all.json", "domains": ["os"]})
    load_tasks({"source_type": "ids", "task_ids": ["desktop/terminal-mkdir"]})

Tasks come back with ``source`` "desktop" / "osworld" and ``spec`` = the OSWorld JSON, which is
what ``VMEnv`` runs.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

from cua_jax.env_api import Task
from envs.tasks import TaskSourceError
from envs.vm import osworld
from envs.vm.env import task_from_osworld


def _limit(tasks: list[Task], cfg: dict[str, Any]) -> list[Task]:
    if cfg.get("seed") is not None:
        tasks = list(tasks)
        random.Random(int(cfg["seed"])).shuffle(tasks)
    limit = cfg.get("limit")
    return tasks[: int(limit)] if limit is not None else tasks


def _api(cfg: dict[str, Any]) -> Any:
    """The ``api_actions`` key: a list of desktop API action names, or True for every one each
    task lists (its oracle then uses them)."""
    api = cfg.get("api_actions") or ()
    return True if api is True or api == "all" else ([api] if isinstance(api, str) else api)


def builtin_desktop_tasks(cfg: dict[str, Any]) -> list[Task]:
    """``{"source_type": "desktop", "names": [...], "limit": N, "seed": S, "api_actions":
    [...] | "all"}``."""
    by_name = {t.id: t for t in osworld.load_builtin()}
    names = cfg.get("names")
    if names is not None:
        names = [names] if isinstance(names, str) else list(names)
        bad = [n for n in names if n not in by_name]
        if bad:
            raise TaskSourceError(
                f"unknown built-in desktop task(s) {bad}; valid: {', '.join(sorted(by_name))}"
            )
    chosen = [by_name[n] for n in names] if names is not None else list(by_name.values())
    try:
        return _limit([task_from_osworld(t, "desktop", _api(cfg)) for t in chosen], cfg)
    except (ValueError, osworld.TaskFormatError) as e:
        raise TaskSourceError(str(e)) from e


def read_meta(meta: str | dict[str, Any]) -> dict[str, list[str]]:
    """OSWorld's meta file (``test_all.json``: ``{domain: [task ids]}``), a path or the dict."""
    if isinstance(meta, str | Path):
        try:
            meta = json.loads(Path(meta).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise TaskSourceError(f"cannot read OSWorld meta file {meta}: {e}") from e
    if not isinstance(meta, dict) or not all(
        isinstance(ids, list) and all(isinstance(i, str) for i in ids) for ids in meta.values()
    ):
        raise TaskSourceError("an OSWorld meta file is {domain: [task ids]}, as test_all.json")
    return {str(d): list(ids) for d, ids in meta.items()}


def osworld_tasks(cfg: dict[str, Any]) -> list[Task]:
    """``{"source_type": "osworld", "path": DIR, "meta": FILE, "domains": [...], "ids": [...],
    "skip_unsupported": bool, "limit": N, "seed": S}``.

    ``path`` is OSWorld's ``evaluation_examples/examples`` (``<domain>/<id>.json``). ``meta``:
    OSWorld's meta file (``test_all.json``, ``{domain: [ids]}``, or the dict itself): its tasks,
    in its order, each of which must exist under ``path``. ``domains``: only these (OSWorld's
    ``--domain``; "all" or absent: every one). Tasks that use getters or metrics this loader
    lacks, or steps that need credentials it was not given (``googledrive``, ``login``), raise,
    unless ``skip_unsupported``, which skips them and prints one line saying how many were
    skipped and why.
    """
    path = cfg.get("path")
    if not path or not Path(path).is_dir():
        raise TaskSourceError(
            f"source_type 'osworld' needs path: OSWorld's evaluation_examples/examples "
            f"directory (got {path!r})"
        )
    domains = cfg.get("domains")
    domains = [domains] if isinstance(domains, str) else domains
    if domains and "all" in domains:
        domains = None
    ids = set(cfg.get("ids") or [])
    if cfg.get("meta") is not None:
        meta = read_meta(cfg["meta"])
        unknown = sorted(set(domains or ()) - set(meta))
        if unknown:
            raise TaskSourceError(
                f"domain(s) {unknown} are not in the meta file; it has {', '.join(meta)}"
            )
        files = [Path(path, d, f"{i}.json") for d, ids_ in meta.items() for i in ids_]
        absent = [f"{f.parent.name}/{f.stem}" for f in files if not f.is_file()]
        if absent:
            raise TaskSourceError(
                f"{len(absent)} task(s) of the meta file are not under {path}: {absent[:5]}"
            )
    else:
        files = sorted(Path(path).glob("*/*.json"))
    out: list[Task] = []
    skipped: dict[str, int] = {}
    for f in files:
        if domains and f.parent.name not in domains:
            continue
        if ids and f.stem not in ids:
            continue
        try:
            out.append(task_from_osworld(osworld.load_task(f), "osworld", _api(cfg)))
        except osworld.TaskFormatError as e:
            if not cfg.get("skip_unsupported"):
                raise TaskSourceError(str(e)) from e
            reason = e.reason or str(e).split(": ", 1)[-1].split(";")[0]
            skipped[reason] = skipped.get(reason, 0) + 1
    if skipped:
        print(
            f"[osworld] skipped {sum(skipped.values())} unsupported task(s): "
            + json.dumps(skipped),
            file=sys.stderr,
        )
    return _limit(out, cfg)


def desktop_task_from_id(task_id: str) -> Task:
    """``desktop/<name>`` -> the built-in desktop task."""
    name = task_id.partition("/")[2]
    return builtin_desktop_tasks({"names": [name]})[0]
