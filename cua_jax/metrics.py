"""Metrics: one `MetricsWriter` fans each step's scalars out to JSONL, TensorBoard and wandb.

Files go through `etils.epath`: a workdir may be a local path or on object storage
(`gs://bucket/run`); object stores cannot append, so there the JSONL file is rewritten whole at
each step (a run logs a few thousand rows at most).

JSONL (`metrics.jsonl` in the workdir) is the source of truth: resume tests compare it line by
line, and `plot_curves` draws the learning curves people look at from it. TensorBoard event files
are written with tensorboardX; wandb is used only when a project is configured (and must then be
installed: it is not a dependency).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
from etils import epath

from cua_jax.redact import redact


def is_local(path: str) -> bool:
    """Whether `path` is on the local file system (not `gs://...` or another URI)."""
    return "://" not in os.fspath(path)


def _to_float(value: Any) -> float | None:
    try:
        f = float(np.asarray(value))
    except (TypeError, ValueError):
        return None
    return f


class MetricsWriter:
    """Writes scalar metrics per step to `workdir/metrics.jsonl`, TensorBoard and optionally wandb.

    Only process 0 writes in a multi-host job; other processes get a writer that does nothing on
    purpose (`enabled=False`), which is why the flag exists rather than a silent no-op.
    """

    def __init__(
        self,
        workdir: str,
        *,
        enabled: bool = True,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        wandb_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        filename: str = "metrics.jsonl",
    ):
        self.workdir = workdir
        self.enabled = enabled
        self.path = os.path.join(workdir, filename)
        self._local = is_local(self.path)
        self._lines: list[str] | None = None  # object storage: the file's lines, rewritten whole
        self._tb = None
        self._tb_dir: str | None = None
        self._wandb = None
        if not enabled:
            return
        epath.Path(workdir).mkdir(parents=True, exist_ok=True)
        if not self._local:
            path = epath.Path(self.path)
            self._lines = path.read_text().splitlines(keepends=True) if path.exists() else []
        # TensorBoard's writer starts at the first row: a run that fails during set-up leaves
        # no writer whose exit-time flush (a thread at interpreter shutdown) would print noise.
        self._tb_dir = os.path.join(workdir, "tb") if tensorboard else None
        if wandb_project:
            try:
                import wandb
            except ImportError as e:  # pragma: no cover - depends on the user's environment
                raise ImportError(
                    f"log.wandb_project={wandb_project!r} is set but wandb is not installed; "
                    "`pip install wandb` or leave log.wandb_project empty"
                ) from e
            self._wandb = wandb.init(
                project=wandb_project,
                name=wandb_name,
                config=redact(dict(config or {})),  # W&B's pages are shared: no tokens
                dir=workdir,
            )

    def truncate_after(self, step: int) -> None:
        """Drops lines with step > `step`: a resumed run rewrites the steps after its checkpoint."""
        path = epath.Path(self.path)
        if not self.enabled or not path.exists():
            return
        lines = path.read_text().splitlines(keepends=True)
        kept = [ln for ln in lines if ln.strip() and json.loads(ln).get("step", -1) <= step]
        path.write_text("".join(kept))
        if self._lines is not None:
            self._lines = kept

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        row: dict[str, Any] = {"step": int(step), "time": time.time()}
        if self._tb is None and self._tb_dir is not None:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(self._tb_dir)
        for k, v in metrics.items():
            f = _to_float(v)
            if f is None:
                continue
            row[k] = f if math.isfinite(f) else str(f)
            if self._tb is not None and math.isfinite(f):
                self._tb.add_scalar(k, f, step)
        line = json.dumps(row) + "\n"
        if self._lines is None:
            with open(self.path, "a") as fh:
                fh.write(line)
        else:
            self._lines.append(line)
            epath.Path(self.path).write_text("".join(self._lines))
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if k != "time"}, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: str) -> list[dict[str, Any]]:
    """Reads a metrics.jsonl file written by `MetricsWriter` (a local path or gs://...)."""
    return [json.loads(ln) for ln in epath.Path(path).read_text().splitlines() if ln.strip()]


def plot_curves(
    rows: list[dict[str, Any]], keys: list[str], out_png: str, title: str = ""
) -> str | None:
    """Draws one panel per key that has data (x = step) and saves a PNG; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = [k for k in keys if any(isinstance(r.get(k), float | int) for r in rows)]
    if not present:
        return None
    fig, axes = plt.subplots(1, len(present), figsize=(4.2 * len(present), 3.2), squeeze=False)
    for ax, key in zip(axes[0], present, strict=True):
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), float | int)]
        xs, ys = zip(*pts, strict=True)
        ax.plot(xs, ys, marker="o", ms=3)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    with epath.Path(out_png).open("wb") as f:
        fig.savefig(f, dpi=110, format="png")
    plt.close(fig)
    return out_png


class Progress:
    """A terminal progress line with rate and ETA (tqdm), plus the latest few metrics."""

    def __init__(self, total: int, initial: int = 0, desc: str = "train", enabled: bool = True):
        self.enabled = enabled
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, initial=initial, desc=desc, file=sys.stderr, dynamic_ncols=True
            )

    def update(self, n: int = 1, **postfix: Any) -> None:
        if self._bar is None:
            return
        shown = {k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in postfix.items()}
        self._bar.set_postfix(shown, refresh=False)
        self._bar.update(n)

    def write(self, msg: str) -> None:
        if self._bar is not None:
            self._bar.write(msg)
        else:
            print(msg, file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
