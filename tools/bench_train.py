"""Train-step time: our jitted GRPO step vs a PyTorch step (transformers + torch AdamW), CPU.

    .venv/bin/python tools/bench_train.py [--layers 2 --hidden 256 --row-len 256 --steps 5]

Both sides get the same Qwen3-VL text config and the same packed batch ([rows, row_len] token
ids; text only), run forward + backward of a token-level policy-gradient loss on the
generated tokens, and an AdamW update. Timings are interleaved (ours, torch, ours, ...) and the
median is reported, so load from other jobs hits both alike. Also printed: tokens/s (real,
non-padding tokens) and the padding share after packing vs one sample per row.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from tools import bench_setup

bench_setup.cpu_unless_set()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from cua_jax.models import qwen_vl  # noqa: E402
from cua_jax.rl import packing  # noqa: E402
from cua_jax.rl.learner import Learner, OptimizerConfig  # noqa: E402
from cua_jax.rl.trajectory import Trajectory, Turn, trajectory_to_samples  # noqa: E402


def make_config(layers: int, hidden: int, vocab: int) -> qwen_vl.QwenVLConfig:
    """A Qwen3-VL config with a text model of `layers` x `hidden` (64-wide heads, GQA 2:1) and
    `vocab`."""
    base = qwen_vl.tiny("qwen3_vl", vocab_size=vocab)
    heads = hidden // 64
    text = dataclasses.replace(
        base.text,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=64,
        mrope_section=(12, 10, 10),
    )
    vision = dataclasses.replace(base.vision, out_hidden_size=hidden)
    return base.replace(text=text, vision=vision)


def make_groups(n_groups: int, group_size: int, max_len: int, vocab: int, seed: int = 0):
    """`n_groups` GRPO groups of `group_size` one-turn text episodes, lengths log-uniform in
    [max_len/16, max_len), from `seed`."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        grp = []
        for _ in range(group_size):
            # log-uniform lengths in [max_len / 16, max_len): short and long episodes mixed
            total = int(np.exp(rng.uniform(np.log(max_len / 16), np.log(max_len))))
            p = int(rng.integers(total // 3, 2 * total // 3))
            prompt = rng.integers(0, vocab - 16, p)
            completion = rng.integers(0, vocab - 16, total - p)  # drawn in this order
            t = Turn(prompt, completion, -rng.random(total - p))
            grp.append(Trajectory("t", f"g{g}", [t], reward=float(rng.random())))
        groups.append(grp)
    return groups


def torch_step_fn(cfg: qwen_vl.QwenVLConfig, batch: packing.PackedBatch, lr: float):
    """A transformers model of `cfg` with torch AdamW and a step on `batch` (the same clipped
    policy-gradient loss); returns (step, parameter count)."""
    import torch
    import transformers

    torch.manual_seed(0)
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf_dict())
    model = transformers.Qwen3VLForConditionalGeneration(hf_cfg).float()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    ids = torch.from_numpy(batch.input_ids.astype(np.int64))
    mask = torch.from_numpy(batch.loss_mask[:, 1:])
    w = torch.from_numpy(batch.loss_weights[:, 1:])
    adv = torch.from_numpy(batch.advantages[:, 1:])
    old = torch.from_numpy(batch.behaviour_logprobs[:, 1:])

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        ratio = torch.exp(logp - torch.where(mask, old, logp.detach()))
        pg = -torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv)
        loss = (pg * w).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return float(loss.detach())

    n_params = sum(p.numel() for p in model.parameters())
    return step, n_params


def main() -> None:
    """The command line: runs what the module docstring describes."""
    ap = bench_setup.arg_parser(__doc__)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--row-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()

    cfg = make_config(args.layers, args.hidden, args.vocab)
    groups = make_groups(args.groups, args.group_size, args.row_len, args.vocab)
    learner = Learner(
        qwen_vl.QwenVL(cfg, rngs=nnx.Rngs(0)),
        optimizer=OptimizerConfig(learning_rate=1e-5),
        seq_len_buckets=(args.row_len,),
    )
    batch, info = learner.prepare_batch(groups)
    samples = []
    for g in groups:
        for t in g:
            samples += trajectory_to_samples(t, 0.0)
    one_per_row = packing.unpacked(samples, seq_len_buckets=(args.row_len,))
    real_tokens = int((batch.segment_ids > 0).sum())
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(learner.model, nnx.Param)))
    print(
        f"config: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, "
        f"{n_params / 1e6:.1f}M params; batch {batch.shape[0]} rows x {batch.shape[1]} "
        f"({len(samples)} samples, {real_tokens} real tokens)"
    )
    print(
        f"padding share: packed {batch.padding_share:.3f} vs one sample per row "
        f"{one_per_row.padding_share:.3f} ({one_per_row.shape[0]} rows)",
        flush=True,
    )

    t0 = time.perf_counter()
    learner.train_step(batch)
    print(f"ours: first step (compile) {time.perf_counter() - t0:.1f}s", flush=True)
    torch_step, torch_params = torch_step_fn(cfg, batch, 1e-5)
    assert torch_params == n_params, (torch_params, n_params)
    torch_step()  # warm-up

    def progress(times: dict) -> None:
        ours, theirs = times["ours"][-1], times["torch"][-1]
        print(f"  step: ours {ours * 1e3:.0f} ms, torch {theirs * 1e3:.0f} ms", flush=True)

    # interleaved: ours, torch, ours, ...; train_step returns host floats: the step has finished
    fns = {"ours": lambda: learner.train_step(batch), "torch": torch_step}
    times, _ = bench_setup.round_times(fns, args.steps, after_round=progress)
    o, t = statistics.median(times["ours"]), statistics.median(times["torch"])
    print(f"ours (jax.jit, donated state): {o * 1e3:.1f} ms/step, {real_tokens / o:.0f} tokens/s")
    print(f"torch (transformers + AdamW):  {t * 1e3:.1f} ms/step, {real_tokens / t:.0f} tokens/s")
    print(f"speed-up ours vs torch: {t / o:.2f}x (median of {args.steps} interleaved steps)")


if __name__ == "__main__":
    main()
