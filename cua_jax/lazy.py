"""Package names imported on first use (PEP 562), for packages whose light modules must load
without the heavy ones (JAX):

    __getattr__, __dir__, __all__ = lazy.exports(__name__, {"Engine": "cua_jax.sampler.engine"})
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def exports(
    package: str, names: dict[str, str], *, submodules: bool = False
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """(`__getattr__`, `__dir__`, `__all__`) for `package`: each of `names` is read from its
    module when first asked for; with `submodules`, any other name is tried as a submodule
    (`package.model`), as an eagerly imported package would have it."""
    public = sorted(names)

    def __getattr__(name: str) -> Any:
        if name in names:
            return getattr(importlib.import_module(names[name]), name)
        if submodules:
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{package}.{name}":  # a submodule's own missing dependency
                    raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return public

    return __getattr__, __dir__, public
