"""The policy of a run's checkpoint, a local Hugging Face checkpoint or a preset at random init:
what tools/eval.py, tools/serve.py and tools/offline_eval.py load (`cua_jax.job.builders`)."""

from __future__ import annotations

import json
import os
from typing import Any

from cua_jax.data.processor import QwenVLProcessor
from cua_jax.job import builders


def checkpoint_step(value: str | None, workdir: str | None) -> int | None:
    """A `--step` value as a checkpoint step: None (the latest), an integer, or "best" (the run's
    summary.json `eval_best_step`); ValueError naming what is wrong."""
    if value is None:
        return None
    if value == "best":
        if workdir is None:
            raise ValueError("--step=best needs --workdir (a run's summary.json)")
        path = os.path.join(workdir, "summary.json")
        try:
            with open(path) as f:
                best = json.load(f).get("eval_best_step")
        except (OSError, ValueError) as e:
            raise ValueError(f"--step=best reads {path}: {e}") from None
        if best is None:
            raise ValueError(f"--step=best: {path} has no eval_best_step (the run logged no eval)")
        return int(best)
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"--step={value!r} is neither a step number nor 'best'") from None


def load_policy(config: Any, workdir: str | None, step: int | None = None):
    """(model, processor, step, mesh, rules). With `workdir`: its checkpoint at `step` (None:
    the latest; raises `CheckpointError` naming the steps there). Without: `config.model`'s
    `hf_path`, or random init for the tiny presets (+ `ckpt.init_params_from`, if set); step
    is None."""
    mesh, rules = builders.mesh_and_rules(config)
    if workdir is not None:
        model, processor, step = builders.restore_run_model(config, workdir, mesh, rules, step)
    else:
        model, processor = builders.build_model_and_processor(config, mesh, rules)
        builders.init_model_weights(model, config)
        step = None
    return model, processor, step, mesh, rules


def build_processor(config: Any):
    """The policy's processor alone (no weights): `model.hf_path`'s, or the shipped tokenizer
    with the tiny presets' image settings (what `builders.build_model_and_processor` gives)."""
    mc = config.model
    if mc.hf_path is not None:
        return builders.screen_form(QwenVLProcessor.from_pretrained(mc.hf_path), config)
    w, h = config.env.viewport_width, config.env.viewport_height
    return builders.screen_form(
        QwenVLProcessor.default(mc.family, max_pixels=w * h, min_pixels=32 * 32), config
    )
