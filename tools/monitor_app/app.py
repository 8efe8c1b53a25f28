"""The monitor's Starlette app: pages (Jinja2 templates) and the JSON the live pages poll.

    app = make_app(engine, token=..., hosts=...)   # tools/monitor.py serves it with uvicorn

`Monitor` holds the app's state (the database engine, the templates) and has one method a
route; `ROUTES` maps URLs to those methods, as `envs.vm.server.VMServer` does.

Pages (stable URLs): /  ·  /runs/<run id>  ·  /runs/<run id>/steps/<step>  ·
/rollouts/<rollout id>  ·  /runs/<run id>/evals/<step>[?tag=&vs=<step>|vs_run=<id>&vs_step=<n>]
JSON: /api/runs  ·  /api/runs/<run id>/steps?after=<step>   Screenshots: /screens/<run id>/<sha>.png
"""

from __future__ import annotations

import os
import re
from typing import Any

from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from cua_jax.redact import redact
from tools.monitor_app import queries
from tools.monitor_app.security import CSP, Guard, SecurityHeaders, new_nonce

HERE = os.path.dirname(os.path.abspath(__file__))
POLL_MS = 3000
_SHOT = re.compile(r"^[0-9a-f]{64}\.png$")


def _fmt(v: Any, digits: int = 3) -> str:
    if isinstance(v, bool) or v is None:
        return "" if v is None else str(v)
    if isinstance(v, int | float):
        return f"{v:.{digits}g}" if isinstance(v, float) else str(v)
    return str(v)


def _int63(text: Any) -> int:
    """A query integer; ValueError (a 400) for one no database column can hold."""
    value = int(text)
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"{value} is out of range")
    return value


def _path_id(request: Request, name: str) -> int:
    """An id or step from the URL; one no database column can hold is a 404, not a 500."""
    value = int(request.path_params[name])
    if not 0 <= value < 2**63:
        raise HTTPException(404, f"no {name.removesuffix('_id')} {value}")
    return value


# (path, the Monitor method that answers it)
ROUTES = (
    ("/", "index"),
    ("/runs/{run_id:int}", "run_page"),
    ("/runs/{run_id:int}/steps/{step:int}", "step_page"),
    ("/runs/{run_id:int}/evals/{step:int}", "eval_page"),
    ("/rollouts/{rollout_id:int}", "rollout_page"),
    ("/api/runs", "api_runs"),
    ("/api/runs/{run_id:int}/steps", "api_steps"),
    ("/screens/{run_id:int}/{name}", "screenshot"),
)


class Monitor:
    """The monitor's pages and JSON over `engine` (a migrated cua_jax database): one method a
    route of `ROUTES`, each opening its own short database session."""

    def __init__(self, engine: Engine, *, poll_ms: int = POLL_MS) -> None:
        self.engine = engine
        self.templates = Jinja2Templates(directory=os.path.join(HERE, "templates"))
        self.templates.env.filters["fmt"] = _fmt
        self.templates.env.globals["poll_ms"] = poll_ms

    def app(self, *, token: str | None = None, hosts: set[str] | None = None) -> Starlette:
        """The Starlette app: `ROUTES`, the static files, the security headers and, with `hosts`
        or `token`, the `Guard` (see security.py)."""
        routes: list[Route | Mount] = [Route(path, getattr(self, name)) for path, name in ROUTES]
        routes.append(
            Mount("/static", StaticFiles(directory=os.path.join(HERE, "static")), name="static")
        )
        middleware = [Middleware(SecurityHeaders)]
        if hosts is not None or token is not None:
            middleware.append(Middleware(Guard, hosts=hosts, token=token))
        return Starlette(
            routes=routes,
            middleware=middleware,
            exception_handlers={HTTPException: self.http_error, 500: self.server_error},
        )

    # -- helpers --------------------------------------------------------------------------------
    def page(self, request: Request, name: str, status_code: int = 200, **ctx: Any) -> Response:
        """Template `name` rendered with `ctx`, under a Content-Security-Policy with a fresh
        nonce (the page's inline scripts carry it; no other inline script runs)."""
        nonce = new_nonce()
        resp = self.templates.TemplateResponse(
            request, name, {**ctx, "csp_nonce": nonce}, status_code=status_code
        )
        resp.headers["Content-Security-Policy"] = CSP.format(nonce=f" 'nonce-{nonce}'")
        return resp

    def db(self) -> Session:
        """A new database session (use it in a `with`)."""
        return Session(self.engine)

    @staticmethod
    def run_or_404(s: Session, request: Request) -> Any:
        """The run the URL names, or a 404."""
        try:
            return queries.get_run(s, _path_id(request, "run_id"))
        except queries.NotFound as e:
            raise HTTPException(404, str(e)) from None

    # -- pages ----------------------------------------------------------------------------------
    def index(self, request: Request) -> Response:
        """Every run."""
        with self.db() as s:
            return self.page(request, "runs.html", runs=queries.runs(s))

    def run_page(self, request: Request) -> Response:
        """One run: its config (redacted), curves, evals, SFT and latest steps."""
        with self.db() as s:
            run = self.run_or_404(s, request)
            last = queries.steps(s, run.id, newest=20)[::-1]
            return self.page(
                request,
                "run.html",
                run=queries.run_dict(run),
                config=redact(run.config or {}),  # rows written before redaction too
                evals=queries.evals(s, run.id),
                sft=queries.sft(s, run.id),
                recent=last,
            )

    def step_page(self, request: Request) -> Response:
        """One training step's groups."""
        with self.db() as s:
            run = self.run_or_404(s, request)
            try:
                data = queries.step_page(s, run.id, _path_id(request, "step"))
            except queries.NotFound as e:
                raise HTTPException(404, str(e)) from None
            return self.page(request, "step.html", run=queries.run_dict(run), **data)

    def rollout_page(self, request: Request) -> Response:
        """One rollout, turn by turn."""
        with self.db() as s:
            try:
                ro = queries.rollout(s, _path_id(request, "rollout_id"))
            except queries.NotFound as e:
                raise HTTPException(404, str(e)) from None
            run = queries.get_run(s, ro.run_id)
            return self.page(
                request, "rollout.html", run=queries.run_dict(run), r=ro, turns=ro.turns
            )

    def eval_page(self, request: Request) -> Response:
        """One eval by task and category, optionally beside another step's or run's
        (`?vs=<step>` or `?vs_run=<id>&vs_step=<n>`, `tag`/`vs_tag` to pick an eval)."""
        q = request.query_params
        with self.db() as s:
            run = self.run_or_404(s, request)
            try:
                ev = queries.eval_at(s, run.id, _path_id(request, "step"), q.get("tag"))
                cur = queries.eval_table(s, ev)
                other = None
                if q.get("vs_run") or q.get("vs"):
                    vs_run = _int63(q.get("vs_run") or run.id)
                    vs_step = _int63(q.get("vs_step") or q.get("vs"))
                    queries.get_run(s, vs_run)
                    other = queries.eval_table(
                        s, queries.eval_at(s, vs_run, vs_step, q.get("vs_tag"))
                    )
            except queries.NotFound as e:
                raise HTTPException(404, str(e)) from None
            except ValueError:
                raise HTTPException(400, "vs, vs_run and vs_step must be integers") from None
            return self.page(
                request,
                "eval.html",
                run=queries.run_dict(run),
                ev=cur,
                other=other,
                evals=queries.evals(s, run.id),
                all_runs=queries.runs(s),
                categories=sorted(
                    set(cur["categories"]) | set((other or {}).get("categories", {}))
                ),
                task_ids=sorted(set(cur["tasks"]) | set((other or {}).get("tasks", {}))),
            )

    # -- JSON and files -------------------------------------------------------------------------
    def api_runs(self, request: Request) -> Response:
        """Every run, as JSON."""
        with self.db() as s:
            return JSONResponse(queries.runs(s))

    def api_steps(self, request: Request) -> Response:
        """A run's steps after `?after=<step>` (the live pages poll this), with its evals."""
        try:
            after = _int63(request.query_params.get("after", -1))
        except ValueError:
            raise HTTPException(400, "after must be an integer step") from None
        with self.db() as s:
            run = self.run_or_404(s, request)
            return JSONResponse(
                {
                    "run": queries.run_dict(run),
                    "steps": queries.steps(s, run.id, after),
                    "evals": queries.evals(s, run.id),
                }
            )

    def screenshot(self, request: Request) -> Response:
        """A screenshot from the run's `workdir/screens` (names are content hashes)."""
        name = request.path_params["name"]
        if not _SHOT.match(name):
            raise HTTPException(404, f"no screenshot {name}")
        with self.db() as s:
            run = self.run_or_404(s, request)
            path = os.path.join(run.workdir, "screens", name)
        if not os.path.exists(path):
            raise HTTPException(404, f"screenshot {name} is not in {run.workdir}/screens")
        return FileResponse(
            path, media_type="image/png", headers={"Cache-Control": "max-age=86400"}
        )

    # -- errors ---------------------------------------------------------------------------------
    async def http_error(self, request: Request, exc: Exception) -> Response:
        """An HTTP error as JSON under /api/, else as the error page."""
        code = getattr(exc, "status_code", 500)
        detail = getattr(exc, "detail", "internal error")
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": detail}, status_code=code)
        return self.page(request, "error.html", status_code=code, code=code, detail=detail)

    async def server_error(self, request: Request, exc: Exception) -> Response:
        """An unexpected exception as a 500 error page naming it."""
        return self.page(
            request, "error.html", status_code=500, code=500, detail=f"{type(exc).__name__}: {exc}"
        )


def make_app(
    engine: Engine,
    *,
    token: str | None = None,
    hosts: set[str] | None = None,
    poll_ms: int = POLL_MS,
) -> Starlette:
    """The monitor on `engine` (a migrated cua_jax database). `hosts`/`token`: see security.py;
    hosts=None accepts any Host (tests with Starlette's TestClient)."""
    return Monitor(engine, poll_ms=poll_ms).app(token=token, hosts=hosts)
