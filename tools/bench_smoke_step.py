"""The smoke preset's GRPO train step on real screenshots: time, XLA scratch and peak RSS, with
the vision attention's query chunk per image (default) vs a fixed 1024 (before commit 1e750bc).

    .venv/bin/python tools/bench_smoke_step.py --workdir=/tmp/cua_smoke [--episodes 32 --steps 3]

Reads the run's config and its oracle demonstrations (`WORKDIR/sft_demos`, written by any smoke
run), turns `--episodes` of them into GRPO samples (alternating +-1 advantages), packs them as
the learner does (rows, patches padded to a bucket) and times the train step both ways in one
process (median of `--steps` after the compiling call; the loss and gradient norm must agree).
"""

from __future__ import annotations

import os
import resource

from tools import bench_setup

bench_setup.cpu_unless_set()

from configs.common import load_run_config  # noqa: E402
from cua_jax import sharding as shd  # noqa: E402
from cua_jax.job import builders  # noqa: E402
from cua_jax.models.qwen_vl import vision  # noqa: E402
from cua_jax.rl.store import TrajectoryReader  # noqa: E402
from cua_jax.rl.trajectory import trajectory_to_samples  # noqa: E402


def main() -> None:
    """The command line: runs what the module docstring describes."""
    ap = bench_setup.arg_parser(__doc__)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()

    config = load_run_config(args.workdir)
    mesh = shd.make_mesh(1, 1, 1)
    demos = TrajectoryReader(os.path.join(args.workdir, "sft_demos"))
    per_image = vision._query_chunk
    print(
        "| vision query chunk | batch | patches (padded) | step scratch | step (median) | "
        "peak RSS so far | loss | grad norm |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    for name, chunk_fn in (
        ("fixed 1024", lambda seg: vision.QUERY_CHUNK),
        ("per image", per_image),
    ):
        vision._query_chunk = chunk_fn
        model, _ = builders.build_model_and_processor(config, mesh, shd.DEFAULT_RULES)
        learner = builders.build_learner(model, config, mesh, shd.DEFAULT_RULES, sft=False)
        pos = learner.position_fn()
        samples = [
            s
            for i in range(args.episodes)
            for s in trajectory_to_samples(demos[i], 1.0 if i % 2 else -1.0, pos)
        ]
        batch = learner.pack(samples)
        temp, _, t_step, m = bench_setup.compile_and_time(learner, batch, args.steps)
        ((_, _, pixels),) = learner.compiled_shapes  # (mode, batch shape, padded patches)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        cells = [
            name,
            f"{batch.shape[0]} x {batch.shape[1]}",
            str(pixels[0]),
            f"{temp / 2**30:.2f} GiB",
            f"{t_step:.2f} s",
            f"{rss:.1f} GiB",
            f"{m['loss']:.6f}",
            f"{m['grad_norm']:.6f}",
        ]
        print("| " + " | ".join(cells) + " |", flush=True)
    vision._query_chunk = per_image


if __name__ == "__main__":
    main()
