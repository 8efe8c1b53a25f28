"""Screenshot decode: Pillow against `envs.screenshots.decode_screenshot`, side by side.

    .venv/bin/python tools/bench_decode.py [--viewports 640x480,1280x720] [--files A.png ...]

Takes real screens first: Chromium screenshots (PNG) of built-in task pages at each viewport,
plus any --files (a VM desktop's PNG, say). For each screen it times both decoders on the same
bytes in alternating rounds (CPU time of this process, so a busy machine slows both alike),
checks they give the same pixels, and prints the median CPU ms per decode and the ratio.

Then the same screens as host frames (`envs.screenshots.encode_frame`, what a browser host sends
with `env.host_screens="frame"`): bytes and CPU ms per decode against the PNG's, and a frame's
decode handed to the remote envs' decode thread (`envs.browser.remote.decode_executor`, as a
PNG is) against inline on the event loop, 64 at a time, CPU ms per decode of the whole process.
"""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np

from envs.browser import BrowserPool, suite
from envs.browser.remote import decode_executor
from envs.screenshots import decode_screenshot, decode_with_pillow, encode_frame
from tools import bench_setup

TEMPLATES = ("click-button", "nav-tabs", "radio-pick")


async def browser_screens(viewports: list[tuple[int, int]]) -> dict[str, bytes]:
    """PNG screenshots of a few built-in task pages at each viewport, taken through a real
    browser."""

    out = {}
    for w, h in viewports:
        async with BrowserPool(1, viewport=(w, h)) as pool, pool.acquire() as env:
            for name in TEMPLATES:
                await env.reset(suite.make_task(name, 1))
                out[f"{name} {w}x{h}"] = env.last_screenshot_bytes
    return out


def repeated(fn, data: bytes, n: int):
    """A no-argument callable that runs `fn(data)` `n` times (the results dropped): one side's
    share of a round."""

    def run() -> None:
        for _ in range(n):
            fn(data)

    return run


def main() -> None:
    """The command line: runs what the module docstring describes."""
    ap = bench_setup.arg_parser(__doc__)
    ap.add_argument("--viewports", default="640x480,1280x720")
    ap.add_argument("--files", nargs="*", default=[])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--decodes", type=int, default=50, help="decodes per round and side")
    args = ap.parse_args()
    vps = [tuple(int(v) for v in s.split("x")) for s in args.viewports.split(",") if s]
    screens = asyncio.run(browser_screens(vps)) if vps else {}
    for path in args.files:
        with open(path, "rb") as f:
            screens[os.path.basename(path)] = f.read()

    print(f"{args.rounds} alternating rounds of {args.decodes} decodes; CPU ms per decode")
    print("| screen | PNG bytes | Pillow ms | decode_screenshot ms | Pillow / ours |")
    print("| --- | --- | --- | --- | --- |")
    for name, data in screens.items():
        ref, ours = decode_with_pillow(data), decode_screenshot(data)
        if ref.shape != ours.shape or not np.array_equal(ref, ours):
            raise SystemExit(f"{name}: the two decoders disagree")
        sides = (decode_with_pillow, decode_screenshot)
        fns = {fn: repeated(fn, data, args.decodes) for fn in sides}
        med = bench_setup.timed_rounds(fns, args.rounds, clock=time.process_time)
        ma, mb = (med[fn] / args.decodes * 1e3 for fn in sides)
        print(f"| {name} | {len(data)} | {ma:.2f} | {mb:.2f} | {ma / mb:.1f}x |")

    print("\n| screen | PNG bytes | frame bytes | PNG ms | frame ms | PNG / frame |")
    print("| --- | --- | --- | --- | --- | --- |")
    frames = {}
    for name, data in screens.items():
        frame = frames[name] = encode_frame(decode_screenshot(data))
        if not np.array_equal(decode_screenshot(frame), decode_screenshot(data)):
            raise SystemExit(f"{name}: the frame's pixels are not the PNG's")
        fns = {
            k: repeated(decode_screenshot, b, args.decodes)
            for k, b in (("png", data), ("f", frame))
        }
        med = bench_setup.timed_rounds(fns, args.rounds, clock=time.process_time)
        ma, mb = (med[k] / args.decodes * 1e3 for k in ("png", "f"))
        print(f"| {name} | {len(data)} | {len(frame)} | {ma:.3f} | {mb:.3f} | {ma / mb:.1f}x |")

    print("\n| frames | on the decode thread, ms | inline on the loop, ms | thread / inline |")
    print("| --- | --- | --- | --- |")
    got = {"thread": [], "inline": []}
    for _ in range(args.rounds):
        for mode in got:
            got[mode].append(asyncio.run(loop_decodes(list(frames.values()), mode, args.decodes)))
    a, b = (float(np.median(got[m])) for m in ("thread", "inline"))
    print(
        f"| {len(frames)} screens, {args.decodes * len(frames)} a round | {a:.3f} | {b:.3f} "
        f"| {a / b:.1f}x |"
    )


async def loop_decodes(frames: list[bytes], mode: str, n: int, at_once: int = 64) -> float:
    """CPU ms of this process per decode of `frames` (each `n` times), `at_once` in flight:
    on the decode executor (`mode="thread"`) or inline on the event loop."""
    loop = asyncio.get_running_loop()
    ex = decode_executor()
    gate = asyncio.Semaphore(at_once)

    async def one(b: bytes) -> None:
        async with gate:
            if mode == "inline":
                decode_screenshot(b)
            else:
                await loop.run_in_executor(ex, decode_screenshot, b)
            await asyncio.sleep(0)

    jobs = [b for b in frames for _ in range(n)]
    c0 = time.process_time()
    await asyncio.gather(*(one(b) for b in jobs))
    return (time.process_time() - c0) / len(jobs) * 1e3


if __name__ == "__main__":
    main()
