"""One Chromium process that hosts many isolated browser contexts, and relaunches itself.

Every :class:`~envs.browser.env.BrowserEnv` of a pool shares one ``BrowserHost``: a context per
env is far cheaper than a browser per env, and one process keeps memory bounded. When the browser
dies (crash, OOM kill, a test's ``SIGKILL``) the next ``context()`` call relaunches it.

We always run Debian's Chromium (``apt-get install chromium``), never a Playwright-downloaded
build: ``playwright install`` needs the network, and the distro build gets security updates.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import time
import uuid
from collections.abc import Sequence

from playwright.async_api import Browser, BrowserContext, Playwright, async_playwright

log = logging.getLogger(__name__)

CHROMIUM_CANDIDATES = (
    "/usr/bin/chromium",
    "/usr/lib/chromium/chromium",
    "/usr/bin/chromium-headless-shell",
    "/usr/lib/chromium/chromium-headless-shell",
    "/usr/bin/chromium-browser",
    "/usr/bin/google-chrome",
)

# --headless etc. as the project needs them: we run as root (no sandbox), without a GPU, with the
# network closed (no background fetches, no QUIC). --host-resolver-rules is a second fence behind
# the per-context request routing: any name that still reached the resolver fails to resolve.
# OverscrollHistoryNavigation off: a sideways wheel scroll past a page's edge is otherwise a "swipe"
# that goes back in history (on a reused env: into an earlier episode's page, which could score).
# WebRTC is the one way out that request routing cannot see: an RTCPeerConnection's STUN/TURN
# traffic is UDP to any address. The IP handling policy disable_non_proxied_udp allows UDP only
# through a proxy (there is none) and the permission check hides local addresses; a page's STUN
# requests to a listener then send nothing (tests/envs/browser/test_env.py). This Chromium reads
# the plain switch; --force-... is the older builds' name. A host that must not reach anything
# at all also needs a network namespace or a firewall around the browser host process.
CHROMIUM_ARGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--mute-audio",
    "--host-resolver-rules=MAP * ~NOTFOUND",
    "--webrtc-ip-handling-policy=disable_non_proxied_udp",
    "--force-webrtc-ip-handling-policy=disable_non_proxied_udp",
    "--enforce-webrtc-ip-permission-check",
    "--disable-features=OverscrollHistoryNavigation",
)
DISABLE_FEATURES = "--disable-features="

# Playwright starts Chromium with a --disable-features switch of its own, before ours, and Chromium
# honours only the last such switch: ours must carry Playwright's features too. They change between
# Playwright versions, so the first launch in this process reads them off the browser's command
# line (and relaunches it with them merged in).
_playwright_disabled_features: tuple[str, ...] | None = None

PROBE_EVERY_S = 1.0  # BrowserHost.check: the most often a page is opened to check the browser
PROBE_WAIT_S = 1.0  # how long a check waits for its probe (a healthy browser takes ~50 ms)


def merge_disable_features(args: Sequence[str], more: Sequence[str] = ()) -> list[str]:
    """``args`` with the features of all their --disable-features switches, and ``more``, joined
    into one switch at the end (Chromium honours only the last one)."""
    rest, features = [], list(more)
    for a in args:
        if a.startswith(DISABLE_FEATURES):
            features += a[len(DISABLE_FEATURES) :].split(",")
        else:
            rest.append(a)
    features = list(dict.fromkeys(f for f in features if f))  # drop repeats, keep the order
    return [*rest, DISABLE_FEATURES + ",".join(features)] if features else rest


def _features_before_the_last(pid: int) -> tuple[str, ...]:
    """The features of every --disable-features switch but the last one (ours) on ``pid``'s
    command line."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmd = f.read().decode(errors="replace").split("\0")
    switches = [a[len(DISABLE_FEATURES) :] for a in cmd if a.startswith(DISABLE_FEATURES)]
    return tuple(f for sw in switches[:-1] for f in sw.split(",") if f)


def find_chromium(executable_path: str | None = None) -> str:
    """The Chromium binary to launch: ``executable_path`` if given, else the first that exists."""
    if executable_path:
        if not os.path.exists(executable_path):
            raise FileNotFoundError(
                f"Chromium executable_path {executable_path!r} does not exist; install it with "
                "`apt-get install -y chromium` or pass executable_path=None to autodetect"
            )
        return executable_path
    for c in CHROMIUM_CANDIDATES:
        if os.path.exists(c):
            return c
    found = shutil.which("chromium") or shutil.which("chromium-headless-shell")
    if found:
        return found
    raise FileNotFoundError(
        f"no Chromium found (looked at {', '.join(CHROMIUM_CANDIDATES)}); install it with "
        "`apt-get install -y chromium` (the Makefile's `make apt` does) or pass executable_path="
    )


class BrowserHost:
    """Owns Playwright and one Chromium process; hands out fresh contexts; relaunches on death.

    Args:
      executable_path: Chromium binary; autodetected when None (see ``find_chromium``).
      extra_args: more Chromium switches (their --disable-features are merged into ours).
      launch_timeout_s: how long a launch may take before it counts as failed.
      page_memory_mb: a per-page cap on JavaScript heap memory (V8's old space, in every
        renderer process): a page that allocates without end crashes its own renderer (a
        fault of that episode; the next reset gets a fresh context) instead of swapping the
        machine that runs the other envs. None: V8's default.
    """

    def __init__(
        self,
        executable_path: str | None = None,
        extra_args: Sequence[str] = (),
        launch_timeout_s: float = 60.0,
        page_memory_mb: int | None = None,
    ):
        self.executable_path = find_chromium(executable_path)
        if page_memory_mb is not None and page_memory_mb < 16:
            raise ValueError(f"page_memory_mb must be >= 16 (MiB), got {page_memory_mb}")
        limits = (
            (f"--js-flags=--max-old-space-size={int(page_memory_mb)}",) if page_memory_mb else ()
        )
        self.extra_args = tuple(extra_args) + limits
        self.launch_timeout_s = launch_timeout_s
        self._pw: Playwright | None = None
        self._browser: Browser | None = None
        self._marker = ""
        self._lock = asyncio.Lock()
        self._probe: asyncio.Future | None = None  # the last health probe (one at a time)
        self._probe_t = (0.0, 0.0)  # when it started, when it ended
        self._verdict: str | None = None  # what the last finished probe found
        self.launches = 0  # how many times a browser was started (relaunches show here)

    async def __aenter__(self) -> BrowserHost:
        await self.browser()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @property
    def connected(self) -> bool:
        return self._browser is not None and self._browser.is_connected()

    async def browser(self) -> Browser:
        """The live browser, launching (or relaunching after a crash) when needed."""
        global _playwright_disabled_features
        if self.connected:
            return self._browser  # type: ignore[return-value]
        async with self._lock:
            if self.connected:
                return self._browser  # type: ignore[return-value]
            if self._browser is not None:
                log.warning("browser is gone (crashed or killed); relaunching")
                await self._drop_browser()
            if self._pw is None:
                self._pw = await async_playwright().start()
            self._browser = await self._launch()
            if _playwright_disabled_features is None:
                pids = self.browser_pids()
                try:
                    _playwright_disabled_features = _features_before_the_last(pids[0])
                except (IndexError, OSError) as e:
                    log.warning("could not read Chromium's command line (%r)", e)
                    _playwright_disabled_features = ()
                if _playwright_disabled_features:
                    await self._drop_browser()
                    self._browser = await self._launch()
            self.launches += 1
            return self._browser

    async def _launch(self) -> Browser:
        assert self._pw is not None
        # A unique no-op switch lets us find (and kill) exactly this browser's processes.
        self._marker = f"--cua-host={uuid.uuid4().hex}"
        args = merge_disable_features(
            [*CHROMIUM_ARGS, *self.extra_args], _playwright_disabled_features or ()
        )
        return await self._pw.chromium.launch(
            executable_path=self.executable_path,
            args=[*args, self._marker],
            headless=True,
            chromium_sandbox=False,
            timeout=self.launch_timeout_s * 1000,
            handle_sigint=False,
            handle_sigterm=False,
            handle_sighup=False,
        )

    async def check(self, timeout_s: float = 20.0) -> str | None:
        """None when the browser opens a page, else why not: it could not, or a page has been
        opening for more than ``timeout_s`` (wedged).

        ``connected`` only says the pipe to Chromium is open: a browser pinned at 100% CPU (a
        100000 x 100000 page) or stopped stays connected while every reset hangs. Opening a
        page needs the browser process and a renderer, as a reset does. One probe runs at a
        time, at most every ``PROBE_EVERY_S``; a caller waits for it at most ``PROBE_WAIT_S``
        (a busy browser is slow, not wedged, until ``timeout_s``) and otherwise gets the last
        verdict. A dead browser is relaunched by the probe.
        """
        now = time.monotonic()
        p = self._probe
        if p is None or (p.done() and now - self._probe_t[1] >= PROBE_EVERY_S):
            p = self._probe = asyncio.ensure_future(self._open_a_page())
            self._probe_t = (now, now)
            p.add_done_callback(self._probe_done)
        if not p.done():
            with contextlib.suppress(Exception):  # a time-out, or the probe's error (its verdict)
                await asyncio.wait_for(asyncio.shield(p), min(PROBE_WAIT_S, timeout_s))
        if not p.done() and time.monotonic() - self._probe_t[0] > timeout_s:
            return f"the browser has not opened a page in {timeout_s:g}s (wedged?)"
        return self._verdict

    def _probe_done(self, f: asyncio.Future) -> None:
        self._probe_t = (self._probe_t[0], time.monotonic())
        e = None if f.cancelled() else f.exception()
        if e is None:
            self._verdict = None
        else:
            first = str(e).splitlines()[0] if str(e) else ""
            self._verdict = f"the browser could not open a page: {type(e).__name__}: {first}"

    async def _open_a_page(self) -> None:
        ctx = await self.new_context(viewport={"width": 64, "height": 64})
        try:
            await (await ctx.new_page()).evaluate("1")
        finally:
            await ctx.close()

    async def new_context(self, **kwargs) -> BrowserContext:
        """A fresh isolated context (own cookies, storage, renderer processes)."""
        browser = await self.browser()
        return await browser.new_context(**kwargs)

    def browser_pids(self) -> list[int]:
        """PIDs of this host's Chromium processes (the browser process first)."""
        if not self._marker:
            return []
        main, others = [], []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().split(b"\0")
            except OSError:
                continue
            if self._marker.encode() not in cmd:
                continue
            (others if any(c.startswith(b"--type=") for c in cmd) else main).append(int(pid))
        return main + others

    def kill(self) -> None:
        """SIGKILL this host's Chromium processes (recovery from a wedged browser; tests)."""
        for pid in self.browser_pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    async def restart(self) -> None:
        """Kill the browser; the next ``browser()`` call launches a new one."""
        async with self._lock:
            self.kill()
            await self._drop_browser()

    async def _drop_browser(self, timeout_s: float = 10.0) -> None:
        b, self._browser = self._browser, None
        if b is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(b.close(), timeout_s)
        self.kill()  # whatever is left of it

    async def close(self, timeout_s: float = 10.0) -> None:
        """Close the browser and Playwright, each given ``timeout_s`` before the browser's
        processes are killed (a wedged browser never answers a close). Safe to call twice."""
        probe, self._probe = self._probe, None
        if probe is not None:
            probe.cancel()
        await self._drop_browser(timeout_s)
        pw, self._pw = self._pw, None
        if pw is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(pw.stop(), timeout_s)
