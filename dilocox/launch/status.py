"""Where each cluster of an elastic run stands, shared between its launcher and the ranks of every cluster it runs
(docs/design.md §10.1).

    board = ClusterBoard(num_clusters)              # in the launcher, passed to every process it starts
    board.set(2, ClusterStatus.RESTARTING)          # the launcher starts cluster 2 again
    board.set(2, ClusterStatus.REJOINING)           # cluster 2's ranks, just before they ask to join
    board.restarts_in_progress()                    # any rank of any cluster: {2: True}
"""

from __future__ import annotations

import ctypes
import enum
import multiprocessing
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

_MESSAGE_KEY = "dilocox/launcher/cluster_message"
"""Where a cluster's ranks leave the line their status carries, in the cluster's store (served by the launcher)."""


class ClusterStatus(enum.IntEnum):
    """One cluster's place in an elastic run. The launcher writes the first status of each start and LOST; the
    cluster's ranks write the others."""

    STARTING = 1
    """Its processes were started for the first time and have not met the other clusters yet."""
    RESTARTING = 2
    """Started again after its processes died; not in the run yet."""
    REJOINING = 3
    """A restart that asks to join: set just before it asks the Lighthouse for its first quorum. The end of
    training waits for this (`ElasticMembership.wait_for_restarts`)."""
    JOINED = 4
    """In the run: it met the other clusters in a quorum (a restart healed from a live peer there)."""
    NO_LIVE_PEER = 5
    """A restart found no other cluster alive to heal from; its ranks exit with `EXIT_NO_PEER` and say why (the
    board's `message`). Not started again."""
    LOST = 6
    """The launcher gave up on it: not started again, or stopped because the run ended without it."""


_IN_PROGRESS = (ClusterStatus.RESTARTING, ClusterStatus.REJOINING, ClusterStatus.NO_LIVE_PEER)
"""A restart that has not joined the run and that its launcher has not given up on."""


class ClusterBoard:
    """The status of every cluster one launcher runs, one byte per cluster in memory shared with every process the
    launcher starts (passed to each at its start, through the fork server): a write is seen at once by the launcher
    and by the ranks of the other clusters, which read it at the end of training. A byte is written whole, so there
    is no lock that a killed process could leave held, and each start overwrites the last one's status.

        board = ClusterBoard(3)
        board.set(0, ClusterStatus.STARTING)
        board.get(0)                               # ClusterStatus.STARTING; None for a cluster never started here
    """

    def __init__(self, num_clusters: int) -> None:
        self._status = multiprocessing.get_context("forkserver").RawArray(ctypes.c_uint8, num_clusters)

    def get(self, cluster: int) -> ClusterStatus | None:
        value = self._status[cluster]
        return ClusterStatus(value) if value else None

    def set(self, cluster: int, status: ClusterStatus) -> None:
        self._status[cluster] = status

    def report(self, cluster: int, status: ClusterStatus, message: str, *, store: dist.Store) -> None:
        """Set `status` with the line that says why, left in the cluster's `store` first, so that whoever sees the
        status finds its line (`message`)."""
        store.set(_MESSAGE_KEY, message)
        self.set(cluster, status)

    @staticmethod
    def message(store: dist.Store) -> str:
        """The line of the status a cluster reported (`report`), from its store."""
        return store.get(_MESSAGE_KEY).decode()

    def restarts_in_progress(self) -> dict[int, bool]:
        """The clusters started again that have not joined the run yet (and that the launcher has not given up on),
        each with whether it has asked to join: `ElasticMembership.restarts` of every rank this launcher starts."""
        in_progress = {c: ClusterStatus(s) for c, s in enumerate(self._status) if s in _IN_PROGRESS}
        return {c: status is not ClusterStatus.RESTARTING for c, status in in_progress.items()}
