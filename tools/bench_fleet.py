"""The rollout side at 64 / 256 / 1,000+ concurrent episodes, isolated from envs and the model.

    .venv/bin/python tools/bench_fleet.py --concurrency 64,256,1000 [--think-s 2 --steps 3
        --seconds 30 --capacity 16 --viewport 640x480 --group-size 8] [--ray]

Simulated browser hosts (``envs.sim``: the real host's wire protocol, call times and PNG sizes
drawn from the profile measured on real browser envs) run in a child process on loopback; this
process is the trainer's rollout side, unchanged: ``BrowserFleet`` (``--ray``: ``RayFleet`` on a
local Ray, the hosts as actors), ``RemoteBrowserEnv`` (HTTP, PNG decode), and ``AgentLoop``
playing GRPO groups (``run_group``: render, image preprocessing, parsing, recording, retries)
with ``envs.sim.ScriptedEngine`` as the policy (the engine's host-side preparation of the request,
``scheduler.prompt_inputs``, then a fixed click after ``--think-s`` seconds, the time a model's
turn would take). ``--profile desktop`` gives the hosts the desktops' measured times and
screens. Every group slot starts its next group as soon as its last one ends (closed loop), for
``--seconds`` after a warm-up.

Per concurrency it prints:
- episodes/s against the ideal: concurrency / E[the slowest of a group of ``--group-size``
  episodes], each episode reset + steps x (step + think) + evaluate with the call times drawn
  from the profile and no queueing (a slot's groups run back to back, each as long as its
  slowest member); "ratio" counts the episodes done in the window, "ratio_from_groups" uses the
  mean duration of the groups that ended in it (groups that began in the warm-up's start-up
  burst pull it down in short windows);
- the trainer process's CPU (user + system, all threads) per turn, in cores, and the cores it
  would need at the ideal rate (CPU a turn x the ideal's turns a second), and per turn by
  thread: the event loop, the prompt threads, the PNG-decode executor; the garbage collector's
  collections (by generation) and its time per turn;
- event-loop lag: how late a 20 ms sleep wakes (p50, p99, max);
- memory: the process's RSS over the run's baseline, per episode in flight (glibc's heap keeps
  some freed memory: an upper bound on what is alive);
- the sim hosts' CPU in cores (the env side's load on the same machine).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

from cua_jax.data.processor import QwenVLProcessor
from cua_jax.rl.rollout import AgentLoop, RolloutSettings
from envs.browser.remote import SCREEN_FORMATS
from envs.fleet import BrowserFleet
from envs.ray_fleet import RayFleet, host_actor_options
from envs.sim import LatencyProfile, ScriptedEngine, sim_task
from tools import bench_setup
from tools.bench_setup import ROOT


def group_ideal_s(profile: LatencyProfile, steps: int, think_s: float, size: int) -> float:
    """E[the slowest of `size` episodes] with the profile's call times and no queueing."""
    rng = np.random.default_rng(0)
    draw = lambda v, shape: np.asarray(v)[rng.integers(0, len(v), shape)]  # noqa: E731
    m = 20000
    ep = (
        draw(profile.reset_s, (m, size))
        + draw(profile.step_s, (m, size, steps)).sum(-1)
        + steps * think_s
        + draw(profile.evaluate_s, (m, size))
    )
    return float(ep.max(-1).mean())


def rss_mb() -> float:
    """This process's resident memory in MiB (`/proc/self/statm`)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used so far (`/proc/PID/stat`)."""
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s() -> dict[str, float]:
    """This process's CPU seconds by thread group: the event loop (the main thread), the prompt
    threads (image preprocessing and rendering), the default executor (PNG decode) and the rest."""
    out = {"loop": 0.0, "prompt": 0.0, "decode": 0.0, "other": 0.0}
    names = {t.native_id: t.name for t in threading.enumerate()}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                parts = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        cpu = (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")
        name = names.get(int(tid), "")
        if int(tid) == os.getpid():
            out["loop"] += cpu
        elif name.startswith("cua-prompt"):
            out["prompt"] += cpu
        elif name.startswith(("asyncio_", "cua-decode")):
            out["decode"] += cpu
        else:
            out["other"] += cpu
    return out


class GcTimer:
    """Collections by generation, and the CPU seconds they took (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.reset()
        self._t = 0.0
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.thread_time()  # CPU: GC runs in the thread that triggered it
        else:
            g = info["generation"]
            self.counts[g] += 1
            self.by_gen[g] += time.thread_time() - self._t

    @property
    def seconds(self) -> float:
        """The CPU seconds of every collection since the last `reset`."""
        return sum(self.by_gen)

    def reset(self) -> None:
        """Counts and seconds back to zero (one level's window)."""
        self.counts, self.by_gen = [0, 0, 0], [0.0, 0.0, 0.0]

    def close(self) -> None:
        """Stops timing collections (removes the callback)."""
        gc.callbacks.remove(self)


def start_sim_hosts(
    n: int, capacity: int, profile: str = "browser"
) -> tuple[subprocess.Popen, list[str]]:
    """`n` simulated env hosts in one `envs.sim --serve` process: (the process, their URLs)."""
    cmd = [sys.executable, "-m", "envs.sim", "--serve", "--hosts", str(n), "--profile", profile]
    proc = subprocess.Popen(
        [*cmd, "--capacity", str(capacity)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    eps = []
    for line in proc.stdout:
        if line.startswith("serving on http://"):
            eps.append(line.strip().removeprefix("serving on http://"))
        elif line.strip() == "ready":
            return proc, eps
    raise RuntimeError(f"the sim hosts did not start (exit {proc.wait()})")


async def lag_monitor(samples: list[float], period: float = 0.02) -> None:
    """Appends the event loop's lag (how late a `period` sleep wakes) to `samples`, forever."""
    while True:
        t = time.perf_counter()
        await asyncio.sleep(period)
        samples.append(time.perf_counter() - t - period)


async def run_level(args, n: int, proc_: QwenVLProcessor, profile: LatencyProfile) -> dict:
    """One concurrency level: `n` episodes at once on simulated hosts (by hand or on Ray) for
    `args.seconds`; episodes a second against the ideal, latency, memory and CPU figures."""
    hosts = -(-n // args.capacity)
    if args.ray:
        sim, eps = None, []
        fleet = RayFleet(
            "local",  # a Ray of this machine's own, started for the bench
            kind="sim",
            target_concurrency=n,
            host_capacity=args.capacity,
            actor_options=host_actor_options("sim", num_cpus=0, resource=""),
            token="bench-fleet-token-0123456789",
            viewport=profile.viewport,
            discover_interval_s=5.0,
            namespace=f"bench{n}",
            screens=args.screens,
        )
    else:
        sim, eps = start_sim_hosts(hosts, args.capacity, args.profile)
        fleet = BrowserFleet(
            None, eps, viewport=profile.viewport, acquire_timeout_s=600, screens=args.screens
        )
    settings = RolloutSettings(
        max_turns=args.steps + 1, system_prompt="compact", prompt_threads=args.prompt_threads
    )
    engine = ScriptedEngine(proc_.tokenizer, settings.action_format, think_s=args.think_s)
    loop = AgentLoop(engine, proc_, settings)
    done = {"episodes": 0, "turns": 0, "faulted": 0}  # counts only: trajectories are dropped,
    counting = False  # as the trainer's store would hand them on
    lags: list[float] = []

    group_s: list[float] = []

    async def slot(k: int) -> None:
        g = 0
        while True:
            task = sim_task(k * 100000 + g, steps=args.steps)
            group, took = await bench_setup.timed_await(
                loop.run_group(fleet, task, args.group_size, seed=g, group_id=f"{k}/{g}")
            )
            if counting:
                group_s.append(took)
                done["episodes"] += len(group)
                done["turns"] += sum(len(t.turns) for t in group)
                done["faulted"] += sum(t.infra_fault for t in group)
            g += 1

    base_rss = rss_mb()
    gct = GcTimer()
    async with fleet:
        if args.ray:
            t0 = time.monotonic()
            while len(fleet) < n and time.monotonic() - t0 < 600:
                await asyncio.sleep(0.5)
        slots = [asyncio.create_task(slot(k)) for k in range(n // args.group_size)]
        mon = asyncio.create_task(lag_monitor(lags))
        await asyncio.sleep(args.warmup)
        counting, lags[:] = True, []
        gct.reset()
        threads0 = thread_cpu_s()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        sim_cpu0 = proc_cpu_s(sim.pid) if sim else 0.0
        await asyncio.sleep(args.seconds)
        counting = False
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        ru = resource.getrusage(resource.RUSAGE_SELF)
        minor_faults, sys_s = ru.ru_minflt - ru0.ru_minflt, ru.ru_stime - ru0.ru_stime
        threads = {k: v - threads0[k] for k, v in thread_cpu_s().items()}
        gc_counts, gc_s, gc_by_gen = list(gct.counts), gct.seconds, list(gct.by_gen)
        tracked = len(gc.get_objects())
        sim_cpu = (proc_cpu_s(sim.pid) - sim_cpu0) if sim else float("nan")
        rss = rss_mb()
        in_flight = sum(h.in_use for h in fleet.hosts.values())
        for t in [*slots, mon]:
            t.cancel()
        await asyncio.gather(*slots, mon, return_exceptions=True)
        faults = fleet.fault_counts()
    gct.close()
    if sim is not None:
        sim.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            sim.wait(10)
    turns = done["turns"]
    mean_turns = turns / max(1, done["episodes"])
    # A slot's groups run back to back, each as long as its slowest member: the ideal rate is
    # group_size / E[max of group_size episode times] a slot, with the profile's draws.
    ideal = n / group_ideal_s(profile, args.steps, args.think_s, args.group_size)
    rate = done["episodes"] / wall
    # The same from the groups' own durations (no wave quantisation in a short window).
    rate_groups = n / statistics.fmean(group_s) if group_s else float("nan")
    lags.sort()
    q = lambda p: lags[min(len(lags) - 1, int(p * len(lags)))] * 1e3 if lags else float("nan")  # noqa: E731
    return {
        "concurrency": n,
        "hosts": hosts,
        "episodes": done["episodes"],
        "faulted": done["faulted"],
        "fleet_faults": faults["faults"],
        "turns_per_episode": round(mean_turns, 2),
        "episodes_per_s": round(rate, 2),
        "ideal_per_s": round(ideal, 2),
        "ratio": round(rate / ideal, 3),
        "episodes_per_s_from_groups": round(rate_groups, 2),
        "ratio_from_groups": round(rate_groups / ideal, 3),
        "cpu_ms_per_turn": round(1e3 * cpu / max(1, turns), 3),
        "trainer_cores": round(cpu / wall, 3),
        # The cores the rollout side would need at the ideal rate, from its CPU a turn: under 1
        # is the goal's "under one core", whatever share of the machine the run was given.
        "cores_at_ideal": round(cpu / max(1, turns) * ideal * mean_turns, 3),
        # The same CPU a turn, by thread: loop (HTTP, the agent loop, the fleet), prompt
        # (screenshot preprocessing, rendering), decode (PNG), other.
        **{f"cpu_ms_per_turn_{k}": round(1e3 * v / max(1, turns), 3) for k, v in threads.items()},
        # Of the CPU a turn, the kernel's (on loopback a send also runs the receiving side's
        # TCP path, which a trainer with hosts on other machines does not pay).
        "cpu_ms_per_turn_system": round(1e3 * sys_s / max(1, turns), 3),
        # Page faults the kernel served (fresh pages of large arrays glibc maps and unmaps).
        "minor_faults_per_turn": round(minor_faults / max(1, turns), 1),
        "gc_collections": gc_counts,
        "gc_ms_per_turn": round(1e3 * gc_s / max(1, turns), 3),
        "gc_s_by_generation": [round(x, 3) for x in gc_by_gen],
        "gc_tracked_objects": tracked,
        "sim_host_cores": round(sim_cpu / wall, 3),
        "loop_lag_ms_p50": round(q(0.5), 2),
        "loop_lag_ms_p99": round(q(0.99), 2),
        "loop_lag_ms_max": round(lags[-1] * 1e3 if lags else float("nan"), 2),
        "rss_mb_over_base": round(rss - base_rss, 1),
        "mb_per_episode": round((rss - base_rss) / max(1, in_flight), 3),
        "in_flight": in_flight,
        "maxrss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "load_avg_1m": round(os.getloadavg()[0], 1),
    }


def main() -> None:
    """The command line: runs what the module docstring describes."""
    p = bench_setup.arg_parser(__doc__)
    p.add_argument("--concurrency", default="64,256,1000")
    p.add_argument("--think-s", type=float, default=2.0, help="the policy's seconds per turn")
    p.add_argument("--steps", type=int, default=3, help="steps per episode")
    p.add_argument("--seconds", type=float, default=30.0, help="measured window per level")
    p.add_argument("--warmup", type=float, default=15.0, help="seconds before measuring")
    p.add_argument("--capacity", type=int, default=16, help="envs per sim host")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--viewport", default=None, help="WxH of the processor (the profile's)")
    p.add_argument(
        "--max-pixels",
        type=int,
        default=0,
        help="the processor's max_pixels (0: the viewport's area, as the smoke preset sets it; "
        "small: screens shrink to a few patches, isolating the rest of the rollout side)",
    )
    p.add_argument(
        "--pixel-dtype",
        choices=("uint8", "float32"),
        default="uint8",
        help="the screens' form in episodes (model.pixel_dtype; uint8 is the presets')",
    )
    p.add_argument("--prompt-threads", type=int, default=1, help="RolloutSettings'")
    p.add_argument(
        "--screens",
        choices=SCREEN_FORMATS,
        default="frame",
        help="how the hosts send screens (env.host_screens): zstd frames or PNGs",
    )
    p.add_argument("--ray", action="store_true", help="hosts as Ray actors on a local Ray")
    p.add_argument(
        "--profile",
        default="browser",
        help="the sim hosts' latency profile: browser, desktop (envs/sim_profile_*.json) or a file",
    )

    p.add_argument("--json", default=None, help="write the rows to this file")
    args = p.parse_args()
    if args.ray and args.profile != "browser":
        p.error("--ray hosts take the browser profile (RayFleet starts them); drop --profile")
    levels = [int(x) for x in args.concurrency.split(",")]
    if any(n < args.group_size or n % args.group_size for n in levels):
        p.error(f"--concurrency values must be multiples of --group-size {args.group_size}")
    profile = LatencyProfile.load(args.profile)
    w, h = tuple(int(x) for x in args.viewport.split("x")) if args.viewport else profile.viewport
    max_pixels = args.max_pixels or w * h
    proc_ = QwenVLProcessor.default(
        "qwen3_vl", max_pixels=max_pixels, min_pixels=32 * 32, pixel_dtype=args.pixel_dtype
    )
    print(
        f"profile: {profile.source}; think {args.think_s} s, {args.steps} steps, screens "
        f"{w}x{h} as {args.pixel_dtype}, processor max_pixels {max_pixels}, hosts send "
        f"{args.screens}s",
        flush=True,
    )
    rows = []
    for n in levels:
        row = asyncio.run(run_level(args, n, proc_, profile))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
