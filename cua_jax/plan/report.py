"""A plan's results: per-device byte counts of abstract arrays, one compiled program's figures
(`ProgramPlan`), the plan and its verdict with what to change (`Plan`), and the plan as tables
(`format_plan`), an RL step's roofline time (`step_seconds`) and JSON (`plan_json`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from cua_jax.plan.hardware import TOPOLOGIES, Chip, GiB, Topology


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


# A learner program's resident entry for the sampler's cache (the KV pool and, for a hybrid
# model, its linear states): planned with the states alone, set to pool + states once sized
SAMPLER_CACHE = "KV pool (sampler, resident)"


def set_sampler_cache(programs: list, nbytes: int) -> None:
    """Sets the resident sampler cache of each of `programs` that holds one to `nbytes`."""
    for p in programs:
        if SAMPLER_CACHE in p.resident:
            p.resident[SAMPLER_CACHE] = nbytes


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
    # bytes one device moves over the interconnect, by collective kind (`plan.collectives`)
    collective_bytes: dict[str, float] = dataclasses.field(default_factory=dict)
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
    def ici_s(self) -> float:
        """Seconds the program's collectives take at the chip's ICI bandwidth (0: unknown)."""
        bw = self.chip.ici_bandwidth
        return sum(self.collective_bytes.values()) / bw if bw else 0.0

    @property
    def roofline_s(self) -> float:
        """The slowest of compute, HBM traffic and interconnect traffic, each at its peak."""
        if not (self.chip.peak_bf16_flops and self.chip.hbm_bandwidth):
            return 0.0  # a device without published figures
        return max(
            self.flops / self.chip.peak_bf16_flops,
            self.bytes_accessed / self.chip.hbm_bandwidth,
            self.ici_s,
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


def fmt_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / (1 << 20):.2f} MiB"


def _collectives_text(p: ProgramPlan) -> str:
    """The program's interconnect traffic a device, by kind, and its time at the ICI peak."""
    if not p.collective_bytes:
        return "no collectives; "
    kinds = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(p.collective_bytes.items()))
    t = f" ({p.ici_s * 1e3:.2f} ms at the ICI peak)" if p.ici_s else ""
    total = fmt_bytes(sum(p.collective_bytes.values()))
    return f"moved over the interconnect {total}{t}: {kinds}; "


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
                + _collectives_text(p)
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
        "| program | kind | rows x length | screens | peak per device | fits | ICI moved "
        "| est. MFU |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    misfits = plan.misfits()
    for p in plan.programs:
        batch = f"{p.rows} x {p.row_length}" if p.rows else "-"
        mfu = f"{p.mfu:.1%}" if p.compile_error is None and p.model_flops and p.roofline_s else "-"
        lines.append(
            f"| {p.name} | {p.kind or '-'} | {batch} | {p.screens or '-'} | "
            f"{fmt_bytes(p.total_bytes)} | {'NO' if p in misfits else 'yes'} | "
            f"{fmt_bytes(sum(p.collective_bytes.values()))} | {mfu} |"
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
                "temp_bytes": p.temp_bytes,
                "flops": p.flops,
                "bytes_accessed": p.bytes_accessed,
                "collective_bytes": dict(p.collective_bytes),
                "ici_s": p.ici_s,
                "roofline_s": p.roofline_s,
            }
            for p in plan.programs
        ],
        "est_step_s": step_seconds(plan) or None,
    }
