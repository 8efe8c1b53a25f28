"""The trainer's host work for one turn of an episode, piece by piece, with no env and no model.

    .venv/bin/python tools/bench_turn.py [--viewport 640x480 --turns 5 --history 3
        --episodes 20 --rounds 5]

Per turn of `--episodes` episodes of `--turns` turns (random screens of `--viewport`, unresized,
as the presets' processors take them; `--history` screens kept in the prompt), CPU milliseconds
(`time.process_time`, one thread) of:

- prompt: `_Transcript.prompt` (the screen's patch rows, its digest, the rendering; the rollout's
  prompt thread) and `reply`;
- request, digests kept: `prompt_inputs` with the transcript's digests (what `Engine.generate`
  does on the event loop: M-RoPE positions, image runs, the prompt's key);
- request, hashed each turn: the same with the engine hashing every kept screen's pixels itself
  (what it did before the rollout kept a digest a screen).

Rounds alternate the two request forms; the table has each piece's median over the rounds.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from cua_jax.data.processor import QwenVLProcessor
from cua_jax.rl.rollout import _Transcript
from cua_jax.sampler.scheduler import prompt_inputs
from tools import bench_setup


def one_round(proc, args, rng, *, keep_digests: bool) -> dict[str, float]:
    """CPU ms a turn of each piece over one round of episodes."""
    w, h = (int(x) for x in args.viewport.split("x"))
    tok = proc.tokenizer
    reply = [*tok.encode('<tool_call>{"name": "computer_use", "arguments": {}}'), tok.im_end_id]
    prompt_s = request_s = 0.0
    turns = 0
    for _ in range(args.episodes):
        tr = _Transcript(proc, "Click the button.", "You operate a computer.", args.history)
        for k in range(args.turns):
            shot = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            t = time.process_time()
            p = tr.prompt("" if k == 0 else "The click landed.", shot)
            tr.reply(reply)
            t1 = time.process_time()
            got = prompt_inputs(
                p.ids,
                p.pixel_values,
                p.grid,
                image_token_id=proc.tokenizer.image_pad_id,
                merge_size=proc.image_config.merge_size,
                image_hashes=p.image_hashes if keep_digests else None,
            )
            t2 = time.process_time()
            assert not isinstance(got, str), got
            prompt_s += t1 - t
            request_s += t2 - t1
            turns += 1
    return {"prompt": 1e3 * prompt_s / turns, "request": 1e3 * request_s / turns}


def main() -> None:
    """The command line: runs what the module docstring describes."""
    p = bench_setup.arg_parser(__doc__)
    p.add_argument("--viewport", default="640x480")
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--history", type=int, default=3, help="env.max_history_images")
    p.add_argument("--episodes", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    w, h = (int(x) for x in args.viewport.split("x"))
    proc = QwenVLProcessor.default(
        "qwen3_vl", max_pixels=w * h, min_pixels=32 * 32, pixel_dtype="uint8"
    )
    rng = np.random.default_rng(0)
    rows: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    one_round(proc, args, rng, keep_digests=True)  # warm caches and imports
    for _ in range(args.rounds):
        for keep in (True, False):
            rows[keep].append(one_round(proc, args, rng, keep_digests=keep))
    med = {
        k: {f: statistics.median(r[f] for r in v) for f in ("prompt", "request")}
        for k, v in rows.items()
    }
    print(
        f"{args.viewport}, {args.turns} turns, {args.history} screens of history, "
        f"{args.episodes} episodes x {args.rounds} rounds; CPU ms a turn (median of rounds)"
    )
    print("| piece | ms a turn |\n| --- | ---: |")
    print(f"| prompt (`_Transcript.prompt` + `reply`) | {med[True]['prompt']:.3f} |")
    print(f"| request, digests kept | {med[True]['request']:.3f} |")
    print(f"| request, hashed each turn | {med[False]['request']:.3f} |")


if __name__ == "__main__":
    main()
