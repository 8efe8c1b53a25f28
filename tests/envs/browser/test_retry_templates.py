"""The forgiving one-click templates (static/templates_retry.js) in Chromium: a wrong pick is
crossed out and the episode goes on; a second click on it does nothing; the target then ends
the episode with score 1. The base template at the same page ends on the wrong pick, scored 0."""

import pytest

from cua_jax import actions as A
from envs.browser import BrowserPool, suite

VIEWPORT = (384, 288)
RETRY = {"retry-color": "click-color", "retry-label": "click-label", "retry-tabs": "nav-tabs"}
CANDIDATES = {"retry-color": "#root button", "retry-label": "#root button"}
CANDIDATES["retry-tabs"] = "#root .tabs span:not(:first-child)"  # the first tab is open already

_BOXES_JS = """(sel) => Array.from(document.querySelectorAll(sel)).map((e) => {
  const r = e.getBoundingClientRect();
  return ['#' + e.id, (r.left + r.right) / 2, (r.top + r.bottom) / 2, e.style.opacity]; })"""


@pytest.fixture(scope="module")
def pool(run):
    p = BrowserPool(3, viewport=VIEWPORT, step_timeout_s=60.0)
    run(p.__aenter__())
    yield p
    run(p.close())


async def _wrong_then_target(env, task):
    await env.reset(task)
    page = env._page
    sel = CANDIDATES[task.spec["template"]]
    target = [st["sel"] for st in await page.evaluate("() => cua.plan()")][0]
    boxes = await page.evaluate(_BOXES_JS, sel)
    wrong = next(b for b in boxes if b[0] != target)
    goal = next(b for b in boxes if b[0] == target)
    first = await env.step(A.Click(wrong[1], wrong[2]))
    again = await env.step(A.Click(wrong[1], wrong[2]))  # crossed out: nothing happens
    score_mid = await env.evaluate()
    crossed = await page.evaluate(_BOXES_JS, wrong[0])
    last = await env.step(A.Click(goal[1], goal[2]))
    return first.done, again.done, score_mid, crossed[0][3], last.done, await env.evaluate()


async def _wrong_on_base(env, task):
    await env.reset(task)
    page = env._page
    sel = CANDIDATES[
        "retry-"
        + {"click-color": "color", "click-label": "label"}.get(task.spec["template"], "tabs")
    ]
    target = [st["sel"] for st in await page.evaluate("() => cua.plan()")][0]
    wrong = next(b for b in await page.evaluate(_BOXES_JS, sel) if b[0] != target)
    res = await env.step(A.Click(wrong[1], wrong[2]))
    return res.done, await env.evaluate()


def test_wrong_pick_is_crossed_out_and_the_episode_goes_on(pool, run):
    tasks = [suite.make_task(name, seed) for name in RETRY for seed in range(4)]
    results = run(pool.map(_wrong_then_target, tasks))
    for task, r in zip(tasks, results, strict=True):
        assert not isinstance(r, BaseException), (task.id, r)
        first_done, again_done, score_mid, opacity, last_done, score = r
        assert (first_done, again_done, score_mid) == (False, False, 0.0), (task.id, r)
        assert opacity == "0.3", (task.id, r)
        assert (last_done, score) == (True, 1.0), (task.id, r)


def test_base_templates_still_end_on_a_wrong_pick(pool, run):
    tasks = [suite.make_task(base, seed) for base in RETRY.values() for seed in range(2)]
    for task, r in zip(tasks, run(pool.map(_wrong_on_base, tasks)), strict=True):
        assert r == (True, 0.0), (task.id, r)


def test_retry_templates_are_listed_only_when_named():
    assert not {t.name for t in suite.templates_for("train")} & set(RETRY)
    assert not {t.name for t in suite.templates_for("eval", category="click")} & set(RETRY)
    named = suite.templates_for("eval", names=["retry-label", "click-label"])
    assert [t.name for t in named] == ["click-label", "retry-label"]
