"""Remote browser hosts (``python -m envs.browser.server`` in child processes on loopback): the
env API over HTTP, the request guard, leases, and a fleet that loses a host mid-run."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import aiohttp
import numpy as np
import pytest

from cua_jax import actions as A
from cua_jax.env_api import INFO_ERROR, EnvError
from envs.browser import BrowserPool, suite
from envs.browser.remote import HostUnavailable, RemoteBrowserEnv, unpack_obs
from envs.browser.server import start_host_process
from envs.fleet import LOCAL, BrowserFleet
from envs.screenshots import FRAME_MAGIC

TOKEN = "test-token-123"
VIEWPORT = (320, 240)


@pytest.fixture(scope="module")
def host():
    # leases live 60 s here (a loaded machine can take seconds between two calls of one
    # episode); the lease test runs its own host with 3 s
    proc, ep = start_host_process(token=TOKEN, capacity=3, extra=["--lease-s", "60"])
    yield ep
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)


async def _oracle_episode(env, task):
    obs = await env.reset(task)
    steps = 0
    for _ in range(task.max_steps + 5):
        res = await env.step(await env.oracle_next())
        steps += 1
        if res.info.get(INFO_ERROR):
            raise EnvError(res.info[INFO_ERROR])
        if res.done:
            break
    return obs, steps, await env.evaluate()


def test_remote_env_runs_oracle_episodes_and_api_actions(host, run):
    async def episodes(s):  # the host's episodes in flight (between reset and evaluate)
        from envs.browser.remote import host_health

        return (await host_health(s, host, TOKEN))["episodes"]

    async def go():
        async with RemoteBrowserEnv(host, TOKEN, VIEWPORT) as env, aiohttp.ClientSession() as s:
            await env.reset(suite.make_task("click-button", 4))
            in_flight = [await episodes(s)]
            await env.evaluate()
            in_flight.append(await episodes(s))  # the lease is kept, the episode is over
            assert in_flight == [1, 0], in_flight
            out = []
            for name in ("click-button", "enter-name-email", "nav-two-level"):
                out.append(await _oracle_episode(env, suite.make_task(name, 5)))
            api_task = suite.make_task("two-dropdowns", 3, api_actions=A.BROWSER_API)
            _, steps, score = await _oracle_episode(env, api_task)
            _, gui_steps, _ = await _oracle_episode(env, suite.make_task("two-dropdowns", 3))
            await env.reset(api_task)
            bad = await env.step(A.OpenUrl("https://example.com/"))
            return out, (steps, gui_steps), score, bad

    out, (api_steps, gui_steps), api_score, bad = run(go())
    for obs, steps, score in out:
        assert obs.screenshot.shape == (240, 320, 3) and obs.screenshot.dtype == np.uint8
        assert obs.instruction and score == 1.0 and steps >= 1
    assert api_score == 1.0 and api_steps < gui_steps  # select_option over the wire
    assert "network is closed" in bad.info["invalid_action"]


def test_remote_screens_equal_local_screens(host, run):
    """The same task and seed, rendered by the remote host and by a local browser: the host's
    screens as frames (the default) and as PNGs are the local screen's pixels; the frame's
    body is a frame; an unknown screen format is a 400 naming the choices."""

    async def go():
        task = suite.make_task("click-color", 11)
        remote = {}
        for screens in ("frame", "png"):
            async with RemoteBrowserEnv(host, TOKEN, VIEWPORT, screens=screens) as env:
                remote[screens] = await env.reset(task)
        async with BrowserPool(1, viewport=VIEWPORT) as pool, pool.acquire() as env:
            local = await env.reset(task)
        async with aiohttp.ClientSession() as s:
            head = {"Authorization": f"Bearer {TOKEN}"}
            async with s.post(f"http://{host}/envs", json={"screens": "frame"}, headers=head) as r:
                key = (await r.json())["env"]
            async with s.post(
                f"http://{host}/envs/{key}/reset", json={"task": task.to_dict()}, headers=head
            ) as r:
                _, image = unpack_obs(await r.read())
            async with s.post(f"http://{host}/envs/{key}/close", json={}, headers=head):
                pass
            async with s.post(f"http://{host}/envs", json={"screens": "jpeg"}, headers=head) as r:
                bad = (r.status, (await r.json())["message"])
        return remote, local, image, bad

    remote, local, image, bad = run(go())
    for r in remote.values():
        assert r.instruction == local.instruction
        assert np.array_equal(r.screenshot, local.screenshot)
    assert image[:4] == FRAME_MAGIC
    assert bad == (400, "screens must be one of ('png', 'frame'), got 'jpeg'")


def test_miniwob_pages_come_from_the_host(host, run):
    from envs.tasks import load_tasks

    task = load_tasks({"source_type": "miniwob", "names": ["click-test"]})[0]

    async def go():
        async with RemoteBrowserEnv(host, TOKEN, VIEWPORT) as env:
            obs = await env.reset(task)
            return obs, await env.evaluate()

    obs, score = run(go())
    assert "click" in obs.instruction.lower() and obs.screenshot.std() > 0
    assert score == -1.0  # unfinished MiniWoB episode, scored by the host


async def _raw(ep, method, path, *, headers=None, data=None, json_body=None):
    async with aiohttp.ClientSession() as s:
        async with s.request(
            method, f"http://{ep}{path}", headers=headers or {}, data=data, json=json_body
        ) as r:
            return r.status, await r.text()


def test_guard_refuses_web_pages_missing_tokens_and_big_bodies(host, run):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    cases = [
        ("GET", "/health", {}, None, None, 401),
        ("GET", "/health", {"Authorization": "Bearer nope"}, None, None, 401),
        ("GET", "/health", {**auth, "Origin": "http://evil.example"}, None, None, 403),
        ("GET", "/health", {**auth, "Host": "evil.example"}, None, None, 403),
        ("GET", "/health", {**auth, "Sec-Fetch-Site": "cross-site"}, None, None, 403),
        ("POST", "/envs", {**auth, "Content-Type": "text/plain"}, b"{}", None, 415),
        ("POST", "/envs/x/step", auth, None, {"action": {"text": "x" * (2 << 20)}}, 413),
        ("POST", "/envs/nope/evaluate", auth, None, None, 404),
        ("GET", "/health", auth, None, None, 200),
    ]
    for method, path, headers, data, body, want in cases:
        status, text = run(_raw(host, method, path, headers=headers, data=data, json_body=body))
        assert status == want, (method, path, headers.keys(), status, text[:200])


def test_bad_reset_arguments_and_non_ascii_tokens_are_4xx(host, run):
    # Each was a 500 with a traceback in the host's log (ValueError, OverflowError on int(inf),
    # AttributeError later on a string spec, UnicodeEncodeError comparing the token).
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    status, text = run(_raw(host, "POST", "/envs", headers=auth, data=b"{}"))
    lease = json.loads(text)["env"]
    task = json.dumps(suite.make_task("click-button", 1).to_dict())
    bad = {
        '"seed": "abc"': "seed must be an integer or null, got 'abc'",
        '"seed": 1e400': "seed must be an integer or null, got inf",
        '"seed": true': "seed must be an integer",
    }
    for extra, message in bad.items():
        body = f'{{"task": {task}, {extra}}}'.encode()
        status, text = run(_raw(host, "POST", f"/envs/{lease}/reset", headers=auth, data=body))
        assert status == 400 and message in text, (extra, status, text)
    spec = json.dumps({"task": {**json.loads(task), "spec": "a string"}}).encode()
    status, text = run(_raw(host, "POST", f"/envs/{lease}/reset", headers=auth, data=spec))
    assert status == 400 and "task field 'spec' must be an object" in text, text
    run(
        _raw(host, "POST", f"/envs/{lease}/close", headers={"Authorization": auth["Authorization"]})
    )

    async def raw_token(token: bytes) -> bytes:
        name, port = host.rsplit(":", 1)
        r, w = await asyncio.open_connection(name, int(port))
        w.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + token)
        w.write(b"\r\nConnection: close\r\n\r\n")
        line = (await r.read()).split(b"\r\n")[0]
        w.close()
        return line

    assert run(raw_token(b"\xe9")) == b"HTTP/1.1 401 Unauthorized"


def test_bench_pages_then_screenshots_from_start_at(host, run):
    """The fleet ceiling's barrier: a host opens its pages (`/bench/pages`), then loops from
    `start_at` (`/bench/screenshots`), not before; without opened pages, or with a `start_at`
    out of range, it refuses."""
    auth = {"Authorization": f"Bearer {TOKEN}"}

    def post(path, body):
        status, text = run(_raw(host, "POST", path, headers=auth, json_body=body))
        return status, json.loads(text) if text.startswith("{") else text

    assert post("/bench/screenshots", {"seconds": 0.5})[0] == 409  # no pages opened
    assert post("/bench/pages", {"pages": 99})[0] == 400  # over capacity
    status, text = post("/bench/pages", {"pages": 1, "viewport": [100000, 100000]})
    assert status == 400 and "64..8192" in str(text)  # bounded as /envs is (it pinned a CPU)
    assert post("/bench/pages", {"pages": 1, "viewport": list(VIEWPORT)}) == (200, {"pages": 1})
    for bad in (time.time() - 5.0, time.time() + 3600.0, "soon"):
        assert post("/bench/screenshots", {"seconds": 0.5, "start_at": bad})[0] == 400
    start_at = time.time() + 5.0  # time for the request to reach a busy host
    status, d = post("/bench/screenshots", {"seconds": 0.5, "start_at": start_at})
    assert status == 200, d
    assert d["shots"] >= 1 and d["late_s"] < 1.0
    assert time.time() >= start_at + 0.5  # it looped after start_at, not before
    assert post("/bench/screenshots", {"seconds": 0.5})[0] == 409  # the pages were closed


def test_cli_binds_loopback_and_needs_a_token_elsewhere(capsys):
    r = subprocess.run(
        [sys.executable, "-m", "envs.browser.server", "--host", "0.0.0.0", "--no-token"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "needs --token" in r.stderr
    from envs.browser.server import parse_args

    a = parse_args([])
    assert a.host == "127.0.0.1" and a.token and a.token_generated
    t = "a-token-of-16+chars"
    assert parse_args(["--host", "0.0.0.0", "--token", t]).token == t
    bad = {
        ("--host", "0.0.0.0", "--token", "T"): "at least 16 characters",
        ("--port", "99999"): "--port 99999 must be in [0, 65535]",
        ("--capacity", "0"): "--capacity 0 must be >= 1",
        ("--lease-s", "-1"): "--lease-s -1.0 must be a finite number > 0",
        ("--step-timeout-s", "nan"): "--step-timeout-s nan must be",
    }
    for args, message in bad.items():
        with pytest.raises(SystemExit) as exc:
            parse_args(list(args))
        err = capsys.readouterr().err
        assert exc.value.code == 2 and message in err, (args, err)


def _browser_process(host_pid: int) -> int:
    """The Chromium browser process (not a renderer) started under the host process."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            kids.setdefault(ppid, []).append(int(d))
    todo, seen = [host_pid], []
    while todo:
        new = kids.get(todo.pop(), [])
        seen += new
        todo += new
    for pid in seen:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().split(b"\0")
        if any(c.startswith(b"--cua-host=") for c in cmd) and not any(
            c.startswith(b"--type=") for c in cmd
        ):
            return pid
    raise AssertionError(f"no Chromium under {host_pid}")


def test_health_names_a_wedged_browser_and_sigterm_still_stops_the_host(run):
    """A stopped Chromium stays `connected` (its pipe is open) while every reset hangs: /health
    turns 503 naming it once a page has been opening for --health-timeout-s (it was 200
    `browser_connected: true`), and SIGTERM with a reset hung in flight stops the host in
    seconds (10 s before; up to 60 s more with aiohttp's grace for in-flight requests)."""
    # 3 s: on a loaded machine a healthy page can take over a second to open
    proc, ep = start_host_process(token=TOKEN, capacity=1, extra=["--health-timeout-s", "3"])
    auth = {"Authorization": f"Bearer {TOKEN}"}
    chromium = _browser_process(proc.pid)
    try:
        status, text = run(_raw(ep, "GET", "/health", headers=auth))
        assert status == 200 and json.loads(text)["browser_ok"], text
        status, text = run(
            _raw(ep, "POST", "/envs", headers=auth, json_body={"viewport": [64, 64]})
        )
        lease = json.loads(text)["env"]
        os.kill(chromium, signal.SIGSTOP)
        t0 = time.monotonic()
        while status == 200 and time.monotonic() - t0 < 20:  # a probe a second, 3 s to fail
            status, text = run(_raw(ep, "GET", "/health", headers=auth))
        took = time.monotonic() - t0
        body = json.loads(text)
        assert status == 503 and not body["browser_ok"] and "wedged" in body["message"], text
        assert body["browser_connected"] and took < 10.0, took  # connected, yet not working

        async def hung_reset_then_sigterm():
            task = {"id": "t", "instruction": "x", "source": "custom", "spec": {"html": "<p>"}}
            reset = asyncio.ensure_future(
                _raw(ep, "POST", f"/envs/{lease}/reset", headers=auth, json_body={"task": task})
            )
            await asyncio.sleep(0.5)
            assert not reset.done()
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            while proc.poll() is None and time.monotonic() - t0 < 20:
                await asyncio.sleep(0.05)
            with contextlib.suppress(Exception):
                await reset
            return time.monotonic() - t0

        stopped_in = run(hung_reset_then_sigterm())
        assert proc.poll() is not None and stopped_in < 8.0, stopped_in
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(chromium, signal.SIGCONT)
            os.kill(chromium, signal.SIGKILL)
        proc.kill()
        proc.wait(10)


@pytest.fixture
def short_lease_host():
    """A host whose idle leases expire after 3 s."""
    proc, ep = start_host_process(token=TOKEN, capacity=3, extra=["--lease-s", "3"])
    yield ep
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)


def test_lease_expires_and_a_full_host_refuses(short_lease_host, run):
    host = short_lease_host

    async def go():
        envs = [RemoteBrowserEnv(host, TOKEN, VIEWPORT) for _ in range(4)]
        for e in envs[:3]:
            await e.lease()
        with pytest.raises(HostUnavailable, match="503"):
            await envs[3].lease()
        await envs[0].reset(suite.make_task("click-button", 1))
        await asyncio.sleep(4.5)  # --lease-s 3: the sweeper reclaims idle leases
        res = await envs[0].step(A.Click(10.0, 10.0))
        with pytest.raises(HostUnavailable, match="404"):
            await envs[1].evaluate()
        async with aiohttp.ClientSession() as s:
            from envs.browser.remote import host_health

            health = await host_health(s, host, TOKEN)
        for e in envs:
            await e.close()
        return res, health

    res, health = run(go())
    assert res.done and "unknown or expired lease" in res.info[INFO_ERROR]
    assert health["free"] == 3 and health["leases"] == 0


def test_fleet_spreads_episodes_and_survives_a_killed_host(run):
    """16 envs over a local pool (4) and two hosts (6 each); one host is killed mid-run: its
    episodes are infrastructure faults, every other episode finishes and scores 1, the host is
    taken out, and a new host process on its port is taken back by the health check."""
    p1, ep1 = start_host_process(token=TOKEN, capacity=6)
    p2, ep2 = start_host_process(token=TOKEN, capacity=6)
    tasks = [suite.make_task(n, s) for s in range(4) for n in ("nav-two-level", "type-word")] * 3

    async def episode(fleet, task, i):
        async with fleet.acquire() as env:
            where = getattr(env, "endpoint", LOCAL)
            try:
                if i >= 16:  # the second wave starts once the host is dead
                    await dead.wait()
                _, _, score = await _oracle_episode(env, task)
                return where, score
            except EnvError as e:
                return where, e

    async def go():
        nonlocal dead
        dead = asyncio.Event()
        fleet = BrowserFleet(
            BrowserPool(4, viewport=VIEWPORT, step_timeout_s=60.0),
            (ep1, ep2),
            token=TOKEN,
            viewport=VIEWPORT,
            health_interval_s=0.5,
        )
        async with fleet:
            assert len(fleet) == 16 and fleet.env_hosts() == 3
            jobs = [asyncio.create_task(episode(fleet, t, i)) for i, t in enumerate(tasks)]
            while fleet.hosts[ep2].in_use < 6:
                await asyncio.sleep(0.05)
            p2.send_signal(signal.SIGKILL)
            p2.wait(10)
            t0 = time.monotonic()
            while fleet.hosts[ep2].up and time.monotonic() - t0 < 30:
                await asyncio.sleep(0.1)
            dead.set()
            results = await asyncio.gather(*jobs)
            hosts_after_kill = fleet.env_hosts()
            metrics = fleet.metrics()  # what the trainer logs under rollout/
            counts = fleet.fault_counts()
            report = fleet.report()
            port = ep2.rsplit(":", 1)[1]
            p3, _ = start_host_process(port=int(port), token=TOKEN, capacity=6)
            try:
                t0 = time.monotonic()
                while fleet.env_hosts() < 3 and time.monotonic() - t0 < 30:
                    await asyncio.sleep(0.1)
                back = fleet.env_hosts()
                async with fleet.acquire() as env:  # the fleet still runs episodes
                    again = (await _oracle_episode(env, tasks[0]))[2]
            finally:
                p3.send_signal(signal.SIGTERM)
                p3.wait(30)
            return results, hosts_after_kill, metrics, counts, report, back, again

    dead = None
    try:
        results, hosts_after_kill, metrics, counts, report, back, again = run(go())
    finally:
        for p in (p1, p2):
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
            p.wait(30)
    on_dead = [r for w, r in results if w == ep2]
    others = [r for w, r in results if w != ep2]
    assert on_dead and all(isinstance(r, EnvError) for r in on_dead), on_dead
    # A local step past its 60 s time-out is the local pool's own fault, not the fleet's: it
    # happened once when a loaded `-n 2` CI run starved this machine's Chromium; it is allowed
    # once, on the local pool only, and only as a time-out. Every other episode scores 1.
    slow = [
        r for w, r in results if w == LOCAL and isinstance(r, EnvError) and "timed out" in str(r)
    ]
    assert len(slow) <= 1, slow
    assert len(others) == len(tasks) - len(on_dead), others
    assert sum(r == 1.0 for r in others) == len(others) - len(slow), others
    assert {w for w, _ in results} >= {LOCAL, ep1, ep2}
    assert hosts_after_kill == 2 and not report[ep2]["up"] and report[ep2]["faults"] >= 1
    assert counts["faults"] >= len(on_dead) and counts["retries"] == 0  # nobody asked to retry
    assert metrics == {
        "env_hosts": 2.0,
        "env_hosts_down": 1.0,
        "env_capacity": 4.0 + 6.0,
        "env_faults": float(counts["faults"]),
        "env_retries": 0.0,
    }
    assert json.dumps(report)  # plain data (the trainer logs it)
    assert back == 3 and again == 1.0


def test_config_browser_endpoints_build_a_fleet(host, run):
    from configs.qwen3vl_grpo import get_config
    from cua_jax.job.steps import env_pool_metrics
    from launch.compose import build_env_factory

    c = get_config("smoke")
    c.env.concurrency = 1
    assert build_env_factory(c)[0]().__class__.__name__ == "BrowserPool"
    c.env.browser_endpoints = (host,)
    c.env.browser_token = TOKEN
    fleet = build_env_factory(c)[0]()
    assert isinstance(fleet, BrowserFleet)

    async def go():
        async with fleet:
            return len(fleet), fleet.env_hosts(), env_pool_metrics(fleet)

    n, hosts, logged = run(go())
    assert (n, hosts) == (4, 2)  # 1 local + the host's 3
    assert logged == {
        "rollout/env_hosts": 2.0,
        "rollout/env_hosts_down": 0.0,
        "rollout/env_capacity": 4.0,
        "rollout/env_faults": 0.0,
        "rollout/env_retries": 0.0,
    }
