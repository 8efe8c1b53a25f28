"""Providers: four local desktops in parallel, recreation after a killed server, retirement of a
dead endpoint, and resets from a template home."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import pytest

from cua_jax.actions import Click, TypeText
from cua_jax.env_api import INFO_DONE_REASON, INFO_ERROR, EnvError, Task
from envs.vm import osworld
from envs.vm.env import VMEnv, task_from_osworld
from envs.vm.providers import DesktopPool, LocalDesktop, PoolExhaustedError, Remote

MKDIR = next(
    task_from_osworld(t, "desktop") for t in osworld.load_builtin() if t.id == "terminal-mkdir"
)


def test_four_desktops_in_parallel_each_on_its_own_display_and_port(xserver, aio):
    desks = [LocalDesktop(320 + 16 * i, 240) for i in range(4)]
    pool = DesktopPool(desks)

    async def go():
        async with pool:
            got = await asyncio.gather(*(pool.acquire() for _ in range(4)))
            assert sorted(id(d) for d in got) == sorted(id(d) for d in desks)
            # Drive all four at once: a different pointer position on each.
            await asyncio.gather(
                *(
                    d.client.pyautogui(f"pyautogui.moveTo({10 + i}, {20 + i})")
                    for i, d in enumerate(desks)
                )
            )
            sizes = await asyncio.gather(*(d.client.screen_size() for d in desks))
            cursors = await asyncio.gather(*(d.client.cursor_position() for d in desks))
            # Independent: each server's X client sees the display we think it serves.
            seen = await asyncio.gather(
                *(
                    d.client.execute(["bash", "-c", "echo $DISPLAY; xdpyinfo | grep dimensions"])
                    for d in desks
                )
            )
            urls = {d.url for d in desks}
            for d in got:
                await pool.release(d)
            return sizes, cursors, seen, urls

    sizes, cursors, seen, urls = aio(go())
    assert sizes == [(320 + 16 * i, 240) for i in range(4)]
    assert cursors == [(10 + i, 20 + i) for i in range(4)]
    for d, s in zip(desks, seen, strict=True):
        assert s["output"].startswith(f"{d.display}\n")
    assert len({d.display for d in desks}) == 4
    assert len(urls) == 4 and all(u.startswith("http://127.0.0.1:") for u in urls)
    for d in desks:  # stopped: processes gone
        assert d.url is None and not d.alive()


def test_server_killed_mid_episode_ends_it_and_provider_recreates(xserver, aio):
    desk = LocalDesktop(640, 480)
    pool = DesktopPool([desk])

    async def go():
        async with pool, VMEnv(pool) as env:
            await env.reset(MKDIR)
            old_url, old_pid = desk.url, desk.server_pid
            os.kill(old_pid, signal.SIGKILL)
            res = await env.step(Click(240, 160))  # must not raise
            after = await env.step(TypeText("ls\n"))
            with pytest.raises(EnvError, match="faulted in this episode"):
                await env.evaluate()  # an infrastructure fault, never a 0-score failure
            score = env.last_eval.score
            # The next episode: the pool recreates the desktop and the task runs normally.
            await env.reset(MKDIR)
            for a in MKDIR.oracle:
                await env.step(a)
            score2 = await env.evaluate()
            return res, after, score, score2, old_url, old_pid, pool.report()

    res, after, score, score2, old_url, old_pid, report = aio(go())
    assert res.done and res.info[INFO_DONE_REASON] == "error"
    assert old_url in res.info[INFO_ERROR]  # names the VM
    assert after.done and after.info[INFO_DONE_REASON] == "error"
    assert score == 0.0 and score2 == 1.0
    assert list(report["faults"].values()) == [1] and report["retired"] == {}
    assert desk.restarts == 1  # recreated once after the fault; the next reset found it fresh
    assert desk.url is None  # pool stopped


def test_dead_endpoint_is_retired_and_reported(xserver, aio):
    desk = LocalDesktop(320, 240)
    dead = Remote(["http://127.0.0.1:9"], ready_timeout=0.3, retries=0)[0]

    async def go():
        pool = DesktopPool([dead, desk])
        async with pool:  # the dead one fails to start and is retired; the live one works
            d = await pool.acquire()
            assert d is desk
            await pool.release(d)
            return pool.report()

    report = aio(go())
    assert list(report["retired"]) == ["http://127.0.0.1:9"]
    assert "http://127.0.0.1:9" in report["retired"]["http://127.0.0.1:9"]
    assert report["live"] == 1

    async def all_dead():
        pool = DesktopPool(Remote(["http://127.0.0.1:9"], ready_timeout=0.3, retries=0))
        await pool.start()

    with pytest.raises(PoolExhaustedError):
        aio(all_dead())


def test_reset_recreates_desktop_from_template_home(xserver, aio, tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("original\n")
    task = Task(
        id="t/template",
        instruction="edit keep.txt",
        source="desktop",
        spec={
            "id": "template",
            "instruction": "edit keep.txt",
            "config": [],
            "evaluator": {
                "func": "exact_match",
                "result": {"type": "vm_command_line", "command": ["cat", "~/notes/keep.txt"]},
                "expected": {"type": "rule", "rules": {"expected": "original\n"}},
            },
        },
    )

    async def go():
        async with LocalDesktop(320, 240, template_home=tmp_path) as desk:
            env = VMEnv(desk)
            await env.reset(task)
            s_before = await env.evaluate()
            await desk.client.execute("echo changed > ~/notes/keep.txt", shell=True)
            s_changed = await env.evaluate()
            pid = desk.server_pid
            await env.reset(task)  # kill + recreate from the template
            return s_before, s_changed, await env.evaluate(), pid != desk.server_pid

    assert aio(go()) == (1.0, 0.0, 1.0, True)
    assert (tmp_path / "notes" / "keep.txt").read_text() == "original\n"  # template untouched


def test_remote_endpoints_take_the_token_from_the_environment(monkeypatch):
    """env.vm_token empty: remote endpoints use $CUA_VM_TOKEN (kept out of argv and config.json);
    a given token wins; local desktops make up their own."""
    from envs.vm import make_env_pool

    monkeypatch.setenv("CUA_VM_TOKEN", "from-the-environment-0123")
    url = "http://127.0.0.1:9"
    (remote,) = make_env_pool(1, endpoints=[url]).desktops.desktops
    assert remote.client.token == "from-the-environment-0123"
    (remote,) = make_env_pool(1, endpoints=[url], token="given-token-0123456").desktops.desktops
    assert remote.client.token == "given-token-0123456"
    (local,) = make_env_pool(1, max_processes=64, cpus=0.5, command_cpu_s=2).desktops.desktops
    assert local.token != "from-the-environment-0123" and len(local.token) >= 16
    assert (local.max_processes, local.cpus, local.command_cpu_s) == (64, 0.5, 2)
    monkeypatch.delenv("CUA_VM_TOKEN")
    (remote,) = make_env_pool(1, endpoints=[url]).desktops.desktops
    assert remote.client.token is None


def test_compose_passes_the_desktop_limits_to_each_local_desktop():
    """launch/compose.py's env factory for env.kind="vm" hands env.desktop_memory_mb,
    desktop_max_processes, desktop_cpus and desktop_command_cpu_s to every LocalDesktop it
    builds (building starts no desktop); their 0 is no cap (None), max_processes' default 4096."""
    from configs.qwen3vl_grpo import get_config
    from launch import compose

    c = get_config("smoke")
    c.env.kind, c.env.concurrency = "vm", 2
    pool = compose.build_env_factory(c)[0]()
    for d in pool.desktops.desktops:
        assert isinstance(d, LocalDesktop)
        assert (d.memory_mb, d.max_processes, d.cpus, d.command_cpu_s) == (None, 4096, None, None)
    c.env.desktop_memory_mb = 2048
    c.env.desktop_max_processes = 64
    c.env.desktop_cpus = 0.5
    c.env.desktop_command_cpu_s = 30
    desks = compose.build_env_factory(c)[0]().desktops.desktops
    assert len(desks) == 2 and all(d.server_pid is None for d in desks)  # nothing started
    for d in desks:
        assert (d.memory_mb, d.max_processes, d.cpus, d.command_cpu_s) == (2048, 64, 0.5, 30)


def test_make_env_pool_local_and_remote_endpoints(xserver, aio, monkeypatch):
    """The pool launch/tpu.py builds: local desktops, and a server reached as a remote endpoint
    (a LocalDesktop's server stands in for an OSWorld VM) with its token from $CUA_VM_TOKEN."""
    from envs.vm import make_env_pool

    async def episode(pool) -> float:
        async with pool.acquire() as env:
            await env.reset(MKDIR)
            for a in MKDIR.oracle:
                await env.step(a)
            return await env.evaluate()

    async def go():
        async with make_env_pool(2, screen=(640, 480)) as pool:
            assert len(pool) == 2
            local = await asyncio.gather(episode(pool), episode(pool))
        async with LocalDesktop(640, 480, token="tok-0123456789abcdef") as vm:
            monkeypatch.setenv("CUA_VM_TOKEN", "tok-0123456789abcdef")
            async with make_env_pool(4, endpoints=[vm.url]) as pool:
                assert len(pool) == 1
                remote = await episode(pool)
                report = pool.report()
        return local, remote, report

    local, remote, report = aio(go())
    assert local == [1.0, 1.0] and remote == 1.0
    assert report["retired"] == {} and sum(report["episodes"].values()) == 1


_SIGTERMED_JOB = """
import asyncio, sys
from launch.process import stop_cleanly_on_sigterm
from envs.vm.providers import LocalDesktop

async def job():
    async with LocalDesktop(320, 240) as d:
        print(d._xvfb.pid, d.server_pid, flush=True)
        await asyncio.sleep(600)  # a long run

stop_cleanly_on_sigterm()
asyncio.run(job())
"""


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_a_sigtermed_job_stops_its_desktops(xserver, sigint):
    """launch/tpu.py's SIGTERM handling: the run is cancelled like Ctrl-C, so its env pool's
    `async with` stops the desktop's processes instead of leaving them running; also when the
    job inherited SIGINT ignored (a background job of a script, `nohup ... &`)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    ignore = signal.SIG_IGN if sigint == "ignored" else signal.default_int_handler
    proc = subprocess.Popen(
        [sys.executable, "-c", _SIGTERMED_JOB],
        cwd=root,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, ignore),
    )
    pids = [int(p) for p in proc.stdout.readline().split()]
    try:
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) != 0  # interrupted, not a clean finish
        assert not any(_alive(p) for p in pids)
    finally:  # a failed check leaves nothing running either
        proc.kill()
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is gone
    except FileNotFoundError:
        return False


def test_osworld_home_paths_are_each_desktops_own_home(xserver, aio):
    """OSWorld's tasks write /home/user/...: each LocalDesktop's processes see their own fresh
    home there (a private mount namespace), the host's /home is untouched, and home_alias=None
    keeps $HOME at the desktop's own directory."""
    host_home = sorted(os.listdir("/home"))

    async def go():
        async with (
            LocalDesktop(320, 240, window_manager=None) as a,
            LocalDesktop(320, 240, window_manager=None) as b,
            LocalDesktop(320, 240, window_manager=None, home_alias=None) as plain,
        ):
            if not (a.home_alias_active and b.home_alias_active):
                pytest.skip("this machine allows no mount namespace (unshare)")
            for d, word in ((a, "a"), (b, "b")):
                await d.client.execute(f"echo {word} > /home/user/Desktop/mark", shell=True)
            seen = [
                (await d.client.execute("cat /home/user/Desktop/mark; echo $HOME", shell=True))[
                    "output"
                ]
                for d in (a, b)
            ]
            files = [(d.home / "Desktop" / "mark").read_text() for d in (a, b)]
            via_file_api = await a.client.download("/home/user/Desktop/mark")
            home = (await plain.client.execute("echo $HOME", shell=True))["output"].strip()
            return seen, files, via_file_api, home, str(plain.home)

    seen, files, via_file_api, home, plain_home = aio(go())
    assert seen == ["a\n/home/user\n", "b\n/home/user\n"] and files == ["a\n", "b\n"]
    assert via_file_api == b"a\n"
    assert home == plain_home and sorted(os.listdir("/home")) == host_home
