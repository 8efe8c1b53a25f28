"""Screens into the vision tower's patches on the rollout side: the two-step path against the
table lookup, side by side.

    .venv/bin/python tools/bench_preprocess.py [--sizes 384x288,640x480,1280x720 --rounds 40
        --family qwen3_vl --path both|lookup|two_step]

A screen already at the processor's size (training sets max_pixels to the viewport's area, so
nothing is resized) goes through `normalize` then `patchify` (float64 rescale, f32 normalize,
f32 transpose with the temporal copy), or through `patch_values` (uint8 transpose, one lookup a
value per channel). Both give the same float32 bits, checked here on every size. Each round times
every path once, in turn, so load from other jobs hits both alike; medians are printed, and the
ratio two-step / lookup. `--path` times one path alone (for whole-process comparisons).
"""

from __future__ import annotations

import sys

import numpy as np

from cua_jax.data.image import ImageConfig, normalize, patch_values, patchify
from tools import bench_setup


def main(argv: list[str] | None = None) -> int:
    """The command line: runs what the module docstring describes; 1 if the paths differ."""
    p = bench_setup.arg_parser(__doc__, paragraph=True)
    p.add_argument("--sizes", default="384x288,640x480,1280x720", help="WxH,WxH,...")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--family", default="qwen3_vl", choices=("qwen3_vl", "qwen2_5_vl"))
    p.add_argument("--path", default="both", choices=("both", "lookup", "two_step"))
    args = p.parse_args(argv)
    try:
        sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    except ValueError:
        p.error(f"--sizes must be WxH,WxH,... (e.g. 640x480), got {args.sizes!r}")
    rng = np.random.default_rng(0)
    for w, h in sizes:
        cfg = ImageConfig.for_family(args.family)
        f = cfg.factor
        h, w = h // f * f, w // f * f  # the viewport the processor keeps unresized
        rgb = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        fns = {
            "two_step": lambda rgb=rgb, cfg=cfg: patchify(normalize(rgb, cfg), cfg)[0],
            "lookup": lambda rgb=rgb, cfg=cfg: patch_values(rgb, cfg)[0],
        }
        if args.path != "both":
            fns = {args.path: fns[args.path]}
        outs = {k: fn() for k, fn in fns.items()}  # warm-up, and the check
        if len(outs) == 2 and not np.array_equal(
            outs["two_step"].view(np.uint32), outs["lookup"].view(np.uint32)
        ):
            print(f"{w}x{h}: the two paths differ", file=sys.stderr)
            return 1
        med = bench_setup.timed_rounds(fns, args.rounds)
        mb = next(iter(outs.values())).nbytes / 2**20
        line = "  ".join(f"{k} {v * 1e3:.2f} ms" for k, v in med.items())
        ratio = (
            f"  two_step / lookup {med['two_step'] / med['lookup']:.2f}x" if len(med) == 2 else ""
        )
        print(f"{w}x{h} ({mb:.1f} MB of f32 patches): {line}{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
