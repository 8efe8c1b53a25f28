"""GRPO learner steps on batches that vary like a scaled-up smoke run's: per-step time,
compiles and compile seconds, before (rows and patches rounded to powers of two per batch) and
after (the config's fixed shape set, compiled ahead).

    nice -n 10 .venv/bin/python tools/bench_compile_once.py --steps 8 --group-size 8 \
        --groups 4 [--only before|after]

The smoke preset's model, row lengths and screen (384x288: 18x24 patches, 108 image tokens);
episodes of 1-2 turns (history window 1: one screen per sample) with prompts of 120-420 text
tokens and 8-48 generated tokens, and a random share of groups filtered as zero-variance, so
each step's batch has its own number of samples, rows and screenshots. Synthetic tokens (the
step's cost depends on shapes, not on values). One process: "before" first, then "after".
"""

from __future__ import annotations

import statistics
import time

from tools import bench_setup

bench_setup.cpu_unless_set()

import numpy as np  # noqa: E402

from configs.qwen3vl_grpo import get_config  # noqa: E402
from cua_jax import sharding as shd  # noqa: E402
from cua_jax.job import builders, compile_stats  # noqa: E402
from cua_jax.rl.shapes import screen_grid  # noqa: E402
from cua_jax.rl.trajectory import Trajectory, Turn  # noqa: E402


def _screen(rng, model_cfg, unit):
    """One random screen of `unit` patches in the model's form (bytes or floats)."""
    if model_cfg.pixel_dtype == "uint8":
        return rng.integers(0, 256, (unit, model_cfg.pixel_width), np.uint8)
    return rng.normal(size=(unit, model_cfg.pixel_width)).astype(np.float32)


def make_groups(rng, cfg, model_cfg, grid, n_groups, group_size):
    """`n_groups` random GRPO groups of `group_size` episodes, each 1..max_turns turns of one screen
    of `grid` patches, random prompt and generated tokens."""
    unit = grid[0] * grid[1] * grid[2]
    img = [model_cfg.vision_start_token_id, *[model_cfg.image_token_id] * (unit // 4)]
    img.append(model_cfg.vision_end_token_id)
    groups = []
    for g in range(n_groups):
        grp = []
        for _ in range(group_size):
            turns = []
            for _ in range(int(rng.integers(1, cfg.env.max_turns + 1))):
                prompt = np.r_[rng.integers(20, 1000, int(rng.integers(120, 420))), img]
                gen = rng.integers(20, 1000, int(rng.integers(8, 49)))
                turns.append(
                    Turn(
                        prompt,
                        gen,
                        -rng.random(gen.size),
                        pixel_values=_screen(rng, model_cfg, unit),
                        image_grid_thw=np.asarray([grid]),
                    )
                )
            grp.append(Trajectory("t", f"g{g}", turns, reward=float(rng.random())))
        groups.append(grp)
    return groups


def run(label, config, steps, seed, fixed):
    """Trains `steps` random batches through the config's learner and prints one table row: warm-up,
    per-step seconds, compiles and the share of wall time spent compiling. `fixed`: the shape set
    compiled up front."""
    mesh = shd.make_mesh(1, 1, 1)
    model, processor = builders.build_model_and_processor(config, mesh, shd.DEFAULT_RULES)
    learner = builders.build_learner(model, config, mesh, shd.DEFAULT_RULES, sft=False)
    ic = processor.image_config
    grid = screen_grid(config.env.viewport_width, config.env.viewport_height, ic)
    stats = compile_stats.install()
    t_run = time.perf_counter()
    warm_s = 0.0
    if fixed:
        learner.shapes = builders.shape_set(config, ic, row_multiple=learner.row_multiple)
        print(learner.shapes.describe(), flush=True)
        mark = stats.snapshot()
        learner.warmup("rl")
        warm_s = stats.since(mark).total_seconds
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(steps):
        # 1..all groups survive zero-variance filtering
        n = int(rng.integers(1, config.rl.groups_per_batch + 1))
        groups = make_groups(rng, config, learner.config, grid, n, config.rl.group_size)
        mark = stats.snapshot()
        t0 = time.perf_counter()
        batch, info = learner.prepare_batch(groups)
        m = learner.train_step(batch)
        dt = time.perf_counter() - t0
        d = stats.since(mark)
        patches = 0 if batch.pixel_values is None else batch.pixel_values.shape[0]
        rows.append((i + 1, n, batch.shape, patches, dt, d.total_seconds, d.count, m["loss"]))
        print(
            f"{label} step {i + 1}: {n} groups, batch {batch.shape[0]}x{batch.shape[1]}, "
            f"{patches} patches, {dt:.1f} s, compile {d.total_seconds:.1f} s ({d.count}), "
            f"padding {info['padding_share']:.2f}",
            flush=True,
        )
    wall = time.perf_counter() - t_run
    step_s = [r[4] for r in rows]
    compile_s = warm_s + sum(r[5] for r in rows)
    med = statistics.median(step_s)
    print(
        f"| {label} | {warm_s:.1f} s | {' / '.join(f'{t:.1f}' for t in step_s)} | {med:.1f} s | "
        f"{max(step_s) / med:.2f}x | {sum(1 for r in rows if r[6])} | "
        f"{compile_s / wall:.0%} |",
        flush=True,
    )


def main() -> None:
    """The command line: runs what the module docstring describes."""
    ap = bench_setup.arg_parser(__doc__)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=("before", "after"))
    args = ap.parse_args()
    config = get_config("smoke")
    config.rl.group_size = args.group_size
    config.rl.groups_per_batch = args.groups
    print(
        "| packing | warm-up compile | step times (s) | median | max/median | steps that "
        "compiled | compile share of wall |\n| --- | --- | --- | --- | --- | --- | --- |"
    )
    for label, fixed in (("before", False), ("after", True)):
        if args.only in (None, label):
            run(label, config, args.steps, args.seed, fixed)


if __name__ == "__main__":
    main()
