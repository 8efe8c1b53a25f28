"""Reset between episodes: the revert hooks from config strings (libvirt, QEMU monitor, Docker,
a user command) and the Docker provider, against fakes: a fake Docker daemon on a unix socket
(Docker itself cannot run on this machine), a fake ``virsh`` on PATH, a fake QEMU monitor. The
"VM" behind each is a tiny HTTP server answering ``/platform`` as the VM server does."""

from __future__ import annotations

import asyncio
import json
import os
import stat

import pytest
from aiohttp import web

from envs.docker.provider import DockerDesktop
from envs.vm import make_env_pool
from envs.vm.client import VMError
from envs.vm.providers import RemoteDesktop, qemu_monitor, revert_hook


async def _platform(request: web.Request) -> web.Response:
    return web.Response(text="Linux")


async def _vm_server(port: int = 0) -> tuple[web.AppRunner, int]:
    """A stand-in VM server: answers /platform like envs.vm.server."""
    app = web.Application()
    app.router.add_get("/platform", _platform)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, reuse_address=True)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


class FakeDocker:
    """The Docker Engine API calls DockerDesktop makes; each "container" is a _vm_server whose
    port changes on every restart (as a published port with HostPort "" may)."""

    def __init__(self, sock: str, keep_port: bool = False):
        self.sock = sock
        self.keep_port = keep_port
        self.calls: list[tuple[str, str, object]] = []
        self.containers: dict[str, dict] = {}

    async def _up(self, c: dict) -> None:
        c["runner"], c["port"] = await _vm_server(c.get("port", 0) if self.keep_port else 0)

    async def _down(self, c: dict) -> None:
        if c.get("runner") is not None:
            await c["runner"].cleanup()
            c["runner"] = None

    def app(self) -> web.Application:
        app = web.Application()
        r = app.router

        async def create(req):
            body = await req.json()
            self.calls.append(("create", req.query.get("name", ""), body))
            if body.get("Image") != "cua-desktop:test":
                return web.json_response({"message": "No such image"}, status=404)
            cid = f"c{len(self.containers):063d}"
            self.containers[cid] = {"body": body}
            return web.json_response({"Id": cid, "Warnings": []}, status=201)

        async def start(req):
            c = self.containers[req.match_info["id"]]
            self.calls.append(("start", req.match_info["id"], None))
            await self._up(c)
            return web.Response(status=204)

        async def restart(req):
            c = self.containers.get(req.match_info["id"])
            self.calls.append(("restart", req.match_info["id"], dict(req.query)))
            if c is None:
                return web.json_response({"message": "No such container"}, status=404)
            await self._down(c)
            await self._up(c)
            return web.Response(status=204)

        async def inspect(req):
            c = self.containers[req.match_info["id"]]
            ports = {"5000/tcp": [{"HostIp": "127.0.0.1", "HostPort": str(c["port"])}]}
            return web.json_response(
                {"Id": req.match_info["id"], "NetworkSettings": {"Ports": ports}}
            )

        async def remove(req):
            c = self.containers.pop(req.match_info["id"])
            self.calls.append(("remove", req.match_info["id"], dict(req.query)))
            await self._down(c)
            return web.Response(status=204)

        r.add_post("/v1.41/containers/create", create)
        r.add_post("/v1.41/containers/{id}/start", start)
        r.add_post("/v1.41/containers/{id}/restart", restart)
        r.add_get("/v1.41/containers/{id}/json", inspect)
        r.add_delete("/v1.41/containers/{id}", remove)
        return app

    async def __aenter__(self) -> FakeDocker:
        self.runner = web.AppRunner(self.app())
        await self.runner.setup()
        await web.UnixSite(self.runner, self.sock).start()
        return self

    async def __aexit__(self, *exc) -> None:
        for c in self.containers.values():
            await self._down(c)
        await self.runner.cleanup()


def test_docker_desktop_lifecycle_against_a_fake_daemon(tmp_path):
    sock = str(tmp_path / "docker.sock")

    async def go():
        async with FakeDocker(sock) as fake:
            d = DockerDesktop("cua-desktop:test", "tok", docker_host=f"unix://{sock}")
            await d.start()
            url0 = d.client.base_url
            assert await d.client.ping()
            await d.reset()
            await d.reset()
            url2 = d.client.base_url
            assert await d.client.ping()  # reconnected to the port after the restart
            await d.stop()
            bad = DockerDesktop(
                "no-such:image", docker_host=f"unix://{sock}", max_processes=256, cpus=1.5
            )
            with pytest.raises(VMError, match="No such image"):
                await bad.start()
            await bad.stop()
            return fake.calls, url0, url2, d.restarts, fake.containers

    calls, url0, url2, restarts, left = asyncio.run(go())
    kinds = [c[0] for c in calls]
    assert kinds == ["create", "start", "restart", "restart", "remove", "create"], kinds
    body = calls[0][2]
    assert "CUA_VM_TOKEN=tok" in body["Env"]
    assert body["HostConfig"]["PortBindings"]["5000/tcp"] == [
        {"HostIp": "127.0.0.1", "HostPort": ""}
    ]
    assert calls[4][2] == {"force": "1", "v": "1"}
    assert restarts == 2 and url0 != url2 and not left
    # Docker's --pids-limit by default (a fork bomb stays in its container), --cpus when given
    assert body["HostConfig"]["PidsLimit"] == 4096 and "NanoCpus" not in body["HostConfig"]
    limited = calls[5][2]["HostConfig"]
    assert limited["PidsLimit"] == 256 and limited["NanoCpus"] == 1_500_000_000


def test_docker_revert_hook_restarts_the_named_container(tmp_path, monkeypatch):
    sock = str(tmp_path / "docker.sock")
    monkeypatch.setenv("DOCKER_HOST", f"unix://{sock}")

    async def go():
        async with FakeDocker(sock, keep_port=True) as fake:
            d = DockerDesktop("cua-desktop:test", docker_host=f"unix://{sock}")
            await d.start()
            cid = d.cid
            # a desktop run by somebody else, reset through the hook: {index} is filled in
            hook = revert_hook("docker:" + cid[:-1] + "{index}", index=0)
            remote = RemoteDesktop(d.client.base_url, revert=hook)
            await remote.reset()
            restarted = [c for c in fake.calls if c[0] == "restart"]
            await remote.stop()
            await d.stop()
            return restarted, cid

    restarted, cid = asyncio.run(go())
    assert restarted == [("restart", cid, {"t": "5"})]


def _fake_virsh(tmp_path) -> str:
    log = tmp_path / "virsh.log"
    exe = tmp_path / "bin" / "virsh"
    exe.parent.mkdir()
    exe.write_text(f'#!/bin/sh\necho "$@" >> {log}\n[ "$2" != "missing" ]\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(log)


def test_libvirt_and_cmd_hooks_run_their_commands(tmp_path, monkeypatch):
    log = _fake_virsh(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    out = tmp_path / "cmd.log"

    async def go():
        runner, port = await _vm_server()
        try:
            url = f"http://127.0.0.1:{port}"
            d = RemoteDesktop(url, revert=revert_hook("libvirt:osworld-{index}@init", index=3))
            await d.reset()
            cmd = revert_hook(f"cmd:echo {{index}} {{host}} {{port}} >> {out}", index=1)
            d2 = RemoteDesktop(url, revert=cmd)
            await d2.reset()
            bad = RemoteDesktop(url, revert=revert_hook("libvirt:missing@init"))
            with pytest.raises(VMError, match="exited 1"):
                await bad.reset()
            fail = RemoteDesktop(url, revert=revert_hook("cmd:exit 7"))
            with pytest.raises(VMError, match="exited 7"):
                await fail.reset()
            for x in (d, d2, bad, fail):
                await x.stop()
            return port
        finally:
            await runner.cleanup()

    port = asyncio.run(go())
    lines = open(log).read().splitlines()
    assert lines[0] == "snapshot-revert osworld-3 init --running"
    assert open(out).read() == f"1 127.0.0.1 {port}\n"


def test_qemu_monitor_loadvm(tmp_path):
    sock = str(tmp_path / "qemu.sock")
    got: list[str] = []

    async def monitor(reader, writer):
        writer.write(b"QEMU 9.2.0 monitor - type 'help' for more information\r\n(qemu) ")
        await writer.drain()
        line = (await reader.readline()).decode().strip()
        got.append(line)
        reply = "" if line == "loadvm init" else "Error: Snapshot 'nope' does not exist\r\n"
        writer.write(f"{line}\r\n{reply}(qemu) ".encode())
        await writer.drain()
        writer.close()

    async def go():
        server = await asyncio.start_unix_server(monitor, sock)
        runner, port = await _vm_server()
        try:
            d = RemoteDesktop(f"http://127.0.0.1:{port}", revert=revert_hook(f"qemu:{sock}@init"))
            await d.reset()
            await d.stop()
            with pytest.raises(VMError, match="does not exist"):
                await qemu_monitor(sock, "loadvm nope")
            with pytest.raises(VMError, match="cannot connect"):
                await qemu_monitor(str(tmp_path / "none.sock"), "loadvm init")
        finally:
            server.close()
            await runner.cleanup()

    asyncio.run(go())
    assert got == ["loadvm init", "loadvm nope"]


@pytest.mark.parametrize("spec", ["snapshot", "virsh:x@y", "libvirt:dom", "qemu:/tmp/s", "cmd:"])
def test_bad_revert_specs_name_the_fix(spec):
    with pytest.raises(ValueError, match="env.vm_revert"):
        revert_hook(spec)
    assert revert_hook("") is None


def test_make_env_pool_wires_revert_and_docker():
    pool = make_env_pool(
        2, endpoints=["http://10.0.0.1:5000", "http://10.0.0.2:5000"], revert="cmd:true {index}"
    )
    ds = pool.desktops.desktops
    assert [type(d).__name__ for d in ds] == ["RemoteDesktop"] * 2
    assert all(d.revert is not None for d in ds)
    pool = make_env_pool(3, docker_image="cua-desktop:test", token="t")
    ds = pool.desktops.desktops
    assert [type(d).__name__ for d in ds] == ["DockerDesktop"] * 3
    assert len({d.name for d in ds}) == 3 and json.dumps([d.name for d in ds])
    with pytest.raises(ValueError, match="env.vm_revert"):
        make_env_pool(1, endpoints=["http://x:1"], revert="bogus")


def test_vmenv_reverts_a_remote_desktop_before_each_episodes_setup(xserver, tmp_path):
    """A desktop reached by URL (a LocalDesktop's server standing in for a remote VM) with a
    revert command: every episode reverts first, then runs the task's setup steps, and the
    oracle solves it; the revert ran once per episode."""
    from envs.vm import osworld
    from envs.vm.env import VMEnv, task_from_osworld
    from envs.vm.providers import DesktopPool, LocalDesktop

    marks = tmp_path / "reverts.log"
    task = task_from_osworld(
        next(t for t in osworld.load_builtin() if t.id == "terminal-mkdir"), "desktop"
    )

    async def go():
        local = LocalDesktop(640, 480)
        await local.start()
        try:
            hook = revert_hook(f"cmd:echo {{index}} {{port}} >> {marks}", index=0)
            remote = RemoteDesktop(local.url, local.token, revert=hook)
            scores = []
            async with DesktopPool([remote]) as pool, VMEnv(pool) as env:
                for _ in range(2):
                    await env.reset(task)
                    for a in task.oracle:
                        if (await env.step(a)).done:
                            break
                    scores.append(await env.evaluate())
            return scores, local.url
        finally:
            await local.stop()

    scores, url = asyncio.run(go())
    port = url.rsplit(":", 1)[1]
    assert scores == [1.0, 1.0]
    assert marks.read_text().splitlines() == [f"0 {port}", f"0 {port}"]
