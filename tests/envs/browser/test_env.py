"""BrowserEnv against a real Chromium: actions reach the page as the right DOM events, the
screenshot is the page, the network is closed, and faults end episodes without hanging."""

import asyncio
import contextlib
import socket
import time

import numpy as np
import pytest

from cua_jax import actions as A
from cua_jax.env_api import Env, EnvError, Task
from envs.browser import BrowserEnv, BrowserHost, suite

VIEWPORT = (400, 300)
EVENTS_HTML = """<!DOCTYPE html><html><body style="margin:0">
<input id="t" style="position:absolute;left:10px;top:10px;width:200px;height:24px">
<div id="red" style="position:absolute;left:0;top:100px;width:50px;height:50px;
  background:rgb(255,0,0)"></div>
<div style="height:3000px;width:300px"></div>
<script>
window.log = [];
for (const ev of ["click", "dblclick", "contextmenu", "auxclick", "mousedown", "mouseup",
                  "keydown"])
  document.addEventListener(ev, (e) => log.push([ev, e.button, e.detail,
    Math.round(e.clientX || 0), Math.round(e.clientY || 0), e.key || "", e.ctrlKey,
    e.shiftKey]));
document.addEventListener("contextmenu", (e) => e.preventDefault());
</script></body></html>"""


def page_task(html: str, tid: str = "t") -> Task:
    return Task(
        id=tid,
        instruction="test page",
        source="custom",
        spec={"kind": "page", "html": html},
        has_checker=False,
    )


@pytest.fixture(scope="module")
def env(run):
    # Short enough that the hung-page test stays quick, long enough that a normal step on a CI
    # machine shared with JAX compiles and other jobs (load average ~5 seen) is not a "hang".
    e = BrowserEnv(viewport=VIEWPORT, step_timeout_s=8.0, reset_timeout_s=8.0)
    run(e.__aenter__())
    yield e
    run(e.close())


def test_actions_reach_the_page(env, run):
    async def go():
        assert isinstance(env, Env)  # the cua_jax.env_api protocol
        obs = await env.reset(page_task(EVENTS_HTML))
        assert obs.screenshot.shape == (300, 400, 3) and obs.screenshot.dtype == np.uint8
        # the screenshot is the page: the red square is red, the background white
        assert obs.screenshot[120, 20].tolist() == [255, 0, 0]
        assert obs.screenshot[250, 350].tolist() == [255, 255, 255]
        steps = [
            A.Click(50, 60),
            A.Click(70, 80, "right"),
            A.Click(90, 95, "middle"),
            A.Click(60, 70, count=2),
            A.Drag(200, 220, 100, 120),
            A.MouseDown(120, 130),  # a drag in steps (pyautogui mouseDown / moveTo / mouseUp)
            A.Move(150, 160),
            A.MouseUp(180, 190),
            A.KeyDown("shift"),  # shift held over a click (keyDown / click / keyUp)
            A.Click(30, 35),
            A.KeyUp("shift"),
            A.Click(31, 36),
        ]
        for a in steps:
            r = await env.step(a)
            assert not r.done and not r.info.get("error"), r.info
        log = await env.page.evaluate("() => log")
        kinds = [(e[0], e[1], e[3], e[4]) for e in log]
        assert ("click", 0, 50, 60) in kinds
        assert ("contextmenu", 2, 70, 80) in kinds
        assert ("auxclick", 1, 90, 95) in kinds
        assert ("dblclick", 0, 60, 70) in kinds
        assert ("mousedown", 0, 100, 120) in kinds and ("mouseup", 0, 200, 220) in kinds
        assert ("mousedown", 0, 120, 130) in kinds and ("mouseup", 0, 180, 190) in kinds
        clicks = {(e[3], e[4]): e[7] for e in log if e[0] == "click"}
        assert clicks[(30, 35)] is True and clicks[(31, 36)] is False  # shift held, released

        await env.step(A.Click(20, 20))  # focus the input
        await env.step(A.TypeText("Hi there"))
        assert await env.page.input_value("#t") == "Hi there"
        await env.step(A.Key(("ctrl", "a")))
        await env.step(A.Key(("backspace",)))
        assert await env.page.input_value("#t") == ""
        log = await env.page.evaluate("() => log")
        # 'a' went down while ctrl was held
        assert any(e[0] == "keydown" and e[5] == "a" and e[6] for e in log), log

        r = await env.step(A.Scroll(200, 200, 0, 3))
        assert await env.page.evaluate("() => scrollY") == 300  # 3 notches x 100 px
        assert r.observation.screenshot[120, 20].tolist() == [255, 255, 255]  # red scrolled away

        # every canonical key name is a key Playwright knows
        for k in sorted(A.KEY_NAMES - {"f5"}):
            r = await env.step(A.Key((k,)))
            assert not r.done, (k, r.info)

        r = await env.step(A.InvalidAction("junk", "no tool call"))
        assert not r.done and r.info["invalid_action"] == "no tool call"
        r = await env.step(A.Answer("forty-two"))
        assert r.done and r.info["done_reason"] == "answer" and r.info["answer"] == "forty-two"
        r = await env.step(A.Click(1, 1))
        assert r.done and "no episode" in r.info["error"]

    run(go())


def test_network_is_closed(env, run):
    async def go():
        env.text_state = True  # the optional text state is the page's visible text
        try:
            obs = await env.reset(page_task("<html><body>hello <b>page</b></body></html>", "n"))
        finally:
            env.text_state = False
        assert obs.text == "hello page" and obs.info["url"].startswith("http://cua.local/")
        fetch = "(u) => fetch(u).then(r => 'status ' + r.status, e => 'blocked')"
        assert await env.page.evaluate(fetch, "http://example.com/") == "blocked"
        assert await env.page.evaluate(fetch, "https://pypi.org/simple/") == "blocked"
        assert await env.page.evaluate(fetch, "/builtin/style.css") == "status 200"
        with pytest.raises(EnvError, match="could not start"):
            bad = Task(
                id="ext",
                instruction="x",
                source="custom",
                spec={"kind": "page", "url": "http://example.com/"},
            )
            await env.reset(bad)

    run(go())


# Opens a peer connection whose STUN server is `stun`; resolves when ICE gathering completes
# (at once when UDP is off) or after 3 s (STUN retransmits meanwhile when it is on).
_STUN_JS = """(stun) => new Promise((done) => {
  const pc = new RTCPeerConnection({iceServers: [{urls: stun}]});
  pc.createDataChannel("x");
  pc.onicegatheringstatechange = () => { if (pc.iceGatheringState === "complete") done("done"); };
  setTimeout(() => done("timeout"), 3000);
  pc.createOffer().then((o) => pc.setLocalDescription(o));
})"""


def test_webrtc_sends_nothing(env, run):
    # A page's RTCPeerConnection is UDP to any address, unseen by request routing: a STUN server
    # on a loopback port is the probe. With UDP open it receives a request within ~0.1 s.
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.setblocking(False)

    async def go():
        await env.reset(page_task("<html><body>rtc</body></html>", "rtc"))
        return await env.page.evaluate(_STUN_JS, f"stun:127.0.0.1:{udp.getsockname()[1]}")

    try:
        run(go())
        time.sleep(0.2)  # a request sent as gathering completed is in the socket by now
        got = []
        with contextlib.suppress(BlockingIOError):
            while True:
                got.append(udp.recvfrom(2048))
    finally:
        udp.close()
    assert got == [], f"the page reached a loopback UDP port: {len(got)} packets"


def test_hung_page_and_step_timeout_end_the_episode(env, run):
    async def go():
        # a page that never finishes loading: reset fails with a reason (a hang guard, not a
        # speed check: wait_for only fires if the env itself never gives up)...
        with pytest.raises(EnvError, match="did not load"):
            await asyncio.wait_for(
                env.reset(page_task("<script>while (true) {}</script>", "hang")), 120
            )
        # ...and the next episode runs
        obs = await env.reset(suite.make_task("click-button", 1))
        assert obs.instruction.startswith("Click")

        # a click whose handler never returns: the step times out and ends the episode
        busy = "<button id=b style='width:200px;height:100px' onclick='while(true){}'>x</button>"
        await env.reset(page_task(busy, "busy"))
        r = await asyncio.wait_for(env.step(A.Click(100, 50)), 120)
        assert r.done and "timed out" in r.info["error"] and r.info["done_reason"] == "error"
        with pytest.raises(EnvError, match="ended by a fault .step timed out"):
            await env.evaluate()  # a fault is not a score of 0: nothing to train on
        # the next episode runs and can be solved
        await env.reset(suite.make_task("click-button", 2))
        r = await env.step(await env.oracle_next())
        assert r.done and await env.evaluate() == 1.0

    run(go())


def test_page_crash_ends_the_episode(env, run):
    async def go():
        await env.reset(suite.make_task("click-label", 3))
        cdp = await env.page.context.new_cdp_session(env.page)
        with __import__("contextlib").suppress(Exception):
            await asyncio.wait_for(cdp.send("Page.crash"), 2)
        r = await env.step(A.Click(10, 10))
        assert r.done and "crash" in r.info["error"], r.info
        await env.reset(suite.make_task("click-label", 3))
        r = await env.step(await env.oracle_next())
        assert r.done and await env.evaluate() == 1.0

    run(go())


def test_browser_killed_mid_episode(run):
    async def go():
        async with BrowserEnv(viewport=VIEWPORT, step_timeout_s=5.0) as env:
            await env.reset(suite.make_task("click-color", 4))
            pids = env.host.browser_pids()
            assert pids
            env.host.kill()
            r = await env.step(A.Click(100, 100))
            assert r.done and "browser crashed or was killed" in r.info["error"], r.info
            with pytest.raises(EnvError, match="ended by a fault .browser crashed or was killed"):
                await env.evaluate()
            # the next episode relaunches the browser and runs
            await env.reset(suite.make_task("click-color", 4))
            assert env.host.launches == 2 and set(env.host.browser_pids()).isdisjoint(pids)
            r = await env.step(await env.oracle_next())
            assert r.done and await env.evaluate() == 1.0

    run(go())


def test_restart_in_place_equals_fresh_load(run):
    """Cheap resets (restart the template in the same document) show the same page as a full
    page load in a brand-new context."""

    async def go():
        async with (
            BrowserHost() as host,
            BrowserEnv(viewport=VIEWPORT, host=host) as reuse,
            BrowserEnv(viewport=VIEWPORT, host=host, reuse_context=False) as fresh,
        ):
            await reuse.reset(suite.make_task("settings-panel", 1))  # a different page first
            for name in ["click-shape", "two-dropdowns"]:
                a = await reuse.reset(suite.make_task(name, 11))
                b = await fresh.reset(suite.make_task(name, 11))
                assert a.instruction == b.instruction
                assert np.array_equal(a.screenshot, b.screenshot), name

    run(go())


def test_bad_config():
    with pytest.raises(ValueError, match="viewport"):
        BrowserEnv(viewport=(10, 10))
    with pytest.raises(FileNotFoundError, match="apt-get install"):
        BrowserEnv(executable_path="/nonexistent/chromium")
