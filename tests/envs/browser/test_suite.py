"""The built-in suite through the real browser env: oracle solves every template for 4 seeds (10
with CUA_LONG_TESTS=1), a random policy rarely does, untouched pages score 0, seeds are
deterministic."""

import math
import os
import random

import numpy as np
import pytest

from cua_jax import actions as A
from envs.browser import BrowserPool, suite

VIEWPORT = (320, 240)
N_ENVS = 4


@pytest.fixture(scope="module")
def pool(run):
    # These tests check the tasks, not speed: a generous step timeout, so that a CI machine whose
    # two cores are shared with JAX compiles and other jobs does not turn a slow step into a
    # "hung page" fault (one did at 15 s, under load average ~4.7). test_env.py tests the fault.
    p = BrowserPool(N_ENVS, viewport=VIEWPORT, step_timeout_s=60.0)
    run(p.__aenter__())
    yield p
    run(p.close())


async def _oracle_episode(env, task):
    obs = await env.reset(task)
    before = await env.evaluate()
    actions = 0  # what Task.oracle_steps counts: scrolls not
    for _ in range(task.max_steps + 5):  # + room for the Scrolls the oracle inserts
        action = await env.oracle_next()
        res = await env.step(action)
        actions += not isinstance(action, A.Scroll)
        assert not res.info.get("error") and not res.info.get("invalid_action"), res.info
        if res.done:
            break
    return before, await env.evaluate(), res.done, obs.instruction, actions


# every template's oracle on 4 seeds; 10 with CUA_LONG_TESTS=1 (~3 min on 2 cores)
ORACLE_SEEDS = 10 if os.environ.get("CUA_LONG_TESTS") else 4


def test_oracle_solves_every_template_on_several_seeds(pool, run):
    tasks = [suite.make_task(t.name, seed) for t in suite.TEMPLATES for seed in range(ORACLE_SEEDS)]
    results = run(pool.map(_oracle_episode, tasks))
    failed = []
    for task, r in zip(tasks, results, strict=True):
        if isinstance(r, BaseException) or r[1] != 1.0 or r[0] != 0.0 or not r[2]:
            failed.append((task.id, r))
    assert not failed, failed[:5]
    # the config check's count of the turns a task needs (config_checks.warn_if_turns_cut)
    pairs = zip(tasks, results, strict=True)
    over = [(t.id, r[4], t.oracle_steps) for t, r in pairs if r[4] > t.oracle_steps]
    assert not over, over
    assert pool.host.launches == 1  # one browser process hosted every context


async def _random_episode(env, task, seed):
    rng = random.Random(seed)
    w, h = VIEWPORT
    await env.reset(task)
    keys = ["enter", "tab", "a", "1", "backspace", "pagedown"]
    for _ in range(task.max_steps):
        u = rng.random()
        if u < 0.6:
            a = A.Click(rng.uniform(0, w - 1), rng.uniform(0, h - 1), count=rng.choice([1, 1, 2]))
        elif u < 0.75:
            a = A.TypeText(rng.choice(["hello", "42", "apple"]))
        elif u < 0.9:
            a = A.Key((rng.choice(keys),))
        else:
            a = A.Scroll(rng.uniform(0, w - 1), rng.uniform(0, h - 1), 0, rng.choice([-3, 3]))
        res = await env.step(a)
        assert not res.info.get("error"), res.info
        if res.done:
            break
    return await env.evaluate()


def test_random_policy_rarely_succeeds(pool, run):
    tasks = [suite.make_task(t.name, 100 + s) for t in suite.TEMPLATES for s in range(2)]
    jobs = [(t, i) for i, t in enumerate(tasks)]
    scores = run(pool.map(lambda env, ti: _random_episode(env, *ti), jobs))
    assert not [s for s in scores if isinstance(s, BaseException)], scores
    rate = float(np.mean(scores))
    print(f"\nrandom-policy success rate over {len(tasks)} episodes: {rate:.3f}")
    assert rate < 0.25


def test_seeded_pages_are_deterministic(pool, run):
    async def go(env, name):
        a = await env.reset(suite.make_task(name, 7))
        b = await env.reset(suite.make_task(name, 7))
        c = await env.reset(suite.make_task(name, 8))
        return a, b, c

    names = ["click-color", "click-shape", "login-form", "settings-panel", "nav-two-level"]
    differ = 0
    for name, (a, b, c) in zip(names, run(pool.map(go, names)), strict=True):
        assert a.instruction == b.instruction and np.array_equal(a.screenshot, b.screenshot), name
        assert a.screenshot.shape == (VIEWPORT[1], VIEWPORT[0], 3)
        differ += a.instruction != c.instruction
    assert differ >= 4  # another seed gives another task instance


_BOXES_JS = """(sel) => Array.from(document.querySelectorAll(sel)).map((e) => {
  const r = e.getBoundingClientRect(); return [e.id, r.left, r.top, r.right, r.bottom]; })"""


def _centre(box):
    return (box[1] + box[3]) / 2, (box[2] + box[4]) / 2


def _closeness(click, box):
    """The checker's closeness of one click to one target box, computed here from the boxes."""
    x, y = click
    dx, dy = max(box[1] - x, 0, x - box[3]), max(box[2] - y, 0, y - box[4])
    return math.exp(-math.hypot(dx, dy) / (0.1 * math.hypot(*VIEWPORT)))


async def _report_after(env, task, pick):
    """Reset, click where `pick(boxes, target_sel)` says (or nowhere: None), score, report."""
    await env.reset(task)
    page = env._page
    boxes = await page.evaluate(_BOXES_JS, "#root button, #root input")
    plan = await page.evaluate("() => cua.plan()")
    sels = [st["sel"] for st in plan if st["op"] == "click"]
    click = pick(boxes, sels)
    if click is not None:
        await env.step(A.Click(*click))
    return boxes, click, await env.evaluate(), await env.report(), sels


def test_checker_report_says_what_was_clicked_where_the_target_was_and_how_close(pool, run):
    """The built-in checker's report (`cua.report` via `BrowserEnv.report`): the clicks and
    what they hit, the plan's targets with their centres, and the closeness computed here from
    the element boxes; a message in the policy's coordinates."""
    by_id = lambda boxes, sel: next(b for b in boxes if "#" + b[0] == sel)  # noqa: E731

    def wrong(boxes, sels):  # the centre of a button the plan does not click
        return _centre(next(b for b in boxes if "#" + b[0] not in sels and b[0].startswith("b-")))

    def submit_only(boxes, sels):
        return _centre(by_id(boxes, "#submit"))

    jobs = [
        (suite.make_task("click-label", 3), wrong),
        (suite.make_task("radio-pick", 4), submit_only),
        (suite.make_task("click-label", 5), lambda boxes, sels: None),
    ]
    out = run(pool.map(lambda env, j: _report_after(env, *j), jobs))
    (boxes, click, score, rep, _), (rboxes, _, rscore, rrep, rsels), (*_, nscore, nrep, _) = out

    # click-label: a wrong button, so score 0, one click on it, one target elsewhere
    assert score == 0.0 and len(rep.clicks) == 1 and len(rep.targets) == 1
    (cx, cy, hit), (label, tx, ty) = rep.clicks[0], rep.targets[0]
    assert abs(cx - click[0]) <= 1 and abs(cy - click[1]) <= 1
    target = next(b for b in boxes if b[0] == "b-" + label)
    assert hit != label and (tx, ty) == tuple(round(v) for v in _centre(target))
    assert rep.closeness == pytest.approx(_closeness((cx, cy), target), rel=1e-6)
    assert 0 < rep.closeness < 1
    space = A.CoordinateSpace.relative(*VIEWPORT)
    mx, my = space.to_model(cx, cy)
    assert rep.message(space.to_model) == (
        f'Clicked "{hit}" at ({mx}, {my}); the target was "{label}" at {space.to_model(tx, ty)}.'
    )

    # radio-pick, Submit clicked without a choice: two targets (the radio, Submit); the mean of
    # the radio's closeness and Submit's 1
    (rx, ry, rhit), radio = rrep.clicks[0], by_id(rboxes, rsels[0])
    assert rscore == 0.0 and rhit == "Submit" and [t[0] for t in rrep.targets][1] == "Submit"
    assert rrep.closeness == pytest.approx((_closeness((rx, ry), radio) + 1.0) / 2, rel=1e-6)

    # no click at all: closeness 0, and the message says so
    assert nscore == 0.0 and nrep.clicks == () and nrep.closeness == 0.0
    assert nrep.message().startswith("Made no click; the target was")


async def _note_after(env, task, play):
    """Reset, let `play(page)` act on the page through Playwright, score, the report's note."""
    obs = await env.reset(task)
    await play(env._page)
    return obs.instruction, await env.evaluate(), (await env.report()).note


def _quoted(instruction):
    return instruction.split('"')[1::2]


def test_checker_notes_say_what_a_form_or_choice_holds_and_what_it_should(pool, run):
    """The form, choice and toggle templates' `cua.explain`: each wrong field's value and the
    wanted one, whether the form was sent; nothing to say about a solved task."""

    async def wrong_word(page):
        await page.fill("#field", "wrong")
        await page.click("#submit")

    async def name_only(page):
        name = (await page.evaluate("() => cua.instruction")).split('"')[1]
        await page.fill("#name", name)

    async def submit_only(page):
        await page.click("#submit")

    async def nothing(page):
        pass

    async def solve(page):
        await page.fill("#field", _quoted(await page.evaluate("() => cua.instruction"))[0])
        await page.click("#submit")

    jobs = [
        (suite.make_task("type-word", 1), wrong_word),
        (suite.make_task("enter-name-email", 2), name_only),
        (suite.make_task("radio-pick", 3), submit_only),
        (suite.make_task("toggle-switch", 4), nothing),
        (suite.make_task("type-word", 5), solve),
    ]
    out = run(pool.map(lambda env, j: _note_after(env, *j), jobs))
    (ins, score, note) = out[0]
    assert score == 0.0
    assert note == f'The text box holds "wrong"; it should hold "{_quoted(ins)[0]}".'
    (ins, score, note) = out[1]
    assert note == (
        f'The Email field is empty; it should hold "{_quoted(ins)[1]}". '
        "Clicking Submit was not done."
    )
    (ins, score, note) = out[2]
    assert note == f'No option is chosen; it should be "{_quoted(ins)[0]}".'
    (ins, score, note) = out[3]
    assert ins == "Turn Sync off, then click Save." and score == 0.0
    assert note == "Sync is on; it should be off. Clicking Save was not done."
    (ins, score, note) = out[4]
    assert score == 1.0 and note == ""


def test_splits_and_templates():
    assert len(suite.TEMPLATES) >= 30
    assert set(suite.CATEGORIES) == {t.category for t in suite.TEMPLATES}
    train = suite.sample_tasks("train", limit=200, seed=1)
    evals = suite.sample_tasks("eval", limit=200, seed=1)
    heldout = {t.name for t in suite.TEMPLATES if t.heldout}
    assert heldout and not heldout & {t.spec["template"] for t in train}
    assert heldout <= {t.spec["template"] for t in evals}
    assert max(t.seed for t in train) < suite.EVAL_SEED_OFFSET <= min(t.seed for t in evals)
    assert [t.id for t in train] == [t.id for t in suite.sample_tasks("train", limit=200, seed=1)]
    # every template the Python side lists is defined by templates*.js (and vice versa)
    static = suite.__file__.rsplit("/", 1)[0] + "/static/"
    src = "".join(open(static + name).read() for name in ("templates.js", "templates_retry.js"))
    defined = set(__import__("re").findall(r'T\["([a-z0-9-]+)"\] =', src))
    assert defined == set(suite.BY_NAME)
