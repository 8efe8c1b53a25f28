"""Per-task-kind page logic for BrowserEnv: how to start a task, read its state and score it.

``task.spec["kind"]`` picks one: "builtin" (envs.browser.suite), "miniwob" (envs.browser.miniwob)
or "page" (any page of ours, no checker). Each adapter is a few ``page.evaluate`` calls against
the JS API its pages define.

The dependency runs one way: ``envs.browser.env`` imports this module, and an adapter sees its
env only through `AdapterHost`, the few attributes it reads (BrowserEnv satisfies it).
"""

from __future__ import annotations

import hashlib
from typing import Any, Protocol

from playwright.async_api import Page

from cua_jax.env_api import CheckerReport, EnvError, Task
from envs.browser import miniwob, pages, suite

KINDS = ("builtin", "miniwob", "page")


class AdapterHost(Protocol):
    """What an adapter reads from the env that drives it (`envs.browser.env.BrowserEnv`)."""

    reset_timeout_s: float  # a page slower than this to load fails the reset
    miniwob_max_time_ms: int  # MiniWoB's episode clock
    signal_done: bool  # set when the page signals the end of its episode
    signal_reward: float  # the reward that signal carried

    def hold_inline(self, key: str, html: str) -> str:
        """Serve `html` at a URL of ours under `key`; returns the URL."""
        ...


class Adapter(Protocol):
    async def start(self, env: AdapterHost, page: Page, task: Task, seed: int) -> str: ...
    async def state(self, env: AdapterHost, page: Page) -> tuple[bool, float]: ...
    async def score(self, env: AdapterHost, page: Page, answer: str | None) -> float: ...
    async def oracle_plan(self, env: AdapterHost, page: Page) -> list[dict[str, Any]]: ...
    async def report(
        self, env: AdapterHost, page: Page, answer: str | None
    ) -> CheckerReport | None: ...


class Builtin:
    PAGE = f"{pages.ORIGIN}/builtin/task.html"

    async def start(self, env: AdapterHost, page: Page, task: Task, seed: int) -> str:
        name = task.spec.get("template")
        suite.get_template(name)  # a clear error for an unknown template
        # Same document, another (template, seed): restart in place, no page load (~10x cheaper).
        restarted = page.url.startswith(self.PAGE) and await page.evaluate(
            "([n, s]) => !!(window.cua && cua.ready && cua.restart(n, s))", [name, seed]
        )
        if not restarted:
            url = f"{self.PAGE}?t={name}&seed={seed}"
            await page.goto(url, wait_until="load", timeout=env.reset_timeout_s * 1000)
        ok, text = await page.evaluate(
            "() => !window.cua ? [false, 'cua.js did not load'] : "
            "cua.ready ? [true, cua.instruction] : [false, cua.error || 'not ready']"
        )
        if not ok:
            raise EnvError(f"built-in page for {name!r} failed: {text}")
        return text

    async def state(self, env: AdapterHost, page: Page) -> tuple[bool, float]:
        return env.signal_done, 0.0  # cua.finish() signals

    async def score(self, env: AdapterHost, page: Page, answer: str | None) -> float:
        return float(await page.evaluate("(a) => Number(cua.score(a)) || 0", answer))

    async def oracle_plan(self, env: AdapterHost, page: Page) -> list[dict[str, Any]]:
        return list(await page.evaluate("() => cua.plan()"))

    async def report(self, env: AdapterHost, page: Page, answer: str | None) -> CheckerReport:
        r = await page.evaluate("(a) => cua.report(a)", answer)
        return CheckerReport(
            clicks=tuple((float(c["x"]), float(c["y"]), str(c["label"])) for c in r["clicks"]),
            targets=tuple((str(t["label"]), float(t["x"]), float(t["y"])) for t in r["targets"]),
            closeness=float(r["closeness"]) if r["targets"] else None,
            note=str(r["note"] or ""),
        )


class MiniWoB:
    async def start(self, env: AdapterHost, page: Page, task: Task, seed: int) -> str:
        name = task.spec.get("name")
        if name not in miniwob.task_names():
            raise EnvError(f"unknown MiniWoB++ task {name!r}")
        await page.goto(miniwob.url(name), wait_until="load", timeout=env.reset_timeout_s * 1000)
        await page.evaluate(miniwob.START_JS, [seed, env.miniwob_max_time_ms])
        await page.wait_for_function(miniwob.READY_JS, timeout=env.reset_timeout_s * 1000)
        return str(await page.evaluate(miniwob.UTTERANCE_JS))

    async def state(self, env: AdapterHost, page: Page) -> tuple[bool, float]:
        return env.signal_done, env.signal_reward  # the wrapped core.endEpisode signals

    async def score(self, env: AdapterHost, page: Page, answer: str | None) -> float:
        done, reward = await page.evaluate(miniwob.STATE_JS)
        # An episode that ends unfinished scores as MiniWoB's own timeout does (-1): scoring it
        # 0 would rank giving up (Done at step 0, running out of turns) above a wrong attempt.
        return float(reward) if done else -1.0

    async def oracle_plan(self, env: AdapterHost, page: Page) -> list[dict[str, Any]]:
        raise NotImplementedError("MiniWoB++ tasks have no oracle here")

    async def report(self, env: AdapterHost, page: Page, answer: str | None) -> None:
        return None  # its checker says nothing beyond the score


class PageKind:
    """Any page of ours: spec {"url": "http://cua.local/..."} or {"html": "..."}; no checker."""

    async def start(self, env: AdapterHost, page: Page, task: Task, seed: int) -> str:
        spec = task.spec
        if "html" in spec:
            key = hashlib.sha1(spec["html"].encode()).hexdigest()[:16]
            url = env.hold_inline(key, spec["html"])
        else:
            url = spec.get("url") or env.hold_inline("blank", _BLANK)
        await page.goto(url, wait_until="load", timeout=env.reset_timeout_s * 1000)
        return task.instruction

    async def state(self, env: AdapterHost, page: Page) -> tuple[bool, float]:
        return False, 0.0

    async def score(self, env: AdapterHost, page: Page, answer: str | None) -> float:
        return 0.0

    async def oracle_plan(self, env: AdapterHost, page: Page) -> list[dict[str, Any]]:
        raise NotImplementedError("custom pages have no oracle")

    async def report(self, env: AdapterHost, page: Page, answer: str | None) -> None:
        return None  # its checker says nothing beyond the score


_BLANK = "<!DOCTYPE html><html><body style='margin:0;background:#fff'></body></html>"
_ADAPTERS: dict[str, Adapter] = {"builtin": Builtin(), "miniwob": MiniWoB(), "page": PageKind()}


def get(task: Task) -> Adapter:
    """The adapter for ``task.spec["kind"]`` (default "page"); EnvError naming the valid kinds."""
    kind = task.spec.get("kind", "page")
    a = _ADAPTERS.get(kind)
    if a is None:
        raise EnvError(
            f"task {task.id!r} has spec kind {kind!r}, which BrowserEnv cannot run; valid kinds: "
            f"{', '.join(KINDS)}"
        )
    return a
