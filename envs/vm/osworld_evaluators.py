"""OSWorld's own getters and metrics (its PyPI package ``desktop-env``) for what the built-in
subset of ``envs.vm.osworld`` lacks, called against our VM client.

Installed by the ``osworld`` extra, desktop-env without its pins (README, "VM environments",
says why this route and what it costs)::

    pip install -e '.[osworld]' && pip install --no-deps desktop-env==1.0.2

A task loads when each getter and metric it names is built in or in the installed desktop-env
(:func:`catalog` reads desktop-env's ``__init__`` files, so loading imports nothing heavy); the
first evaluation that needs desktop-env imports its evaluators (torch through easyocr: seconds,
once per process). Its getters take OSWorld's ``DesktopEnv``; they get a stand-in
(:class:`_EnvShim`) with desktop-env's own ``PythonController`` pointed at the VM. desktop-env
calls the VM with ``requests`` and no token, so for a server that wants one (``LocalDesktop``'s,
``--token``) the calls go through a loopback relay that adds it; a getter that drives Chrome over
its DevTools port (``env.chromium_port``) then reaches that port on this machine.

Getters and metrics run in worker threads: the event loop and other episodes go on meanwhile.
A getter that raises ``FileNotFoundError`` scores 0, as in OSWorld's ``DesktopEnv.evaluate``;
any other exception of desktop-env's code, or one that outlasts ``timeout_s``, is an
:class:`EvaluatorError`, an infrastructure fault of the episode (OSWorld's run gives such an
example no result either).
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import functools
import importlib.metadata
import importlib.util
import logging
import threading
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from envs.vm.client import VMClient
from envs.vm.osworld_setup import SetupError

log = logging.getLogger(__name__)

DESKTOP_ENV_VERSION = "1.0.2"  # the release the extra was measured with
INSTALL_HINT = (
    f"pip install -e '.[osworld]' && pip install --no-deps desktop-env=={DESKTOP_ENV_VERSION}"
)
# What desktop-env's evaluators import beyond our own dependencies (the ``osworld`` extra):
# module -> distribution. Its ``metrics`` package imports every one of them when it loads.
EVALUATOR_MODULES = {
    "pandas": "pandas",
    "openpyxl": "openpyxl",
    "docx": "python-docx",
    "pptx": "python-pptx",
    "odf": "odfpy",
    "pypdf": "pypdf",
    "PyPDF2": "PyPDF2",
    "pdfplumber": "pdfplumber",
    "fitz": "pymupdf",
    "borb": "borb",
    "bs4": "beautifulsoup4",
    "lxml": "lxml",
    "cssselect": "cssselect",
    "xmltodict": "xmltodict",
    "rapidfuzz": "rapidfuzz",
    "formulas": "formulas",
    "tldextract": "tldextract",
    "pytz": "pytz",
    "requests": "requests",
    "imagehash": "ImageHash",
    "skimage": "scikit-image",
    "cv2": "opencv-python-headless",
    "librosa": "librosa",
    "fastdtw": "fastdtw",
    "acoustid": "pyacoustid",
    "mutagen": "mutagen",
    "easyocr": "easyocr",
    "pydrive": "pydrive",
}
VLC_PORT = 8080  # OSWorld's VLC web interface port (its DesktopEnv's default)
_CONTROLLER_RETRY_S = 1.0  # desktop-env's controller waits 5 s between tries; ours retry already


class EvaluatorError(SetupError):
    """desktop-env's getter or metric failed (or never returned): an infrastructure fault."""


@dataclasses.dataclass(frozen=True)
class Catalog:
    """The getters and metrics of the installed desktop-env (read from its source, not imported).

    Attributes:
      version: its distribution version ("unknown" for a source checkout on ``sys.path``).
      where: the directory it is installed in.
      metrics: metric names (``evaluator.func`` values).
      getters: getter types (``evaluator.result.type``; desktop-env's ``get_<type>``).
    """

    version: str
    where: str
    metrics: frozenset[str]
    getters: frozenset[str]


def _exported(init: Path) -> frozenset[str]:
    """Names a package ``__init__`` binds: its ``from .x import a, b`` and its own ``def``s."""
    names: set[str] = set()
    for node in ast.parse(init.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.FunctionDef):
            names.add(node.name)
    return frozenset(names)


def missing_modules() -> list[str]:
    """The distributions of the extra whose modules cannot be found (nothing is imported)."""
    return [d for mod, d in EVALUATOR_MODULES.items() if importlib.util.find_spec(mod) is None]


@functools.cache
def catalog() -> Catalog | None:
    """The installed desktop-env's getters and metrics, or None when it or a module its
    evaluators import is missing (:func:`unavailable` says which)."""
    return None if unavailable() else _read_catalog()


@functools.cache
def unavailable() -> str | None:
    """None when desktop-env's evaluators can run here, else one line saying what is missing
    and the command that installs it."""
    spec = importlib.util.find_spec("desktop_env")
    if spec is None or not spec.submodule_search_locations:
        return f"desktop-env is not installed: {INSTALL_HINT}"
    missing = missing_modules()
    if missing:
        return f"desktop-env's evaluators need {', '.join(missing)}: {INSTALL_HINT}"
    try:
        _read_catalog()
    except (OSError, SyntaxError) as e:
        return f"cannot read desktop-env's evaluators ({e}): reinstall it: {INSTALL_HINT}"
    return None


@functools.cache
def _read_catalog() -> Catalog:
    spec = importlib.util.find_spec("desktop_env")
    assert spec is not None and spec.submodule_search_locations
    root = Path(next(iter(spec.submodule_search_locations))) / "evaluators"
    try:
        version = importlib.metadata.version("desktop-env")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    getters = _exported(root / "getters" / "__init__.py")
    return Catalog(
        version=version,
        where=str(root.parent),
        metrics=_exported(root / "metrics" / "__init__.py"),
        getters=frozenset(n.removeprefix("get_") for n in getters if n.startswith("get_")),
    )


def missing_reason(kind: str, name: str) -> str:
    """Why a ``kind`` ("metric" | "getter") ``name`` outside the built-in subset cannot run: the
    extra to install, or that the installed desktop-env lacks it."""
    why = unavailable()
    if why is not None:
        return f"OSWorld's own {kind}s need the osworld extra; {why}"
    cat = catalog()
    assert cat is not None
    return (
        f"desktop-env {cat.version} ({cat.where}) has no {kind} {name!r} either: the task needs "
        "a newer OSWorld (pip install --no-deps OSWORLD_CHECKOUT, the checkout its task files "
        "come from)"
    )


def has(kind: str, name: str) -> bool:
    """Whether the installed desktop-env (with the extra) provides this metric or getter."""
    cat = catalog()
    if cat is None:
        return False
    return name in (cat.metrics if kind == "metric" else cat.getters)


_import_lock = threading.Lock()


def _modules() -> tuple[Any, Any]:
    """desktop-env's ``metrics`` and ``getters`` modules, imported once (a thread may block
    here for the first import's seconds)."""
    with _import_lock:
        try:
            from desktop_env.evaluators import getters, metrics  # noqa: PLC0415 -- optional
        except ImportError as e:
            why = f"cannot import desktop-env's evaluators ({e})"
            raise EvaluatorError(f"{why}: {INSTALL_HINT}") from e
    return metrics, getters


# ----------------------------------------------------------------------------- the VM's side


class _Relay:
    """A loopback HTTP server that forwards every request to ``client``'s server with its bearer
    token: desktop-env's controller sends none."""

    def __init__(self, client: VMClient):
        self._base = client.base_url
        self._headers = {"Authorization": f"Bearer {client.token}"}
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.port = 0

    async def start(self) -> None:
        app = web.Application(client_max_size=1 << 31)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self._session = aiohttp.ClientSession(
            headers=self._headers, timeout=aiohttp.ClientTimeout(total=600)
        )

    async def _forward(self, request: web.Request) -> web.Response:
        assert self._session is not None
        body = await request.read()
        ctype = request.headers.get("Content-Type")
        try:
            async with self._session.request(
                request.method,
                self._base + request.path_qs,
                data=body,
                headers={"Content-Type": ctype} if ctype else None,
            ) as r:
                data = await r.read()
                out_type = r.headers.get("Content-Type", "application/octet-stream")
                return web.Response(body=data, status=r.status, headers={"Content-Type": out_type})
        except (aiohttp.ClientError, TimeoutError) as e:
            return web.Response(status=502, text=f"relay to {self._base}: {e}")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()


class _EnvShim:
    """What desktop-env's getters read of its ``DesktopEnv``: the VM's address and ports, its
    platform, ``controller`` (desktop-env's own ``PythonController``) and ``cache_dir``."""

    def __init__(self, host: str, port: int, platform: str, chromium_port: int, cache_dir: str):
        from desktop_env.controllers.python import PythonController  # noqa: PLC0415 -- optional

        self.vm_ip = host
        self.server_port = port
        self.chromium_port = chromium_port
        self.vlc_port = VLC_PORT
        self.vm_platform = platform
        self.cache_dir = cache_dir
        self.current_use_proxy = False
        self.enable_proxy = False
        self.controller = PythonController(vm_ip=host, server_port=port)
        self.controller.retry_interval = _CONTROLLER_RETRY_S


class FileMissing:
    """A result getter raised FileNotFoundError: OSWorld scores the metric 0."""

    def __repr__(self) -> str:
        return "FileMissing()"


FILE_MISSING = FileMissing()


class DesktopEnvBridge:
    """desktop-env's getters and metrics for one evaluation against ``client``.

    ``async with DesktopEnvBridge(client) as b: await b.get(cfg, cache_dir)`` fetches a value
    with desktop-env's ``get_<type>``; ``await b.metric(name, *args, **options)`` scores.

    Args:
      client: the VM's client (its base URL and token).
      chromium_port: Chrome's DevTools port in the VM (OSWorld's VMs: 9222).
      timeout_s: how long one getter or metric may take.
    """

    def __init__(self, client: VMClient, *, chromium_port: int = 9222, timeout_s: float = 600.0):
        self.client = client
        self.chromium_port = chromium_port
        self.timeout_s = timeout_s
        self._relay: _Relay | None = None
        self._platform: str | None = None

    async def __aenter__(self) -> DesktopEnvBridge:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._relay is not None:
            await self._relay.close()
            self._relay = None

    async def _address(self) -> tuple[str, int]:
        if self.client.token:
            if self._relay is None:
                self._relay = _Relay(self.client)
                await self._relay.start()
            return "127.0.0.1", self._relay.port
        u = urllib.parse.urlsplit(self.client.base_url)
        return u.hostname or "127.0.0.1", u.port or (443 if u.scheme == "https" else 80)

    async def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await asyncio.wait_for(asyncio.to_thread(fn, *args, **kwargs), self.timeout_s)
        except TimeoutError as e:
            raise EvaluatorError(f"desktop-env's {what} outlasted {self.timeout_s:g} s") from e

    async def get(self, cfg: Mapping[str, Any], cache_dir: Path) -> Any:
        """desktop-env's ``get_<type>(env, cfg)``; :data:`FILE_MISSING` when it raised
        FileNotFoundError."""
        what = f"getter {cfg['type']}"
        metrics, getters = await self._call("evaluators' import", _modules)
        fn = getattr(getters, f"get_{cfg['type']}", None)
        if fn is None:
            raise EvaluatorError(f"desktop-env has no {what}")
        if self._platform is None:
            self._platform = await self.client.platform()
        host, port = await self._address()
        env = _EnvShim(host, port, self._platform, self.chromium_port, str(cache_dir))
        try:
            return await self._call(what, fn, env, dict(cfg))
        except FileNotFoundError:
            return FILE_MISSING
        except EvaluatorError:
            raise
        except Exception as e:  # noqa: BLE001 -- desktop-env raises anything; a fault either way
            raise EvaluatorError(f"desktop-env's {what} failed: {type(e).__name__}: {e}") from e

    async def metric(self, name: str, *args: Any, **options: Any) -> float:
        """desktop-env's metric ``name`` on the fetched values."""
        metrics, _ = await self._call("evaluators' import", _modules)
        fn = getattr(metrics, name, None)
        if fn is None:
            raise EvaluatorError(f"desktop-env has no metric {name!r}")
        try:
            s = await self._call(f"metric {name}", fn, *args, **options)
        except EvaluatorError:
            raise
        except Exception as e:  # noqa: BLE001 -- as above
            why = f"{type(e).__name__}: {e}"
            raise EvaluatorError(f"desktop-env's metric {name} failed: {why}") from e
        try:
            return float(s)
        except (TypeError, ValueError) as e:
            raise EvaluatorError(f"desktop-env's metric {name} returned {s!r}, not a number") from e
