"""File access for ``envs.vm.server``: the allowed-roots guard, directory trees, upload writes."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

MAX_LIST_ENTRIES = 5000  # /list_directory walks at most this many entries


class PathGuard:
    """Confines file endpoints to allowed root directories (symlinks and ``..`` resolved)."""

    def __init__(self, roots: Sequence[str | os.PathLike]):
        self.roots = [Path(r).expanduser().resolve() for r in roots]

    def check(self, raw: str) -> Path:
        """The resolved path, or raises ``web.HTTPForbidden`` when it leaves every root."""
        if not isinstance(raw, str) or not raw or "\x00" in raw:
            raise web.HTTPForbidden(text=f"bad path {raw!r}")
        p = Path(os.path.expanduser(raw))
        if not p.is_absolute():
            p = Path.home() / p
        resolved = p.resolve()  # follows symlinks, so a link out of a root is caught too
        for root in self.roots:
            if resolved == root or resolved.is_relative_to(root):
                return resolved
        allowed = ", ".join(str(r) for r in self.roots)
        raise web.HTTPForbidden(text=f"path {raw!r} is outside the allowed roots ({allowed})")


def directory_tree(path: Path, max_entries: int = MAX_LIST_ENTRIES) -> dict[str, Any]:
    """OSWorld's ``{"type", "name", "children"}`` tree under ``path``, entries sorted by name.

    Symlinked directories are listed as files (never followed); at most ``max_entries`` entries
    are visited in all, depth first; an unreadable directory has no children.
    """
    budget = [max_entries]

    def tree(p: Path) -> dict[str, Any]:
        node: dict[str, Any] = {"type": "directory", "name": p.name, "children": []}
        try:
            entries = sorted(os.scandir(p), key=lambda e: e.name)
        except OSError:
            return node
        for e in entries:
            if budget[0] <= 0:
                break
            budget[0] -= 1
            if e.is_dir(follow_symlinks=False):
                node["children"].append(tree(Path(e.path)))
            else:
                node["children"].append({"type": "file", "name": e.name})
        return node

    return tree(path)


def write_upload(path: Path, data: Any) -> None:
    """Writes a form field (an aiohttp ``FileField``, whose body aiohttp spooled to a temp file,
    or plain ``str``/``bytes``) to ``path``, creating its parent directories."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if hasattr(data, "file"):
        data.file.seek(0)
        with open(path, "wb") as f:
            shutil.copyfileobj(data.file, f, 1024 * 1024)
    else:
        path.write_bytes(data if isinstance(data, bytes | bytearray) else str(data).encode())
