"""Writes synthetic grounding screens as grain-readable shards (cua_jax.demos.grounding/shards).

    python tools/make_grounding_data.py --out=/tmp/ground/train --num=20000
    python tools/make_grounding_data.py --out=/tmp/ground/heldout --num=512 --split=heldout

Training screens use seeds [seed, seed + num); held-out ones start at HELDOUT_SEED (10**9), so
the two never share a screen. Then `--config.mid.source=/tmp/ground/train
--config.mid.heldout=/tmp/ground/heldout` (mid-training) or `--config.sft.source=...` (SFT from
the same shards) in `launch/tpu.py`. About 2 ms a screen and 5-10 KB on disk.
"""

from __future__ import annotations

import argparse
import sys
import time

from cua_jax.demos.grounding import HELDOUT_SEED, KINDS, render_sample
from cua_jax.demos.shards import ShardWriter


def main(argv: list[str] | None = None) -> int:
    """Writes `--num` synthetic grounding screens as shards under `--out`; returns 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="a new directory for the shards")
    ap.add_argument("--num", type=int, required=True, help="how many screens")
    ap.add_argument("--split", choices=("train", "heldout"), default="train")
    ap.add_argument("--seed", type=int, default=0, help="first seed (offset within the split)")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {KINDS}")
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--height", type=int, default=288)
    ap.add_argument("--per_shard", type=int, default=2000)
    a = ap.parse_args(argv)
    if a.num < 1:
        ap.error(f"--num must be >= 1, got {a.num}")
    kinds = [k for k in a.kinds.split(",") if k]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        ap.error(f"--kinds: unknown {bad or kinds}; choose from {KINDS}")
    base = a.seed + (HELDOUT_SEED if a.split == "heldout" else 0)
    if a.split == "train" and base + a.num > HELDOUT_SEED:
        ap.error(f"training seeds must stay below {HELDOUT_SEED}")
    t0 = time.perf_counter()
    with ShardWriter(a.out, a.per_shard) as w:
        for i in range(a.num):
            seed = base + i
            w.write(render_sample(seed, a.width, a.height, kind=kinds[seed % len(kinds)]))
            if (i + 1) % 1000 == 0 or i + 1 == a.num:
                dt = time.perf_counter() - t0
                print(f"\r{i + 1}/{a.num} screens, {(i + 1) / dt:.0f}/s", end="", file=sys.stderr)
    print(f"\nwrote {a.num} {a.split} screens to {a.out} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
