"""The policy of a run's checkpoint, a local Hugging Face checkpoint or a preset at random init:
what tools/eval.py, tools/serve.py and tools/offline_eval.py load (`cua_jax.builders`)."""

from __future__ import annotations

from typing import Any


def load_policy(config: Any, workdir: str | None, step: int | None = None):
    """(model, processor, step, mesh, rules). With `workdir`: its checkpoint at `step` (None:
    the latest; raises `CheckpointError` naming the steps there). Without: `config.model`'s
    `hf_path`, or random init for the tiny presets (+ `ckpt.init_params_from`, if set); step
    is None."""
    from cua_jax import builders

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
    from cua_jax.data.processor import QwenVLProcessor

    mc = config.model
    if mc.hf_path is not None:
        return QwenVLProcessor.from_pretrained(mc.hf_path)
    w, h = config.env.viewport_width, config.env.viewport_height
    return QwenVLProcessor.default(mc.family, max_pixels=w * h, min_pixels=32 * 32)
