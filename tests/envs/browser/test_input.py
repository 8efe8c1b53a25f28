"""BrowserEnv input edge cases: nothing an episode does (a sideways scroll, a held key, a huge
scroll, an odd key name) leaks into the next episode, scores another page, or is an env error."""

import math
import time

import pytest

from cua_jax import actions as A
from cua_jax.env_api import Task
from envs.browser import BrowserEnv, BrowserHost, miniwob, pages, suite
from envs.browser.host import merge_disable_features

# Two inputs and a log of the key and mouse events the page saw.
INPUT_HTML = """<!DOCTYPE html><html><body style="margin:0">
<input id="a" style="position:absolute;left:10px;top:10px;width:300px;height:30px">
<input id="b" style="position:absolute;left:10px;top:60px;width:300px;height:30px">
<div style="height:20000px;width:300px"></div>
<script>
window.log = [];
for (const ev of ["keydown", "mousedown", "mouseup", "click"])
  document.addEventListener(ev, (e) => log.push([ev, e.key || "", e.shiftKey, e.ctrlKey,
    e.altKey, e.buttons]), true);
</script></body></html>"""
VALUES_JS = "() => [a.value, b.value, document.activeElement.id]"


def page_task(html: str = INPUT_HTML) -> Task:
    return Task(id="t", instruction="test", source="custom", spec={"kind": "page", "html": html})


@pytest.fixture(scope="module")
def host(run):
    h = BrowserHost()
    run(h.__aenter__())
    yield h
    run(h.close())


@pytest.fixture(scope="module")
def env(host, run):
    e = BrowserEnv(viewport=(640, 480), host=host, step_timeout_s=8.0)
    run(e.__aenter__())
    yield e
    run(e.close())


def ok(r) -> bool:
    """The step went through: the episode goes on, no fault, no invalid action."""
    return not r.done and not r.info.get("error") and not r.info.get("invalid_action")


async def solve(env: BrowserEnv) -> None:
    for _ in range(6):
        r = await env.step(await env.oracle_next())
        assert not r.info.get("error"), r.info
        if r.done:
            return
    raise AssertionError("the oracle did not finish")


def test_merge_disable_features():
    args = ["--a", "--disable-features=X,Y", "--b", "--disable-features=Y,Z"]
    assert merge_disable_features(args, ["P"]) == ["--a", "--b", "--disable-features=P,X,Y,Z"]
    assert merge_disable_features(["--a"]) == ["--a"]


def test_chromium_honours_all_disabled_features(run):
    async def go():
        async with BrowserHost(extra_args=("--disable-features=Foo",)) as host:
            with open(f"/proc/{host.browser_pids()[0]}/cmdline", "rb") as f:
                cmd = f.read().decode().split("\0")
        # Chromium honours only the last --disable-features: it must hold every feature of the
        # others (Playwright's own) as well as ours and the extra_args'.
        switches = [set(a.split("=", 1)[1].split(",")) for a in cmd if "--disable-features=" in a]
        assert {"OverscrollHistoryNavigation", "Foo"} <= switches[-1]
        assert all(s <= switches[-1] for s in switches), switches

    run(go())


def test_sideways_overscroll_does_not_go_back(env, run):
    async def go():
        await env.reset(suite.make_task("nav-link", 1))  # an earlier episode, with page loads
        await solve(env)
        await env.reset(suite.make_task("click-color", 5))
        for a in [A.Scroll(320, 240, -3, 0), A.Click(5, 470)]:  # left past the edge, a click
            r = await env.step(a)
            assert ok(r), r.info
        assert "t=click-color&seed=5" in env.page.url

    run(go())


def test_only_the_tasks_page_scores(env, run):
    async def go():
        await env.reset(suite.make_task("click-button", 1))
        # the page now shows (and the oracle solves) another seed of the template
        await env.page.evaluate("() => cua.restart('click-button', 2)")
        await solve(env)
        assert await env.page.evaluate("() => cua.score()") == 1
        assert await env.evaluate() == 0.0
        await env.reset(suite.make_task("click-button", 2))
        await solve(env)
        assert await env.evaluate() == 1.0

        # MiniWoB: another task's page, solved, does not score this task
        await env.reset(miniwob.make_task("click-button"), seed=1)
        await env.page.goto(miniwob.url("click-test"))
        await env.page.evaluate(miniwob.START_JS, [1, 60_000])
        await env.page.click("#subbtn")
        assert (await env.page.evaluate(miniwob.STATE_JS))[1] > 0
        assert await env.evaluate() == -1.0  # what an unfinished MiniWoB episode scores

    run(go())


def test_oracle_scrolls_only_the_axis_that_needs_it(host, run):
    async def go():
        async with BrowserEnv(viewport=(1280, 720), host=host) as big:
            await big.reset(suite.make_task("scroll-button", 1))
            a = await big.oracle_next()
            # the button is far left of the viewport's centre, but in view horizontally
            assert isinstance(a, A.Scroll) and a.dx == 0 and a.dy > 0, a
            await solve(big)
            assert await big.evaluate() == 1.0

    run(go())


def test_held_keys_and_buttons_do_not_leak_into_the_next_episode(env, run):
    async def go():
        await env.reset(page_task())
        for a in [A.KeyDown("shift"), A.KeyDown("ctrl"), A.MouseDown(5, 5, "right"), A.Done()]:
            r = await env.step(a)
            assert not r.info.get("error"), r.info
        await env.reset(page_task())
        await env.step(A.Click(100, 150))
        log = await env.page.evaluate("() => log")
        assert ["mousedown", "", False, False, False, 1] in log, log  # only the left button
        assert ["click", "", False, False, False, 0] in log, log

        # keys and buttons released within the episode: the context is reused (cheap reset)
        page = env.page
        for a in [A.KeyDown("alt"), A.MouseDown(5, 5), A.MouseUp(), A.KeyUp("alt"), A.Done()]:
            await env.step(a)
        await env.reset(page_task())
        assert env.page is page

    run(go())


def test_huge_and_non_finite_scrolls(env, run):
    async def go():
        await env.reset(page_task())
        r = await env.step(A.Scroll(320, 240, 0, 1e300))  # capped at 50 notches
        assert ok(r), r.info
        assert await env.page.evaluate("() => scrollY") == 5000
        t0 = time.perf_counter()
        r = await env.step(A.Click(100, 100))  # the next input event does not hang
        assert ok(r) and time.perf_counter() - t0 < 4, r.info
        r = await env.step(A.Scroll(320, 240, 0, -1e308))
        assert ok(r), r.info
        assert await env.page.evaluate("() => scrollY") == 0
        for dx, dy in [(0, math.inf), (0, -math.inf), (math.nan, 0)]:
            r = await env.step(A.Scroll(320, 240, dx, dy))
            assert not r.done and "finite" in r.info["invalid_action"], r.info

    run(go())


def test_points_off_the_screen_are_invalid_actions_not_hangs(env, run):
    # A Click at (1e308, 1e308) hung Chromium's input for the whole step time-out (8 s here,
    # 20 s on a host) and ended the episode; inf was a fault ("not JSON compliant").
    async def go():
        await env.reset(page_task())
        t0 = time.perf_counter()
        for a in [
            A.Click(1e308, 1e308),
            A.Move(1e308, 3),
            A.Click(math.inf, 1),
            A.MouseDown(math.nan, 5),
            A.Drag(10, 10, -1e12, 5),
            A.Scroll(641, 5, 0, 1),
            A.MouseUp(5, -0.5),
        ]:
            r = await env.step(a)
            assert not r.done and "off the 640x480 screen" in r.info["invalid_action"], (a, r)
        assert time.perf_counter() - t0 < 2.0
        assert ok(await env.step(A.Click(640, 480)))  # the edges are on the screen
        assert ok(await env.step(A.Click(100, 25)))

    run(go())


def test_inline_pages_are_freed_after_their_episode(env, run):
    # Every distinct inline page was kept for the life of the process: a host's memory grew
    # by each page's size on every reset (68 -> 101 MB over 30 resets of 1 MB pages).
    async def go():
        await env.reset(page_task("<p>first</p>"))
        held = pages.inline_pages()
        for i in range(5):
            await env.reset(page_task(f"<p>page {i}</p>"))
            assert pages.inline_pages() == held
        other = BrowserEnv(viewport=(640, 480), host=env.host)
        await other.reset(page_task("<p>page 4</p>"))  # the same page, two holders
        await env.reset(page_task("<p>again</p>"))
        assert await other.page.evaluate("() => document.body.innerText") == "page 4"
        await other.page.reload()  # still served: the other env holds it
        assert await other.page.evaluate("() => document.body.innerText") == "page 4"
        await other.close()
        return held

    held = run(go())
    assert pages.inline_pages() == held


def test_keys_playwright_does_not_know(env, run):
    async def go():
        await env.reset(page_task())
        await env.step(A.Click(100, 25))  # focus #a
        for ch in ["é", "€", "日", "\u00a0"]:  # typed as the character
            r = await env.step(A.Key((ch,)))
            assert ok(r), r.info
        r = await env.step(A.KeyDown("ü"))
        assert ok(r), r.info
        r = await env.step(A.KeyUp("ü"))
        assert ok(r), r.info
        assert await env.page.evaluate(VALUES_JS) == ["é€日\u00a0ü", "", "a"]
        r = await env.step(A.Key(("\t",)))  # Tab: on to #b
        assert ok(r), r.info
        for a, why in [
            (A.Key(("ctrl", "é")), "chord"),
            (A.Key(("no-such-key",)), "unknown key"),
            (A.Key(("\x01",)), "unknown key"),
            (A.KeyDown("no-such-key"), "unknown key"),
            (A.KeyUp("no-such-key"), "unknown key"),
        ]:
            r = await env.step(a)
            assert not r.done and why in r.info.get("invalid_action", ""), (a, r.info)
        await env.step(A.TypeText("x"))  # ctrl is not left down by the failed chord
        assert await env.page.evaluate(VALUES_JS) == ["é€日\u00a0ü", "x", "b"]

    run(go())


def test_shift_chords_type_the_shifted_character(env, run):
    async def go():
        await env.reset(page_task())
        await env.step(A.Click(100, 25))
        for keys in [("shift", "1"), ("shift", "a"), ("shift", "="), ("shift", "/")]:
            r = await env.step(A.Key(keys))
            assert ok(r), r.info
        for a in [A.KeyDown("shift"), A.Key(("b",)), A.KeyDown("2"), A.KeyUp("2")]:
            await env.step(a)
        await env.step(A.KeyUp("shift"))
        await env.step(A.Key(("c",)))
        assert await env.page.evaluate(VALUES_JS) == ["!A+?B@c", "", "a"]
        # a shifted chord with a named key is unchanged: shift+home selects, delete clears
        await env.step(A.Key(("shift", "home")))
        await env.step(A.Key(("delete",)))
        assert await env.page.evaluate(VALUES_JS) == ["", "", "a"]

    run(go())
