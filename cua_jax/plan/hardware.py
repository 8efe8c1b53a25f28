"""The TPU chips and slices a plan is for: each chip's published figures (`CHIPS`), the slices by
name (`TOPOLOGIES`, `get_topology`) and their abstract devices from libtpu (`abstract_devices`),
and the devices present as a topology (`local_topology`); `PlanInputError` for bad input."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

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
    # bytes / s one chip receives over all its ICI links: half the published bidirectional
    # figure (0: not published here, no interconnect term in the roofline)
    ici_bandwidth: float = 0.0


# Public figures from Google Cloud's TPU system-architecture pages
# (https://cloud.google.com/tpu/docs/v4, .../v5e, .../v5p, .../v6e), per chip:
#   v4   32 GiB HBM2,  275 TFLOP/s bf16, 1200 GB/s
#   v5e  16 GiB HBM2,  197 TFLOP/s bf16,  819 GB/s
#   v5p  95 GiB HBM2e, 459 TFLOP/s bf16, 2765 GB/s
#   v6e  32 GiB HBM,   918 TFLOP/s bf16, 1640 GB/s (Trillium)
# and bidirectional ICI bandwidth per chip: v5e 400 GB/s, v5p 1200 GB/s, v6e 800 GB/s (v4's is
# not on its page in that form; left out)
CHIPS = {
    "v4": Chip("v4", 32 * GiB, 275e12, 1200e9),
    "v5e": Chip("v5e", 16 * GiB, 197e12, 819e9, 200e9),
    "v5p": Chip("v5p", 95 * GiB, 459e12, 2765e9, 600e9),
    "v6e": Chip("v6e", 32 * GiB, 918e12, 1640e9, 400e9),
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
