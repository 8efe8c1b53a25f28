"""Episode viewer: trajectories as a self-contained HTML page with the actions drawn on screen.

Each turn shows the screenshot the policy saw with its action drawn on it (a ring at a click, an
arrow for a drag, a bar for a scroll), the decoded model output, and the env feedback. Images are
embedded as base64 PNG, so the page is one file that opens anywhere.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from cua_jax import actions as A
from cua_jax.rl.trajectory import Trajectory

_COLORS = {"left": (255, 40, 40), "right": (40, 120, 255), "middle": (40, 200, 40)}


def draw_actions(screenshot: np.ndarray, acts: Sequence[Any]) -> Image.Image:
    """The screenshot (u8[H, W, 3]) with `acts` (screen pixels) drawn on it."""
    img = Image.fromarray(np.asarray(screenshot, np.uint8)).convert("RGB")
    d = ImageDraw.Draw(img)
    r = max(4, min(img.size) // 40)
    for act in acts or ():
        if isinstance(act, A.Click) and act.x is not None and act.y is not None:
            c = _COLORS.get(act.button, (255, 40, 40))
            for k in range(max(1, act.count)):
                rr = r + 3 * k
                d.ellipse((act.x - rr, act.y - rr, act.x + rr, act.y + rr), outline=c, width=2)
            d.line((act.x - r, act.y, act.x + r, act.y), fill=c)
            d.line((act.x, act.y - r, act.x, act.y + r), fill=c)
        elif isinstance(act, A.Move):
            d.ellipse((act.x - 2, act.y - 2, act.x + 2, act.y + 2), fill=(255, 200, 0))
        elif isinstance(act, A.Drag):
            if act.start_x is not None and act.start_y is not None:
                d.line((act.start_x, act.start_y, act.x, act.y), fill=(255, 0, 200), width=2)
            d.ellipse((act.x - r, act.y - r, act.x + r, act.y + r), outline=(255, 0, 200))
        elif isinstance(act, A.MouseDown | A.MouseUp) and act.x is not None and act.y is not None:
            c = _COLORS.get(act.button, (255, 40, 40))  # filled: down, hollow: up
            box = (act.x - r, act.y - r, act.x + r, act.y + r)
            d.rectangle(box, fill=c if isinstance(act, A.MouseDown) else None, outline=c, width=2)
        elif isinstance(act, A.Scroll) and act.x is not None and act.y is not None:
            tip = (act.x + 3 * r * np.sign(act.dx), act.y + 3 * r * np.sign(act.dy))
            d.line((act.x, act.y, *tip), fill=(0, 200, 200), width=3)
    return img


def _png_b64(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def episodes_html(
    episodes: Sequence[tuple[Trajectory, Sequence[np.ndarray]]],
    decode: Callable[[Sequence[int]], str],
    title: str = "episodes",
) -> str:
    """One HTML page for (trajectory, screenshots) pairs; `decode` turns ids into text."""
    parts = [
        "<!doctype html><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:16px}"
        ".ep{border:1px solid #ccc;margin:12px 0;padding:8px}"
        ".turn{display:inline-block;vertical-align:top;margin:4px;max-width:340px}"
        ".turn img{max-width:330px;border:1px solid #888}"
        "pre{white-space:pre-wrap;font-size:11px;background:#f6f6f6;padding:4px}"
        ".ok{color:#080}.bad{color:#a00}</style>",
        f"<h2>{html.escape(title)}</h2>",
    ]
    for traj, screens in episodes:
        cls = "ok" if traj.success else "bad"
        parts.append(
            f"<div class='ep'><b>{html.escape(traj.task_id)}</b> group "
            f"{html.escape(str(traj.group_id))} — <span class='{cls}'>reward {traj.reward:.2f}"
            f"</span>, {len(traj.turns)} turns, policy v{traj.policy_version}"
            + (f", ended: {html.escape(traj.failure_reason)}" if traj.failure_reason else "")
            + "<br>"
        )
        for k, turn in enumerate(traj.turns):
            acts = turn.action if isinstance(turn.action, list | tuple) else []
            img = draw_actions(screens[k], acts) if k < len(screens) else None
            desc = "; ".join(A.describe(a) for a in acts)
            parts.append("<div class='turn'>")
            if img is not None:
                parts.append(f"<img src='data:image/png;base64,{_png_b64(img)}'>")
            parts.append(f"<div>turn {k}: {html.escape(desc)}</div>")
            parts.append(f"<pre>{html.escape(decode(turn.generated_ids.tolist()))}</pre>")
            if turn.feedback:
                parts.append(f"<div><i>{html.escape(turn.feedback)}</i></div>")
            parts.append("</div>")
        parts.append("</div>")
    return "\n".join(parts)


# --- training curves -----------------------------------------------------------------------------


def sft_end(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Where the SFT warm-up ended in a run's metrics rows (`train.py` writes the after-SFT
    eval at step 0 with ``phase_sft=1``): {"step", "sft_steps", "eval_success"}, or None when
    the run had no SFT phase."""
    for r in rows:
        if r.get("phase_sft") == 1.0:
            return {
                "step": r["step"],
                "sft_steps": r.get("sft/steps"),
                "eval_success": r.get("eval/success"),
            }
    return None


def entropulse_phases(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Entropulse SFT phases that trained, in a run's metrics rows (`entropulse/phase` = 1
    on the RL step the phase followed): {"step", "sft_steps", "entropy_before",
    "entropy_after"}; a phase skipped for want of successes is left out."""
    return [
        {
            "step": r["step"],
            "sft_steps": r.get("entropulse/sft_steps"),
            "entropy_before": r.get("entropulse/entropy_before"),
            "entropy_after": r.get("entropulse/entropy_after"),
        }
        for r in rows
        if r.get("entropulse/phase") == 1.0 and not r.get("entropulse/skipped_no_success")
    ]


def _num(v: Any) -> bool:
    return isinstance(v, float | int) and not isinstance(v, bool)


def plot_run_curves(
    rows: Sequence[dict[str, Any]], keys: Sequence[str], out_png: str, title: str = ""
) -> str | None:
    """`curve_figure` saved as a PNG; returns its path (None: no data)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from etils import epath

    fig = curve_figure(rows, keys, title)
    if fig is None:
        return None
    with epath.Path(out_png).open("wb") as f:
        fig.savefig(f, dpi=110, format="png")
    plt.close(fig)
    return out_png


def curve_figure(rows: Sequence[dict[str, Any]], keys: Sequence[str], title: str = "") -> Any:
    """One panel per key with data (x = GRPO step), with the end of the SFT warm-up marked: a
    dashed vertical line at its step labelled with its SFT steps, the before-SFT point (random
    init) drawn apart as a cross, and on eval/success a dotted level at the after-SFT success,
    so the RL phase's own gain reads off the plot. Each Entropulse SFT phase that trained is a
    dotted purple line at the step it followed; on train/entropy its probe's entropy before and
    after the phase are drawn there (a triangle from one to the other). None: no data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    num = _num
    present = [k for k in keys if any(num(r.get(k)) for r in rows)]
    if not present:
        return None
    end = sft_end(rows)
    pulses = entropulse_phases(rows)
    fig, axes = plt.subplots(1, len(present), figsize=(4.2 * len(present), 3.2), squeeze=False)
    for ax, key in zip(axes[0], present, strict=True):
        before = [
            (r["step"], r[key]) for r in rows if r.get("phase_sft") == 0.0 and num(r.get(key))
        ]
        pts = [(r["step"], r[key]) for r in rows if r.get("phase_sft") != 0.0 and num(r.get(key))]
        if end is None:  # no SFT phase: the step-0 point is where the run started
            pts, before = before + pts, []
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o", ms=3)
        if before:
            bx, by = zip(*before, strict=True)
            ax.plot(bx, by, "x", color="gray", ms=6, label="before SFT")
        if end is not None:
            n = end["sft_steps"]
            label = f"SFT ends ({int(n)} steps)" if num(n) else "SFT ends"
            ax.axvline(end["step"], color="tab:red", ls="--", lw=1, label=label)
            if key == "eval/success" and num(end["eval_success"]):
                ax.axhline(end["eval_success"], color="tab:red", ls=":", lw=1, label="after SFT")
        for i, ph in enumerate(pulses):
            n = ph["sft_steps"]
            label = (
                (f"Entropulse SFT ({int(n)} steps)" if num(n) else "Entropulse SFT")
                if i == 0
                else None
            )
            ax.axvline(ph["step"], color="tab:purple", ls=":", lw=1.2, label=label)
            b, a = ph["entropy_before"], ph["entropy_after"]
            if key == "train/entropy" and num(b) and num(a):
                ax.annotate(
                    "",
                    xy=(ph["step"], a),
                    xytext=(ph["step"], b),
                    arrowprops={"arrowstyle": "->", "color": "tab:purple"},
                )
                ax.plot([ph["step"]], [a], "^", color="tab:purple", ms=5)
        if end is not None or pulses:
            ax.legend(fontsize=7, loc="best")
        ax.set_title(key)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
