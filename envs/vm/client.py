"""Async client for the OSWorld VM server protocol (``OSWORLD_API.md``).

Speaks exactly the request/response shapes of OSWorld's ``desktop_env/server/main.py``, so the
same client drives a real OSWorld VM on port 5000 and our own ``envs.vm.server``::

    async with VMClient("http://10.0.0.7:5000") as vm:
        png = await vm.screenshot()
        out = await vm.execute(["ls", "-la", "~/"])          # {"status", "output", "error", ...}
        await vm.pyautogui("pyautogui.click(100, 200)")     # how OSWorld's client acts

Failure policy (many VMs are driven at once, so one flaky VM must not stall or crash a run):

* every call has a timeout (``timeout`` per client, overridable per call);
* connection refused, 502/503/504, and (for calls that are safe to repeat) a dropped connection,
  a timeout or a bare 500 are retried ``retries`` times with exponential ``backoff``;
* when the VM stays unreachable the call raises :class:`VMGoneError` naming the URL;
* protocol-level errors (a command that failed, a file that is not there, a bad token) are not
  retried: ``execute``-style calls return the server's JSON, the others raise
  :class:`VMRequestError` with the HTTP status and body.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

# What OSWorld's client puts in front of every pyautogui action (desktop_env/controllers/python.py).
PYAUTOGUI_PREFIX = "import pyautogui; import time; pyautogui.FAILSAFE = False; "

_RETRY_STATUSES = (502, 503, 504)


class VMError(RuntimeError):
    """Base class of the client's errors."""


class VMGoneError(VMError):
    """The VM did not answer (connection refused / reset / timeout) after all retries."""

    def __init__(self, url: str, attempts: int, cause: BaseException | str):
        self.url = url
        self.attempts = attempts
        self.cause = cause
        super().__init__(
            f"VM at {url} is unreachable after {attempts} attempt(s): {cause!r}. Check that the "
            "VM is running and its server listens there (python -m envs.vm.server, or OSWorld's "
            "server on port 5000)."
        )


class VMRequestError(VMError):
    """The server answered with an HTTP error that retrying will not fix (4xx, or a 5xx)."""

    def __init__(self, url: str, status: int, body: str):
        self.url = url
        self.status = status
        self.body = body
        hint = (
            " (wrong or missing token: pass VMClient(..., token=T); envs.vm.server prints a "
            "token it made up on stderr)"
            if status == 401
            else ""
        )
        super().__init__(f"{url} answered HTTP {status}{hint}: {body[:500]}")


class VMFileNotFoundError(VMRequestError, FileNotFoundError):
    """``download`` of a path that does not exist in the VM (HTTP 404)."""


class VMClient:
    """One VM's server at ``base_url`` (e.g. ``"http://127.0.0.1:5000"``).

    Args:
      base_url: the server's address.
      token: bearer token of our server (its ``--token``, or the one it made up and printed on
        stderr; ``LocalDesktop`` passes its own); OSWorld's own server ignores it.
      timeout: default seconds per HTTP call (a call's ``timeout=`` overrides it).
      retries: extra attempts after the first for transient failures (OSWorld tries 3 times).
      backoff: seconds before the first retry; doubles each time.
    """

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = 0.5,
    ):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(
                f"VMClient base_url must start with http:// or https://, got {base_url!r}"
            )
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        # Headers of the latest response (diagnostics: our server reports X-Handler-Seconds, the
        # time spent inside the VM; meaningful when calls on this client do not overlap).
        self.last_headers: Mapping[str, str] = {}
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"VMClient({self.base_url!r})"

    async def __aenter__(self) -> VMClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Closes the HTTP session (safe to call twice)."""
        if self._session is not None and not self._session.closed:
            if self._session_loop is asyncio.get_running_loop():
                await self._session.close()
        self._session = None

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        # A session is tied to its event loop; recreate it when called from another loop.
        if self._session is None or self._session.closed or self._session_loop is not loop:
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
            self._session = aiohttp.ClientSession(
                headers=headers, connector=aiohttp.TCPConnector(limit=16, force_close=False)
            )
            self._session_loop = loop
        return self._session

    # ------------------------------------------------------------------------- transport

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        form: dict[str, Any] | aiohttp.FormData | None = None,
        timeout: float | None = None,
        idempotent: bool = True,
        json_errors: bool = False,
    ) -> tuple[int, bytes]:
        """Sends one request with retries; returns (status, body).

        ``json_errors``: a 500 whose body is JSON is a protocol answer (e.g. a failed command),
        returned as is rather than retried or raised.
        """
        url = self.base_url + path
        attempts = self.retries + 1
        last: BaseException | str = "no attempt made"
        last_http: tuple[int, bytes] | None = None  # the last retryable HTTP error, if any
        for i in range(attempts):
            if i:
                await asyncio.sleep(self.backoff * 2 ** (i - 1))
            try:
                data = form
                if isinstance(form, dict):  # FormData is single-use: rebuild per attempt
                    data = aiohttp.FormData()
                    for k, v in form.items():
                        if isinstance(v, tuple):
                            data.add_field(k, v[1], filename=v[0])
                        else:
                            data.add_field(k, v)
                async with self._get_session().request(
                    method,
                    url,
                    json=json_body,
                    data=data,
                    timeout=aiohttp.ClientTimeout(total=timeout or self.timeout),
                ) as resp:
                    body = await resp.read()
                    status = resp.status
                    self.last_headers = resp.headers
            except aiohttp.ClientConnectorError as e:  # nothing reached the server: safe to retry
                last, last_http = e, None
                continue
            except (aiohttp.ClientError, TimeoutError) as e:
                last_http = None
                last = e if str(e) else f"{type(e).__name__} after {timeout or self.timeout:g} s"
                if idempotent:
                    continue
                raise VMGoneError(url, i + 1, last) from e
            if status < 400:
                return status, body
            if status == 500 and json_errors and _is_json(body):
                return status, body
            if status in _RETRY_STATUSES or (status == 500 and idempotent and not _is_json(body)):
                last, last_http = f"HTTP {status}: {body[:200]!r}", (status, body)
                continue
            err = VMFileNotFoundError if status == 404 else VMRequestError
            raise err(url, status, body.decode("utf-8", errors="replace"))
        if last_http is not None and isinstance(last, str):  # the server answered, badly
            raise VMRequestError(url, last_http[0], last_http[1].decode("utf-8", "replace"))
        raise VMGoneError(url, attempts, last)

    async def _json(self, method: str, path: str, **kw: Any) -> Any:
        _, body = await self._request(method, path, **kw)
        return json.loads(body)

    async def _text(self, method: str, path: str, **kw: Any) -> str:
        _, body = await self._request(method, path, **kw)
        return body.decode("utf-8", errors="replace")

    # ------------------------------------------------------------------------- screen

    async def screenshot(self, timeout: float | None = None) -> bytes:
        """PNG bytes of the whole screen, cursor drawn in."""
        _, body = await self._request("GET", "/screenshot", timeout=timeout)
        return body

    async def screen_size(self) -> tuple[int, int]:
        """(width, height) of the VM's screen in pixels."""
        d = await self._json("POST", "/screen_size")
        return int(d["width"]), int(d["height"])

    async def cursor_position(self) -> tuple[int, int]:
        """(x, y) of the mouse pointer."""
        x, y = await self._json("GET", "/cursor_position")
        return int(x), int(y)

    async def accessibility(self, timeout: float | None = None) -> str:
        """The accessibility tree as XML (``{"AT": xml}`` on the wire)."""
        return (await self._json("GET", "/accessibility", timeout=timeout))["AT"]

    async def terminal(self) -> str | None:
        """The text of the open terminal (needs AT-SPI in the VM), or None when unavailable."""
        try:
            d = await self._json("GET", "/terminal", json_errors=True)
        except VMRequestError:
            return None
        return d.get("output")

    async def platform(self) -> str:
        """The VM's OS name, e.g. ``"Linux"``."""
        return (await self._text("GET", "/platform")).strip()

    async def ping(self, timeout: float = 5.0) -> bool:
        """True when the server answers /platform (one attempt, no retries)."""
        try:
            async with self._get_session().get(
                self.base_url + "/platform", timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def wait_ready(self, timeout: float = 30.0, interval: float = 0.1) -> None:
        """Polls until the server answers; raises VMGoneError after ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            if await self.ping(timeout=min(5.0, timeout)):
                return
            await asyncio.sleep(interval)
        raise VMGoneError(self.base_url, 0, f"server not ready within {timeout:g} s")

    # ------------------------------------------------------------------------- commands

    async def execute(
        self, command: str | Sequence[str], shell: bool = False, timeout: float | None = None
    ) -> dict[str, Any]:
        """Runs a command to completion: ``{"status", "output", "error", "returncode"}``.

        A failed or timed-out command comes back as ``{"status": "error", "message", ...}``
        (``"timed_out": True`` from our server), not as an exception. ``timeout`` is the command's
        run-time limit in the VM (the server caps it); the HTTP call waits a little longer.
        Not retried after the request reached the server (a command may not be idempotent).
        """
        body: dict[str, Any] = {
            "command": command if isinstance(command, str) else list(command),
            "shell": shell,
        }
        if timeout is not None:
            body["timeout"] = timeout
        _, raw = await self._request(
            "POST",
            "/execute",
            json_body=body,
            timeout=(timeout or 120.0) + 15.0,
            idempotent=False,
            json_errors=True,
        )
        return json.loads(raw)

    async def pyautogui(self, code: str, timeout: float | None = None) -> dict[str, Any]:
        """Runs pyautogui ``code`` in the VM exactly as OSWorld's client does."""
        return await self.execute(["python", "-c", PYAUTOGUI_PREFIX + code], timeout=timeout)

    async def launch(self, command: str | Sequence[str], shell: bool = False) -> str:
        """Starts a program and returns at once (``/setup/launch``)."""
        body = {"command": command if isinstance(command, str) else list(command), "shell": shell}
        return await self._text("POST", "/setup/launch", json_body=body, idempotent=False)

    async def run_python(self, code: str) -> dict[str, Any]:
        """Runs a Python script in the VM (30 s): ``{"status", "message", "output", "error",
        "return_code"}``."""
        _, raw = await self._request(
            "POST",
            "/run_python",
            json_body={"code": code},
            timeout=60.0,
            idempotent=False,
            json_errors=True,
        )
        return json.loads(raw)

    async def run_bash_script(
        self, script: str, timeout: float = 100.0, working_dir: str | None = None
    ) -> dict[str, Any]:
        """Runs a bash script: ``{"status", "output" (stdout+stderr), "error", "returncode"}``."""
        body = {"script": script, "timeout": timeout, "working_dir": working_dir}
        _, raw = await self._request(
            "POST",
            "/run_bash_script",
            json_body=body,
            timeout=timeout + 15.0,
            idempotent=False,
            json_errors=True,
        )
        return json.loads(raw)

    # ------------------------------------------------------------------------- files

    async def upload(self, path: str, data: bytes) -> str:
        """Writes ``data`` to ``path`` in the VM (``/setup/upload``, multipart)."""
        form = {"file_path": path, "file_data": ("file", data)}
        return await self._text("POST", "/setup/upload", form=form, timeout=max(self.timeout, 300))

    async def download(self, path: str) -> bytes:
        """The bytes of ``path`` in the VM (``/file``); VMFileNotFoundError when missing."""
        _, body = await self._request(
            "POST", "/file", form={"file_path": path}, timeout=max(self.timeout, 300)
        )
        return body

    async def list_directory(self, path: str) -> dict[str, Any]:
        """``{"type", "name", "children"}`` tree under ``path``."""
        return (await self._json("POST", "/list_directory", json_body={"path": path}))[
            "directory_tree"
        ]

    async def desktop_path(self) -> str:
        return (await self._json("POST", "/desktop_path"))["desktop_path"]

    async def open_file(self, path: str) -> str:
        """Opens ``path`` with its default application and waits for its window."""
        return await self._text(
            "POST", "/setup/open_file", json_body={"path": path}, idempotent=False, timeout=120.0
        )

    # ------------------------------------------------------------------------- windows

    async def window_size(self, app_class: str) -> tuple[int, int]:
        """(width, height) of the first window whose class contains ``app_class``."""
        d = await self._json("POST", "/window_size", form={"app_class_name": app_class})
        return int(d["width"]), int(d["height"])

    async def activate_window(
        self, window_name: str, strict: bool = False, by_class: bool = False
    ) -> str:
        body = {"window_name": window_name, "strict": strict, "by_class": by_class}
        return await self._text("POST", "/setup/activate_window", json_body=body)

    async def close_window(
        self, window_name: str, strict: bool = False, by_class: bool = False
    ) -> str:
        body = {"window_name": window_name, "strict": strict, "by_class": by_class}
        return await self._text("POST", "/setup/close_window", json_body=body, idempotent=False)

    # ------------------------------------------------------------------------- recording

    async def start_recording(self) -> dict[str, Any]:
        return await self._json("POST", "/start_recording", idempotent=False)

    async def end_recording(self) -> bytes:
        """The recorded mp4 bytes."""
        _, body = await self._request("POST", "/end_recording", idempotent=False, timeout=120.0)
        return body


def _is_json(body: bytes) -> bool:
    try:
        json.loads(body)
    except ValueError:
        return False
    return True
