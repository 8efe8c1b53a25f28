"""OSWorld's setup (and postconfig) steps, with its placeholders and its file cache.

What OSWorld's ``desktop_env/controllers/setup.py`` (``SetupController._<type>_setup``) does for
each ``{"type", "parameters"}`` step of a task's ``config`` and ``evaluator.postconfig``, over
the same VM protocol (``VMClient``):

* ``download``: fetches ``url`` on the host through a :class:`ContentCache` in OSWorld's layout
  (``<cache_dir>/<task id>/<file>``) and uploads it to ``path`` in the VM. A cached file needs
  no network; a file neither cached nor reachable is a :class:`DownloadError` naming the URL.
* ``upload_file``, ``open``, ``launch``, ``execute``/``command`` (``until``, ``stdout``,
  ``stderr``), ``sleep``, ``activate_window``, ``close_window``.
* ``chrome_open_tabs``, ``chrome_close_tabs``: Chrome's DevTools HTTP endpoints (``/json/new``,
  ``/json/list``, ``/json/close``) on the VM's port 9222, called from *inside* the VM through
  ``/execute``, so neither Playwright nor an exposed DevTools port is needed on the host.
* ``update_browse_history``: OSWorld's empty Chrome history database (a download, cached), the
  visits written into it here, uploaded as the VM's ``~/.config/google-chrome/Default/History``.
* ``googledrive`` and ``login`` need a Google account and OSWorld's own code for them (the
  ``osworld`` extra, desktop-env): :func:`credentials_problem` says in one line what is missing,
  and the loader refuses such a task with that line unless it is configured.

Placeholders ``{CLIENT_PASSWORD}``, ``{SCREEN_WIDTH}``, ``{SCREEN_HEIGHT}``,
``{SCREEN_WIDTH_HALF}``, ``{SCREEN_HEIGHT_HALF}`` are filled in every string of a step.

Failures are loud where OSWorld's own run would be broken: a step the VM refuses (an HTTP error:
a missing program, a file that is not there), a download, an ``until`` condition never met, and
an ``execute`` whose exit status says its program is missing (126, 127: e.g. ``sudo`` on a
desktop without it) raise :class:`SetupError`, which ``VMEnv`` turns into an infrastructure
fault of the episode, never a 0 score. Other non-zero exits are logged (OSWorld ignores them,
and some of its steps, like ``killall`` of an app that is not running, exit 1 by design);
``SetupOptions.strict`` makes them faults too. A window that ``activate_window`` /
``close_window`` cannot find is logged, as in OSWorld: the task stays solvable.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import json
import logging
import os
import shutil
import sqlite3
import tempfile
import urllib.parse
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp

from envs.vm.client import VMClient, VMError, VMRequestError

log = logging.getLogger(__name__)

SETUP_TYPES = (
    "download",
    "upload_file",
    "open",
    "launch",
    "execute",
    "command",
    "sleep",
    "activate_window",
    "close_window",
    "chrome_open_tabs",
    "chrome_close_tabs",
    "update_browse_history",
    "googledrive",
    "login",
)
# The steps that need a Google account, and what configures them.
CREDENTIAL_STEPS = {
    "googledrive": "Google Drive API credentials (settings_file and its client_config_file)",
    "login": "a Google account (settings_file with email and password)",
}
DEFAULT_CLIENT_PASSWORD = "password"  # OSWorld's VMs (its AWS images: osworld-public-evaluation)
DEFAULT_CACHE_DIR = "~/.cache/cua_jax/osworld"
HISTORY_DB_URL = (
    "https://huggingface.co/datasets/xlangai/ubuntu_osworld_file_cache/resolve/main/chrome/"
    "44ee5668-ecd5-4366-a6ce-c1c9b8d4e938/history_empty.sqlite?download=true"
)
CHROME_HISTORY_PATH = "~/.config/google-chrome/Default/History"
UNTIL_TRIES = 40  # an ``until`` step polls this many times, 0.3 s apart (OSWorld: forever)
_MISSING_PROGRAM_EXITS = (126, 127)  # the shell's "not executable" / "command not found"


class SetupError(RuntimeError):
    """A setup (or postconfig) step failed in the VM: the episode is an infrastructure fault."""


class DownloadError(SetupError):
    """A ``download`` / ``cloud_file`` URL is neither in the cache nor reachable."""

    def __init__(self, url: str, cached_at: Path, cause: str):
        self.url = url
        super().__init__(
            f"cannot get {url}: not in the cache ({cached_at}) and the download failed: {cause}"
        )


# ----------------------------------------------------------------------------- the file cache


class ContentCache:
    """OSWorld's file cache: ``root/<task id>/<file>``, filled on first use.

    OSWorld's ``download`` step caches a URL as ``<uuid5(url)>_<basename(path)>`` and its
    ``cloud_file`` getter as ``<dest>``, both in ``cache/<task id>/``; a cache OSWorld filled
    works here as is, and so does one made by hand (``<task id>/<basename(path)>``). Files are
    written whole (a temporary file renamed), so concurrent episodes of one task are safe.

    Args:
      root: the cache directory (``~`` expanded).
      offline: never use the network: a file that is not cached is a :class:`DownloadError`.
      timeout: seconds one download may take.
      tries: download attempts before giving up.
    """

    def __init__(
        self,
        root: str | os.PathLike = DEFAULT_CACHE_DIR,
        *,
        offline: bool = False,
        timeout: float = 300.0,
        tries: int = 3,
    ):
        self.root = Path(root).expanduser()
        self.offline = offline
        self.timeout = timeout
        self.tries = max(1, int(tries))

    def __repr__(self) -> str:
        return f"ContentCache({str(self.root)!r}, offline={self.offline})"

    def task_dir(self, task_id: str) -> Path:
        if not task_id or "/" in task_id or task_id in (".", ".."):
            raise SetupError(f"a task id {task_id!r} cannot name a cache directory")
        return self.root / task_id

    @staticmethod
    def download_name(url: str, path: str) -> str:
        """OSWorld's cache file name of a ``download`` step's file."""
        return f"{uuid.uuid5(uuid.NAMESPACE_URL, url)}_{os.path.basename(path)}"

    async def fetch(self, task_id: str, url: str, names: Sequence[str]) -> Path:
        """The cached file under the first of ``names`` that exists, else ``url`` downloaded to
        ``names[0]``. Raises :class:`DownloadError` naming the URL."""
        d = self.task_dir(task_id)
        for n in names:
            if (d / n).is_file():
                return d / n
        dest = d / names[0]
        if self.offline:
            raise DownloadError(url, dest, "the cache is offline")
        if not url.startswith(("http://", "https://")):
            raise DownloadError(url, dest, "not an http(s) URL")
        d.mkdir(parents=True, exist_ok=True)
        cause = ""
        for i in range(self.tries):
            if i:
                await asyncio.sleep(min(2.0**i, 10.0))
            fd, tmp = tempfile.mkstemp(dir=d, prefix=".part-")
            try:
                with os.fdopen(fd, "wb") as f:
                    await self._get(url, f)
                os.replace(tmp, dest)
                return dest
            except (aiohttp.ClientError, TimeoutError, OSError) as e:
                cause = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                log.warning("download %s failed (try %d/%d): %s", url, i + 1, self.tries, cause)
                status = getattr(e, "status", None)
                if isinstance(e, aiohttp.ClientResponseError) and status < 500 and status != 429:
                    break  # not there: asking again will not change it
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        raise DownloadError(url, dest, cause)

    async def _get(self, url: str, f: Any) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with aiohttp.ClientSession(timeout=timeout) as s, s.get(url) as r:
            r.raise_for_status()
            async for chunk in r.content.iter_chunked(1 << 20):
                f.write(chunk)


# ----------------------------------------------------------------------------- placeholders


def fill_placeholders(obj: Any, screen_size: tuple[int, int], password: str = "") -> Any:
    """Fills OSWorld's placeholders in every string of ``obj`` (nested lists and dicts)."""
    w, h = screen_size
    subs = {
        "{CLIENT_PASSWORD}": password,
        "{SCREEN_WIDTH_HALF}": str(w // 2),
        "{SCREEN_HEIGHT_HALF}": str(h // 2),
        "{SCREEN_WIDTH}": str(w),
        "{SCREEN_HEIGHT}": str(h),
    }
    if isinstance(obj, str):
        for k, v in subs.items():
            obj = obj.replace(k, v)
        return obj
    if isinstance(obj, list | tuple):
        return [fill_placeholders(x, screen_size, password) for x in obj]
    if isinstance(obj, Mapping):
        return {k: fill_placeholders(v, screen_size, password) for k, v in obj.items()}
    return obj


# ----------------------------------------------------------------------------- credentials


def settings_roots(base_dir: str | os.PathLike | None) -> list[Path]:
    """Where a ``settings_file`` is looked for: the working directory (OSWorld runs from its
    checkout), then the OSWorld checkout holding the task (``<root>/evaluation_examples/
    examples/<domain>/``)."""
    roots = [Path.cwd()]
    if base_dir is not None and len(Path(base_dir).resolve().parents) >= 3:
        roots.append(Path(base_dir).resolve().parents[2])
    return roots


def credentials_problem(step: Mapping[str, Any], roots: Sequence[Path]) -> str | None:
    """None when a ``googledrive`` / ``login`` step can run (its settings under one of
    ``roots``, and desktop-env installed), else one line saying what is missing."""
    t = step.get("type")
    if t not in CREDENTIAL_STEPS:
        return None
    settings = str((step.get("parameters") or {}).get("settings_file", ""))
    found = next((r / settings for r in roots if settings and (r / settings).is_file()), None)
    if found is not None and t == "googledrive":
        # settings.yml names the OAuth client file; without it there are no credentials.
        conf = next(
            (
                ln.split(":", 1)[1].strip()
                for ln in found.read_text(errors="replace").splitlines()
                if ln.startswith("client_config_file:")
            ),
            "",
        )
        if not conf or not any((r / conf).is_file() for r in roots):
            found = None
    if found is None:
        return f"setup step {t} needs {CREDENTIAL_STEPS[t]}: {settings or '?'} not found"
    if importlib.util.find_spec("desktop_env") is None:
        return f"setup step {t} runs OSWorld's own code: install the osworld extra (desktop-env)"
    return None


# ----------------------------------------------------------------------------- steps


@dataclasses.dataclass(frozen=True)
class SetupOptions:
    """What setup steps need beyond the step itself.

    Attributes:
      client_password: fills ``{CLIENT_PASSWORD}`` (the VM user's sudo password).
      cache: the file cache of ``download`` (None: ``ContentCache()`` at the default place).
      work_dir: this episode's own directory for ``execute``'s ``stdout``/``stderr`` files
        (OSWorld writes them to its task cache dir; the ``cache_file`` getter reads them).
        None: those outputs are dropped.
      chrome_port: Chrome's DevTools port inside the VM (OSWorld's VMs: 9222).
      strict: any non-zero exit of an ``execute`` step is a fault (default: only 126 / 127).
      window_wait_s: how long ``activate_window`` / ``close_window`` look for the window.
      sleep_scale: ``sleep`` steps wait this many times their ``seconds`` (a slow desktop's,
        e.g. ``QemuDesktop.sleep_scale`` under TCG; 1 on the machines OSWorld times them for).
    """

    client_password: str = DEFAULT_CLIENT_PASSWORD
    cache: ContentCache | None = None
    work_dir: str | None = None
    chrome_port: int = 9222
    strict: bool = False
    window_wait_s: float = 5.0
    sleep_scale: float = 1.0


async def run_setup(
    client: VMClient,
    steps: Sequence[Mapping[str, Any]],
    *,
    screen_size: tuple[int, int],
    base_dir: str | None = None,
    task_id: str = "",
    options: SetupOptions | None = None,
) -> None:
    """Runs setup steps in order, as OSWorld's SetupController does; raises SetupError."""
    opts = options or SetupOptions()
    for i, step in enumerate(steps):
        t = step["type"]
        p = fill_placeholders(dict(step.get("parameters") or {}), screen_size, opts.client_password)
        fn = _STEPS.get(t)
        if fn is None:
            raise SetupError(f"unsupported setup type {t!r}; supported: {', '.join(SETUP_TYPES)}")
        try:
            await fn(_Step(client, p, opts, base_dir, task_id))
        except DownloadError:
            raise  # its message names the URL already
        except KeyError as e:
            raise SetupError(f"setup step {i} ({t}): missing parameter {e}") from e
        except (VMError, SetupError, OSError) as e:
            shown = json.dumps(p)
            if opts.client_password:
                shown = shown.replace(opts.client_password, "***")
            raise SetupError(f"setup step {i} ({t} {shown[:200]}) failed: {e}") from e


@dataclasses.dataclass
class _Step:
    client: VMClient
    p: dict[str, Any]
    opts: SetupOptions
    base_dir: str | None
    task_id: str

    @property
    def cache(self) -> ContentCache:
        return self.opts.cache or ContentCache()


async def _download(s: _Step) -> None:
    for f in s.p["files"]:
        url, path = str(f.get("url") or ""), str(f.get("path") or "")
        if not url or not path:
            raise SetupError(f"download: a file needs a url and a path, got {f}")
        names = [ContentCache.download_name(url, path), os.path.basename(path)]
        local = await s.cache.fetch(s.task_id, url, names)
        await s.client.upload(path, await asyncio.to_thread(local.read_bytes))


async def _upload_file(s: _Step) -> None:
    for f in s.p["files"]:
        local = Path(f["local_path"])
        if not local.is_absolute() and s.base_dir is not None:
            local = Path(s.base_dir) / local
        if not local.is_file():
            raise SetupError(f"upload_file: no local file {local}")
        await s.client.upload(f["path"], local.read_bytes())


async def _open(s: _Step) -> None:
    if not s.p.get("path"):
        raise SetupError("open: no path given")
    await s.client.open_file(s.p["path"])


async def _launch(s: _Step) -> None:
    if not s.p["command"]:
        raise SetupError("launch: empty command")
    await s.client.launch(s.p["command"], shell=bool(s.p.get("shell", False)))


def _until_met(until: Mapping[str, Any], r: Mapping[str, Any]) -> bool:
    """OSWorld's test: any one of returncode / stdout / stderr matching ends the wait."""
    return bool(
        ("returncode" in until and r.get("returncode") == until["returncode"])
        or ("stdout" in until and until["stdout"] in (r.get("output") or ""))
        or ("stderr" in until and until["stderr"] in (r.get("error") or ""))
    )


async def _execute(s: _Step) -> None:
    cmd, shell = s.p["command"], bool(s.p.get("shell", False))
    if not cmd:
        raise SetupError("execute: empty command")
    until = s.p.get("until") or {}
    tries = UNTIL_TRIES if until else 1
    for _ in range(tries):
        r = await s.client.execute(cmd, shell=shell)
        if r.get("status") != "success":
            raise SetupError(r.get("message") or r.get("error") or str(r))
        for key, field in (("stdout", "output"), ("stderr", "error")):
            if s.p.get(key) and s.opts.work_dir:
                Path(s.opts.work_dir, os.path.basename(s.p[key])).write_text(r.get(field) or "")
        if until:
            if _until_met(until, r):
                return
            await asyncio.sleep(0.3)
            continue
        rc = r.get("returncode", 0)
        if rc in _MISSING_PROGRAM_EXITS or (rc != 0 and s.opts.strict):
            err = (r.get("error") or "").strip()[-300:]
            raise SetupError(f"exit status {rc}: {err or '(no error output)'}")
        if rc != 0:
            log.warning("setup command %r exited %s: %s", cmd, rc, (r.get("error") or "")[-200:])
        return
    raise SetupError(f"condition {until} not met after {tries} tries")


async def _sleep(s: _Step) -> None:
    await asyncio.sleep(float(s.p["seconds"]) * s.opts.sleep_scale)


async def _window(s: _Step, close: bool) -> None:
    name = s.p["window_name"]
    fn = s.client.close_window if close else s.client.activate_window
    loop = asyncio.get_running_loop()
    deadline = loop.time() + s.opts.window_wait_s
    while True:
        try:
            await fn(name, bool(s.p.get("strict", False)), bool(s.p.get("by_class", False)))
            return
        except VMRequestError as e:  # not (yet) there: apps open their windows late
            if loop.time() >= deadline:
                verb = "close" if close else "activate"
                log.warning("setup could not %s window %r: %s", verb, name, e)
                return
        await asyncio.sleep(0.25)


async def _activate_window(s: _Step) -> None:
    await _window(s, close=False)


async def _close_window(s: _Step) -> None:
    await _window(s, close=True)


# Runs inside the VM (python3 -c): Chrome's DevTools HTTP API, no Playwright needed.
# argv: port, "open" | "close", JSON list of URLs, seconds to wait for Chrome.
_CDP_SCRIPT = r"""
import json, sys, time, urllib.parse, urllib.request
base, op, urls = "http://127.0.0.1:" + sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
def call(path, method="GET"):
    req = urllib.request.Request(base + path, method=method)
    with urllib.request.urlopen(req, timeout=30) as r:
        body = r.read()
    return json.loads(body) if body[:1] in (b"{", b"[") else body
deadline = time.time() + float(sys.argv[4])
while True:
    try:
        pages = [t for t in call("/json/list") if t.get("type") == "page"]
        break
    except OSError as e:
        if time.time() > deadline:
            sys.exit("Chrome's DevTools port %s did not answer: %s" % (base, e))
        time.sleep(0.5)
def same(a, b):
    a, b = urllib.parse.urlparse(a), urllib.parse.urlparse(b)
    return (a.netloc, a.path.rstrip("/")) == (b.netloc, b.path.rstrip("/"))
if op == "open":
    # a Chrome just launched answers DevTools before its default tab is listed (seconds later
    # on a loaded machine): wait for it (at most 20 s), so the first new tab replaces it as in
    # OSWorld; a default tab listed only after the new ones is closed at the end
    settle = min(deadline, time.time() + 20.0)
    while not pages and time.time() < settle:
        time.sleep(0.2)
        pages = [t for t in call("/json/list") if t.get("type") == "page"]
    late = not pages
    ours = set()
    for i, u in enumerate(urls):
        made = call("/json/new?" + urllib.parse.quote(u, safe=":/?&=#%+@,;~!$'()*"), "PUT")
        ours.add(made.get("id") if isinstance(made, dict) else None)
        if i == 0 and pages:  # like OSWorld: the first new tab replaces Chrome's default one
            call("/json/close/" + pages[0]["id"])
            pages = pages[1:]
    if late and urls:
        for t in call("/json/list"):
            if t.get("type") == "page" and t.get("id") not in ours:
                if t.get("url", "").startswith(("chrome://newtab", "about:blank")):
                    call("/json/close/" + t["id"])
                    break
else:
    for u in urls:
        for t in pages:
            if same(t.get("url", ""), u):
                call("/json/close/" + t["id"])
                pages.remove(t)
                break
"""


async def _cdp(s: _Step, op: str, urls: Sequence[str], wait_s: float = 60.0) -> None:
    port = str(s.opts.chrome_port)
    argv = ["python3", "-c", _CDP_SCRIPT, port, op, json.dumps(list(urls)), str(wait_s)]
    r = await s.client.execute(argv, timeout=wait_s + 60.0)
    if r.get("status") != "success" or r.get("returncode") != 0:
        err = (r.get("error") or r.get("message") or "").strip().splitlines()[-1:]
        raise SetupError(f"chrome tabs ({op}): {err[0] if err else r}")


async def _chrome_open_tabs(s: _Step) -> None:
    await _cdp(s, "open", s.p["urls_to_open"])


async def _chrome_close_tabs(s: _Step) -> None:
    await _cdp(s, "close", s.p["urls_to_close"])


def add_visits(db: Path, history: Sequence[Mapping[str, Any]]) -> None:
    """OSWorld's fake visits into Chrome's history ``db`` (timestamps: microseconds since
    1601-01-01, as Chrome keeps them)."""
    conn = sqlite3.connect(db)
    try:
        for item in history:
            t = datetime.now() - timedelta(seconds=item["visit_time_from_now_in_seconds"])
            ts = int((t - datetime(1601, 1, 1)).total_seconds() * 1_000_000)
            cur = conn.execute(
                "INSERT INTO urls (url, title, visit_count, typed_count, last_visit_time, hidden)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (item["url"], item["title"], 1, 0, ts, 0),
            )
            conn.execute(
                "INSERT INTO visits (url, visit_time, from_visit, transition, segment_id, "
                "visit_duration) VALUES (?, ?, ?, ?, ?, ?)",
                (cur.lastrowid, ts, 0, 805306368, 0, 0),
            )
        conn.commit()
    except sqlite3.Error as e:
        raise SetupError(f"update_browse_history: {db} is not a Chrome history: {e}") from e
    finally:
        conn.close()


async def _update_browse_history(s: _Step) -> None:
    empty = await s.cache.fetch(s.task_id, HISTORY_DB_URL, ["history_new.sqlite"])
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "History"
        shutil.copy(empty, db)
        add_visits(db, s.p["history"])
        await s.client.upload(CHROME_HISTORY_PATH, db.read_bytes())


async def _google(s: _Step, kind: str) -> None:
    """OSWorld's own ``googledrive`` / ``login`` code (desktop-env): Google Drive through pydrive
    on this host; the login through Playwright on the VM's Chrome DevTools port, which must
    then be reachable at the VM's address."""
    try:
        from desktop_env.controllers.setup import SetupController  # noqa: PLC0415 -- optional
    except ImportError as e:
        raise SetupError(f"{kind} needs the osworld extra (desktop-env): {e}") from e
    url = urllib.parse.urlsplit(s.client.base_url)
    ctl = SetupController(
        vm_ip=url.hostname or "127.0.0.1",
        server_port=url.port or 5000,
        chromium_port=s.opts.chrome_port,
        cache_dir=str(s.cache.task_dir(s.task_id)),
        client_password=s.opts.client_password,
    )
    params = dict(s.p)
    for r in settings_roots(s.base_dir):
        if (r / str(params.get("settings_file", ""))).is_file():
            params["settings_file"] = str(r / params["settings_file"])
            break
    try:
        await asyncio.to_thread(getattr(ctl, f"_{kind}_setup"), **params)
    except Exception as e:  # noqa: BLE001 -- OSWorld's code raises anything; a fault either way
        raise SetupError(f"{kind}: {type(e).__name__}: {e}") from e


async def _googledrive(s: _Step) -> None:
    await _google(s, "googledrive")


async def _login(s: _Step) -> None:
    await _google(s, "login")


_STEPS = {
    "download": _download,
    "upload_file": _upload_file,
    "open": _open,
    "launch": _launch,
    "execute": _execute,
    "command": _execute,
    "sleep": _sleep,
    "activate_window": _activate_window,
    "close_window": _close_window,
    "chrome_open_tabs": _chrome_open_tabs,
    "chrome_close_tabs": _chrome_close_tabs,
    "update_browse_history": _update_browse_history,
    "googledrive": _googledrive,
    "login": _login,
}
assert tuple(_STEPS) == SETUP_TYPES
