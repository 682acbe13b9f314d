"""dilocox: train language models across decentralized clusters joined by slow links (DiLoCoX).

The public API for a training loop of your own (docs/api.md):

    import dilocox
    with dilocox.OuterSync(model, inner_optimizer, cluster_group=group, inner_steps=50) as sync:
        ...; inner_optimizer.step(); sync.step()

The names below load on first use, so `import dilocox` (and the `dilocox` command's start) stays fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "CompressionConfig",
    "OuterSync",
    "RoundStats",
    "SyncConfig",
    "Topology",
    "WanChannel",
    "build_process_groups",
]

_HOMES = {
    "CompressionConfig": "dilocox.compress.config",
    "OuterSync": "dilocox.sync.outer",
    "RoundStats": "dilocox.sync.base",
    "SyncConfig": "dilocox.sync.config",
    "Topology": "dilocox.topology",
    "WanChannel": "dilocox.net.channel",
    "build_process_groups": "dilocox.topology",
}
"""Where each public name is defined."""

if TYPE_CHECKING:
    from dilocox.compress.config import CompressionConfig
    from dilocox.net.channel import WanChannel
    from dilocox.sync.base import RoundStats
    from dilocox.sync.config import SyncConfig
    from dilocox.sync.outer import OuterSync
    from dilocox.topology import Topology, build_process_groups


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'dilocox' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
