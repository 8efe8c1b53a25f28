"""Who may talk to the monitor: loopback by default, a token, same-origin requests only.

A request passes when (1) its Host header names this server (no DNS rebinding), (2) an Origin
or Sec-Fetch-Site header, when sent, says the request comes from the monitor's own pages, and
(3) with a token, it carries it: `?token=T` once (the answer sets a cookie and redirects to the
same URL without it, as Jupyter does), the cookie, or `Authorization: token T`.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from urllib.parse import parse_qsl, urlencode

from starlette.responses import PlainTextResponse, RedirectResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from cua_jax.evaluation.server import is_loopback  # one loopback rule for both servers

COOKIE = "cua_monitor_token"


def allowed_hosts(host: str, port: int, extra: Iterable[str] = ()) -> set[str]:
    """Host header values this server answers to: its own name and, on loopback, every
    loopback name, each with and without the port."""
    names = {host, *extra}
    if is_loopback(host) or host in ("0.0.0.0", "::"):
        names |= {"127.0.0.1", "localhost", "[::1]"}
    if ":" in host and not host.startswith("["):
        names.add(f"[{host}]")
    return {n for name in names for n in (name, f"{name}:{port}")}


class Guard:
    """ASGI middleware enforcing the module docstring's three rules (403 / 401 otherwise)."""

    def __init__(self, app: ASGIApp, *, hosts: set[str] | None, token: str | None) -> None:
        self.app, self.hosts, self.token = app, hosts, token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        if self.hosts is not None and host not in self.hosts:
            await _deny(403, f"refused: Host {host!r} is not this monitor", scope, receive, send)
            return
        origin = headers.get("origin")
        if origin is not None and origin != f"http://{host}":
            await _deny(403, f"refused: cross-origin request from {origin}", scope, receive, send)
            return
        if headers.get("sec-fetch-site") == "cross-site":
            await _deny(403, "refused: cross-site request", scope, receive, send)
            return
        if self.token is not None:
            query = dict(parse_qsl(scope.get("query_string", b"").decode()))
            given = query.get("token")
            if given is not None and hmac.compare_digest(given, self.token):
                rest = {k: v for k, v in query.items() if k != "token"}
                url = scope["path"] + ("?" + urlencode(rest) if rest else "")
                resp = RedirectResponse(url, status_code=303)
                resp.set_cookie(COOKIE, self.token, httponly=True, samesite="strict")
                await resp(scope, receive, send)
                return
            cookie = _cookies(headers.get("cookie", "")).get(COOKIE, "")
            auth = headers.get("authorization", "")
            ok = hmac.compare_digest(cookie, self.token) or hmac.compare_digest(
                auth.removeprefix("token ").strip(), self.token
            )
            if not ok:
                await _deny(
                    401,
                    "this monitor needs its token: open the URL it printed at start (…/?token=...)",
                    scope,
                    receive,
                    send,
                )
                return
        await self.app(scope, receive, send)


def _cookies(header: str) -> dict[str, str]:
    out = {}
    for part in header.split(";"):
        k, _, v = part.strip().partition("=")
        if k:
            out[k] = v
    return out


async def _deny(code: int, msg: str, scope: Scope, receive: Receive, send: Send) -> None:
    await PlainTextResponse(msg + "\n", status_code=code)(scope, receive, send)
