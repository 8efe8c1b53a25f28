"""Export a training run's checkpoint as a Hugging Face directory that transformers loads.

    export_checkpoint(workdir, out_dir, step=None, config=load_run_config(workdir))

Rebuilds the run's model from its config (`configs.common.load_run_config`: the base
checkpoint for real presets, the tiny preset's shapes otherwise), restores the trained
parameters from `workdir/checkpoints`, folds LoRA adapters into the base weights, and writes
safetensors + config.json + generation_config.json (+ the tokenizer files of the base
checkpoint). The tiny presets use the SentencePiece tokenizer shipped with cua_jax, which
transformers has no class for: its model file is copied as `cua_jax_tokenizer.model` and the
weights load in transformers all the same.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import shutil
from typing import Any

from cua_jax import sharding as shd
from cua_jax.data.tokenizer import DEFAULT_TOKENIZER_PATH
from cua_jax.job.builders import restore_run_model
from cua_jax.models import lora
from cua_jax.models.qwen_vl import save_pretrained


def export_checkpoint(workdir: str, out_dir: str, step: int | None = None, *, config: Any) -> int:
    """Writes the checkpoint at `step` (default: latest) of `workdir` to `out_dir`; returns step.

    config: the run's config, as `configs.common.load_run_config(workdir)` reads it (which fills
    fields added since the run)."""
    mesh = shd.make_mesh(1, -1, 1)
    rules = tuple(shd.DEFAULT_RULES) + tuple(tuple(r) for r in config.mesh.rules)
    model, _, step = restore_run_model(config, workdir, mesh, rules, step)
    if lora.has_lora(model):
        model = lora.merge_lora(model)
    save_pretrained(model, out_dir, tokenizer_dir=config.model.hf_path)
    if config.model.hf_path is None:
        src = importlib.resources.files("cua_jax").joinpath(DEFAULT_TOKENIZER_PATH)
        with importlib.resources.as_file(src) as path:
            shutil.copy(path, os.path.join(out_dir, "cua_jax_tokenizer.model"))
    with open(os.path.join(out_dir, "cua_jax_export.json"), "w") as f:
        json.dump({"workdir": os.path.abspath(workdir), "step": step}, f, indent=2)
    return step
