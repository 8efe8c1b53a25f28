"""SFT from a grounding shard directory, streamed: peak RSS and throughput over the whole set.

    /usr/bin/time -v .venv/bin/python tools/bench_sft_stream.py --shards=/tmp/g37/train \
        --train_steps=50

The smoke preset's SFT learner and agent; every demonstration of `--shards` goes once through
the trainer's path (`GroundingDemos` -> `sft_dataset` -> `batch_iterator`: PNG decode, the
agent's prompt, f32 patches, packing), the first `--train_steps` batches also through
`learner.sft_step`. Prints the RSS (VmRSS, and the peak so far) every `--every` batches: it must
stay flat however many demonstrations the set holds.
"""

from __future__ import annotations

import resource
import time

from tools import bench_setup

bench_setup.cpu_unless_set()

from configs import qwen3vl_grpo  # noqa: E402
from cua_jax.demos.pipeline import batch_iterator, sft_dataset  # noqa: E402
from cua_jax.demos.shards import GroundingDemos, GroundingShards  # noqa: E402
from cua_jax.job import builders  # noqa: E402
from cua_jax.rl.rollout import AgentLoop  # noqa: E402


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def main() -> None:
    """The command line: runs what the module docstring describes."""
    ap = bench_setup.arg_parser(__doc__)
    ap.add_argument("--shards", required=True)
    ap.add_argument("--train_steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=8, help="demonstrations a batch (rows_per_step)")
    ap.add_argument("--every", type=int, default=250)
    a = ap.parse_args()
    config = qwen3vl_grpo.get_config("smoke")
    mesh, rules = builders.mesh_and_rules(config)
    model, processor = builders.build_model_and_processor(config, mesh, rules)
    learner = builders.build_learner(model, config, mesh, rules, sft=True)
    agent = AgentLoop(None, processor, builders.build_rollout_settings(config, learner.model))
    demos = GroundingDemos(GroundingShards(a.shards), agent)
    ds = sft_dataset(
        demos, learner.pack, batch_size=a.batch, position_fn=learner.position_fn(), num_epochs=1
    )
    print(f"{len(demos)} demonstrations, {len(ds)} batches of {a.batch}; RSS {_rss_mb():.0f} MB")
    t0 = time.perf_counter()
    n = 0
    for i, batch in enumerate(batch_iterator(ds)):
        if i < a.train_steps:
            loss = learner.sft_step(batch)["loss"]
            if i + 1 == a.train_steps:
                print(f"trained {a.train_steps} steps, loss {float(loss):.3f}")
        n += batch.num_samples
        if (i + 1) % a.every == 0 or i + 1 == len(ds):
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            dt = time.perf_counter() - t0
            print(f"{n} demos, {n / dt:.1f}/s, RSS {_rss_mb():.0f} MB (peak {peak:.0f} MB)")


if __name__ == "__main__":
    main()
