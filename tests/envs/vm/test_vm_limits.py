"""Per-desktop limits (envs.vm.limits): a fork bomb and a busy loop stay inside their desktop,
and a second desktop beside it (another episode's) runs its commands as before.

A task's setup or a model's action runs shell commands as the trainer's user. Each test runs the
attack through the desktop's own server (the path an action takes) and then checks the host: the
test process still forks, the bomb got at most its desktop's budget, and nothing the attack left
behind outlives the desktop's reset. The fork bomb is bounded (300 sleeping children at most), so
on a machine where no limit applies it fails the test instead of the machine.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from envs.vm.providers import LocalDesktop

# Forks up to 300 children that sleep 20 s (outputs closed); prints the count and their pids.
BOMB = (
    "import os, time\n"
    "pids = []\n"
    "for _ in range(300):\n"
    "    try:\n"
    "        pid = os.fork()\n"
    "    except OSError:\n"
    "        break\n"
    "    if pid == 0:\n"
    "        os.close(1)\n"  # the reply does not wait for the children
    "        os.close(2)\n"
    "        time.sleep(20)\n"
    "        os._exit(0)\n"
    "    pids.append(pid)\n"
    "print(len(pids), *pids)\n"
)
BUDGET = 64


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().split(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _host_forks() -> bool:
    return subprocess.run(["true"], check=False).returncode == 0


def test_a_fork_bomb_gets_its_desktops_budget_and_dies_with_the_desktop(xserver, aio, tmp_path):
    bomb = tmp_path / "bomb.py"
    bomb.write_text(BOMB)

    async def go():
        async with (
            LocalDesktop(320, 240, window_manager=None, max_processes=BUDGET) as d,
            LocalDesktop(320, 240, window_manager=None, max_processes=BUDGET) as other,
        ):
            if d.limits_mode == "none":
                pytest.skip("no writable cgroup and RLIMIT_NPROC does not bind root here")
            r = await d.client.execute(["python3", str(bomb)], timeout=30)
            n, *pids = (int(x) for x in r["output"].split())
            assert _host_forks()  # the trainer's side forks while the desktop is full
            # another episode's desktop, beside it: forks and answers as before
            neighbour = await other.client.execute("sh -c 'echo neighbour'", shell=True, timeout=10)
            after = await d.client.execute("echo still here", shell=True, timeout=10)
            await d.restart()  # an episode's reset: the bomb's children go with the desktop
            gone = not any(_alive(p) for p in pids)
            again = await d.client.execute("echo fresh", shell=True, timeout=10)
            return d.limits_mode, n, after, gone, again, neighbour

    mode, n, after, gone, again, neighbour = aio(go())
    assert neighbour["output"].strip() == "neighbour", neighbour
    # the server, its worker and Xvfb hold part of the budget; the bomb got the rest, not 300
    assert 0 < n < BUDGET, (mode, n)
    # the full desktop's next command is a bounded failure of this episode (fork refused), or
    # it still ran on a freed slot; either way it answered, the server did not die
    assert after.get("status") in ("success", "error"), after
    assert gone, "the bomb's children outlived the desktop's reset"
    assert again["output"].strip() == "fresh" and _host_forks()


def test_a_busy_loop_is_capped_killed_by_cpu_seconds_and_dies_with_the_desktop(xserver, aio):
    async def go():
        async with (
            LocalDesktop(320, 240, window_manager=None, cpus=0.5, command_cpu_s=1) as d,
            LocalDesktop(320, 240, window_manager=None, cpus=0.5, command_cpu_s=1) as other,
        ):
            # in the foreground: RLIMIT_CPU ends it after ~1 CPU second, not the 120 s limit
            t0 = time.monotonic()
            fg = await d.client.execute(["python3", "-c", "while True: pass"], timeout=60)
            fg_s = time.monotonic() - t0
            # left running in the background (escapes the command's process-group kill)
            r = await d.client.execute(
                "setsid nohup python3 -c 'while True: pass' >/dev/null 2>&1 & echo $!",
                shell=True,
                timeout=10,
            )
            pid = int(r["output"].split()[-1])
            c0, w0 = _cpu_s(pid), time.monotonic()
            time.sleep(1.5)
            share = (_cpu_s(pid) - c0) / (time.monotonic() - w0)
            # another episode's desktop, beside the loop: its command runs to the end
            neighbour = await other.client.execute(
                ["python3", "-c", "print(sum(range(10**5)))"], timeout=30
            )
            assert neighbour["output"].strip() == str(sum(range(10**5))), neighbour
            mode = d.limits_mode
            await d.restart()
            return mode, fg, fg_s, share, _alive(pid)

    mode, fg, fg_s, share, alive = aio(go())
    # SIGXCPU (-24) or the hard limit's SIGKILL (-9): a bounded failure of the command
    assert fg.get("returncode") in (-24, -9, 128 + 24, 128 + 9), fg
    if mode.startswith("cgroup"):  # the quota holds the loop to its share (half a core)
        assert fg_s < 15 and share < 0.65, (fg_s, share)
        assert not alive, "the background busy loop outlived the desktop's reset"
    else:  # no cgroup: only the CPU-seconds cap applies (the loop dies after 1 s of CPU)
        assert fg_s < 15
