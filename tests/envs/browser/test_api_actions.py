"""Browser API actions (open_url, fill, select_option) on real pages of the built-in suite, and
the oracle that uses them where a task allows them (fewer steps than the GUI-only oracle)."""

import dataclasses

import pytest

from cua_jax import actions as A
from cua_jax.env_api import INFO_API_RESULT, INFO_INVALID_ACTION
from envs.browser import BrowserPool, suite
from envs.browser.pages import ORIGIN

VIEWPORT = (480, 360)
ALL = A.BROWSER_API


@pytest.fixture(scope="module")
def pool(run):
    p = BrowserPool(2, viewport=VIEWPORT, step_timeout_s=60.0)
    run(p.__aenter__())
    yield p
    run(p.close())


def _task(name, seed=3, api=ALL):
    return suite.make_task(name, seed, api_actions=api)


async def _values(page, *sels):
    return [await page.eval_on_selector(s, "e => e.value") for s in sels]


def test_fill_then_submit_solves_a_form(pool, run):
    async def go():
        async with pool.acquire() as env:
            obs = await env.reset(_task("enter-name-email", 7))
            name, email = obs.instruction.split('"')[1], obs.instruction.split('"')[3]
            r1 = await env.step(A.Fill("Name", name))
            r2 = await env.step(A.Fill("email", email))  # a case-insensitive label match
            vals = await _values(env.page, "#name", "#email")
            # fill replaces what the field held
            await env.step(A.Fill("Name", "junk"))
            await env.step(A.Fill("Name", name))
            vals2 = await _values(env.page, "#name")
            await env.step(A.Click(*await _center(env.page, "#submit")))
            return r1, r2, vals, vals2, await env.evaluate(), (name, email)

    r1, r2, vals, vals2, score, (name, email) = run(go())
    assert INFO_INVALID_ACTION not in r1.info and "filled" in r1.info[INFO_API_RESULT]
    assert INFO_INVALID_ACTION not in r2.info
    assert vals == [name, email] and vals2 == [name]
    assert score == 1.0


async def _center(page, sel):
    b = await page.eval_on_selector(
        sel,
        "e => { const r = e.getBoundingClientRect(); "
        "return [r.left + r.width / 2, r.top + r.height / 2]; }",
    )
    return float(b[0]), float(b[1])


def test_select_option_in_a_select_box_and_an_aria_dropdown(pool, run):
    async def go():
        async with pool.acquire() as env:
            obs = await env.reset(_task("listbox-pick", 5))
            want = obs.instruction.split('"')[1]
            r = await env.step(A.SelectOption("List", want))
            got = await _values(env.page, "#list")
            obs = await env.reset(_task("two-dropdowns", 2))
            words = obs.instruction.removesuffix(", then click Add.").split()
            size, color = words[2], words[-1]
            r2 = await env.step(A.SelectOption("Size", size))
            r3 = await env.step(A.SelectOption("Color", color.upper()))  # no exact: casefold
            bad = await env.step(A.SelectOption("Size", "XXXL"))
            texts = [await env.page.inner_text(s) for s in ("#size-btn", "#color-btn")]
            await env.step(A.Click(*await _center(env.page, "#submit")))
            return r, got, want, r2, r3, bad, texts, size, color, await env.evaluate()

    r, got, want, r2, r3, bad, texts, size, color, score = run(go())
    assert INFO_INVALID_ACTION not in r.info and got == [want]
    assert INFO_INVALID_ACTION not in r2.info and INFO_INVALID_ACTION not in r3.info, (r2, r3)
    assert (
        "no option" in bad.info[INFO_INVALID_ACTION] or "option(s)" in bad.info[INFO_INVALID_ACTION]
    )
    assert texts[0].startswith(size) and texts[1].startswith(color)
    assert score == 1.0


def test_open_url_loads_our_pages_and_never_the_network(pool, run):
    async def go():
        async with pool.acquire() as env:
            await env.reset(_task("nav-link", 4))
            target = f"{ORIGIN}/builtin/task.html?t=click-button&seed=9"
            ok = await env.step(A.OpenUrl(target))
            url_ok = env.page.url
            rel = await env.step(A.OpenUrl("task.html?t=click-color&seed=1"))
            url_rel = env.page.url
            out = [
                await env.step(A.OpenUrl(u))
                for u in (
                    "https://example.com/",
                    "javascript:alert(1)",
                    "file:///etc/passwd",
                    "http://cua.local.evil.com/x",
                    "data:text/html,<b>x</b>",
                )
            ]
            return ok, url_ok, target, rel, url_rel, out, env.page.url

    ok, url_ok, target, rel, url_rel, out, final = run(go())
    assert INFO_INVALID_ACTION not in ok.info and url_ok == target
    assert "HTTP 200" in ok.info[INFO_API_RESULT]
    assert url_rel.endswith("task.html?t=click-color&seed=1")
    for r in out:
        assert "network is closed" in r.info[INFO_INVALID_ACTION] and not r.done
    assert final == url_rel  # the refused ones never navigated


def test_api_actions_refused_unless_the_task_allows_them(pool, run):
    async def go():
        async with pool.acquire() as env:
            await env.reset(_task("enter-name-email", api=()))
            gui_only = await env.step(A.Fill("Name", "x"))
            await env.reset(_task("enter-name-email", api=("select_option",)))
            other = await env.step(A.Fill("Name", "x"))
            vm = await env.step(A.RunShell("ls"))
            missing = (await env.reset(_task("enter-name-email"))) and await env.step(
                A.Fill("Telephone", "1")
            )
            not_text = await env.step(A.SelectOption("Name", "x"))
            vals = await _values(env.page, "#name")
            return gui_only, other, vm, missing, not_text, vals

    gui_only, other, vm, missing, not_text, vals = run(go())
    assert "does not allow the API action fill; use GUI" in gui_only.info[INFO_INVALID_ACTION]
    assert "allowed: select_option" in other.info[INFO_INVALID_ACTION]
    assert "not a browser API action" in vm.info[INFO_INVALID_ACTION]
    assert "no field(s) labelled 'Telephone'" in missing.info[INFO_INVALID_ACTION]
    assert "not a select box" in not_text.info[INFO_INVALID_ACTION]
    assert vals == [""] and not any(r.done for r in (gui_only, other, vm, missing, not_text))


def test_make_task_rejects_unknown_and_vm_api_names():
    with pytest.raises(ValueError, match="unknown API action"):
        suite.make_task("type-word", 1, api_actions=("rm",))
    with pytest.raises(ValueError, match="only browser API actions"):
        suite.make_task("type-word", 1, api_actions=("run_shell",))


API_TEMPLATES = (
    "enter-name-email",
    "login-form",
    "fill-address",
    "listbox-pick",
    "dropdown-pick",
    "two-dropdowns",
    "enter-number",
    "edit-profile",
)


async def _oracle_steps(env, task):
    await env.reset(task)
    acts = []
    for _ in range(task.max_steps + 5):
        a = await env.oracle_next()
        acts.append(a)
        res = await env.step(a)
        assert not res.info.get("error") and not res.info.get("invalid_action"), (a, res.info)
        if res.done:
            break
    return acts, await env.evaluate()


def test_oracle_with_api_actions_solves_in_fewer_steps(pool, run):
    """Per template and seed: the oracle allowed the browser API solves the task with API
    actions, in fewer steps than the GUI-only oracle (as many for a select box's option)."""
    rows = {}
    for name in API_TEMPLATES:
        for seed in (0, 1, 2):
            gui = _task(name, seed, api=())
            api = dataclasses.replace(gui, api_actions=ALL)
            ga, gs = run(_oracle_steps_on(pool, gui))
            aa, as_ = run(_oracle_steps_on(pool, api))
            assert gs == 1.0 and as_ == 1.0, (name, seed, gs, as_)
            assert not any(A.api_name(a) for a in ga)
            assert any(A.api_name(a) for a in aa), (name, aa)
            # a select box's option is one click either way; elsewhere API saves steps
            assert len(aa) < len(ga) or (name == "listbox-pick" and len(aa) == len(ga)), (
                name,
                seed,
                aa,
                ga,
            )
            rows.setdefault(name, []).append((len(ga), len(aa)))
    print("\ntemplate: (GUI oracle steps, API oracle steps) for seeds 0, 1, 2")
    for name, steps in rows.items():
        print(f"{name}: {steps}")


async def _oracle_steps_on(pool, task):
    async with pool.acquire() as env:
        return await _oracle_steps(env, task)


def test_oracle_without_fusable_steps_stays_gui(pool, run):
    task = _task("click-button", 1)
    acts, score = run(_oracle_steps_on(pool, task))
    assert score == 1.0 and not any(A.api_name(a) for a in acts)


def test_builtin_task_source_takes_api_actions():
    from envs.tasks import TaskSourceError, load_tasks

    src = {"source_type": "builtin", "category": "forms", "limit": 3, "api_actions": ["fill"]}
    assert all(t.api_actions == ("fill",) for t in load_tasks(src))
    assert all(t.api_actions == () for t in load_tasks({**src, "api_actions": []}))
    with pytest.raises(TaskSourceError, match="unknown API action"):
        load_tasks({**src, "api_actions": ["fil"]})
