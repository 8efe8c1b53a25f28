"""Per-env resource limits: a page that allocates without end crashes only its own renderer
(the JavaScript heap cap, ``page_memory_mb``); its episode is a fault, the env's next reset
works, and an env in the same browser plays its episode meanwhile."""

import asyncio

import pytest

from cua_jax import actions as A
from cua_jax.env_api import INFO_ERROR, Task
from envs.browser import BrowserHost, BrowserPool, suite

HOG = """<!DOCTYPE html><html><body style="margin:0">
<button id="b" style="width:320px;height:240px"
 onclick="const a = []; while (true) a.push(new Array(1e6).fill(Math.random()));">eat</button>
</body></html>"""


def test_a_runaway_page_crashes_alone(run):
    async def go():
        async with BrowserPool(
            2, viewport=(320, 240), page_memory_mb=64, step_timeout_s=60.0
        ) as pool:
            hog_task = Task("custom/hog", "click", "custom", spec={"kind": "page", "html": HOG})
            good_task = suite.make_task("enter-name-email", 4)

            async def hog():
                async with pool.acquire() as env:
                    await env.reset(hog_task)
                    res = await env.step(A.Click(160.0, 120.0))
                    again = await env.reset(suite.make_task("click-button", 2))
                    steps = 0
                    while True:
                        r = await env.step(await env.oracle_next())
                        steps += 1
                        if r.done:
                            break
                    return res, again, await env.evaluate()

            async def good():
                async with pool.acquire() as env:
                    await env.reset(good_task)
                    while True:
                        r = await env.step(await env.oracle_next())
                        assert not r.info.get(INFO_ERROR), r.info
                        if r.done:
                            return await env.evaluate()

            return await asyncio.gather(hog(), good()), pool.host.launches

    ((res, again, score_after), good_score), launches = run(go())
    assert res.done and "crash" in res.info[INFO_ERROR], res.info
    assert again.instruction and score_after == 1.0
    assert good_score == 1.0 and launches == 1  # one browser throughout


def test_page_memory_cap_is_validated():
    with pytest.raises(ValueError, match="page_memory_mb"):
        BrowserHost(page_memory_mb=1)
    assert "--js-flags=--max-old-space-size=256" in BrowserHost(page_memory_mb=256).extra_args
