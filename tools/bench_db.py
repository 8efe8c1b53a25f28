r"""Trajectory database and monitor timings on a synthetic run (no model, no env).

    python tools/bench_db.py [--steps 1000] [--groups 8] [--group-size 8] [--turns 3]
        [--screens-groups 2] [--db postgresql://...] [--browser]

1. Writer: every step's real `Trajectory` groups go through `TrajectoryDB.log_step` as the
   trainer calls it. Reported: the caller's time per call (what a training step pays) and the
   writer thread's time per step (background: conversion, screenshots, one transaction).
2. Monitor: the pages of the run (steps x groups x group_size rollouts) served in-process
   (Starlette TestClient: template + queries, no network), median of 5; with --browser also
   Chromium's full load of the run page until every curve is drawn.
"""

from __future__ import annotations

import functools
import os
import tempfile
import time

from cua_jax import db as db_lib
from envs.browser.host import find_chromium
from tools import bench_setup, monitor
from tools.monitor_app.app import make_app

print = functools.partial(print, flush=True)  # noqa: A001 -- progress shows at once


def main(argv: list[str] | None = None) -> None:
    """The command line: runs what the module docstring describes."""
    p = bench_setup.arg_parser(__doc__, paragraph=True)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--turns", type=int, default=3, help="turns of the longest episode")
    p.add_argument("--screens-groups", type=int, default=2, help="groups whose screens are kept")
    p.add_argument("--db", default=None, help="database URL (default: SQLite in a temp workdir)")
    p.add_argument("--browser", action="store_true", help="also time Chromium loading the run")
    args = p.parse_args(argv)

    import numpy as np
    from starlette.testclient import TestClient

    from tests.db import synth

    workdir = tempfile.mkdtemp(prefix="bench_db_")
    db = db_lib.open_run(workdir, args.db, run_name="bench", decode=synth.decode, queue_size=4096)
    db.truncate_after(-1)
    # A few distinct step batches, reused (building trajectories is not what is timed).
    batches = []
    for b in range(4):
        groups, screens = synth.step_groups(b + 1, args.groups, args.group_size, version=b)
        for g in groups:
            for t in g:
                t.turns = t.turns[: args.turns]
        per_screens = args.screens_groups * args.group_size
        batches.append((groups, screens[:per_screens]))
    rollouts = args.groups * args.group_size
    print(
        f"{args.steps} steps x {rollouts} rollouts ({args.groups} groups of {args.group_size}),"
        f" screenshots of {args.screens_groups} groups per step, db {db.url}"
    )
    call_s = []
    t_all = time.perf_counter()
    for s in range(1, args.steps + 1):
        groups, screens = batches[s % len(batches)]
        row = synth.metrics_row(s)
        t0 = time.perf_counter()
        db.log_step(s, row, groups, screens=screens, version=s)
        call_s.append(time.perf_counter() - t0)
    db.flush(3600)
    writer_s = time.perf_counter() - t_all
    db.close("finished")
    print(
        f"writer: log_step call {np.median(call_s) * 1e6:.0f} us median, "
        f"{np.percentile(call_s, 99) * 1e6:.0f} us p99 (the training step's cost); "
        f"background {writer_s / args.steps * 1e3:.1f} ms per step "
        f"({args.steps} steps in {writer_s:.1f} s)"
    )

    engine = monitor.open_database(
        db.url if args.db else os.path.join(workdir, "trajectories.sqlite")
    )
    client = TestClient(make_app(engine))
    rid = client.get(f"/runs/1/steps/{args.steps // 2}").text.split('href="/rollouts/')[1]
    rid = rid.split('"')[0]
    pages = {
        "/": "runs list",
        "/runs/1": "run page (HTML)",
        "/api/runs/1/steps": f"run curves JSON ({args.steps} steps)",
        f"/api/runs/1/steps?after={args.steps - 1}": "live poll (1 new step)",
        f"/runs/1/steps/{args.steps // 2}": f"step page ({rollouts} rollouts)",
        f"/rollouts/{rid}": "rollout page",
    }
    for url, what in pages.items():
        r = client.get(url)
        assert r.status_code == 200, (url, r.status_code)
        ms = bench_setup.median_s(lambda url=url: client.get(url), 5) * 1e3
        print(f"  {what:32s} {ms:8.1f} ms  {len(r.content) / 1e3:8.1f} kB  {url}")

    if args.browser:
        from playwright.sync_api import sync_playwright

        server = bench_setup.uvicorn_thread(make_app(engine), "the monitor")
        with server as port, sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=find_chromium())
            page = browser.new_page()

            def load() -> None:
                page.goto(f"http://127.0.0.1:{port}/runs/1")
                page.wait_for_function(
                    f"document.body.dataset.loadedSteps === '{args.steps}' && "
                    "document.querySelectorAll('.chart canvas').length >= 7"
                )

            ms = bench_setup.median_s(load, 5) * 1e3
            print(f"  Chromium: run page until every curve is drawn {ms:.0f} ms")
            browser.close()


if __name__ == "__main__":
    main()
