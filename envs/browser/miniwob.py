"""MiniWoB++ tasks from the `miniwob` PyPI package's HTML, driven by Playwright (no selenium).

The package's own runner (miniwob.selenium_instance) starts an episode with
``Math.seedrandom(seed); core.setDataMode(mode); core.startEpisodeReal()`` and reads
``WOB_DONE_GLOBAL`` / ``WOB_RAW_REWARD_GLOBAL``; we do the same through ``page.evaluate``. The
instruction is the page's ``core.getUtterance()`` (the ``#query`` text).
"""

from __future__ import annotations

import functools

from cua_jax.env_api import Task
from envs.browser import pages


@functools.cache
def task_names() -> tuple[str, ...]:
    """Every MiniWoB++ task the package ships (file names under html/miniwob/)."""
    d = pages.miniwob_html_dir() / "miniwob"
    return tuple(sorted(p.stem for p in d.glob("*.html")))


# Tasks a screenshot-and-click policy can do in a few steps (used when no names are given).
DEFAULT_TASKS = (
    "click-test",
    "click-test-2",
    "click-button",
    "click-link",
    "click-color",
    "click-dialog",
    "click-tab",
    "click-checkboxes",
    "focus-text",
    "enter-text",
    "enter-password",
    "login-user",
    "click-option",
    "choose-list",
    "navigate-tree",
    "use-autocomplete",
)


def make_task(name: str, seed: int = 0, split: str = "train") -> Task:
    """A Task for MiniWoB++ task ``name`` (e.g. "click-test")."""
    names = task_names()
    if name not in names:
        raise ValueError(
            f"unknown MiniWoB++ task {name!r}; the miniwob package ships: {', '.join(names)}"
        )
    return Task(
        id=f"miniwob/{name}",
        instruction="(MiniWoB++ task; the instruction is read from the page at reset)",
        source="miniwob",
        category="miniwob",
        difficulty="medium",
        split=split,
        seed=int(seed),
        spec={"kind": "miniwob", "name": name},
        max_steps=10,
    )


def url(name: str) -> str:
    return f"{pages.ORIGIN}/miniwob/miniwob/{name}.html"


# Seeds and starts one episode; returns the instruction. Args: [seed, max_time_ms].
START_JS = """([seed, maxMs]) => {
  Math.seedrandom(String(seed));
  if (typeof core.setDataMode === 'function') core.setDataMode('train');
  core.EPISODE_MAX_TIME = maxMs;
  if (!core.__cuaWrapped) {  // tell the env when an episode ends (see BrowserEnv._on_signal)
    const end = core.endEpisode;
    core.endEpisode = function () {
      const wasRunning = core.EP_TIMER !== null;
      const out = end.apply(this, arguments);
      if (wasRunning && WOB_DONE_GLOBAL && window.__cuaSignal)
        window.__cuaSignal(Number(WOB_RAW_REWARD_GLOBAL) || 0);
      return out; };
    core.__cuaWrapped = true; }
  core.startEpisodeReal();
  return true; }"""
UTTERANCE_JS = """() => { const u = core.getUtterance();
  if (u && typeof u === 'object') return u.utterance || '';
  if (u) return String(u);
  const q = document.getElementById('query'); return q ? q.innerText : ''; }"""
STATE_JS = "() => [!!WOB_DONE_GLOBAL, Number(WOB_RAW_REWARD_GLOBAL) || 0]"
READY_JS = "() => typeof WOB_TASK_READY === 'undefined' || !!WOB_TASK_READY"
