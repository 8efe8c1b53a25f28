"""The allowed range of every numeric config key, in one table.

    check_limits(config)   # raises LimitError (a ValueError) naming the key, value and range

The flag parser checks types only: `--config.sft.learning_rate=nan` or `--config.total_steps=-5`
type-check and would train NaN weights or nothing at all. `LIMITS` holds one row per numeric key
of `configs/common.py` (a test fails when a numeric key is added there without a row here): an
integer or a finite number, its bounds, values with a meaning of their own (`mesh.fsdp=-1`), and
why. Relations between keys (KV pages for `max_seq_len`, `top_p` with `old_logprobs`) stay in
`cua_jax.config.checks.validate_config`, which calls `check_limits` first.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


class LimitError(ValueError):
    """A numeric config value outside its allowed range; the message names the key."""


@dataclasses.dataclass(frozen=True)
class Limit:
    """`kind` "int" (an integer) or "float" (a finite number); `lo`/`hi` bounds (None: none),
    open when `lo_open`/`hi_open`; `also`: single values allowed besides the range;
    `each`: the value is a sequence and every element must satisfy the limit."""

    kind: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    also: tuple[float, ...] = ()
    each: bool = False
    why: str = ""

    def describe(self) -> str:
        what = "an integer" if self.kind == "int" else "a finite number"
        if self.lo is not None and self.hi is not None:
            rng = (
                f"in {'(' if self.lo_open else '['}{_num(self.lo)}, "
                f"{_num(self.hi)}{')' if self.hi_open else ']'}"
            )
        elif self.lo is not None:
            rng = f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
        elif self.hi is not None:
            rng = f"{'<' if self.hi_open else '<='} {_num(self.hi)}"
        else:
            rng = ""
        text = f"{what} {rng}".strip()
        if self.also:
            text += " or " + " or ".join(_num(v) for v in self.also)
        if self.each:
            text = f"a sequence of {text.replace('an integer', 'integers')}"
        return text + (f" ({self.why})" if self.why else "")

    def allows(self, v: Any) -> bool:
        if isinstance(v, bool) or not isinstance(v, int | float):
            return False
        if v in self.also:
            return True
        if self.kind == "int" and not (isinstance(v, int) or float(v).is_integer()):
            return False
        if not math.isfinite(v):
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return not (self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi))


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


def _int(lo: int | None = None, hi: int | None = None, why: str = "", **kw: Any) -> Limit:
    return Limit("int", lo, hi, why=why, **kw)


def _float(lo: float | None = None, hi: float | None = None, why: str = "", **kw: Any) -> Limit:
    return Limit("float", lo, hi, why=why, **kw)


_POS = _float(0, lo_open=True)  # a finite number > 0

# Every numeric key of configs/common.py -> its limit.
LIMITS: dict[str, Limit] = {
    "seed": _int(0, why="numpy seeds are non-negative"),
    "total_steps": _int(0, why="GRPO learner steps; 0: SFT and evaluation only"),
    # ---- model
    "model.lora_rank": _int(0, why="0: full fine-tuning"),
    "model.lora_alpha": _POS,
    "model.attn_block": _int(0, why="query tokens per attention block in the learner; 0: dense"),
    # ---- mesh
    "mesh.data": _int(1),
    "mesh.fsdp": _int(1, also=(-1,), why="-1: all remaining devices"),
    "mesh.tensor": _int(1),
    "mesh.expert": _int(1, why="MoE expert parallelism; 1: experts not split"),
    # ---- sampler
    "sampler.max_slots": _int(1),
    "sampler.page_size": _int(1),
    "sampler.num_pages": _int(2, why="page 0 is scratch"),
    "sampler.kv_memory_fraction": _float(0, 1, hi_open=True, why="0: a fixed num_pages"),
    "env.desktop_max_processes": _int(0, why="0: no task budget"),
    "env.desktop_cpus": _float(0, 1024, why="0: no CPU quota"),
    "sampler.kv_min_fraction": _float(0, 1, hi_open=True, why="0: any pool that holds a sequence"),
    "sampler.max_seq_len": _int(1),
    "sampler.decode_chunk": _int(1, why="decode steps per engine call"),
    # ---- rl
    "rl.group_size": _int(2, why="GRPO compares rollouts in a group"),
    "rl.groups_per_batch": _int(1),
    "rl.learning_rate": _POS,
    "rl.max_tokens": _int(1),
    "rl.temperature": _POS,
    "rl.top_p": _float(0, 1, lo_open=True),
    "rl.invalid_action_penalty": _float(0, why="subtracted from the reward per invalid action"),
    "rl.closeness_reward": _float(
        0, 1, hi_open=True, why="a failed episode's reward must stay below a success's"
    ),
    "rl.kl_penalty_coef": _float(0),
    "rl.clip_low": _float(0, 1, hi_open=True, why="the PPO ratio's floor 1 - clip_low is > 0"),
    "rl.clip_high": _float(0, why="the PPO ratio's ceiling is 1 + clip_high"),
    "rl.tis_cap": _float(1, why="importance weights are truncated at it"),
    "rl.loss_norm": _float(0, why="0: the generation budget"),
    "rl.num_substeps": _int(1),
    "rl.ppo_epochs": _int(1, why="passes over each batch"),
    "rl.ppo_minibatches": _int(1, why="optimizer updates per pass"),
    "rl.max_sampling_rounds": _int(1, why="dynamic sampling's bound"),
    "rl.replay_max_staleness": _int(0, also=(-1,), why="-1: max_steps_off_policy"),
    "rl.max_steps_off_policy": _int(0),
    "rl.entropy_coef": _float(0),
    "rl.row_lengths": _int(1, each=True, why="packing buckets, in tokens"),
    "rl.rows_per_step": _int(1),
    "rl.learner_rows": _int(0, why="0: one row per episode of a step"),
    "rl.images_per_row": _int(0, why="0: what a row can hold, at most turns x history images"),
    "optim.max_update_ratio": _float(0, why="0: no bound on an update's size"),
    "rl.tokens_per_chip": _int(0, why="0: the row-count shape set"),
    "rl.screens_per_chip": _int(0, why="0: what rl.tokens_per_chip can hold"),
    "rl.logits_chunk": _int(0, why="0: every position at once"),
    "rl.router_aux_coef": _float(0, why="0: no load-balancing loss"),
    "rl.sdpo_weight": _float(0, 1, why="SDPO's share of the loss; GRPO has the rest"),
    "rl.sdpo_js_beta": _float(0, 1, lo_open=True, hi_open=True, why="0 / 1: use kl / rkl"),
    "rl.sdpo_topk": _int(0, why="0: the whole vocabulary"),
    "rl.sdpo_ema": _float(0, 1, lo_open=True, why="the EMA teacher's step towards the policy"),
    "rl.entropulse_every": _int(0, why="0: no Entropulse"),
    "rl.entropulse_sft_steps": _int(1),
    # ---- optim
    "optim.warmup_steps": _int(0),
    "optim.weight_decay": _float(0),
    "optim.grad_clip": _float(0, why="0: no clipping"),
    "optim.b1": _float(0, 1, hi_open=True),
    "optim.b2": _float(0, 1, hi_open=True),
    # ---- sft
    "sft.steps": _int(0, why="0: no warm-up"),
    "sft.learning_rate": _POS,
    "sft.episodes_per_task": _int(1),
    "sft.num_tasks": _int(0, why="0: every training task"),
    "sft.recovery_share": _float(0, 1),
    "sft.feedback_share": _float(0, 1),
    "mid.steps": _int(0, why="0: no mid-training"),
    "mid.batch_size": _int(1),
    "mid.eval_every": _int(0, why="0: at the start and end only"),
    "mid.eval_samples": _int(1),
    # ---- env
    "env.concurrency": _int(1),
    "env.max_turns": _int(1),
    "env.max_history_images": _int(1, why="the current screenshot is the last image"),
    "env.viewport_width": _int(64, 8192, why="screen pixels"),
    "env.viewport_height": _int(64, 8192, why="screen pixels"),
    "env.step_timeout_s": _POS,
    "env.page_memory_mb": _int(0, why="MiB of JavaScript heap per page; 0: no cap"),
    "env.desktop_memory_mb": _int(0, why="MiB of address space per desktop process; 0: no cap"),
    "env.desktop_command_cpu_s": _float(
        1, 86400, also=(0,), why="CPU seconds per command a local desktop runs; 0: no cap"
    ),
    "env.vm_qemu_memory_mb": _int(256, why="MiB of guest memory"),
    "env.vm_qemu_cpus": _int(1, 64, why="virtual CPUs per guest"),
    # ---- ckpt
    "ckpt.save_every": _int(1),
    "ckpt.keep": _int(1),
    "ckpt.init_params_step": _int(0, also=(-1,), why="-1: the latest"),
    # ---- log
    "log.eval_every": _int(1),
    "log.num_groups_to_log": _int(0),
    # ---- serve
    "serve.port": _int(0, 65535, why="0: no live policy server"),
    "serve.max_tokens": _int(1),
}


def _lookup(config: Any, key: str) -> Any:
    node = config
    for part in key.split("."):
        node = node[part]
    return node


def check_limits(config: Any) -> None:
    """Raises `LimitError` for the first numeric key outside its range (a NaN, an infinity, a
    negative count, ...), naming the key, its value and the allowed range. Keys of `LIMITS`
    the config lacks (an older run's config) are skipped."""
    for key, limit in LIMITS.items():
        try:
            value = _lookup(config, key)
        except (KeyError, AttributeError):
            continue
        values = value if limit.each else (value,)
        if limit.each and (not isinstance(value, list | tuple) or not value):
            ok = False
        else:
            ok = all(limit.allows(v) for v in values)
        if not ok:
            raise LimitError(f"config.{key}={value!r} is out of range: {limit.describe()}")


__all__ = ["LIMITS", "Limit", "LimitError", "check_limits"]
