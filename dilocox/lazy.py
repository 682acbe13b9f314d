"""Packages whose public names load on first use, so that importing one light module of a package (a config
dataclass) does not import the rest, nor torch: `dilocox train --help` reads every option without it.

    __getattr__, __dir__, __all__ = lazy_exports(__name__, {"dilocox.compress.factory": ("build_codec",)})
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: str, homes: dict[str, tuple[str, ...]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """The module `__getattr__` (PEP 562), `__dir__` and `__all__` of `package`, whose names live in the modules of
    `homes` (module -> names) and are imported from there when first read."""
    where = {name: module for module, names in homes.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *where})

    return __getattr__, __dir__, sorted(where)
