"""Fleet faults with simulated hosts (no Chromium, no model): an episode a dead host ended is
played again on another host (bounded, counted, never a policy failure, never lost), and after
a host is killed its faults are counted against the incarnation that leased the env."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

from cua_jax.data.processor import QwenVLProcessor
from cua_jax.rl.rollout import AgentLoop, RolloutSettings
from envs.fleet import BrowserFleet
from envs.sim import LatencyProfile, ScriptedEngine, SimServer, sim_task, start_sim_server

FAST = LatencyProfile.load().scaled(0.02)  # the measured shape, 50x faster


@pytest.fixture(scope="module")
def proc():
    return QwenVLProcessor.default("qwen3_vl", max_pixels=64 * 64, min_pixels=32 * 32)


class GatedEngine(ScriptedEngine):
    """Every episode waits at the start of turn `at` until `gate` opens (`waiting` counts them)."""

    def __init__(self, tokenizer, at: int):
        super().__init__(tokenizer)
        self.at, self.gate, self.waiting, self.turns = at, asyncio.Event(), 0, {}

    async def generate(self, prompt_ids, pixel_values=None, image_grid_thw=None, **kw):
        session = kw.get("session_id")
        turn = self.turns[session] = self.turns.get(session, -1) + 1
        if turn == self.at and not self.gate.is_set():
            self.waiting += 1
            await self.gate.wait()
        return await super().generate(prompt_ids, pixel_values, image_grid_thw)


class Recording:
    """The fleet, with each acquire's (avoid, host it gave) recorded."""

    def __init__(self, fleet):
        self.fleet, self.acquired = fleet, []

    def __len__(self):
        return len(self.fleet)

    def host_of(self, env):
        return self.fleet.host_of(env)

    @contextlib.asynccontextmanager
    async def acquire(self, avoid=None):
        async with self.fleet.acquire(avoid) as env:
            self.acquired.append((avoid, self.fleet.host_of(env)))
            yield env


def _loop(engine, proc, **kw):
    settings = RolloutSettings(max_turns=6, system_prompt="compact", **kw)
    return AgentLoop(engine, proc, settings)


def test_a_killed_host_s_episodes_are_retried_elsewhere_and_blamed_on_it(proc):
    """Host A is killed while its episodes wait for the policy, and a new process is serving on
    its port before the fleet notices. Their next call gets a lost lease (404) from the new A:
    each is a fault of A's first incarnation, counted once, and played again on B; the new A is
    not taken out (the fleet before this took it out and blamed it); B is blamed for nothing;
    every episode comes back exactly once and none is a failure."""

    async def go():
        # B has room for every retry: 8 envs, of which A's episodes leave on_a free.
        servers = [SimServer(c, profile=FAST, seed=i, name=f"h{i}") for i, c in enumerate((4, 8))]
        (ra, a), (rb, b) = [await start_sim_server(s) for s in servers]
        engine = GatedEngine(proc.tokenizer, at=2)
        loop = _loop(engine, proc)
        fleet = BrowserFleet(None, (a, b), viewport=FAST.viewport, health_interval_s=3600)
        async with fleet:
            pool = Recording(fleet)
            tasks = [sim_task(g, steps=4, p_success=1.0) for g in range(2)]
            jobs = [
                asyncio.create_task(loop.run_group(pool, t, 4, seed=g, group_id=f"g{g}"))
                for g, t in enumerate(tasks)
            ]
            async with asyncio.timeout(60):
                while engine.waiting < 8:
                    await asyncio.sleep(0.01)
            on_a = fleet.hosts[a].in_use
            await ra.cleanup()  # A dies with its leases; a new A serves on the same port
            port = int(a.rsplit(":", 1)[1])
            ra2, _ = await start_sim_server(SimServer(4, profile=FAST, name="h0-new"), port=port)
            engine.gate.set()
            groups = await asyncio.wait_for(asyncio.gather(*jobs), 60)
            report, counts = fleet.report(), fleet.fault_counts()
            log = list(fleet.fault_log)
        await ra2.cleanup()
        await rb.cleanup()
        return groups, on_a, report, counts, log, pool.acquired, loop

    groups, on_a, report, counts, log, acquired, loop = asyncio.run(go())
    a, b = list(report)
    trajs = [t for g in groups for t in g]
    assert len(trajs) == 8 and on_a >= 1  # nothing lost; on_a were on A at the kill
    assert sorted(t.group_id for t in trajs) == ["g0"] * 4 + ["g1"] * 4  # none counted twice
    assert not any(t.infra_fault for t in trajs) and all(t.success for t in trajs)
    assert sum(t.timings["env_attempts"] - 1 for t in trajs) == on_a == loop.env_retries
    # The faults: one per episode that was on A, all A's, of its first incarnation.
    assert counts == {"faults": on_a, "retries": on_a, "by_host": {a: {0: on_a}}}
    assert all("HTTP 404" in f["reason"] for f in log)
    assert report[a]["up"] and report[a]["faults"] == on_a and report[b]["faults"] == 0
    # Each retry avoided A and went to B (B had room: its own four were done or running).
    retried = [(avoid, got) for avoid, got in acquired if avoid is not None]
    assert retried == [(a, b)] * on_a


def test_retries_are_bounded_and_a_still_faulted_episode_is_returned_as_a_fault(proc):
    """Every step of every host faults: each episode is played 1 + env_retries times, then
    comes back as an infrastructure fault (not a failure), counted; none is lost."""

    async def go():
        servers = [SimServer(2, profile=FAST, seed=i, fault_rate=1.0) for i in range(2)]
        started = [await start_sim_server(s) for s in servers]
        loop = _loop(ScriptedEngine(proc.tokenizer), proc, env_retries=2)
        fleet = BrowserFleet(
            None, [ep for _, ep in started], viewport=FAST.viewport, health_interval_s=0.05
        )
        async with fleet:
            group = await asyncio.wait_for(
                loop.run_group(fleet, sim_task(0), 3, seed=0, group_id="g"), 60
            )
            counts = fleet.fault_counts()
        for r, _ in started:
            await r.cleanup()
        return group, counts, loop

    group, counts, loop = asyncio.run(go())
    assert len(group) == 3 and all(t.infra_fault for t in group)
    assert all(t.failure_reason.startswith("env_error") and not t.success for t in group)
    assert [t.timings["env_attempts"] for t in group] == [3.0] * 3 and loop.env_retries == 6
    assert counts["faults"] == 9 and counts["retries"] == 6


def test_a_pool_without_hosts_still_retries_and_bad_settings_fail(proc):
    with pytest.raises(ValueError, match="env_retries"):
        RolloutSettings(env_retries=-1)
    with pytest.raises(ValueError, match="fault_rate"):
        SimServer(1, profile=FAST, fault_rate=2.0)


class _CrashOnce:
    """An env whose browser crashes (a step ends with info["error"]) on the pool's first reset."""

    crashes = 1

    async def reset(self, task, seed=None):
        self.crash, _CrashOnce.crashes = _CrashOnce.crashes > 0, _CrashOnce.crashes - 1
        return await self._obs()

    async def step(self, action):
        from cua_jax.env_api import StepResult

        info = {"error": "page crashed", "done_reason": "error"} if self.crash else {}
        return StepResult(await self._obs(), True, 0.0, info)

    async def _obs(self):
        from cua_jax.env_api import Observation

        return Observation(np.zeros((48, 64, 3), np.uint8), "x")

    async def evaluate(self):
        return 1.0

    async def close(self):
        pass


class _OneEnvPool:
    """A pool with no hosts (no `host_of`, `acquire()` without arguments), as BrowserPool."""

    def __init__(self):
        self.env = _CrashOnce()

    def __len__(self):
        return 1

    @contextlib.asynccontextmanager
    async def acquire(self):
        yield self.env


def test_a_pool_without_hosts_plays_a_crashed_episode_again(proc):
    _CrashOnce.crashes = 1
    loop = _loop(ScriptedEngine(proc.tokenizer), proc)
    (traj,) = asyncio.run(loop.run_group(_OneEnvPool(), sim_task(0), 1, seed=0, group_id="g"))
    assert traj.failure_reason is None and traj.success and traj.timings["env_attempts"] == 2.0
    assert loop.env_retries == 1
