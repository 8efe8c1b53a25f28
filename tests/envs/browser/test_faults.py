"""Fault injection on BrowserEnv: Chromium killed before reset, during a step and before
evaluate never turns into a score. A killed browser before reset is relaunched (the episode is
a normal one) or, when it cannot be, reset raises; a kill during a step ends the episode with
``info["error"]``; evaluate raises EnvError naming the cause, so the rollout loop counts the
episode as an infrastructure fault (``evaluate_error``) instead of a policy failure scored 0.
A checker's own 0 (a wrong answer) is still 0."""

import asyncio

import pytest

from cua_jax import actions as A
from cua_jax.env_api import EnvError
from envs.browser import BrowserEnv, suite

VIEWPORT = (320, 240)


def _env() -> BrowserEnv:
    # A generous step timeout: a step on a loaded CI machine must not time out on its own.
    return BrowserEnv(viewport=VIEWPORT, step_timeout_s=20.0, reset_timeout_s=20.0)


def test_evaluate_before_reset_raises(run):
    async def go():
        async with _env() as env:
            with pytest.raises(EnvError, match="no episode to score"):
                await env.evaluate()

    run(go())


def test_killed_before_evaluate_raises_not_zero(run):
    """The issue's repro: a correct click-button step, Chromium killed, then evaluate."""

    async def go():
        async with _env() as env:
            await env.reset(suite.make_task("click-button", 1))
            r = await env.step(await env.oracle_next())
            assert r.done and not r.info.get("error"), r.info
            env.host.kill()
            with pytest.raises(EnvError, match="cannot score task 'builtin/click-button/1'"):
                await env.evaluate()
            # the next episode relaunches the browser and is scored normally
            await env.reset(suite.make_task("click-button", 2))
            r = await env.step(await env.oracle_next())
            assert r.done and await env.evaluate() == 1.0
            assert env.host.launches == 2

    run(go())


def test_killed_mid_step_ends_the_episode_and_evaluate_raises(run):
    async def go():
        async with _env() as env:
            await env.reset(suite.make_task("click-button", 3))

            async def kill_soon():
                await asyncio.sleep(0.5)
                env.host.kill()

            # the kill lands while the step waits in the page
            r, _ = await asyncio.gather(env.step(A.Wait(3.0)), kill_soon())
            assert r.done and r.info["done_reason"] == "error", r.info
            assert "browser crashed or was killed" in r.info["error"], r.info
            with pytest.raises(EnvError, match="ended by a fault .browser crashed or was killed"):
                await env.evaluate()

    run(go())


def test_killed_before_reset_relaunches_or_raises(run):
    async def go():
        async with _env() as env:
            await env.reset(suite.make_task("click-button", 4))
            env.host.kill()
            # a dead browser before an episode costs nothing: reset relaunches it
            await env.reset(suite.make_task("click-button", 4))
            assert env.host.launches == 2
            r = await env.step(await env.oracle_next())
            assert r.done and await env.evaluate() == 1.0
            # a browser that cannot be relaunched: reset raises, naming the cause
            env.host.kill()
            env.host.executable_path = "/nonexistent/chromium"
            with pytest.raises(EnvError, match="could not start: .*nonexistent/chromium"):
                await env.reset(suite.make_task("click-button", 5))
            with pytest.raises(EnvError, match="ended by a fault .the task could not start"):
                await env.evaluate()

    run(go())


def test_wrong_answer_scores_zero_without_raising(run):
    async def go():
        async with _env() as env:
            await env.reset(suite.make_task("click-button", 6))
            r = await env.step(A.Click(1, 1))  # a corner, no button there
            assert not r.info.get("error"), r.info
            assert await env.evaluate() == 0.0

    run(go())
