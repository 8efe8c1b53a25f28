"""The X display side of ``envs.vm.server``: screenshots, pointer, windows, accessibility tree.

``XScreen`` talks to the X server through python-xlib (and PIL for the capture); window lists
come from ``wmctrl``; the accessibility tree from AT-SPI (pyatspi) when the VM has it.
"""

from __future__ import annotations

import io
import os
import threading
import time
from typing import Any, Protocol
from xml.sax.saxutils import quoteattr

import numpy as np

from envs.vm.server_exec import run_limited


class Screen(Protocol):
    """What the server needs from a display (``XScreen``; tests pass a fake)."""

    display_name: str | None

    def size(self) -> tuple[int, int]: ...

    def cursor_position(self) -> tuple[int, int]: ...

    def screenshot_png(self) -> tuple[bytes, float, float]: ...


class XScreen:
    """Screenshots (cursor composited in), pointer position and screen size of one X display.

    One python-xlib connection guarded by a lock: python-xlib connections are not thread-safe and
    the handlers call this from worker threads.
    """

    def __init__(self, display_name: str | None = None):
        from Xlib import display as xdisplay  # the server runs where python-xlib is installed

        self.display_name = display_name or os.environ.get("DISPLAY")
        if not self.display_name:
            raise RuntimeError(
                "envs.vm.server needs an X display: set DISPLAY (e.g. start `Xvfb :1` and run "
                "with DISPLAY=:1)"
            )
        self._lock = threading.Lock()
        self._dpy = xdisplay.Display(self.display_name)
        self._root = self._dpy.screen().root
        self._has_xfixes = self._dpy.has_extension("XFIXES")
        if self._has_xfixes:
            self._dpy.xfixes_query_version()

    def size(self) -> tuple[int, int]:
        # The root window's live geometry: screen().width_in_pixels is python-xlib's copy of the
        # connection setup data and stays stale after a resolution change (xrandr).
        with self._lock:
            g = self._root.get_geometry()
            return int(g.width), int(g.height)

    def cursor_position(self) -> tuple[int, int]:
        with self._lock:
            p = self._root.query_pointer()
            return int(p.root_x), int(p.root_y)

    def _cursor_sprite(self) -> tuple[np.ndarray, int, int] | None:
        """(u8[h, w, 4] RGBA sprite, top-left x, top-left y) of the current cursor, or None."""
        if not self._has_xfixes:
            return None
        with self._lock:
            r = self._dpy.xfixes_get_cursor_image(self._root)
        if r.width == 0 or r.height == 0:
            return None
        # XFixes gives premultiplied ARGB as one u32 per pixel.
        argb = np.asarray(r.cursor_image, dtype=np.uint32).reshape(r.height, r.width)
        rgba = np.stack(
            [(argb >> 16) & 255, (argb >> 8) & 255, argb & 255, (argb >> 24) & 255], axis=-1
        ).astype(np.uint8)
        return rgba, int(r.x) - int(r.xhot), int(r.y) - int(r.yhot)

    def screenshot(self):
        """A PIL RGB image of the whole screen with the cursor drawn in (like OSWorld's)."""
        from PIL import Image, ImageGrab

        img = ImageGrab.grab(xdisplay=self.display_name).convert("RGB")
        try:
            sprite = self._cursor_sprite()
        except Exception:  # a cursor-less screenshot beats no screenshot
            sprite = None
        if sprite is not None:
            rgba, x0, y0 = sprite
            cur = Image.fromarray(rgba, "RGBA")
            img.paste(cur, (x0, y0), cur)
        return img

    def screenshot_png(self) -> tuple[bytes, float, float]:
        """(PNG bytes, seconds to capture, seconds to encode)."""
        t0 = time.perf_counter()
        img = self.screenshot()
        t1 = time.perf_counter()
        buf = io.BytesIO()
        # compress_level=1: several times faster than the default on a full screen, and still
        # a plain PNG (OSWorld's clients only decode it).
        img.save(buf, format="PNG", compress_level=1)
        return buf.getvalue(), t1 - t0, time.perf_counter() - t1


def parse_wmctrl(out: str) -> list[dict[str, Any]]:
    """Rows of ``wmctrl -lGx``: id, desktop, x, y, w, h, class, name."""
    wins = []
    for line in out.splitlines():
        parts = line.split(None, 8)
        if len(parts) < 8:
            continue
        wins.append(
            {
                "id": parts[0],
                "desktop": parts[1],
                "x": int(parts[2]),
                "y": int(parts[3]),
                "w": int(parts[4]),
                "h": int(parts[5]),
                "class": parts[6],
                "name": parts[8] if len(parts) > 8 else "",
            }
        )
    return wins


async def wmctrl_windows() -> list[dict[str, Any]]:
    """The top-level windows (``parse_wmctrl`` rows); empty when wmctrl fails."""
    rc, out, _ = await run_limited(["wmctrl", "-lGx"], shell=False, limit_s=10)
    return parse_wmctrl(out) if rc == 0 else []


def windows_xml(wins: list[dict[str, Any]], note: str) -> str:
    """The accessibility fallback: top-level windows as XML under a ``note`` saying so."""
    items = "".join(
        f"<window name={quoteattr(w['name'])} class={quoteattr(w['class'])} "
        f'x="{w["x"]}" y="{w["y"]}" width="{w["w"]}" height="{w["h"]}"/>'
        for w in wins
    )
    return f"<desktop-frame note={quoteattr(note)}>{items}</desktop-frame>"


def atspi_tree() -> str:
    """The AT-SPI tree as XML (names/roles/extents); raises when pyatspi is unavailable."""
    import pyatspi  # only in VMs with the accessibility stack (python3-pyatspi)

    def node(acc, depth: int) -> str:
        if depth > 50:
            return ""
        role = acc.getRoleName().replace(" ", "-") or "unknown"
        try:
            ext = acc.queryComponent().getExtents(pyatspi.DESKTOP_COORDS)
            geo = f' x="{ext.x}" y="{ext.y}" width="{ext.width}" height="{ext.height}"'
        except Exception:
            geo = ""
        kids = "".join(node(acc.getChildAtIndex(i), depth + 1) for i in range(acc.childCount))
        return f"<{role} name={quoteattr(acc.name or '')}{geo}>{kids}</{role}>"

    return node(pyatspi.Registry.getDesktop(0), 0)


def atspi_terminal_text() -> str:
    """The text of the first terminal in the AT-SPI tree (raises without pyatspi or one)."""
    import pyatspi

    desktop = pyatspi.Registry.getDesktop(0)
    for app in desktop:
        for acc in pyatspi.findAllDescendants(app, lambda a: a.getRoleName() == "terminal"):
            return acc.queryText().getText(0, -1)
    raise LookupError("no terminal found in the AT-SPI tree")
