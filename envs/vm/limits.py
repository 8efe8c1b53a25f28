"""Per-desktop process and CPU limits: a cgroup where the machine lets us make one, else rlimits.

    limits = DesktopLimits("cua-desktop-1", max_processes=4096, cpus=1.0)
    limits.create()                       # the cgroup, if this machine allows one (limits.mode)
    subprocess.Popen(cmd, preexec_fn=limits.preexec(memory_mb=2048))  # every desktop process
    limits.kill_all(); limits.remove()    # at stop: nothing the desktop started outlives it

Why: a task's setup or a model's action runs shell commands as the trainer's user. A fork bomb
or a busy loop left behind in one desktop must not take the machine (the trainer, the other
desktops) with it.

- ``max_processes``: the most tasks (processes and threads) the desktop may hold. A cgroup's
  ``pids.max`` where one can be made (cgroup v2 with a writable, delegated subtree, or v1's
  ``pids`` hierarchy); else ``RLIMIT_NPROC`` set to the user's current count plus the budget,
  which the kernel ignores for root (``mode`` then says "none" for processes, and a warning is
  logged once).
- ``cpus``: a CPU quota (``cpu.max`` / ``cpu.cfs_quota_us``), only with a cgroup; without one
  the desktop's processes run at nice 10 so the trainer keeps its cores.
- Everything in the cgroup is killed at ``kill_all``, including processes that left the
  desktop's process groups (``setsid``, ``nohup ... &``), which ``killpg`` never reaches.

The VM server's own per-command CPU-seconds cap (``python -m envs.vm.server --command-cpu-s``)
works everywhere, a cgroup or not (``RLIMIT_CPU`` on each command it starts).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from absl import logging

CGROUP_ROOT = Path("/sys/fs/cgroup")
CFS_PERIOD_US = 100_000
_warned: set[str] = set()


def warn_once(msg: str) -> None:
    """Logs `msg` once a process (a condition every desktop of the machine shares)."""
    if msg not in _warned:
        _warned.add(msg)
        logging.warning("%s", msg)


def _own_cgroup(controller: str | None) -> str | None:
    """This process's cgroup path in the v1 hierarchy of ``controller`` (None: the v2 one)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, ctrls, path = line.split(":", 2)
        if (controller is None and ctrls == "") or (
            controller is not None and controller in ctrls.split(",")
        ):
            return path
    return None


def _user_tasks(uid: int) -> int:
    """How many tasks (threads) processes of ``uid`` hold now (RLIMIT_NPROC counts these)."""
    n = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            st = d.stat()
            if st.st_uid == uid:
                n += sum(1 for _ in (d / "task").iterdir())
        except OSError:
            continue
    return n


class DesktopLimits:
    """The limits of one desktop's processes (module docstring)."""

    def __init__(self, name: str, *, max_processes: int | None, cpus: float | None) -> None:
        if max_processes is not None and max_processes < 16:
            raise ValueError(
                f"max_processes must be >= 16 (a desktop needs a few), got {max_processes}"
            )
        if cpus is not None and not cpus > 0:
            raise ValueError(f"cpus must be > 0 (a share of CPU cores), got {cpus}")
        self.name, self.max_processes, self.cpus = name, max_processes, cpus
        self.dirs: list[Path] = []  # the cgroup directories the desktop's processes join
        self.mode = "none"  # "cgroup v2" | "cgroup v1" | "rlimit" | "none"
        self._nproc: int | None = None

    # ---- set-up ---------------------------------------------------------------------------

    def create(self) -> str:
        """Makes the cgroup (or settles for rlimits); returns ``mode``."""
        if self.max_processes is None and self.cpus is None:
            return self.mode
        if self._create_v2() or self._create_v1():
            return self.mode
        if self.max_processes is not None and os.getuid() != 0:
            self._nproc = _user_tasks(os.getuid()) + self.max_processes
            self.mode = "rlimit"
        else:
            warn_once(
                "desktop limits: no writable cgroup on this machine and RLIMIT_NPROC does not "
                "bind root: the desktops' process count is not capped (run as a user, or give "
                "the trainer a delegated cgroup)"
                if self.max_processes is not None
                else "desktop limits: no writable cgroup: cpus is not enforced (nice 10 only)"
            )
        return self.mode

    def _create_v2(self) -> bool:
        if not (CGROUP_ROOT / "cgroup.controllers").exists():
            return False
        own = _own_cgroup(None)
        if own is None:
            return False
        parent = CGROUP_ROOT / own.lstrip("/")
        d = parent / self.name
        try:
            d.mkdir()
        except OSError:
            return False
        try:
            have = set((d / "cgroup.controllers").read_text().split())
            need = {"pids"} if self.max_processes is not None else set()
            need |= {"cpu"} if self.cpus is not None else set()
            if not need <= have:
                (parent / "cgroup.subtree_control").write_text(
                    " ".join(f"+{c}" for c in sorted(need))
                )
            self._write_limits(d, d, v2=True)
        except OSError:
            d.rmdir()
            return False
        self.dirs, self.mode = [d], "cgroup v2"
        return True

    def _create_v1(self) -> bool:
        made: list[Path] = []
        try:
            pids = cpu = None
            if self.max_processes is not None:
                pids = self._v1_dir("pids")
                made.append(pids)
            if self.cpus is not None:
                cpu = self._v1_dir("cpu")
                made.append(cpu)
            self._write_limits(pids, cpu, v2=False)
        except OSError:
            for d in made:
                try:
                    d.rmdir()
                except OSError:
                    pass
            return False
        self.dirs, self.mode = made, "cgroup v1"
        return True

    def _v1_dir(self, controller: str) -> Path:
        own = _own_cgroup(controller)
        base = CGROUP_ROOT / controller
        if own is None or not base.is_dir():
            raise OSError(f"no v1 {controller} hierarchy")
        d = base / own.lstrip("/") / self.name
        d.mkdir()
        return d

    def _write_limits(self, pids: Path | None, cpu: Path | None, *, v2: bool) -> None:
        if self.max_processes is not None and pids is not None:
            (pids / "pids.max").write_text(str(int(self.max_processes)))
        if self.cpus is not None and cpu is not None:
            quota = max(1000, int(self.cpus * CFS_PERIOD_US))
            if v2:
                (cpu / "cpu.max").write_text(f"{quota} {CFS_PERIOD_US}")
            else:
                (cpu / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
                (cpu / "cpu.cfs_quota_us").write_text(str(quota))

    def preexec(self, *, memory_mb: int | None = None) -> Callable[[], None] | None:
        """A ``preexec_fn`` putting the child in the desktop's cgroup (or under its rlimits),
        with ``memory_mb`` as its address-space cap; None when there is nothing to apply."""
        dirs, nproc, nice = list(self.dirs), self._nproc, self.cpus is not None and not self.dirs
        if not (dirs or nproc or nice or memory_mb):
            return None
        import resource  # noqa: PLC0415 -- POSIX only, as preexec_fn itself

        def apply() -> None:
            for d in dirs:  # joined before exec: every descendant is born inside
                with open(d / "cgroup.procs", "w") as f:
                    f.write(str(os.getpid()))
            if nproc:
                resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
            if nice:
                os.nice(10)
            if memory_mb:
                n = int(memory_mb) * 1024 * 1024
                resource.setrlimit(resource.RLIMIT_AS, (n, n))

        return apply

    # ---- tear-down ------------------------------------------------------------------------

    def pids(self) -> list[int]:
        """The processes in the desktop's cgroup now (empty without one)."""
        out: set[int] = set()
        for d in self.dirs:
            try:
                out |= {int(p) for p in (d / "cgroup.procs").read_text().split()}
            except (OSError, ValueError):
                continue
        return sorted(out)

    def kill_all(self, timeout: float = 5.0) -> int:
        """SIGKILLs everything in the cgroup until it is empty (a fork bomb forks between
        reads: the loop outlasts it, pids.max bounds it); returns how many were killed."""
        if not self.dirs:
            return 0
        killed: set[int] = set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)
        return len(killed)

    def remove(self) -> None:
        """Kills what is left and removes the cgroup directories."""
        self.kill_all()
        for d in self.dirs:
            for _ in range(50):  # a killed task leaves the cgroup once it is reaped
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)
            else:
                logging.warning("desktop limits: could not remove cgroup %s", d)
        self.dirs = []
