"""The HTTP guard of ``envs.vm.server``: who may call it and how big a request may be.

The server runs any command it is sent, so every request passes these checks (in this order)
before its handler runs:

1. Browsers (403): a web page open in a browser on the same machine can send requests to a
   loopback server. A request is refused when its ``Host`` is not loopback / the server's own
   host (DNS rebinding), when it carries an ``Origin`` other than the server's own, or when
   ``Sec-Fetch-Site`` says another site sent it. Programs (our client, OSWorld's) send neither
   ``Origin`` nor ``Sec-Fetch-Site``.
2. Token (401): with a token set, ``Authorization: Bearer <token>`` must match (constant time).
3. Size (413): each route has a body cap (``Route.max_bytes``); a ``Content-Length`` over it is
   refused before any byte of the body is read, and a chunked body is cut off at the cap.
4. Content type (415): routes that take JSON require ``Content-Type: application/json`` (which a
   browser cannot send cross-origin without a CORS preflight, and the server answers none);
   routes that take a form require a form type.
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from aiohttp import web
from yarl import URL

from cua_jax.hosts import is_loopback  # re-exported: envs.vm.server and envs.browser.server use it

KiB, MiB, GiB = 1024, 1024**2, 1024**3
SMALL_MAX_BYTES = 64 * KiB  # bodiless routes and small JSON/form arguments (a path, a name)
COMMAND_MAX_BYTES = 4 * MiB  # /execute, /setup/launch: Linux caps a command line at 2 MiB
SCRIPT_MAX_BYTES = 16 * MiB  # /run_python, /run_bash_script: the script goes to a file
UPLOAD_MAX_BYTES = 1 * GiB  # /setup/upload default (--max-upload-bytes); spooled to disk

NONE, JSON, FORM = "none", "json", "form"
FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclasses.dataclass(frozen=True)
class Route:
    """One endpoint: ``body`` is what it reads (NONE, JSON or FORM), ``max_bytes`` its body cap
    (None: the server's upload cap)."""

    method: str
    path: str
    handler: str  # the name of the VMServer method
    body: str = NONE
    max_bytes: int | None = SMALL_MAX_BYTES


def is_wildcard(host: str) -> bool:
    """True for the any-address binds (0.0.0.0, ::, empty)."""
    if host in ("", "*"):
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def split_host(value: str) -> tuple[str, int | None]:
    """(lower-case host name, port or None) of a ``Host`` header value (``[::1]:5000`` too)."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        name, rest = value[1:end], value[end + 1 :]
        port = rest[1:] if rest.startswith(":") else ""
    elif value.count(":") == 1:
        name, port = value.split(":")
    else:
        name, port = value, ""
    return name.rstrip("."), (int(port) if port.isdigit() else None)


def error(message: str, status: int = 500, **extra: Any) -> web.Response:
    """OSWorld's error shape: ``{"status": "error", "message": ...}``."""
    return web.json_response({"status": "error", "message": message, **extra}, status=status)


async def json_body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object, or 400 naming the path (413 passes through)."""
    try:
        data = await request.json()
    except web.HTTPException:
        raise
    except Exception as e:
        raise web.HTTPBadRequest(
            text=f"{request.path}: the body must be a JSON object ({e})"
        ) from e
    if not isinstance(data, dict):
        raise web.HTTPBadRequest(text=f"{request.path}: the body must be a JSON object")
    return data


class RequestGuard:
    """The checks above, as one aiohttp middleware (``guard.middleware``).

    Args:
      token: the bearer token every request must carry; None = no token check.
      allowed_hosts: host names the ``Host`` header may name besides loopback ones; None =
        any (a wildcard bind, where the token is what protects the server).
      route_of: maps a matched aiohttp route to its ``Route`` (None for unknown paths).
      upload_max_bytes: the cap of routes whose ``max_bytes`` is None.
    """

    def __init__(
        self,
        *,
        token: str | None,
        allowed_hosts: Collection[str] | None,
        route_of: Callable[[Any], Route | None],
        upload_max_bytes: int = UPLOAD_MAX_BYTES,
    ):
        self.token = token
        self.allowed_hosts = None if allowed_hosts is None else {h.lower() for h in allowed_hosts}
        self.route_of = route_of
        self.upload_max_bytes = upload_max_bytes

    def host_refusal(self, request: web.Request) -> str | None:
        """Why the request's ``Host`` / ``Origin`` / ``Sec-Fetch-Site`` is refused, or None."""
        host = request.headers.get("Host")
        if host is not None and self.allowed_hosts is not None:
            name, _ = split_host(host)
            if not (is_loopback(name) or name in self.allowed_hosts):
                return f"Host {host!r} is not this server's (DNS rebinding?)"
        origin = request.headers.get("Origin")
        if origin is not None:
            try:
                o = URL(origin)
                same = (
                    host is not None
                    and o.scheme == request.scheme
                    and (o.host or "").lower() == split_host(host)[0]
                    and o.port == (split_host(host)[1] or URL(f"{o.scheme}://x").port)
                )
            except ValueError:
                same = False
            if not same:
                return f"cross-origin request from {origin!r} refused"
        site = request.headers.get("Sec-Fetch-Site")
        if site is not None and site.lower() not in ("same-origin", "none"):
            return f"request sent by another site (Sec-Fetch-Site: {site}) refused"
        return None

    def max_bytes(self, route: Route | None) -> int:
        if route is None:
            return SMALL_MAX_BYTES
        return self.upload_max_bytes if route.max_bytes is None else route.max_bytes

    async def check(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        why = self.host_refusal(request)
        if why is not None:
            return error(f"{why}: the VM server takes no requests from web pages", 403)
        if self.token is not None:
            # a header's non-UTF-8 bytes arrive as surrogates: compared as the bytes they were
            got = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(got, f"Bearer {self.token}".encode()):
                return error("missing or wrong bearer token", 401)
        route = self.route_of(request.match_info.route)
        cap = self.max_bytes(route)
        size = request.content_length
        if size is not None and size > cap:
            return error(f"{request.path} takes at most {cap} bytes of body, got {size}", 413)
        if route is not None and request.method == "POST":
            ctype = request.content_type
            if route.body == JSON and ctype != "application/json":
                return error(
                    f"{request.path} takes Content-Type: application/json, got {ctype!r}", 415
                )
            if route.body == FORM and ctype not in FORM_TYPES:
                return error(f"{request.path} takes a form ({' or '.join(FORM_TYPES)})", 415)
        if request.body_exists:  # a chunked body has no Content-Length: cap it while reading
            request = request.clone(client_max_size=cap)
        t0 = time.perf_counter()
        resp = await handler(request)
        # Time spent inside the VM, so clients can split a round trip into HTTP vs work.
        resp.headers["X-Handler-Seconds"] = f"{time.perf_counter() - t0:.6f}"
        return resp

    @property
    def middleware(self) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
        @web.middleware
        async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
            return await self.check(request, handler)

        return guard
