"""Browser env throughput vs the raw Playwright screenshot ceiling, side by side in one run.

    .venv/bin/python tools/bench_envs.py --concurrency 1,4,16 --seconds 5 --rounds 3

For each concurrency N, on ONE Chromium process, alternating ``--rounds`` times:
  ceiling: N pages (one context each) looping ``page.screenshot()`` (PNG bytes, nothing else)
  env:     N BrowserEnvs looping ``env.step(Move(...))``: input event + screenshot + PNG->RGB
           decode + done check, i.e. a full agent step
and prints screenshots/s, steps/s and the median of the per-round ratios (alternating rounds
keep a drifting background load from favouring either side). Both show the same task page.

    .venv/bin/python tools/bench_envs.py --fleet --concurrency 16 --hosts 2 --kill

``--fleet``: N envs spread by ``envs.fleet.BrowserFleet`` over a local pool and ``--hosts``
browser hosts (``python -m envs.browser.server`` child processes on loopback), against the same
hosts' raw screenshot ceiling (local pages + each host's ``/bench/pages`` then
``/bench/screenshots``: every host opens its pages, then all loop from one moment),
alternating as above. ``--kill``: then a run of oracle episodes (``--episodes``) over the same
fleet in which the last host is SIGKILLed once a quarter of them are done (or after
``--kill-after`` seconds): its episodes in flight must be
infrastructure faults and every other episode must finish. The fleet run also prints where the
env side's CPU goes, in CPU ms per env step by process kind: this process (the trainer's side:
HTTP client, local Playwright calls, decode), the hosts' Python, Playwright's node drivers and
Chromium.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import time

import aiohttp

from cua_jax import actions as A
from cua_jax.env_api import INFO_ERROR, EnvError
from envs.browser import BrowserEnv, BrowserHost, BrowserPool, suite
from envs.browser.bench import close_pages, loop_rate, open_pages, screenshot_loop
from envs.browser.pages import ORIGIN, handle_route
from envs.browser.server import start_host_process
from envs.fleet import LOCAL, BrowserFleet
from tools import bench_setup


async def _rate(seconds: float, fns) -> float:
    """Calls/s of all ``fns`` looping concurrently for ``seconds``."""
    calls, took = await loop_rate(seconds, fns)
    return calls / took


async def bench(host: BrowserHost, n: int, seconds: float, rounds: int, viewport) -> None:
    """Steps/s of `n` concurrent raw-page screenshot loops vs `n` BrowserEnv step loops on one host;
    prints one row (medians over `rounds`)."""
    w, h = viewport
    ctxs, pages = [], []
    for i in range(n):
        ctx = await host.new_context(viewport={"width": w, "height": h}, device_scale_factor=1)
        await ctx.route("**/*", handle_route)
        page = await ctx.new_page()
        await page.goto(f"{ORIGIN}/builtin/task.html?t=settings-panel&seed={i}")
        await page.screenshot()  # warm-up
        ctxs.append(ctx)
        pages.append(page)
    envs = [BrowserEnv(viewport, host=host) for _ in range(n)]
    steps = []
    for i, e in enumerate(envs):
        await e.reset(suite.make_task("settings-panel", i))
        rng = random.Random(i)

        async def step(e=e, rng=rng):
            r = await e.step(A.Move(rng.uniform(0, w - 1), rng.uniform(0, h - 1)))
            assert not r.done, r.info

        await step()  # warm-up
        steps.append(step)

    raws, envr = [], []
    for _ in range(rounds):
        raws.append(await _rate(seconds, [p.screenshot for p in pages]))
        envr.append(await _rate(seconds, steps))
    ratio = bench_setup.median_ratio(envr, raws)
    print(
        f"{n:>5} {statistics.median(raws):>12.1f} {statistics.median(envr):>12.1f} {ratio:>7.2f}",
        flush=True,
    )
    for c in ctxs:
        await c.close()
    for e in envs:
        await e.close()


TOKEN = "bench-envs-token"


async def _post_bench(session, ep: str, path: str, body: dict, timeout_s: float) -> dict:
    async with session.post(
        f"http://{ep}{path}",
        json=body,
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    ) as r:
        d = await r.json()
        if r.status != 200:
            raise RuntimeError(f"{ep} {path}: {d}")
        return d


def _cpu_by_kind(host_pids: set[int]) -> dict[int, tuple[str, float]]:
    """{pid: (kind, CPU seconds so far)} of this process and all its descendants; kind is
    "trainer" (this process), "host" (a browser host's Python), "driver" (Playwright's node)
    or "chromium"."""
    import psutil  # noqa: PLC0415

    me = psutil.Process()
    out = {}
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            name = p.name()
        except psutil.Error:
            continue
        if p.pid == me.pid:
            kind = "trainer"
        elif p.pid in host_pids:
            kind = "host"
        elif "node" in name:
            kind = "driver"
        elif "chrom" in name or "headless" in name:
            kind = "chromium"
        else:
            kind = "other"
        out[p.pid] = (kind, t.user + t.system)
    return out


def _cpu_delta(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds per kind between two `_cpu_by_kind` snapshots (a process that started in
    between counts from 0; one that ended is lost, as its time cannot be read)."""
    out: dict[str, float] = {}
    for pid, (kind, t) in after.items():
        out[kind] = out.get(kind, 0.0) + t - before.get(pid, (kind, 0.0))[1]
    return out


async def _oracle_episode(env, task) -> float:
    await env.reset(task)
    for _ in range(task.max_steps + 5):
        res = await env.step(await env.oracle_next())
        if res.info.get(INFO_ERROR):
            raise EnvError(res.info[INFO_ERROR])
        if res.done:
            break
    return await env.evaluate()


async def bench_fleet(args, viewport) -> None:
    """N envs over the local host and --hosts remote hosts vs the same hosts' raw ceiling."""
    import signal  # noqa: PLC0415

    n = int(args.concurrency.split(",")[0])
    per = [
        n // (args.hosts + 1) + (1 if i < n % (args.hosts + 1) else 0)
        for i in range(args.hosts + 1)
    ]
    procs = [start_host_process(token=TOKEN, capacity=c) for c in per[1:]]
    eps = [ep for _, ep in procs]
    w, h = viewport
    try:
        fleet = BrowserFleet(
            BrowserPool(per[0], viewport=viewport, step_timeout_s=60.0),
            eps,
            token=TOKEN,
            viewport=viewport,
            health_interval_s=1.0,
            request_timeout_s=60.0,
        )
        async with fleet, aiohttp.ClientSession() as session:
            print(f"{n} envs: local {per[0]}, hosts {dict(zip(eps, per[1:], strict=True))}")
            async with contextlib.AsyncExitStack() as stack:
                envs = [await stack.enter_async_context(fleet.acquire()) for _ in range(n)]
                where = {}
                steps = []
                for i, e in enumerate(envs):
                    await e.reset(suite.make_task("settings-panel", i))
                    where[getattr(e, "endpoint", LOCAL)] = (
                        where.get(getattr(e, "endpoint", LOCAL), 0) + 1
                    )
                    rng = random.Random(i)

                    async def step(e=e, rng=rng):
                        r = await e.step(A.Move(rng.uniform(0, w - 1), rng.uniform(0, h - 1)))
                        assert not r.done, r.info

                    await step()
                    steps.append(step)
                print(f"envs per host: {where}")
                raws, envr = [], []
                host_pids = {p.pid for p, _ in procs}
                cpu: dict[str, float] = {}
                env_steps = 0
                for _ in range(args.rounds):
                    # every host opens its pages, then all loop from the same moment: loops
                    # that ran one after another would each have the cores to themselves
                    opened = await asyncio.gather(
                        open_pages(fleet.local.host, per[0], viewport),
                        *(
                            _post_bench(
                                session,
                                ep,
                                "/bench/pages",
                                {"pages": c, "viewport": list(viewport)},
                                300,
                            )
                            for ep, c in zip(eps, per[1:], strict=True)
                        ),
                    )
                    start_at = time.time() + 3.0  # time for every host to get the request
                    body = {"seconds": args.seconds, "start_at": start_at}
                    try:
                        local, *remote = await asyncio.gather(
                            screenshot_loop(opened[0], args.seconds, start_at),
                            *(
                                _post_bench(
                                    session, ep, "/bench/screenshots", body, args.seconds + 60
                                )
                                for ep in eps
                            ),
                        )
                    finally:
                        await close_pages(opened[0])
                    rates = [local, *((d["shots"], d["seconds"], d["late_s"]) for d in remote)]
                    late = max(r[2] for r in rates)
                    if late > 0.2:
                        print(f"  (a ceiling loop began {late:.1f} s late)")
                    raws.append(sum(shots / took for shots, took, _ in rates))
                    before = _cpu_by_kind(host_pids)
                    count, took = await loop_rate(args.seconds, steps)
                    for k, v in _cpu_delta(before, _cpu_by_kind(host_pids)).items():
                        cpu[k] = cpu.get(k, 0.0) + v
                    env_steps += count
                    envr.append(count / took)
                    print(
                        f"  round: raw {raws[-1]:.1f} shots/s, env {envr[-1]:.1f} steps/s",
                        flush=True,
                    )
            ratio = bench_setup.median_ratio(envr, raws)
            print(f"{'envs':>5} {'raw shots/s':>12} {'env steps/s':>12} {'ratio':>7}")
            print(
                f"{n:>5} {statistics.median(raws):>12.1f} {statistics.median(envr):>12.1f} "
                f"{ratio:>7.2f}"
            )
            by_cost = sorted(cpu.items(), key=lambda kv: -kv[1])
            split = ", ".join(f"{k} {v / env_steps * 1e3:.2f}" for k, v in by_cost)
            total = sum(cpu.values()) / env_steps * 1e3
            print(f"CPU ms per env step (all rounds): {total:.2f} = {split}")
            if args.kill:
                await _kill_run(fleet, procs[-1], args, signal)
    finally:
        for p, _ in procs:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
            p.wait(30)


async def _kill_run(fleet, victim, args, signal) -> None:

    proc, ep = victim
    names = ("nav-two-level", "type-word", "enter-name-email", "click-sequence")
    tasks = [suite.make_task(names[i % len(names)], i) for i in range(args.episodes)]
    t0 = time.perf_counter()

    finished = asyncio.Event()  # a quarter of the episodes are done: the run is mid-way
    done = 0

    async def one(task):
        nonlocal done
        async with fleet.acquire() as env:
            host = getattr(env, "endpoint", LOCAL)
            try:
                return host, await _oracle_episode(env, task)
            except EnvError as e:
                return host, e
            finally:
                done += 1
                if done >= max(1, len(tasks) // 4):
                    finished.set()

    async def killer():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(finished.wait(), args.kill_after)
        proc.send_signal(signal.SIGKILL)
        print(
            f"  killed {ep} at {time.perf_counter() - t0:.1f} s, {done} of {len(tasks)} "
            "episodes done",
            flush=True,
        )
        if done == len(tasks):
            raise SystemExit("the kill came after the last episode: nothing was in flight")

    k = asyncio.create_task(killer())
    results = await asyncio.gather(*(one(t) for t in tasks))
    await k
    took = time.perf_counter() - t0
    by_host: dict[str, list[int]] = {}
    for host, r in results:
        ok, fault = by_host.setdefault(host, [0, 0])
        by_host[host] = [ok + (r == 1.0), fault + isinstance(r, EnvError)]
    lost = sum(1 for _, r in results if not isinstance(r, EnvError) and r != 1.0)
    print(
        f"kill run: {len(tasks)} oracle episodes in {took:.1f} s; per host [solved, faults]: "
        f"{by_host}; neither: {lost}; hosts up after: {fleet.env_hosts()}"
    )
    print(f"fleet report: {fleet.report()}")


async def main() -> None:
    """The command line: runs what the module docstring describes."""
    ap = bench_setup.arg_parser(__doc__)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--viewport", default="640x480")
    ap.add_argument("--executable-path", default=None)
    ap.add_argument("--fleet", action="store_true", help="local + remote hosts (see above)")
    ap.add_argument("--hosts", type=int, default=2, help="remote browser hosts (--fleet)")
    ap.add_argument("--kill", action="store_true", help="then kill a host mid-run (--fleet)")
    ap.add_argument(
        "--kill-after",
        type=float,
        default=8.0,
        help="kill the host after this many seconds, or once a quarter of the episodes are done",
    )
    ap.add_argument("--episodes", type=int, default=48)
    args = ap.parse_args()
    viewport = tuple(int(v) for v in args.viewport.split("x"))
    print(
        f"viewport {viewport[0]}x{viewport[1]}, PNG, {args.rounds} alternating rounds of "
        f"{args.seconds:g} s per side"
    )
    if args.fleet:
        await bench_fleet(args, viewport)
        return
    print(f"{'envs':>5} {'raw shots/s':>12} {'env steps/s':>12} {'ratio':>7}")
    async with BrowserHost(args.executable_path) as host:
        for n in (int(x) for x in args.concurrency.split(",")):
            await bench(host, n, args.seconds, args.rounds, viewport)


if __name__ == "__main__":
    asyncio.run(main())
