"""QemuDesktop on a real QEMU guest: the Debian image ``tools/build_vm_image.sh`` builds (Xvfb,
openbox, xterm and our VM server on guest port 5000), booted through ``make_env_pool`` as in
``test_vm_qemu.py``, runs a desktop task's API oracle twice, the second time after ``loadvm``.

The image takes minutes to build (as root), so this test needs it named::

    sudo tools/build_vm_image.sh ~/.cache/cua_jax/vm/debian.qcow2     # or: make vm-image
    CUA_QEMU_IMAGE=~/.cache/cua_jax/vm/debian.qcow2 pytest tests/envs/vm/test_vm_qemu_real.py

and is skipped without ``$CUA_QEMU_IMAGE``. The guest's token: ``$CUA_QEMU_TOKEN``, else
``IMAGE.token`` (the build script writes it). ``$CUA_QEMU_ACCEL``: "auto" (default: KVM when
usable, else TCG), "kvm" or "tcg". A TCG boot takes about a minute on a busy 2-core machine.
"""

import os
import time
from pathlib import Path

import pytest

from cua_jax import actions as A
from envs.vm import make_env_pool, osworld
from envs.vm.env import VMEnv, task_from_osworld
from envs.vm.qemu import QemuDesktop, kvm_usable


def _image() -> Path:
    path = os.environ.get("CUA_QEMU_IMAGE")
    if not path:
        pytest.skip(
            "set CUA_QEMU_IMAGE to a guest image built by tools/build_vm_image.sh "
            "(`make vm-image` builds ~/.cache/cua_jax/vm/debian.qcow2; a few minutes, as root)"
        )
    image = Path(path).expanduser()
    if not image.is_file():
        pytest.fail(f"CUA_QEMU_IMAGE={path}: no such file (build it: make vm-image)")
    return image


def _token(image: Path) -> str:
    token = os.environ.get("CUA_QEMU_TOKEN")
    if token:
        return token
    f = Path(str(image) + ".token")
    if not f.is_file():
        pytest.fail(f"no token: set CUA_QEMU_TOKEN or put the guest's token in {f}")
    return f.read_text().strip()


def test_kvm_usable_needs_hardware_virtualization(tmp_path):
    """/dev/kvm without VMX/SVM (PVM, a software nested hypervisor) is not usable: a stock
    guest kernel does not boot on it in useful time, TCG does."""
    dev = tmp_path / "kvm"
    dev.write_text("")
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu vme sse2 hypervisor\n")
    assert not kvm_usable(str(dev), str(cpuinfo))
    for flag in ("svm", "vmx"):
        cpuinfo.write_text(f"processor\t: 0\nflags\t\t: fpu {flag} sse2\n")
        assert kvm_usable(str(dev), str(cpuinfo))
        assert not kvm_usable(str(tmp_path / "no-kvm"), str(cpuinfo))
    cpuinfo.write_text("processor\t: 0\nFeatures\t: fp asimd\n")  # no x86 flags line
    assert kvm_usable(str(dev), str(cpuinfo))


def test_episodes_on_a_real_qemu_guest(aio):
    image = _image()
    token = _token(image)
    accel = os.environ.get("CUA_QEMU_ACCEL", "auto")
    task = task_from_osworld(
        {t.id: t for t in osworld.load_builtin()}["terminal-mkdir"], "desktop", ("run_shell",)
    )
    timings: dict[str, float] = {}

    async def episode(pool, n):
        async with pool.acquire() as env:
            assert isinstance(env, VMEnv)
            t0 = time.perf_counter()
            obs = await env.reset(task)  # episode 2: loadvm, then the task's setup steps
            timings[f"reset {n}"] = time.perf_counter() - t0
            before = await env.client.execute("ls -A ~", shell=True)
            # OSWorld's pyautogui action command runs in the guest (the image's pyautogui)
            moved = await env.client.pyautogui(f"pyautogui.moveTo({100 + n}, {200 + n})")
            assert moved["returncode"] == 0, moved
            assert await env.client.cursor_position() == (100 + n, 200 + n)
            for a in task.oracle:
                await env.step(a)
            return obs.screenshot.shape, before["output"].split(), await env.evaluate()

    async def go():
        pool = make_env_pool(
            1,
            token=token,
            qemu_image=str(image),
            qemu_options=dict(accel=accel, memory_mb=1024, cpus=1, boot_timeout=420),
        )
        desktop = pool.desktops.desktops[0]
        assert isinstance(desktop, QemuDesktop)
        t0 = time.perf_counter()
        async with pool:
            timings["boot + savevm"] = time.perf_counter() - t0
            workdir = Path(desktop.monitor).parent
            first = await episode(pool, 1)
            second = await episode(pool, 2)
            metrics = pool.metrics()
        return first, second, metrics, desktop, workdir

    first, second, metrics, desktop, workdir = aio(go(), timeout=600)
    print(f"\n{desktop.accel}: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
    # the guest's Xvfb screen; episode 2 starts from the booted snapshot, not from episode 1's
    # desktop: the directory episode 1 made is gone
    assert first[0] == second[0] == (720, 1280, 3)
    assert "projects" not in first[1] and "projects" not in second[1]
    assert first[2] == second[2] == 1.0 and isinstance(task.oracle[0], A.RunShell)
    assert metrics == {"env_hosts": 1.0, "env_hosts_down": 0.0, "env_resets": 1.0}
    assert desktop.restarts == 1  # one snapshot revert, no fresh boot
    assert not desktop.alive() and not workdir.exists()
