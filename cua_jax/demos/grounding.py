"""Synthetic grounding screens for mid-training: (screen uint8, instruction, target box).

    s = render_sample(seed)            # s.screen u8[H, W, 3], s.instruction, s.box (x0, y0, x1, y1)
    s.target                           # the box's centre in screen pixels: the oracle's click

A pure-PIL renderer of the built-in browser suite's click widgets (`envs/browser/static`:
the instruction banner, `button.big`, colored buttons, a tab strip), about a millisecond a
screen against Chromium's tens: mid-training needs tens of thousands of screens. It draws with
the suite's own CSS values (DejaVu Sans, #eef2f7 banner, 2 px #333 borders, 120 x 56 minimum
buttons, the eight named colors) so that what the model learns to ground here carries over to the
real pages, but it is a look-alike, not a copy: flex layout, fonts hinting and anti-aliasing
differ from the browser's.

Kinds (each a layout and instruction family of one suite template, with more variety):
  label  3-6 labelled buttons in a wrapping row or scattered: 'Click the button labeled "X".'
  button one big button anywhere, or several: 'Click the "X" button.'
  color  2-4 unlabelled colored buttons in a row: 'Click the red button.'
  tab    a tab strip of 4: 'Open the "X" tab.'

Splits: seeds below `HELDOUT_SEED` are training screens, seeds at or above it are held out
(the same convention as the browser suite's eval split).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
from PIL import Image, ImageDraw, ImageFont

HELDOUT_SEED = 10**9
KINDS = ("label", "button", "color", "tab")
COLORS = {
    "red": "#d62728",
    "green": "#2ca02c",
    "blue": "#1f77b4",
    "orange": "#ff7f0e",
    "purple": "#9467bd",
    "yellow": "#e6c700",
    "pink": "#e377c2",
    "gray": "#888888",
}
LABELS = (
    *("Save", "Cancel", "Delete", "Open", "Print", "Share", "Copy", "Help", "Edit", "Send"),
    *("OK", "Submit", "Go", "Next", "Start", "Continue", "Back", "Close", "Apply", "Undo"),
)
TABS = ("General", "Billing", "Security", "Profile", "Team", "Usage", "Privacy", "Alerts")
FONT = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"
BANNER_H = 28  # the #instr banner: 14 px text, 6 px padding, a 1 px border


@dataclasses.dataclass(frozen=True)
class GroundingSample:
    """One screen and what to click on it (screen pixels, inclusive-exclusive box)."""

    screen: np.ndarray  # u8[H, W, 3]
    instruction: str
    box: tuple[int, int, int, int]  # x0, y0, x1, y1
    kind: str
    seed: int

    @property
    def target(self) -> tuple[float, float]:
        x0, y0, x1, y1 = self.box
        return (x0 + x1) / 2, (y0 + y1) / 2

    def contains(self, x: float, y: float) -> bool:
        x0, y0, x1, y1 = self.box
        return x0 <= x < x1 and y0 <= y < y1


@functools.cache
def _font(size: int) -> ImageFont.FreeTypeFont:
    try:
        return ImageFont.truetype(FONT, size)
    except OSError as e:
        raise FileNotFoundError(
            f"the grounding renderer needs {FONT} (Debian: apt-get install fonts-dejavu-core)"
        ) from e


def _button_size(draw: ImageDraw.ImageDraw, label: str, big: bool = True) -> tuple[int, int]:
    x0, y0, x1, y1 = draw.textbbox((0, 0), label, font=_font(18 if big else 16))
    w, h = x1 - x0 + 28 + 4, y1 - y0 + 12 + 4  # padding 6 x 14, 2 px border
    return (max(w, 120), max(h, 56)) if big else (w, h)


def _draw_button(draw, box, label: str, fill: str = "#f4f4f4", size: int = 18) -> None:
    draw.rounded_rectangle(box, radius=6, fill=fill, outline="#333333", width=2)
    if label:
        cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
        draw.text((cx, cy), label, fill="#111111", font=_font(size), anchor="mm")


def _scatter(rng, sizes, area, tries: int = 200) -> list[tuple[int, int, int, int]] | None:
    """Non-overlapping boxes of `sizes` at random places inside `area` (None if none found)."""
    ax0, ay0, ax1, ay1 = area
    boxes: list[tuple[int, int, int, int]] = []
    for w, h in sizes:
        for _ in range(tries):
            if ax1 - w <= ax0 or ay1 - h <= ay0:
                return None
            x = int(rng.integers(ax0, ax1 - w))
            y = int(rng.integers(ay0, ay1 - h))
            b = (x, y, x + w, y + h)
            if all(
                b[2] + 6 <= o[0] or o[2] + 6 <= b[0] or b[3] + 6 <= o[1] or o[3] + 6 <= b[1]
                for o in boxes
            ):
                boxes.append(b)
                break
        else:
            return None
    return boxes


def _flow(sizes, x0: int, y0: int, x_max: int, gap: int = 12) -> list[tuple[int, int, int, int]]:
    """A wrapping row (`.row`: flex-wrap, gap 12 px, items centred on each line)."""
    boxes, x, y, line_h = [], x0, y0, 0
    for w, h in sizes:
        if x > x0 and x + w > x_max:
            x, y, line_h = x0, y + line_h + gap, 0
        boxes.append((x, y, x + w, y + h))
        x += w + gap
        line_h = max(line_h, h)
    return boxes


def render_sample(seed: int, width: int = 384, height: int = 288, kind: str | None = None):
    """The grounding screen of `seed` (deterministic): a `GroundingSample`."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown grounding kind {kind!r}; choose one of {KINDS}")
    if width < 200 or height < 150:
        raise ValueError(f"grounding screens need at least 200 x 150 pixels, got {width}x{height}")
    rng = np.random.default_rng(seed)
    kind = kind or KINDS[int(rng.integers(len(KINDS)))]
    img = Image.new("RGB", (width, height), "#ffffff")
    draw = ImageDraw.Draw(img)
    area = (10, BANNER_H + 10, width - 10, height - 6)  # #root's 10 px padding
    if kind == "tab":
        tabs = [str(t) for t in rng.choice(TABS, 4, replace=False)]
        t = 1 + int(rng.integers(3))
        y = area[1] + 8
        x, boxes = area[0], []
        for name in tabs:
            bx0, _, bx1, _ = draw.textbbox((0, 0), name, font=_font(16))
            w = bx1 - bx0 + 28 + 4
            boxes.append((x, y, x + w, y + 34))
            x += w + 4
        for i, (b, name) in enumerate(zip(boxes, tabs, strict=True)):
            draw.rounded_rectangle(
                b, radius=6, fill="#333333" if i == 0 else "#ffffff", outline="#333333", width=2
            )
            draw.text(
                ((b[0] + b[2]) / 2, (b[1] + b[3]) / 2),
                name,
                anchor="mm",
                font=_font(16),
                fill="#ffffff" if i == 0 else "#111111",
            )
        draw.rectangle(
            (area[0], y + 34, min(area[2], area[0] + 300), y + 34 + 84), outline="#333333", width=2
        )
        draw.text((area[0] + 10, y + 44), f"{tabs[0]} settings", fill="#111111", font=_font(16))
        instruction, box = f'Open the "{tabs[t]}" tab.', boxes[t]
    elif kind == "color":
        names = [str(c) for c in rng.choice(list(COLORS), int(rng.integers(2, 5)), replace=False)]
        t = int(rng.integers(len(names)))
        sizes = [(110 + 4, 70 + 4)] * len(names)
        if rng.random() < 0.5:
            boxes = _flow(sizes, area[0], area[1] + 20, area[2], gap=24)
        else:
            boxes = _scatter(rng, sizes, area) or _flow(sizes, area[0], area[1] + 20, area[2], 24)
        for b, name in zip(boxes, names, strict=True):
            _draw_button(draw, b, "", fill=COLORS[name])
        instruction, box = f"Click the {names[t]} button.", boxes[t]
    else:
        n = 1 if kind == "button" and rng.random() < 0.5 else int(rng.integers(3, 7))
        labels = [str(s) for s in rng.choice(LABELS, n, replace=False)]
        t = int(rng.integers(n))
        sizes = [_button_size(draw, s) for s in labels]
        if n > 1 and rng.random() < 0.5:
            boxes = _flow(sizes, area[0], area[1] + 8, area[2])
        else:
            boxes = _scatter(rng, sizes, area) or _flow(sizes, area[0], area[1] + 8, area[2])
        for b, s in zip(boxes, labels, strict=True):
            _draw_button(draw, b, s)
        q = labels[t]
        instruction = (
            f'Click the button labeled "{q}".' if kind == "label" else f'Click the "{q}" button.'
        )
        box = boxes[t]
    draw.rectangle((0, 0, width, BANNER_H - 1), fill="#eef2f7")
    draw.line((0, BANNER_H - 1, width, BANNER_H - 1), fill="#c9d2de")
    draw.text((10, 6), instruction, fill="#111111", font=_font(14))
    x0, y0, x1, y1 = (int(v) for v in box)
    box = (max(x0, 0), max(y0, 0), min(x1, width), min(y1, height))
    return GroundingSample(np.asarray(img, np.uint8), instruction, box, kind, seed)


__all__ = ["HELDOUT_SEED", "KINDS", "GroundingSample", "render_sample"]
