"""What decoding within the action format's grammar costs the sampler (BENCHMARKS.md).

    .venv/bin/python tools/bench_grammar.py --threads=1

One tiny random Qwen3-VL over the shipped tokenizer (1,536 ids) and three ways to decode the
same batch of prompts, alternated `--reps` times: an engine without a grammar; an engine with the
Qwen3-VL action grammar, requests unconstrained (the placeholder path: the mask is skipped); the
same engine, every request constrained. Greedy, no stop token (a constrained reply that is
whole can only write stop tokens, so every request decodes `--new-tokens` tokens). Reports the
median decode tokens/s of each and the ratios to the first; compile time apart.
"""

from __future__ import annotations

import os
import statistics
import time

from tools import bench_setup

bench_setup.cpu_unless_set()

from cua_jax.actions.qwen import QwenComputerUse  # noqa: E402
from cua_jax.data.tokenizer import load_default_tokenizer  # noqa: E402
from cua_jax.models import qwen_vl  # noqa: E402
from cua_jax.sampler import Engine, SamplingParams  # noqa: E402
from cua_jax.sampler.grammar import action_automaton  # noqa: E402


def main() -> None:
    """The command line: runs what the module docstring describes."""
    ap = bench_setup.arg_parser(__doc__)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="pin to N cores (0 = all)")
    args = ap.parse_args()
    bench_setup.pin_cpu_threads(args.threads)  # XLA reads its flags at the first device
    tok = load_default_tokenizer()
    automaton = action_automaton(tok, QwenComputerUse("3"))
    cfg = qwen_vl.tiny("qwen3_vl", vocab_size=tok.vocab_size, **tok.vision_token_ids())
    model = qwen_vl.init_random(cfg, seed=0)
    kw = dict(max_slots=args.batch, page_size=16, num_pages=512, max_seq_len=256, decode_chunk=8)
    plain = Engine(model, **kw)
    guided = Engine(model, grammar=automaton, **kw)
    prompt = tok.encode("<|im_start|>user\nClick the OK button.<|im_end|>\n<|im_start|>assistant\n")

    def run(engine: Engine, constrained: bool) -> float:
        reqs = [
            dict(
                prompt_ids=prompt + [100 + i],  # distinct prompts: no shared pages
                params=SamplingParams(
                    temperature=0.0, max_new_tokens=args.new_tokens, constrained=constrained
                ),
            )
            for i in range(args.batch)
        ]
        t0 = time.perf_counter()
        outs = engine.generate_batch(reqs)
        dt = time.perf_counter() - t0
        assert all(len(o.tokens) == args.new_tokens for o in outs), [o.finish_reason for o in outs]
        return args.batch * args.new_tokens / dt

    cases = {
        "no grammar": (plain, False),
        "grammar, unconstrained requests": (guided, False),
        "grammar, constrained requests": (guided, True),
    }
    for name, (engine, c) in cases.items():  # compile
        t0 = time.perf_counter()
        run(engine, c)
        print(f"first call ({name}): {time.perf_counter() - t0:.1f} s", flush=True)
    rates: dict[str, list[float]] = {n: [] for n in cases}
    for _ in range(args.reps):
        for name, (engine, c) in cases.items():
            rates[name].append(run(engine, c))
    print(
        f"{automaton.num_states} states x {automaton.allow.shape[1]} classes, batch "
        f"{args.batch}, {args.new_tokens} tokens, load {os.getloadavg()[0]:.1f}"
    )
    base = statistics.median(rates["no grammar"])
    for name, r in rates.items():
        med = statistics.median(r)
        print(f"  {name:34s} {med:8.1f} tokens/s  x{med / base:.3f}")


if __name__ == "__main__":
    main()
