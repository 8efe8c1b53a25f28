"""The monitor's token and pages against a hostile neighbour on the same host: the cookie is
per port and is not the token, same-site (another port) requests are refused, every answer
carries a CSP, X-Frame-Options and nosniff, and the command line bounds its numbers."""

from __future__ import annotations

import re

import pytest
from starlette.testclient import TestClient

from tools import monitor
from tools.monitor_app.app import make_app
from tools.monitor_app.security import COOKIE, allowed_hosts, cookie_name

TOKEN = "s3cret-monitor-token-0123456789"


@pytest.fixture(scope="module")
def engine(filled):
    return monitor.open_database(filled[0])


def _client(engine, port: int, token: str = TOKEN) -> TestClient:
    app = make_app(engine, token=token, hosts=allowed_hosts("127.0.0.1", port))
    return TestClient(app, base_url=f"http://127.0.0.1:{port}", follow_redirects=False)


def test_cookie_is_per_port_and_never_the_token(engine):
    other = "another-monitor-token-98765432"
    a, b = _client(engine, 8080), _client(engine, 8081, other)
    b.cookies = a.cookies  # one browser: cookies are kept per host, whatever the port
    r = a.get(f"/runs/1?token={TOKEN}")
    set_cookie = r.headers["set-cookie"]
    assert r.status_code == 303 and set_cookie.startswith(f"{cookie_name(8080)}=")
    assert TOKEN not in set_cookie and "samesite=strict" in set_cookie.lower()
    assert "httponly" in set_cookie.lower()
    assert a.get("/runs/1").status_code == 200  # the cookie works where it was set
    value = a.cookies[cookie_name(8080)]
    # the monitor on another port: neither that cookie nor the old token-valued one opens it
    for name, v in ((cookie_name(8080), value), (cookie_name(8081), value), (COOKIE, TOKEN)):
        assert b.get("/runs/1", headers={"Cookie": f"{name}={v}"}).status_code == 401
    b.get(f"/?token={other}")  # its own login leaves the first monitor's cookie alone
    assert a.get("/runs/1").status_code == 200 and b.get("/runs/1").status_code == 200


def test_same_site_requests_are_refused(engine):
    c = _client(engine, 8080)
    auth = {"Authorization": f"token {TOKEN}"}
    r = c.get("/api/runs", headers={**auth, "Sec-Fetch-Site": "same-site"})
    assert r.status_code == 403 and "same-site" in r.text
    r = c.get("/api/runs", headers={**auth, "Origin": "http://127.0.0.1:9999"})
    assert r.status_code == 403
    assert c.get("/api/runs", headers={**auth, "Sec-Fetch-Site": "same-origin"}).status_code == 200
    assert c.get("/api/runs", headers={**auth, "Sec-Fetch-Site": "none"}).status_code == 200
    r = TestClient(make_app(engine, hosts=allowed_hosts("0.0.0.0", 8080))).get(
        "/", headers={"Host": "box.example:8080"}
    )
    assert r.status_code == 403 and "--allow-host" in r.text  # says how to let it in


def test_every_answer_has_a_csp_and_no_framing(engine):
    c = TestClient(make_app(engine))
    for path in ("/", "/runs/1", "/api/runs", "/static/monitor.js", "/runs/999999"):
        r = c.get(path)
        csp = r.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in csp and "default-src 'none'" in csp, path
        assert "'unsafe-inline'" not in csp, path
        assert r.headers["x-frame-options"] == "DENY", path
        assert r.headers["x-content-type-options"] == "nosniff", path
    page = c.get("/runs/1")
    nonce = re.search(r"'nonce-([^']+)'", page.headers["content-security-policy"]).group(1)
    inline = re.findall(r"<script( nonce=\"[^\"]*\")?>", page.text)
    assert inline and all(n == f' nonce="{nonce}"' for n in inline)  # every inline script
    assert nonce not in c.get("/runs/1").text  # a fresh one per page


@pytest.mark.parametrize(
    "args,message",
    [
        (["--port", "99999"], "--port 99999 must be in [1, 65535]"),
        (["--poll-ms", "-5"], "--poll-ms -5 must be >= 100"),
        (["--host", "0.0.0.0", "--token", "T"], "at least 16 characters"),
    ],
)
def test_cli_bounds_are_one_line(filled, capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        monitor.main([f"--db={filled[0]}", *args])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_ids_beyond_any_column_are_4xx_not_500(engine):
    c = TestClient(make_app(engine), raise_server_exceptions=False)
    huge = "9" * 30
    for path in (f"/runs/{huge}", f"/runs/1/steps/{huge}", f"/rollouts/{huge}"):
        assert c.get(path).status_code == 404, path
    for path in (f"/runs/1/evals/0?vs={huge}", f"/api/runs/1/steps?after={huge}"):
        assert c.get(path).status_code == 400, path


def test_non_ascii_tokens_are_401_not_500(engine):
    # hmac.compare_digest raised TypeError on a str with non-ASCII characters: a 500.
    c = _client(engine, 8080)
    assert c.get("/api/runs?token=%C3%A9").status_code == 401
    assert c.get("/api/runs", headers={"Authorization": "token é".encode()}).status_code == 401
    assert (
        c.get("/api/runs", headers={"Cookie": f"{cookie_name(8080)}=é".encode()}).status_code == 401
    )
