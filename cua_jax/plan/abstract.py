"""The run built abstractly: the preset's model config (`model_config`), the trainer's learner
over an abstract model (`build_abstract`: shapes and shardings, no arrays), parameter counts,
the compile that records a program's figures (`_compile`), and the run's shapes (the trainer's
shape set, what a turn's text takes)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from cua_jax import sharding as shd
from cua_jax.data.processor import QwenVLProcessor
from cua_jax.job import builders
from cua_jax.job.builders import build_learner
from cua_jax.models import qwen_vl
from cua_jax.plan.collectives import moved_bytes
from cua_jax.plan.hardware import GiB, PlanInputError
from cua_jax.plan.report import ProgramPlan, with_shardings
from cua_jax.sampler.steps import ModelDef


# ------------------------------------------------------------------------------- model config
def model_config(config: Any) -> qwen_vl.QwenVLConfig:
    """The preset's model: `model.hf_path/config.json` when set, else the published checkpoint of
    the preset's size, else (the smoke preset) the tiny model train.py builds."""
    mc = config.model
    options = dict(
        dtype=mc.dtype,
        param_dtype=mc.param_dtype,
        remat=mc.remat,
        attn_block=mc.attn_block,
        attn_impl=mc.attn_impl,
        moe_dispatch=mc.get("moe_dispatch", "auto"),
        pixel_dtype=mc.get("pixel_dtype", "float32"),
    )
    if mc.hf_path is not None:
        path = os.path.expanduser(str(mc.hf_path))
        if not os.path.isdir(path):
            raise PlanInputError(
                f"--config.model.hf_path={mc.hf_path} is not a directory (a local Hugging Face "
                "checkpoint directory with config.json)"
            )
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise PlanInputError(f"{cfg_file} does not exist (model.hf_path needs a config.json)")
        with open(cfg_file) as f:
            return qwen_vl.QwenVLConfig.from_hf_dict(json.load(f), **options)
    if (mc.family, mc.preset) in qwen_vl.PUBLISHED or (
        mc.family == "qwen3_5" and mc.preset in qwen_vl.PUBLISHED_QWEN35
    ):
        return qwen_vl.published_config(mc.family, mc.preset, **options)

    w, h = config.env.viewport_width, config.env.viewport_height
    tok = QwenVLProcessor.default(mc.family, max_pixels=w * h, min_pixels=32 * 32).tokenizer
    return qwen_vl.tiny(
        mc.family,
        vocab_size=tok.vocab_size,
        **tok.vision_token_ids(),
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
        moe=mc.preset == "tiny_moe",
        **options,
    )


# ------------------------------------------------------------------------------- abstract run
@dataclasses.dataclass
class _Abstract:
    learner: Any
    decode_model: Any  # steps.ModelDef of the whole model (adapters included), remat off
    trainable: Any
    opt_state: Any
    frozen: Any
    rest: Any
    ref: Any


def _opt_shardings(opt_state: Any, trainable: Any, replicated: NamedSharding) -> Any:
    """Each optimizer-state leaf takes the sharding of the parameter it mirrors (Adam's mu / nu
    end with that parameter's path and have its shape), as `jnp.zeros_like` of a sharded
    parameter does in a real run; counters and scalars are replicated."""
    by_path = {tuple(map(str, p)): a for p, a in jax.tree_util.tree_flatten_with_path(trainable)[0]}

    def one(path, a):
        key = tuple(map(str, path))
        for i in range(len(key)):
            p = by_path.get(key[i:])
            if p is not None and p.shape == a.shape:
                return p.sharding
        return replicated

    return jax.tree_util.tree_map_with_path(one, opt_state)


def build_abstract(
    config: Any, cfg: qwen_vl.QwenVLConfig, mesh: Any, rules: shd.Rules, *, sft: bool = False
) -> _Abstract:
    """The trainer's learner (builders.build_learner: LoRA, freezing, optimizer, KL reference) over
    an abstract model: everything is traced under `jax.eval_shape`, so no array is made; the
    learner's jitted step and shardings are the ones a run uses. `sft`: the SFT warm-up's
    learner (no KL reference, the SFT learning rate) instead of the RL one."""
    held: dict[str, Any] = {}

    def build():
        model = qwen_vl.QwenVL(cfg, rngs=nnx.Rngs(0))
        learner = build_learner(model, config, mesh, rules, sft=sft)
        held["learner"] = learner
        # The sampler's view of the same model (ModelDef.of turns remat off: no backward pass).

        held["decode_model"], _ = ModelDef.of(model)
        # the step's argument trees
        return learner.trainable, learner.opt_state, learner.frozen, learner.rest, learner.reference

    trainable, opt_state, frozen, rest, ref = jax.eval_shape(build)
    learner = held["learner"]
    repl = NamedSharding(mesh, P())
    trainable = with_shardings(trainable, learner.trainable_sharding)
    frozen = with_shardings(frozen, learner.frozen_sharding)
    rest = with_shardings(rest, jax.tree.map(lambda _: repl, rest))
    ref = None if ref is None else with_shardings(ref, learner.trainable_sharding)
    opt_sh = _opt_shardings(opt_state, trainable, repl)
    learner.opt_sharding = opt_sh  # the real run reads these off the concrete zeros
    opt_state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), opt_state, opt_sh
    )
    return _Abstract(learner, held["decode_model"], trainable, opt_state, frozen, rest, ref)


def _param_count(tree: Any) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def _text_param_count(state: Any, active_expert_share: float = 1.0) -> float:
    """Text-model parameters a token passes through: a MoE layer's expert weights count with
    `active_expert_share` (top-k / experts), every other weight whole."""
    n = 0.0
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        key = jax.tree_util.keystr(path)
        if "visual" not in key:
            share = active_expert_share if ".experts" in key or "'experts'" in key else 1.0
            n += math.prod(x.shape) * share
    return n


_OOM_TEMP = re.compile(r"HLO temporaries \(([0-9.]+)([KMGT]?)\)")


def compiler_oom_temp_bytes(msg: str) -> int:
    """The temporaries the TPU compiler said a program needs when it ran out of HBM ("the total
    memory required for HLO temporaries (31.61G) exceeds available HBM (15.75G)"; its K / M /
    G / T are powers of 1024), in bytes; 0 when the message has no such figure."""
    m = _OOM_TEMP.search(msg)
    if m is None:
        return 0
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2) or " "))


def _compile(fn: Any, args: tuple, prog: ProgramPlan) -> None:
    """Compiles for the slice and records the compiler's figures; a program whose arguments and
    resident buffers alone exceed the chip's HBM is not compiled (it cannot fit, and compiling a
    large model costs minutes and host memory)."""
    floor = sum(prog.arguments.values()) + sum(prog.resident.values())
    if prog.chip.hbm_bytes and floor > prog.chip.hbm_bytes:
        prog.compile_error = (
            f"not compiled: its arguments and resident buffers alone need {floor / GiB:.1f} GiB "
            f"of {prog.chip.hbm_bytes / GiB:.0f} GiB"
        )
        return
    t0 = time.perf_counter()
    try:
        compiled = fn.lower(*args).compile()
    except Exception as e:  # the TPU compiler refuses programs that overflow HBM
        msg = str(e)
        if "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower():
            line = next(
                (ln.strip() for ln in msg.splitlines() if "memory" in ln.lower()), msg[:200]
            )
            prog.compile_error = line[:300]
            prog.temp_bytes = compiler_oom_temp_bytes(msg)
            return
        raise
    prog.compile_s = time.perf_counter() - t0
    m = compiled.memory_analysis()
    prog.argument_bytes = int(m.argument_size_in_bytes)
    prog.output_bytes = int(m.output_size_in_bytes)
    prog.alias_bytes = int(m.alias_size_in_bytes)
    prog.temp_bytes = int(m.temp_size_in_bytes)
    prog.code_bytes = int(m.generated_code_size_in_bytes)
    cost = compiled.cost_analysis()
    if isinstance(cost, list):  # older JAX: one dict per device program
        cost = cost[0]
    prog.flops = float(cost.get("flops", 0.0)) + prog.pallas_flops
    prog.bytes_accessed = float(cost.get("bytes accessed", 0.0)) + prog.pallas_bytes
    prog.collective_bytes = moved_bytes(compiled.as_text())


# ------------------------------------------------------------------------------- the run's shapes
def trainer_rl_shapes(config: Any, learner: Any) -> Any:
    """The learner's shape set as the trainer builds it (`warmup.begin`): its RL shapes are a
    step's episodes (or turns) as rows, with their screens' patch budget."""

    env = config.env
    ic = QwenVLProcessor.default(
        learner.config.family,
        max_pixels=env.viewport_width * env.viewport_height,
        min_pixels=32 * 32,
    ).image_config
    return builders.shape_set(config, ic, row_multiple=learner.row_multiple)


# What a drawn RL batch's episodes look like (`drawn_rl_batch`): the system prompt and task,
# tokens an action call takes, the env's feedback text a turn, in tokens
SYSTEM_TOKENS = 600
ACTION_TOKENS = (24, 128)
FEEDBACK_TOKENS = 16
