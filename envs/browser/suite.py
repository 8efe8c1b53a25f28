"""The built-in browser task suite: template metadata, splits and seeds.

The pages and their logic (seeded layout, checker, oracle plan) are in ``static/templates.js``;
this file says which templates exist, their category and difficulty, which are held out of the
training split, and turns (template, seed) into :class:`cua_jax.env_api.Task` values.

Splits: the train split uses the non-held-out templates with seeds in [0, 10**9); the eval split
uses every template (held-out ones included) with seeds in [10**9, 2 * 10**9), so no eval episode
repeats a training page.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

from cua_jax import actions as A
from cua_jax.env_api import Task

CATEGORIES = ("click", "forms", "select", "toggles", "scroll", "navigation", "workflow")
EVAL_SEED_OFFSET = 10**9


@dataclasses.dataclass(frozen=True)
class Template:
    name: str
    category: str
    difficulty: str
    summary: str  # what the task asks, with the seeded parts left generic
    heldout: bool = False  # eval split only
    max_steps: int = 10
    # the most actions the oracle's plan (static/templates.js) takes over seeds, scrolls not
    # counted; test_suite.py checks it for every template
    oracle_steps: int = 1
    # only when named (`templates_for(names=...)`): variants that would otherwise change the
    # task lists of every config that takes a whole split or category
    opt_in: bool = False


TEMPLATES: tuple[Template, ...] = (
    # click
    Template(
        "click-button", "click", "easy", "Click the named button (one big button).", max_steps=5
    ),
    Template("click-color", "click", "easy", "Click the button of the named color.", max_steps=5),
    Template("click-label", "click", "easy", "Click the button with the given label.", max_steps=5),
    Template("click-link", "click", "easy", "Click the link with the given text.", max_steps=5),
    Template(
        "click-shape",
        "click",
        "medium",
        "Click the shape of the given color and kind.",
        heldout=True,
        max_steps=5,
    ),
    Template(
        "double-click", "click", "medium", "Double-click the box of the given color.", max_steps=5
    ),
    Template("right-click", "click", "medium", "Right-click the named file.", max_steps=5),
    Template(
        "click-sequence",
        "click",
        "medium",
        "Click two named buttons in order.",
        max_steps=6,
        oracle_steps=2,
    ),
    # forms
    Template(
        "type-word", "forms", "medium", "Type a word into a text box and submit.", oracle_steps=3
    ),
    Template(
        "enter-name-email",
        "forms",
        "medium",
        "Fill in a name and an email and submit.",
        max_steps=12,
        oracle_steps=5,
    ),
    Template(
        "login-form",
        "forms",
        "medium",
        "Log in with the given username and password.",
        max_steps=12,
        oracle_steps=5,
    ),
    Template("enter-number", "forms", "medium", "Enter a number and press Enter.", oracle_steps=3),
    Template(
        "search-query",
        "forms",
        "medium",
        "Search for the given words.",
        heldout=True,
        oracle_steps=3,
    ),
    Template(
        "copy-text",
        "forms",
        "hard",
        "Type the phrase shown on the page and submit.",
        oracle_steps=3,
    ),
    Template(
        "fill-address",
        "forms",
        "hard",
        "Fill in a three-field address and save.",
        max_steps=14,
        oracle_steps=7,
    ),
    # select
    Template(
        "radio-pick",
        "select",
        "easy",
        "Select the named radio option and submit.",
        max_steps=6,
        oracle_steps=2,
    ),
    Template(
        "listbox-pick",
        "select",
        "medium",
        "Choose the named item in a list box and submit.",
        oracle_steps=2,
    ),
    Template(
        "dropdown-pick",
        "select",
        "medium",
        "Pick the named option from a dropdown, submit.",
        heldout=True,
        oracle_steps=3,
    ),
    Template(
        "two-dropdowns",
        "select",
        "hard",
        "Choose a size and a color from two dropdowns.",
        max_steps=12,
        oracle_steps=5,
    ),
    Template(
        "pick-day",
        "select",
        "medium",
        "Pick the given day in a calendar and confirm.",
        oracle_steps=2,
    ),
    # toggles
    Template(
        "toggle-switch",
        "toggles",
        "easy",
        "Turn one setting on or off and save.",
        max_steps=6,
        oracle_steps=2,
    ),
    Template(
        "checkbox-set",
        "toggles",
        "medium",
        "Check exactly the named boxes and submit.",
        heldout=True,
        max_steps=12,
        oracle_steps=4,
    ),
    Template(
        "settings-panel",
        "toggles",
        "hard",
        "Set four switches as asked and save.",
        max_steps=12,
        oracle_steps=5,
    ),
    Template("set-slider", "toggles", "hard", "Set a slider to a value and save.", oracle_steps=2),
    # scroll
    Template("scroll-button", "scroll", "medium", "Scroll down to a button and click it."),
    Template(
        "scroll-list",
        "scroll",
        "medium",
        "Scroll a list box and click the named item.",
        heldout=True,
    ),
    Template("scroll-answer", "scroll", "hard", "Scroll to the bottom and answer the code word."),
    Template(
        "scroll-agree",
        "scroll",
        "medium",
        "Scroll a terms box, tick I agree, continue.",
        oracle_steps=2,
    ),
    # navigation (real page loads)
    Template("nav-link", "navigation", "easy", "Go to the named page via the menu.", max_steps=5),
    Template("nav-tabs", "navigation", "easy", "Open the named tab.", max_steps=5),
    Template(
        "nav-two-level",
        "navigation",
        "medium",
        "Open a product page via its category.",
        max_steps=8,
        oracle_steps=2,
    ),
    Template(
        "nav-breadcrumb",
        "navigation",
        "medium",
        "Go up to the named page via breadcrumbs.",
        heldout=True,
        max_steps=5,
    ),
    # workflow (several steps, several pages)
    Template(
        "login-then-setting",
        "workflow",
        "hard",
        "Log in, then change a setting and save.",
        max_steps=15,
        oracle_steps=7,
    ),
    Template(
        "cart-checkout",
        "workflow",
        "hard",
        "Add an item to the cart and check out.",
        max_steps=10,
        oracle_steps=3,
    ),
    Template(
        "compose-email",
        "workflow",
        "hard",
        "Compose and send an email.",
        max_steps=12,
        oracle_steps=6,
    ),
    Template(
        "delete-confirm",
        "workflow",
        "medium",
        "Delete the named file and confirm.",
        heldout=True,
        max_steps=6,
        oracle_steps=2,
    ),
    Template("rename-file", "workflow", "hard", "Rename a file in place.", oracle_steps=3),
    Template(
        "edit-profile",
        "workflow",
        "hard",
        "Open the profile, edit the city, save.",
        max_steps=12,
        oracle_steps=5,
    ),
)
# Forgiving variants of three one-click templates (static/templates_retry.js): a wrong pick is
# crossed out and the episode goes on, so trying another candidate after a miss pays. Same
# categories as their bases; listed only when named.
TEMPLATES += (
    Template(
        "retry-color",
        "click",
        "easy",
        "Click the named color; a wrong pick is crossed out.",
        max_steps=5,
        opt_in=True,
    ),
    Template(
        "retry-label",
        "click",
        "easy",
        "Click the labelled button; a wrong pick is crossed out.",
        max_steps=5,
        opt_in=True,
    ),
    Template(
        "retry-tabs",
        "navigation",
        "easy",
        "Open the named tab; a wrong tab is crossed out.",
        max_steps=5,
        opt_in=True,
    ),
)
BY_NAME = {t.name: t for t in TEMPLATES}
# The ones a tiny policy can learn in a smoke run: one big target, solved by one click.
SMOKE_TEMPLATES = ("click-button", "click-color", "click-label", "nav-tabs")


def get_template(name: str) -> Template:
    t = BY_NAME.get(name)
    if t is None:
        raise KeyError(f"unknown built-in template {name!r}; valid: {', '.join(BY_NAME)}")
    return t


def make_task(name: str, seed: int, split: str = "train", api_actions: Sequence[str] = ()) -> Task:
    """The Task for template ``name`` at ``seed`` (seeds are used as given); ``api_actions``:
    the browser API actions (``cua_jax.actions.BROWSER_API``) the task allows."""
    t = get_template(name)
    api = A.check_api_names(api_actions, where=f"built-in task {name!r} api_actions")
    not_browser = [n for n in api if n not in A.BROWSER_API]
    if not_browser:
        raise ValueError(
            f"built-in browser tasks can allow only browser API actions "
            f"({', '.join(A.BROWSER_API)}), got {not_browser}"
        )
    return Task(
        id=f"builtin/{name}/{seed}",
        instruction=t.summary,  # the seeded instruction comes from the page at reset
        source="builtin",
        category=t.category,
        difficulty=t.difficulty,
        split=split,
        seed=int(seed),
        spec={"kind": "builtin", "template": name},
        max_steps=t.max_steps,
        api_actions=api,
        oracle_steps=t.oracle_steps,
    )


def templates_for(
    split: str = "train",
    category: str | None = None,
    difficulty: str | None = None,
    names: list[str] | None = None,
) -> list[Template]:
    """Templates in ``split`` (train excludes held-out ones), filtered."""
    if split not in ("train", "eval"):
        raise ValueError(f"unknown split {split!r}; valid: train, eval")
    if category is not None and category not in CATEGORIES:
        raise ValueError(f"unknown category {category!r}; valid: {', '.join(CATEGORIES)}")
    if difficulty is not None and difficulty not in ("easy", "medium", "hard"):
        raise ValueError(f"unknown difficulty {difficulty!r}; valid: easy, medium, hard")
    out = []
    for t in TEMPLATES:
        if split == "train" and t.heldout:
            continue
        if t.opt_in and (names is None or t.name not in names):
            continue
        if category and t.category != category:
            continue
        if difficulty and t.difficulty != difficulty:
            continue
        if names is not None and t.name not in names:
            continue
        out.append(t)
    return out


def sample_tasks(
    split: str = "train",
    category: str | None = None,
    difficulty: str | None = None,
    limit: int | None = None,
    seed: int = 0,
    names: list[str] | None = None,
    per_template: int | None = None,
    api_actions: Sequence[str] = (),
) -> list[Task]:
    """Seeded task instances, round-robin over the chosen templates.

    ``limit`` tasks in all (default: ``per_template`` each, default 10); page seeds are drawn
    from ``random.Random(seed)`` inside the split's seed range, so the list is reproducible.
    """
    temps = templates_for(split, category, difficulty, names)
    if not temps:
        raise ValueError(
            f"no built-in template matches split={split!r} category={category!r} "
            f"difficulty={difficulty!r} names={names!r}"
        )
    rng = random.Random(f"{split}|{seed}")
    n = limit if limit is not None else len(temps) * (per_template or 10)
    base = EVAL_SEED_OFFSET if split == "eval" else 0
    return [
        make_task(
            temps[i % len(temps)].name,
            base + rng.randrange(EVAL_SEED_OFFSET),
            split,
            api_actions,
        )
        for i in range(n)
    ]
