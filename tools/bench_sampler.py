"""Sampler benchmarks, each a ratio measured side by side in one run (figures go to BENCHMARKS.md).

    .venv/bin/python tools/bench_sampler.py                # all three parts
    .venv/bin/python tools/bench_sampler.py --parts=decode --batches=1,16
    .venv/bin/python tools/bench_sampler.py --family=qwen3_5 --parts=decode --vocab=1536 --threads=1

1. decode: useful tokens/s of `Engine` vs transformers `generate` on CPU. Same weights (our
   random-init model exported with `save_pretrained` and loaded by transformers), f32, greedy,
   fixed prompt and output lengths, EOS disabled, torch and XLA on the same cores (--threads N
   pins the process to N cores); best (and median) of 5 alternating runs; compile time (first
   call minus a warm call) is reported apart, excluded.
2. batching: continuous vs static batching on a multi-turn workload of mixed lengths (episodes of
   several turns, each turn appends new tokens to the transcript and generates a random number of
   tokens, the next turn starts when the previous one returns); wall time, useful tokens/s and
   padding efficiency = useful tokens / slot-steps of the decode batch.
3. prefix: a GRPO group of 8 rollouts sharing one first turn (text + a screenshot): prefill tokens
   and vision-tower runs with page forking vs without, and the wall time of both.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import tempfile
import time

import numpy as np

from cua_jax.models import qwen_vl
from cua_jax.sampler import Engine, SamplingParams
from tools import bench_setup


def _loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def small_config(family: str, hidden: int, layers: int, vocab: int):
    """A small `family` config (`hidden`, `layers`, `vocab`) for the sampler benchmarks."""

    cfg = qwen_vl.tiny(family, vocab_size=vocab)
    text = dataclasses.replace(
        cfg.text,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=max(1, hidden // 128),
        head_dim=32,
    )
    vision = dataclasses.replace(cfg.vision, out_hidden_size=hidden)
    return cfg.replace(text=text, vision=vision)


def bench_decode(model, hf_dir, batches, prompt_len, new_tokens, threads, family, repeats=5):
    """Batched greedy decode through our Engine vs transformers' generate for each batch size;
    prints a row each."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    cls = {
        "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
        "qwen3_5": transformers.Qwen3_5ForConditionalGeneration,
        "qwen3_5_moe": transformers.Qwen3_5MoeForConditionalGeneration,
    }[family]
    hf = cls.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    V = model.config.text.vocab_size
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)  # no stop tokens
    print(
        f"\n== decode: prompt {prompt_len}, {new_tokens} new tokens, greedy, f32, EOS off, "
        f"{threads} threads =="
    )
    print(
        f"{'batch':>5} {'ours tok/s':>11} {'hf tok/s':>9} {'ratio':>6} {'median ratio':>12} "
        f"{'ours compile s':>15} {'same tokens':>11} {'load avg':>15}"
    )
    rows = []
    for B in batches:
        rng = np.random.default_rng(B)
        prompts = rng.integers(0, V - 16, (B, prompt_len))
        pages = B * ((prompt_len + new_tokens) // 16 + 2) + 1
        engine = Engine(
            model,
            max_slots=B,
            page_size=16,
            num_pages=pages,
            max_seq_len=prompt_len + new_tokens + 16,
            decode_chunk=16,
        )
        reqs = [dict(prompt_ids=p, params=params) for p in prompts]
        t0 = time.perf_counter()
        engine.generate_batch(reqs)
        first = time.perf_counter() - t0
        ids = torch.as_tensor(prompts)
        kw = dict(
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
        with torch.no_grad():
            hf.generate(ids, **kw)  # warm-up
            # Best of `repeats`, alternating ours and theirs so both see the same machine load.
            fns = {
                "ours": functools.partial(engine.generate_batch, reqs),
                "theirs": functools.partial(hf.generate, ids, **kw),
            }
            times, last = bench_setup.round_times(fns, repeats)
        ours_t, theirs_t = times["ours"], times["theirs"]
        outs, hf_out = last["ours"], last["theirs"]
        ours, theirs = min(ours_t), min(theirs_t)
        median_ratio = float(np.median(theirs_t) / np.median(ours_t))
        same = np.mean([o.tokens == hf_out[i, prompt_len:].tolist() for i, o in enumerate(outs)])
        useful = B * new_tokens
        rows.append((B, useful / ours, useful / theirs))
        print(
            f"{B:>5} {useful / ours:>11.1f} {useful / theirs:>9.1f} {theirs / ours:>6.2f} "
            f"{median_ratio:>12.2f} {first - ours:>15.1f} {same:>11.0%} {_loadavg():>15}"
        )
    return rows


def multi_turn_workload(n_episodes, turns, vocab, seed=0):
    """`n_episodes` episodes of `turns` (new prompt ids, tokens to generate) pairs."""
    rng = np.random.default_rng(seed)
    eps = []
    for _ in range(n_episodes):
        eps.append(
            [
                (rng.integers(0, vocab - 16, int(rng.integers(8, 48))), int(rng.integers(4, 40)))
                for _ in range(turns)
            ]
        )
    return eps


async def run_episodes(engine, episodes):
    """Plays every episode on `engine` concurrently, each turn extending its transcript by the new
    ids and the reply."""

    async def episode(i, turns):
        transcript = np.zeros((0,), np.int64)
        for new_ids, n_out in turns:
            transcript = np.concatenate([transcript, new_ids])
            out = await engine.generate(
                transcript,
                params=SamplingParams(temperature=0.0, max_new_tokens=n_out),
                session_id=i,
            )
            transcript = np.concatenate([transcript, np.asarray(out.tokens)])
        engine.drop_session(i)
        return transcript

    return await asyncio.gather(*(episode(i, t) for i, t in enumerate(episodes)))


def bench_batching(model, slots, n_episodes, turns):
    """The multi-turn workload through a `slots`-slot engine with static vs continuous batching
    (after a compiling warm-up, best of two each): wall time, useful tokens/s, padding
    efficiency; prints a row each and whether both give the same transcripts."""

    V = model.config.text.vocab_size
    episodes = multi_turn_workload(n_episodes, turns, V)
    print(
        f"\n== batching: {n_episodes} episodes x {turns} turns (+8..47 tokens, 4..39 generated "
        f"per turn), {slots} slots, greedy =="
    )
    print(
        f"{'mode':>10} {'wall s':>7} {'useful tok/s':>12} {'padding eff.':>12} {'decode calls':>12}"
    )
    results = {}
    for mode in ("warmup", "static", "continuous", "static", "continuous"):
        engine = Engine(
            model,
            max_slots=slots,
            page_size=16,
            num_pages=slots * 24 + 1,
            max_seq_len=512,
            decode_chunk=8,
            static_batching=mode == "static",
        )
        if mode == "warmup":  # compile every bucket once, outside the timed runs
            asyncio.run(run_episodes(engine, episodes))
            shared_fns = engine
            continue
        # Reuse the compiled functions (same shapes) so compile time stays out of the figure.
        engine._fns = shared_fns._fns
        t0 = time.perf_counter()
        outs = asyncio.run(run_episodes(engine, episodes))
        wall = time.perf_counter() - t0
        s = engine.stats
        eff = s["useful_tokens"] / max(s["slot_steps"], 1)
        results[mode] = (min(wall, results.get(mode, (wall,))[0]), outs)
        print(
            f"{mode:>10} {wall:>7.2f} {s['useful_tokens'] / wall:>12.1f} {eff:>12.1%} "
            f"{s['decode_calls']:>12}"
        )
    same = all(
        np.array_equal(a, b)
        for a, b in zip(results["static"][1], results["continuous"][1], strict=True)
    )
    print(
        f"continuous / static speed-up (best of 2 each): "
        f"{results['static'][0] / results['continuous'][0]:.2f}x;"
        f" identical transcripts: {same}"
    )


def bench_prefix(model, family, group=8):
    """A group of `group` samples of one screenshot prompt with and without prefix sharing: prefill
    tokens, vision-encoder runs and wall time."""

    cfg = model.config
    rng = np.random.default_rng(0)
    m = cfg.vision.spatial_merge_size
    patch = cfg.vision.patch_size
    side = 16  # a 16x16-patch screenshot (224 or 256 px): 64 merged tokens
    grid = np.asarray([[1, side, side]])
    C = cfg.vision.in_channels * cfg.vision.temporal_patch_size * patch * patch
    pv = rng.standard_normal((side * side, C)).astype(np.float32)
    n_img = side * side // (m * m)
    V = cfg.text.vocab_size
    prompt = np.concatenate(
        [
            rng.integers(0, V - 16, 120),
            [cfg.vision_start_token_id],
            [cfg.image_token_id] * n_img,
            [cfg.vision_end_token_id],
            rng.integers(0, V - 16, 20),
        ]
    )
    reqs = [
        dict(
            prompt_ids=prompt,
            pixel_values=pv,
            image_grid_thw=grid,
            params=SamplingParams(temperature=1.0, seed=s, max_new_tokens=32),
        )
        for s in range(group)
    ]
    print(
        f"\n== prefix sharing: group of {group}, shared first turn of {len(prompt)} tokens "
        f"({n_img} image tokens), 32 sampled tokens each =="
    )
    print(f"{'sharing':>8} {'prefill tok':>11} {'vision runs':>11} {'wall s':>7}")
    walls = {}
    for share in (True, False, True, False):  # first pair compiles
        engine = Engine(
            model,
            max_slots=group,
            page_size=16,
            num_pages=group * 16 + 1,
            max_seq_len=256,
            decode_chunk=8,
            share_prefix=share,
        )
        if share in walls:
            engine._fns = walls[share][1]

        async def go(engine=engine):
            return await asyncio.gather(*(engine.generate(**r) for r in reqs))

        t0 = time.perf_counter()
        outs = asyncio.run(go())
        wall = time.perf_counter() - t0
        vision_runs = sum(o.num_cached_tokens == 0 for o in outs)
        if share in walls:
            print(
                f"{share!s:>8} {engine.stats['prefill_tokens']:>11} {vision_runs:>11} {wall:>7.2f}"
            )
            walls[share] = (wall, engine.stats["prefill_tokens"])
        else:
            walls[share] = (wall, engine._fns)
    saved = 1 - walls[True][1] / walls[False][1]
    print(
        f"prefill tokens saved: {saved:.1%}; group wall-time speed-up "
        f"{walls[False][0] / walls[True][0]:.2f}x"
    )


def main():
    """The command line: runs what the module docstring describes."""
    ap = bench_setup.arg_parser(__doc__)
    ap.add_argument("--parts", default="decode,batching,prefix")
    ap.add_argument(
        "--family",
        default="qwen2_5_vl",
        choices=("qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe"),
        help="qwen3_5 / qwen3_5_moe: the tiny hybrid Gated DeltaNet model, dense or MoE "
        "(qwen_vl.tiny: its own sizes, --hidden/--layers ignored)",
    )
    ap.add_argument(
        "--smoke-model",
        action="store_true",
        help="the smoke preset's model (qwen_vl.tiny: hidden 128, 2 layers, GQA 4/2, vocab 1536 "
        "of the shipped tokenizer) instead of --hidden/--layers/--vocab",
    )
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="for torch and XLA (0 = all cores)")
    ap.add_argument("--episodes", type=int, default=24)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--slots", type=int, default=8)
    args = ap.parse_args()
    if args.threads:
        # Pin the whole process to `threads` cores before jax and torch start their pools. XLA's
        # CPU client sizes its intra-op pool from the schedulable cores and ignores
        # --xla_cpu_multi_thread_eigen for its own dots, so affinity is what makes "1 thread"
        # true for XLA (measured: without it a "1-thread" run used both cores); torch also gets
        # torch.set_num_threads(threads) in bench_decode.
        cores = sorted(os.sched_getaffinity(0))[: args.threads]
        os.sched_setaffinity(0, cores)
        bench_setup.add_xla_flags(bench_setup.eigen_flag(args.threads))
    args.threads = args.threads or len(os.sched_getaffinity(0))

    import jax

    jax.config.update("jax_default_matmul_precision", "highest")

    if args.family.startswith("qwen3_5"):  # the linear layers' dims come with the tiny config
        cfg = qwen_vl.tiny("qwen3_5", vocab_size=args.vocab, moe=args.family == "qwen3_5_moe")
        args.hidden, args.layers = cfg.text.hidden_size, cfg.text.num_hidden_layers
    elif args.smoke_model:
        cfg = qwen_vl.tiny(args.family, vocab_size=1536)
        args.hidden, args.layers, args.vocab = 128, 2, 1536
    else:
        cfg = small_config(args.family, args.hidden, args.layers, args.vocab)
    model = qwen_vl.init_random(cfg, seed=0)
    from flax import nnx

    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(
        f"model: {args.family}, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
        f"{n_params / 1e6:.1f}M params (text + vision); jax {jax.__version__} on "
        f"{jax.default_backend()}, {os.cpu_count()} host cores, process pinned to cores "
        f"{sorted(os.sched_getaffinity(0))}; load average {_loadavg()}"
    )
    parts = args.parts.split(",")
    if "decode" in parts:
        with tempfile.TemporaryDirectory() as d:
            qwen_vl.save_pretrained(model, d)
            bench_decode(
                model,
                d,
                [int(b) for b in args.batches.split(",")],
                args.prompt_len,
                args.new_tokens,
                args.threads,
                args.family,
            )
    if "batching" in parts:
        bench_batching(model, args.slots, args.episodes, args.turns)
    if "prefix" in parts:
        bench_prefix(model, args.family)


if __name__ == "__main__":
    main()
