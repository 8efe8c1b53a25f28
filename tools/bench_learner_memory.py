"""Learner memory and step time with and without chunked log-probs (`rl.logits_chunk`), at a
real Qwen vocabulary.

    .venv/bin/python tools/bench_learner_memory.py [--row-len 2048 --chunks 0,1024,256]

One packed GRPO batch of `--rows` rows x `--row-len` tokens on a narrow Qwen3-VL text model with
the real vocabulary (the LM head and its f32 logits are what grows with the vocabulary). For each
`logits_chunk` the same train step is compiled and XLA's buffer assignment is read
(`compiled.memory_analysis()`: scratch ("temp") bytes the step needs besides its inputs and
outputs), then the step is timed (median of `--steps`; the first, compiling, call apart).
Loss and gradient norm are printed: they must agree across chunk sizes.
"""

from __future__ import annotations

from tools import bench_setup

bench_setup.cpu_unless_set()

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from cua_jax.models import qwen_vl  # noqa: E402
from cua_jax.rl.learner import Learner, OptimizerConfig  # noqa: E402
from tools.bench_train import make_config, make_groups  # noqa: E402


def main() -> None:
    """The command line: runs what the module docstring describes."""
    ap = bench_setup.arg_parser(__doc__)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--row-len", type=int, default=2048)
    ap.add_argument("--chunks", default="0,1024,256")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()

    cfg = make_config(args.layers, args.hidden, args.vocab)
    groups = make_groups(2, 2, args.row_len, args.vocab)
    logits_gib = args.row_len * args.vocab * 4 / 2**30
    print(
        f"jax {jax.__version__}, {jax.devices()[0].platform}; vocab {args.vocab}, hidden "
        f"{args.hidden}, {args.layers} layers; f32 logits of one row: {logits_gib:.2f} GiB",
        flush=True,
    )
    print("| logits_chunk | step scratch (temp) | compile | step (median) | loss | grad norm |")
    print("| --- | --- | --- | --- | --- | --- |")
    for chunk in (int(c) for c in args.chunks.split(",")):
        learner = Learner(
            qwen_vl.QwenVL(cfg, rngs=nnx.Rngs(0)),
            optimizer=OptimizerConfig(learning_rate=1e-5),
            seq_len_buckets=(args.row_len,),
            logits_chunk=chunk,
        )
        batch, _ = learner.prepare_batch(groups, num_rows=args.rows)
        temp, t_compile, t_step, m = bench_setup.compile_and_time(learner, batch, args.steps)
        print(
            f"| {chunk or 'off'} | {temp / 2**30:.2f} GiB | {t_compile:.1f} s | "
            f"{t_step:.2f} s | {m['loss']:.6f} | {m['grad_norm']:.6f} |",
            flush=True,
        )
        del learner


if __name__ == "__main__":
    main()
