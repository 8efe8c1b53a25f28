"""Benchmark of the VM environments: env steps/s and where one step's time goes.

    .venv/bin/python tools/bench_vm_envs.py [--steps 30] [--width 1280] [--height 720]

Runs on local desktops (Xvfb + openbox + ``envs.vm.server`` on loopback, an xterm open) and
prints, side by side in one run:

* env steps/s through ``VMEnv.step`` (action + screenshot round trip) with 1 desktop and with 4
  desktops driven concurrently (aggregate);
* the split of one step into: the action inside the VM (OSWorld's
  ``python -c "import pyautogui; ..."`` process), screenshot capture (X grab + cursor), PNG
  encode, HTTP (everything between client and server handler: connection, request/response,
  JSON), and the client's PNG decode. In-VM times come from the server's ``X-Handler-Seconds`` /
  ``X-Capture-Seconds`` / ``X-Encode-Seconds`` headers;
* the same split for the action run three ways: our server's warm pyautogui worker (default),
  a new ``python -c "import pyautogui; ..."`` process per action (what OSWorld's server does), and
  plain ``xdotool`` (no Python), to show what the per-action process costs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import io
import platform
import random
import statistics
import time

from PIL import Image

from cua_jax.actions import Move
from envs.vm import osworld
from envs.vm.env import VMEnv, task_from_osworld
from envs.vm.providers import LocalDesktop, missing_programs
from tools import bench_setup

TASK = dataclasses.replace(
    next(
        task_from_osworld(t, "desktop") for t in osworld.load_builtin() if t.id == "terminal-mkdir"
    ),
    max_steps=10**6,
)


async def env_steps(
    desk: LocalDesktop, n: int, seed: int, ready: asyncio.Barrier | None = None
) -> list[float]:
    """Seconds of each of n VMEnv.step(Move) after a reset with an xterm on screen.

    With ``ready``, the timed steps of all desktops start together (resets excluded)."""
    rng = random.Random(seed)
    env = VMEnv(desk)
    await env.reset(TASK)
    for _ in range(2):  # warm-up: connection, page cache
        await env.step(Move(rng.randrange(desk.width), rng.randrange(desk.height)))
    if ready is not None:
        await ready.wait()
    times = []
    for _ in range(n):
        move = Move(rng.randrange(desk.width), rng.randrange(desk.height))
        res, took = await bench_setup.timed_await(env.step(move))
        times.append(took)
        assert not res.done, res.info
    return times


async def breakdown(desk: LocalDesktop, n: int, via: str) -> dict[str, float]:
    """Mean seconds per step by component.

    ``via``: "warm" (our server's warm pyautogui worker, the default), "cold" (a new
    ``python -c`` per action, what OSWorld's server does) or "xdotool" (no Python at all).
    """
    c = desk.client
    rng = random.Random(1)
    parts: dict[str, list[float]] = {
        k: [] for k in ("action", "capture", "encode", "http", "decode", "total")
    }
    for i in range(n + 2):
        x, y = rng.randrange(desk.width), rng.randrange(desk.height)
        t0 = time.perf_counter()
        if via == "warm":
            r = await c.pyautogui(f"pyautogui.moveTo({x}, {y})")
        elif via == "cold":  # same code; the prefix does not match the worker's fast path
            r = await c.execute(
                ["python", "-c", f"import time; import pyautogui; pyautogui.moveTo({x}, {y})"]
            )
        else:
            r = await c.execute(["xdotool", "mousemove", str(x), str(y)])
        assert r["returncode"] == 0, r
        t1 = time.perf_counter()
        act = float(c.last_headers["X-Handler-Seconds"])
        png = await c.screenshot()
        t2 = time.perf_counter()
        h = c.last_headers
        cap, enc = float(h["X-Capture-Seconds"]), float(h["X-Encode-Seconds"])
        shot_handler = float(h["X-Handler-Seconds"])
        with Image.open(io.BytesIO(png)) as im:
            im.convert("RGB").load()
        t3 = time.perf_counter()
        if i < 2:
            continue  # warm-up
        parts["action"].append(act)
        parts["capture"].append(cap)
        parts["encode"].append(enc)
        parts["http"].append((t1 - t0 - act) + (t2 - t1 - shot_handler))
        parts["decode"].append(t3 - t2)
        parts["total"].append(t3 - t0)
    return {k: statistics.fmean(v) for k, v in parts.items()}


async def main(args: argparse.Namespace) -> None:
    """Runs what the module docstring describes with the parsed `args`."""
    missing = missing_programs(("Xvfb", "openbox", "xdotool", "wmctrl", "xterm"))
    if missing:
        raise SystemExit(f"missing {missing}: run `make apt`")
    desks = [LocalDesktop(args.width, args.height) for _ in range(4)]
    await asyncio.gather(*(d.start() for d in desks))
    try:
        print(
            f"# VM env benchmark: {args.width}x{args.height}, {args.steps} steps per desktop, "
            f"{platform.node()} ({__import__('os').cpu_count()} CPUs)"
        )
        # 1 desktop, then 4 at once, then 1 again: the machine is shared, so the two single
        # runs bracket the parallel one and their spread shows the noise.
        singles = []
        for rep in range(2):
            if rep == 1:
                ready = asyncio.Barrier(4)
                res = await asyncio.gather(
                    *(env_steps(d, args.steps, i, ready) for i, d in enumerate(desks))
                )
                # timed window: from the barrier to the last desktop's last step
                wall = max(sum(r) for r in res)
                agg = 4 * args.steps / wall
                print(
                    f"4 desktops: {agg:6.2f} env steps/s aggregate "
                    f"(median step {1000 * statistics.median(sum(res, [])):.0f} ms)"
                )
            times = await env_steps(desks[0], args.steps, 10 + rep)
            singles.append(args.steps / sum(times))
            print(
                f"1 desktop : {singles[-1]:6.2f} env steps/s "
                f"(median step {1000 * statistics.median(times):.0f} ms)"
            )
        one = statistics.fmean(singles)
        print(f"4 desktops / 1 desktop: {agg / one:.2f}x")
        print("\nwhere one step goes (mean ms, share of the step):")
        rows = {}
        vias = ("warm", "cold", "xdotool")
        for via in vias:
            rows[via] = await breakdown(desks[0], args.steps, via)
        print(
            f"{'component':<36}"
            + "".join(f"{h:>20}" for h in ("pyautogui warm", "pyautogui cold", "xdotool"))
        )
        labels = {
            "action": "action in VM (command run)",
            "capture": "screenshot capture (X grab+cursor)",
            "encode": "PNG encode in VM",
            "http": "HTTP (client<->server handlers)",
            "decode": "PNG decode in client",
            "total": "total",
        }
        for k, lab in labels.items():
            cells = []
            for via in vias:
                ms = 1000 * rows[via][k]
                share = 100 * rows[via][k] / rows[via]["total"]
                cells.append(f"{ms:7.1f} ms {share:5.1f}%")
            print(f"{lab:<36}" + "".join(f"{c:>20}" for c in cells))
        tot = {v: rows[v]["total"] for v in vias}
        print(
            f"\nstep time cold / warm pyautogui: {tot['cold'] / tot['warm']:.2f}x; "
            f"warm / xdotool: {tot['warm'] / tot['xdotool']:.2f}x"
        )
    finally:
        await asyncio.gather(*(d.stop() for d in desks))


if __name__ == "__main__":
    p = bench_setup.arg_parser(__doc__)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--height", type=int, default=720)
    asyncio.run(main(p.parse_args()))
