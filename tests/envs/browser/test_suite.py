"""The built-in suite through the real browser env: oracle solves every template for 10 seeds,
a random policy rarely does, untouched pages score 0, seeds are deterministic."""

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
    for _ in range(task.max_steps + 5):  # + room for the Scrolls the oracle inserts
        res = await env.step(await env.oracle_next())
        assert not res.info.get("error") and not res.info.get("invalid_action"), res.info
        if res.done:
            break
    return before, await env.evaluate(), res.done, obs.instruction


def test_oracle_solves_every_template_10_seeds(pool, run):
    tasks = [suite.make_task(t.name, seed) for t in suite.TEMPLATES for seed in range(10)]
    results = run(pool.map(_oracle_episode, tasks))
    failed = []
    for task, r in zip(tasks, results, strict=True):
        if isinstance(r, BaseException) or r[1] != 1.0 or r[0] != 0.0 or not r[2]:
            failed.append((task.id, r))
    assert not failed, failed[:5]
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
    # every template the Python side lists is defined by templates.js (and vice versa)
    js = suite.__file__.rsplit("/", 1)[0] + "/static/templates.js"
    with open(js) as f:
        src = f.read()
    defined = set(__import__("re").findall(r'T\["([a-z0-9-]+)"\] =', src))
    assert defined == set(suite.BY_NAME)
