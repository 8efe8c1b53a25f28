"""Browser envs on another machine: the wire format of ``envs.browser.server`` and its client.

``RemoteBrowserEnv`` implements :class:`cua_jax.env_api.Env` over HTTP against a browser host
(``python -m envs.browser.server``): each env is a *lease* on one of the host's browser
contexts; every call renews the lease, and a lease nobody renews within its time-out is
reclaimed by the host. The pages (built-in suite, MiniWoB++, inline HTML) are served by the
host's own Chromium from the host's memory, so nothing reaches the network on either side.

A host that stops answering is an infrastructure fault, never a policy failure: ``reset`` and
``evaluate`` raise :class:`EnvError`, ``step`` ends the episode with ``info["error"]``, and the
``on_fault`` callback tells the fleet (``envs.fleet``) to take the host out until its health
check answers again.

Wire format: requests are JSON (``Authorization: Bearer T``); an observation comes back as
``application/x-cua-obs``: 4 bytes big-endian header length, the JSON header, then the encoded
screenshot (PNG or JPEG, as the host's Chromium produced it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import io
import json
import os
import struct
import threading
from collections.abc import Callable
from typing import Any

import aiohttp
import numpy as np
from yarl import URL

from cua_jax import actions as A
from cua_jax.env_api import (
    INFO_DONE_REASON,
    INFO_ERROR,
    EnvError,
    Observation,
    StepResult,
    Task,
)
from envs.screenshots import FRAME_MAGIC, decode_screenshot, encode_frame
from envs.tasks import check_task_fields

OBS_CONTENT_TYPE = "application/x-cua-obs"
PROTOCOL_VERSION = 1


_decoder: concurrent.futures.ThreadPoolExecutor | None = None
_decoder_lock = threading.Lock()


def decode_executor() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that decode remote screenshots, one process-wide pool: a few threads
    (a quarter of the cores, 1 to 4), not the event loop's default executor (up to 32). PNG
    decoding releases the GIL, but more threads than cores add GIL hand-offs and wake-ups: at
    40 decodes in flight on this 2-core machine a 640x480 screen took 0.50 ms of CPU on the
    default executor's 6 threads, 0.30 ms on one thread, 0.22 ms inline (tools/bench_fleet.py,
    BENCHMARKS). Off the loop, so a 1280x720 screen's few ms of decode do not stall the
    episodes' HTTP calls."""
    global _decoder
    with _decoder_lock:
        if _decoder is None:
            n = max(1, min(4, (os.cpu_count() or 1) // 4))
            _decoder = concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="cua-decode")
        return _decoder


async def _off_loop(fn: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(decode_executor(), fn, *args)


async def _decoded(fn: Callable[..., Any], header: dict[str, Any], image: bytes) -> Any:
    """`fn(header, image)`: a frame inline on the loop, a PNG on the decode executor. A frame
    decodes in 0.05-0.17 ms (640x480 to 1280x720 browser screens), less than the hand-off to a
    thread and back costs: 0.11 against 0.19 ms of CPU a frame (`tools/bench_decode.py`)."""
    if image[:4] == FRAME_MAGIC:
        return fn(header, image)
    return await _off_loop(fn, header, image)


def pack_obs(header: dict[str, Any], image: bytes) -> bytes:
    """A header (JSON) and an encoded screenshot as one body."""
    h = json.dumps(header, default=_jsonable).encode()
    return struct.pack(">I", len(h)) + h + image


def unpack_obs(body: bytes) -> tuple[dict[str, Any], bytes]:
    """``pack_obs``'s inverse; ValueError for a truncated or malformed body."""
    if len(body) < 4:
        raise ValueError("observation body shorter than its 4-byte header length")
    (n,) = struct.unpack(">I", body[:4])
    if 4 + n > len(body):
        raise ValueError(f"observation header of {n} bytes in a {len(body)}-byte body")
    header = json.loads(body[4 : 4 + n])
    if not isinstance(header, dict):
        raise ValueError("observation header is not a JSON object")
    return header, body[4 + n :]


def encode_png(img: np.ndarray) -> bytes:
    from PIL import Image  # noqa: PLC0415

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


# How a host's observations carry the screen (the lease's "screens"): the browser's PNG, or a
# frame (`envs.screenshots.encode_frame`), which the trainer decodes in a quarter to a half of
# the CPU
SCREEN_FORMATS = ("png", "frame")


def screen_frame(screen: bytes | np.ndarray) -> bytes:
    """A screen (encoded image bytes, or u8[H, W, 3]) as a frame."""
    if isinstance(screen, bytes | bytearray | memoryview):
        screen = decode_screenshot(bytes(screen))
    return encode_frame(screen)


def _jsonable(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, tuple | set):
        return list(v)
    return repr(v)


def task_from_dict(d: dict[str, Any]) -> Task:
    """A Task from ``Task.to_dict()``; ``TaskSourceError`` (a ValueError) naming an unknown or
    missing field, or one of the wrong JSON type."""
    check_task_fields(d)
    return Task(**d)


class HostUnavailable(EnvError):
    """The browser host did not answer (connection refused/reset, time-out, 5xx, lease lost)."""


class RemoteBrowserEnv:
    """One env leased from a browser host (``envs.browser.server``).

    Args:
      endpoint: ``host:port`` (or ``http://host:port``) of the browser host.
      token: its bearer token (None for a ``--no-token`` host).
      viewport: (width, height) of the screen.
      session: a shared ``aiohttp.ClientSession`` (one per host is plenty); made when None.
      timeout_s: the longest one call may take (a reset loads a page; a step waits for it).
      on_fault: called with (endpoint, reason) when the host fails to answer.
      screens: how the host sends screens, "frame" (`envs.screenshots.encode_frame`: a quarter
        to a half of a PNG's decode CPU here) or "png"; a host that predates frames sends PNGs,
        which decode all the same.
    """

    def __init__(
        self,
        endpoint: str,
        token: str | None = None,
        viewport: tuple[int, int] = (1280, 720),
        *,
        session: aiohttp.ClientSession | None = None,
        timeout_s: float = 60.0,
        on_fault: Callable[[str, str], None] | None = None,
        screens: str = "frame",
    ):
        if screens not in SCREEN_FORMATS:
            raise ValueError(f"screens={screens!r} is not one of {SCREEN_FORMATS}")
        self.screens = screens
        self.endpoint = endpoint
        self.base_url = endpoint if "://" in endpoint else f"http://{endpoint}"
        self.token = token
        self.viewport = viewport
        self.timeout_s = timeout_s
        self.on_fault = on_fault
        self._session = session
        self._own_session = session is None
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._lease: str | None = None
        self.lease_s = 120.0  # how long the host keeps a lease nobody renews (its answer)
        self._urls: dict[str, URL] = {}  # path -> URL, parsed once (aiohttp takes a URL as is)
        self._last_obs: Observation | None = None
        self._instruction = ""

    # ------------------------------------------------------------------------------- HTTP

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def _url(self, path: str) -> URL:
        url = self._urls.get(path)
        if url is None:
            if len(self._urls) > 16:  # paths name the lease: a new lease, new paths
                self._urls.clear()
            url = self._urls[path] = URL(self.base_url + path)
        return url

    async def _post(self, path: str, body: dict[str, Any] | None = None) -> tuple[int, bytes, str]:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        try:
            async with self._session.post(
                self._url(path),
                json=body or {},
                headers=self._headers(),
                timeout=self._timeout,
            ) as r:
                return r.status, await r.read(), r.content_type
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            reason = f"browser host {self.endpoint} did not answer {path}: {type(e).__name__}: {e}"
            self._fault(reason)
            raise HostUnavailable(reason) from e

    def _fault(self, reason: str) -> None:
        if self.on_fault is not None:
            self.on_fault(self.endpoint, reason)

    def _fail(self, path: str, status: int, body: bytes) -> EnvError:
        """The error for a non-200 answer: the host's own message; 5xx and a lost lease are the
        host's fault (HostUnavailable), 4xx the request's (EnvError)."""
        try:
            msg = json.loads(body).get("message", "")
        except (ValueError, AttributeError):
            msg = body[:300].decode("utf-8", "replace")
        reason = f"browser host {self.endpoint} {path}: HTTP {status}: {msg}"
        if status >= 500 or status in (401, 403, 404):
            if status != 503:  # 503: the host is full, not broken
                self._fault(reason)
            return HostUnavailable(reason)
        return EnvError(reason)

    async def lease(self) -> None:
        """Takes an env on the host (``HostUnavailable`` when it is full or down)."""
        status, body, _ = await self._post(
            "/envs", {"viewport": list(self.viewport), "screens": self.screens}
        )
        if status != 200:
            raise self._fail("/envs", status, body)
        answer = json.loads(body)
        self._lease = answer["env"]
        self.lease_s = float(answer.get("lease_s", self.lease_s))

    @property
    def leased(self) -> bool:
        """The env holds a lease on its host (taken, and neither closed nor given up)."""
        return self._lease is not None

    def end_episode(self) -> None:
        """Forgets the episode (its last screen and instruction) but keeps the lease: the
        fleet hands the env to the next episode, whose ``reset`` starts it afresh, without a
        new lease and a close (two calls an episode, `envs.fleet`)."""
        self._last_obs, self._instruction = None, ""

    def _obs(self, header: dict[str, Any], image: bytes) -> Observation:
        return Observation(
            decode_screenshot(image),
            header.get("instruction", self._instruction),
            header.get("text"),
            dict(header.get("info") or {}),
        )

    # ------------------------------------------------------------------------------- Env

    async def __aenter__(self) -> RemoteBrowserEnv:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def reset(self, task: Task, seed: int | None = None) -> Observation:
        if self._lease is None:
            await self.lease()
        path = f"/envs/{self._lease}/reset"
        status, body, ctype = await self._post(path, {"task": task.to_dict(), "seed": seed})
        if status != 200 or ctype != OBS_CONTENT_TYPE:
            raise self._fail(path, status, body)
        header, image = unpack_obs(body)
        self._instruction = header.get("instruction", "")
        self._last_obs = await _decoded(self._obs, header, image)
        return self._last_obs

    async def step(self, action: A.Action) -> StepResult:
        if self._lease is None or self._last_obs is None:
            obs = self._last_obs or self._blank()
            info = {INFO_ERROR: "no episode is running; call reset()", INFO_DONE_REASON: "error"}
            return StepResult(obs, True, 0.0, info)
        path = f"/envs/{self._lease}/step"
        try:
            status, body, ctype = await self._post(path, {"action": A.action_to_dict(action)})
            if status != 200 or ctype != OBS_CONTENT_TYPE:
                raise self._fail(path, status, body)
            header, image = unpack_obs(body)
            obs = await _decoded(self._obs, header, image)
        except (EnvError, ValueError) as e:
            info = {INFO_ERROR: str(e), INFO_DONE_REASON: "error"}
            return StepResult(self._last_obs, True, 0.0, info)
        self._last_obs = obs
        return StepResult(obs, bool(header["done"]), float(header["reward"]), header["info"])

    async def evaluate(self) -> float:
        if self._lease is None:
            raise EnvError("RemoteBrowserEnv.evaluate(): no episode; call reset() first")
        path = f"/envs/{self._lease}/evaluate"
        status, body, _ = await self._post(path)
        if status != 200:
            raise self._fail(path, status, body)
        return float(json.loads(body)["score"])

    async def oracle_next(self) -> A.Action:
        if self._lease is None:
            raise RuntimeError("call reset() before oracle_next()")
        path = f"/envs/{self._lease}/oracle_next"
        status, body, _ = await self._post(path)
        if status == 501:
            raise NotImplementedError(json.loads(body).get("message", "no oracle"))
        if status != 200:
            raise self._fail(path, status, body)
        return A.action_from_dict(json.loads(body)["action"])

    async def close(self) -> None:
        """Gives the lease back (best effort: a dead host reclaims it by time-out)."""
        lease, self._lease = self._lease, None
        if lease is not None and self._session is not None and not self._session.closed:
            try:
                async with self._session.post(
                    f"{self.base_url}/envs/{lease}/close",
                    json={},
                    headers=self._headers(),
                    timeout=aiohttp.ClientTimeout(total=5),
                ):
                    pass
            except (aiohttp.ClientError, TimeoutError, OSError):
                pass
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    def _blank(self) -> Observation:
        w, h = self.viewport
        return Observation(np.zeros((h, w, 3), np.uint8), self._instruction)


async def host_health(
    session: aiohttp.ClientSession, endpoint: str, token: str | None, timeout_s: float = 5.0
) -> dict[str, Any]:
    """The host's ``/health`` (capacity, free, leases); raises HostUnavailable if it is down."""
    base = endpoint if "://" in endpoint else f"http://{endpoint}"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        async with session.get(
            base + "/health", headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as r:
            body = await r.read()
            if r.status != 200:  # 503 names why (a wedged browser)
                why = body[:300].decode(errors="replace")
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    why = json.loads(body)["message"]
                raise HostUnavailable(f"browser host {endpoint} /health: HTTP {r.status}: {why}")
            return json.loads(body)
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
        raise HostUnavailable(f"browser host {endpoint} /health: {type(e).__name__}: {e}") from e
