"""The VM server's request guard over real HTTP (aiohttp's TestServer on loopback, no X).

What a web page in a browser on the desktop's machine can send is refused before any handler
runs; every refusal is checked against an independent witness: the file a command would have
created is absent, and an oversized body is refused without being read.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from envs.vm import server as vm_server
from envs.vm.client import VMClient, VMRequestError
from envs.vm.server import VMServer
from envs.vm.server_http import COMMAND_MAX_BYTES, is_wildcard, split_host

from .test_vm_server_handlers import FakeScreen

TOKEN = "s3cret-token"


def _run(tmp_path: Path, body, *, token: str | None = TOKEN, **kw):
    """Serves a VMServer on a loopback port and runs ``body(url)`` against it."""

    async def go():
        srv = VMServer(
            screen=FakeScreen(),
            token=token,
            allowed_roots=[tmp_path],
            warm_pyautogui=False,
            exec_limit_s=5,
            **kw,
        )
        ts = TestServer(srv.app(), host="127.0.0.1")
        await ts.start_server()
        try:
            return await body(f"http://127.0.0.1:{ts.port}")
        finally:
            await ts.close()

    return asyncio.run(go())


def _touch(marker: Path) -> bytes:
    return json.dumps({"command": ["touch", str(marker)]}).encode()


async def _post(url: str, path: str, data: bytes, headers: dict[str, str]) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.post(url + path, data=data, headers=headers) as r:
        return r.status, await r.text()


@pytest.mark.parametrize("token", [TOKEN, None])
def test_cross_origin_text_plain_post_is_refused_and_runs_nothing(tmp_path, token):
    marker = tmp_path / "pwned"
    # What `fetch(url, {method: "POST", mode: "no-cors", body})` on http://evil.example sends.
    evil = {"Origin": "http://evil.example", "Content-Type": "text/plain;charset=UTF-8"}
    if token:
        evil["Authorization"] = f"Bearer {token}"  # even a page that somehow had the token

    async def body(url):
        return await _post(url, "/execute", _touch(marker), evil)

    status, text = _run(tmp_path, body, token=token)
    assert status == 403 and "cross-origin" in text and "evil.example" in text
    assert not marker.exists()


@pytest.mark.parametrize(
    "headers, why",
    [
        ({"Origin": "http://evil.example", "Content-Type": "application/json"}, "cross-origin"),
        ({"Origin": "null", "Content-Type": "application/json"}, "cross-origin"),
        ({"Sec-Fetch-Site": "cross-site", "Content-Type": "application/json"}, "another site"),
        ({"Host": "evil.example:80", "Content-Type": "application/json"}, "DNS rebinding"),
        ({"Content-Type": "text/plain"}, "application/json"),  # no Origin, wrong type: 415
        ({"Content-Type": "application/x-www-form-urlencoded"}, "application/json"),
    ],
)
def test_browser_shaped_requests_are_refused(tmp_path, headers, why):
    marker = tmp_path / "pwned"

    async def body(url):
        return await _post(
            url, "/execute", _touch(marker), {**headers, "Authorization": "Bearer " + TOKEN}
        )

    status, text = _run(tmp_path, body)
    assert status == (415 if why == "application/json" else 403), text
    assert why in text
    assert not marker.exists()


def test_cross_site_get_of_the_screen_is_refused(tmp_path):
    async def body(url):
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/screenshot", headers={"Sec-Fetch-Site": "cross-site"}) as r:
                return r.status, await r.read()

    status, data = _run(tmp_path, body, token=None)
    assert status == 403 and not data.startswith(b"\x89PNG")


def test_missing_or_wrong_token_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    cases = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}]

    async def body(url):
        out = []
        for auth in cases:
            headers = {"Content-Type": "application/json", **auth}
            out.append(await _post(url, "/execute", _touch(marker), headers))
        return out

    for status, text in _run(tmp_path, body):
        assert status == 401 and "token" in text
    assert not marker.exists()


def test_same_origin_and_no_origin_clients_with_the_token_work(tmp_path):
    marker = tmp_path / "ran"

    async def body(url):
        async with VMClient(url, token=TOKEN, retries=0) as c:
            size = await c.screen_size()
            r = await c.execute(["touch", str(marker)])
            up = await c.upload(str(tmp_path / "u.bin"), b"\x00\x01" * 1000)
            down = await c.download(str(tmp_path / "u.bin"))
        same = {
            "Origin": url,
            "Sec-Fetch-Site": "same-origin",
            "Content-Type": "application/json",
            "Authorization": f"Bearer {TOKEN}",
        }
        status, text = await _post(url, "/execute", b'{"command": ["echo", "same"]}', same)
        return size, r, up, down, status, text

    size, r, up, down, status, text = _run(tmp_path, body)
    assert size == (40, 30) and r["returncode"] == 0 and marker.exists()
    assert up == "File uploaded" and down == b"\x00\x01" * 1000
    assert status == 200 and json.loads(text)["output"] == "same\n"


def test_localhost_and_ipv6_loopback_host_names_are_accepted(tmp_path):
    async def body(url):
        port = url.rsplit(":", 1)[1]
        out = []
        for host in (f"localhost:{port}", f"[::1]:{port}", "127.0.0.2"):
            async with aiohttp.ClientSession() as s:
                hdrs = {"Host": host, "Authorization": f"Bearer {TOKEN}"}
                async with s.post(url + "/screen_size", headers=hdrs) as r:
                    out.append(r.status)
        return out

    assert _run(tmp_path, body) == [200, 200, 200]


def test_bound_host_and_allow_host_names_are_accepted_others_not(tmp_path):
    async def body(url):
        out = []
        for host in ("vm.example:5000", "10.1.2.3:5000", "other.example"):
            async with aiohttp.ClientSession() as s:
                hdrs = {"Host": host, "Authorization": f"Bearer {TOKEN}"}
                async with s.post(url + "/screen_size", headers=hdrs) as r:
                    out.append(r.status)
        return out

    got = _run(
        tmp_path, body, allowed_hosts=vm_server.allowed_hosts_for("10.1.2.3", ["VM.example"])
    )
    assert got == [200, 200, 403]
    assert vm_server.allowed_hosts_for("0.0.0.0") is None  # wildcard: the token protects it
    assert vm_server.allowed_hosts_for("::", ["a"]) == ["a"]


def test_a_non_ascii_token_is_a_401_and_a_client_leaving_mid_body_no_traceback(tmp_path, caplog):
    # A token byte \xe9 reached hmac.compare_digest as a surrogate: UnicodeEncodeError, a 500
    # (with a traceback in the log); the browser host shares this guard.
    async def body(url):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        out = []
        for auth in (b"Bearer \xe9", "Bearer é".encode()):
            r, w = await asyncio.open_connection(host, int(port))
            w.write(b"GET /platform HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: " + auth)
            w.write(b"\r\nConnection: close\r\n\r\n")
            out.append((await r.read()).split(b"\r\n")[0])
            w.close()
        r, w = await asyncio.open_connection(host, int(port))  # leaves after 5 of 1000 bytes
        w.write(
            f"POST /execute HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
            'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"com'.encode()
        )
        await w.drain()
        w.close()
        await asyncio.sleep(0.2)
        return out

    assert _run(tmp_path, body) == [b"HTTP/1.1 401 Unauthorized"] * 2
    assert not [r for r in caplog.records if r.exc_info], caplog.text


def test_oversized_body_is_refused_with_413_before_it_is_read(tmp_path):
    marker = tmp_path / "ran"

    def raw_post(url: str, length: int) -> bytes:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sk:
            head = (
                f"POST /execute HTTP/1.1\r\nHost: {host}:{port}\r\n"
                f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {length}\r\n\r\n"
            )
            sk.sendall(head.encode() + _touch(marker))  # the first bytes of a 400 MB body
            return sk.recv(4096)

    async def body(url):
        return await asyncio.to_thread(raw_post, url, 400_000_000)

    reply = _run(tmp_path, body)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert str(COMMAND_MAX_BYTES).encode() in reply
    assert not marker.exists()


def test_chunked_body_over_the_route_cap_is_cut_off_with_413(tmp_path):
    marker = tmp_path / "ran"
    big = b'{"command": ["touch", "%s"], "pad": "' % str(marker).encode()

    async def chunks():  # no Content-Length: the server must count while reading
        yield big
        for _ in range(COMMAND_MAX_BYTES // 65536 + 2):
            yield b"x" * 65536
        yield b'"}'

    async def body(url):
        hdrs = {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"}
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/execute", data=chunks(), headers=hdrs) as r:
                return r.status

    assert _run(tmp_path, body) == 413
    assert not marker.exists()


def test_upload_cap_is_its_own(tmp_path):
    async def body(url):
        async with VMClient(url, token=TOKEN, retries=0) as c:
            ok = await c.upload(str(tmp_path / "small.bin"), b"a" * 3000)
            with pytest.raises(VMRequestError) as e:
                await c.upload(str(tmp_path / "big.bin"), b"b" * 20_000)
            # The small cap of other routes is not the upload cap.
            hdrs = {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"}
            status, _ = await _post(url, "/list_directory", b" " * 70_000 + b"{}", hdrs)
        return ok, e.value.status, status

    ok, big_status, list_status = _run(tmp_path, body, max_upload_bytes=10_000)
    assert ok == "File uploaded" and (tmp_path / "small.bin").stat().st_size == 3000
    assert big_status == 413 and not (tmp_path / "big.bin").exists()
    assert list_status == 413


def test_host_header_parsing():
    assert split_host("LocalHost:5000") == ("localhost", 5000)
    assert split_host("[::1]:80") == ("::1", 80)
    assert split_host("[::1]") == ("::1", None)
    assert split_host("example.com.") == ("example.com", None)
    assert is_wildcard("0.0.0.0") and is_wildcard("::") and not is_wildcard("127.0.0.1")


def test_cli_makes_up_a_token_on_loopback_and_needs_one_elsewhere(monkeypatch, capsys):
    monkeypatch.delenv("CUA_VM_TOKEN", raising=False)
    a, b = vm_server.parse_args([]), vm_server.parse_args([])
    assert a.token_generated and len(a.token) >= 32 and a.token != b.token
    assert vm_server.parse_args(["--no-token"]).token is None
    given = vm_server.parse_args(["--token", "T"])
    assert given.token == "T" and not given.token_generated
    monkeypatch.setenv("CUA_VM_TOKEN", "from-env")
    assert vm_server.parse_args([]).token == "from-env"
    assert vm_server.parse_args(["--no-token"]).token is None  # --no-token beats the env
    for argv, msg in [
        (["--host", "0.0.0.0", "--no-token"], "--no-token"),
        (["--no-token", "--token", "T"], "contradict"),
    ]:
        with pytest.raises(SystemExit):
            vm_server.parse_args(argv)
        assert msg in capsys.readouterr().err
    monkeypatch.delenv("CUA_VM_TOKEN")
    with pytest.raises(SystemExit):
        vm_server.parse_args(["--host", "10.0.0.7"])  # never a made-up token off loopback
    assert "needs --token" in capsys.readouterr().err
    assert os.environ.get("CUA_VM_TOKEN") is None


def test_cli_bounds_are_one_line_and_exit_2(capsys):
    # Each was accepted (or a traceback from the event loop, for the port) before.
    long = "a-token-of-16+chars"
    assert vm_server.parse_args(["--host", "0.0.0.0", "--token", long]).token == long
    bad = {
        ("--exec-limit", "-1"): "--exec-limit -1.0 must be in (0, 86400]",
        ("--exec-limit", "nan"): "--exec-limit nan must be in",
        ("--max-upload-bytes", "-1"): "--max-upload-bytes -1 must be in [1,",
        ("--port", "99999"): "--port 99999 must be in [0, 65535]",
        ("--port", "-2"): "--port -2 must be in",
        ("--host", "0.0.0.0", "--token", "T"): "at least 16 characters",
        ("--command-cpu-s", "0"): "--command-cpu-s 0.0 must be in [1, 86400]",
        ("--command-cpu-s", "inf"): "--command-cpu-s inf must be in",
    }
    for argv, message in bad.items():
        with pytest.raises(SystemExit) as exc:
            vm_server.parse_args(list(argv))
        err = capsys.readouterr().err
        assert exc.value.code == 2 and message in err and "Traceback" not in err, (argv, err)
        assert err.strip().splitlines()[-1].startswith("python -m envs.vm.server: error:")
