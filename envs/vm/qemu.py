"""``QemuDesktop``: a desktop in a QEMU virtual machine booted from a local disk image, such as
OSWorld's ``Ubuntu.qcow2`` (its VM server listens on port 5000 inside the guest).

    pool = DesktopPool([QemuDesktop("/vms/Ubuntu.qcow2") for _ in range(4)])

Each desktop boots from its own copy-on-write overlay of the image (``qemu-img create -b``), so
the image is never written and several desktops share it. QEMU runs headless with user-mode
networking; the guest's port 5000 is forwarded to a free loopback port, and the human monitor
listens on a unix socket. Once the guest's server answers, the booted state is saved as an
internal snapshot of the overlay (``savevm``); ``reset()`` before every episode after the first
goes back to it (``loadvm``: seconds, no reboot), then the task's own setup steps run, as on
OSWorld's VMs. ``recover()`` after a fault boots a fresh overlay. KVM is used when ``/dev/kvm``
is usable and the CPU has VMX/SVM (``kvm_usable``), else TCG (slower: the small Debian guest
of ``tools/build_vm_image.sh`` boots in about a minute on a busy 2-core host; a large desktop
guest takes minutes).

Tested against a stand-in QEMU (``tests/envs/vm/fake_qemu.py``: the same command line, monitor
and port forward, our VM server as the "guest") and against a real guest:
``tools/build_vm_image.sh`` builds a small Debian image running our server, and
``tests/envs/vm/test_vm_qemu_real.py`` (``CUA_QEMU_IMAGE=...``) boots it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from envs.vm.client import VMClient, VMError
from envs.vm.providers import _kill, _reap, qemu_monitor

GUEST_PORT = 5000  # OSWorld's VM server inside the guest
SNAPSHOT = "cua_ready"  # the overlay's internal snapshot of the booted, server-ready guest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvm_usable(dev: str = "/dev/kvm", cpuinfo: str = "/proc/cpuinfo") -> bool:
    """/dev/kvm can be opened and the CPU has hardware virtualization (VMX or SVM).

    Some sandboxes offer /dev/kvm without either: PVM (the ``kvm_pvm`` module, a nested
    hypervisor made of software) runs only guest kernels built for it. A stock guest there
    crawls or stops: Debian's kernel decompressed itself at ~30 KB/s (no boot in 300 s), and
    syslinux died in KVM's instruction emulator ("KVM internal error. Suberror: 1"), so TCG
    boots such a guest far sooner.
    """
    if not os.access(dev, os.R_OK | os.W_OK):
        return False
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line.partition(":")[2].split()
                    return "vmx" in flags or "svm" in flags
    except OSError:
        pass
    return True  # no x86 flags line to go by: trust /dev/kvm


# A TCG guest (no hardware virtualisation) runs several times slower than the KVM guests
# OSWorld's task files are timed on; its `sleep` steps wait this many times longer.
TCG_SLEEP_SCALE = 10.0


class QemuDesktop:
    """One QEMU guest booted from ``image`` (module docstring).

    Args:
      image: the guest's disk image (qcow2; raw works as a backing file too), read-only here.
      token: the guest server's bearer token (OSWorld's own server takes none).
      memory_mb, cpus: the guest's memory and virtual CPUs.
      accel: "kvm", "tcg", or "auto" (KVM when ``kvm_usable()``: /dev/kvm and VMX/SVM).
      qemu, qemu_img: the commands (argv prefixes) of ``qemu-system-x86_64`` and ``qemu-img``.
      boot_timeout: seconds to wait for the guest's server after starting QEMU.
      extra_args: more QEMU arguments (e.g. ``("-vga", "virtio")``).
      client_password: the password the guest user's ``sudo`` takes (``VMEnv`` fills OSWorld's
        ``{CLIENT_PASSWORD}`` with it): "password" in OSWorld's images and in
        ``tools/build_vm_image.sh``'s (its ``--password``).
      sleep_scale: how many times longer a task file's ``sleep`` steps wait on this guest
        (``VMEnv`` hands it to the setup; None: ``TCG_SLEEP_SCALE`` under TCG, else 1).
        OSWorld sizes its sleeps for KVM guests: 0.5 s after ctrl+s, where a TCG guest's Calc
        was still writing the file that compare_table then read (BENCHMARKS.md, "OSWorld-ready
        guest images under TCG").
    """

    def __init__(
        self,
        image: str | Path,
        token: str | None = None,
        *,
        memory_mb: int = 4096,
        cpus: int = 2,
        accel: str = "auto",
        qemu: Sequence[str] = ("qemu-system-x86_64",),
        qemu_img: Sequence[str] = ("qemu-img",),
        boot_timeout: float = 600.0,
        extra_args: Sequence[str] = (),
        name: str | None = None,
        client_password: str = "password",
        sleep_scale: float | None = None,
    ):
        self.image = Path(image).resolve()
        if not self.image.is_file():
            raise ValueError(f"QemuDesktop: the image {str(image)!r} is not a file")
        if accel not in ("auto", "kvm", "tcg"):
            raise ValueError(f"QemuDesktop accel={accel!r}: expected 'auto', 'kvm' or 'tcg'")
        if memory_mb < 256 or cpus < 1:
            raise ValueError(f"QemuDesktop: memory_mb={memory_mb} (>= 256), cpus={cpus} (>= 1)")
        self.token = token
        self.memory_mb, self.cpus = int(memory_mb), int(cpus)
        self.accel = ("kvm" if kvm_usable() else "tcg") if accel == "auto" else accel
        self.qemu, self.qemu_img = list(qemu), list(qemu_img)
        self.boot_timeout = boot_timeout
        self.extra_args = list(extra_args)
        self.client_password = client_password
        if sleep_scale is not None and not 1 <= sleep_scale <= 100:
            raise ValueError(f"QemuDesktop: sleep_scale={sleep_scale} must be in [1, 100]")
        self.sleep_scale = float(
            sleep_scale
            if sleep_scale is not None
            else TCG_SLEEP_SCALE
            if self.accel == "tcg"
            else 1
        )
        self._name = name
        self.port: int | None = None
        self.url: str | None = None
        self.client = VMClient("http://127.0.0.1:1")  # replaced by start()
        self._dir: Path | None = None
        self._proc: subprocess.Popen | None = None
        self._used = False
        self.restarts = 0  # snapshot reverts and fresh boots after the first start

    @property
    def name(self) -> str:
        return self._name or f"qemu:{self.image.name}@{self.port}"

    @property
    def monitor(self) -> str:
        assert self._dir is not None, "not started"
        return str(self._dir / "monitor.sock")

    def __repr__(self) -> str:
        return f"QemuDesktop({str(self.image)!r}, url={self.url!r})"

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self, overlay: Path, port: int, monitor: str) -> list[str]:
        """QEMU's command line for one guest."""
        kvm = self.accel == "kvm"
        options = {  # QEMU's flag -> its value, in this order
            "-machine": f"q35,accel={self.accel}",
            "-cpu": "host" if kvm else "max",
            "-m": str(self.memory_mb),
            "-smp": str(self.cpus),
            "-drive": f"file={overlay},if=virtio,format=qcow2",
            "-netdev": f"user,id=net0,hostfwd=tcp:127.0.0.1:{port}-:{GUEST_PORT}",
            "-device": "virtio-net-pci,netdev=net0",
            "-monitor": f"unix:{monitor},server,nowait",
            "-display": "none",
        }
        return [*self.qemu, *(w for pair in options.items() for w in pair), *self.extra_args]

    async def start(self) -> None:
        """Overlay, boot, wait for the guest's server, save the ready state."""
        self._dir = Path(tempfile.mkdtemp(prefix="cua-qemu-"))
        overlay = self._dir / "overlay.qcow2"
        fmt = "raw" if self.image.suffix in (".img", ".raw") else "qcow2"
        backing = (str(self.image), str(overlay))  # the overlay of the image
        made = await asyncio.to_thread(
            subprocess.run,
            [*self.qemu_img, "create", "-q", "-f", "qcow2", "-F", fmt, "-b", *backing],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if made.returncode != 0:
            await self.stop()
            raise VMError(f"qemu-img could not make an overlay of {self.image}: {made.stderr}")
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        log = open(self._dir / "qemu.log", "wb")  # noqa: SIM115 -- QEMU's, closed by stop()
        try:
            self._proc = subprocess.Popen(
                self.command(overlay, self.port, self.monitor),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()
        self.client = VMClient(self.url, token=self.token)
        try:
            await self._wait_boot()
            await qemu_monitor(self.monitor, f"savevm {SNAPSHOT}", timeout=self.boot_timeout)
        except BaseException:
            await self.stop()
            raise
        self._used = False

    async def _wait_boot(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.boot_timeout
        while loop.time() < deadline:
            if not self.alive():
                raise VMError(f"QEMU exited while booting {self.image}: {self._log_tail()}")
            if await self.client.ping(timeout=5.0):
                return
            await asyncio.sleep(0.5)
        raise VMError(
            f"the guest of {self.image} did not answer on {self.url} (guest port {GUEST_PORT}) "
            f"within {self.boot_timeout:g} s ({self.accel}): {self._log_tail()}"
        )

    def _log_tail(self) -> str:
        try:
            return (self._dir / "qemu.log").read_text(errors="replace")[-500:].strip()  # type: ignore[operator]
        except OSError:
            return "(no QEMU log)"

    async def reset(self) -> None:
        """Back to the saved ready state before every episode after the first."""
        if not self.alive():
            await self.restart()
        elif self._used:
            await qemu_monitor(self.monitor, f"loadvm {SNAPSHOT}", timeout=self.boot_timeout)
            # loadvm also restores user networking's connection table as of the snapshot: a
            # keep-alive connection the client opened since then is dead, and a request on it
            # hangs until its timeout (a real guest: wait_ready's first ping lost 5 s, a POST
            # would fail). Drop the client's pooled connections; the next request opens one.
            await self.client.close()
            await self.client.wait_ready(60.0)
            self.restarts += 1
        self._used = True

    async def restart(self) -> None:
        """A fresh overlay, booted again."""
        await self.stop()
        await self.start()
        self.restarts += 1

    async def recover(self) -> None:
        await self.restart()

    async def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            try:
                await qemu_monitor(self.monitor, "quit", timeout=5.0)
            except VMError:
                pass  # "quit" ends the monitor connection without a prompt; or it is gone
            try:
                await asyncio.to_thread(proc.wait, 10)
            except subprocess.TimeoutExpired:
                _kill(proc, signal.SIGKILL)
        await _reap(proc)
        await self.client.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self.url = None
