"""Offline step-level evaluation (AgentNetBench style): each recorded step's predicted action
against the gold one, without running any environment.

    steps = steps_from_trajectories(TrajectoryReader(WORKDIR + "/sft_demos"), processor, "qwen3vl")
    steps = steps_from_jsonl("steps.jsonl", "qwen3vl")        # screenshot + gold action lines
    report = await evaluate_steps(steps, predictor)             # predictor(step) -> actions
    report.accuracy, report.by_kind, report.by_task, report.interval

A step is correct when the prediction has the gold's actions, in order, each matching:
  * Click (button and count), Move, Drag (its end and, when given, its start), Scroll's and
    MouseDown/Up's point: inside the gold's target box when the step has one (`bbox`, screen
    pixels), else within `radius` of the gold point, measured in screen fractions
    (sqrt((dx/W)^2 + (dy/H)^2)); Scroll also needs the same direction on each axis;
  * TypeText / Answer: the same text (surrounding whitespace ignored); Key: the same keys;
    KeyDown/KeyUp: the same key;
  * Wait, Done, Fail: the same type.
An InvalidAction prediction is wrong.

Steps of the project's own episodes (`steps_from_trajectories`: the trainer's
`TrajectoryWriter` directories, e.g. WORKDIR/sft_demos) keep the exact prompt ids and images
the policy saw, so the project's model predicts from the very same context; the gold is the
recorded turn's text, parsed with the action format in the frame of the image the model saw
(W x H = its resized size). Turns that were not trained (a recovery demo's scripted miss) are
skipped. JSONL steps (`steps_from_jsonl`) hold a screenshot for any agent.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
import math
import os
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import numpy as np

from cua_jax import actions as A
from cua_jax.evaluation import stats
from cua_jax.evaluation.results import action_from_json
from cua_jax.sampler import SamplingParams

DEFAULT_RADIUS = 0.05  # screen fractions


@dataclasses.dataclass
class Step:
    """One recorded step.

    gold: the gold actions in screen pixels of a W x H screen (`screen`); bbox: the gold
    target box (x0, y0, x1, y1) in the same pixels, or None. For the project's episodes
    `prompt_ids` / `pixel_values` / `image_grid_thw` are the prompt the policy saw and
    `gold_text` its text; for JSONL steps `screenshot` (u8[H, W, 3]) is set instead."""

    task_id: str
    index: int  # the step's position in its episode (0-based)
    instruction: str
    gold: list[Any]
    screen: tuple[int, int]  # (W, H)
    space: A.CoordinateSpace
    bbox: tuple[float, float, float, float] | None = None
    gold_text: str | None = None
    prompt_ids: np.ndarray | None = None
    pixel_values: np.ndarray | None = None
    image_grid_thw: np.ndarray | None = None
    screenshot: np.ndarray | None = None
    history: list[str] = dataclasses.field(default_factory=list)


# ------------------------------------------------------------------------------ matching


def _point(a: Any) -> tuple[float, float] | None:
    x, y = getattr(a, "x", None), getattr(a, "y", None)
    return None if x is None or y is None else (float(x), float(y))


def point_ok(
    p: tuple[float, float] | None,
    g: tuple[float, float] | None,
    screen: tuple[int, int],
    bbox: Sequence[float] | None,
    radius: float,
) -> bool:
    """The predicted point p hits the gold (its box when given, else within `radius`)."""
    if g is None:
        return p is None
    if p is None:
        return False
    if bbox is not None:
        x0, y0, x1, y1 = bbox
        return x0 <= p[0] <= x1 and y0 <= p[1] <= y1
    w, h = screen
    return math.hypot((p[0] - g[0]) / w, (p[1] - g[1]) / h) <= radius


def _sign(v: float) -> int:
    return (v > 0) - (v < 0)


def action_matches(
    pred: Any,
    gold: Any,
    screen: tuple[int, int],
    bbox: Sequence[float] | None = None,
    radius: float = DEFAULT_RADIUS,
) -> bool:
    """One predicted action against one gold action (the rules of the module docstring)."""
    if type(pred) is not type(gold) or isinstance(pred, A.InvalidAction):
        return False
    if isinstance(gold, A.Click):
        return (
            pred.button == gold.button
            and pred.count == gold.count
            and point_ok(_point(pred), _point(gold), screen, bbox, radius)
        )
    if isinstance(gold, (A.Move, A.MouseDown, A.MouseUp)):
        same_button = getattr(pred, "button", None) == getattr(gold, "button", None)
        return same_button and point_ok(_point(pred), _point(gold), screen, bbox, radius)
    if isinstance(gold, A.Drag):
        start_ok = gold.start_x is None or point_ok(
            None if pred.start_x is None else (pred.start_x, pred.start_y),
            (gold.start_x, gold.start_y),
            screen,
            None,
            radius,
        )
        return start_ok and point_ok(_point(pred), _point(gold), screen, bbox, radius)
    if isinstance(gold, A.Scroll):
        same_way = _sign(pred.dx) == _sign(gold.dx) and _sign(pred.dy) == _sign(gold.dy)
        at = _point(gold) is None or point_ok(_point(pred), _point(gold), screen, bbox, radius)
        return same_way and at
    if isinstance(gold, (A.TypeText, A.Answer)):
        return pred.text.strip() == gold.text.strip()
    if isinstance(gold, A.Key):
        return tuple(pred.keys) == tuple(gold.keys)
    if isinstance(gold, (A.KeyDown, A.KeyUp)):
        return pred.key == gold.key
    return True  # Wait, Done, Fail: the type is the action


def step_correct(pred: Sequence[Any], step: Step, radius: float = DEFAULT_RADIUS) -> bool:
    """The prediction has the gold's actions in order, each matching (the box applies to the
    first positional action)."""
    if len(pred) != len(step.gold) or not step.gold:
        return False
    return all(
        action_matches(p, g, step.screen, step.bbox if i == 0 else None, radius)
        for i, (p, g) in enumerate(zip(pred, step.gold, strict=True))
    )


def kind_of(actions: Sequence[Any]) -> str:
    return type(actions[0]).__name__ if actions else "none"


# ------------------------------------------------------------------------------- sources


def _resized_size(grid_row: Sequence[int], patch_size: int) -> tuple[int, int]:
    """(W, H) of the image the model saw, from its (t, h, w) patch grid."""
    _, gh, gw = (int(v) for v in grid_row)
    return gw * patch_size, gh * patch_size


def steps_from_trajectories(
    trajectories: Iterable[Any], processor: Any, action_format: str, *, successful_only=True
) -> list[Step]:
    """Steps of recorded `Trajectory`s (e.g. `TrajectoryReader(WORKDIR/sft_demos)`): the
    prompt each turn saw (ids + all its images, reassembled from the turns' new images), the
    turn's text as the gold, in the frame of the turn's screenshot as the model saw it."""
    fmt = A.get_format(action_format)
    tok = processor.tokenizer
    stop = set(tok.stop_ids)
    patch = processor.image_config.patch_size
    out: list[Step] = []
    for traj in trajectories:
        if successful_only and not traj.success:
            continue
        pix: list[np.ndarray] = []
        grids: list[np.ndarray] = []
        instruction = ""
        for k, turn in enumerate(traj.turns):
            if not turn.extends_previous:
                pix, grids = [], []
            if turn.pixel_values is not None:
                pix.append(np.asarray(turn.pixel_values))
                grids.append(np.asarray(turn.image_grid_thw, np.int32).reshape(-1, 3))
            if not turn.trained or not grids:
                continue
            grid = np.concatenate(grids)
            w, h = _resized_size(grid[-1], patch)
            space = fmt.default_space(w, h, w, h)
            text = tok.decode([int(t) for t in turn.generated_ids if int(t) not in stop])
            gold = fmt.parse(text, space)
            if any(isinstance(a, A.InvalidAction) for a in gold):
                continue  # not a gold step
            out.append(
                Step(
                    task_id=traj.task_id,
                    index=k,
                    instruction=instruction,
                    gold=gold,
                    screen=(w, h),
                    space=space,
                    gold_text=text,
                    prompt_ids=np.asarray(turn.prompt_ids, np.int32),
                    pixel_values=np.concatenate(pix),
                    image_grid_thw=grid,
                )
            )
    return out


def _load_image(ref: str, base_dir: str) -> np.ndarray:
    from PIL import Image

    if ref.startswith("data:"):
        raw = base64.b64decode(ref.partition(",")[2])
        return np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"), np.uint8)
    path = ref if os.path.isabs(ref) else os.path.join(base_dir, ref)
    return np.asarray(Image.open(path).convert("RGB"), np.uint8)


def gold_from_json(gold: Any, fmt: Any, space: A.CoordinateSpace) -> list[Any]:
    """Gold actions from a JSONL step: model text in the format, or {"type": ..., fields} (or
    a list of them) in screen pixels."""
    if isinstance(gold, str):
        return fmt.parse(gold, space)
    items = gold if isinstance(gold, list) else [gold]
    acts = [action_from_json(g) for g in items]
    if any(a is None for a in acts):
        raise ValueError(f"gold {gold!r}: unknown action type")
    return acts


def steps_from_jsonl(path: str, action_format: str) -> list[Step]:
    """Steps from a JSONL file, one object per line:

    {"task_id": "t1", "step": 0, "instruction": "...", "screenshot": "shots/t1_0.png" (or a
     data: URI), "gold": "<tool_call>...</tool_call>" (model text in the format) or
     {"type": "Click", "x": 120, "y": 40} (screen pixels), "bbox": [x0, y0, x1, y1]
     (optional, screen pixels), "history": ["clicked File", ...] (optional)}
    """
    fmt = A.get_format(action_format)
    base = os.path.dirname(os.path.abspath(path))
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                shot = _load_image(d["screenshot"], base)
                h, w = shot.shape[:2]
                space = fmt.default_space(w, h, w, h)
                gold = gold_from_json(d["gold"], fmt, space)
                bbox = d.get("bbox")
                out.append(
                    Step(
                        task_id=str(d.get("task_id", n)),
                        index=int(d.get("step", 0)),
                        instruction=str(d.get("instruction", "")),
                        gold=gold,
                        screen=(w, h),
                        space=space,
                        bbox=None if bbox is None else tuple(float(v) for v in bbox),
                        screenshot=shot,
                        history=list(d.get("history", [])),
                    )
                )
            except (KeyError, ValueError, OSError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}:{n}: {type(e).__name__}: {e}") from None
    return out


# ---------------------------------------------------------------------------- evaluating

Predictor = Callable[[Step], Awaitable[list[Any]]]


@dataclasses.dataclass
class Report:
    n: int
    correct: int
    by_kind: dict[str, stats.Rate]  # by the gold's first action type
    by_task: dict[str, stats.Rate]
    per_step: list[bool]

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else float("nan")

    @property
    def interval(self) -> tuple[float, float]:
        return stats.wilson_interval(self.correct, self.n)

    def to_json(self) -> dict[str, Any]:
        def r(x: stats.Rate) -> dict[str, Any]:
            return {"n": x.n, "correct": x.successes, "rate": x.rate, "ci95": [x.low, x.high]}

        return {
            "steps": self.n,
            "correct": self.correct,
            "accuracy": self.accuracy,
            "ci95": list(self.interval),
            "by_kind": {k: r(v) for k, v in self.by_kind.items()},
            "by_task": {k: r(v) for k, v in self.by_task.items()},
        }


async def evaluate_steps(
    steps: Sequence[Step],
    predictor: Predictor,
    *,
    radius: float = DEFAULT_RADIUS,
    concurrency: int = 64,
) -> Report:
    """Every step's prediction scored against its gold (predictions run concurrently)."""
    sem = asyncio.Semaphore(concurrency)

    async def one(step: Step) -> bool:
        async with sem:
            pred = await predictor(step)
        return step_correct(pred, step, radius)

    ok = list(await asyncio.gather(*(one(s) for s in steps)))
    by_kind = stats.by_category(ok, [kind_of(s.gold) for s in steps])
    by_task = stats.by_category(ok, [s.task_id for s in steps])
    by_kind.pop("overall", None)
    by_task.pop("overall", None)
    return Report(len(steps), sum(ok), by_kind, by_task, ok)


def oracle_predictor(action_format: str) -> Predictor:
    """The gold written as the model would write it and parsed back (`format` -> `parse` in
    the step's coordinate space, so model-frame rounding is part of it)."""
    fmt = A.get_format(action_format)

    async def predict(step: Step) -> list[Any]:
        out: list[Any] = []
        for a in step.gold:
            out += fmt.parse(fmt.format(a, step.space), step.space)
        return out

    return predict


def random_click_predictor(seed: int = 0) -> Predictor:
    """A left click at a uniformly random point of the screen."""
    rng = np.random.default_rng(seed)

    async def predict(step: Step) -> list[Any]:
        w, h = step.screen
        x, y = rng.random(2)
        return [A.Click(float(x * w), float(y * h))]

    return predict


def random_click_rate(step: Step, radius: float = DEFAULT_RADIUS, grid: int = 400) -> float:
    """The probability that `random_click_predictor` is right on `step`: the gold box's share
    of the screen, or the share of the screen within `radius` of the gold point (a disc in
    screen fractions, cut at the edges; midpoint rule on a grid x grid lattice); 0 when the
    gold is not one left click."""
    g = step.gold[0] if len(step.gold) == 1 else None
    if not (isinstance(g, A.Click) and g.button == "left" and g.count == 1 and g.x is not None):
        return 0.0
    w, h = step.screen
    if step.bbox is not None:
        x0, y0, x1, y1 = step.bbox
        return max(0.0, min(x1, w) - max(x0, 0)) * max(0.0, min(y1, h) - max(y0, 0)) / (w * h)
    gx, gy = g.x / w, g.y / h
    c = (np.arange(grid) + 0.5) / grid
    inside = np.hypot(c[:, None] - gx, c[None, :] - gy) <= radius
    return float(inside.mean())


def engine_predictor(
    engine: Any,
    processor: Any,
    action_format: str,
    *,
    max_new_tokens: int = 128,
    banned_token_ids: Sequence[int] = (),
) -> Predictor:
    """The project's model (greedy) on the step's recorded prompt ids and images."""

    fmt = A.get_format(action_format)
    tok = processor.tokenizer
    params = SamplingParams(
        temperature=0.0,
        max_new_tokens=max_new_tokens,
        stop_token_ids=tuple(tok.stop_ids),
        banned_token_ids=tuple(banned_token_ids),
    )

    async def predict(step: Step) -> list[Any]:
        if step.prompt_ids is None:
            raise ValueError(
                f"step {step.task_id}/{step.index} has no recorded prompt; the model predicts "
                "on the project's own episodes (use an agent for screenshot steps)"
            )
        out = await engine.generate(
            step.prompt_ids, step.pixel_values, step.image_grid_thw, params=params
        )
        return fmt.parse(tok.decode([int(t) for t in out.tokens]), step.space)

    return predict


__all__ = [
    "DEFAULT_RADIUS",
    "Report",
    "Step",
    "action_matches",
    "engine_predictor",
    "evaluate_steps",
    "gold_from_json",
    "oracle_predictor",
    "point_ok",
    "random_click_predictor",
    "random_click_rate",
    "step_correct",
    "steps_from_jsonl",
    "steps_from_trajectories",
]
