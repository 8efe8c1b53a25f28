"""Task sources: config dicts (or lists of them) -> ``list[cua_jax.env_api.Task]``.

    load_tasks({"source_type": "builtin", "split": "train", "category": "forms",
                "difficulty": "easy", "limit": 20, "seed": 42})
    load_tasks([{"source_type": "miniwob", "names": ["click-test", "enter-text"]},
                {"source_type": "ids", "task_ids": ["builtin/click-button/17"]},
                {"source_type": "custom", "instructions": ["Open the settings page"]},
                {"source_type": "file", "path": "tasks.jsonl"}])

Source types register themselves in a small registry, so other packages add theirs without
editing this file::

    from envs.tasks import register_source, register_id_prefix
    register_source("osworld", load_osworld_tasks)      # fn(cfg: dict) -> list[Task]
    register_id_prefix("osworld", task_from_osworld_id)  # fn(task_id: str) -> Task

A bad source (unknown type, unknown key, unknown category/template, missing or malformed file)
raises ``TaskSourceError`` naming the problem and the valid choices.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from cua_jax.env_api import DIFFICULTIES, SPLITS, Task

SourceFn = Callable[[dict[str, Any]], list[Task]]
IdFn = Callable[[str], Task]

_SOURCES: dict[str, SourceFn] = {}
_SOURCE_KEYS: dict[str, frozenset[str] | None] = {}
_ID_PREFIXES: dict[str, IdFn] = {}


class TaskSourceError(ValueError):
    """A task source config is wrong; the message names the problem and the fix."""


def register_source(name: str, fn: SourceFn, keys: Iterable[str] | None = None) -> None:
    """Make ``{"source_type": name, ...}`` load with ``fn(cfg)``.

    ``keys``: the config keys ``fn`` accepts (besides "source_type"); unknown keys then raise
    an error listing these. None accepts any key.
    """
    _SOURCES[name] = fn
    _SOURCE_KEYS[name] = None if keys is None else frozenset(keys)


def register_id_prefix(prefix: str, fn: IdFn) -> None:
    """Make ``{"source_type": "ids"}`` resolve ids starting with ``prefix + "/"`` via ``fn``."""
    _ID_PREFIXES[prefix] = fn


def source_types() -> tuple[str, ...]:
    return tuple(_SOURCES)


def source_dicts(source: Any, name: str = "a task source") -> list[dict[str, Any]]:
    """``source`` (one source dict or a list of them; ml_collections ConfigDicts too) as a list
    of plain dicts; ``TaskSourceError`` naming ``name`` (e.g. "config.tasks") for anything else,
    such as the string ``--config.tasks=junk`` leaves."""
    if hasattr(source, "to_dict") and not isinstance(source, Mapping):
        source = source.to_dict()  # an ml_collections ConfigDict (not a Mapping)
    if isinstance(source, Mapping):
        return [dict(source)]
    if isinstance(source, str | bytes) or not isinstance(source, Iterable):
        raise TaskSourceError(
            f"{name} must be a dict like {{'source_type': 'builtin'}} or a list of them, "
            f"got {type(source).__name__} {source!r:.200}"
        )
    out = []
    for i, s in enumerate(source):
        if hasattr(s, "to_dict") and not isinstance(s, Mapping):
            s = s.to_dict()
        if not isinstance(s, Mapping):
            raise TaskSourceError(
                f"{name}: source #{i} must be a dict like {{'source_type': 'builtin'}}, "
                f"got {type(s).__name__} {s!r:.200}"
            )
        out.append(dict(s))
    return out


def load_tasks(source: Mapping[str, Any] | Iterable[Mapping[str, Any]]) -> list[Task]:
    """Tasks from one source config dict or a list of them (concatenated in order)."""
    out: list[Task] = []
    for s in source_dicts(source):
        out.extend(_load_one(s))
    return out


def _int(cfg: Mapping[str, Any], key: str, default: int | None, minimum: int = 0) -> int | None:
    """``cfg[key]`` as an int >= ``minimum`` (``default`` when absent or None); a string such as
    ``limit: 'x'`` is a ``TaskSourceError`` naming the key, not a TypeError deep in a source."""
    v = cfg.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise TaskSourceError(
            f"{key} must be an integer >= {minimum} (source_type {cfg.get('source_type')!r}), "
            f"got {v!r:.100}"
        )
    return v


def _load_one(cfg: Mapping[str, Any]) -> list[Task]:
    cfg = dict(cfg)  # also turns an ml_collections ConfigDict into a plain dict
    st = cfg.get("source_type")
    if st not in _SOURCES:
        raise TaskSourceError(
            f"unknown task source_type {st!r} in {cfg}; valid: {', '.join(_SOURCES)}"
        )
    keys = _SOURCE_KEYS[st]
    if keys is not None:
        bad = sorted(set(cfg) - keys - {"source_type"})
        if bad:
            raise TaskSourceError(
                f"unknown key(s) {bad} for source_type {st!r}; "
                f"valid keys: {', '.join(sorted(keys))}"
            )
    return _SOURCES[st](cfg)


# ------------------------------------------------------------------------------------------
# built-in sources
# ------------------------------------------------------------------------------------------


def _builtin(cfg: dict[str, Any]) -> list[Task]:
    from envs.browser import suite  # noqa: PLC0415 -- keeps `envs.tasks` light to import

    split = cfg.get("split", "train")
    if split not in SPLITS:
        raise TaskSourceError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    cat = cfg.get("category")
    if cat is not None and cat not in suite.CATEGORIES:
        raise TaskSourceError(
            f"unknown built-in category {cat!r}; valid: {', '.join(suite.CATEGORIES)}"
        )
    diff = cfg.get("difficulty")
    if diff is not None and diff not in DIFFICULTIES:
        raise TaskSourceError(f"unknown difficulty {diff!r}; valid: {', '.join(DIFFICULTIES)}")
    names = cfg.get("templates")
    if names is not None:
        names = [names] if isinstance(names, str) else list(names)
        bad = [n for n in names if n not in suite.BY_NAME]
        if bad:
            raise TaskSourceError(
                f"unknown built-in template(s) {bad}; valid: {', '.join(suite.BY_NAME)}"
            )
    try:
        return suite.sample_tasks(
            split=split,
            category=cat,
            difficulty=diff,
            limit=_int(cfg, "limit", None),
            seed=_int(cfg, "seed", 0),
            names=names,
            per_template=_int(cfg, "per_template", None, minimum=1),
            api_actions=cfg.get("api_actions") or (),
        )
    except ValueError as e:
        raise TaskSourceError(str(e)) from e


def _miniwob(cfg: dict[str, Any]) -> list[Task]:
    from envs.browser import miniwob  # noqa: PLC0415

    names = cfg.get("names") or list(miniwob.DEFAULT_TASKS)
    if isinstance(names, str):
        names = [names]
    valid = miniwob.task_names()
    bad = [n for n in names if n not in valid]
    if bad:
        raise TaskSourceError(f"unknown MiniWoB++ task(s) {bad}; valid: {', '.join(valid)}")
    split = cfg.get("split", "train")
    if split not in SPLITS:
        raise TaskSourceError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    k = _int(cfg, "seeds_per_task", 1, minimum=1)
    rng = random.Random(f"miniwob|{split}|{_int(cfg, 'seed', 0)}")
    tasks = []
    for _ in range(k):
        for n in names:
            t = miniwob.make_task(n, rng.randrange(2**31), split)
            tasks.append(dataclasses.replace(t, id=f"{t.id}/{t.seed}"))
    limit = _int(cfg, "limit", None)
    return tasks[:limit] if limit is not None else tasks


def _ids(cfg: dict[str, Any]) -> list[Task]:
    ids = cfg.get("task_ids")
    if not isinstance(ids, list | tuple) or not ids:
        raise TaskSourceError("source_type 'ids' needs task_ids: a non-empty list of task ids")
    return [task_from_id(str(i)) for i in ids]


def task_from_id(task_id: str) -> Task:
    """``builtin/<template>/<seed>``, ``miniwob/<name>[/<seed>]`` or a registered prefix."""
    prefix, _, rest = task_id.partition("/")
    if prefix == "builtin":
        from envs.browser import suite  # noqa: PLC0415

        name, _, seed = rest.partition("/")
        if name not in suite.BY_NAME or not seed.isdigit():
            raise TaskSourceError(
                f"bad built-in task id {task_id!r}: expected builtin/<template>/<seed> with a "
                f"template in {', '.join(suite.BY_NAME)}"
            )
        split = "eval" if int(seed) >= suite.EVAL_SEED_OFFSET else "train"
        return suite.make_task(name, int(seed), split)
    if prefix == "miniwob":
        from envs.browser import miniwob  # noqa: PLC0415

        name, _, seed = rest.partition("/")
        if name not in miniwob.task_names() or (seed and not seed.isdigit()):
            raise TaskSourceError(
                f"bad MiniWoB++ task id {task_id!r}: expected miniwob/<name>[/<seed>] with a "
                f"name in {', '.join(miniwob.task_names())}"
            )
        t = miniwob.make_task(name, int(seed or 0))
        return dataclasses.replace(t, id=task_id)
    if prefix in _ID_PREFIXES:
        return _ID_PREFIXES[prefix](task_id)
    raise TaskSourceError(
        f"unknown task id {task_id!r}; ids start with one of: "
        f"{', '.join(['builtin', 'miniwob', *_ID_PREFIXES])}"
    )


def _custom(cfg: dict[str, Any]) -> list[Task]:
    ins = cfg.get("instructions")
    if not isinstance(ins, list | tuple) or not ins or not all(isinstance(i, str) for i in ins):
        raise TaskSourceError(
            "source_type 'custom' needs instructions: a non-empty list of strings"
        )
    spec: dict[str, Any] = {"kind": "page"}
    if cfg.get("start_url"):
        spec["url"] = cfg["start_url"]
    if cfg.get("html"):
        spec["html"] = cfg["html"]
    return [
        Task(
            id=f"custom/{i}",
            instruction=text,
            source="custom",
            category="custom",
            difficulty=cfg.get("difficulty", "medium"),
            split=cfg.get("split", "train"),
            seed=i,
            spec=spec,
            max_steps=_int(cfg, "max_steps", 15, minimum=1),
            has_checker=False,
        )
        for i, text in enumerate(ins)
    ]


_TASK_FIELDS = {f.name for f in dataclasses.fields(Task)} - {"oracle"}
# The JSON type each task-file field must have (a "spec" string crashed the loader).
_STR, _INT = ((str,), "a string"), ((int,), "an integer")
_FIELD_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "id": _STR,
    "instruction": _STR,
    "source": _STR,
    "category": _STR,
    "difficulty": _STR,
    "split": _STR,
    "seed": _INT,
    "spec": ((dict,), "an object"),
    "max_steps": _INT,
    "oracle_steps": ((int, type(None)), "an integer or null"),
    "has_checker": ((bool,), "true or false"),
    "api_actions": ((list, str), "a list of names"),
}
_reading: list[str] = []  # the task files being read, outermost first (include cycles)


def check_task_fields(
    d: Mapping[str, Any], required: Iterable[str] = ("id", "instruction", "source")
) -> None:
    """Raises ``TaskSourceError`` unless ``d`` is a Task's JSON form (``Task.to_dict``): no
    unknown field, the ``required`` ones present, each of its JSON type (a task file's or a
    browser host's client's ``"spec": "a string"`` crashed whoever read it later)."""
    bad = sorted(set(d) - _TASK_FIELDS)
    missing = [k for k in required if k not in d]
    if bad or missing:
        raise TaskSourceError(
            (f"unknown task field(s) {bad}; " if bad else "")
            + (f"missing {missing}; " if missing else "")
            + f"valid fields: {', '.join(sorted(_TASK_FIELDS))}"
        )
    for k, v in d.items():
        types, what = _FIELD_TYPES.get(k, ((object,), ""))
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            raise TaskSourceError(f"task field {k!r} must be {what}, got {v!r:.100}")


def _file(cfg: dict[str, Any]) -> list[Task]:
    """JSONL, one task per line: a Task dict ({"id", "instruction", ...}, as Task.to_dict
    writes) or a source dict ({"source_type": ...}, which may name another file, never one
    being read); blank lines and # comments are skipped."""
    path = cfg.get("path")
    if not path or not isinstance(path, str):
        raise TaskSourceError("source_type 'file' needs path: a JSONL file of tasks")
    if not os.path.isfile(path):
        raise TaskSourceError(f"task file {path!r} does not exist (source_type 'file')")
    real = os.path.realpath(path)
    if real in _reading:
        chain = " -> ".join([*_reading, real])
        raise TaskSourceError(f"task file {path} includes itself ({chain})")
    _reading.append(real)
    try:
        return _read_task_file(path)
    finally:
        _reading.pop()


def _read_task_file(path: str) -> list[Task]:
    out: list[Task] = []
    try:
        with open(path, "rb") as f:
            raw = f.read()
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        n = raw.count(b"\n", 0, e.start) + 1
        raise TaskSourceError(f"{path}:{n}: not UTF-8 text (byte {e.start}: {e.reason})") from e
    except OSError as e:
        raise TaskSourceError(f"task file {path!r} cannot be read: {e.strerror}") from e
    for n, line in enumerate(text.split("\n"), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskSourceError(f"{path}:{n}: not valid JSON ({e.msg})") from e
        except RecursionError as e:
            raise TaskSourceError(f"{path}:{n}: JSON nested too deep") from e
        if not isinstance(d, dict):
            raise TaskSourceError(f"{path}:{n}: each line must be a JSON object")
        if "source_type" in d:
            try:
                out.extend(_load_one(d))
            except TaskSourceError as e:
                raise TaskSourceError(f"{path}:{n}: {e}") from None
            continue
        try:
            check_task_fields(d, required=("id", "instruction"))
        except TaskSourceError as e:
            raise TaskSourceError(f"{path}:{n}: {e}") from None
        d.setdefault("source", "file")
        if not d.get("spec"):
            d["spec"] = {"kind": "page"}
        if d["source"] == "custom" or d["spec"].get("kind") == "page":
            d.setdefault("has_checker", False)
        out.append(Task(**d))
    return out


register_source(
    "builtin",
    _builtin,
    keys=(
        "split",
        "category",
        "difficulty",
        "limit",
        "seed",
        "templates",
        "per_template",
        "api_actions",
    ),
)
register_source("miniwob", _miniwob, keys=("names", "split", "seeds_per_task", "seed", "limit"))
register_source("ids", _ids, keys=("task_ids",))
register_source(
    "custom",
    _custom,
    keys=("instructions", "start_url", "html", "difficulty", "split", "max_steps"),
)
register_source("file", _file, keys=("path",))
