"""Who may talk to the monitor: loopback by default, a token, same-origin requests only.

A request passes when (1) its Host header names this server (no DNS rebinding), (2) an Origin
or Sec-Fetch-Site header, when sent, says the request comes from the monitor's own pages (not
another port of the same host: that is "same-site", not "same-origin"), and (3) with a token,
it carries it: `?token=T` once (the answer sets a cookie and redirects to the same URL without
it, as Jupyter does), the cookie, or `Authorization: token T`.

Cookies are not scoped by port: every server on 127.0.0.1 is sent this one. So the cookie is
named after the port (two monitors do not overwrite each other's) and holds not the token but
an HMAC of it bound to the port (a server on another port that sees it learns nothing it can
use elsewhere). Every answer also carries a Content-Security-Policy (scripts only from the
monitor's own files and the nonce its pages carry), X-Frame-Options DENY and nosniff.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable
from urllib.parse import parse_qsl, urlencode

from starlette.responses import PlainTextResponse, RedirectResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from cua_jax.hosts import is_loopback

COOKIE = "cua_monitor_token"  # + "_PORT"
# The policy of every answer; pages add their script nonce to script-src (`csp_nonce`).
CSP = (
    "default-src 'none'; script-src 'self'{nonce}; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
SECURITY_HEADERS = (
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
)


def cookie_name(port: int) -> str:
    """The token cookie of the monitor on `port` (one per port: cookies ignore ports)."""
    return f"{COOKIE}_{port}"


def cookie_value(token: str, port: int) -> str:
    """What the cookie holds: the token's HMAC bound to `port`, never the token itself."""
    return hmac.new(token.encode(), f"cua-monitor:{port}".encode(), hashlib.sha256).hexdigest()


def _port(scope: Scope) -> int:
    server = scope.get("server") or ("", 0)
    return int(server[1] or 0)


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
            msg = (
                f"refused: Host {host!r} is not this monitor (a name clients use for it is "
                "allowed by starting tools/monitor.py with --allow-host NAME)"
            )
            await _deny(403, msg, scope, receive, send)
            return
        origin = headers.get("origin")
        if origin is not None and origin != f"http://{host}":
            await _deny(403, f"refused: cross-origin request from {origin}", scope, receive, send)
            return
        site = headers.get("sec-fetch-site")
        if site is not None and site not in ("same-origin", "none"):
            await _deny(403, f"refused: {site} request", scope, receive, send)
            return
        if self.token is not None:
            query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
            given = query.get("token")
            if given is not None and _same(given, self.token):
                rest = {k: v for k, v in query.items() if k != "token"}
                url = scope["path"] + ("?" + urlencode(rest) if rest else "")
                resp = RedirectResponse(url, status_code=303)
                port = _port(scope)
                resp.set_cookie(
                    cookie_name(port),
                    cookie_value(self.token, port),
                    httponly=True,
                    samesite="strict",
                )
                await resp(scope, receive, send)
                return
            port = _port(scope)
            cookie = _cookies(headers.get("cookie", "")).get(cookie_name(port), "")
            auth = headers.get("authorization", "")
            ok = _same(cookie, cookie_value(self.token, port)) or _same(
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


def _same(given: str, secret: str) -> bool:
    """Constant-time equality of two strings as UTF-8 (`hmac.compare_digest` raises TypeError,
    a 500, for a str holding non-ASCII characters: a token `é` in a URL or header)."""
    return hmac.compare_digest(
        given.encode("utf-8", "surrogateescape"), secret.encode("utf-8", "surrogateescape")
    )


class SecurityHeaders:
    """ASGI middleware adding `SECURITY_HEADERS` and, unless the answer set its own, the `CSP`
    without a nonce to every answer."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"content-security-policy" for k, _ in headers):
                    headers.append((b"content-security-policy", CSP.format(nonce="").encode()))
                message = {**message, "headers": headers + list(SECURITY_HEADERS)}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def new_nonce() -> str:
    """A fresh script nonce for one page."""
    return secrets.token_urlsafe(16)


def _cookies(header: str) -> dict[str, str]:
    out = {}
    for part in header.split(";"):
        k, _, v = part.strip().partition("=")
        if k:
            out[k] = v
    return out


async def _deny(code: int, msg: str, scope: Scope, receive: Receive, send: Send) -> None:
    await PlainTextResponse(msg + "\n", status_code=code)(scope, receive, send)
