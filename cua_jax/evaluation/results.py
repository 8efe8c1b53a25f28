"""OSWorld-style result directories: one folder per episode, a summary, a side-by-side page.

    write_episode(result_dir, task, traj, screens, texts, agent="qwen@step100")
    summary = summarize(result_dir)          # per-domain and overall, as OSWorld's show_result
    print(format_summary(summary))
    html = side_by_side_html([dir_a, dir_b], task_id="builtin/click-button/3")

Layout (OSWorld's `results/.../<domain>/<example_id>/`, with our extras):

    RESULT_DIR/<domain>/<task_id>/          domain: the task's category ("all" when empty);
                                            task_id with "/" written as "__"
        step_<k>.png        the screenshot the agent saw before step k (k = 1, 2, ...)
        traj.jsonl          one line per step: step_num, action (described), actions ({"type",
                            **fields} each), response (the model's text), token_ids (the
                            ids recorded for it), feedback, screenshot_file,
                            reward (the score on the last step, else 0), done
        result.txt          the task's score (a float, as OSWorld writes it); absent when an
                            infrastructure fault ended the episode (not counted, as in
                            eval.json)
        meta.json           task id / instruction / category, agent, score, success,
                            failure_reason, infra_fault, policy_version, turns

A score is a success when it is >= 1 (the binary built-in tasks; OSWorld sums fractional scores,
and `summarize` reports both the score sum and the success count).
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image

from cua_jax import actions as A
from cua_jax.viz import draw_actions


def action_to_json(action: Any) -> dict[str, Any]:
    """{"type": class name, **fields} of a `cua_jax.actions` action."""
    if dataclasses.is_dataclass(action):
        return {"type": type(action).__name__, **dataclasses.asdict(action)}
    return {"type": "unknown", "repr": repr(action)}


def action_from_json(d: dict[str, Any]) -> Any:
    """The action `action_to_json` wrote; None for an unknown type (never evaluates code)."""
    cls = getattr(A, str(d.get("type")), None)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        return None
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        return cls(**{k: v for k, v in d.items() if k in names})
    except (TypeError, ValueError):
        return None


def task_dirname(task_id: str) -> str:
    """A task id as one path component ("builtin/click/3" -> "builtin__click__3")."""
    name = task_id.replace(os.sep, "__").replace("/", "__")
    if name in ("", ".", ".."):
        raise ValueError(f"task id {task_id!r} cannot name a directory")
    return name


def domain_of(task: Any) -> str:
    return (getattr(task, "category", "") or "all").replace("/", "__")


def _write_steps(
    out: str, traj: Any, screens: Sequence[np.ndarray], texts: Sequence[str], score: float
) -> None:
    """OUT/traj.jsonl, one line a turn (its actions, the model's text, the reward at the last
    turn), and OUT/step_<k>.png, the screen of each turn that has one."""
    lines = []
    n = len(traj.turns)
    for k, turn in enumerate(traj.turns):
        name = f"step_{k + 1}.png"
        if k < len(screens):
            Image.fromarray(np.asarray(screens[k], np.uint8)).save(os.path.join(out, name))
        acts = list(turn.action or [])
        lines.append(
            {
                "step_num": k + 1,
                "action": "; ".join(A.describe(a) for a in acts),
                "actions": [action_to_json(a) for a in acts],
                "response": texts[k] if k < len(texts) else "",
                "token_ids": [int(t) for t in turn.generated_ids],
                "feedback": turn.feedback,
                "screenshot_file": name if k < len(screens) else None,
                "reward": score if k == n - 1 else 0.0,
                "done": k == n - 1,
            }
        )
    with open(os.path.join(out, "traj.jsonl"), "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")


def write_episode(
    result_dir: str,
    task: Any,
    traj: Any,
    screens: Sequence[np.ndarray],
    texts: Sequence[str],
    *,
    agent: str = "",
    sample: int | None = None,
) -> str:
    """Writes one episode (a `Trajectory`, the screenshot of each turn and the model's text of
    each turn) under RESULT_DIR/<domain>/<task_id>/ (<task_id>__s<sample> for one of several
    samples of a task); returns that directory."""
    name = task_dirname(task.id) + ("" if sample is None else f"__s{sample}")
    out = os.path.join(result_dir, domain_of(task), name)
    os.makedirs(out, exist_ok=True)
    score = float(traj.score or 0.0)
    n = len(traj.turns)
    _write_steps(out, traj, screens, texts, score)
    rpath = os.path.join(out, "result.txt")
    if traj.infra_fault:  # not scored (as eval.json leaves it out); a rerun may write it
        if os.path.exists(rpath):
            os.remove(rpath)
    else:
        with open(rpath, "w") as f:
            f.write(f"{score}\n")
    meta = {
        "task_id": task.id,
        "instruction": task.instruction,
        "category": getattr(task, "category", ""),
        "agent": agent,
        "sample": sample,
        "score": score,
        "success": bool(traj.success),
        "failure_reason": traj.failure_reason,
        "infra_fault": bool(traj.infra_fault),
        "policy_version": int(traj.policy_version),
        "turns": n,
    }
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    return out


@dataclasses.dataclass
class DomainResult:
    ran: int  # episodes with a result.txt
    score: float  # sum of their scores (OSWorld's "Successfully Ran")
    successes: int  # scores >= 1


@dataclasses.dataclass
class Summary:
    domains: dict[str, DomainResult]
    scores: dict[str, dict[str, float]]  # domain -> task dir -> score (all_result.json)

    @property
    def ran(self) -> int:
        return sum(d.ran for d in self.domains.values())

    @property
    def score(self) -> float:
        return sum(d.score for d in self.domains.values())

    @property
    def successes(self) -> int:
        return sum(d.successes for d in self.domains.values())


def read_result(path: str) -> float:
    """The score in a result.txt (a float; OSWorld also writes "True"/"False")."""
    text = open(path).read().strip()
    try:
        return float(text)
    except ValueError:
        if text in ("True", "False"):
            return float(text == "True")
        raise ValueError(f"{path}: {text!r} is not a score") from None


def summarize(result_dir: str) -> Summary:
    """Walks RESULT_DIR/<domain>/<task>/result.txt as OSWorld's show_result does."""
    if not os.path.isdir(result_dir):
        raise FileNotFoundError(f"no result directory {result_dir}")
    domains: dict[str, DomainResult] = {}
    scores: dict[str, dict[str, float]] = {}
    for domain in sorted(os.listdir(result_dir)):
        dpath = os.path.join(result_dir, domain)
        if not os.path.isdir(dpath):
            continue
        for example in sorted(os.listdir(dpath)):
            rpath = os.path.join(dpath, example, "result.txt")
            if not os.path.isfile(rpath):
                continue
            s = read_result(rpath)
            d = domains.setdefault(domain, DomainResult(0, 0.0, 0))
            d.ran += 1
            d.score += s
            d.successes += s >= 1.0
            scores.setdefault(domain, {})[example] = s
    return Summary(domains, scores)


def format_summary(s: Summary) -> str:
    """OSWorld's show_result lines, one per domain, then the overall one."""
    lines = []
    for name, d in s.domains.items():
        lines.append(
            f"Domain: {name} Runned: {d.ran} Successully Ran: {d.score:g} "
            f"Success Rate: {100.0 * d.score / d.ran:.2f} %"
        )
    if not s.ran:
        return "New experiment, no result yet."
    lines.append(">>>>>>>>>>>>>")
    lines.append(f"Runned: {s.ran} Current Success Rate: {100.0 * s.score / s.ran:.2f} %")
    return "\n".join(lines)


# ------------------------------------------------------------------------- side by side


def _episode(result_dir: str, task_id: str) -> tuple[str, dict, list[dict]] | None:
    name = task_dirname(task_id)
    for domain in sorted(os.listdir(result_dir)):
        d = os.path.join(result_dir, domain, name)
        if os.path.isfile(os.path.join(d, "meta.json")):
            meta = json.load(open(os.path.join(d, "meta.json")))
            with open(os.path.join(d, "traj.jsonl")) as f:
                steps = [json.loads(line) for line in f if line.strip()]
            return d, meta, steps
    return None


def _img_b64(path: str, step_actions: list[dict]) -> str:
    """The step's screenshot with its clicks drawn (cua_jax.viz), as a PNG data URI."""
    img = np.asarray(Image.open(path).convert("RGB"))
    acts = [a for a in map(action_from_json, step_actions) if a is not None]
    buf = io.BytesIO()
    draw_actions(img, acts).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def agent_label(result_dir: str) -> str:
    """The agent named in the directory's episodes (meta.json), else the directory's name."""
    for domain in sorted(os.listdir(result_dir)):
        dpath = os.path.join(result_dir, domain)
        if not os.path.isdir(dpath):
            continue
        for ex in sorted(os.listdir(dpath)):
            m = os.path.join(dpath, ex, "meta.json")
            if os.path.isfile(m):
                agent = json.load(open(m)).get("agent")
                if agent:
                    return str(agent)
    norm = os.path.normpath(result_dir)
    base = os.path.basename(norm)
    return os.path.basename(os.path.dirname(norm)) + "/" + base if base == "results" else base


def common_tasks(result_dirs: Sequence[str]) -> list[str]:
    """Task ids present (with meta.json) in every one of `result_dirs`, sorted."""
    sets = []
    for rd in result_dirs:
        ids = set()
        for domain in os.listdir(rd):
            dpath = os.path.join(rd, domain)
            if not os.path.isdir(dpath):
                continue
            for ex in os.listdir(dpath):
                m = os.path.join(dpath, ex, "meta.json")
                if os.path.isfile(m):
                    ids.add(json.load(open(m))["task_id"])
        sets.append(ids)
    return sorted(set.intersection(*sets)) if sets else []


def side_by_side_html(
    result_dirs: Sequence[str], task_ids: Sequence[str] | None = None, labels=None
) -> str:
    """A page with, for each task, the agents' trajectories in columns (one per result dir):
    each step's screenshot with the clicks drawn, the action, the model's text, the feedback,
    and the outcome on top."""
    labels = list(labels or [agent_label(d) for d in result_dirs])
    task_ids = list(task_ids) if task_ids is not None else common_tasks(result_dirs)
    esc = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>side by side</title><style>",
        "body{font-family:sans-serif;margin:12px}",
        ".row{display:flex;gap:12px;align-items:flex-start}",
        ".col{flex:1;min-width:0;border:1px solid #ccc;padding:8px}",
        ".ok{color:#080;font-weight:bold} .bad{color:#b00;font-weight:bold}",
        "img{width:100%;max-width:960px;border:1px solid #888}",
        "pre{white-space:pre-wrap;overflow-wrap:anywhere;background:#f4f4f4;padding:4px;",
        "font-size:12px} .step{margin-bottom:10px}</style></head><body>",
        f"<h1>{len(task_ids)} task(s): {' vs '.join(esc(x) for x in labels)}</h1>",
    ]
    for tid in task_ids:
        eps = [_episode(d, tid) for d in result_dirs]
        instr = next((e[1]["instruction"] for e in eps if e is not None), "")
        parts.append(f"<h2>{esc(tid)}</h2><p>{esc(instr)}</p><div class='row'>")
        for label, ep in zip(labels, eps, strict=True):
            parts.append(f"<div class='col'><h3>{esc(label)}</h3>")
            if ep is None:
                parts.append("<p>(no episode)</p></div>")
                continue
            d, meta, steps = ep
            cls = "ok" if meta["success"] else "bad"
            why = f" ({esc(str(meta['failure_reason']))})" if meta.get("failure_reason") else ""
            parts.append(
                f"<p class='{cls}'>{'success' if meta['success'] else 'failure'}, score "
                f"{meta['score']:g}, {meta['turns']} step(s){why}</p>"
            )
            for st in steps:
                parts.append(f"<div class='step'><b>step {st['step_num']}</b>: {esc(st['action'])}")
                if st.get("screenshot_file"):
                    src = _img_b64(os.path.join(d, st["screenshot_file"]), st.get("actions", []))
                    parts.append(f"<br><img src='{src}'>")
                parts.append(f"<pre>{esc(st.get('response', ''))}</pre>")
                if st.get("feedback"):
                    parts.append(f"<i>{esc(st['feedback'])}</i>")
                parts.append("</div>")
            parts.append("</div>")
        parts.append("</div><hr>")
    parts.append("</body></html>")
    return "\n".join(parts)


__all__ = [
    "DomainResult",
    "action_from_json",
    "action_to_json",
    "agent_label",
    "Summary",
    "common_tasks",
    "format_summary",
    "read_result",
    "side_by_side_html",
    "summarize",
    "task_dirname",
    "write_episode",
]
