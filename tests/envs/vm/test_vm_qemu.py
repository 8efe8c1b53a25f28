"""QemuDesktop's code paths against a stand-in QEMU (`fake_qemu.py`: the same command line,
monitor socket and port forward; the "guest" is Xvfb + openbox + our VM server). No real guest
image is booted here: this machine has no OSWorld image."""

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from cua_jax import actions as A
from envs.vm import make_env_pool, osworld
from envs.vm.client import VMError
from envs.vm.env import VMEnv, task_from_osworld
from envs.vm.qemu import SNAPSHOT, QemuDesktop

FAKE = str(Path(__file__).with_name("fake_qemu.py"))
FAKE_ARGS = {"qemu": (sys.executable, FAKE, "system"), "qemu_img": (sys.executable, FAKE, "img")}


TOKEN = "qemu-test-token"


@pytest.fixture
def image(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_QEMU_TOKEN", TOKEN)  # the stand-in guest server's token
    p = tmp_path / "Ubuntu.qcow2"
    p.write_text("the base image\n")
    return p


def test_boot_snapshot_reset_and_recover(xserver, aio, image):
    async def go():
        d = QemuDesktop(image, TOKEN, accel="tcg", boot_timeout=60, **FAKE_ARGS)
        await d.start()
        try:
            overlay = Path(d.monitor).with_name("overlay.qcow2")
            cmdline = d.command(overlay, d.port, d.monitor)
            seen = (await d.client.execute("cat ~/image.txt", shell=True))["output"]
            await d.reset()  # the first episode: the guest as booted, nothing to revert
            await d.client.execute("touch ~/dirty", shell=True)
            await d.reset()  # the next: back to the snapshot
            after = (await d.client.execute("ls ~", shell=True))["output"].split()
            log = Path(str(overlay) + ".monitor.log").read_text().splitlines()
            reverts = d.restarts
            os.kill(d._proc.pid, signal.SIGTERM)  # QEMU exits: the guest is gone
            await asyncio.to_thread(d._proc.wait)
            await d.reset()  # a dead guest is booted again from a fresh overlay
            fresh = (await d.client.execute("ls ~", shell=True))["output"].split()
            return seen, after, log, reverts, d.restarts, fresh, cmdline
        finally:
            workdir = Path(d.monitor).parent
            await d.stop()
            assert not workdir.exists()

    seen, after, log, reverts, restarts, fresh, cmdline = aio(go())
    assert seen == "the base image\n" and image.read_text() == "the base image\n"
    # the home as booted (with the Desktop/, Documents/, Downloads/ OSWorld's tasks assume),
    # without the episode's "dirty" file
    home = ["Desktop", "Documents", "Downloads", "image.txt"]
    assert sorted(after) == home and sorted(fresh) == home
    assert log == [f"savevm {SNAPSHOT}", f"loadvm {SNAPSHOT}"] and reverts == 1
    assert restarts == 2
    assert "-enable-kvm" not in cmdline and "q35,accel=tcg" in cmdline


def test_a_guest_that_fails_to_boot_names_qemus_error(xserver, aio, image, tmp_path):
    d = QemuDesktop(image, accel="tcg", boot_timeout=30, extra_args=("-fail-boot",), **FAKE_ARGS)
    with pytest.raises(VMError, match="QEMU exited while booting.*the machine could not start"):
        aio(d.start())
    with pytest.raises(ValueError, match="is not a file"):
        QemuDesktop(tmp_path / "missing.qcow2")
    with pytest.raises(ValueError, match="accel='xen'"):
        QemuDesktop(image, accel="xen")


def test_episodes_on_a_qemu_pool_from_config_keys(xserver, aio, image):
    """make_env_pool(qemu_image=...) (env.vm_qemu_image): a desktop task's API oracle solves it
    on the guest, and the next episode starts from the snapshot."""
    task = task_from_osworld(
        {t.id: t for t in osworld.load_builtin()}["terminal-mkdir"], "desktop", ("run_shell",)
    )

    async def episode(pool):
        async with pool.acquire() as env:
            assert isinstance(env, VMEnv)
            await env.reset(task)
            for a in task.oracle:
                await env.step(a)
            return await env.evaluate()

    async def go():
        pool = make_env_pool(
            1, token=TOKEN, qemu_image=str(image), qemu_options=dict(accel="tcg", **FAKE_ARGS)
        )
        async with pool:
            scores = [await episode(pool), await episode(pool)]
            return scores, pool.metrics()

    scores, metrics = aio(go(), timeout=240)
    assert scores == [1.0, 1.0] and isinstance(task.oracle[0], A.RunShell)
    assert metrics == {"env_hosts": 1.0, "env_hosts_down": 0.0, "env_resets": 1.0}
