"""Serves the envs' own pages from memory through Playwright request routing; blocks the rest.

Every page an env shows lives under the fake origin ``http://cua.local`` and is answered by
``route.fulfill`` from files on disk (cached in memory), so no HTTP server runs and no request
ever leaves the machine. Any other URL (a model typing a web address, a script fetching a CDN)
is aborted: that is the network isolation.

Paths:
  /builtin/<file>   the built-in task suite (envs/browser/static/)
  /miniwob/<path>   the `miniwob` package's html/ directory (core/, miniwob/, common/ ...)
  /inline/<key>     HTML registered at run time with ``register_inline`` (custom tasks, tests),
                    held while an env shows it and freed by ``release_inline`` (a host that
                    resets envs onto new inline pages for days must not keep every page)
"""

from __future__ import annotations

import logging
import mimetypes
import pathlib
import threading
import urllib.parse

from playwright.async_api import Route

log = logging.getLogger(__name__)

ORIGIN = "http://cua.local"
STATIC_DIR = pathlib.Path(__file__).parent / "static"


def miniwob_html_dir() -> pathlib.Path:
    """The html/ directory shipped inside the `miniwob` PyPI package."""
    try:
        import miniwob  # noqa: PLC0415 -- optional until a MiniWoB task is run
    except ImportError as e:
        raise ImportError(
            "MiniWoB++ tasks need the `miniwob` package (pip install miniwob; it is in "
            "pyproject.toml)"
        ) from e
    d = pathlib.Path(miniwob.__file__).parent / "html"
    if not (d / "miniwob").is_dir():
        raise FileNotFoundError(f"the miniwob package at {d.parent} ships no html/miniwob/")
    return d


_cache: dict[str, tuple[bytes, str] | None] = {}
_inline: dict[str, str] = {}
_inline_refs: dict[str, int] = {}  # how many holders each inline page has
_lock = threading.Lock()


def register_inline(key: str, html: str) -> str:
    """Serve ``html`` at ``/inline/<key>`` until as many ``release_inline(key)`` calls as
    ``register_inline(key, ...)`` calls were made; returns the full URL."""
    with _lock:
        _inline[key] = html
        _inline_refs[key] = _inline_refs.get(key, 0) + 1
    return f"{ORIGIN}/inline/{urllib.parse.quote(key)}"


def release_inline(key: str) -> None:
    """One holder of ``/inline/<key>`` is done with it; the last one frees the page."""
    with _lock:
        n = _inline_refs.get(key, 0) - 1
        if n > 0:
            _inline_refs[key] = n
        else:
            _inline_refs.pop(key, None)
            _inline.pop(key, None)


def inline_pages() -> int:
    """How many inline pages are held (tests: a host's memory does not grow over resets)."""
    return len(_inline)


def _resolve(path: str) -> pathlib.Path | None:
    """URL path -> a file inside one of the served roots (None for anything else)."""
    for prefix, root_fn in (("/builtin/", lambda: STATIC_DIR), ("/miniwob/", miniwob_html_dir)):
        if path.startswith(prefix):
            root = root_fn().resolve()
            f = (root / path[len(prefix) :]).resolve()
            # No escaping the root with ../ tricks.
            return f if f.is_file() and root in f.parents else None
    return None


def lookup(url: str) -> tuple[bytes, str] | None:
    """(body, content type) for one of our URLs, or None (-> 404)."""
    parsed = urllib.parse.urlsplit(url)
    path = urllib.parse.unquote(parsed.path)
    if path.startswith("/inline/"):
        html = _inline.get(path[len("/inline/") :])
        return None if html is None else (html.encode(), "text/html; charset=utf-8")
    if path in _cache:
        return _cache[path]
    f = _resolve(path)
    item = None
    if f is not None:
        ctype = mimetypes.guess_type(f.name)[0] or "application/octet-stream"
        if ctype.startswith("text/") or ctype.endswith("javascript"):
            ctype += "; charset=utf-8"
        item = (f.read_bytes(), ctype)
    with _lock:
        _cache[path] = item
    return item


async def handle_route(route: Route) -> None:
    """The context-wide route handler: fulfil our origin, abort everything else."""
    url = route.request.url
    try:
        if not url.startswith(ORIGIN + "/"):
            await route.abort("blockedbyclient")
            return
        item = lookup(url)
        if item is None:
            await route.fulfill(status=404, body=f"not found: {url}", content_type="text/plain")
            return
        body, ctype = item
        await route.fulfill(status=200, body=body, content_type=ctype)
    except Exception as e:  # noqa: BLE001 -- the page/context may be closing under us
        log.debug("route %s failed: %s", url, e)
