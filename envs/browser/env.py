"""``BrowserEnv``: the :class:`cua_jax.env_api.Env` contract on a Playwright page.

One env = one browser context (own cookies/storage/renderer; wiped between episodes, replaced
after a fault) inside a shared Chromium process (:class:`~envs.browser.host.BrowserHost`).
Actions go through Playwright's mouse and keyboard at screen pixel coordinates; observations are
PNG screenshots decoded to ``u8[H, W, 3]``.

Faults never raise out of ``step``: a step over ``step_timeout_s`` (a hung page), a crashed page,
or a dead browser end the episode (``done=True``, ``info["error"]`` says why) and the next
``reset`` starts from a fresh context, relaunching the browser when it is gone. ``reset`` raises
:class:`~cua_jax.env_api.EnvError` (after one retry on a fresh browser) when a task's page cannot
be loaded within ``reset_timeout_s``.

Which page a task shows is decided by ``task.spec["kind"]``:
  "builtin"  the built-in suite (``envs.browser.suite``), spec: {"template": name}
  "miniwob"  MiniWoB++ from the miniwob package (``envs.browser.miniwob``), spec: {"name": ...}
  "page"     any page of ours: spec {"url": "http://cua.local/..."} or {"html": "<html>..."};
             no checker (custom instructions); evaluate() returns 0.0

``evaluate`` raises :class:`~cua_jax.env_api.EnvError` after a fault, or when the browser or page
fails while the checker reads it, so a dead browser is never scored as a policy failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import string
import time
import unicodedata
import urllib.parse
from typing import Any

import numpy as np
from playwright.async_api import BrowserContext, Page

from cua_jax import actions as A
from cua_jax.env_api import (
    INFO_ANSWER,
    INFO_API_RESULT,
    INFO_DONE_REASON,
    INFO_ERROR,
    INFO_INVALID_ACTION,
    INFO_TIMING,
    CheckerReport,
    EnvError,
    Observation,
    StepResult,
    Task,
)
from envs.browser import adapters, miniwob, pages
from envs.browser.host import BrowserHost
from envs.screenshots import decode_screenshot

log = logging.getLogger(__name__)

# Canonical key names (cua_jax.actions.KEY_NAMES) -> Playwright key names.
PLAYWRIGHT_KEYS = {
    "ctrl": "Control",
    "shift": "Shift",
    "alt": "Alt",
    "meta": "Meta",
    "enter": "Enter",
    "esc": "Escape",
    "tab": "Tab",
    "backspace": "Backspace",
    "delete": "Delete",
    "space": "Space",
    "up": "ArrowUp",
    "down": "ArrowDown",
    "left": "ArrowLeft",
    "right": "ArrowRight",
    "home": "Home",
    "end": "End",
    "pageup": "PageUp",
    "pagedown": "PageDown",
    "insert": "Insert",
    "capslock": "CapsLock",
    "printscreen": "PrintScreen",
    "numlock": "NumLock",
    "scrolllock": "ScrollLock",
    "pause": "Pause",
    "menu": "ContextMenu",
    **{f"f{i}": f"F{i}" for i in range(1, 13)},
    "\t": "Tab",  # Playwright knows "\n" (Enter) but not "\t"
}
# With Shift held Playwright still types a character key's own text (shift+1 -> "1"); the physical
# key's code name types the shifted one (shift+Digit1 -> "!"), as a real keyboard (xdotool) does.
SHIFTABLE_KEYS = {
    **{c: f"Key{c.upper()}" for c in string.ascii_letters},
    **{d: f"Digit{d}" for d in string.digits},
    **{"=": "Equal", "-": "Minus", "[": "BracketLeft", "]": "BracketRight", "\\": "Backslash"},
    **{";": "Semicolon", "'": "Quote", ",": "Comma", ".": "Period", "/": "Slash", "`": "Backquote"},
}

# Returns [left, top, width, height] of the first element matching `sel`, or null.
_BOX_JS = """(sel) => { const e = document.querySelector(sel); if (!e) return null;
  const r = e.getBoundingClientRect(); return [r.left, r.top, r.width, r.height]; }"""
# For the element `sel`: {box: [left, top, width, height]} when its centre is in view, else
# {scroll: [x, y, dx, dy]}: the point to scroll at (its nearest scrollable ancestor's centre, or
# the viewport's) and the pixels to scroll, 0 on an axis where the centre is in view already (no
# needless sideways scroll); null when there is no such element.
_TARGET_JS = """(sel) => { const e = document.querySelector(sel); if (!e) return null;
  const r = e.getBoundingClientRect(); const vw = innerWidth, vh = innerHeight;
  let c = e.parentElement;
  while (c && c !== document.body && c !== document.documentElement) {
    const s = getComputedStyle(c);
    if ((c.scrollHeight > c.clientHeight + 1 && /(auto|scroll)/.test(s.overflowY)) ||
        (c.scrollWidth > c.clientWidth + 1 && /(auto|scroll)/.test(s.overflowX))) break;
    c = c.parentElement; }
  let box = [0, 0, vw, vh];
  if (c && c !== document.body && c !== document.documentElement) {
    const q = c.getBoundingClientRect();
    box = [Math.max(q.left, 0), Math.max(q.top, 0), Math.min(q.right, vw), Math.min(q.bottom, vh)];
  }
  const cx = r.left + r.width / 2, cy = r.top + r.height / 2;
  const inX = cx >= box[0] + 2 && cx <= box[2] - 2, inY = cy >= box[1] + 2 && cy <= box[3] - 2;
  if (inX && inY) return {box: [r.left, r.top, r.width, r.height]};
  const mx = (box[0] + box[2]) / 2, my = (box[1] + box[3]) / 2;
  return {scroll: [mx, my, inX ? 0 : cx - mx, inY ? 0 : cy - my]}; }"""
# Two animation frames, or 1 s if the renderer produces none (a starved or throttled renderer must
# not turn a scroll into a "hung page" fault; the screenshot after it still waits for a frame).
_RAF_JS = (
    "() => new Promise(r => { requestAnimationFrame(() => requestAnimationFrame(r)); "
    "setTimeout(r, 1000); })"
)


class _EpisodeOver(Exception):
    """Raised inside a step when the page/browser failed; carries the reason."""


class _BadKey(Exception):
    """Raised inside a step for a key Playwright cannot press (an invalid action, not a fault)."""


class _ApiRefused(_BadKey):
    """An API action the page cannot carry out (no such field, option or page): invalid."""


# How long an API action waits for its element to be actionable (then it is invalid, not a
# fault: a hidden or disabled field is the model's mistake, not a hung page).
_API_TIMEOUT_MS = 2000
# For the element `sel`, what an API action could do with it: {kind: "text" | "option" |
# "combobox" | "roleoption" | "other", label, option}; null when there is no such element.
_FIELD_JS = """(sel) => { const e = document.querySelector(sel); if (!e) return null;
  const lab = (el) => ((el.getAttribute("aria-label") ||
    (el.labels && el.labels[0] ? el.labels[0].innerText : "") || "") + "").trim();
  if (e.tagName === "OPTION" && e.parentElement && e.parentElement.tagName === "SELECT")
    return {kind: "option", label: lab(e.parentElement), option: (e.label || e.text).trim()};
  if (e.getAttribute("role") === "combobox") return {kind: "combobox", label: lab(e)};
  if (e.getAttribute("role") === "option")
    return {kind: "roleoption", option: e.textContent.trim()};
  const noText = ["checkbox", "radio", "button", "submit", "reset", "range", "color", "file",
    "image", "hidden"];
  if ((e.tagName === "INPUT" && !noText.includes(e.type)) || e.tagName === "TEXTAREA")
    return {kind: "text", label: lab(e)};
  return {kind: "other"}; }"""


MAX_VIEWPORT_SIDE = 8192


def check_viewport(viewport: Any) -> tuple[int, int]:
    """`viewport` as (width, height), each an int in 64..MAX_VIEWPORT_SIDE; ValueError otherwise
    (every page a host opens is bounded: a 100000 x 100000 page pins Chromium)."""
    try:
        w, h = viewport
    except (TypeError, ValueError):
        raise ValueError(f"viewport must be (width, height), got {viewport!r}") from None
    side = MAX_VIEWPORT_SIDE
    if not all(isinstance(v, int) and not isinstance(v, bool) and 64 <= v <= side for v in (w, h)):
        raise ValueError(f"viewport must be (width, height) ints in 64..{side}, got {viewport!r}")
    return w, h


class BrowserEnv:
    """A Playwright-driven browser environment implementing ``cua_jax.env_api.Env``.

    Args:
      viewport: (width, height) of the screen in pixels; screenshots have this size.
      executable_path: Chromium binary (autodetected when None). Ignored when ``host`` is given.
      host: a shared :class:`BrowserHost` (``BrowserPool`` passes one); when None the env owns one.
      step_timeout_s: a step (action + screenshot) slower than this ends the episode.
      reset_timeout_s: a task page slower than this to load fails the reset.
      max_wait_s: cap on ``Wait`` actions.
      scroll_px_per_notch: CSS pixels per wheel notch of a ``Scroll`` action.
      screenshot_type: "png" (lossless) or "jpeg" (faster to encode on big screens).
      text_state: when True, ``Observation.text`` holds the page's visible text (truncated).
      reuse_context: wipe and reuse the context between healthy episodes (storage and cookies
        cleared; our pages keep no other state) instead of making a new one, which costs
        ~0.3 s of CPU per reset. A fault always gets a brand-new context.
      decode_screenshots: False leaves ``Observation.screenshot`` an undecoded stand-in of the
        right shape (a browser host sends ``last_screenshot_bytes`` on as they are).
      miniwob_max_time_ms: MiniWoB's episode clock (its default 10 s is too short for a model
        generating on CPU; rewards that decay with time decay against this).
    """

    def __init__(
        self,
        viewport: tuple[int, int] = (1280, 720),
        executable_path: str | None = None,
        *,
        host: BrowserHost | None = None,
        step_timeout_s: float = 10.0,
        reset_timeout_s: float = 20.0,
        max_wait_s: float = 5.0,
        scroll_px_per_notch: float = 100.0,
        screenshot_type: str = "png",
        text_state: bool = False,
        miniwob_max_time_ms: int = 3_600_000,
        reuse_context: bool = True,
        decode_screenshots: bool = True,
    ):
        w, h = check_viewport(viewport)
        if screenshot_type not in ("png", "jpeg"):
            raise ValueError(f"screenshot_type must be 'png' or 'jpeg', got {screenshot_type!r}")
        self.viewport = (w, h)
        self._own_host = host is None
        self.host = host if host is not None else BrowserHost(executable_path)
        self.step_timeout_s = step_timeout_s
        self.reset_timeout_s = reset_timeout_s
        self.max_wait_s = max_wait_s
        self.scroll_px_per_notch = scroll_px_per_notch
        self.screenshot_type = screenshot_type
        self.text_state = text_state
        self.miniwob_max_time_ms = miniwob_max_time_ms
        self.reuse_context = reuse_context
        self.decode_screenshots = decode_screenshots

        self._ctx: BrowserContext | None = None
        self._page: Page | None = None
        self._task: Task | None = None
        self._seed = 0
        self._instruction = ""
        self._active = False  # an episode is running (reset done, not over)
        self._broken = False  # the context is unusable (fault); the next reset replaces it
        self._fault_reason: str | None = None  # why the last episode ended by a fault
        self._crashed = False
        self._last_obs: Observation | None = None
        self._answer: str | None = None
        self._env_reward = 0.0
        self._mouse = (w / 2, h / 2)
        # Keys (Playwright names) and mouse buttons a KeyDown/MouseDown left pressed.
        self._held_keys: set[str] = set()
        self._held_buttons: set[str] = set()
        self._oracle_plan: list[dict[str, Any]] | None = None
        self._api_result: str | None = None
        self.last_screenshot_bytes: bytes | None = None
        self._oracle_i = 0
        self._steps = 0
        self._nav_loaded = asyncio.Event()
        self.signal_done = False  # set by the page through window.__cuaSignal
        self.signal_reward = 0.0
        self._inline_key: str | None = None  # the inline page this env's task is served from

    # ---------------------------------------------------------------------------------------
    # lifecycle
    # ---------------------------------------------------------------------------------------
    async def __aenter__(self) -> BrowserEnv:
        if self._own_host:
            await self.host.browser()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Close this env's context (and its browser if it owns it). Safe to call twice."""
        self._active = False
        self.release_inline()
        await self._drop_context()
        if self._own_host:
            await self.host.close()

    def hold_inline(self, key: str, html: str) -> str:
        """Serves ``html`` at ``/inline/<key>`` while this env's task shows it (until the next
        reset or close); returns its URL."""
        self.release_inline()
        url = pages.register_inline(key, html)
        self._inline_key = key
        return url

    def release_inline(self) -> None:
        """Frees the inline page of this env's last task (unless another env holds it too)."""
        key, self._inline_key = self._inline_key, None
        if key is not None:
            pages.release_inline(key)

    async def _drop_context(self) -> None:
        ctx, self._ctx, self._page = self._ctx, None, None
        # Held on the page that goes away; a new page starts with nothing pressed.
        self._held_keys.clear()
        self._held_buttons.clear()
        if ctx is None:
            return
        try:
            await asyncio.wait_for(ctx.close(), 5.0)
        except Exception as e:  # noqa: BLE001 -- a wedged renderer: restart the browser
            if self.host.connected:
                log.warning("closing a browser context failed (%s); restarting the browser", e)
                await self.host.restart()

    async def _fresh_page(self, reuse: bool) -> Page:
        """A page with no state from earlier episodes: the old context wiped (cheap) when it is
        healthy and ``reuse`` is on, else a brand-new context."""
        page = self._page
        # A key or button still held would stay held into the next episode (shift+click, a drag)
        # on this page. Releasing it is an input event to the old page (a mouseup that clicks a
        # link and starts a navigation racing the reset, a Space keyup that clicks a button), so
        # the next episode gets a new context, where nothing is pressed.
        held = self._held_keys or self._held_buttons
        if reuse and page is not None and not self._broken and not self._crashed and not held:
            try:
                await asyncio.wait_for(self._wipe(page), 5.0)
                return page
            except Exception as e:  # noqa: BLE001 -- fall back to a new context
                log.info("could not reuse the browser context (%s); making a new one", e)
        await self._drop_context()
        return await self._new_page()

    async def _wipe(self, page: Page) -> None:
        assert self._ctx is not None
        await page.evaluate(
            "() => { try { sessionStorage.clear(); localStorage.clear(); } catch (e) {} }"
        )
        await self._ctx.clear_cookies()
        self._nav_loaded.set()

    def _on_signal(self, _source: Any, reward: Any = 0.0) -> None:
        self.signal_done = True
        try:
            self.signal_reward = float(reward)
        except (TypeError, ValueError):
            self.signal_reward = 0.0

    async def _new_page(self) -> Page:
        w, h = self.viewport
        ctx = await self.host.new_context(
            viewport={"width": w, "height": h},
            device_scale_factor=1,
            service_workers="block",
            accept_downloads=False,
            reduced_motion="reduce",
        )
        self._ctx = ctx
        await ctx.route("**/*", pages.handle_route)
        # Pages report "episode over" by calling window.__cuaSignal(reward) (the built-in suite's
        # cua.finish(), MiniWoB's wrapped core.endEpisode): a push, so a step needs no extra
        # page round trip to learn whether the episode ended.
        await ctx.expose_binding("__cuaSignal", self._on_signal)
        page = await ctx.new_page()
        self._crashed = False

        def on_crash(_p: Page) -> None:
            self._crashed = True

        page.on("crash", on_crash)
        # Track main-frame navigations a click or key may start, so the step can wait for the
        # new document before it reads the page state and takes the screenshot.
        self._nav_loaded = asyncio.Event()
        self._nav_loaded.set()

        def on_request(req) -> None:
            if req.is_navigation_request() and req.frame == page.main_frame:
                self._nav_loaded.clear()

        page.on("request", on_request)
        page.on("load", lambda _p: self._nav_loaded.set())
        page.on("requestfailed", lambda _r: self._nav_loaded.set())
        page.on("dialog", lambda d: asyncio.ensure_future(_quiet(d.dismiss())))
        # Pop-ups (window.open, target=_blank) are closed: the agent sees one page.
        ctx.on("page", lambda p: None if p is page else asyncio.ensure_future(_quiet(p.close())))
        page.set_default_timeout(self.step_timeout_s * 1000)
        self._page = page
        return page

    # ---------------------------------------------------------------------------------------
    # Env API
    # ---------------------------------------------------------------------------------------
    async def reset(self, task: Task, seed: int | None = None) -> Observation:
        """Open ``task``'s page with ``seed`` (default ``task.seed``) in a fresh context."""
        adapter = adapters.get(task)
        self._task = task
        self._seed = int(task.seed if seed is None else seed)
        self._active = False
        last_err: Exception | None = None
        for attempt in range(2):
            try:
                page = await self._fresh_page(reuse=attempt == 0 and self.reuse_context)
                self.release_inline()  # the last task's page (the next start holds its own)
                self.signal_done, self.signal_reward = False, 0.0
                self._instruction = await asyncio.wait_for(
                    adapter.start(self, page, task, self._seed), self.reset_timeout_s
                )
                self._broken = False
                self._fault_reason = None
                self._answer = None
                self._env_reward = 0.0
                self._oracle_plan = None
                self._oracle_i = 0
                self._steps = 0
                self._mouse = (self.viewport[0] / 2, self.viewport[1] / 2)
                obs = await asyncio.wait_for(self._observe(), self.step_timeout_s)
                self._active = True
                return obs
            except TimeoutError as e:
                last_err = e
                reason = f"page did not load within {self.reset_timeout_s:g}s"
            except EnvError:
                await self._drop_context()
                raise
            except Exception as e:  # noqa: BLE001 -- playwright errors of all kinds
                last_err = e
                reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self._broken = True
            self._fault_reason = f"the task could not start: {reason}"
            if not self.host.connected or self._crashed:
                continue  # browser died under us: one more try on a fresh one
            break
        await self._drop_context()
        raise EnvError(f"task {task.id!r} (seed {self._seed}) could not start: {reason}") from (
            last_err
        )

    async def step(self, action: A.Action) -> StepResult:
        """Execute ``action`` (screen pixels); faults end the episode with ``info['error']``."""
        t0 = time.perf_counter()
        if not self._active or self._last_obs is None:
            obs = self._last_obs or self._blank_obs()
            return StepResult(
                obs,
                True,
                0.0,
                {INFO_ERROR: "no episode is running; call reset()", INFO_DONE_REASON: "error"},
            )
        self._steps += 1
        self._api_result = None
        info: dict[str, Any] = {}
        if isinstance(action, A.InvalidAction):
            info[INFO_INVALID_ACTION] = action.reason
            return StepResult(self._last_obs, False, 0.0, info)
        if isinstance(action, A.Scroll) and not all(map(math.isfinite, (action.dx, action.dy))):
            info[INFO_INVALID_ACTION] = (
                f"scroll amounts must be finite numbers, got dx={action.dx!r} dy={action.dy!r}"
            )
            return StepResult(self._last_obs, False, 0.0, info)
        off = _off_screen(action, self.viewport)
        if off is not None:
            info[INFO_INVALID_ACTION] = off
            return StepResult(self._last_obs, False, 0.0, info)
        if isinstance(action, A.API_ACTION_TYPES):
            allowed = self._task.api_actions if self._task is not None else ()
            why = A.api_refusal(action, allowed, A.BROWSER_API, "browser")
            if why is not None:
                info[INFO_INVALID_ACTION] = why
                return StepResult(self._last_obs, False, 0.0, info)
        if isinstance(action, A.TERMINAL_ACTIONS):
            self._active = False
            if isinstance(action, A.Answer):
                self._answer = action.text
                info[INFO_ANSWER] = action.text
            info[INFO_DONE_REASON] = type(action).__name__.lower()
            return StepResult(self._last_obs, True, 0.0, info)
        try:
            done, reward, timing = await asyncio.wait_for(
                self._act_and_observe(action), self.step_timeout_s + _wait_time(action, self)
            )
        except TimeoutError:
            return await self._fault(f"step timed out after {self.step_timeout_s:g}s (hung page?)")
        except _BadKey as e:  # nothing was left pressed: the episode goes on
            info[INFO_INVALID_ACTION] = str(e)
            return StepResult(self._last_obs, False, 0.0, info)  # type: ignore[arg-type]
        except _EpisodeOver as e:
            return await self._fault(str(e))
        except Exception as e:  # noqa: BLE001 -- playwright raises many kinds
            # The "disconnected"/"crash" events may trail the failed call: give them a moment
            # so the recorded reason says what actually happened.
            await asyncio.sleep(0.2)
            return await self._fault(self._describe_fault(e))
        timing["total_s"] = time.perf_counter() - t0
        info[INFO_TIMING] = timing
        if self._api_result is not None:
            info[INFO_API_RESULT], self._api_result = self._api_result, None
        if done:
            self._active = False
            self._env_reward = reward
            info[INFO_DONE_REASON] = "env_done"
        return StepResult(self._last_obs, done, reward if done else 0.0, info)  # type: ignore[arg-type]

    async def evaluate(self) -> float:
        """The task's score for the current page state (0.0 for a task without a checker).

        Raises :class:`EnvError` naming the cause when there is nothing trustworthy to score: no
        episode was started, a fault (crash, killed browser, hung page) ended it, or the browser
        or page fails while the checker reads it. A dead browser is an infrastructure fault, not
        a policy failure: scoring it 0.0 would train on it (the rollout loop counts the raise as
        ``evaluate_error``). A checker's own 0.0 (a wrong answer) is returned as it is.
        """
        task = self._task
        if task is None:
            raise EnvError("BrowserEnv.evaluate(): no episode to score; call reset() first")
        if self._broken or self._page is None:
            raise EnvError(
                f"cannot score task {task.id!r}: its episode "
                f"{'ended by a fault' if self._broken else 'is closed'} "
                f"({self._fault_reason or 'no page'})"
            )
        page = self._page

        async def score() -> float:
            if not await self._shows_task(page):
                # e.g. an earlier episode's page: its checker must not score this episode, which
                # scores as unfinished (MiniWoB: -1, as adapters.MiniWoB.score does)
                return -1.0 if task.spec.get("kind") == "miniwob" else 0.0
            return await adapters.get(task).score(self, page, self._answer)

        try:
            return float(
                await asyncio.wait_for(
                    # a navigation the last action started may still be committing
                    self._with_nav_retry(score),
                    self.step_timeout_s,
                )
            )
        except TimeoutError as e:
            reason = f"the checker got no answer from the page within {self.step_timeout_s:g}s"
            await self._fault_during_evaluate(reason)
            raise EnvError(f"cannot score task {task.id!r}: {reason}") from e
        except Exception as e:  # playwright raises many kinds
            await asyncio.sleep(0.2)  # a trailing "disconnected"/"crash" event names the cause
            reason = self._describe_fault(e)
            await self._fault_during_evaluate(reason)
            raise EnvError(f"cannot score task {task.id!r}: {reason}") from e

    async def report(self) -> CheckerReport | None:
        """The checker's report on the episode (clicks, targets, closeness; see
        :class:`cua_jax.env_api.CheckerReport`), read after `evaluate`; None for a task kind
        whose checker has none, or when the page cannot give it (a fault already ended the
        episode, or the page fails now: logged, the episode's score stands)."""
        task, page = self._task, self._page
        if task is None or page is None or self._broken:
            return None
        try:
            return await asyncio.wait_for(
                self._with_nav_retry(lambda: adapters.get(task).report(self, page, self._answer)),
                self.step_timeout_s,
            )
        except Exception as e:  # noqa: BLE001 -- playwright raises many kinds
            log.warning("checker report of %s failed: %s", task.id, self._describe_fault(e))
            return None

    async def _fault_during_evaluate(self, reason: str) -> None:
        log.warning("evaluate of %s failed: %s", self._task.id if self._task else "?", reason)
        self._broken = True
        self._fault_reason = reason
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._drop_context(), 15.0)

    async def _shows_task(self, page: Page) -> bool:
        """Whether ``page`` shows this episode's task (template and seed; a MiniWoB task's page)."""
        assert self._task is not None
        spec = self._task.spec
        if spec.get("kind") == "builtin":
            return await page.evaluate(
                "([n, s]) => !!window.cua && cua.name === n && cua.seed === s",
                [spec.get("template"), self._seed],
            )
        if spec.get("kind") == "miniwob":
            return page.url.split("?")[0].split("#")[0] == miniwob.url(spec.get("name", ""))
        return True

    # ---------------------------------------------------------------------------------------
    # extras
    # ---------------------------------------------------------------------------------------
    @property
    def page(self) -> Page | None:
        """The live Playwright page (tests, tools)."""
        return self._page

    @property
    def instruction(self) -> str:
        return self._instruction

    async def oracle_next(self) -> A.Action:
        """The oracle's next action for the current state (screen pixels), or ``Done()``.

        Built-in tasks define a plan of element-level steps (click #id, type text, ...); each is
        resolved to coordinates from the element's live box right before it is returned, and a
        target outside the visible area first yields the ``Scroll`` that brings it into view.
        Raises ``NotImplementedError`` for tasks without an oracle.
        """
        if self._task is None or self._page is None:
            raise RuntimeError("call reset() before oracle_next()")
        if self._oracle_plan is None:
            adapter, page = adapters.get(self._task), self._page
            self._oracle_plan = await self._with_nav_retry(lambda: adapter.oracle_plan(self, page))
        while self._oracle_i < len(self._oracle_plan):
            st = self._oracle_plan[self._oracle_i]
            if self._task.api_actions:
                fused = await self._api_oracle_step(self._oracle_i)
                if fused is not None:
                    self._oracle_i += fused[1]
                    return fused[0]
            action = await self._resolve_oracle_step(st)
            if action is not None:
                if not isinstance(action, A.Scroll):
                    self._oracle_i += 1
                return action
            self._oracle_i += 1
        return A.Done()

    async def _api_oracle_step(self, i: int) -> tuple[A.Action, int] | None:
        """The plan's steps from ``i`` as one API action the task allows, and how many plan
        steps it replaces: click a labelled text field + type -> ``Fill``; click an option of
        a labelled select box, or a labelled dropdown then its option -> ``SelectOption``.
        None when the steps are not such a pair (or the label does not name one element)."""
        page, plan = self._page, self._oracle_plan
        assert page is not None and plan is not None and self._task is not None
        api = self._task.api_actions
        st, nxt = plan[i], plan[i + 1] if i + 1 < len(plan) else {}
        # (a double or triple click before typing selects the old text: fill replaces it too)
        if st.get("op") != "click" or st.get("button", "left") != "left":
            return None
        f = await self._with_nav_retry(lambda: page.evaluate(_FIELD_JS, st["sel"]))
        if not f or not f.get("label"):
            return None
        if not await self._labels_one(page, f["label"]):
            return None
        if f["kind"] == "text" and "fill" in api and nxt.get("op") == "type":
            return A.Fill(f["label"], str(nxt["text"])), 2
        if "select_option" not in api or st.get("count", 1) != 1:
            return None
        if f["kind"] == "option":
            return A.SelectOption(f["label"], f["option"]), 1
        if f["kind"] == "combobox" and nxt.get("op") == "click":
            o = await self._with_nav_retry(lambda: page.evaluate(_FIELD_JS, nxt["sel"]))
            if o and o.get("kind") == "roleoption" and o.get("option"):
                return A.SelectOption(f["label"], o["option"]), 2
        return None

    async def _labels_one(self, page: Page, label: str) -> bool:
        return await self._with_nav_retry(lambda: page.get_by_label(label, exact=True).count()) == 1

    async def _resolve_oracle_step(self, st: dict[str, Any]) -> A.Action | None:
        page = self._page
        assert page is not None
        op = st["op"]
        if op in ("click", "move", "drag", "see"):
            sel = st["sel"]
            target = await self._with_nav_retry(lambda: page.evaluate(_TARGET_JS, sel))
            # The last action may have started a navigation (JS `location.href = ...`) whose
            # request had not surfaced yet: give the next page a moment before giving up.
            for _ in range(40):
                if target is not None:
                    break
                await asyncio.sleep(0.05)
                await self._nav_loaded.wait()
                target = await self._with_nav_retry(lambda: page.evaluate(_TARGET_JS, sel))
            if target is None:
                raise RuntimeError(f"oracle target {sel!r} not found on {page.url}")
            if "scroll" in target:
                mx, my, ddx, ddy = target["scroll"]
                step = self.scroll_px_per_notch
                nx = 0.0 if abs(ddx) < 4 else float(max(1, math.ceil(abs(ddx) / step - 0.5)))
                ny = 0.0 if abs(ddy) < 4 else float(max(1, math.ceil(abs(ddy) / step - 0.5)))
                return A.Scroll(
                    mx,
                    my,
                    math.copysign(nx, ddx) if nx else 0.0,
                    math.copysign(ny, ddy) if ny else 0.0,
                )
            if op == "see":  # only bring it into view (e.g. before an Answer)
                return None
            box = target["box"]
            x, y = self._center(box, st.get("frac"))
            if op == "click":
                return A.Click(x, y, st.get("button", "left"), int(st.get("count", 1)))
            if op == "move":
                return A.Move(x, y)
            to = await page.evaluate(_BOX_JS, st["to"])
            if to is None:
                raise RuntimeError(f"oracle drag target {st['to']!r} not found")
            tx, ty = self._center(to, st.get("to_frac"))
            return A.Drag(tx, ty, x, y)
        if op == "type":
            return A.TypeText(st["text"])
        if op == "key":
            return A.Key(tuple(st["keys"]))
        if op == "wait":
            return A.Wait(float(st.get("s", 0.1)))
        if op == "answer":
            return A.Answer(str(st["text"]))
        if op == "done":
            return A.Done()
        raise ValueError(f"unknown oracle op {op!r} in {st}")

    def _center(self, box: list[float], frac: list[float] | None = None) -> tuple[float, float]:
        fx, fy = frac if frac else (0.5, 0.5)
        x = box[0] + box[2] * fx
        y = box[1] + box[3] * fy
        w, h = self.viewport
        return float(min(max(round(x), 0), w - 1)), float(min(max(round(y), 0), h - 1))

    # ---------------------------------------------------------------------------------------
    # internals
    # ---------------------------------------------------------------------------------------
    async def _act_and_observe(self, action: A.Action) -> tuple[bool, float, dict[str, float]]:
        page = self._page
        assert page is not None and self._task is not None
        t0 = time.perf_counter()
        await self._execute(page, action)
        if self._crashed:
            raise _EpisodeOver("page crashed")
        t1 = time.perf_counter()
        adapter = adapters.get(self._task)
        if not self._nav_loaded.is_set():  # the action started a navigation: wait for it
            await self._nav_loaded.wait()
        await self._observe()
        # Read the state after the screenshot: a page's done signal, sent while it handled the
        # input, has certainly arrived by now (same CDP session, in order).
        done, reward = await self._with_nav_retry(lambda: adapter.state(self, page))
        t2 = time.perf_counter()
        return done, reward, {"action_s": t1 - t0, "observe_s": t2 - t1}

    async def _with_nav_retry(self, fn):
        # A click may start a navigation: evaluating in the old document then fails with
        # "Execution context was destroyed". Wait for the new document and ask again.
        for attempt in range(4):
            try:
                return await fn()
            except Exception as e:
                msg = str(e)
                transient = ("context was destroyed", "navigat", "Unable to capture screenshot")
                if attempt == 3 or not any(t in msg for t in transient):
                    raise
                assert self._page is not None
                await asyncio.sleep(0.02 * (attempt + 1))  # let a pending navigation commit
                with contextlib.suppress(Exception):
                    await self._page.wait_for_load_state("load")

    async def _execute(self, page: Page, a: A.Action) -> None:
        m = page.mouse
        match a:
            case A.Click(x, y, button, count):
                if x is not None and y is not None:
                    self._mouse = (x, y)
                await m.click(*self._mouse, button=button, click_count=count)
                self._held_buttons.discard(button)
            case A.Move(x, y):
                self._mouse = (x, y)
                await m.move(x, y)
            case A.Drag(x, y, sx, sy):
                if sx is not None and sy is not None:
                    self._mouse = (sx, sy)
                await m.move(*self._mouse)
                await m.down()
                await m.move(x, y, steps=5)
                await m.up()
                self._held_buttons.discard("left")
                self._mouse = (x, y)
            case A.TypeText(text):
                await page.keyboard.type(text[:2000])
            case A.Key(keys):
                await self._press_keys(page, keys)
            case A.Scroll(x, y, dx, dy):
                if x is not None and y is not None:
                    self._mouse = (x, y)
                await m.move(*self._mouse)
                dx, dy = A.clamp_scroll(dx), A.clamp_scroll(dy)
                await m.wheel(dx * self.scroll_px_per_notch, dy * self.scroll_px_per_notch)
                # Wheel scrolling is asynchronous: let two frames pass so the screenshot shows it.
                await self._with_nav_retry(lambda: page.evaluate(_RAF_JS))
            case A.MouseDown(x, y, button) | A.MouseUp(x, y, button):
                if x is not None and y is not None:
                    self._mouse = (x, y)
                    await m.move(x, y, steps=5)  # a held button drags along the way
                if isinstance(a, A.MouseDown):
                    await m.down(button=button)
                    self._held_buttons.add(button)
                else:
                    await m.up(button=button)
                    self._held_buttons.discard(button)
            case A.KeyDown(key):
                name = _key_name(key, shifted="Shift" in self._held_keys)
                if await _send_key(page.keyboard.down, name):
                    self._held_keys.add(name)
                elif _typable(name):  # a key Playwright does not know: type the character
                    await page.keyboard.insert_text(name)
                else:
                    raise _BadKey(f"unknown key {key!r}")
            case A.KeyUp(key):
                name = _key_name(key, shifted=False)  # "a" and "KeyA" are the same key
                if await _send_key(page.keyboard.up, name):
                    self._held_keys.difference_update({name, SHIFTABLE_KEYS.get(name)})
                elif not _typable(name):
                    raise _BadKey(f"unknown key {key!r}")
            case A.Wait(seconds):
                await asyncio.sleep(min(max(seconds, 0.0), self.max_wait_s))
            case A.OpenUrl() | A.Fill() | A.SelectOption():
                try:
                    self._api_result = await self._api(page, a)
                except _ApiRefused:
                    raise
                except Exception as e:
                    if self._crashed or not self.host.connected or _is_closed(e):
                        raise  # a fault, not the model's mistake
                    first = str(e).splitlines()[0] if str(e) else type(e).__name__
                    raise _ApiRefused(f"{A.api_name(a)} failed: {first}") from e
            case _:
                raise ValueError(f"BrowserEnv cannot execute {a!r}")

    async def _api(self, page: Page, a: A.Action) -> str:
        """Runs a browser API action through Playwright's locators; what it did, as text.
        Raises _ApiRefused (an invalid action) when the page has no such field/option/page."""
        match a:
            case A.OpenUrl(url):
                full = urllib.parse.urljoin(page.url, url.strip())
                if not full.startswith(pages.ORIGIN + "/"):
                    raise _ApiRefused(
                        f"open_url: {url!r} is not reachable (the network is closed; only "
                        f"pages under {pages.ORIGIN}/ open)"
                    )
                resp = await page.goto(full, wait_until="load", timeout=self.step_timeout_s * 1000)
                return f"opened {full} (HTTP {resp.status if resp else '?'})"
            case A.Fill(label, text):
                loc = await self._labelled(page, label, "fill")
                await loc.fill(text[:10_000], timeout=_API_TIMEOUT_MS)
                return f"filled {label!r}"
            case A.SelectOption(label, option):
                loc = await self._labelled(page, label, "select_option")
                tag, role, controls = await loc.evaluate(
                    "e => [e.tagName, e.getAttribute('role') || '', "
                    "e.getAttribute('aria-controls') || '']"
                )
                if tag == "SELECT":
                    opts = await loc.evaluate(
                        "e => Array.from(e.options).map(o => [(o.label || o.text).trim(), o.value])"
                    )
                    val = _pick_option(option, opts)
                    if val is None:
                        names = ", ".join(repr(o[0]) for o in opts[:20])
                        raise _ApiRefused(
                            f"select_option: {label!r} has no option {option!r}; options: {names}"
                        )
                    await loc.select_option(value=val, timeout=_API_TIMEOUT_MS)
                    return f"selected {option!r} in {label!r}"
                if role != "combobox":
                    raise _ApiRefused(
                        f"select_option: {label!r} is not a select box or dropdown; use fill or "
                        "GUI actions"
                    )
                await loc.click(timeout=_API_TIMEOUT_MS)
                scope = page.locator(f"[id={json.dumps(controls)}]") if controls else page
                opt = scope.get_by_role("option", name=option, exact=True)
                if await opt.count() == 0:
                    opt = scope.get_by_role("option", name=option)
                n = await opt.count()
                if n != 1:
                    await loc.click(timeout=_API_TIMEOUT_MS)  # close it again
                    raise _ApiRefused(
                        f"select_option: the dropdown {label!r} has "
                        f"{'no' if n == 0 else n} option(s) named {option!r}"
                    )
                await opt.click(timeout=_API_TIMEOUT_MS)
                return f"selected {option!r} in {label!r}"
        raise ValueError(f"BrowserEnv cannot execute {a!r}")

    async def _labelled(self, page: Page, label: str, what: str):
        """The one element labelled ``label`` (exact label, then substring, then placeholder)."""
        n = 0
        for loc in (
            page.get_by_label(label, exact=True),
            page.get_by_label(label),
            page.get_by_placeholder(label),
        ):
            n = await loc.count()
            if n == 1:
                return loc
            if n > 1:
                visible = loc.filter(visible=True)
                if await visible.count() == 1:
                    return visible
                break
        raise _ApiRefused(
            f"{what}: {'no' if n == 0 else n} field(s) labelled {label!r} on the page"
            + ("; name it by its full label" if n > 1 else "")
        )

    async def _press_keys(self, page: Page, keys: tuple[str, ...]) -> None:
        """A ``Key`` chord: keys go down in order and come up in reverse."""
        shifted = "Shift" in self._held_keys or any(_key_name(k, False) == "Shift" for k in keys)
        names = [_key_name(k, shifted) for k in keys]
        down: list[str] = []
        for name in names:
            if not await _send_key(page.keyboard.down, name):
                break
            down.append(name)
        for name in reversed(down):
            await page.keyboard.up(name)
        self._held_keys.difference_update(down)
        if len(down) < len(names):  # Playwright does not know names[len(down)]
            bad = keys[len(down)]
            if len(keys) == 1 and _typable(bad):  # e.g. "é": type it, as a keyboard layout would
                await page.keyboard.insert_text(bad)
            elif _typable(bad):
                raise _BadKey(f"key {bad!r} cannot be part of a chord; type it alone")
            else:
                raise _BadKey(f"unknown key {bad!r}")

    async def _observe(self) -> Observation:
        page = self._page
        assert page is not None
        data = await self._with_nav_retry(
            lambda: page.screenshot(type=self.screenshot_type, timeout=self.step_timeout_s * 1000)
        )
        self.last_screenshot_bytes = data  # the encoded image (the remote host sends it on)
        if self.decode_screenshots:
            img = await asyncio.to_thread(decode_screenshot, data)
        else:  # no pixels: a read-only view of one black pixel, the screen's shape
            w, h = self.viewport
            img = np.broadcast_to(np.zeros((1, 1, 3), np.uint8), (h, w, 3))
        text = None
        if self.text_state:
            text = await self._with_nav_retry(
                lambda: page.evaluate("() => document.body ? document.body.innerText : ''")
            )
            text = (text or "")[:4000]
        obs = Observation(
            screenshot=img,
            instruction=self._instruction,
            text=text,
            info={"url": page.url, "step": self._steps},
        )
        self._last_obs = obs
        return obs

    def _describe_fault(self, e: Exception) -> str:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        if self._crashed:
            return f"page crashed ({first})"
        if not self.host.connected:
            return f"browser crashed or was killed ({first})"
        return f"browser error: {type(e).__name__}: {first}"

    async def _fault(self, reason: str) -> StepResult:
        log.warning(
            "episode of %s ended by a fault: %s", self._task.id if self._task else "?", reason
        )
        self._active = False
        self._broken = True
        self._fault_reason = reason
        obs = self._last_obs or self._blank_obs()
        # Drop the context now (bounded) so a hung renderer stops burning CPU.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._drop_context(), 15.0)
        return StepResult(obs, True, 0.0, {INFO_ERROR: reason, INFO_DONE_REASON: "error"})

    def _blank_obs(self) -> Observation:
        w, h = self.viewport
        return Observation(np.zeros((h, w, 3), np.uint8), self._instruction)


def _pick_option(option: str, opts: list[list[str]]) -> str | None:
    """The value of the option whose text (or value) is ``option``: exact, then ignoring case."""
    want = option.strip()
    for match in (lambda t: t == want, lambda t: t.casefold() == want.casefold()):
        for text, value in opts:
            if match(text) or match(value):
                return value
    return None


def _off_screen(action: A.Action, viewport: tuple[int, int]) -> str | None:
    """Why a pointer action's point is not on the screen, or None. Chromium is handed no
    point it cannot place: a Click at (1e308, 1e308) hung the page for the whole step time-out,
    and inf is not even JSON."""
    match action:
        case A.Drag(x, y, sx, sy):
            points = [(x, y), (sx, sy)]
        case A.Click(x, y) | A.Move(x, y) | A.Scroll(x, y) | A.MouseDown(x, y) | A.MouseUp(x, y):
            points = [(x, y)]
        case _:
            return None
    w, h = viewport
    for x, y in points:
        if x is None or y is None:
            continue  # at the pointer, which is always on the screen
        try:
            on = 0 <= x <= w and 0 <= y <= h  # False for NaN
        except TypeError:
            on = False
        if not on:
            name = type(action).__name__
            return f"{name} at ({x!r}, {y!r}) is off the {w}x{h} screen"
    return None


def _is_closed(e: Exception) -> bool:
    msg = str(e)
    return any(t in msg for t in ("has been closed", "Target closed", "crashed", "disconnected"))


def _key_name(key: str, shifted: bool) -> str:
    """The Playwright name of a canonical key name; a character key's code name when shifted."""
    name = PLAYWRIGHT_KEYS.get(key, key)
    return SHIFTABLE_KEYS.get(name, name) if shifted else name


async def _send_key(press, name: str) -> bool:
    """``press(name)`` (keyboard.down or .up); False when Playwright does not know the key."""
    try:
        await press(name)
    except Exception as e:
        if "Unknown key" not in str(e):
            raise
        return False
    return True


def _typable(key: str) -> bool:
    """One character that is not a control character (which insert_text could type)."""
    return len(key) == 1 and not unicodedata.category(key).startswith("C")


def _wait_time(action: A.Action, env: BrowserEnv) -> float:
    return min(action.seconds, env.max_wait_s) if isinstance(action, A.Wait) else 0.0


async def _quiet(coro) -> None:
    with contextlib.suppress(Exception):
        await coro
