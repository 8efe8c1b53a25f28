"""`config_checks.warn_if_turns_cut`: a task kind is cut short by env.max_turns when its oracle's
solution takes more actions than that (or, not saying, when its max_steps allows more); no
preset warns about its own tasks."""

import importlib

import pytest

from cua_jax import actions as A
from cua_jax.config import checks as config_checks
from cua_jax.env_api import Task
from envs.tasks import load_tasks


@pytest.fixture
def warnings(monkeypatch):
    out = []
    monkeypatch.setattr(config_checks.logging, "warning", lambda msg, *a: out.append(msg % a))
    return out


def _task(kind, **kw):
    return Task(f"builtin/{kind}/0", "do it", "builtin", **kw)


def test_a_kind_that_allows_more_steps_than_it_takes_is_not_cut(warnings):
    config_checks.warn_if_turns_cut([_task("one-click", max_steps=5, oracle_steps=1)], 3)
    assert warnings == []


def test_a_kind_whose_oracle_takes_more_turns_is_named(warnings):
    tasks = [
        _task("fill-address", max_steps=14, oracle_steps=7),
        _task("two-clicks", oracle=[A.Click(1, 1), A.Click(2, 2)]),  # a fixed oracle's length
        _task("one-click", max_steps=5, oracle_steps=1),
    ]
    config_checks.warn_if_turns_cut(tasks, 1)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(
        "2 task kinds take more actions than config.env.max_turns=1 with their oracle's "
        "solution, up to 7;"
    ), warnings
    assert warnings[0].endswith(": builtin/fill-address, builtin/two-clicks"), warnings


def test_a_kind_that_does_not_say_is_judged_by_its_max_steps(warnings):
    config_checks.warn_if_turns_cut([_task("osworld-like", max_steps=15)], 5)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(
        "1 task kinds allow more steps than config.env.max_turns=5, up to 15, and do not say"
    ), warnings
    assert warnings[0].endswith("cannot succeed: builtin/osworld-like"), warnings


@pytest.mark.parametrize(
    "family,preset",
    [("qwen3vl_grpo", "smoke"), ("qwen3vl_grpo", "learn"), ("qwen3vl_grpo", "8b")]
    + [("qwen25vl_grpo", "smoke"), ("qwen35_grpo", "smoke")],
)
def test_no_preset_warns_about_its_own_tasks(warnings, family, preset):
    c = importlib.import_module(f"configs.{family}").get_config(preset)
    tasks = load_tasks([dict(t) for t in (*c.tasks, *c.eval_tasks)])
    config_checks.warn_if_turns_cut(tasks, c.env.max_turns)
    assert warnings == []
