"""A stand-in for ``qemu-img`` and ``qemu-system-x86_64`` for the QemuDesktop tests.

    python fake_qemu.py img create -q -f qcow2 -F qcow2 -b IMAGE OVERLAY
    python fake_qemu.py system [QEMU's arguments as QemuDesktop writes them]

``img`` writes the overlay as JSON naming its backing image (which must exist). ``system``
checks the command line the way QEMU would read it (the overlay's backing image, the port
forward to guest port 5000, the monitor socket), then "boots" a guest: a ``LocalDesktop``
(Xvfb, openbox and our VM server; token ``$FAKE_QEMU_TOKEN``) whose home starts with the backing
image's bytes as ``~/image.txt``, and forwards the host port to the guest server, as QEMU's
``hostfwd`` does. Its human monitor on the unix socket answers ``savevm NAME`` (keeps a copy of
the home), ``loadvm NAME`` (recreates the desktop from that copy, as a guest resumed from a
snapshot) and ``quit``; every monitor command is appended to ``OVERLAY.monitor.log``.
``-fail-boot`` makes it exit at once with an error, like a QEMU that cannot start the machine.
SIGTERM shuts the guest down cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from envs.vm.providers import LocalDesktop  # noqa: E402


def img(argv: list[str]) -> int:
    backing, overlay = argv[argv.index("-b") + 1], argv[-1]
    if not Path(backing).is_file():
        print(f"qemu-img: Could not open '{backing}': No such file or directory", file=sys.stderr)
        return 1
    Path(overlay).write_text(json.dumps({"backing": backing, "format": argv[argv.index("-F") + 1]}))
    return 0


def _opt(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def guest(overlay: Path, port: int, monitor_path: str) -> None:
    seed = Path(str(overlay) + ".seed")
    seed.mkdir()
    shutil.copyfile(json.loads(overlay.read_text())["backing"], seed / "image.txt")
    desktop = LocalDesktop(640, 480, template_home=seed, token=os.environ["FAKE_QEMU_TOKEN"])
    await desktop.start()
    log = Path(str(overlay) + ".monitor.log")
    done = asyncio.Event()

    async def forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", int(desktop.url.rsplit(":", 1)[1]))
        await asyncio.gather(_pipe(reader, up_w), _pipe(up_r, writer))

    async def session(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"QEMU 7.2.0 monitor - type 'help' for more information\r\n(qemu) ")
        while not reader.at_eof():
            line = (await reader.readline()).decode().strip()
            if not line:
                continue
            with open(log, "a") as f:
                f.write(line + "\n")
            cmd, _, arg = line.partition(" ")
            reply = ""
            snap = Path(str(overlay) + ".snap-" + arg)
            if cmd == "savevm":
                shutil.rmtree(snap, ignore_errors=True)
                shutil.copytree(desktop.home, snap, symlinks=True)
            elif cmd == "loadvm":
                if not snap.is_dir():
                    reply = f"Error: Snapshot '{arg}' does not exist in device 'virtio0'\r\n"
                else:
                    desktop.template_home = snap
                    await desktop.restart()
            elif cmd == "quit":
                writer.close()
                done.set()
                return
            else:
                reply = f"unknown command: '{cmd}'\r\n"
            writer.write(f"{line}\r\n{reply}(qemu) ".encode())
            await writer.drain()

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, done.set)
    fwd = await asyncio.start_server(forward, "127.0.0.1", port)
    mon = await asyncio.start_unix_server(session, monitor_path)
    try:
        await done.wait()
    finally:
        fwd.close()
        mon.close()
        with contextlib.suppress(Exception):
            await desktop.stop()


def system(argv: list[str]) -> int:
    if "-fail-boot" in argv:
        print("qemu-system-x86_64: -fail-boot: the machine could not start", file=sys.stderr)
        return 1
    overlay = Path(re.search(r"file=([^,]+)", _opt(argv, "-drive")).group(1))
    fwd = re.search(r"hostfwd=tcp:127\.0\.0\.1:(\d+)-:(\d+)", _opt(argv, "-netdev"))
    sock = re.fullmatch(r"unix:(.+),server,nowait", _opt(argv, "-monitor"))
    assert fwd and fwd.group(2) == "5000" and sock, argv
    assert "accel=" in _opt(argv, "-machine") and _opt(argv, "-display") == "none", argv
    asyncio.run(guest(overlay, int(fwd.group(1)), sock.group(1)))
    return 0


if __name__ == "__main__":
    kind, *rest = sys.argv[1:]
    sys.exit(img(rest[1:]) if kind == "img" else system(rest))
