"""Fixtures for the VM environment tests: a module-scoped event loop and an X check.

The tests start real Xvfb displays, window managers and ``envs.vm.server`` processes on
loopback. Missing X programs fail the tests with the command that installs them (never a
silent skip): CI installs them through the Makefile's ``apt`` target.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from typing import Any

import pytest

from envs.vm.providers import XVFB_INSTALL_HINT, missing_programs

NEEDED = ("Xvfb", "openbox", "xdotool", "wmctrl", "xterm", "nano", "xdpyinfo")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "osworld: needs the osworld extra (desktop-env); skipped without it"
    )


class Loop:
    """Runs coroutines on one event loop that lives as long as the module's desktops."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def __call__(self, coro: Coroutine[Any, Any, Any], timeout: float = 120.0) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    def close(self) -> None:
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()


@pytest.fixture(scope="module")
def aio() -> Iterator[Loop]:
    loop = Loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def xserver() -> None:
    """Fails (does not skip) when the desktop programs are missing."""
    missing = missing_programs(NEEDED)
    if missing:
        pytest.fail(f"the VM env tests need {', '.join(missing)}: {XVFB_INSTALL_HINT}")
