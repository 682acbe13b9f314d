"""What changes in an elastic run's membership, said once: every stall, leave and rejoin is one line
(`dilocox: elastic: ...`) and one `elastic` record of metrics.jsonl (docs/design.md §10.1).

    log = MembershipLog(cluster=0, heartbeat_timeout_s=1.0)
    events = log.quorum((0, 1), step=20, ages={2: 7.3})             # cluster 2 left: one ElasticEvent
    events = log.stalled({2: 6.1}, (0, 1, 2), step=20, reason=...)  # named while the others waited on it

Each member of a round sees the same change; the lowest cluster among those that see it prints the line, so it is
printed once. Cluster 0 writes the records (it writes metrics.jsonl), whichever cluster printed the line.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

EVENT = "elastic"
"""The `event` field of a membership record in metrics.jsonl (records without it are the per-step ones)."""


@dataclass(frozen=True)
class ElasticEvent:
    """One change of an elastic run's membership, at the round boundary of inner step `step`."""

    kind: str
    """stalled (named while its peers waited on it in a transfer), left (not in the round's quorum), rejoined."""
    cluster: int
    step: int
    reason: str
    seconds: float | None
    """stalled and left: seconds since its last heartbeat (None: unknown); rejoined: seconds it was out of the run
    on the clock of the cluster that saw it leave (None: it left before that cluster's process started)."""

    def line(self) -> str:
        return f"dilocox: elastic: cluster {self.cluster} {self.kind} at step {self.step}: {self.reason}"

    def record(self) -> dict[str, object]:
        """Its metrics.jsonl record."""
        return {
            "step": self.step,
            "event": EVENT,
            "kind": self.kind,
            "cluster": self.cluster,
            "reason": self.reason,
            "seconds": self.seconds,
        }


class MembershipLog:
    """The membership changes one cluster sees, quorum after quorum; `printer` says whether this cluster prints
    a change (the lowest of the clusters that see it)."""

    def __init__(self, *, cluster: int, heartbeat_timeout_s: float) -> None:
        self.cluster = cluster
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.members: tuple[int, ...] = ()
        """The clusters of the last quorum this cluster was in (empty before its first)."""
        self._left_at: dict[int, float] = {}
        self._stalled: set[int] = set()
        self._rejoined: dict[int, int] = {}
        """The step at which each cluster was last said to rejoin (a quorum's change and a heal say it once)."""

    def quorum(self, clusters: tuple[int, ...], *, step: int, ages: Mapping[int, float]) -> list[ElasticEvent]:
        """The changes from the last quorum to `clusters` (none at this cluster's first quorum): a cluster missing
        (left, unless it was named stalled already) and one back (rejoined). `ages`: seconds since each cluster's
        last heartbeat at the Lighthouse (`stall.cluster_ages`), for the reason a cluster left."""
        previous, self.members = self.members, tuple(clusters)
        if not previous:
            return []
        events = []
        now = time.monotonic()
        for cluster in sorted(set(previous) - set(clusters)):
            self._left_at[cluster] = now
            if cluster in self._stalled:
                continue
            age = ages.get(cluster)
            if age is not None and age > self.heartbeat_timeout_s:
                reason = f"no heartbeat for {age:.1f}s (stopped, frozen, dead or cut off); the others go on without it"
            else:
                reason = "it did not join this round's quorum in time (it failed a collective, or was late)"
            events.append(ElasticEvent("left", cluster, step, reason, age))
        for cluster in sorted(set(clusters) - set(previous)):
            self._stalled.discard(cluster)
            left_at = self._left_at.pop(cluster, None)
            out = None if left_at is None else now - left_at
            reason = "back in the round, healed from a live peer" + ("" if out is None else f" after {out:.1f}s out")
            events.append(ElasticEvent("rejoined", cluster, step, reason, out))
            self._rejoined[cluster] = step
        return events

    def healed(self, clusters: list[int], *, step: int) -> list[ElasticEvent]:
        """Members that healed from a live peer at the boundary of `step` (`MemberReport.healed`) and were not said to
        rejoin there yet: restarted so fast that no quorum went without them."""
        events = []
        for cluster in sorted(clusters):
            if cluster == self.cluster or self._rejoined.get(cluster) == step:
                continue
            self._rejoined[cluster] = step
            self._stalled.discard(cluster)
            reason = "restarted and healed from a live peer (back before any round went without it)"
            events.append(ElasticEvent("rejoined", cluster, step, reason, None))
        return events

    def stalled(
        self, silent: Mapping[int, float], clusters: tuple[int, ...], *, step: int, stall_timeout_s: float
    ) -> list[ElasticEvent]:
        """Members of the quorum `clusters` named stalled in a transfer (`silent`: cluster -> seconds without a
        heartbeat); the live ones settle the round without them."""
        events = []
        for cluster, age in sorted(silent.items()):
            if cluster in self._stalled:
                continue
            self._stalled.add(cluster)
            reason = (
                f"no heartbeat for {age:.1f}s (network.stall_timeout = {stall_timeout_s:g}s) while the others waited "
                "on it in the round's transfer; they settle the round without it"
            )
            events.append(ElasticEvent("stalled", cluster, step, reason, age))
        return events

    def printer(self, clusters: tuple[int, ...], gone: set[int]) -> bool:
        """Whether this cluster is the one that prints a change seen by the members of `clusters` less `gone`."""
        seeing = [cluster for cluster in clusters if cluster not in gone]
        return bool(seeing) and min(seeing) == self.cluster
