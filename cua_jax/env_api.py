"""The environment contract shared by the trainer, the browser envs and the VM envs.

The trainer (``cua_jax.rl``) only ever sees these types; concrete environments live in the
top-level ``envs`` package (``envs.browser``, ``envs.vm``) and implement :class:`Env`. Keeping the
contract here, free of playwright / HTTP imports, lets ``cua_jax`` stay importable on a TPU host
that runs no environment at all.

An episode::

    async with make_env() as env:                 # envs are async context managers
        obs = await env.reset(task, seed=task.seed)
        while True:
            action = policy(obs)                      # a cua_jax.actions.Action, screen pixels
            res = await env.step(action)
            obs = res.observation
            if res.done:
                break
        score = await env.evaluate()                  # task score in [0, 1] (MiniWoB: [-1, 1])

Faults (a crashed browser, a page that never loads, a step over its timeout) never raise out of
``step``: they end the episode with ``done=True`` and ``info["error"]`` set, and the env recovers
on the next ``reset``. ``reset`` may raise :class:`EnvError` when the env cannot start the task at
all (after its own retries); the rollout loop records that episode as failed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from cua_jax.actions import Action

# Keys of StepResult.info (and of Observation.info) with a fixed meaning everywhere.
INFO_INVALID_ACTION = "invalid_action"  # str: why the action string could not be executed
INFO_ERROR = "error"  # str: a fault that ended the episode (crash, timeout, hung page)
INFO_DONE_REASON = (
    "done_reason"  # str: "done" | "fail" | "answer" | "max_steps" | "env_done" | "error"
)
INFO_TIMING = "timing"  # dict[str, float]: seconds spent in action / screenshot / total
INFO_ANSWER = "answer"  # str: the text of an Answer action
INFO_API_RESULT = "api_result"  # str: what an API action returned (a command's output, ...)

SPLITS = ("train", "eval")
DIFFICULTIES = ("easy", "medium", "hard")


class EnvError(RuntimeError):
    """An environment could not start or run a task (after its own recovery attempts)."""


@dataclasses.dataclass(frozen=True)
class Task:
    """One task instance: what to do, where, and with which random seed.

    Attributes:
      id: unique, stable id, e.g. ``"builtin/click-button/17"`` or ``"miniwob/click-test"``.
      instruction: the natural-language goal shown to the policy. Templates whose text depends on
        the seed may leave this as a placeholder; the env's ``reset`` returns the real one in
        ``Observation.instruction``, which is the one to show.
      source: which task source made it ("builtin", "miniwob", "custom", "osworld", ...). Envs use
        it to decide whether they can run the task.
      category: e.g. "click", "forms", "select", "toggles", "scroll", "navigation", "workflow".
      difficulty: "easy" | "medium" | "hard".
      split: "train" | "eval".
      seed: the seed ``reset`` uses when none is given.
      spec: free-form, JSON-serialisable description for the env that runs the task (template
        name, MiniWoB task name, OSWorld config, start URL, ...).
      max_steps: the episode's step budget; the rollout loop stops there, or earlier at its
        own cap (``RolloutSettings.max_turns`` = config ``env.max_turns``).
      has_checker: False for tasks with no programmatic score (custom instructions): evaluate()
        then returns 0.0 and a judge (or nobody) scores them.
      oracle: an optional fixed action sequence (screen pixels) that solves the task. Envs whose
        oracle depends on the live page (the built-in browser suite) instead give the next
        oracle action for the current state with ``await env.oracle_next()`` after ``reset``.
      oracle_steps: how many actions the oracle's solution takes at most (scrolls not counted),
        when the task source knows; None: not said (a fixed ``oracle`` gives its length). The
        config check warns when ``env.max_turns`` is fewer (``config_checks.warn_if_turns_cut``).
      api_actions: the API actions (``cua_jax.actions.API_TOOLS`` names: "run_shell", "fill",
        ...) the policy may call in this task besides GUI actions; the system prompt lists them
        and the oracle uses them. Empty: GUI only (an API action is an invalid action).
    """

    id: str
    instruction: str
    source: str
    category: str = ""
    difficulty: str = "easy"
    split: str = "train"
    seed: int = 0
    spec: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    max_steps: int = 15
    has_checker: bool = True
    oracle: Sequence[Action] | None = None
    api_actions: tuple[str, ...] = ()
    oracle_steps: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.api_actions, str):  # one name, from JSON or a config
            object.__setattr__(self, "api_actions", (self.api_actions,))
        elif not isinstance(self.api_actions, tuple):
            object.__setattr__(self, "api_actions", tuple(self.api_actions))

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict (the oracle is dropped: it holds Action objects)."""
        d = dataclasses.asdict(self)
        d.pop("oracle")
        d["spec"] = dict(self.spec)
        return d


@dataclasses.dataclass
class Observation:
    """What the policy sees after reset or a step.

    Attributes:
      screenshot: u8[H, W, 3] RGB; coordinates of actions are pixels of this image.
      instruction: the task instruction (resolved for seeded templates).
      text: optional text state (page title/URL, accessibility text, terminal output).
      info: env-specific extras (url, step index, ...).
    """

    screenshot: np.ndarray
    instruction: str
    text: str | None = None
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def screen_size(self) -> tuple[int, int]:
        """(width, height) in pixels: the screen space actions are expressed in."""
        h, w = self.screenshot.shape[:2]
        return int(w), int(h)


@dataclasses.dataclass
class StepResult:
    """The outcome of one ``Env.step``.

    Attributes:
      observation: the screen after the action (after a fault: the last good screen, or black).
      done: the episode is over (Done/Fail/Answer action, the env finished, or a fault).
      reward: a per-step reward from the env, 0.0 for most envs (the score comes from evaluate()).
      info: ``invalid_action`` (reason string) when the action could not be executed; ``error``
        when a fault ended the episode; ``done_reason``; ``timing`` (seconds); ``answer``.
    """

    observation: Observation
    done: bool
    reward: float = 0.0
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class CheckerReport:
    """What a task's checker can say about an attempt beyond its score (an env's optional
    ``report()``; the built-in browser tasks have one).

    Attributes:
      clicks: (x, y, label) of each press the page got, in screen pixels, in order; label is what
        it landed on (a button's text, a field's label, an id).
      targets: (label, x, y) of the elements the task's plan clicks that are on the final screen,
        x, y their centres in screen pixels.
      closeness: in [0, 1], how near the clicks came to the targets (1: every target clicked;
        falls off with distance, see ``envs/browser/static/cua.js``); None where the checker
        cannot say (no click targets).
      note: the task's own sentence on what was wrong ("" when it has none).
    """

    clicks: tuple[tuple[float, float, str], ...] = ()
    targets: tuple[tuple[str, float, float], ...] = ()
    closeness: float | None = None
    note: str = ""

    def message(self, to_model: Any = None) -> str:
        """The report as text for the policy (SDPO's teacher): `to_model` maps screen pixels to
        the policy's coordinate frame (`CoordinateSpace.to_model`), so the positions are the ones
        the policy itself writes."""

        def at(x: float, y: float) -> str:
            mx, my = to_model(x, y) if to_model is not None else (round(x), round(y))
            return f"({mx}, {my})"

        parts = []
        if self.clicks:
            parts.append(
                "clicked " + ", then ".join(f'"{lb}" at {at(x, y)}' for x, y, lb in self.clicks)
            )
        elif self.targets:
            parts.append("made no click")
        if self.targets:
            parts.append(
                "the target was "
                + " and ".join(f'"{lb}" at {at(x, y)}' for lb, x, y in self.targets)
            )
        text = "; ".join(parts)
        text = (text[:1].upper() + text[1:] + ".") if text else ""
        return f"{text} {self.note}".strip()


@runtime_checkable
class Env(Protocol):
    """An interactive environment that runs one task at a time.

    Implementations are async context managers (``async with Env(...) as env``) so a crash in the
    caller still closes browsers and VMs. ``step`` never raises for bad actions or env faults:
    those come back in ``StepResult.info``.
    """

    async def reset(self, task: Task, seed: int | None = None) -> Observation:
        """Start ``task`` (seed defaults to ``task.seed``) and return the first observation."""
        ...

    async def step(self, action: Action) -> StepResult:
        """Execute one action (screen pixel coordinates) and return the next observation."""
        ...

    async def evaluate(self) -> float:
        """Score the current state for the current task (1.0 = solved, 0.0 = not)."""
        ...

    # Optional (not part of the protocol check): ``async def report(self) -> CheckerReport |
    # None``, read after ``evaluate``: what the checker can say beyond the score (the rollout
    # loop records it on ``Trajectory.checker_report``; SDPO's teacher reads its message, and
    # ``rl.closeness_reward`` shapes failed episodes' rewards with its closeness).

    async def close(self) -> None:
        """Release everything the env holds (pages, browsers, VMs). Safe to call twice."""
        ...
