"""How the members of an elastic round boundary agree on the way on (docs/design.md §10.1).

The members of a boundary's quorum each tell the others what they hold of the sync in flight (`MemberReport`, one
small all-reduce: `exchange_reports`), and all reach the same verdict on it (`delayed_update_verdict`); a member whose
outer params are not the agreed ones is found by their digests (`outer_digest`, `diverged_members`). The ranks of one
cluster, each settling its own stage, then take the same way at every step (`ClusterVote`: the most severe `Branch`
any of them saw).

    reports = exchange_reports(mine, group=quorum.control, timeout=control)
    verdict = delayed_update_verdict(num_holding=..., num_not_ok=...)   # apply, redo or nothing
    branch = ClusterVote(membership.cluster_group).most_severe(Branch.REDO)
"""

from __future__ import annotations

import datetime
import enum
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dilocox.elastic.membership import ElasticError, summed

APPLY, REDO, NOTHING = "apply", "redo", "nothing"


class RejoinRequired(RuntimeError):
    """This cluster's state is not its peers' (it missed a commit, or applied another average): its process stops,
    so that its launcher restarts it and it heals from a live peer."""


def delayed_update_verdict(*, num_holding: int, num_not_ok: int) -> str:
    """What the clusters of a quorum do with the sync of the last round, still in flight (one-step delay).

    Every member says whether it holds a share of it (`num_holding` counts those that do) and whether that share
    arrived whole in this very quorum (`num_not_ok` counts the members for which it did not: it failed, it was
    launched in another quorum, or the member has none, being new). Both counts are summed over the quorum, so every
    member reaches the same verdict:
    - `nothing`: no member holds one (the first round, or a blocking sync);
    - `apply`: every member got the whole average in an unchanged quorum: apply it, as a static run would;
    - `redo`: the members that hold a share send it again over the new quorum (the same bytes) and the others
      abstain, so the average is over the clusters that delivered and are still alive.
    """
    if num_holding == 0:
        return NOTHING
    return APPLY if num_not_ok == 0 else REDO


@dataclass(frozen=True)
class MemberReport:
    """What one member of a boundary's quorum tells the others before the sync in flight is settled."""

    holding: bool
    """It holds a share of the sync in flight (an abstaining sender's too), or, just healed, its peers do."""
    ok: bool
    """Its share arrived whole, in this very quorum."""
    restart_missing: bool
    """End of training: a cluster its launcher is starting again is not in this quorum (it asked too late)."""
    digest: int
    """`outer_digest` of its outer params, which every member must hold bit for bit."""
    config: int = 0
    """`agreement.settings_fingerprint` of its run's settings and payload key: clusters started on several machines
    with different configs stop with one line at their first boundary instead of averaging what does not belong
    together."""
    healed: bool = False
    """It healed from a live peer at this boundary (a restart, or a cluster that joined late): its peers record the
    rejoin, also when it was back so fast that no quorum ever went without it."""


def outer_digest(outer_params: torch.Tensor) -> int:
    """A fingerprint of fp32 outer params: the wrapping int64 sum of their bit patterns. Integer addition is
    associative, so it is the same on every device and for any reduction order; one flipped bit changes it."""
    return int(outer_params.detach().view(torch.int32).sum(dtype=torch.int64))


def diverged_members(digests: Sequence[int]) -> list[int]:
    """The group ranks whose outer params are not the agreed ones: the digest most members hold, ties going to the
    one of the lowest rank. Empty when all agree."""
    counts = Counter(digests)
    agreed = max(digests, key=lambda digest: (counts[digest], -digests.index(digest)))
    return [rank for rank, digest in enumerate(digests) if digest != agreed]


def exchange_reports(
    report: MemberReport, *, group: dist.ProcessGroup, timeout: datetime.timedelta
) -> list[MemberReport]:
    """Every member's report, in group rank order: one small all-reduce over `group` of a table in which each member
    fills its own row (`summed`, bounded by `timeout`). A group of one returns its own report."""
    if group.size() == 1:
        return [report]
    table = torch.zeros(group.size(), 6, dtype=torch.int64)  # (members, fields)
    table[group.rank()] = torch.tensor(
        [report.holding, report.ok, report.restart_missing, report.digest, report.config, report.healed]
    )
    summed(table, group=group, timeout=timeout)
    return [MemberReport(bool(h), bool(o), bool(r), int(d), int(c), bool(e)) for h, o, r, d, c, e in table.tolist()]


def exchange_settings(
    settings: dict[str, Any], *, group: dist.ProcessGroup, timeout: datetime.timedelta
) -> list[dict[str, Any]]:
    """Every member's `agreement.run_settings`, in group rank order, when their fingerprints differ: two small
    all-reduces over `group` (the JSON's lengths, then its bytes, each member filling its own row), bounded by
    `timeout`. Control traffic, once, just before the run stops. A length above `_MAX_SETTINGS_BYTES` is refused
    before anything of that size is allocated."""
    data = json.dumps(settings, sort_keys=True).encode()
    size, rank = group.size(), group.rank()
    lengths = torch.zeros(size, dtype=torch.int64)
    lengths[rank] = len(data)
    summed(lengths, group=group, timeout=timeout)
    if not all(0 <= n <= _MAX_SETTINGS_BYTES for n in lengths.tolist()):
        raise ElasticError(f"a member of the round declared settings of {lengths.tolist()} bytes: not dilocox's")
    table = torch.zeros(size, int(lengths.max()), dtype=torch.int64)  # (members, bytes)
    table[rank, : len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
    summed(table, group=group, timeout=timeout)
    described = []
    for row, length in zip(table.tolist(), lengths.tolist(), strict=True):
        try:
            described.append(json.loads(bytes(row[:length])))
        except (ValueError, UnicodeDecodeError):
            described.append({})
    return described


_MAX_SETTINGS_BYTES = 256 << 10
"""The most bytes a member may declare for its settings as JSON (about 5 KB)."""


class Branch(enum.IntEnum):
    """The way a rank goes at one step of a boundary, ordered by severity: the ranks of a cluster take the most
    severe one any of them saw (`ClusterVote`)."""

    GO_ON = 0
    """Nothing happened that changes the way (a transfer arrived, a quorum formed)."""
    NOTHING = 1
    """No member holds a sync in flight (`delayed_update_verdict`)."""
    APPLY = 2
    """Every member got the whole average in an unchanged quorum."""
    REDO = 3
    """The members that hold a share send it again over the new quorum."""
    MEET_AGAIN = 4
    """A restarted cluster is missing from the quorum at the end of training: meet again with it."""
    FAILED = 5
    """A collective of the round failed, or a member diverged: report it and settle in a new quorum."""
    REJOIN = 6
    """This cluster is cut off or holds other outer params: it stops, and heals once restarted."""


VERDICT_BRANCH = {NOTHING: Branch.NOTHING, APPLY: Branch.APPLY, REDO: Branch.REDO}


class ClusterVote:
    """The ranks of one cluster take the same branch at every step of an elastic boundary.

    Each rank settles its own stage's sync (its slice, with several data-parallel replicas) with the same rank of the
    other clusters, over a slow-link group of its own, so what one rank sees (a transfer that failed, a quorum that
    did not form, a member that diverged) may differ from what another rank of its cluster sees. torchft meets all
    ranks of a cluster at every quorum and commit, and the stages and replicas meet in the fast collectives that
    follow a transfer, so a rank that went its own way would hold its whole cluster until network.timeout. Each rank
    says its branch and all take the most severe (one MAX all-reduce of one value over the cluster's own group, on
    the fast link). A cluster of one rank needs no vote.

        vote = ClusterVote(membership.cluster_group)
        branch = vote.most_severe(Branch.REDO)   # REDO, or a more severe branch another rank took
        failed = vote.any_failed(error)          # a step that failed on any rank (error: this rank's, or None)
    """

    def __init__(self, group: dist.ProcessGroup | None, *, cluster: int = 0) -> None:
        self.group = group
        self.cluster = cluster
        self.size = 1 if group is None else group.size()

    def most_severe(self, branch: Branch) -> Branch:
        """The most severe of the cluster's ranks' `branch`es. A rank of this cluster that does not answer (it died or
        hangs) stops this one too: its launcher restarts the whole cluster, which heals from a live peer."""
        if self.size == 1:
            return branch
        assert self.group is not None
        value = torch.tensor([int(branch)], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        try:
            self.group.allreduce([value], options).wait()
        except RuntimeError as error:
            raise RejoinRequired(
                f"a rank of cluster {self.cluster} did not answer its cluster's vote ({error}); this rank stops, so "
                "that its launcher restarts the whole cluster and it heals from a live peer"
            ) from None
        return Branch(int(value))

    def any_failed(self, failure: BaseException | None) -> bool:
        """Whether a step failed on any rank of the cluster; `failure`: this rank's error, None where it passed."""
        return self.most_severe(Branch.FAILED if failure else Branch.GO_ON) is Branch.FAILED
