"""Micro-batching and step helpers shared by the learner's programs and the passes beside it
(SDPO's teacher, the image groups' embedding, Entropulse): splitting rows into micro-batches
and back, combining their metrics, compiling a shape set's programs ahead, and stopping a run
on a non-finite loss.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def split_micro(x: Any, s: int) -> Any:
    """Rows [R, ...] -> [S, R/S, ...] (a list of arrays: each; None stays None): micro-batch j
    holds rows i x S + j, so each device keeps its own rows when the rows are sharded."""
    if x is None:
        return None
    if isinstance(x, list | tuple):
        return type(x)(split_micro(a, s) for a in x)
    return x.reshape(x.shape[0] // s, s, *x.shape[1:]).swapaxes(0, 1)


def unsplit_micro(x: Any) -> Any:
    """`split_micro`'s inverse: [S, R/S, ...] -> [R, ...]."""
    if x is None:
        return None
    if isinstance(x, list | tuple):
        return type(x)(unsplit_micro(a) for a in x)
    return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def split_micro_inputs(xs: dict[str, Any], s: int) -> dict[str, Any]:
    """A device batch's inputs as `s` micro-batches (`split_micro`); position ids are
    [3, R, L] -> [S, 3, R/S, L]."""
    out = {k: split_micro(v, s) for k, v in xs.items() if k != "position_ids"}
    pos = xs["position_ids"]
    out["position_ids"] = pos.reshape(3, pos.shape[1] // s, s, pos.shape[-1]).transpose(2, 0, 1, 3)
    return out


def combine_micro_metrics(metrics: dict[str, Any], xp: Any = np) -> dict[str, Any]:
    """A step's metrics from its micro-batches' (each metric stacked over them; `xp`: jnp
    inside a program, np on the host for a token-budget batch's chunks): token means weighted
    by the micro-batches' token counts; loss terms are already batch-normalised sums, so they
    add up; maxima take the max."""
    metrics = dict(metrics)
    n = metrics["num_tokens"]
    out = {}
    if "_routing_recorded" in metrics:  # MoE: share over every recorded (token, layer)
        differ = xp.sum(metrics.pop("_routing_differ"))
        recorded = xp.sum(metrics.pop("_routing_recorded"))
        out["routing_mismatch"] = differ / xp.maximum(recorded, 1.0)
        out["routing_recorded"] = recorded
    for k, v in metrics.items():
        if k.endswith("_max"):
            out[k] = xp.max(v)
        elif k in ("loss", "pg_loss", "num_tokens") or k.startswith("sdpo_"):
            out[k] = xp.sum(v)
        else:
            out[k] = xp.sum(v * n) / xp.maximum(xp.sum(n), 1.0)
    return out


def compile_each(
    shapes: Sequence[Any],
    program: str,
    lower: Callable[[Any], Any],
    stop: threading.Event | None = None,
) -> dict[str, float]:
    """Compiles `lower(shape)` (a `jax.stages.Lowered`) for every shape ahead of time: the
    warm-up's loop. Returns {"<program> <shape>": seconds}. A set `stop` (the run failed:
    `warmup.Warmup.cancel`) ends the loop before the next shape."""
    out = {}
    for shape in shapes:
        if stop is not None and stop.is_set():
            break
        t0 = time.perf_counter()
        lower(shape).compile()
        out[f"{program} {shape}"] = time.perf_counter() - t0
    return out


# The step metrics whose non-finite value stops a run.
FINITE_METRICS = ("loss", "grad_norm")


class NonFiniteError(FloatingPointError):
    """A train step's loss or gradient norm is NaN or infinite: the run stops (see
    `check_finite`)."""


def check_finite(
    metrics: dict[str, float], *, step: int, phase: str, last_checkpoint: str | None
) -> None:
    """Raises `NonFiniteError` naming the step, the metric and the last good checkpoint when a
    step's loss or gradient norm (host floats `train_step` / `sft_step` return: no device sync)
    is NaN or infinite, or its update was rejected (`update_rejected`: not finite, or larger
    than `OptimizerConfig.max_update_ratio` x the parameters); the parameters that step wrote
    are not to be saved or sampled."""
    where = (
        f"the last good checkpoint is {last_checkpoint}"
        if last_checkpoint
        else "no checkpoint was saved before it"
    )
    if metrics.get("update_rejected", 0.0) > 0:
        raise NonFiniteError(
            f"{phase} step {step}: its update was {metrics.get('update_ratio', float('nan')):.3g}"
            " x the parameters' norm (optim.max_update_ratio) or not finite and was not "
            f"applied; the run stops ({where}). Resume from it with a lower learning rate or a "
            "tighter optim.grad_clip"
        )
    for key in FINITE_METRICS:
        value = metrics.get(key)
        if value is not None and not np.isfinite(value):
            raise NonFiniteError(
                f"{phase} step {step}: {key} is {value}; the run stops ({where}). Resume from "
                "it with a lower learning rate or a tighter optim.grad_clip, or look for a bad "
                "batch in the step's episodes"
            )
