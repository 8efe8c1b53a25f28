"""Ahead-of-time memory and roofline plan of a run for a TPU slice, compiled on this machine.

    plan = make_plan(config, "v5p-8")          # config: a configs/*.py ConfigDict
    print(format_plan(plan)); plan.fits         # per-device HBM, FLOPs, roofline, MFU / MBU

With `libtpu` installed, `jax.experimental.topologies.get_topology_desc` gives the abstract
devices of a TPU slice that is not here, and `jax.jit(f).lower(*abstract_args).compile()` runs
the real TPU compiler for them (as MaxText's train_compile.py does). The model is built
abstractly (`jax.eval_shape`: shapes only, no weights, no checkpoint) from the published
config.json dimensions of the preset's size (`qwen_vl.published_config`) or from
`model.hf_path/config.json`, laid out on a mesh of the slice's devices with the preset's rules,
and these programs are compiled (`PROGRAMS`; `programs=` picks):

  train_step    the learner's RL step (cua_jax.rl.learner, built by builders.build_learner) on one
                packed batch of `rl.rows_per_step` rows x the longest `rl.row_lengths` bucket;
                with rl.algorithm="sdpo" also the two SDPO programs below.
  train_step_screens  the RL step at the largest shape of the trainer's shape set
                (`rl.shapes`: a step's episodes or turns as rows) with its screens through the
                vision tower: the program the trainer compiles for its biggest batch. Not in
                the default set (its compile is the largest).
  sft_step      the SFT learner's step (the SFT warm-up's, built by build_learner(sft=True):
                no KL reference, its own optimizer state) on the shape set's SFT shapes with
                their screens: with rl.tokens_per_chip each SFT shape's chunk gradient program
                and the SFT learner's update; with Entropulse (rl.entropulse_every) also the RL
                learner's SFT chunks. In the default set when the run trains SFT
                (sft.steps, mid.steps or rl.entropulse_every) and has a token budget.
  sdpo_step     SDPO's step: the RL step with the teacher's top-k targets as inputs.
  sdpo_teacher  SDPO's teacher pass: a forward over the learner's micro-batches, top-k out, on
                rows one length longer (the feedback message and screen).
  decode_step   one decode step of every sampler slot: the model's decode path with the
                platform's paged-attention kernel (JAX's Pallas TPU kernel) over the KV pool,
                params shared in place with the learner (colocated), K/V sharded over kv heads.

Memory is per device: the compiler's argument / output / alias / temp bytes of each program,
plus what the other program keeps resident meanwhile (the KV pool while the train step runs;
optimizer state and KL reference while the sampler decodes). Arguments are also broken down by
hand (shard shape x dtype size) into params, optimizer state, KL reference, KV pool, batch.
FLOPs and bytes are XLA's `cost_analysis()` of the per-device program; it does not see inside a
Pallas call, so the paged-attention kernel's FLOPs and bytes are counted by hand and added.
Roofline time = max(FLOPs / peak, bytes / bandwidth) with the chip's published figures; MFU =
model FLOPs (6 N T + attention; 4 N T for frozen weights) / (roofline time x peak); MBU = the
bytes a decode step must read (params once, the live K/V) / (roofline time x bandwidth).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import re
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from cua_jax import sharding as shd
from cua_jax.data.processor import QwenVLProcessor
from cua_jax.job.builders import build_learner
from cua_jax.models import qwen_vl
from cua_jax.models.qwen_vl.text import splash_tile
from cua_jax.rl import batching, sdpo
from cua_jax.rl.image_groups import ImageGroups
from cua_jax.rl.learner import APPLY_PROGRAM
from cua_jax.rl.shapes import ShapeError, ShapeSet, teacher_row_length
from cua_jax.rl.trajectory import Trajectory, Turn, trajectory_to_samples
from cua_jax.sampler import kv_cache, steps
from cua_jax.sampler.kernels.paged_attention import GpuKernelOptions, select_backend
from cua_jax.sampler.kv_cache import kv_pages_for_budget, kv_pool_bytes_per_device
from cua_jax.sampler.placement import kv_sharding
from cua_jax.sampler.scheduler import token_bucket
from cua_jax.sampler.steps import ModelDef

GiB = 1 << 30


class PlanInputError(ValueError):
    """Bad input to a plan (unknown topology, missing checkpoint directory, a mesh that does not
    divide the slice): tools/plan.py prints it as one line and exits 2."""


# ------------------------------------------------------------------------------- hardware
@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU chip as JAX sees it (v4 / v5p: the two TensorCores form one megacore device)."""

    name: str
    hbm_bytes: int
    peak_bf16_flops: float  # per chip, dense bf16
    hbm_bandwidth: float  # bytes / s


# Public figures from Google Cloud's TPU system-architecture pages
# (https://cloud.google.com/tpu/docs/v4, .../v5e, .../v5p, .../v6e), per chip:
#   v4   32 GiB HBM2,  275 TFLOP/s bf16, 1200 GB/s
#   v5e  16 GiB HBM2,  197 TFLOP/s bf16,  819 GB/s
#   v5p  95 GiB HBM2e, 459 TFLOP/s bf16, 2765 GB/s
#   v6e  32 GiB HBM,   918 TFLOP/s bf16, 1640 GB/s (Trillium)
CHIPS = {
    "v4": Chip("v4", 32 * GiB, 275e12, 1200e9),
    "v5e": Chip("v5e", 16 * GiB, 197e12, 819e9),
    "v5p": Chip("v5p", 95 * GiB, 459e12, 2765e9),
    "v6e": Chip("v6e", 32 * GiB, 918e12, 1640e9),
}


@dataclasses.dataclass(frozen=True)
class Topology:
    """A slice by its usual name (`v5p-8`) and how libtpu names it (`v5:2x2x1`)."""

    name: str
    chip: Chip
    topology_name: str  # for jax.experimental.topologies.get_topology_desc
    chip_config_name: str  # "megacore" (v4, v5p) or "default"
    chips_per_host_bounds: tuple[int, int, int]
    num_chips: int

    @property
    def num_hosts(self) -> int:
        return self.num_chips // math.prod(self.chips_per_host_bounds)


def _topologies() -> dict[str, Topology]:
    out: dict[str, Topology] = {}

    def add(name: str, chip: str, topo: str, hosts: tuple[int, int, int]):
        dims = [int(d) for d in topo.split(":")[1].split("x")]
        cfg = "megacore" if chip in ("v4", "v5p") else "default"
        hb = tuple(min(h, d) for h, d in zip(hosts, [*dims, 1][:3], strict=True))
        out[name] = Topology(name, CHIPS[chip], topo, cfg, hb, math.prod(dims))  # type: ignore[arg-type]

    # v4 / v5p names count TensorCores (2 per chip); 4 chips per host.
    for n, t in ((8, "2x2x1"), (16, "2x2x2"), (32, "2x2x4"), (64, "2x4x4"), (128, "4x4x4")):
        add(f"v4-{n}", "v4", f"v4:{t}", (2, 2, 1))
        add(f"v5p-{n}", "v5p", f"v5:{t}", (2, 2, 1))
    # v5e / v6e names count chips; -1/-4/-8 are one host (the 8-chip host is 2x4), larger slices
    # are hosts of 2x2 chips.
    for chip, lib in (("v5e", "v5e"), ("v6e", "v6e")):
        add(f"{chip}-1", chip, f"{lib}:1x1", (1, 1, 1))
        add(f"{chip}-4", chip, f"{lib}:2x2", (2, 2, 1))
        add(f"{chip}-8", chip, f"{lib}:2x4", (2, 4, 1))
        for n, t in ((16, "4x4"), (32, "4x8"), (64, "8x8"), (128, "8x16"), (256, "16x16")):
            add(f"{chip}-{n}", chip, f"{lib}:{t}", (2, 2, 1))
    return out


TOPOLOGIES = _topologies()


def get_topology(name: str) -> Topology:
    """The slice named `name`; raises PlanInputError listing the known names."""
    if name not in TOPOLOGIES:
        raise PlanInputError(f"unknown topology {name!r}; known: {', '.join(TOPOLOGIES)}")
    return TOPOLOGIES[name]


def local_topology(devices: list[Any]) -> Topology:
    """The devices actually present (launch-time check: `launch/tpu.py --dry_run`) as a
    Topology: a known TPU chip's published figures, else the device's own memory limit (GPU; CPU
    devices: the host's memory split between them) and no peak figures (no roofline)."""
    kind = devices[0].device_kind.lower()
    table = (
        ("v6 lite", "v6e"),
        ("v6e", "v6e"),
        ("v5 lite", "v5e"),
        ("v5e", "v5e"),
        ("v5p", "v5p"),
        ("v5", "v5p"),
        ("v4", "v4"),
    )
    chip = next((CHIPS[c] for key, c in table if kind.startswith("tpu") and key in kind), None)
    if chip is None:
        stats = getattr(devices[0], "memory_stats", lambda: None)() or {}
        limit = int(stats.get("bytes_limit", 0))
        if not limit and devices[0].platform == "cpu":
            # CPU devices share the host's memory (this process's devices: one host's share)
            local = sum(d.process_index == devices[0].process_index for d in devices)
            limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // local
        chip = Chip(devices[0].device_kind, limit, 0.0, 0.0)
    name = f"{len(devices)} x {devices[0].device_kind}"
    return Topology(name, chip, "", "", (1, 1, 1), len(devices))


def abstract_devices(topo: Topology) -> list[Any]:
    """The slice's devices, abstract (compile-only), from libtpu."""
    try:
        from jax.experimental import topologies
    except ImportError as e:  # pragma: no cover - jax always ships it
        raise PlanInputError(f"jax.experimental.topologies is missing: {e}") from e
    quiet: dict[str, str] = {}
    if os.environ.get("JAX_PLATFORMS") == "cpu":
        # Compile-only on a machine without TPUs: tell libtpu so (it reads these when it first
        # starts), instead of letting it ask a metadata server and log errors; the values do not
        # change the topology described. The environment is restored afterwards. No chip is
        # opened, so several processes may load libtpu at once (tests, parallel plans) instead
        # of the second failing on libtpu's lockfile.
        kind = {"v5e": "v5litepod", "v5p": "v5p", "v4": "v4", "v6e": "v6e"}[topo.chip.name]
        quiet = {
            "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
            "TPU_SKIP_MDS_QUERY": "1",
            "TPU_WORKER_HOSTNAMES": "localhost",
            "TPU_ACCELERATOR_TYPE": f"{kind}-{topo.name.split('-')[1]}",
        }
        quiet = {k: v for k, v in quiet.items() if k not in os.environ}
    os.environ.update(quiet)
    try:
        desc = topologies.get_topology_desc(
            platform="tpu",
            topology_name=topo.topology_name,
            chip_config_name=topo.chip_config_name,
            chips_per_host_bounds=topo.chips_per_host_bounds,
            num_slices=1,
        )
    except Exception as e:
        raise PlanInputError(
            f"cannot describe TPU topology {topo.name} ({topo.topology_name}): {e}; a TPU plan "
            "needs libtpu (pip install -e '.[test]' installs the matching version)"
        ) from e
    finally:
        for k in quiet:
            os.environ.pop(k, None)
    return list(desc.devices)


def table_of_topologies() -> str:
    """Markdown table of the known slices and their chips' published figures."""
    lines = [
        "| topology | chips | hosts | HBM / chip | peak bf16 / chip | HBM bandwidth / chip |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for t in TOPOLOGIES.values():
        c = t.chip
        lines.append(
            f"| {t.name} | {t.num_chips} | {t.num_hosts} | {c.hbm_bytes / GiB:.0f} GiB | "
            f"{c.peak_bf16_flops / 1e12:.0f} TFLOP/s | {c.hbm_bandwidth / 1e9:.0f} GB/s |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------- byte counts
def shard_bytes(x: Any) -> int:
    """Bytes one device holds of an abstract array with a sharding (its shard shape)."""
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) else x.shape
    return math.prod(shape) * jnp.dtype(x.dtype).itemsize


def tree_shard_bytes(tree: Any) -> int:
    return sum(shard_bytes(x) for x in jax.tree.leaves(tree))


def with_shardings(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs of `tree` carrying `shardings` (a pytree prefix of `tree`)."""

    def one(s, sub):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), sub)

    return jax.tree.map(
        one, shardings, tree, is_leaf=lambda n: isinstance(n, jax.sharding.Sharding)
    )


# ------------------------------------------------------------------------------- results
@dataclasses.dataclass
class ProgramPlan:
    """One compiled program's per-device figures (bytes, FLOPs) on one slice."""

    name: str
    chip: Chip
    arguments: dict[str, int]  # by hand: shard bytes per kind of argument
    resident: dict[str, int]  # live buffers of the other program (not arguments here)
    argument_bytes: int = 0  # compiler's figures from here on
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    code_bytes: int = 0
    flops: float = 0.0  # XLA's cost analysis + hand count of Pallas calls
    bytes_accessed: float = 0.0
    pallas_flops: float = 0.0  # the hand-counted part
    pallas_bytes: float = 0.0
    model_flops: float = 0.0  # the useful FLOPs (MFU numerator)
    min_bytes: float = 0.0  # bytes a step must read (MBU numerator)
    compile_error: str | None = None  # the compiler's message when it refused (out of memory)
    compile_s: float = 0.0
    notes: list[str] = dataclasses.field(default_factory=list)
    # what `--json` reports of the program: learner | sft | sampler | sdpo, and its batch
    kind: str = ""
    rows: int = 0
    row_length: int = 0
    screens: int = 0

    @property
    def total_bytes(self) -> int:
        """Peak per-device HBM: arguments + outputs - donated + scratch + code + resident. A
        program the compiler refused: its arguments, resident buffers and the temporaries the
        compiler said it needed (`temp_bytes`, 0 when its message gave no figure)."""
        if self.compile_error is not None:
            return sum(self.arguments.values()) + sum(self.resident.values()) + self.temp_bytes
        # Arguments the program does not read (the vision tower in decode) are pruned from the
        # compiled program but still live in HBM: the hand count holds them; the compiler's may
        # be larger (TPU tiling pads small dims).
        args = max(self.argument_bytes, sum(self.arguments.values()))
        own = args + self.output_bytes - self.alias_bytes + self.temp_bytes
        return own + self.code_bytes + sum(self.resident.values())

    @property
    def roofline_s(self) -> float:
        if not (self.chip.peak_bf16_flops and self.chip.hbm_bandwidth):
            return 0.0  # a device without published figures
        return max(
            self.flops / self.chip.peak_bf16_flops, self.bytes_accessed / self.chip.hbm_bandwidth
        )

    @property
    def mfu(self) -> float:
        t = self.roofline_s
        return self.model_flops / (t * self.chip.peak_bf16_flops) if t > 0 else 0.0

    @property
    def mbu(self) -> float:
        t = self.roofline_s
        return self.min_bytes / (t * self.chip.hbm_bandwidth) if t > 0 else 0.0

    def consumers(self) -> dict[str, int]:
        """Per-device bytes by consumer, biggest first (temp = the compiler's scratch)."""
        out = dict(self.arguments)
        out.update(self.resident)
        if self.compile_error is None or self.temp_bytes:
            out["temp (activations, scratch)"] = self.temp_bytes
            extra = self.output_bytes - self.alias_bytes
            if extra > 0:
                out["outputs not donated"] = extra
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


@dataclasses.dataclass
class Plan:
    topology: Topology
    mesh_shape: dict[str, int]
    headroom: float  # share of HBM kept free
    programs: list[ProgramPlan]
    summary: dict[str, Any]
    # what does not fit besides a program's peak (one line each): a KV pool below
    # sampler.kv_min_fraction or one sequence, as `builders.kv_pages` refuses it at start
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def budget_bytes(self) -> int:
        return int(self.topology.chip.hbm_bytes * (1.0 - self.headroom))

    def misfits(self) -> list[ProgramPlan]:
        limit = self.budget_bytes or float("inf")  # a device that reports no memory limit
        return [p for p in self.programs if p.compile_error is not None or p.total_bytes > limit]

    @property
    def fits(self) -> bool:
        return not self.misfits() and not self.problems

    def reason(self) -> str:
        """One line: the first program that does not fit, its biggest consumer, what to change
        (else the first of `problems`)."""
        bad = self.misfits()
        if not bad:
            return self.problems[0] if self.problems else ""
        p = bad[0]
        name, size = next(iter(p.consumers().items()))
        hbm = self.topology.chip.hbm_bytes
        what = (
            f"the TPU compiler ran out of memory ({p.compile_error})"
            if p.compile_error is not None and p.total_bytes <= self.budget_bytes
            else f"needs {p.total_bytes / GiB:.1f} GiB per device > {self.budget_bytes / GiB:.1f}"
            f" GiB ({hbm / GiB:.0f} GiB HBM less {self.headroom:.0%} headroom)"
            + (" by the compiler's count as it ran out of memory" if p.compile_error else "")
        )
        return (
            f"{p.name} does not fit {self.topology.name}: {what}; biggest consumer: {name} "
            f"{size / GiB:.1f} GiB; {_advice(name, self)}"
        )


def _advice(consumer: str, plan: Plan) -> str:
    s = plan.summary
    bigger = _next_topology(plan.topology)
    more = f"a larger topology ({bigger})" if bigger else "a larger topology"
    if consumer.startswith("KV pool"):
        fit = s.get("kv_pages_that_fit")
        pages = f"--config.sampler.num_pages={fit}" if fit else "fewer --config.sampler.num_pages"
        return f"try {pages}, a larger --config.mesh.tensor (K/V shard over it), or {more}"
    if consumer.startswith(("params", "optimizer", "KL reference", "frozen")):
        lora = "" if s.get("lora_rank") else "LoRA (--config.model.lora_rank=64), "
        return f"try {lora}{more} (FSDP shards params and optimizer state over every device)"
    if consumer.startswith("temp") and s.get("tokens_per_chip"):
        least = s.get("least_tokens_per_chip")
        floor = f"; the least is {least}: the row that holds the longest sample" if least else ""
        return (
            f"try a smaller --config.rl.tokens_per_chip (now {s['tokens_per_chip']}{floor}), "
            f"fewer --config.env.max_history_images or max_turns (shorter samples), a larger "
            f"--config.mesh.tensor, or {more}"
        )
    if consumer.startswith("temp"):
        remat = "" if s.get("remat") == "full" else "--config.model.remat=full, "
        subs = 2 * int(s.get("num_substeps", 1))
        return (
            f"try {remat}--config.rl.num_substeps={subs} (micro-batches; rows_per_step must be "
            f"a multiple of it x data x fsdp), a shorter --config.rl.row_lengths, fewer "
            f"--config.sampler.num_pages (the KV pool is resident), or {more}"
        )
    return f"try {more}"


def _next_topology(topo: Topology) -> str | None:
    same = sorted(
        (t for t in TOPOLOGIES.values() if t.chip == topo.chip and t.num_chips > topo.num_chips),
        key=lambda t: t.num_chips,
    )
    return same[0].name if same else None


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
    if (mc.family, mc.preset) in qwen_vl.PUBLISHED:
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


# ------------------------------------------------------------------------------- train step
def plan_train_step(
    config: Any,
    ab: _Abstract,
    mesh: Any,
    chip: Chip,
    rows: int,
    row_len: int,
    kv_bytes: int,
    shapes: Any,
) -> ProgramPlan:
    """The RL step on `rows` text-only rows of `row_len`; its notes name the trainer's largest
    RL shape of `shapes` (`trainer_rl_shapes`) when that is larger."""
    learner = ab.learner
    xs = _step_inputs(learner, rows, row_len)
    args = (ab.trainable, ab.opt_state, ab.frozen, ab.rest, ab.ref, xs, None)
    arguments = _step_arguments(ab, xs, "batch")
    prog = ProgramPlan("train_step", chip, arguments, {"KV pool (sampler, resident)": kv_bytes})
    prog.kind, prog.rows, prog.row_length = "learner", rows, row_len
    # Model FLOPs per device (`_model_flops`).
    tokens = rows * row_len
    prog.model_flops = _model_flops(ab, tokens, row_len) / mesh.size
    prog.notes.append(
        f"{rows} rows x {row_len} tokens, text only (no screenshots); "
        f"remat={ab.learner.config.remat}, logits_chunk={ab.learner.logits_chunk}"
    )
    largest = largest_rl_shape(shapes)
    if largest.rows * largest.length > tokens or largest.patches:
        prog.notes.append(
            f"the trainer's largest RL batch is {largest.rows} rows x {largest.length} tokens "
            f"+ {largest.patches} screen patches (its shape set): --programs=train_step_screens "
            "plans that program"
        )
    if ab.learner.config.attn_impl == "splash":
        prog.pallas_flops, prog.pallas_bytes = _splash_cost(ab.learner.config, rows, row_len, mesh)
        prog.notes.append("splash attention (Pallas): FLOPs and bytes counted by hand")
    _compile(learner.step_program("rl"), args, prog)
    s = learner.num_substeps
    if s > 1 and prog.compile_error is None:
        # XLA's cost analysis counts a loop body once: the micro-batch scan runs it s times (the
        # embedding stage and the optimizer update outside it are counted s times too: a
        # slight overcount)
        prog.flops *= s
        prog.bytes_accessed *= s
        prog.notes.append(f"FLOPs and bytes: XLA's count x {s} micro-batches")
    return prog


def trainer_rl_shapes(config: Any, learner: Any) -> Any:
    """The learner's shape set as the trainer builds it (`warmup.begin`): its RL shapes are a
    step's episodes (or turns) as rows, with their screens' patch budget."""

    env = config.env
    ic = QwenVLProcessor.default(
        learner.config.family,
        max_pixels=env.viewport_width * env.viewport_height,
        min_pixels=32 * 32,
    ).image_config
    return ShapeSet.from_config(config, ic, row_multiple=learner.row_multiple)


def largest_rl_shape(shapes: Any) -> Any:
    """The RL shape of a shape set with the most tokens (then the most patches)."""
    return max(shapes.rl, key=lambda sh: (sh.rows * sh.length, sh.patches))


def plan_train_step_screens(
    ab: _Abstract, chip: Chip, kv_bytes: int, shapes: Any, mode: str = "rl"
) -> ProgramPlan:
    """The RL step at the largest shape of the trainer's shape set (most tokens), its screens
    through the vision tower: the program the trainer compiles for its biggest batch. The
    screens are laid out as the learner lays them out (`BatchLayout.device_batch`): grouped by
    micro-batch and device (`cua_jax.rl.image_groups`), sharded over the batch axes, in the
    model's compute dtype. `mode="sft"`: the SFT step at the largest SFT shape instead."""
    learner = ab.learner
    cfg = learner.config
    shape = max(shapes.of(mode), key=lambda sh: (sh.rows * sh.length, sh.patches))
    xs = _step_inputs(learner, shape.rows, shape.length)
    s, b = learner.num_substeps, learner.layout.batch_parallel
    images, per_group, unit = _abstract_screens(learner, shape, shapes.grid)
    arguments = _step_arguments(ab, xs, "batch (text)")
    arguments["screens (pixel values by micro-batch and device, and layout)"] = tree_shard_bytes(
        images
    )
    name = "train_step_screens" if mode == "rl" else f"{mode}_step_screens"
    prog = ProgramPlan(name, chip, arguments, {"KV pool (sampler, resident)": kv_bytes})
    screens = shape.patches // unit
    prog.kind = "learner" if mode == "rl" else mode
    prog.rows, prog.row_length, prog.screens = shape.rows, shape.length, screens
    prog.notes.append(
        f"the trainer's largest {mode.upper()} shape: {shape.rows} rows x {shape.length} tokens "
        f"and {screens} screens of {unit} patches ({shape.patches} patches) through the vision "
        f"tower, {per_group} a (micro-batch, device) group of {s} x {b}; shape set: "
        f"{', '.join(map(str, shapes.of(mode)))}; {s} micro-batches, remat={cfg.remat}"
    )
    args = (ab.trainable, ab.opt_state, ab.frozen, ab.rest, ab.ref, xs, images)
    _compile(learner.step_program(mode, grouped=True), args, prog)
    return prog


def _model_flops(ab: _Abstract, tokens: float, row_len: int, useful: float = 1.0) -> float:
    """Model FLOPs of a learner pass over `tokens` tokens in rows of `row_len` (all devices):
    6 N T for trained weights, 4 N T for frozen ones, 2 N T more for the KL reference's
    forward, causal attention 6 x layers x T x L x heads x head_dim; x `useful`, the share of
    the tokens that are samples' (padding is not useful work)."""
    t = ab.learner.config.text
    moe = getattr(t, "num_experts", 0) or 0
    active = (t.num_experts_per_tok / moe) if moe else 1.0
    n_tr = _text_param_count(ab.trainable, active)
    n_fr = _text_param_count(ab.frozen, active)
    attn = 6 * t.num_hidden_layers * tokens * row_len * t.num_attention_heads * t.head_dim
    flops = 6 * n_tr * tokens + 4 * n_fr * tokens + attn
    if ab.ref is not None:
        flops += 2 * (_text_param_count(ab.ref, active) + n_fr) * tokens + attn / 3
    return flops * useful


# What a drawn RL batch's episodes look like (`drawn_rl_batch`): the system prompt and task,
# tokens an action call takes, the env's feedback text a turn, in tokens
SYSTEM_TOKENS = 600
ACTION_TOKENS = (24, 128)
FEEDBACK_TOKENS = 16


def drawn_rl_batch(config: Any, learner: Any, shapes: Any, seed: int = 0) -> Any:
    """A step's RL batch as the preset's env settings make it, packed as the learner packs it
    (`batching.pack_chunks`): `rl.group_size x rl.groups_per_batch` episodes of 1 to
    `env.max_turns` turns (uniform), each turn showing the last `env.max_history_images`
    screens of the preset's viewport, `SYSTEM_TOKENS` of prompt, an action of `ACTION_TOKENS`
    tokens (at most `rl.max_tokens`) and `FEEDBACK_TOKENS` of feedback a turn; turns that
    extend the previous one while the window keeps every screen, separate samples once it
    drops one (as the chat renders a cut history). Pixels are stand-ins of one value a
    patch. Returns the packed batch."""

    cfg = learner.config
    rl, env = config.rl, config.env
    rng = np.random.default_rng(seed)
    unit = int(np.prod(shapes.grid))
    merge = cfg.vision.spatial_merge_size
    screen = np.r_[
        cfg.vision_start_token_id,
        [cfg.image_token_id] * (unit // merge**2),
        cfg.vision_end_token_id,
    ].astype(np.int32)

    def positions(ids, grid):
        return np.broadcast_to(np.arange(len(ids), dtype=np.int32), (3, len(ids))).copy()

    samples = []
    for _ in range(rl.group_size * rl.groups_per_batch):
        turns, actions = [], []
        for t in range(int(rng.integers(1, env.max_turns + 1))):
            shown = min(t + 1, env.max_history_images)
            history = np.concatenate(
                [np.full(len(a) + FEEDBACK_TOKENS, 7) for a in actions] or [[]]
            )
            prompt = np.concatenate([np.full(SYSTEM_TOKENS, 5), history] + [screen] * shown).astype(
                np.int32
            )
            extends = 0 < t < env.max_history_images
            if extends:  # the previous turn's sequence, then this turn's text and screen
                prev = turns[-1].full_ids
                prompt = np.r_[prev, np.full(FEEDBACK_TOKENS, 7), screen].astype(np.int32)
            low, high = (min(n, rl.max_tokens) for n in ACTION_TOKENS)
            gen = np.full(int(rng.integers(low, high + 1)), 9, np.int32)
            new = 1 if extends or t == 0 else shown
            turns.append(
                Turn(
                    prompt,
                    gen,
                    np.zeros(gen.size, np.float32),
                    pixel_values=np.zeros((new * unit, 1), np.float32),
                    image_grid_thw=np.tile(np.asarray(shapes.grid, np.int32), (new, 1)),
                    extends_previous=extends,
                )
            )
            actions.append(gen)
        traj = Trajectory("drawn", "g", turns, reward=1.0)
        samples += trajectory_to_samples(traj, 1.0, positions)
    shape, k = shapes.chunks_for("rl", samples)
    return batching.pack_chunks(
        samples,
        shape,
        k,
        image_token_id=cfg.image_token_id,
        merge=merge,
        substeps=learner.num_substeps,
        devices=learner.layout.batch_parallel,
        screen_patches=unit,
    )


def longest_sample_tokens(config: Any, image_tokens: int) -> int:
    """The longest turn sample the preset's env settings can make, by the same counts as
    `drawn_rl_batch`: the prompt, every earlier action with its feedback, this turn's action,
    and `env.max_history_images` screens with their two marker tokens."""
    rl, env = config.rl, config.env
    text = SYSTEM_TOKENS + env.max_turns * (rl.max_tokens + FEEDBACK_TOKENS)
    return text + min(env.max_history_images, env.max_turns) * (image_tokens + 2)


def least_tokens_per_chip(config: Any, image_tokens: int) -> int:
    """The least `rl.tokens_per_chip` the preset's env settings allow: the shortest row length
    of `rl.row_lengths` that holds the longest turn sample (`longest_sample_tokens`; a sample
    is never split over rows), else the longest row length."""
    lengths = sorted(config.rl.row_lengths)
    need = longest_sample_tokens(config, image_tokens)
    return next((n for n in lengths if n >= need), lengths[-1])


def next_budget(
    config: Any, grads: list[ProgramPlan], limit: int, image_tokens: int
) -> tuple[int, tuple[int, ...]] | None:
    """The smaller (tokens_per_chip, row_lengths) to plan again when the largest of the chunk
    programs `grads` (planned at `config.rl.tokens_per_chip`) peaks above `limit`; a program
    the compiler refused counts at the temporaries it said it needed. None when the largest
    fits, when a refused program gave no figure, when what does not grow with the chunk
    (params, accumulator, optimizer state) is already above `limit`, or when nothing smaller
    is left (`_fitted_budget`)."""
    if not grads or any(p.compile_error is not None and not p.temp_bytes for p in grads):
        return None
    top = max(grads, key=lambda p: p.total_bytes)
    if top.total_bytes <= limit:
        return None
    chunk = top.arguments["chunk (text)"] + top.arguments[_SCREENS_ARG] + top.temp_bytes
    fixed = top.total_bytes - chunk
    if fixed >= limit:
        return None
    tokens = int(config.rl.tokens_per_chip)
    return _fitted_budget(config, tokens, fixed, top.total_bytes, limit, image_tokens)


def _fitted_budget(
    config: Any, tokens: int, fixed: int, peak: int, limit: int, image_tokens: int
) -> tuple[int, tuple[int, ...]] | None:
    """(tokens_per_chip, row_lengths) for the chunk programs to peak under `limit`, from one
    plan at `tokens` whose largest chunk program peaked at `peak`, `fixed` of it not growing
    with the chunk (params, gradient accumulator, optimizer state): the chunk's bytes scaled
    linearly, rounded down to a power of two, at most half of `tokens`, never below the
    shortest row length that holds the longest sample; row lengths above it dropped. None when
    nothing smaller is left to try."""
    lengths = sorted(config.rl.row_lengths)
    floor = least_tokens_per_chip(config, image_tokens)
    scaled = tokens * (limit - fixed) / max(peak - fixed, 1)
    new = 1 << max(int(np.floor(np.log2(max(scaled, 1)))), 0)
    new = max(min(new, tokens // 2), floor)
    if new >= tokens:
        return None
    return new, tuple(n for n in lengths if n <= new) or (floor,)


def plan_budget_chunks(
    config: Any, ab: _Abstract, chip: Chip, kv_bytes: int, limit: int | None, sdpo: bool = False
) -> tuple[list[ProgramPlan], Any, Any, str]:
    """(programs, shapes, drawn batch, note) of the token-budget learner: the chunk programs of
    `rl.tokens_per_chip` (`plan_chunk_programs`, on a batch drawn from the preset's env
    settings). With `limit` (bytes a chip the learner may take: `kv_memory_fraction` less
    `kv_min_fraction` of HBM), a largest chunk program above it is planned again at a smaller
    budget (`_fitted_budget`; twice at most), so a preset sized for a larger slice plans to
    fit a smaller one, and the note says what to pass the run. `sdpo`: SDPO's chunks and
    teacher passes instead of GRPO's (`plan_chunk_programs`)."""
    tokens0, lengths0 = int(config.rl.tokens_per_chip), tuple(config.rl.row_lengths)
    c, note = config, ""
    for _ in range(3):
        shapes = trainer_rl_shapes(c, ab.learner)
        try:
            drawn = drawn_rl_batch(c, ab.learner, shapes)
        except ShapeError as e:
            raise PlanInputError(
                f"the preset's own env settings make a batch no shape holds: {e}"
            ) from None
        useful = 1.0 - drawn.padding_share
        progs = plan_chunk_programs(ab, chip, kv_bytes, shapes, useful, c if sdpo else None)
        grads = [p for p in progs if p.rows]
        if limit is None:
            break
        image_tokens = int(np.prod(shapes.grid)) // ab.learner.config.vision.spatial_merge_size**2
        # a chunk program the compiler refused (out of HBM) counts at the temporaries it said
        # it needed: on a small chip that is what the first plan at the preset's budget gives
        fit = next_budget(c, grads, limit, image_tokens)
        if fit is None:
            break  # fits, or no smaller chunk fits: the misfit is reported as planned
        c = copy.deepcopy(c)
        c.rl.tokens_per_chip, c.rl.row_lengths = fit
    if c is not config:
        t, lengths = int(c.rl.tokens_per_chip), tuple(c.rl.row_lengths)
        note = (
            f"rl.tokens_per_chip {tokens0} -> {t}, rl.row_lengths {lengths0} -> {lengths} to "
            f"leave the KV pool sampler.kv_min_fraction of {chip.name}'s HBM: run with "
            f"--config.rl.tokens_per_chip={t} --config.rl.row_lengths='{lengths}'"
        )
    return progs, shapes, drawn, note


def size_kv_pool(
    cfg: qwen_vl.QwenVLConfig, sc: Any, tensor: int, hbm: int, frac: float, programs: list
) -> tuple[int, int, str]:
    """(pages, bytes a device, a note) of the KV pool sized from memory: `frac` of the chip's
    HBM less the largest planned program's peak (planned with no pool), in whole pages of
    `kv_pool_bytes_per_device`; each program's resident pool is set to it."""
    peak = max((p.total_bytes for p in programs), default=0)
    pages = kv_pages_for_budget(
        cfg, max(0, int(hbm * frac) - peak), sc.page_size, cfg.dtype, tensor
    )
    kv = kv_pool_bytes_per_device(cfg, pages, sc.page_size, cfg.dtype, tensor)
    for p in programs:
        if "KV pool (sampler, resident)" in p.resident:
            p.resident["KV pool (sampler, resident)"] = kv
    note = (
        f"{pages} pages: {frac:.0%} of {hbm / GiB:.0f} GiB less the largest learner program's "
        f"{peak / GiB:.2f} GiB (sampler.kv_memory_fraction)"
    )
    return pages, kv, note


_SCREENS_ARG = "chunk screens (by micro-batch and device)"


def plan_chunk_programs(
    ab: _Abstract,
    chip: Chip,
    kv_bytes: int,
    shapes: Any,
    useful: float = 1.0,
    sdpo_config: Any = None,
    *,
    mode: str = "rl",
    suffix: str = "",
    update: bool = True,
) -> list[ProgramPlan]:
    """A token-budget shape set's learner programs (`rl.tokens_per_chip`): the gradient program
    of one chunk of each RL shape, its screens through the vision tower (grouped by
    micro-batch and device, sharded, in the compute dtype, as `BatchLayout.device_batch` lays
    them out), with the optimizer state and the KV pool resident beside it; then the update
    (`apply_update`). A step runs one gradient call a chunk, so these are its peaks whatever
    a batch's size. `useful`: the share of a chunk's tokens that are samples' (MFU).
    `sdpo_config` (the run's config with rl.algorithm="sdpo"): the chunks are SDPO's (the
    gradient program of its step mode, the teacher's top-k targets among the chunk's inputs),
    and each teacher shape's teacher pass (`plan_teacher_chunks`) follows the update.
    `mode="sft"`: the SFT shapes' chunks of the SFT loss instead, and the update named
    "apply_update (sft)" (kind "sft"); `suffix` ends each name; `update=False` leaves the
    update out (Entropulse: the RL learner's, planned with its RL chunks)."""

    learner = ab.learner
    cfg = learner.config
    s, b = learner.num_substeps, learner.layout.batch_parallel
    repl = learner.replicated
    prefix, k = f"{mode}_grads", 0
    kind = "learner" if mode == "rl" else mode
    if sdpo_config is not None:
        rl = sdpo_config.rl
        mode = sdpo.step_mode(rl.sdpo_divergence, rl.sdpo_js_beta, rl.sdpo_weight)
        prefix, k = "sdpo_grads", sdpo.topk_width(int(rl.sdpo_topk), cfg.text.vocab_size)
    out = []
    for shape in shapes.of(mode):
        xs = _step_inputs(learner, shape.rows, shape.length)
        if k:
            xs.update(_sdpo_targets(learner, shape.rows, shape.length, k))
        images, per_group, unit = _abstract_screens(learner, shape, shapes.grid)
        arguments = {
            "params (trainable)": tree_shard_bytes(ab.trainable),
            "params (frozen)": tree_shard_bytes(ab.frozen) + tree_shard_bytes(ab.rest),
            "gradient accumulator": tree_shard_bytes(ab.trainable),
            "chunk (text)": tree_shard_bytes(xs),
            _SCREENS_ARG: tree_shard_bytes(images),
        }
        if ab.ref is not None:
            arguments["KL reference"] = tree_shard_bytes(ab.ref)
        resident = {
            "optimizer state (resident)": tree_shard_bytes(ab.opt_state),
            "KV pool (sampler, resident)": kv_bytes,
        }
        if k and sdpo_config.rl.sdpo_teacher == "ema":
            resident["EMA teacher params (resident)"] = tree_shard_bytes(ab.trainable)
        name = f"{prefix} {shape.rows}x{shape.length}{suffix}"
        prog = ProgramPlan(name, chip, arguments, resident)
        prog.kind = "sdpo" if k else kind
        prog.rows, prog.row_length = shape.rows, shape.length
        prog.screens = per_group * s * b
        tokens = shape.rows * shape.length
        prog.model_flops = _model_flops(ab, tokens, shape.length, useful) / learner.mesh.size
        prog.notes.append(
            f"one chunk: {shape.rows} rows x {shape.length} tokens ({shapes.tokens_per_chip} "
            f"tokens a chip a micro-batch), {per_group} screens a (micro-batch, device) group "
            f"of {s} x {b}; remat={cfg.remat}, logits_chunk={learner.logits_chunk}"
        )
        if cfg.attn_impl == "splash":
            prog.pallas_flops, prog.pallas_bytes = _splash_cost(
                cfg, shape.rows, shape.length, learner.mesh
            )
        n_total = jax.ShapeDtypeStruct((), jnp.float32, sharding=repl)
        grouped = learner.grads_program(mode, grouped=True)
        args = (ab.trainable, ab.frozen, ab.rest, ab.ref, xs, images, n_total, ab.trainable)
        _compile(grouped, args, prog)
        if s > 1 and prog.compile_error is None:
            prog.flops *= s  # XLA counts the micro-batch scan's body once
            prog.bytes_accessed *= s
        out.append(prog)
    if not update:
        return out
    arguments = {
        "params (trainable)": tree_shard_bytes(ab.trainable),
        "optimizer state": tree_shard_bytes(ab.opt_state),
        "gradients": tree_shard_bytes(ab.trainable),
    }
    resident = {
        "params (frozen, resident)": tree_shard_bytes(ab.frozen) + tree_shard_bytes(ab.rest),
        "KV pool (sampler, resident)": kv_bytes,
    }
    if ab.ref is not None:
        resident["KL reference (resident)"] = tree_shard_bytes(ab.ref)
    name = APPLY_PROGRAM if mode == "rl" else f"{APPLY_PROGRAM} ({mode})"
    prog = ProgramPlan(name + suffix, chip, arguments, resident)
    prog.kind = kind
    _compile(learner.apply_program(), (ab.trainable, ab.opt_state, ab.trainable), prog)
    out.append(prog)
    if k:
        out += plan_teacher_chunks(sdpo_config, ab, chip, kv_bytes, shapes, k)
    return out


def _sdpo_targets(learner: Any, rows: int, length: int, k: int) -> dict[str, Any]:
    """The abstract teacher targets of an SDPO step's rows (`sdpo.TARGET_KEYS`)."""
    topk_sh, tok_sh = learner.layout.rows_sharding(3), learner.layout.rows_sharding(2)
    return {
        "sdpo_ids": jax.ShapeDtypeStruct((rows, length, k), jnp.int32, sharding=topk_sh),
        "sdpo_logp": jax.ShapeDtypeStruct((rows, length, k), jnp.float32, sharding=topk_sh),
        "sdpo_mask": jax.ShapeDtypeStruct((rows, length), jnp.bool_, sharding=tok_sh),
        "sdpo_weights": jax.ShapeDtypeStruct((rows, length), jnp.float32, sharding=tok_sh),
    }


def plan_teacher_chunks(
    config: Any, ab: _Abstract, chip: Chip, kv_bytes: int, shapes: Any, k: int
) -> list[ProgramPlan]:
    """SDPO's teacher pass over a token-budget batch: one call a chunk of each teacher shape
    (the RL shapes and one row length longer for the feedback message, `shapes.teacher`), its
    screens grouped by micro-batch and device as the step's, top-`k` ids and log-probs out,
    with the learner's optimizer state and the KV pool resident beside it."""

    learner = ab.learner
    fn = sdpo._teacher_jit(learner, int(config.rl.sdpo_topk), {})
    out = []
    for shape in shapes.teacher:
        xs = _step_inputs(learner, shape.rows, shape.length)
        images, per_group, _ = _abstract_screens(learner, shape, shapes.grid)
        arguments = {
            "teacher params": tree_shard_bytes(ab.trainable)
            + tree_shard_bytes(ab.frozen)
            + tree_shard_bytes(ab.rest),
            "chunk (text)": tree_shard_bytes(xs),
            _SCREENS_ARG: tree_shard_bytes(images),
        }
        resident = {
            "optimizer state (learner, resident)": tree_shard_bytes(ab.opt_state),
            "KV pool (sampler, resident)": kv_bytes,
        }
        if config.rl.sdpo_teacher == "ema":
            resident["EMA teacher params (resident)"] = tree_shard_bytes(ab.trainable)
        prog = ProgramPlan(f"sdpo_teacher {shape.rows}x{shape.length}", chip, arguments, resident)
        prog.kind, prog.rows, prog.row_length = "sdpo", shape.rows, shape.length
        prog.screens = per_group * learner.num_substeps * learner.layout.batch_parallel
        prog.notes.append(f"one teacher chunk, top-{k} ids and log-probs out")
        _compile(fn, (ab.trainable, ab.frozen, ab.rest, xs, images), prog)
        out.append(prog)
    return out


def _abstract_screens(learner: Any, shape: Any, grid: Any) -> tuple[Any, int, int]:
    """(the step's abstract `ImageGroups` for `shape`, screens a group, patches a screen): the
    screens grouped by micro-batch and device as `BatchLayout.grouped_images` lays them out
    (sharded over the batch axes, in the compute dtype; a token-budget shape's group budget)."""

    v = learner.config.vision
    patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size**2
    s, b = learner.num_substeps, learner.layout.batch_parallel
    per_group, unit, meta = learner.layout.screen_layout(
        shape.length, shape.patches, s, grid, per_group=shape.group_screens
    )
    repl = learner.replicated

    def spec(a):
        a = np.asarray(a)
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=repl)

    pixels = jax.ShapeDtypeStruct(
        (s, b, per_group * unit, patch_dim),
        learner.layout.pixel_dtype(),
        sharding=learner.layout.pixel_sharding(4),
    )
    return ImageGroups(pixels, jax.tree.map(spec, meta)), per_group, unit


def _step_inputs(learner: Any, rows: int, row_len: int) -> dict[str, Any]:
    """The RL step's batch as abstract arrays (text only), laid out as the learner lays it."""
    row_sh, pos_sh = learner.layout.row_sh, learner.layout.pos_sh

    def arr(shape, dtype, sh):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)

    xs = {
        "input_ids": arr((rows, row_len), jnp.int32, row_sh),
        "segment_ids": arr((rows, row_len), jnp.int32, row_sh),
        "loss_mask": arr((rows, row_len), jnp.bool_, row_sh),
        "behaviour_logprobs": arr((rows, row_len), jnp.float32, row_sh),
        "advantages": arr((rows, row_len), jnp.float32, row_sh),
        "loss_weights": arr((rows, row_len), jnp.float32, row_sh),
        "position_ids": arr((3, rows, row_len), jnp.int32, pos_sh),
    }
    if learner.route_shape is not None:  # MoE: the sampler's recorded experts (routing replay)
        xs["routes"] = arr((rows, row_len, *learner.route_shape), jnp.int32, learner.route_sharding)
    return xs


def _step_arguments(ab: _Abstract, xs: dict[str, Any], batch: str) -> dict[str, int]:
    """A learner step's arguments by kind, in shard bytes (the batch under the name `batch`)."""
    arguments = {
        "params (trainable)": tree_shard_bytes(ab.trainable),
        "params (frozen)": tree_shard_bytes(ab.frozen) + tree_shard_bytes(ab.rest),
        "optimizer state": tree_shard_bytes(ab.opt_state),
        batch: tree_shard_bytes(xs),
    }
    if ab.ref is not None:
        arguments["KL reference"] = tree_shard_bytes(ab.ref)
    return arguments


PROGRAMS = (
    "train_step",
    "train_step_screens",
    "sft_step",
    "sdpo_step",
    "sdpo_teacher",
    "decode_step",
    "prefill_turn",
)


def default_programs(config: Any) -> tuple[str, ...]:
    """What a run of `config` compiles: with a token-budget shape set (`rl.tokens_per_chip`)
    the learner's chunk programs with their screens and the update, the SFT learner's chunks
    and update when the run trains SFT (`trains_sft`), and the sampler's prefill of a real
    turn, else the text-only `train_step`; SDPO's teacher pass and step when `rl.algorithm`
    asks; the sampler's decode."""
    distill = ("sdpo_step", "sdpo_teacher") if config.rl.get("algorithm", "grpo") == "sdpo" else ()
    if config.rl.get("tokens_per_chip", 0) <= 0:
        return ("train_step", *distill, "decode_step")
    # with a token budget SDPO's programs are its chunks' (`plan_chunk_programs`)
    sft = ("sft_step",) if any(trains_sft(config)) else ()
    return ("train_step_screens", *sft, *distill, "decode_step", "prefill_turn")


def trains_sft(config: Any) -> tuple[bool, bool]:
    """(the SFT warm-up's learner trains: sft.steps or mid.steps > 0, the RL learner takes SFT
    steps: Entropulse, rl.entropulse_every > 0)."""
    warmup = config.sft.get("steps", 0) > 0 or config.get("mid", {}).get("steps", 0) > 0
    return warmup, config.rl.get("entropulse_every", 0) > 0


def plan_sft(
    config: Any,
    ab: _Abstract,
    cfg: qwen_vl.QwenVLConfig,
    mesh: Any,
    rules: shd.Rules,
    chip: Chip,
    kv_bytes: int,
    shapes: Any,
    useful: float = 1.0,
) -> list[ProgramPlan]:
    """The SFT programs a run of `config` compiles (kind "sft"), on the shape set's SFT shapes
    with their screens: the SFT warm-up's learner (built as the trainer builds it: no KL
    reference, its own optimizer state, beside the resident KV pool) with a token budget its
    chunk gradient programs and its update, else its one-call step at the largest SFT shape;
    with Entropulse the RL learner's SFT chunks too ("(entropulse)"). `ab`: the RL learner.
    Asked for (`--programs=sft_step`) by a run that trains no SFT: the SFT learner's."""
    warmup, entropulse = trains_sft(config)
    out: list[ProgramPlan] = []
    if warmup or not entropulse:
        sft_ab = build_abstract(config, cfg, mesh, rules, sft=True)
        if shapes.budgeted:
            out += plan_chunk_programs(sft_ab, chip, kv_bytes, shapes, useful, mode="sft")
        else:
            out.append(plan_train_step_screens(sft_ab, chip, kv_bytes, shapes, mode="sft"))
    if entropulse:
        if shapes.budgeted:
            out += plan_chunk_programs(
                ab, chip, kv_bytes, shapes, useful, mode="sft", suffix=" (entropulse)", update=False
            )
        else:
            prog = plan_train_step_screens(ab, chip, kv_bytes, shapes, mode="sft")
            prog.name += " (entropulse)"
            out.append(prog)
    return out


def plan_sdpo(
    config: Any,
    ab: _Abstract,
    mesh: Any,
    chip: Chip,
    rows: int,
    row_len: int,
    kv_bytes: int,
    programs: tuple[str, ...] = ("sdpo_step", "sdpo_teacher"),
) -> list[ProgramPlan]:
    """rl.algorithm="sdpo": the SDPO step (the RL step plus the teacher's top-k targets as
    inputs) on the RL rows, and the teacher pass (a forward over the learner's micro-batches,
    top-k log-probs out) on the teacher rows, one length longer for the feedback message
    (`shapes.teacher_row_length`, with one screen's tokens for the final screenshot); those of
    the two in `programs`."""

    rl, learner = config.rl, ab.learner
    cfg = learner.config
    k = sdpo.topk_width(int(rl.sdpo_topk), cfg.text.vocab_size)
    mode = sdpo.step_mode(rl.sdpo_divergence, rl.sdpo_js_beta, rl.sdpo_weight)
    xs = {**_step_inputs(learner, rows, row_len), **_sdpo_targets(learner, rows, row_len, k)}
    resident = {"KV pool (sampler, resident)": kv_bytes}
    if rl.sdpo_teacher == "ema":
        resident["EMA teacher params (resident)"] = tree_shard_bytes(ab.trainable)
    step = ProgramPlan(
        "sdpo_step", chip, _step_arguments(ab, xs, "batch with teacher targets"), resident
    )
    step.notes.append(
        f"{rows} rows x {row_len} tokens, text only; teacher top-{k} targets; mode {mode}"
    )
    step.kind, step.rows, step.row_length = "sdpo", rows, row_len
    args = (ab.trainable, ab.opt_state, ab.frozen, ab.rest, ab.ref, xs, None)
    out = []
    if "sdpo_step" in programs:
        _compile(learner.step_program(mode), args, step)
        out.append(step)
    if "sdpo_teacher" not in programs:
        return out

    unit = cfg.vision.patch_size * cfg.vision.spatial_merge_size
    screen = -(-config.env.viewport_height // unit) * -(-config.env.viewport_width // unit)
    t_len = teacher_row_length(config, screen, row_len)
    t_xs = _step_inputs(learner, rows, t_len)
    teacher = ProgramPlan(
        "sdpo_teacher",
        chip,
        {
            "teacher params": tree_shard_bytes(ab.trainable)
            + tree_shard_bytes(ab.frozen)
            + tree_shard_bytes(ab.rest),
            "teacher batch": tree_shard_bytes(t_xs),
        },
        {
            "optimizer state (learner, resident)": tree_shard_bytes(ab.opt_state),
            **resident,
        },
    )
    teacher.notes.append(
        f"{rows} rows x {t_len} tokens (the RL rows plus the feedback message and a "
        f"{screen}-token screen) in {learner.num_substeps} micro-batches, text only; "
        f"top-{k} ids and log-probs out"
    )
    teacher.kind, teacher.rows, teacher.row_length = "sdpo", rows, t_len
    fn = sdpo._teacher_jit(learner, rl.sdpo_topk, {})
    _compile(fn, (ab.trainable, ab.frozen, ab.rest, t_xs, None), teacher)
    return [*out, teacher]


def _splash_cost(cfg: qwen_vl.QwenVLConfig, rows: int, row_len: int, mesh: Any) -> tuple:
    """FLOPs and HBM bytes per device of the learner's splash attention kernels in one step
    (XLA's cost analysis counts a Pallas call as almost nothing), by hand.

    Per layer and row, one causal [T, T] x [heads x head_dim] matmul is T^2 N H FLOPs (half
    of 2 T^2 N H: the kernel skips the masked tiles). The forward kernel runs two (QK^T, PV),
    the backward's dK/dV kernel four (QK^T, dV, dP, dK) and its dQ kernel three (QK^T, dP,
    dQ): 9; remat="full" runs the forward once more: 11. Bytes: the forward reads Q and
    writes O once and reads K and V once per query tile below the diagonal (T / block / 2
    times on average); the backward reads and writes about twice that."""
    t = cfg.text
    T, N, K, H = row_len, t.num_attention_heads, t.num_key_value_heads, t.head_dim
    block = splash_tile(cfg.attn_block, T)
    matmuls = 9 + (2 if cfg.remat == "full" else 0)
    flops = matmuls * T * T * N * H * rows * t.num_hidden_layers
    size = jnp.dtype(cfg.dtype).itemsize
    fwd = (2 * T * N * H + 2 * T * K * H * max(1.0, T / block / 2)) * size
    fwd_runs = 2 if cfg.remat == "full" else 1
    nbytes = (fwd_runs + 2) * fwd * rows * t.num_hidden_layers
    return flops / mesh.size, nbytes / mesh.size


# ------------------------------------------------------------------------------- decode step
def plan_decode_step(
    config: Any, ab: _Abstract, mesh: Any, chip: Chip, num_pages: int, backend: str
) -> ProgramPlan:

    cfg = ab.learner.config
    t = cfg.text
    sc = config.sampler
    S, L = sc.max_slots, sc.page_size
    tensor = mesh.shape["tensor"]
    if t.num_key_value_heads % tensor:
        raise PlanInputError(
            f"num_key_value_heads={t.num_key_value_heads} is not divisible by mesh.tensor="
            f"{tensor}: the sampler shards K/V over kv heads; change --config.mesh.tensor"
        )
    pages_per_seq = -(-sc.max_seq_len // L)
    # Every slot live, the pool shared evenly: each slot's context is what the pool can hold.
    ctx = min(sc.max_seq_len, (num_pages - 1) * L // S)
    cache_dtype = jnp.dtype(cfg.dtype)

    kv_sh = kv_sharding(mesh)  # as the engine lays out its pools
    pool = jax.ShapeDtypeStruct(
        (t.num_key_value_heads, num_pages, L, t.head_dim), cache_dtype, sharding=kv_sh
    )
    cache = kv_cache.KVCache((pool,) * t.num_hidden_layers, (pool,) * t.num_hidden_layers)
    repl = NamedSharding(mesh, P())
    params = nnx.merge_state(ab.trainable, ab.frozen, ab.rest)
    kv_bytes = tree_shard_bytes(cache)
    arguments = {"params": tree_shard_bytes(params), f"KV pool ({num_pages} pages)": kv_bytes}
    resident = {"optimizer state (learner, resident)": tree_shard_bytes(ab.opt_state)}
    if ab.ref is not None:
        resident["KL reference (learner, resident)"] = tree_shard_bytes(ab.ref)
    prog = ProgramPlan("decode_step", chip, arguments, resident)
    prog.kind = "sampler"
    # As the engine decides: the TPU kernel, or the jnp reference where it cannot take the shapes.
    platform = mesh.devices.flat[0].platform
    backend = select_backend(backend, head_dim=t.head_dim, page_size=L, platform=platform)
    # The kernel, by hand (XLA's cost analysis counts a Pallas call as almost nothing): per
    # layer and slot, q.k and p.v over ctx tokens (4 N H ctx FLOPs) reading K and V of ctx
    # tokens (2 K H ctx x dtype bytes); heads split over `tensor`.
    per_layer = S * ctx * t.head_dim
    attn_flops = 4 * t.num_attention_heads * per_layer * t.num_hidden_layers / tensor
    kv_read = 2 * t.num_key_value_heads * per_layer * cache_dtype.itemsize * t.num_hidden_layers
    kv_read /= tensor
    if backend in ("tpu", "gpu"):  # Pallas calls (Mosaic / Triton)
        prog.pallas_flops, prog.pallas_bytes = attn_flops, kv_read
    n_text = _text_param_count(params)
    prog.model_flops = (2 * n_text * S) / mesh.size + attn_flops
    # A decode step must read every text weight once (each device its shard, FSDP gathers
    # the rest: the shard is what HBM serves) and the live K/V.
    prog.min_bytes = tree_shard_bytes(_text_only(params)) + kv_read
    prog.notes.append(
        f"{S} slots x context {ctx} (pool {num_pages} x {L} tokens, max_seq_len "
        f"{sc.max_seq_len}, {pages_per_seq} pages a sequence); the engine's decode chunk "
        f"(steps.decode_paged): XLA counts its loop body once, so FLOPs and bytes are one of "
        f"its {sc.decode_chunk} steps; "
        f"paged attention: {backend} kernel, K/V {cache_dtype.name} sharded over tensor={tensor}"
    )

    # The engine's own jitted decode chunk (cua_jax.sampler.steps), sharded as the engine
    # shards it: params in place with the learner's shardings, pools over kv heads.
    step_cfg = steps.StepConfig(
        page_size=L,
        decode_chunk=sc.decode_chunk,
        head_dim=t.head_dim,
        attn_backend=backend,
        attn_options=GpuKernelOptions(),
        mesh=mesh,
    )
    shardings = steps.StepShardings(
        params=jax.tree.map(lambda x: x.sharding, params), cache=kv_sh, small=repl
    )
    fns = steps.build_step_fns(ab.decode_model, step_cfg, shardings, t.num_hidden_layers)
    fn = fns.decode_paged
    args = (params, cache, *steps.decode_arg_shapes(S, pages_per_seq))
    _compile(fn, args, prog)
    return prog


def plan_prefill_turn(
    config: Any, ab: _Abstract, mesh: Any, chip: Chip, num_pages: int, backend: str
) -> ProgramPlan:
    """The sampler's prefill of one real turn: one row of the preset's `env.max_history_images`
    screens at its viewport with `SYSTEM_TOKENS` of prompt, in the engine's token bucket, its
    whole page table, with the KV pool resident as the decode step has it (the engine's
    `prefill(grid)` program, `cua_jax.sampler.steps`)."""

    cfg = ab.learner.config
    t, v = cfg.text, cfg.vision
    sc, env = config.sampler, config.env
    L = sc.page_size
    shapes = trainer_rl_shapes(config, ab.learner)
    grid = shapes.grid
    unit = int(np.prod(grid))
    screens = env.max_history_images
    tokens = screens * (unit // v.spatial_merge_size**2 + 2) + SYSTEM_TOKENS
    T = min(token_bucket(tokens), sc.max_seq_len)
    cols = -(-sc.max_seq_len // L)
    dim = v.in_channels * v.temporal_patch_size * v.patch_size**2
    kv_sh = kv_sharding(mesh)
    pool = jax.ShapeDtypeStruct(
        (t.num_key_value_heads, num_pages, L, t.head_dim), jnp.dtype(cfg.dtype), sharding=kv_sh
    )
    cache = kv_cache.KVCache((pool,) * t.num_hidden_layers, (pool,) * t.num_hidden_layers)
    params = nnx.merge_state(ab.trainable, ab.frozen, ab.rest)
    repl = NamedSharding(mesh, P())
    arguments = {
        "params": tree_shard_bytes(params),
        f"KV pool ({num_pages} pages)": tree_shard_bytes(cache),
        "the turn's screens": screens * unit * dim * 4,
    }
    resident = {"optimizer state (learner, resident)": tree_shard_bytes(ab.opt_state)}
    if ab.ref is not None:
        resident["KL reference (learner, resident)"] = tree_shard_bytes(ab.ref)
    prog = ProgramPlan("prefill_turn", chip, arguments, resident)
    prog.kind, prog.rows, prog.row_length, prog.screens = "sampler", 1, T, screens
    platform = mesh.devices.flat[0].platform
    backend = select_backend(backend, head_dim=t.head_dim, page_size=L, platform=platform)
    step_cfg = steps.StepConfig(
        page_size=L,
        decode_chunk=sc.decode_chunk,
        head_dim=t.head_dim,
        attn_backend=backend,
        attn_options=GpuKernelOptions(),
        mesh=mesh,
    )
    shardings = steps.StepShardings(
        params=jax.tree.map(lambda x: x.sharding, params), cache=kv_sh, small=repl
    )
    fns = steps.build_step_fns(ab.decode_model, step_cfg, shardings, t.num_hidden_layers)
    prog.notes.append(
        f"one turn: {screens} screens of {unit} patches and about {tokens} tokens in a "
        f"{T}-token prefill, a {cols}-column page table"
        + (f" (a turn is longer than sampler.max_seq_len={sc.max_seq_len})" if tokens > T else "")
    )
    args = (params, cache, *steps.prefill_arg_shapes(1, T, cols, (screens * unit, dim)))
    _compile(fns.prefill((tuple(grid),) * screens), args, prog)
    return prog


def _text_only(state: Any) -> list[Any]:
    return [
        x
        for p, x in jax.tree_util.tree_flatten_with_path(state)[0]
        if "visual" not in jax.tree_util.keystr(p)
    ]


# ------------------------------------------------------------------------------- the plan
def make_plan(
    config: Any,
    topology: str | Topology,
    *,
    devices: list[Any] | None = None,
    headroom: float = 0.1,
    rows: int | None = None,
    row_len: int | None = None,
    programs: tuple[str, ...] | None = None,
    attn_backend: str = "auto",
) -> Plan:
    """Compiles `programs` of the run `config` describes for the slice `topology` (a name in
    TOPOLOGIES), or, with `devices` (e.g. `jax.devices()`), for the devices present.

    Raises PlanInputError for bad input (unknown topology, hf_path not a directory, a mesh that
    does not divide the slice or the model).
    """
    if not programs:
        programs = default_programs(config)
    unknown = set(programs) - set(PROGRAMS)
    if unknown:
        raise PlanInputError(f"unknown programs {sorted(unknown)}; use {', '.join(PROGRAMS)}")
    if devices is None:
        topo = get_topology(str(topology))
        devices = abstract_devices(topo)
    else:  # the devices present (a launch-time check)
        topo = topology if isinstance(topology, Topology) else local_topology(list(devices))
    cfg = model_config(config)
    m = config.mesh
    try:
        mesh = shd.make_mesh(m.data, m.fsdp, m.tensor, devices=devices, expert=m.get("expert", 1))
    except ValueError as e:
        raise PlanInputError(f"mesh does not fit {topo.name} ({len(devices)} chips): {e}") from e
    rules = tuple(shd.DEFAULT_RULES) + tuple(tuple(r) for r in m.rules)
    try:
        ab = build_abstract(config, cfg, mesh, rules)
    except ValueError as e:  # a dimension the mesh cannot divide
        raise PlanInputError(f"the mesh {dict(mesh.shape)} cannot lay out the model: {e}") from e

    sc = config.sampler
    tensor = mesh.shape["tensor"]
    budget = int(topo.chip.hbm_bytes * (1.0 - headroom))
    num_pages = sc.num_pages
    frac = float(config.sampler.get("kv_memory_fraction", 0.0) or 0.0)
    # kv_memory_fraction > 0: the pool takes what the learner's programs leave of that share
    # of HBM (`size_kv_pool`, after they are planned with no pool); else sampler.num_pages
    kv_bytes = (
        0 if frac > 0 else kv_pool_bytes_per_device(cfg, num_pages, sc.page_size, cfg.dtype, tensor)
    )
    rows = rows or config.rl.rows_per_step
    mult = ab.learner.row_multiple
    rows = -(-rows // mult) * mult
    row_len = row_len or max(config.rl.row_lengths)

    with_train = "train_step" in programs and config.rl.algorithm == "sdpo"
    sdpo_programs = tuple(p for p in ("sdpo_step", "sdpo_teacher") if p in programs or with_train)
    out: list[ProgramPlan] = []
    shapes = None
    if {"train_step", "train_step_screens", "sft_step"} & set(programs):
        shapes = trainer_rl_shapes(config, ab.learner)
    if "train_step" in programs:
        out.append(plan_train_step(config, ab, mesh, topo.chip, rows, row_len, kv_bytes, shapes))
    drawn = None
    fit_note = ""
    if "train_step_screens" in programs and shapes.budgeted:
        min_frac = float(config.sampler.get("kv_min_fraction", 0.0) or 0.0)
        limit = int(topo.chip.hbm_bytes * (frac - min_frac)) if frac > 0 and min_frac else None
        chunks, shapes, drawn, fit_note = plan_budget_chunks(
            config, ab, topo.chip, kv_bytes, limit, sdpo=bool(sdpo_programs)
        )
        out += chunks
        sdpo_programs = ()  # planned with the chunks: SDPO's gradient and teacher chunks
    elif "train_step_screens" in programs:
        out.append(plan_train_step_screens(ab, topo.chip, kv_bytes, shapes))
    if "sft_step" in programs:  # the budget's shapes as fitted above (the SFT shapes are the RL)
        useful = 1.0 - drawn.padding_share if drawn is not None else 1.0
        out += plan_sft(config, ab, cfg, mesh, rules, topo.chip, kv_bytes, shapes, useful)
    if sdpo_programs:
        out += plan_sdpo(config, ab, mesh, topo.chip, rows, row_len, kv_bytes, sdpo_programs)
    pool_note = ""
    hbm = topo.chip.hbm_bytes
    if frac > 0:
        num_pages, kv_bytes, pool_note = size_kv_pool(cfg, sc, tensor, hbm, frac, out)

    def sampler_programs(pages: int) -> list[ProgramPlan]:
        # a pool of 0 or 1 pages holds nothing to decode: compiled at 2 (`kv_pool_problem`
        # then says the plan does not fit)
        pages, progs = max(pages, 2), []
        if "decode_step" in programs:
            progs.append(plan_decode_step(config, ab, mesh, topo.chip, pages, attn_backend))
        if "prefill_turn" in programs:
            progs.append(plan_prefill_turn(config, ab, mesh, topo.chip, pages, attn_backend))
        return progs

    sampler = sampler_programs(num_pages)
    problems = []
    if frac > 0:
        # the sampler's own scratch (the prefill's vision tower, the decode loop) above the
        # learner's: the pool gives up the rest, and both are compiled again with it
        per_page = kv_pool_bytes_per_device(cfg, 1, sc.page_size, cfg.dtype, tensor)
        cut = sampler_pool_cut(sampler, hbm, frac, per_page)
        if cut:
            num_pages = max(0, num_pages - cut)
            kv_bytes = num_pages * per_page
            names = ", ".join(p.name for p in sampler if p.total_bytes > hbm * frac)
            sampler = sampler_programs(num_pages)
            for p in out:
                if "KV pool (sampler, resident)" in p.resident:
                    p.resident["KV pool (sampler, resident)"] = kv_bytes
            pool_note += f"; cut to {num_pages} pages for the sampler's own scratch ({names})"
        min_frac = float(sc.get("kv_min_fraction", 0.0) or 0.0)
        problem = kv_pool_problem(cfg, sc, num_pages, tensor, hbm, min_frac)
        if problem:
            problems.append(problem)
    out += sampler

    # The pool that would fit next to the train step (its other consumers as compiled).
    summary: dict[str, Any] = {
        "model": f"{cfg.family} {_param_count(ab.trainable) + _param_count(ab.frozen):,} params",
        "trainable_params": _param_count(ab.trainable),
        "lora_rank": int(config.model.lora_rank),
        "num_pages": num_pages,
        "kv_pool_bytes": kv_bytes,
        "kv_pool": pool_note or f"sampler.num_pages = {num_pages}",
        "rows": rows,
        "row_len": row_len,
        "remat": ab.learner.config.remat,
        "num_substeps": ab.learner.num_substeps,
    }
    if shapes is not None and shapes.budgeted:
        summary["tokens_per_chip"] = shapes.tokens_per_chip
        summary["row_lengths"] = tuple(sh.length for sh in shapes.rl)
        image_tokens = int(np.prod(shapes.grid)) // cfg.vision.spatial_merge_size**2
        summary["least_tokens_per_chip"] = least_tokens_per_chip(config, image_tokens)
    if fit_note:
        summary["token_budget"] = fit_note
    if drawn is not None:
        summary["drawn_batch"] = (
            f"{drawn.num_samples} samples in {drawn.chunks} chunks of "
            f"{drawn.shape[0] // drawn.chunks} x {drawn.shape[1]}, "
            f"padding share {drawn.padding_share:.3f}"
        )
        summary["padding_share"] = drawn.padding_share
        summary["chunks"] = drawn.chunks
        summary["drawn_length"] = drawn.shape[1]
    train = next((p for p in out if p.name == "train_step" and p.compile_error is None), None)
    if train is not None:
        spare = budget - (train.total_bytes - kv_bytes)
        summary["kv_pages_that_fit"] = kv_pages_for_budget(
            cfg, max(spare, 0), sc.page_size, cfg.dtype, tensor
        )
    return Plan(topo, dict(mesh.shape), headroom, out, summary, problems)


def sampler_pool_cut(sampler: list[ProgramPlan], hbm: int, frac: float, per_page: int) -> int:
    """KV pages the pool sized from the learner's programs (`size_kv_pool`) must give up so that
    every sampler program (`decode_step`, `prefill_turn`, each with that pool among its
    arguments) peaks within `frac` of `hbm`: its excess over that share in whole pages of
    `per_page` bytes (0 when none is over; a program the compiler refused counts at the
    temporaries it said it needed)."""
    peaks = [p.total_bytes for p in sampler if p.compile_error is None or p.temp_bytes]
    over = max(peaks, default=0) - int(hbm * frac)
    return -(-over // per_page) if over > 0 else 0


def kv_pool_problem(
    cfg: qwen_vl.QwenVLConfig, sc: Any, pages: int, tensor: int, hbm: int, min_frac: float
) -> str:
    """Why a run stops at start with the pool of `pages` a device sized from memory, as
    `builders.kv_pages` refuses it: less than `min_frac` (sampler.kv_min_fraction) of `hbm`, or
    not one sequence of sampler.max_seq_len past the scratch page 0; "" when neither."""
    pool = kv_pool_bytes_per_device(cfg, pages, sc.page_size, cfg.dtype, tensor)
    fix = (
        "lower --config.rl.tokens_per_chip or --config.sampler.kv_min_fraction, a larger "
        "--config.mesh.tensor (K/V and activations split over it), or a larger topology"
    )
    if pool < min_frac * hbm:
        return (
            f"the KV pool gets {pool / GiB:.2f} GiB ({pages} pages) a device, less than "
            f"sampler.kv_min_fraction={min_frac} of {hbm / GiB:.0f} GiB "
            f"({min_frac * hbm / GiB:.2f} GiB): a run stops at start; {fix}"
        )
    if (pages - 1) * sc.page_size < sc.max_seq_len:
        return (
            f"the KV pool gets {pages} pages of {sc.page_size} tokens, not one sequence of "
            f"sampler.max_seq_len={sc.max_seq_len} past the scratch page: a run stops at "
            f"start; {fix}, or a shorter --config.sampler.max_seq_len"
        )
    return ""


def fmt_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / (1 << 20):.2f} MiB"


def format_plan(plan: Plan) -> str:
    """Human-readable tables: one per program, then the verdict."""
    topo, chip = plan.topology, plan.topology.chip
    s = plan.summary
    if topo.topology_name:  # a TPU slice by name (abstract devices)
        hw = f"{topo.num_chips} x TPU {chip.name}, {topo.num_hosts} host(s), "
    else:  # the devices present (launch/tpu.py --dry_run)
        hw = "the devices present, "
    mem = f"{chip.hbm_bytes / GiB:.0f} GiB" if chip.hbm_bytes else "no memory limit reported"
    peak = (
        f", {chip.peak_bf16_flops / 1e12:.0f} TFLOP/s bf16, {chip.hbm_bandwidth / 1e9:.0f} GB/s"
        if chip.peak_bf16_flops
        else ", no published peak figures (no roofline)"
    )
    lines = [
        f"plan for {topo.name} ({hw}{mem}{peak} per device); mesh {plan.mesh_shape}; "
        f"{s['model']}, {s['trainable_params']:,} trainable; KV pool {s['kv_pool']}",
    ]
    for p in plan.programs:
        took = f"; compiled in {p.compile_s:.0f} s" if p.compile_error is None else ""
        lines += [
            "",
            f"## {p.name}  ({'; '.join(p.notes)}{took})",
            "| per device | bytes |",
            "| --- | --- |",
        ]
        for k, v in p.arguments.items():
            lines.append(f"| argument: {k} | {fmt_bytes(v)} |")
        for k, v in p.resident.items():
            lines.append(f"| {k} | {fmt_bytes(v)} |")
        if p.compile_error is not None:
            lines.append(f"| compile | {p.compile_error} |")
        else:
            lines += [
                f"| arguments (compiler) | {fmt_bytes(p.argument_bytes)} |",
                f"| outputs (donated: {fmt_bytes(p.alias_bytes)}) | {fmt_bytes(p.output_bytes)} |",
                f"| temp | {fmt_bytes(p.temp_bytes)} |",
            ]
        lines.append(
            f"| **total** vs HBM {fmt_bytes(chip.hbm_bytes)} (budget "
            f"{fmt_bytes(plan.budget_bytes)}) | **{fmt_bytes(p.total_bytes)}** |"
        )
        if p.compile_error is None:
            lines += [
                "",
                f"FLOPs/step {p.flops:.3e} (Pallas, by hand: {p.pallas_flops:.3e}); bytes "
                f"accessed {p.bytes_accessed:.3e} (Pallas: {p.pallas_bytes:.3e}); "
                + (
                    f"roofline {p.roofline_s * 1e3:.2f} ms; "
                    + (
                        f"MFU {p.mfu:.1%}"
                        if p.model_flops
                        else f"MBU {p.mbu:.1%}"
                        if p.min_bytes
                        else "no MFU / MBU (no useful-work count for this program)"
                    )
                    if p.roofline_s
                    else "no roofline (no published peak figures for this device)"
                ),
            ]
    lines += [
        "",
        "| program | kind | rows x length | screens | peak per device | fits | est. MFU |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    misfits = plan.misfits()
    for p in plan.programs:
        batch = f"{p.rows} x {p.row_length}" if p.rows else "-"
        mfu = f"{p.mfu:.1%}" if p.compile_error is None and p.model_flops and p.roofline_s else "-"
        lines.append(
            f"| {p.name} | {p.kind or '-'} | {batch} | {p.screens or '-'} | "
            f"{fmt_bytes(p.total_bytes)} | {'NO' if p in misfits else 'yes'} | {mfu} |"
        )
    if "token_budget" in s:
        lines.append(f"\ntoken budget sized from memory: {s['token_budget']}")
    if "drawn_batch" in s:
        lines.append(f"\nthe RL batch drawn from the preset's env settings: {s['drawn_batch']}")
        est = step_seconds(plan)
        if est:
            lines.append(f"estimated RL step (roofline): {est:.2f} s")
    lines.append("")
    if plan.fits and not chip.hbm_bytes:
        lines.append("compiled; the devices report no memory limit to check against")
    elif plan.fits:
        worst = max(p.total_bytes for p in plan.programs)
        lines.append(
            f"fits: largest program {worst / GiB:.1f} GiB of {chip.hbm_bytes / GiB:.0f} GiB per "
            f"device ({1 - worst / chip.hbm_bytes:.0%} free; headroom asked {plan.headroom:.0%})"
        )
    else:
        lines.append("does not fit: " + plan.reason())
    return "\n".join(lines)


def step_seconds(plan: Plan) -> float:
    """A token-budget RL step's roofline time: the drawn batch's chunks through its shape's
    gradient program, then the update (0 when not known)."""
    s = plan.summary
    grads = [p for p in plan.programs if p.name.startswith("rl_grads") and p.roofline_s]
    apply = [p for p in plan.programs if p.name == "apply_update" and p.roofline_s]
    if not grads or "chunks" not in s:
        return 0.0
    drawn = [p for p in grads if p.row_length == s.get("drawn_length")]
    used = drawn[0] if drawn else max(grads, key=lambda p: p.roofline_s)
    return s["chunks"] * used.roofline_s + sum(p.roofline_s for p in apply)


def plan_json(plan: Plan, preset: str) -> dict[str, Any]:
    """`tools/plan.py --json`'s record of a plan."""
    limit = plan.budget_bytes or float("inf")
    return {
        "preset": preset,
        "topology": plan.topology.name,
        "processes": plan.topology.num_hosts,
        "hbm_bytes": plan.topology.chip.hbm_bytes,
        "fits": plan.fits,
        "problems": list(plan.problems),
        "padding_share": plan.summary.get("padding_share"),
        "tokens_per_chip": plan.summary.get("tokens_per_chip"),
        "row_lengths": list(plan.summary.get("row_lengths", ())),
        "programs": [
            {
                "name": p.name,
                "kind": p.kind,
                "rows": p.rows,
                "row_length": p.row_length,
                "screens": p.screens,
                "bytes": p.total_bytes,
                "fits": p.compile_error is None and p.total_bytes <= limit,
                "est_mfu": p.mfu if p.compile_error is None and p.model_flops else None,
            }
            for p in plan.programs
        ],
    }


def dry_run(config: Any, devices: list[Any] | None = None, prog: str = "launch/tpu.py") -> int:
    """The launch-time check (`launch/tpu.py --dry_run`): the run's programs compiled for the
    devices present (`jax.devices()`: real TPU / GPU chips, or CPU devices), the plan printed on
    stdout; returns the exit status: 0 fits, 1 does not (the one-line reason on stderr, prefixed
    with `prog`). Raises PlanInputError for bad input (the caller's exit 2)."""
    plan = make_plan(config, "", devices=list(devices if devices is not None else jax.devices()))
    print(format_plan(plan), flush=True)
    if plan.fits:
        return 0
    print(f"{prog}: {plan.reason()}", file=sys.stderr)
    return 1
