"""The OpenAI-compatible chat-completions server over an `Engine` (tools/serve.py's core).

`create_app` builds the Starlette app (routes, error bodies, the `Guard` middleware);
`EmbeddedServer` runs it on a caller's event loop (the trainer serving its live policy,
`config.serve.port`); `resolve_token` is the token policy both entry points share. The request
format, errors and security rules are in tools/serve.py's docstring.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import secrets
import socket
import time
import uuid
from collections.abc import Collection, Sequence
from typing import Any
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from cua_jax.evaluation.openai_chat import (
    MessageRenderer,
    RequestError,
    parse_request,
)
from cua_jax.hosts import is_loopback  # re-exported: tools/serve.py imports it from here
from cua_jax.sampler import SamplingParams

MiB = 1024 * 1024
DEFAULT_MAX_BODY = 32 * MiB


def _host_name(value: str) -> str:
    """The host name of a Host header value (`[::1]:8000` -> `::1`)."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def error_response(
    status: int, message: str, type_: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    """OpenAI's error body."""
    return JSONResponse(
        {"error": {"message": message, "type": type_, "param": param, "code": code}},
        status_code=status,
    )


class Guard:
    """ASGI middleware: the browser (403) and token (401) checks of the module docstring.

    hosts: host names the Host header may carry besides loopback ones; None = any (a wildcard
    bind, protected by its token)."""

    def __init__(self, app: ASGIApp, *, token: str | None, hosts: Collection[str] | None):
        self.app, self.token = app, token
        self.hosts = None if hosts is None else {h.strip("[]").lower() for h in hosts}

    def refusal(self, headers: dict[str, str], scheme: str) -> tuple[int, str] | None:
        host = headers.get("host", "")
        name = _host_name(host)
        if self.hosts is not None and not (is_loopback(name) or name in self.hosts):
            return 403, f"Host {host!r} is not this server's (DNS rebinding?)"
        origin = headers.get("origin")
        if origin is not None:
            o = urlsplit(origin)
            if f"{o.scheme}://{o.netloc}".lower() != f"{scheme}://{host}".lower():
                return 403, f"cross-origin request from {origin!r} refused"
        if headers.get("sec-fetch-site") in ("cross-site", "same-site"):
            return 403, "a request sent by another site is refused"
        if self.token is not None:
            auth = headers.get("authorization", "")
            given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(given.encode(), self.token.encode()):
                return 401, "missing or wrong token: send 'Authorization: Bearer <token>'"
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = {
                k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]
            }
            bad = self.refusal(headers, scope.get("scheme", "http"))
            if bad is not None:
                status, msg = bad
                kind = "authentication_error" if status == 401 else "permission_error"
                await error_response(status, msg, kind)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, type_: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code


async def _read_json(request: Request, max_bytes: int) -> Any:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise _HTTPError(
            415,
            f"Content-Type must be application/json, got {ctype or 'none'!r}",
            "invalid_request_error",
        )
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise _HTTPError(
            413,
            f"the body ({length} bytes) is over the {max_bytes}-byte limit",
            "invalid_request_error",
        )
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _HTTPError(
                    413, f"the body is over the {max_bytes}-byte limit", "invalid_request_error"
                )
            chunks.append(chunk)
    except ClientDisconnect:  # nobody reads the answer; not a server error (no traceback)
        raise _HTTPError(400, "the client left mid-body", "invalid_request_error") from None
    try:  # off the event loop: a body with screenshots is megabytes of JSON
        return await asyncio.to_thread(json.loads, b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _HTTPError(
            400, f"the body is not JSON: {e}", "invalid_request_error", "invalid_json"
        ) from None
    except RecursionError:
        raise _HTTPError(
            400, "the body's JSON is nested too deep", "invalid_request_error", "invalid_json"
        ) from None


async def _disconnected(request: Request) -> None:
    """Returns when the client of `request` (whose body was read) disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ChatServer:
    """The request handlers over one `Engine` and `QwenVLProcessor`.

    Args:
      engine: a `cua_jax.sampler.Engine` (its version is reported; `update_params` on it
        between requests serves the new weights).
      processor: the policy's `QwenVLProcessor`.
      model_name: the id /v1/models lists and replies name.
      max_tokens: the default `max_tokens` of a request that gives none.
      banned_token_ids: never sampled (the vision placeholders, as in rollouts).
      max_body_bytes: the request body cap (413 over it).
    """

    def __init__(
        self,
        engine: Any,
        processor: Any,
        *,
        model_name: str = "cua_jax",
        max_tokens: int = 256,
        banned_token_ids: Sequence[int] = (),
        max_body_bytes: int = DEFAULT_MAX_BODY,
    ):
        self.engine, self.processor = engine, processor
        self.tokenizer = processor.tokenizer
        self.renderer = MessageRenderer(processor)
        self.model_name = model_name
        self.max_tokens = max_tokens
        self.banned = tuple(int(t) for t in banned_token_ids)
        self.stop_ids = tuple(self.tokenizer.stop_ids)
        self.max_body_bytes = max_body_bytes
        self.requests = 0
        self.abandoned = 0  # requests whose client left before the reply (generation stopped)

    async def chat_completions(self, request: Request) -> Response:
        try:
            body = await _read_json(request, self.max_body_bytes)
            return await self._until_the_client_leaves(request, self._complete(body))
        except _HTTPError as e:
            return error_response(e.status, e.message, e.type, None, e.code)
        except RequestError as e:
            return JSONResponse(e.body(), status_code=400)

    async def _until_the_client_leaves(self, request: Request, work: Any) -> Response:
        """`work`'s response, or, when the client disconnects first, `work` cancelled (its
        `Engine.generate` calls free their slots: a client that left kept the engine busy
        generating for nobody) and a 499 nobody reads."""
        job = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({job, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not job.done():
                job.cancel()
        if job.cancelled() or not job.done():
            with contextlib.suppress(asyncio.CancelledError):
                await job
            self.abandoned += 1
            return Response(status_code=499)
        return job.result()

    async def _complete(self, body: Any) -> JSONResponse:
        eng = self.engine
        req = await asyncio.to_thread(  # base64 + PNG decoding, off the loop that drives eng
            parse_request,
            body,
            max_tokens_default=self.max_tokens,
            max_tokens_limit=eng.max_seq_len,
        )
        if req.model is not None and req.model != self.model_name:
            raise RequestError(
                f"model {req.model!r} is not served here (this server serves {self.model_name!r})",
                "model",
                "model_not_found",
            )
        prompt = await asyncio.to_thread(self.renderer.render, req.messages, req.images)
        n_prompt = len(prompt.ids)
        if n_prompt >= eng.max_seq_len:
            raise RequestError(
                f"the prompt has {n_prompt} tokens; this server's context is {eng.max_seq_len} "
                "tokens (prompt + at least one generated): send fewer or smaller images / turns",
                "messages",
                "context_length_exceeded",
            )
        sessions = [prompt.session or self.renderer.new_session()]
        sessions += [self.renderer.new_session() for _ in range(req.n - 1)]
        params = self._sampling_params(req)
        self.requests += 1
        outs = await asyncio.gather(
            *(
                eng.generate(prompt.ids, prompt.pixel_values, prompt.grid, params=p, session_id=s)
                for p, s in zip(params, sessions, strict=True)
            )
        )
        choices = []
        for k, (out, sess) in enumerate(zip(outs, sessions, strict=True)):
            if out.finish_reason == "error":
                return error_response(
                    500, f"the sampler failed: {out.error}", "server_error", None, "sampler_error"
                )
            choices.append(self._choice(k, out, sess, req))
        version = min(c["policy_version"] for c in choices)
        n_gen = sum(len(c["token_ids"]) for c in choices)
        return JSONResponse(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.model_name,
                "system_fingerprint": f"cua_jax-v{version}",
                "policy_version": version,
                "choices": choices,
                "usage": {
                    "prompt_tokens": n_prompt,
                    "completion_tokens": n_gen,
                    "total_tokens": n_prompt + n_gen,
                    "prompt_tokens_details": {"cached_tokens": int(outs[0].num_cached_tokens)},
                },
            }
        )

    def _sampling_params(self, req: Any) -> list[Any]:
        """One `SamplingParams` a choice (seeds `seed`, `seed + 1`, ...: a random seed when the
        request names none); a value the sampler refuses is the request's error."""

        seed = req.seed if req.seed is not None else secrets.randbits(31)
        try:
            return [
                SamplingParams(
                    temperature=req.temperature,
                    top_p=req.top_p,
                    seed=(seed + k) % 2**63,
                    max_new_tokens=req.max_tokens,
                    stop_token_ids=self.stop_ids,
                    stop_strings=req.stop,
                    banned_token_ids=self.banned,
                )
                for k in range(req.n)
            ]
        except ValueError as e:
            raise RequestError(str(e), None, "invalid_value") from None

    def _choice(self, k: int, out: Any, sess: Any, req: Any) -> dict[str, Any]:
        """Choice `k` of a completion: the text without its stop token or stop string (as
        OpenAI's), the token ids, the policy version, and the log-probs when asked for; the
        renderer remembers the turn for the session's next request."""
        tokens = [int(t) for t in out.tokens]
        content_ids = tokens[:-1] if tokens and tokens[-1] in self.stop_ids else tokens
        text = self.tokenizer.decode(content_ids)
        for s in req.stop:  # OpenAI leaves the stop sequence out of the content
            cut = text.find(s)
            if cut >= 0:
                text = text[:cut]
        self.renderer.remember(req.messages, text, tokens, sess)
        choice: dict[str, Any] = {
            "index": k,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "stop" if out.finish_reason == "stop" else "length",
            "logprobs": None,
            "token_ids": tokens,
            "policy_version": int(out.version),
        }
        if req.logprobs:
            choice["logprobs"] = {
                "content": [
                    {
                        "token": (piece := self.tokenizer.decode([t])),
                        "logprob": float(lp),
                        "bytes": list(piece.encode("utf-8")),
                        "top_logprobs": [],
                    }
                    for t, lp in zip(tokens, out.logprobs, strict=True)
                ]
            }
        return choice

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": self.model_name, "object": "model", "owned_by": "cua_jax"}],
            }
        )

    async def health(self, request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "policy_version": int(self.engine.version)})


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(
        exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind
    )


async def _server_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(500, f"{type(exc).__name__}: {exc}", "server_error")


def create_app(
    engine: Any,
    processor: Any,
    *,
    token: str | None,
    hosts: Collection[str] | None = (),
    **server_kw: Any,
) -> Starlette:
    """The ASGI app (Starlette) serving `engine`: `token` None = no token check; `hosts`: Host
    names accepted besides loopback ones (None: any). `server_kw` go to `ChatServer`. The app's
    `state.chat` is the ChatServer."""
    chat = ChatServer(engine, processor, **server_kw)
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat.chat_completions, methods=["POST"]),
            Route("/v1/models", chat.models, methods=["GET"]),
            Route("/health", chat.health, methods=["GET"]),
        ],
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
    )
    app.state.chat = chat
    app.add_middleware(Guard, token=token, hosts=hosts)
    return app


class EmbeddedServer:
    """tools/serve.py's app on the caller's running event loop (say a trainer's, serving its
    live policy: each reply names the weights version that wrote it, and `engine.update_params`
    moves the server to new weights as it moves the rollouts). One loop drives the engine, and
    the process's signal handlers are left alone.

        srv = await EmbeddedServer.start(engine, processor, port=8000, token=tok)
        ... srv.url ...
        await srv.stop()
    """

    def __init__(self, server: Any, task: asyncio.Task, url: str):
        self.server, self.task, self.url = server, task, url

    @classmethod
    async def start(
        cls,
        engine: Any,
        processor: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None,
        **server_kw: Any,
    ) -> EmbeddedServer:
        """Binds `host:port` (0: a free port) and serves until `stop()`; `token` None only on
        loopback (ValueError otherwise, as the CLI); OSError when the address cannot be bound
        (the socket is bound here, not by uvicorn, which would exit the process)."""
        import contextlib

        import uvicorn

        if token is None and not is_loopback(host):
            raise ValueError(f"serving on {host} needs a token")

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # the host program keeps its own signal handling
                yield

        hosts = None if host in ("0.0.0.0", "::", "") else {host}
        app = create_app(engine, processor, token=token, hosts=hosts, **server_kw)
        server = _Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
        task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                task.result()  # raises what stopped it (say, the port is taken)
                raise RuntimeError(f"the server on {host}:{port} stopped at start")
            await asyncio.sleep(0.02)
        bound = server.servers[0].sockets[0].getsockname()[1]
        name = f"[{host}]" if ":" in host else host
        return cls(server, task, f"http://{name}:{bound}/v1")

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


MIN_TOKEN_CHARS = 16  # a bearer token anyone on the host (or network) cannot guess


def resolve_token(host: str, token: str | None, no_token: bool) -> tuple[str | None, bool]:
    """(the token to require or None, whether it was made up here); ValueError for a refused
    combination (non-loopback without --token, --no-token off loopback, both given) or a token
    a guesser could find (under MIN_TOKEN_CHARS characters, on any address: loopback is shared
    with every local user)."""
    if no_token and token:
        raise ValueError("--no-token and --token contradict each other: give one")
    token = token or os.environ.get("CUA_SERVE_TOKEN") or None
    if token and len(token) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"the token (--token, config.serve.token or $CUA_SERVE_TOKEN) has {len(token)} "
            f"characters, fewer than {MIN_TOKEN_CHARS}: use a longer one (python -c 'import "
            "secrets; print(secrets.token_urlsafe(32))') or none, and one is made up"
        )
    if not is_loopback(host):
        if no_token:
            raise ValueError(
                f"refusing to bind {host} with --no-token: a non-loopback address needs --token T"
            )
        if not token:
            raise ValueError(
                f"refusing to bind {host} without a token you chose: a non-loopback "
                "address needs --token T (or $CUA_SERVE_TOKEN)"
            )
    if no_token:
        return None, False
    if token:
        return token, False
    return secrets.token_urlsafe(32), True
