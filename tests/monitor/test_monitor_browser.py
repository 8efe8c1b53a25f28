"""The monitor in real Chromium (Debian's, through Playwright): a finished run shows its curve,
a step's groups and a rollout whose screenshot carries the click overlay; a run page left open
while the writer logs a new step shows it without a reload. A PNG of each page is saved in
$CUA_TEST_ARTIFACTS (default: a pytest temp dir) for people to look at."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import uvicorn

from cua_jax import db as db_lib
from tests.db import synth
from tests.monitor.conftest import GROUP_SIZE, GROUPS, STEPS, fill_run
from tools import monitor
from tools.monitor_app.app import make_app
from tools.monitor_app.security import allowed_hosts

sync_api = pytest.importorskip("playwright.sync_api")


def _chromium() -> str:
    try:
        from envs.browser.host import find_chromium

        return find_chromium()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture
def artifacts(tmp_path):
    out = os.environ.get("CUA_TEST_ARTIFACTS") or str(tmp_path / "pages")
    os.makedirs(out, exist_ok=True)
    return out


class Server:
    """The monitor app under uvicorn in a thread, on a free loopback port, with a token."""

    def __init__(self, url: str, poll_ms: int = 300):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.token = "t0ken"
        app = make_app(
            monitor.open_database(url),
            token=self.token,
            hosts=allowed_hosts("127.0.0.1", self.port),
            poll_ms=poll_ms,
        )
        cfg = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            timeout_keep_alive=1,  # the browser's open connections do not hold up the end
            timeout_graceful_shutdown=1,
        )
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "the monitor did not start"
            time.sleep(0.05)
        self.base = f"http://127.0.0.1:{self.port}"

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def browser_page():
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), headless=True)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        # a script, style or image the monitor's Content-Security-Policy refused is an error
        page.on("console", lambda m: "Content Security Policy" in m.text and errors.append(m.text))
        yield page, errors
        browser.close()


def _wait_until(page, expr: str, timeout_ms: int = 30_000) -> None:
    """Polls `expr` in the page until it is true (Playwright's wait_for_function compiles its
    predicate with eval, which the monitor's CSP forbids; evaluate does not)."""
    deadline = time.monotonic() + timeout_ms / 1000
    while not page.evaluate(expr):
        assert time.monotonic() < deadline, f"timed out waiting for {expr}"
        time.sleep(0.05)


def test_finished_run_pages(filled, browser_page, artifacts):
    url, _ = filled
    page, errors = browser_page
    srv = Server(url)
    try:
        page.goto(f"{srv.base}/?token={srv.token}")  # the printed URL: sets the cookie
        page.wait_for_selector("#runs tr[data-run='1']")
        assert "finished" in page.inner_text("#runs")
        page.screenshot(path=os.path.join(artifacts, "runs.png"), full_page=True)

        page.goto(f"{srv.base}/runs/1")
        page.wait_for_selector(".chart[data-title='success'] canvas")
        _wait_until(page, f"document.body.dataset.loadedSteps === '{STEPS + 1}'")
        titles = page.eval_on_selector_all(".chart", "els => els.map(e => e.dataset.title)")
        assert {
            "success",
            "reward",
            "entropy",
            "KL",
            "clip fractions",
            "staleness (versions)",
            "throughput (generated tokens / s)",
        } <= set(titles)
        assert page.locator("#steps tbody tr").count() == STEPS + 1
        page.screenshot(path=os.path.join(artifacts, "run.png"), full_page=True)

        page.click("#steps a >> text='2'")
        page.wait_for_url("**/runs/1/steps/2")
        assert page.locator("section.group").count() == GROUPS
        assert page.locator("a.rollout").count() == GROUPS * GROUP_SIZE
        page.screenshot(path=os.path.join(artifacts, "step.png"), full_page=True)

        # member 1 of group 0: two turns, a click then a drag
        page.locator("section.group").first.locator("a.rollout").nth(1).click()
        page.wait_for_url("**/rollouts/*")
        turns = page.locator("section.turn")
        assert turns.count() == 2
        shot = turns.first.locator("svg.shot")
        assert shot.locator("g.act.click circle").count() >= 1
        assert turns.nth(1).locator("svg.shot g.act.drag line").count() == 1
        # the screenshot under the overlay really loaded (fetched through the guard)
        loaded = page.evaluate(
            "async () => (await fetch(document.querySelector('svg.shot image')"
            ".getAttribute('href'))).status"
        )
        assert loaded == 200
        assert shot.bounding_box()["width"] > 300
        page.screenshot(path=os.path.join(artifacts, "rollout.png"), full_page=True)
        # the player shows one turn at a time
        assert turns.nth(1).is_hidden()
        page.click("#next")
        assert turns.nth(1).is_visible() and turns.first.is_hidden()
        page.check("#show-all")
        assert turns.first.is_visible()
        page.screenshot(path=os.path.join(artifacts, "rollout_all_turns.png"), full_page=True)

        page.goto(f"{srv.base}/runs/1/evals/{STEPS}?vs=0")
        page.wait_for_selector("#categories")
        page.screenshot(path=os.path.join(artifacts, "eval.png"), full_page=True)
        page.goto(f"{srv.base}/runs/1/steps/999")
        assert "404" in page.inner_text("h1")
        page.screenshot(path=os.path.join(artifacts, "404.png"))
    finally:
        srv.close()
    assert errors == []


def test_open_page_shows_a_new_step_without_reload(tmp_path, browser_page, artifacts):
    url = str(tmp_path / "live.sqlite")
    db = fill_run(str(tmp_path / "run"), url, "live-run", 3, close=False)
    page, errors = browser_page
    srv = Server(url, poll_ms=300)
    try:
        page.goto(f"{srv.base}/runs/1?token={srv.token}")
        _wait_until(page, "document.body.dataset.loadedSteps === '4'")
        assert page.inner_text("#run-status") == "running"
        page.evaluate("window.__marker = 'same page'")  # gone if the page reloads
        groups, screens = synth.step_groups(4, GROUPS, GROUP_SIZE, version=3)
        trajs, tasks, shots = synth.eval_batch(4)
        db.log_eval(4, "step4", trajs, tasks, screens=shots, metrics={"eval/success": 0.25})
        db.log_step(
            4, {**synth.metrics_row(4), "eval/success": 0.25}, groups, screens=screens, version=4
        )
        assert db.flush(30)
        page.wait_for_selector("#steps tr[data-step='4']", timeout=15_000)
        page.wait_for_selector("#evals a[href='/runs/1/evals/4?tag=step4']", timeout=15_000)
        _wait_until(page, "document.body.dataset.loadedSteps === '5'")
        assert page.inner_text("#last-step") == "4"
        db.close("finished")
        _wait_until(
            page,
            "document.getElementById('run-status').textContent === 'finished'",
            timeout_ms=15_000,
        )
        assert page.evaluate("window.__marker") == "same page"
        page.screenshot(path=os.path.join(artifacts, "run_live.png"), full_page=True)
    finally:
        db.close("finished")
        srv.close()
    assert errors == []
    assert isinstance(db, db_lib.TrajectoryDB)


# Markup a writer (or anyone with the database file) could leave in an eval's num_tasks: inserted
# as HTML it would be a <b id="pwned"> and an <img> in the table (its handler blocked by the CSP,
# which then reports a violation), not this text.
HOSTILE = '<b id="pwned">7</b><img src="/x" onerror="window.__pwned = 1">'


def test_a_hostile_eval_value_is_shown_as_text(tmp_path, browser_page, artifacts):
    """A string in evals.num_tasks (SQLite keeps it in an INTEGER column) is shown as text both
    in the page the server renders and in the rows monitor.js redraws when a new eval arrives."""
    import sqlite3

    url = str(tmp_path / "hostile.sqlite")
    db = fill_run(str(tmp_path / "run"), url, "hostile-run", 3, close=False)
    with sqlite3.connect(url) as con:
        con.execute("UPDATE evals SET num_tasks = ? WHERE step = 3", (HOSTILE,))
    page, errors = browser_page
    srv = Server(url, poll_ms=300)
    cell = "#evals a[href='/runs/1/evals/3?tag=step3'] >> xpath=../../td[4]"
    try:
        page.goto(f"{srv.base}/runs/1?token={srv.token}")
        page.wait_for_selector(cell)
        rendered = page.inner_text(cell)  # the server's page
        trajs, tasks, shots = synth.eval_batch(4)
        db.log_eval(4, "step4", trajs, tasks, screens=shots, metrics={"eval/success": 0.25})
        assert db.flush(30)
        # monitor.js redraws every row of the table when the number of evals changes
        page.wait_for_selector("#evals a[href='/runs/1/evals/4?tag=step4']", timeout=15_000)
        redrawn = page.inner_text(cell)
        injected = page.locator("#evals #pwned, #evals img").count()
        pwned = page.evaluate("window.__pwned === 1")
        page.screenshot(path=os.path.join(artifacts, "run_hostile_eval.png"), full_page=True)
    finally:
        db.close("finished")
        srv.close()
    assert rendered == HOSTILE and redrawn == HOSTILE
    assert injected == 0 and not pwned
    assert errors == []
