"""OSWorld task JSON: loading, validation, setup steps, getters and metrics.

An OSWorld task (``evaluation_examples/examples/<domain>/<id>.json`` in xlang-ai/OSWorld)::

    {"id", "snapshot", "instruction", "source", "related_apps",
     "config": [{"type": "execute", "parameters": {...}}, ...],        # setup steps
     "evaluator": {"postconfig": [...], "func": "exact_match" | [...], "conj": "and" | "or",
                   "result": {"type": "vm_command_line", ...}, "expected": {"type": "rule", ...},
                   "options": {...}}}

Every setup step type OSWorld's task files use runs (``envs.vm.osworld_setup``: downloads
through OSWorld's file cache, Chrome tabs, ...; ``googledrive`` and ``login`` only when their
credentials are configured). The getters and metrics here are the subset that needs no
app-specific Python (see ``GETTERS``, ``METRICS``), with the same semantics as OSWorld's
``desktop_env/evaluators``; every other one is OSWorld's own, from desktop-env
(``envs.vm.osworld_evaluators``, the ``osworld`` extra). A task that names one neither has
fails at *load* time with an error naming it and the fix (the extra's install command, or a
newer desktop-env; ``TaskFormatError.reason`` in short), so a suite never dies halfway through
a run.

Built-in desktop tasks (``envs/vm/tasks/*.json``) use the same format plus an ``"oracle"`` list
of pyautogui action strings (parsed into our typed actions) that solves the task with GUI
actions, and optionally ``"api_actions"`` (the API actions the task may allow: "run_shell",
"open_app", "write_file", "set_cell") with an ``"api_oracle"`` that solves it with them
(``run_shell('mkdir -p ~/x')``, ``DONE``): what the oracle plays when a task source allows them.
Any task may set ``"settle_s"``: how long its screen must hold still after its window steps
before the first screenshot (the built-in xterm tasks: 0.2 s, where an office app needs the
env's default of a second).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from envs.vm import osworld_evaluators as desktop_env
from envs.vm.client import VMClient
from envs.vm.osworld_setup import (
    CREDENTIAL_STEPS,
    SETUP_TYPES,
    ContentCache,
    DownloadError,
    SetupError,
    SetupOptions,
    credentials_problem,
    fill_placeholders,
    run_setup,
    settings_roots,
)

__all__ = [  # the setup names live in osworld_setup; importers of this module see them here too
    "CREDENTIAL_STEPS",
    "SETUP_TYPES",
    "ContentCache",
    "DownloadError",
    "SetupError",
    "SetupOptions",
    "fill_placeholders",
    "run_setup",
]

GETTERS = (
    "vm_command_line",
    "vm_command_error",
    "vm_file",
    "rule",
    "vm_screen_size",
    "vm_terminal_output",
    "cloud_file",
    "cache_file",
)
METRICS = (
    "exact_match",
    "check_include_exclude",
    "compare_text_file",
    "match_in_list",
    "is_in_list",
    "literal_match",
    "infeasible",
    # OSWorld's, newer than desktop-env 1.0.2 (written here after OSWorld's semantics)
    "check_play_and_exit",
    "check_structure_sim_with_threshold",
)
# A built-in metric that needs a module of the osworld extra: a task naming it loads only where
# the extra is installed (its message names the extra).
METRIC_MODULES = {"check_structure_sim_with_threshold": "skimage"}
BUILTIN_TASK_DIR = Path(__file__).parent / "tasks"


class TaskFormatError(ValueError):
    """A task JSON is malformed or uses a type this loader does not support. ``reason``: the
    short why (``"metric compare_table"``) that load counts group by."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class OSWorldTask:
    """One validated OSWorld task. ``raw`` is the JSON as loaded (placeholders unfilled)."""

    id: str
    instruction: str
    config: tuple[Mapping[str, Any], ...]
    evaluator: Mapping[str, Any]
    domain: str = ""
    snapshot: str = ""
    related_apps: tuple[str, ...] = ()
    base_dir: str | None = None  # where upload_file's local_path is resolved
    oracle: tuple[str, ...] | None = None  # pyautogui strings (built-in tasks only)
    api_actions: tuple[str, ...] = ()  # the API actions this task can allow
    api_oracle: tuple[str, ...] | None = None  # the oracle with them (pyautogui-format strings)
    max_steps: int = 15
    # how long the screen must hold still after a window-showing setup step before the first
    # screenshot (``VMEnv._settle``); None: the env's ``settle_s``
    settle_s: float | None = None
    raw: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def infeasible(self) -> bool:
        return _as_list(self.evaluator.get("func")) == ["infeasible"]


def _as_list(x: Any) -> list[Any]:
    return list(x) if isinstance(x, list | tuple) else [x]


def _check_steps(
    steps: Any, where: str, what: str, roots: list[Path]
) -> tuple[Mapping[str, Any], ...]:
    if steps is None:
        return ()
    if not isinstance(steps, list):
        raise TaskFormatError(f"{where}: {what} must be a list of {{type, parameters}} objects")
    for i, s in enumerate(steps):
        if not isinstance(s, dict) or "type" not in s:
            raise TaskFormatError(f"{where}: {what}[{i}] must be an object with a 'type'")
        if s["type"] not in SETUP_TYPES:
            raise TaskFormatError(
                f"{where}: {what}[{i}] has type {s['type']!r}, which is not supported; "
                f"supported setup types: {', '.join(SETUP_TYPES)}",
                f"setup step {s['type']}",
            )
        if not isinstance(s.get("parameters", {}), dict):
            raise TaskFormatError(f"{where}: {what}[{i}].parameters must be an object")
        problem = credentials_problem(s, roots)
        if problem:
            raise TaskFormatError(f"{where}: {what}[{i}]: {problem}", problem.split(":")[0])
    return tuple(steps)


def _check_getters(cfg: Any, where: str, what: str) -> None:
    for i, g in enumerate(_as_list(cfg)):
        if g is None:
            continue
        got = g.get("type") if isinstance(g, dict) else g
        if not isinstance(got, str):
            raise TaskFormatError(f"{where}: evaluator.{what}[{i}] must be a {{type, ...}} object")
        if got not in GETTERS and not desktop_env.has("getter", got):
            raise TaskFormatError(
                f"{where}: evaluator.{what}[{i}] has getter type {got!r}, which is not supported "
                f"here: the built-in getters are {', '.join(GETTERS)}; "
                f"{desktop_env.missing_reason('getter', got)}",
                f"getter {got}",
            )


def parse_task(
    d: Mapping[str, Any],
    *,
    where: str = "<task>",
    base_dir: str | Path | None = None,
    domain: str = "",
) -> OSWorldTask:
    """Validates an OSWorld task dict; raises TaskFormatError naming the field and the fix."""
    if not isinstance(d, Mapping):
        raise TaskFormatError(f"{where}: a task must be a JSON object, got {type(d).__name__}")
    for key in ("id", "instruction", "evaluator"):
        if key not in d:
            raise TaskFormatError(f"{where}: missing required field {key!r}")
    if not isinstance(d["instruction"], str) or not d["instruction"].strip():
        raise TaskFormatError(f"{where}: 'instruction' must be a non-empty string")
    roots = settings_roots(base_dir)
    config = _check_steps(d.get("config", []), where, "config", roots)
    ev = d["evaluator"]
    if not isinstance(ev, dict) or "func" not in ev:
        raise TaskFormatError(f"{where}: 'evaluator' must be an object with a 'func'")
    funcs = _as_list(ev["func"])
    for f in funcs:
        if not isinstance(f, str):
            raise TaskFormatError(f"{where}: evaluator.func must name metrics, got {f!r}")
        if f not in METRICS and not desktop_env.has("metric", f):
            raise TaskFormatError(
                f"{where}: evaluator.func {f!r} is not supported here: the built-in metrics are "
                f"{', '.join(METRICS)}; {desktop_env.missing_reason('metric', f)}",
                f"metric {f}",
            )
        module = METRIC_MODULES.get(f)
        if module and (desktop_env.unavailable() or importlib.util.find_spec(module) is None):
            raise TaskFormatError(
                f"{where}: evaluator.func {f!r} needs the osworld extra (its {module} module): "
                f"{desktop_env.INSTALL_HINT}",
                f"metric {f}",
            )
    if ev.get("conj", "and") not in ("and", "or"):
        raise TaskFormatError(f"{where}: evaluator.conj must be 'and' or 'or'")
    _check_steps(ev.get("postconfig", []), where, "evaluator.postconfig", roots)
    if funcs != ["infeasible"]:
        if "result" not in ev:
            raise TaskFormatError(f"{where}: evaluator needs a 'result' getter")
        _check_getters(ev["result"], where, "result")
        _check_getters(ev.get("expected"), where, "expected")
        if isinstance(ev["func"], list) and len(_as_list(ev["result"])) != len(funcs):
            raise TaskFormatError(f"{where}: evaluator.func and evaluator.result differ in length")
    oracle = d.get("oracle")
    if oracle is not None and not (
        isinstance(oracle, list) and all(isinstance(a, str) for a in oracle)
    ):
        raise TaskFormatError(f"{where}: 'oracle' must be a list of pyautogui action strings")
    api_oracle = d.get("api_oracle")
    if api_oracle is not None and not (
        isinstance(api_oracle, list) and all(isinstance(a, str) for a in api_oracle)
    ):
        raise TaskFormatError(f"{where}: 'api_oracle' must be a list of action strings")
    from cua_jax.actions import VM_API  # noqa: PLC0415 -- keeps the server's import light

    api = d.get("api_actions", [])
    if not (isinstance(api, list) and all(isinstance(a, str) and a in VM_API for a in api)):
        raise TaskFormatError(
            f"{where}: 'api_actions' must be a list of desktop API action names "
            f"({', '.join(VM_API)}), got {api!r}"
        )
    if api_oracle is not None and not api:
        raise TaskFormatError(f"{where}: an 'api_oracle' needs the 'api_actions' it uses")
    settle = d.get("settle_s")
    if settle is not None and (
        isinstance(settle, bool) or not isinstance(settle, (int, float)) or not settle >= 0
    ):
        raise TaskFormatError(f"{where}: 'settle_s' must be a number of seconds >= 0")
    return OSWorldTask(
        id=str(d["id"]),
        instruction=d["instruction"],
        config=config,
        evaluator=ev,
        domain=domain or str(d.get("domain", "")),
        snapshot=str(d.get("snapshot", "")),
        related_apps=tuple(d.get("related_apps", ())),
        base_dir=str(base_dir) if base_dir is not None else None,
        oracle=tuple(oracle) if oracle is not None else None,
        api_actions=tuple(api),
        api_oracle=tuple(api_oracle) if api_oracle is not None else None,
        max_steps=int(d.get("max_steps", 15)),
        settle_s=None if settle is None else float(settle),
        raw=dict(d),
    )


def load_task(path: str | Path) -> OSWorldTask:
    """Loads and validates one task file."""
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TaskFormatError(f"{path}: not valid JSON ({e})") from e
    return parse_task(d, where=str(path), base_dir=path.parent, domain=path.parent.name)


def load_dir(root: str | Path) -> list[OSWorldTask]:
    """All ``*.json`` tasks under ``root`` (OSWorld layout ``<domain>/<id>.json``), sorted."""
    root = Path(root)
    if not root.is_dir():
        raise TaskFormatError(f"task directory {root} does not exist")
    return [load_task(p) for p in sorted(root.rglob("*.json"))]


def load_builtin() -> list[OSWorldTask]:
    """The built-in desktop tasks shipped in ``envs/vm/tasks``."""
    return [dataclasses.replace(t, domain="desktop") for t in load_dir(BUILTIN_TASK_DIR)]


# ----------------------------------------------------------------------------- getters


async def get_value(
    client: VMClient,
    cfg: Mapping[str, Any] | None,
    cache_dir: Path,
    *,
    task_id: str = "",
    options: SetupOptions | None = None,
) -> Any:
    """Fetches a ``result`` / ``expected`` value like OSWorld's getters (None when missing).

    ``cache_dir``: where ``vm_file`` puts its copies (this evaluation's own). ``cloud_file``
    goes through ``options.cache`` (``<task id>/<dest>``, OSWorld's layout), ``cache_file``
    reads the episode's ``options.work_dir`` (what ``execute`` steps saved with ``stdout``).
    """
    opts = options or SetupOptions()
    if cfg is None:
        return None
    t = cfg["type"]
    if t == "rule":
        return cfg["rules"]
    if t in ("vm_command_line", "vm_command_error"):
        r = await client.execute(cfg["command"], shell=bool(cfg.get("shell", False)))
        if r.get("status") != "success":
            return None
        return r.get("output") if t == "vm_command_line" else r.get("error")
    if t == "vm_file":
        # OSWorld downloads into its cache dir and hands metrics the local path(s): with
        # "multi", every file is fetched (a metric may read a neighbour by name) and those at
        # "gives" (default [0]) are handed over, one as a str. A list without "multi" (ours)
        # hands over all. A file that is not there is None.
        paths, dests = _as_list(cfg["path"]), _as_list(cfg.get("dest", cfg["path"]))
        gives = cfg.get("gives", [0] if cfg.get("multi") else range(len(paths)))
        got: list[str | None] = []
        for path, dest in zip(paths, dests, strict=True):
            local = cache_dir / Path(str(dest)).name
            try:
                local.write_bytes(await client.download(path))
            except FileNotFoundError:
                got.append(None)
                continue
            got.append(str(local))
        out = [got[i] for i in gives]
        return out if isinstance(cfg["path"], list) and len(out) != 1 else out[0]
    if t == "vm_screen_size":
        w, h = await client.screen_size()
        return {"width": w, "height": h}
    if t == "vm_terminal_output":
        return await client.terminal()
    if t == "cloud_file":
        urls, dests = _as_list(cfg["path"]), _as_list(cfg["dest"])
        if not cfg.get("multi", False):
            urls, dests = urls[:1], dests[:1]
        cache = opts.cache or ContentCache()
        got = [
            await cache.fetch(task_id, str(u), [str(d)]) for u, d in zip(urls, dests, strict=True)
        ]
        gives = [str(got[i]) for i in cfg.get("gives", [0])]
        return gives[0] if len(gives) == 1 else gives
    if t == "cache_file":
        local = Path(opts.work_dir or cache_dir) / str(cfg["path"])
        return str(local) if local.is_file() else None
    raise TaskFormatError(f"unsupported getter {t!r}; supported: {', '.join(GETTERS)}")


# ----------------------------------------------------------------------------- metrics


def exact_match(result: Any, rules: Mapping[str, Any]) -> float:
    """1 when ``result == rules["expected"]``."""
    return float(result == rules["expected"])


def match_in_list(result: Any, rules: Mapping[str, Any]) -> float:
    """1 when ``result`` is one of ``rules["expected"]``."""
    return float(result in rules["expected"])


def is_in_list(result: Any, rules: Mapping[str, Any]) -> float:
    """1 when ``rules["expected"]`` occurs in ``result``."""
    return float(result is not None and rules["expected"] in result)


def check_include_exclude(result: Any, rules: Mapping[str, Any]) -> float:
    """1 when every ``include`` string is in ``result`` and no ``exclude`` string is."""
    if result is None:
        return 0.0
    inc, exc = rules.get("include", []), rules.get("exclude", [])
    return float(all(s in result for s in inc) and not any(s in result for s in exc))


def literal_match(result: Any, expected: Any, **options: Any) -> float:
    """Equality after OSWorld's normalisations (``type``: str | list, ``ignore_case``)."""
    if result is None:
        return 0.0
    kind, ic = options.get("type", "str"), options.get("ignore_case", False)
    if kind == "str":
        a, b = str(result), str(expected)
        return float((a.lower() == b.lower()) if ic else a == b)
    if kind == "list":
        a, b = list(result), list(expected)
        if ic:
            a, b = [str(x).lower() for x in a], [str(x).lower() for x in b]
        return float(a == b)
    raise TaskFormatError(f"literal_match option type must be 'str' or 'list', got {kind!r}")


def compare_text_file(file1: str | None, file2: str | None, **options: Any) -> float:
    """1 when the two text files are equal (``ignore_blanks``, ``ignore_case`` options)."""
    if not file1 or not file2:
        return 0.0
    a, b = Path(file1).read_text(errors="replace"), Path(file2).read_text(errors="replace")
    if options.get("ignore_blanks", False):
        a, b = re.sub(r"[\t\n ]+", "", a), re.sub(r"[\t\n ]+", "", b)
    if options.get("ignore_case", False):
        a, b = a.lower(), b.lower()
    return float(a == b)


def check_play_and_exit(config_path: str | None, rule: Mapping[str, Any]) -> float:
    """OSWorld's VLC check (its task 5ac2891a): 1 when VLC's config file (``vlcrc``, from the
    ``vlc_config`` getter) sets ``play-and-exit`` to ``rule["expected_play_and_exit"]``. Read as
    OSWorld reads it: the last line naming ``play-and-exit=`` gives the value, a commented
    default (``#play-and-exit=0``) included; no such line reads as "0"."""
    if config_path is None:
        return 0.0
    value = "0"
    for line in Path(config_path).read_text(encoding="utf-8", errors="replace").splitlines():
        if "play-and-exit=" in line:
            value = line.split("=")[-1].strip()
    return float(value == str(rule["expected_play_and_exit"]))


def check_structure_sim_with_threshold(
    src_path: str | None, tgt_path: str | None, **options: Any
) -> float:
    """OSWorld's image check (its task e8172110): 1 when the SSIM of the two images (RGB; the
    first resized to the second's size with Lanczos; scikit-image's ``structural_similarity``
    over a 7-pixel window, or the largest odd one a tiny image allows) is at least
    ``options["ssim_threshold"]`` (default 0.85). A missing or unreadable image scores 0."""
    from PIL import Image, UnidentifiedImageError  # noqa: PLC0415 -- at evaluation only
    from skimage.metrics import structural_similarity  # noqa: PLC0415 -- the osworld extra

    if src_path is None or tgt_path is None:
        return 0.0
    try:
        with Image.open(src_path) as a, Image.open(tgt_path) as b:
            src = a.convert("RGB")
            tgt = b.convert("RGB")
    except (OSError, UnidentifiedImageError):
        return 0.0
    if src.size != tgt.size:
        src = src.resize(tgt.size, Image.Resampling.LANCZOS)
    x, y = np.asarray(src), np.asarray(tgt)
    win = min(7, min(x.shape[:2]))
    win -= 1 - win % 2  # odd
    if win < 1:
        return 0.0
    sim = structural_similarity(x, y, win_size=win, channel_axis=2)
    return float(sim >= float(options.get("ssim_threshold", 0.85)))


_METRIC_FNS = {
    "exact_match": exact_match,
    "check_include_exclude": check_include_exclude,
    "compare_text_file": compare_text_file,
    "match_in_list": match_in_list,
    "is_in_list": is_in_list,
    "literal_match": literal_match,
    "check_play_and_exit": check_play_and_exit,
    "check_structure_sim_with_threshold": check_structure_sim_with_threshold,
}


@dataclasses.dataclass
class EvalResult:
    score: float
    details: list[dict[str, Any]]


async def _fetch(
    client: VMClient,
    bridge: desktop_env.DesktopEnvBridge,
    cfg: Mapping[str, Any] | None,
    cache_dir: Path,
    task_id: str,
    opts: SetupOptions,
) -> Any:
    """A getter's value: the built-in one, else desktop-env's."""
    if cfg is None or cfg.get("type") in GETTERS:
        return await get_value(client, cfg, cache_dir, task_id=task_id, options=opts)
    return await bridge.get(cfg, cache_dir)


async def evaluate(
    client: VMClient,
    task: OSWorldTask,
    *,
    screen_size: tuple[int, int],
    last_action_was_fail: bool,
    cache_dir: str | Path | None = None,
    options: SetupOptions | None = None,
) -> EvalResult:
    """Scores the VM's current state for ``task`` (OSWorld's DesktopEnv.evaluate semantics).

    Infeasible tasks score 1 only when the last action was FAIL; a FAIL on a feasible task
    scores 0. ``postconfig`` runs first; each metric gets (result, expected, **options);
    ``conj`` "and" averages (0 as soon as one metric is 0), "or" takes the max. ``options``:
    what the postconfig steps and the cache getters need (``SetupOptions``). Getters and
    metrics outside the built-in subset are desktop-env's (``envs.vm.osworld_evaluators``). A
    postconfig step, an ``expected`` file or desktop-env's code that fails raises
    ``SetupError``: a fault, not a score.
    """
    opts = options or SetupOptions()
    ev = fill_placeholders(dict(task.evaluator), screen_size, opts.client_password)
    if task.infeasible:
        return EvalResult(float(last_action_was_fail), [{"func": "infeasible"}])
    if last_action_was_fail:
        return EvalResult(0.0, [{"note": "the last action was FAIL on a feasible task"}])
    await run_setup(
        client,
        ev.get("postconfig", []),
        screen_size=screen_size,
        base_dir=task.base_dir,
        task_id=task.id,
        options=opts,
    )
    funcs = _as_list(ev["func"])
    multi = isinstance(ev["func"], list)
    results = _as_list(ev["result"]) if multi else [ev["result"]]
    expecteds = _as_list(ev.get("expected")) if multi else [ev.get("expected")]
    if len(expecteds) < len(funcs):
        expecteds += [None] * (len(funcs) - len(expecteds))
    options = ev.get("options", {})
    optlist = _as_list(options) if multi and isinstance(options, list) else [options] * len(funcs)
    conj = ev.get("conj", "and")
    bridge = desktop_env.DesktopEnvBridge(client, chromium_port=opts.chrome_port)
    with tempfile.TemporaryDirectory(prefix="osworld-eval-", dir=cache_dir) as tmp:
        scores, details = [], []
        async with bridge:
            for i, (fn, r_cfg, e_cfg, opt) in enumerate(
                zip(funcs, results, expecteds, optlist, strict=True)
            ):
                sub = Path(tmp) / str(i)
                (sub / "r").mkdir(parents=True)
                (sub / "e").mkdir()
                result = await _fetch(client, bridge, r_cfg, sub / "r", task.id, opts)
                if result is desktop_env.FILE_MISSING:  # OSWorld: the metric scores 0
                    s = 0.0
                else:
                    expected = await _fetch(client, bridge, e_cfg, sub / "e", task.id, opts)
                    if expected is desktop_env.FILE_MISSING:
                        raise desktop_env.EvaluatorError(f"the expected file of {fn} is missing")
                    args = (result,) if e_cfg is None else (result, expected)
                    if fn in _METRIC_FNS:
                        s = _METRIC_FNS[fn](*args, **(opt or {}))
                    else:
                        s = await bridge.metric(fn, *args, **(opt or {}))
                scores.append(float(s))
                details.append({"func": fn, "score": float(s), "result": _short(result)})
                if conj == "and" and s == 0:
                    break
                if conj == "or" and s == 1:
                    break
    if conj == "and":
        score = 0.0 if any(s == 0 for s in scores) else sum(scores) / len(scores)
    else:
        score = max(scores)
    return EvalResult(score, details)


def _short(x: Any) -> Any:
    if isinstance(x, str) and len(x) > 300:
        return x[:300] + "..."
    return x
