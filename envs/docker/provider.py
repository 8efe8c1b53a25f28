"""``DockerDesktop``: a desktop in a container of the image ``envs/docker/Dockerfile`` builds.

    pool = DesktopPool([DockerDesktop("cua-desktop:latest", token=T) for _ in range(8)])

Talks to the Docker Engine API directly (aiohttp over ``/var/run/docker.sock``, or
``$DOCKER_HOST`` = ``unix:///path`` / ``tcp://host:port``): create a container from the image
with the VM server's port 5000 published on a free loopback port, start it, read the port back
(``inspect``), and wait for the server; ``reset()`` (before every episode) restarts the
container, so each episode starts from the image's state (the container's writable layer is
kept across restarts: the task's own setup steps then prepare the episode, as on OSWorld's
VMs); ``stop()`` removes it. The token is passed in as ``$CUA_VM_TOKEN``. A container holds
at most ``max_processes`` tasks (4096 by default, Docker's ``--pids-limit``) and, with ``cpus``,
that many cores (``--cpus``): a fork bomb or busy loop stays in its container.
"""

from __future__ import annotations

import os
import secrets
from typing import Any

import aiohttp

from envs.vm.client import VMClient, VMError

API = "/v1.41"
VM_PORT = "5000/tcp"


class DockerError(VMError):
    """The Docker daemon refused a request (the message is the daemon's)."""


class DockerAPI:
    """The few Docker Engine API calls a desktop needs."""

    def __init__(self, host: str | None = None, timeout: float = 120.0):
        host = host or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
        if host.startswith("unix://"):
            self._unix: str | None = host.removeprefix("unix://")
            self.base = "http://docker" + API
        elif host.startswith("tcp://"):
            self._unix = None
            self.base = "http://" + host.removeprefix("tcp://") + API
        else:
            raise ValueError(f"DOCKER_HOST {host!r}: expected unix:///path or tcp://host:port")
        self.host = host
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> DockerAPI:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(self, method: str, path: str, **kw: Any) -> Any:
        if self._session is None:
            conn = aiohttp.UnixConnector(path=self._unix) if self._unix else None
            self._session = aiohttp.ClientSession(connector=conn)
        try:
            async with self._session.request(
                method, self.base + path, timeout=aiohttp.ClientTimeout(total=self.timeout), **kw
            ) as r:
                body = await r.read()
                if r.status >= 400:
                    msg = body.decode(errors="replace")[:500]
                    raise DockerError(f"docker {method} {path}: HTTP {r.status}: {msg}")
                if r.content_type == "application/json" and body:
                    return await r.json()
                return None
        except (aiohttp.ClientError, OSError) as e:
            raise DockerError(f"docker daemon at {self.host} did not answer: {e}") from e

    async def create(
        self,
        image: str,
        env: dict[str, str],
        name: str | None = None,
        *,
        pids_limit: int | None = None,
        cpus: float | None = None,
    ) -> str:
        """A container of ``image``; ``pids_limit`` / ``cpus``: Docker's --pids-limit and
        --cpus (HostConfig PidsLimit, NanoCpus), enforced by the daemon's cgroup."""
        body = {
            "Image": image,
            "Env": [f"{k}={v}" for k, v in env.items()],
            "ExposedPorts": {VM_PORT: {}},
            "HostConfig": {
                "PortBindings": {VM_PORT: [{"HostIp": "127.0.0.1", "HostPort": ""}]},
                "ShmSize": 512 * 1024**2,
            },
        }
        if pids_limit is not None:
            body["HostConfig"]["PidsLimit"] = int(pids_limit)
        if cpus is not None:
            body["HostConfig"]["NanoCpus"] = int(cpus * 1e9)
        params = {"name": name} if name else None
        out = await self._call("POST", "/containers/create", json=body, params=params)
        return out["Id"]

    async def start(self, cid: str) -> None:
        await self._call("POST", f"/containers/{cid}/start")

    async def restart(self, cid: str, t: int = 5) -> None:
        await self._call("POST", f"/containers/{cid}/restart", params={"t": str(t)})

    async def remove(self, cid: str) -> None:
        await self._call("DELETE", f"/containers/{cid}", params={"force": "1", "v": "1"})

    async def host_port(self, cid: str) -> tuple[str, int]:
        """(host ip, port) the container's VM server port is published on."""
        info = await self._call("GET", f"/containers/{cid}/json")
        binds = ((info.get("NetworkSettings") or {}).get("Ports") or {}).get(VM_PORT) or []
        if not binds:
            raise DockerError(f"container {cid[:12]} publishes no {VM_PORT}")
        ip = binds[0].get("HostIp") or "127.0.0.1"
        return ("127.0.0.1" if ip in ("0.0.0.0", "") else ip), int(binds[0]["HostPort"])


class DockerDesktop:
    """One desktop container (the ``Desktop`` protocol of ``envs.vm.providers``)."""

    def __init__(
        self,
        image: str = "cua-desktop:latest",
        token: str | None = None,
        *,
        docker_host: str | None = None,
        screen: tuple[int, int] = (1280, 720),
        ready_timeout: float = 120.0,
        name: str | None = None,
        max_processes: int | None = 4096,
        cpus: float | None = None,
    ):
        if max_processes is not None and max_processes < 16:
            raise ValueError(f"DockerDesktop max_processes must be >= 16, got {max_processes}")
        if cpus is not None and not cpus > 0:
            raise ValueError(f"DockerDesktop cpus must be > 0, got {cpus}")
        self.max_processes, self.cpus = max_processes, cpus
        self.image = image
        self.token = token
        self.screen = screen
        self.ready_timeout = ready_timeout
        self.container_name = name
        self.api = DockerAPI(docker_host)
        self.cid: str | None = None
        self.client: VMClient | None = None
        self.name = f"docker:{name or image + '#' + secrets.token_hex(4)}"  # unique in a pool
        self.restarts = 0

    def __repr__(self) -> str:
        return f"DockerDesktop({self.image!r}, {self.cid[:12] if self.cid else 'not started'})"

    async def _connect(self) -> None:
        assert self.cid is not None
        ip, port = await self.api.host_port(self.cid)
        if self.client is None or self.client.base_url != f"http://{ip}:{port}":
            if self.client is not None:
                await self.client.close()
            self.client = VMClient(f"http://{ip}:{port}", token=self.token)
        await self.client.wait_ready(self.ready_timeout)

    async def start(self) -> None:
        env = {"SCREEN": f"{self.screen[0]}x{self.screen[1]}x24"}
        if self.token:
            env["CUA_VM_TOKEN"] = self.token
        self.cid = await self.api.create(
            self.image, env, self.container_name, pids_limit=self.max_processes, cpus=self.cpus
        )
        await self.api.start(self.cid)
        await self._connect()

    async def reset(self) -> None:
        """Restarts the container (a fresh desktop session) and waits for its server."""
        if self.cid is None:
            await self.start()
            return
        await self.api.restart(self.cid)
        self.restarts += 1
        await self._connect()

    async def recover(self) -> None:
        await self.reset()

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None
        if self.cid is not None:
            cid, self.cid = self.cid, None
            await self.api.remove(cid)
        await self.api.close()
