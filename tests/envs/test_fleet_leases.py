"""A fleet's env keeps its lease from one episode to the next on its host (two calls an
episode fewer), and a lease is closed instead when its episode faulted or was cut short, when it
sat idle too long, or when its host went down (sim hosts, no Chromium, no model)."""

from __future__ import annotations

import asyncio

import pytest

from cua_jax.data.processor import QwenVLProcessor
from cua_jax.rl.rollout import AgentLoop, RolloutSettings
from envs.fleet import BrowserFleet
from envs.sim import (
    PROFILES,
    LatencyProfile,
    ScriptedEngine,
    SimServer,
    sim_task,
    start_sim_server,
)

INSTANT = LatencyProfile.load().scaled(0.0)


@pytest.fixture(scope="module")
def proc():
    return QwenVLProcessor.default("qwen3_vl", max_pixels=64 * 64, min_pixels=32 * 32)


def _loop(proc):
    settings = RolloutSettings(max_turns=4, system_prompt="compact", env_retries=0)
    return AgentLoop(ScriptedEngine(proc.tokenizer), proc, settings)


async def _until(cond, timeout_s: float = 10.0) -> None:
    """Waits for a background lease close to land (polled; a loaded machine can take a while)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)


async def _host(capacity=4, **kw):
    server = SimServer(capacity, profile=INSTANT, **kw)
    runner, ep = await start_sim_server(server)
    return server, runner, ep


def test_back_to_back_groups_reuse_their_leases_and_close_them_at_the_end(proc):
    async def go():
        server, runner, ep = await _host()
        loop = _loop(proc)
        fleet = BrowserFleet(None, (ep,), viewport=INSTANT.viewport, health_interval_s=3600)
        async with fleet:
            for g in range(3):
                task = sim_task(g, steps=2)
                group = await loop.run_group(fleet, task, 2, seed=g, group_id=f"{g}")
                assert [t.failure_reason for t in group] == [None, None]
                assert [len(t.turns) for t in group] == [2, 2]
            idle = fleet.report()[ep]["idle_leases"]
            leased, resets, open_leases = server.leased, server.resets, len(server.leases)
        closed = len(server.leases)
        await runner.cleanup()
        return idle, leased, resets, open_leases, closed

    idle, leased, resets, open_leases, closed = asyncio.run(go())
    # 6 episodes, 6 resets, on the 2 leases the first group took; kept idle, closed by close().
    assert (leased, resets, idle, open_leases, closed) == (2, 6, 2, 2, 0)


def test_a_faulted_or_cut_short_episode_s_lease_is_closed_not_reused(proc):
    async def go():
        server, runner, ep = await _host(fault_rate=1.0)  # every step: HTTP 500
        loop = _loop(proc)
        fleet = BrowserFleet(None, (ep,), viewport=INSTANT.viewport, health_interval_s=3600)
        async with fleet:
            (traj,) = await loop.run_group(fleet, sim_task(0), 1, seed=0, group_id="0")
            faulted = (traj.infra_fault, fleet.report()[ep]["idle_leases"], len(server.leases))
            server.fault_rate = 0.0
            await fleet._check(ep)  # the health check puts the host back
            with pytest.raises(RuntimeError, match="cut short"):
                async with fleet.acquire() as env:
                    await env.reset(sim_task(1))
                    raise RuntimeError("cut short")
            cut = (fleet.report()[ep]["idle_leases"], len(server.leases))
            async with fleet.acquire() as env:
                await env.reset(sim_task(2))
            kept = (fleet.report()[ep]["idle_leases"], len(server.leases), server.leased)
        await runner.cleanup()
        return faulted, cut, kept

    faulted, cut, kept = asyncio.run(go())
    assert faulted == (True, 0, 0)  # the faulted env's lease was closed, none kept
    assert cut == (0, 0)
    assert kept == (1, 1, 3)  # a whole episode keeps its lease: one idle, three leases in all


def test_idle_leases_expire_and_a_host_that_went_down_leases_afresh(proc):
    async def go():
        server, runner, ep = await _host()
        fleet = BrowserFleet(
            None, (ep,), viewport=INSTANT.viewport, health_interval_s=3600, idle_lease_s=0.05
        )
        async with fleet:
            async with fleet.acquire() as env:
                await env.reset(sim_task(0))
            first = env
            await asyncio.sleep(0.1)  # longer than idle_lease_s: given back, a new lease
            async with fleet.acquire() as env:
                await env.reset(sim_task(1))
            expired = (env is not first, server.leased)
            await _until(lambda: len(server.leases) == 1)  # the old lease's background close
            open_after_expiry = len(server.leases)
            fleet.mark_down(ep, "test: taken out")  # idle leases of a down host are given back
            await _until(lambda: not server.leases)
            down = (fleet.report()[ep]["idle_leases"], len(server.leases))
        await runner.cleanup()
        return expired, open_after_expiry, down

    expired, open_after_expiry, down = asyncio.run(go())
    assert expired == (True, 2)
    assert open_after_expiry == 1
    assert down == (0, 0)


def test_idle_lease_s_zero_leases_every_episode_and_bad_values_fail(proc):
    async def go():
        server, runner, ep = await _host()
        loop = _loop(proc)
        fleet = BrowserFleet(
            None, (ep,), viewport=INSTANT.viewport, health_interval_s=3600, idle_lease_s=0
        )
        async with fleet:
            for g in range(2):
                await loop.run_group(fleet, sim_task(g, steps=1), 2, seed=g, group_id=f"{g}")
            left = len(server.leases)
        await runner.cleanup()
        return server.leased, left

    assert asyncio.run(go()) == (4, 0)
    with pytest.raises(ValueError, match="idle_lease_s"):
        BrowserFleet(None, ("127.0.0.1:1",), idle_lease_s=-1)


def test_the_desktop_profile_s_hosts_send_desktop_screens(proc):
    """The shipped desktop profile (`python -m envs.sim --measure desktop`) loads, and hosts that
    follow it send screens of its resolution, which the rollout takes as it takes browsers'."""
    desktop = LatencyProfile.load(PROFILES["desktop"])
    assert desktop.viewport == (1280, 720) and "measure_desktop_profile" in desktop.source
    assert desktop.mean_episode_s(3) > 0

    async def go():
        server = SimServer(2, profile=desktop.scaled(0.0))
        runner, ep = await start_sim_server(server)
        fleet = BrowserFleet(None, (ep,), viewport=desktop.viewport, health_interval_s=3600)
        screens: list = []
        async with fleet:
            group = await _loop(proc).run_group(
                fleet, sim_task(0, steps=2), 1, seed=0, group_id="d", screens=screens
            )
        await runner.cleanup()
        return group, screens

    group, screens = asyncio.run(go())
    assert group[0].failure_reason is None and len(group[0].turns) == 2
    assert {s.shape for s in screens[0]} == {(720, 1280, 3)}
