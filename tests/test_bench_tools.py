"""The accelerator benchmark runs end to end on CPU at a tiny size, so the command a GPU session
runs (`python3 tools/bench_paged_decode.py`) has not rotted by the time a GPU is lent."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_paged_decode_small_on_cpu():
    args = [
        sys.executable, "tools/bench_paged_decode.py", "--size=small", "--batch=4",
        "--prompt-len=64", "--new-tokens=16", "--copy-mib=64", "--iters=2",
        "--kernel-shape=2,4,2,128,16,48", "--backends=auto,interpret",
        "--gpu-options=pages_per_block=1;pages_per_block=2,f32_dots=false",
    ]  # fmt: skip
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    # kernel part: one row per interpret-mode kernel variant and the reference; bf16 inputs, so
    # equal to the reference within bf16 rounding
    kernel = out.split("== kernel")[1].split("fastest:")[0].splitlines()[2:]
    rows = {line.split("]")[0].strip() + "]": line.split()[-1] for line in kernel if "[" in line}
    assert set(rows) == {"interpret[p1 f32]", "interpret[p2 bf16]"}, out
    assert all(float(d) < 5e-2 for d in rows.values()), out
    # bandwidth part: one row per backend, the same greedy tokens from both
    table = out.split("== bandwidth")[1].splitlines()
    rows = [line.split() for line in table if line.split()[:1] in (["auto"], ["interpret"])]
    assert [r[0] for r in rows] == ["auto", "interpret"], out
    assert all(r[-1] == "100%" for r in rows), out
