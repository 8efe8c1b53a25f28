"""OSWorld's Chrome setup on a LocalDesktop with this machine's real Debian Chromium.

An OSWorld-format task launched as OSWorld's Chrome tasks launch it (``google-chrome
--remote-debugging-port=P`` and ``socat tcp-listen:Q,fork tcp:localhost:P``: on a desktop with
Chromium and no Chrome, the desktop's stand-ins), then ``chrome_open_tabs`` with two pages a
loopback HTTP server serves (no internet), scored by desktop-env's own ``open_tabs_info`` getter
and ``is_expected_tabs`` metric: 0 while the extra tab is open, 1 after one ``run_shell`` that
closes it through DevTools, as a model would. The ports are free ones, not OSWorld's 9222/1337,
so the test cannot meet another Chrome on this machine.

Marked ``browser`` (needs Chromium) and ``osworld`` (the getter and metric are desktop-env's).
"""

from __future__ import annotations

import http.server
import json
import shutil
import socket
import threading
import urllib.request

import pytest

from cua_jax.actions import RunShell
from envs.vm import osworld
from envs.vm import osworld_evaluators as desktop_env
from envs.vm.env import VMEnv, task_from_osworld
from envs.vm.osworld_setup import ContentCache
from envs.vm.providers import LocalDesktop

pytestmark = [
    pytest.mark.browser,
    pytest.mark.osworld,
    pytest.mark.skipif(
        not (shutil.which("chromium") or shutil.which("google-chrome")),
        reason="needs Chromium (apt-get install chromium)",
    ),
    pytest.mark.skipif(
        desktop_env.unavailable() is not None, reason=str(desktop_env.unavailable())
    ),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Pages(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 -- http.server's name
        body = f"<title>{self.path}</title><h1>{self.path}</h1>".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def pages():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Pages)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


# Closes, through the DevTools endpoint in the desktop, every tab whose URL contains $1.
CLOSE_TAB = (
    "python3 -c \"import json, sys, urllib.request as u; b = 'http://127.0.0.1:' + sys.argv[1]; "
    "[u.urlopen(b + '/json/close/' + t['id']).read() for t in json.load(u.urlopen(b + "
    "'/json/list')) if t['type'] == 'page' and sys.argv[2] in t['url']]\" {port} {needle}"
)


def test_chrome_open_tabs_on_real_chromium_scored_by_osworlds_getter(xserver, aio, pages):
    chrome, relay = _free_port(), _free_port()
    keep, extra = f"{pages}/keep", f"{pages}/extra"
    raw = {
        "id": "chrome-tabs-local",
        "snapshot": "chrome",
        "instruction": "Close the tab that shows /extra and keep the other one.",
        "source": "test",
        "config": [
            {
                "type": "launch",
                "parameters": {"command": ["google-chrome", f"--remote-debugging-port={chrome}"]},
            },
            {
                "type": "launch",
                "parameters": {
                    "command": ["socat", f"tcp-listen:{relay},fork", f"tcp:localhost:{chrome}"]
                },
            },
            {"type": "chrome_open_tabs", "parameters": {"urls_to_open": [keep, extra]}},
        ],
        "related_apps": ["chrome"],
        "evaluator": {
            "func": "is_expected_tabs",
            "result": {"type": "open_tabs_info"},
            "expected": {"type": "rule", "rules": {"type": "url", "urls": [keep]}},
        },
    }
    ot = osworld.parse_task(raw, where="chrome", domain="chrome")
    task = task_from_osworld(ot, "osworld", ["run_shell"])

    async def play():
        async with LocalDesktop(640, 480) as d:
            env = VMEnv(d, cache=ContentCache(d.home.parent / "cache"), chrome_port=relay)
            await env.reset(task)
            with urllib.request.urlopen(f"http://127.0.0.1:{relay}/json/list") as r:
                tabs = [t["url"] for t in json.load(r) if t["type"] == "page"]
            before = await env.evaluate()
            details = [env.last_eval.details]
            step = await env.step(RunShell(CLOSE_TAB.format(port=relay, needle="/extra")))
            after = await env.evaluate()
            details.append(env.last_eval.details)
            await env.close()
            return tabs, before, step, after, details

    tabs, before, step, after, details = aio(play(), timeout=120)
    # OSWorld: the first new tab replaces Chrome's own first tab, so exactly the two pages
    assert sorted(tabs) == sorted([keep, extra]), tabs
    assert "invalid_action" not in step.info, step.info
    assert (before, after) == (0.0, 1.0), details
