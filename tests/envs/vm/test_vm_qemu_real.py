"""QemuDesktop on a real QEMU guest: the Debian image ``tools/build_vm_image.sh`` builds (Xvfb,
openbox, xterm and our VM server on guest port 5000), booted through ``make_env_pool`` as in
``test_vm_qemu.py``, runs a desktop task's API oracle twice, the second time after ``loadvm``;
the guest meets OSWorld's assumptions (a home with Desktop/, Documents/, Downloads/ owned by
"user"; ``echo <password> | sudo -S`` gives root, a wrong password does not; xterm).

With the office image (``make vm-image APPS=office``) named by ``$CUA_QEMU_OFFICE_IMAGE``,
OSWorld's Calc task ``01b269ae`` runs end to end in the guest's LibreOffice, scored by
desktop-env's ``compare_table`` (the case, its offline cache and its episode are
``test_vm_osworld_office.py``'s), twice: on the booted guest, then after ``loadvm``. It prints
the boot, reset and evaluate times (BENCHMARKS)::

    CUA_QEMU_OFFICE_IMAGE=~/.cache/cua_jax/vm/debian-office.qcow2 \
        pytest -s tests/envs/vm/test_vm_qemu_real.py -k calc

The image takes minutes to build (as root), so this test needs it named::

    sudo tools/build_vm_image.sh ~/.cache/cua_jax/vm/debian.qcow2     # or: make vm-image
    CUA_QEMU_IMAGE=~/.cache/cua_jax/vm/debian.qcow2 pytest tests/envs/vm/test_vm_qemu_real.py

and is skipped without ``$CUA_QEMU_IMAGE``. The guest's token: ``$CUA_QEMU_TOKEN``, else
``IMAGE.token`` (the build script writes it). ``$CUA_QEMU_ACCEL``: "auto" (default: KVM when
usable, else TCG), "kvm" or "tcg"; ``$CUA_QEMU_PASSWORD``: the image's ``--password`` (default
OSWorld's "password"). A TCG boot takes 1-4 minutes on a 2-core machine (more, the busier).
"""

import os
import time
from pathlib import Path

import pytest

from cua_jax import actions as A
from envs.vm import make_env_pool, osworld
from envs.vm.env import VMEnv, task_from_osworld
from envs.vm.osworld_setup import DEFAULT_CLIENT_PASSWORD
from envs.vm.qemu import QemuDesktop, kvm_usable

PASSWORD = os.environ.get("CUA_QEMU_PASSWORD", DEFAULT_CLIENT_PASSWORD)


def _image(var: str = "CUA_QEMU_IMAGE", make: str = "make vm-image") -> Path:
    path = os.environ.get(var)
    if not path:
        pytest.skip(
            f"set {var} to a guest image built by tools/build_vm_image.sh "
            f"(`{make}` builds it under ~/.cache/cua_jax/vm/; minutes, as root)"
        )
    image = Path(path).expanduser()
    if not image.is_file():
        pytest.fail(f"{var}={path}: no such file (build it: {make})")
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


async def _check_osworld_assumptions(client) -> None:
    """What OSWorld's tasks take for granted in the guest (its setup steps run
    ``echo {CLIENT_PASSWORD} | sudo -S ...`` and write to ~/Desktop, ~/Downloads)."""

    async def sh(cmd: str) -> dict:
        return await client.execute(cmd, shell=True, timeout=60)

    home = await sh('echo "$HOME"; stat -c "%n %U %F" ~/Desktop ~/Documents ~/Downloads')
    assert home["returncode"] == 0, home
    assert home["output"].split("\n")[:4] == [
        "/home/user",
        *(f"/home/user/{d} user directory" for d in ("Desktop", "Documents", "Downloads")),
    ], home
    root = await sh(f"echo {PASSWORD} | sudo -S id -un")
    assert root["returncode"] == 0 and root["output"].strip().endswith("root"), root
    made = await sh(f"echo {PASSWORD} | sudo -S mkdir ~/Desktop/todo_list_Jan_1 && ls ~/Desktop")
    assert made["returncode"] == 0 and "todo_list_Jan_1" in made["output"], made
    wrong = await sh("echo not-the-password | sudo -S true")
    assert wrong["returncode"] != 0, wrong
    term = await sh("command -v xterm && id -un")
    assert term["output"].split() == ["/usr/bin/xterm", "user"], term


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
            if n == 1:
                await _check_osworld_assumptions(env.client)
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
            qemu_options=dict(accel=accel, memory_mb=1024, cpus=1, boot_timeout=900),
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

    first, second, metrics, desktop, workdir = aio(go(), timeout=1200)
    print(f"\n{desktop.accel}: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
    # the guest's Xvfb screen; episode 2 starts from the booted snapshot, not from episode 1's
    # desktop: the directory episode 1 made is gone
    assert first[0] == second[0] == (720, 1280, 3)
    assert "projects" not in first[1] and "projects" not in second[1]
    # both episodes start in OSWorld's home (Desktop/, Documents/, Downloads/) and nothing else
    assert {"Desktop", "Documents", "Downloads"} <= set(second[1]) == set(first[1])
    assert first[2] == second[2] == 1.0 and isinstance(task.oracle[0], A.RunShell)
    assert metrics == {"env_hosts": 1.0, "env_hosts_down": 0.0, "env_resets": 1.0}
    assert desktop.restarts == 1  # one snapshot revert, no fresh boot
    assert not desktop.alive() and not workdir.exists()


def test_osworld_calc_task_on_the_office_image(aio, tmp_path):
    """OSWorld's Calc task 01b269ae in the office image's LibreOffice: 0 before the typed
    solution, 1 after (compare_table on the file Calc saved), on the booted guest and again
    after loadvm; prints the boot, reset and evaluate times."""
    image = _image("CUA_QEMU_OFFICE_IMAGE", "make vm-image APPS=office")
    from tests.envs.vm import test_vm_osworld_office as office

    if office.desktop_env.unavailable():
        pytest.skip(str(office.desktop_env.unavailable()))
    case = office.CASES["calc_01b269ae"]
    # OSWorld's postconfig sleeps 0.5 s after ctrl+s, enough on its VMs; the TCG guest's Calc
    # takes longer to write the file, and the evaluation then read the unsaved one (compare_table
    # 0 on a file that, downloaded a few seconds later, was right). The desktop's sleep_scale
    # (TCG_SLEEP_SCALE under TCG) stretches every sleep step; $CUA_QEMU_SLEEP_SCALE overrides it.
    scale = os.environ.get("CUA_QEMU_SLEEP_SCALE")
    desk = QemuDesktop(
        image,
        _token(image),
        accel=os.environ.get("CUA_QEMU_ACCEL", "auto"),
        memory_mb=2048,
        cpus=int(os.environ.get("CUA_QEMU_CPUS", "1")),
        boot_timeout=600,
        client_password=PASSWORD,
        sleep_scale=float(scale) if scale else None,
    )

    async def go() -> tuple[float, list[dict]]:
        t0 = time.perf_counter()
        await desk.start()
        boot_s = time.perf_counter() - t0
        try:
            runs = []
            for i in range(2):  # the booted guest, then loadvm back to it
                cache = office._cache(tmp_path / f"cache{i}", case.raw, case.files())
                runs.append(await office.play(desk, case, cache))
            return boot_s, runs
        finally:
            await desk.stop()

    boot_s, runs = aio(go(), timeout=1500)
    print(
        f"\n{desk.accel}, {desk.cpus} vCPU, {desk.memory_mb} MiB, sleeps x{desk.sleep_scale:g}: "
        f"boot + savevm {boot_s:.1f} s"
    )
    for i, r in enumerate(runs):
        print(
            f"episode {i + 1}{' (after loadvm)' if i else ''}: scores {r['before']:g} -> "
            f"{r['after']:g}; reset {r['reset_s']:.1f} s (settle {r['settle_s']:.1f} s), "
            f"evaluate {r['eval_before_s']:.1f} s then {r['eval_after_s']:.1f} s, "
            f"{len(r['step_s'])} actions {sum(r['step_s']):.1f} s, "
            f"redrawn after reset {r['redrawn_share']:.3f}"
        )
        print(f"  {r['details']}; saved {case.read(r['saved'])}")
    assert desk.restarts == 1  # one loadvm, no second boot
    for r in runs:
        # the open step started Calc on the file (trixie's LibreOffice 25 titles it with an em
        # dash, which the server's activate_window takes for OSWorld's " - ")
        titles = r["windows"].replace(" \u2014 ", " - ")
        assert case.window in titles, r["windows"]
        assert (r["before"], r["after"]) == (0.0, 1.0), r["details"]
        assert case.read(r["saved"]) == case.solved()  # Calc saved what was typed
