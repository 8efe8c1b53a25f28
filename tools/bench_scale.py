"""The cost of scaling out on CPU: sampler decode tokens/s and train step time of the smoke
preset's model on 1 vs 4 forced host devices (one process), and on 1 vs 2 processes (2 devices
in one process vs 2 processes x 1 device joined over gloo, as two hosts would be).

    .venv/bin/python tools/bench_scale.py [--batch 8 --new-tokens 32 --rows 8 --steps 3 --rounds 2]

Each configuration runs in its own subprocesses (XLA_FLAGS fixes the device count before JAX
starts); each process builds the smoke preset's tiny Qwen3-VL on the run's mesh exactly as the
trainer does (`cua_jax.job.builders`: learner on the mesh, sampler on the learner's params, or on
each process's own devices with several processes), then times

- decode: `--batch` greedy text requests of a 64-token prompt, `--new-tokens` each, EOS off
  (best of 3 after a compiling call); with several processes each decodes its own batch and
  the job's tokens/s is their sum;
- train step: a GRPO step on `--rows` packed rows of random tokens (the global batch; each
  process packs its share), median of `--steps` after the compiling step.

On a CPU the devices share the same cores, so more devices cannot be faster: the ratios are the
overhead of sharding (collectives, smaller matmuls) that a TPU or GPU mesh would pay in exchange
for memory and FLOPs. Prints one table; BENCHMARKS.md has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from configs.qwen3vl_grpo import get_config
from cua_jax.job import builders
from cua_jax.rl.trajectory import Sample
from cua_jax.sampler import SamplingParams
from launch.process import maybe_initialize_distributed
from tools import bench_setup
from tools.bench_setup import ROOT


def _worker(args: argparse.Namespace) -> None:
    """One process of one configuration: prints a JSON line of its timings."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        maybe_initialize_distributed()
    import jax
    import numpy as np

    c = get_config("smoke")
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, args.fsdp, args.tensor
    c.sampler.max_slots = args.batch
    c.sampler.max_seq_len = 64 + args.new_tokens + 16
    mesh, rules = builders.mesh_and_rules(c)
    model, _ = builders.build_model_and_processor(c, mesh, rules)
    learner = builders.build_learner(model, c, mesh, rules, sft=False)
    tok = type("Tok", (), {"decode": staticmethod(lambda ids: "")})()
    engine = builders.build_engine(learner.model, c, tok, mesh=mesh, rules=rules)
    engine.update_params(builders.sampler_params(learner), learner.version)
    vocab = learner.config.text.vocab_size
    rng = np.random.default_rng(jax.process_index())
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)
    reqs = [
        dict(prompt_ids=rng.integers(16, vocab - 16, 64), params=params) for _ in range(args.batch)
    ]
    engine.generate_batch(reqs)  # compiles
    decode_times, outs = bench_setup.timed_calls(lambda: engine.generate_batch(reqs), 3)
    tokens = sum(len(o.tokens) for o in outs)

    n = jax.process_count()
    length = 192

    def sample(i: int) -> Sample:
        ids = rng.integers(16, vocab - 16, length).astype(np.int32)
        mask = np.zeros(length, bool)
        mask[64:] = True
        pos = np.broadcast_to(np.arange(length, dtype=np.int32), (3, length)).copy()
        return Sample(
            input_ids=ids,
            loss_mask=mask,
            behaviour_logprobs=np.where(mask, -2.0, 0.0).astype(np.float32),
            position_ids=pos,
            advantage=1.0 if i % 2 else -1.0,
            episode=i,
        )

    batch = learner.pack([sample(i) for i in range(args.rows // n)], num_rows=args.rows)
    learner.train_step(batch)  # compiles
    times, _ = bench_setup.timed_calls(lambda: learner.train_step(batch), args.steps)
    out = {
        "process": jax.process_index(),
        "devices": jax.device_count(),
        "decode_tokens": tokens,
        "decode_s": min(decode_times),  # best of 3
        "train_step_s": float(np.median(times)),
    }
    print("RESULT " + json.dumps(out), flush=True)
    if n > 1:
        jax.distributed.shutdown()


def _run(name: str, devices: int, processes: int, fsdp: int, tensor: int, args) -> dict:
    """Starts `processes` workers with `devices` forced devices each; returns the job's row."""
    port = bench_setup.free_port()
    procs = []
    for i in range(processes):
        env = dict(os.environ)
        env.update(XLA_FLAGS=bench_setup.host_devices_flag(devices))
        env["JAX_PLATFORMS"] = "cpu"
        if processes > 1:
            env.update(
                JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                JAX_NUM_PROCESSES=str(processes),
                JAX_PROCESS_ID=str(i),
            )
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            f"--fsdp={fsdp}",
            f"--tensor={tensor}",
            f"--batch={args.batch}",
            f"--new-tokens={args.new_tokens}",
            f"--rows={args.rows}",
            f"--steps={args.steps}",
        ]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, cwd=ROOT))
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=1200)
        if p.returncode != 0:
            raise SystemExit(f"{name}: a worker failed (exit {p.returncode})")
        line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT ") :]))
    tokens = sum(r["decode_tokens"] for r in results)
    decode_s = max(r["decode_s"] for r in results)
    return {
        "name": name,
        "decode_tok_s": tokens / decode_s,
        "train_step_s": max(r["train_step_s"] for r in results),
    }


CONFIGS = {
    # name: (devices per process, processes, fsdp, tensor)
    "1 device": (1, 1, 1, 1),
    "4 devices, fsdp=2 x tensor=2": (4, 1, 2, 2),
    "2 devices, 1 process (fsdp=2)": (2, 1, 2, 1),
    "2 processes x 1 device (fsdp=2, gloo)": (1, 2, 2, 1),
}


def main() -> None:
    """The command line: runs what the module docstring describes."""
    ap = bench_setup.arg_parser(__doc__)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--fsdp", type=int, default=1)
    ap.add_argument("--tensor", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8, help="decode requests (per process)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rows", type=int, default=8, help="packed rows of the global batch")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (best of)")
    ap.add_argument("--only", default="", help="comma-separated config names to run")
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return
    names = [n for n in CONFIGS if not args.only or n in args.only.split(",")]
    rows: dict[str, dict] = {}
    for _ in range(args.rounds):  # interleaved rounds, best of each: load drifts on a shared CPU
        for n in names:
            r = _run(n, *CONFIGS[n], args)
            best = rows.setdefault(n, r)
            best["decode_tok_s"] = max(best["decode_tok_s"], r["decode_tok_s"])
            best["train_step_s"] = min(best["train_step_s"], r["train_step_s"])
    print(f"load average at the end: {os.getloadavg()}")
    print(f"{'configuration':<40} {'decode tok/s':>12} {'train step s':>12}")
    for r in rows.values():
        print(f"{r['name']:<40} {r['decode_tok_s']:>12.1f} {r['train_step_s']:>12.3f}")
    pairs = [
        ("1 device", "4 devices, fsdp=2 x tensor=2"),
        ("2 devices, 1 process (fsdp=2)", "2 processes x 1 device (fsdp=2, gloo)"),
    ]
    for a, b in pairs:
        if a in rows and b in rows:
            ra, rb = rows[a], rows[b]
            print(
                f"{b} / {a}: decode tok/s x{rb['decode_tok_s'] / ra['decode_tok_s']:.2f}, "
                f"train step time x{rb['train_step_s'] / ra['train_step_s']:.2f}"
            )


if __name__ == "__main__":
    main()
