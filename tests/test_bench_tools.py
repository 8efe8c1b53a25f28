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
    ]  # fmt: skip
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    # kernel part: interpret-mode kernel vs reference, equal within f32 rounding
    diff = float(out.split("max |difference| ")[1].split()[0])
    assert diff < 1e-2, out
    # bandwidth part: one row per backend, the same greedy tokens from both
    table = out.split("== bandwidth")[1].splitlines()
    rows = [line.split() for line in table if line.split()[:1] in (["auto"], ["interpret"])]
    assert [r[0] for r in rows] == ["auto", "interpret"], out
    assert all(r[-1] == "100%" for r in rows), out
