"""Run-time checks of a config's values: each rule once, naming the key and the fix.

    validate_config(config)   # raises ConfigError before any work starts

The flag parser checks keys and types (`--config.rl.gruop_size` fails by name); these rules catch
values that type-check but mean nothing (a negative page count, an unknown loss mode, a
checkpoint path that is not there). `launch/tpu.py` and `tools/eval.py` turn a ConfigError into
one line on stderr.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from absl import logging

from cua_jax.config.limits import LimitError, check_limits
from cua_jax.env_api import Task
from cua_jax.models.qwen_vl.config import SPLASH_BLOCK, TINY_MOE, splash_tile
from cua_jax.sampler.kernels.options import GpuKernelOptions

# Keys whose value must be one of a fixed set.
ENUMS = {
    "model.family": ("qwen2_5_vl", "qwen3_vl", "qwen3_5"),
    "model.dtype": ("float32", "bfloat16"),
    "model.param_dtype": ("float32", "bfloat16"),
    "model.remat": ("none", "full", "dots", "ordered"),
    "model.attn_impl": ("xla", "splash"),
    "model.moe_dispatch": ("auto", "all_to_all", "all_gather"),  # = qwen_vl.MOE_DISPATCHES
    "model.gated_delta_impl": ("reference", "pallas", "auto"),  # = config.GATED_DELTA_IMPLS
    "rl.mode": ("sync", "async"),
    "rl.kl_estimator": ("k1", "k2", "k3"),
    "rl.loss_agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "rl.old_logprobs": ("behaviour", "learner"),
    "rl.advantage": ("grpo", "drgrpo", "rloo"),
    "rl.algorithm": ("grpo", "sdpo"),
    "rl.sdpo_divergence": ("kl", "rkl", "js"),
    "rl.sdpo_teacher": ("current", "ema"),
    "rl.warmup": ("none", "learner", "all"),
    "optim.schedule": ("constant", "cosine"),
    "env.kind": ("browser", "vm"),
    "env.action_format": ("qwen25vl", "qwen3vl", "qwen35", "pyautogui"),
    "env.system_prompt": ("tools", "compact"),
    "env.host_screens": ("frame", "png"),
    "sampler.backend": ("auto", "tpu", "gpu", "interpret", "reference"),
}


# The feedback SDPO's teacher may read (`config.rl.sdpo_feedback`, `cua_jax.rl.sdpo`).
FEEDBACK_KINDS = ("final_screenshot", "checker_message", "peer_success")


class ConfigError(ValueError):
    """A config value that type-checks but means nothing; names the key and the valid values."""


def _get(config: Any, key: str) -> Any:
    section, name = key.split(".")
    return config[section][name]


def check_sft_source(path: str) -> str:
    """The kind of an SFT source file, "dir" (a trajectory directory) or "jsonl"; raises
    ConfigError naming `config.sft.source` otherwise."""
    if os.path.isdir(path):
        return "dir"
    if os.path.isfile(path) and path.endswith(".jsonl"):
        return "jsonl"
    raise ConfigError(
        f"config.sft.source={path!r} does not exist or is neither 'oracle', a trajectory "
        "directory, nor a .jsonl file of demonstrations"
    )


def feedback_kinds(spec: str | Sequence[str]) -> tuple[str, ...]:
    """`config.rl.sdpo_feedback` ("final_screenshot,checker_message", or already a sequence of
    kinds) as a checked, non-empty tuple: the one place the kinds are parsed."""
    parts = spec.split(",") if isinstance(spec, str) else spec
    kinds = tuple(str(k).strip() for k in parts if str(k).strip())
    bad = [k for k in kinds if k not in FEEDBACK_KINDS]
    if bad or not kinds:
        raise ValueError(f"sdpo_feedback={spec!r}: use some of {FEEDBACK_KINDS}")
    return kinds


def validate_config(config: Any) -> None:
    """Fails before any work starts on values the flag parser cannot catch."""
    for key, valid in ENUMS.items():
        if _get(config, key) not in valid:
            raise ConfigError(
                f"config.{key}={_get(config, key)!r} is not one of {', '.join(valid)}"
            )
    try:  # every numeric key's range (finite, sign, bounds): one table, beside no other rule
        check_limits(config)
    except LimitError as e:
        raise ConfigError(str(e)) from None
    rl, sc = config.rl, config.sampler
    if rl.algorithm == "sdpo":
        try:
            feedback_kinds(rl.sdpo_feedback)
        except ValueError as e:
            raise ConfigError(f"config.rl.{e}") from None
    if rl.top_p < 1 and rl.old_logprobs == "behaviour":
        # The sampler reports log-probs of the nucleus-truncated distribution it drew from; the
        # learner scores the full (tempered) one, so the PPO ratio would not start at 1.
        raise ConfigError(
            f"config.rl.top_p={rl.top_p} needs config.rl.old_logprobs='learner' (the "
            "ratio is anchored at the learner's own log-probs; truncated importance sampling "
            "with rl.tis_cap corrects the nucleus truncation)"
        )
    if config.env.constrain_actions and config.env.action_format == "pyautogui":
        raise ConfigError(
            "config.env.constrain_actions=True needs a tool-call format with a grammar "
            "(config.env.action_format='qwen25vl' or 'qwen3vl'), not 'pyautogui' (Python code)"
        )
    pages = -(-sc.max_seq_len // sc.page_size)
    if pages > sc.num_pages - 1:
        raise ConfigError(
            f"config.sampler.max_seq_len={sc.max_seq_len} needs {pages} KV pages of "
            f"config.sampler.page_size={sc.page_size}, but config.sampler.num_pages="
            f"{sc.num_pages} holds {sc.num_pages - 1} (page 0 is scratch)"
        )
    try:
        GpuKernelOptions.parse(sc.gpu_kernel)
    except ValueError as e:
        raise ConfigError(f"config.sampler.gpu_kernel={sc.gpu_kernel!r}: {e}") from None
    _check_sources(config)
    _check_splash(config)
    _check_model(config)


def _check_sources(config: Any) -> None:
    """What the run reads from disk: init weights, the SFT source, the VM's disk image."""
    ck = config.ckpt
    if ck.init_params_from:
        if ck.load_checkpoint_path:
            raise ConfigError(
                "config.ckpt.init_params_from and config.ckpt.load_checkpoint_path are exclusive: "
                "the first starts a new run from saved weights, the second resumes a run"
            )
        if not os.path.isdir(ck.init_params_from):
            raise ConfigError(
                f"config.ckpt.init_params_from={ck.init_params_from!r} is not a directory (pass "
                "a run's workdir or its checkpoints directory, WORKDIR/checkpoints)"
            )
    if config.sft.steps > 0 and config.sft.source != "oracle":
        check_sft_source(config.sft.source)
    if config.sft.get("feedback_share", 0.0) > 0 and config.sft.source != "oracle":
        raise ConfigError(
            f"config.sft.feedback_share={config.sft.feedback_share} needs "
            f"config.sft.source='oracle' (its failed attempts are played on the tasks' pages), "
            f"not {config.sft.source!r}"
        )
    qemu_image = config.env.get("vm_qemu_image")
    if config.env.kind == "vm" and qemu_image and not os.path.isfile(qemu_image):
        raise ConfigError(
            f"config.env.vm_qemu_image={qemu_image!r} is not a file (the guest's disk image, "
            "e.g. OSWorld's Ubuntu.qcow2)"
        )


def _check_splash(config: Any) -> None:
    """model.attn_impl='splash' tiles every learner row in blocks of model.attn_block tokens
    (512 when 0), multiples of 128 (the TPU kernel's lanes)."""
    m = config.model
    if m.attn_impl != "splash":
        return
    block = m.attn_block or SPLASH_BLOCK
    tiles = {n: splash_tile(m.attn_block, n) for n in config.rl.row_lengths}
    bad = [n for n, tile in tiles.items() if n % tile or tile % 128]
    if block % 128 or bad:
        raise ConfigError(
            f"config.model.attn_impl='splash' tiles rows in blocks of config.model.attn_block="
            f"{block} tokens: the block must be a multiple of 128 and divide every "
            f"config.rl.row_lengths entry (these do not: {bad or list(config.rl.row_lengths)})"
        )


# model.preset values built at random init when model.hf_path is unset (builders)
TINY_PRESETS = ("tiny", "small", "tiny_moe")
# families with a MoE variant (tiny_moe), and the HF model types each family reads
MOE_FAMILIES = ("qwen3_vl", "qwen3_5")
MODEL_TYPES = {
    "qwen2_5_vl": ("qwen2_5_vl",),
    "qwen3_vl": ("qwen3_vl", "qwen3_vl_moe"),
    "qwen3_5": ("qwen3_5", "qwen3_5_moe"),
}


def _check_model(config: Any) -> None:
    path = config.model.hf_path
    if path is None:
        preset = config.model.preset
        if preset not in TINY_PRESETS:
            raise ConfigError(
                f"preset {config.preset!r} trains a real checkpoint: pass "
                "--config.model.hf_path=/path/to/local/hf_dir (a Qwen2.5-VL / Qwen3-VL directory)"
                f" (without one, config.model.preset is one of {', '.join(TINY_PRESETS)})"
            )
        if preset == "tiny_moe" and config.model.family not in MOE_FAMILIES:
            raise ConfigError(
                f"config.model.preset='tiny_moe' needs config.model.family in {MOE_FAMILIES} "
                f"(MoE decoders are Qwen3-VL-MoE and Qwen3.5-MoE), got {config.model.family!r}"
            )
        _check_moe(config, TINY_MOE["num_experts"] if preset == "tiny_moe" else 0)
        return
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ConfigError(
            f"config.model.hf_path={path!r} is not a Hugging Face model directory "
            "(no config.json); point it at a local Qwen2.5-VL / Qwen3-VL checkpoint"
        )
    with open(cfg_file) as f:
        hf = json.load(f)
    model_type = hf.get("model_type")
    if model_type not in sum(MODEL_TYPES.values(), ()):
        raise ConfigError(
            f"config.model.hf_path={path!r} holds a {model_type!r} model; cua_jax trains "
            "Qwen2.5-VL ('qwen2_5_vl'), Qwen3-VL ('qwen3_vl'), Qwen3-VL-MoE ('qwen3_vl_moe'), "
            "Qwen3.5 ('qwen3_5') and Qwen3.5-MoE ('qwen3_5_moe') checkpoints"
        )
    family = config.model.family
    if family in MODEL_TYPES and model_type not in MODEL_TYPES[family]:
        want = next(f for f, types in MODEL_TYPES.items() if model_type in types)
        raise ConfigError(
            f"config.model.hf_path={path!r} holds a {model_type!r} model but config.model.family"
            f"={family!r}: use the {want!r} config file (or --config.model.family={want})"
        )
    experts = 0
    if model_type in ("qwen3_vl_moe", "qwen3_5_moe"):
        text = hf.get("text_config") or {}
        experts = int(text.get("num_experts") or text.get("num_local_experts") or 0)
    _check_moe(config, experts)


def _check_moe(config: Any, num_experts: int) -> None:
    """MoE-only options on a dense model, and an expert axis that does not split the experts."""
    rl, expert = config.rl, config.mesh.get("expert", 1)
    if not num_experts:
        for key, on in (
            ("rl.routing_replay", rl.get("routing_replay", False)),
            ("rl.router_aux_coef", rl.get("router_aux_coef", 0.0) > 0),
            ("mesh.expert", expert > 1),
        ):
            if on:
                raise ConfigError(
                    f"config.{key}={_get(config, key)!r} is for MoE models, and this one is "
                    "dense (use --config.model.preset=tiny_moe or a Qwen3-VL-MoE hf_path)"
                )
    elif num_experts % expert:
        raise ConfigError(
            f"config.mesh.expert={expert} does not divide the model's {num_experts} experts"
        )


__all__ = ["ConfigError", "check_sft_source", "validate_config"]


def warn_if_turns_cut(tasks: Sequence[Task], max_turns: int) -> None:
    """An episode lasts min(task.max_steps, env.max_turns) turns: warns for the task kinds the
    config cuts short. A task that says how many actions its oracle's solution takes
    (`Task.oracle_steps`, or a fixed oracle's length) is cut when that is more than max_turns,
    whatever its max_steps allows (the smoke's one-click pages allow 5 and take 1); one that does
    not say, when its max_steps allows more than max_turns (it may need them)."""
    long: dict[str, int] = {}  # kind -> the most actions its oracles take, over max_turns
    unknown: dict[str, int] = {}  # kind -> its largest max_steps, over max_turns
    for t in tasks:
        kind, steps = t.id.rsplit("/", 1)[0], t.oracle_steps
        if steps is None and t.oracle is not None:
            steps = len(t.oracle)
        if steps is not None and steps > max_turns:
            long[kind] = max(long.get(kind, 0), steps)
        elif steps is None and t.max_steps > max_turns:
            unknown[kind] = max(unknown.get(kind, 0), t.max_steps)
    if long:
        logging.warning(
            "%d task kinds take more actions than config.env.max_turns=%d with their oracle's "
            "solution, up to %d; their episodes end after %d turns, so such a task succeeds only "
            "by a shorter solution, if there is one: %s",
            len(long),
            max_turns,
            max(long.values()),
            max_turns,
            _some(long),
        )
    if unknown:
        logging.warning(
            "%d task kinds allow more steps than config.env.max_turns=%d, up to %d, and do not "
            "say how many their solution takes; their episodes end after %d turns, so a task "
            "that needs more cannot succeed: %s",
            len(unknown),
            max_turns,
            max(unknown.values()),
            max_turns,
            _some(unknown),
        )


def _some(kinds: dict[str, int]) -> str:
    names = sorted(kinds)
    return ", ".join(names[:10]) + (" ..." if len(names) > 10 else "")
