"""The fork server that local ranks are forked from (docs/design.md §7).

The local launcher forks every rank from one server process that imported torch and the trainer once, instead of
each rank importing them (about 2 s of CPU per rank). Starting that server is itself an import of torch (about
2 s), so `dilocox train` starts it first thing (`start_early`), and the server's imports run while the launcher
imports, reads and checks the config and prepares the run directory. This module imports nothing heavy: it runs
before torch is imported.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import tomllib
from collections.abc import Sequence

LOCAL_PRELOAD = ("torch", "torch._dynamo", "dilocox.launch.local", "dilocox.trainer")
"""What the fork server of a static local run imports once. torch._dynamo: building the model on the meta device
imports it (nn.Embedding's init goes through torch._refs), about 2 s of CPU that every rank paid again after the fork
otherwise; preloaded, a 2-step debug run ends about 1.2 s sooner (6.3-6.9 s -> 5.2-5.5 s on this machine)."""
ELASTIC_PRELOAD = (*LOCAL_PRELOAD, "dilocox.launch.elastic", "torchft", "dilocox.elastic.membership")
"""What the fork server of an elastic run imports once, before the first cluster starts: a restart is in its peers'
run about a second after it starts, instead of the 5-20 s a fresh interpreter takes on 2 busy cores."""


def start(preload: Sequence[str]) -> None:
    """Start this process's fork server with `preload` imported, unless it runs already (then it keeps its own)."""
    multiprocessing.set_forkserver_preload(list(preload))
    multiprocessing.forkserver.ensure_running()


def start_early(config_path: str | None, overrides: Sequence[str]) -> None:
    """Start the fork server that `launch_local` will fork ranks from, before torch is imported here (the caller
    knows the run is launched locally, not under torchrun). A guess from the raw arguments: an elastic run
    (`topology.elastic` in the file or the overrides) starts a server with `ELASTIC_PRELOAD` itself. A wrong guess
    costs time, never correctness: a rank imports whatever its server did not."""
    if any(o.startswith("--topology.elastic") for o in overrides):
        return
    if config_path:
        try:
            with open(config_path, "rb") as f:
                if tomllib.load(f).get("topology", {}).get("elastic", False):
                    return
        except (OSError, ValueError):  # the config's own loading reports what is wrong with it
            return
    start(LOCAL_PRELOAD)
