"""Authenticated slow-link payloads (network.auth_key_file, §5 of docs/design.md): each payload sealed with its
HMAC-SHA256 tag (`PayloadAuth`), opened on arrival, and the members' verdicts on every sender, so that all of them
leave out the same payloads and average the same ones; a cluster whose payload every other member rejected stops the
run (`PayloadsRejected`).

    seal = PayloadSeal(PayloadAuth(key), staging=staging, account=account)
    seal.bind(rank=1, world=3, identity=(0, 4, 8))         # the group, by the global ranks it is named by in tags
    wire = seal.seal(payload, exchange=7)                  # the payload's bytes and their tag, on the host
    payloads = seal.open(wires, payload, 7, group=group)   # None in place of every payload a member rejected
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

from dilocox.net.accounting import LinkAccount
from dilocox.net.auth import TAG_BYTES, PayloadAuth
from dilocox.net.staging import HostStaging


class PayloadsRejected(ValueError):
    """Every other member rejected a cluster's authenticated payload (or no payload verified on every member): the
    same one line on every member of the group, which stops the run rather than let that cluster train apart."""


class PayloadSeal:
    """The tags of one channel's payloads: a payload from sender s in exchange n of a group verifies only under the
    shared key, for that exchange, that sender and that group (its `identity`: the group's global ranks, or an
    elastic round's quorum id and clusters), so a payload replayed from another exchange, sender or group does not.

    A payload that does not verify is counted (`LinkAccount.add_rejected`) and named in one warning line; the members
    then all-gather their verdicts (one byte per sender) and leave out alike every payload that any of them rejected
    (`rejection_verdict`). With `stop_if_cut_off` a payload that every other member rejected stops the run on every
    member; without (an elastic run) only on the cut-off member, which heals from a live peer.
    """

    def __init__(
        self, auth: PayloadAuth, *, staging: HostStaging, account: LinkAccount, stop_if_cut_off: bool = True
    ) -> None:
        self.auth = auth
        self.staging = staging
        self.account = account
        self.stop_if_cut_off = stop_if_cut_off
        self.rank, self.world = 0, 1
        self.identity: tuple[int, ...] = ()
        self.clusters: tuple[int, ...] = ()
        """The cluster of each group rank where it is not the group rank (an elastic round's), for messages."""

    def bind(self, *, rank: int, world: int, identity: Sequence[int], clusters: Sequence[int] = ()) -> None:
        """The group the channel's next exchanges run in: this rank's place in it, its size and its identity."""
        self.rank, self.world = rank, world
        self.identity, self.clusters = tuple(identity), tuple(clusters)

    def seal(self, tensor: torch.Tensor, exchange: int, *, signer: PayloadAuth | None = None) -> torch.Tensor:
        """(nbytes + 32,) uint8 on the host: the bytes of `tensor` followed by their tag for this exchange, under
        `signer` (by default the shared key)."""
        data = self.staging.to_host(tensor).view(torch.uint8)  # (nbytes,)
        tag = (signer or self.auth).tag(data.numpy(), seq=exchange, sender=self.rank, group=self.identity)
        return torch.cat([data, torch.frombuffer(bytearray(tag), dtype=torch.uint8)])

    def open(
        self, sealed: list[torch.Tensor | None], tensor: torch.Tensor, exchange: int, *, group: dist.ProcessGroup
    ) -> list[torch.Tensor | None]:
        """Every payload that the members of `group` kept, as `tensor`'s dtype on its device (this rank's own is
        `tensor`); None for those any of them rejected (`rejection_verdict`)."""
        opened: list[torch.Tensor | None] = []
        rejected_here = torch.zeros(self.world, dtype=torch.uint8)  # (senders,) 1: this rank rejected it, 0: kept
        for sender, wire in enumerate(sealed):
            assert wire is not None
            if sender == self.rank:
                opened.append(tensor)
                continue
            nbytes = wire.numel() - TAG_BYTES
            ok = (
                nbytes >= 0
                and nbytes % tensor.element_size() == 0
                and self.auth.verify(
                    wire[:nbytes].numpy(), wire[nbytes:].numpy(), seq=exchange, sender=sender, group=self.identity
                )
            )
            opened.append(self.staging.to_device(wire[:nbytes].view(tensor.dtype), tensor.device) if ok else None)
            rejected_here[sender] = not ok
        left_out = self.judge(rejected_here, exchange, group=group)
        return [None if sender in left_out else payload for sender, payload in enumerate(opened)]

    def judge(self, rejected_here: torch.Tensor, exchange: int, *, group: dist.ProcessGroup) -> list[int]:
        """The senders every member of `group` leaves out of an authenticated exchange, from every member's
        rejections (`rejected_here[s]`: this rank rejected sender s's payload; one all-gathered byte per sender): the
        payloads this rank rejected are counted and named in one warning line, and a sender that every other member
        rejected stops the run (`PayloadsRejected`, `rejection_verdict`)."""
        rows = [torch.empty(self.world, dtype=torch.uint8) for _ in range(self.world)]
        dist.all_gather(rows, rejected_here, group=group)
        rejected = [[v == 1 for v in row.tolist()] for row in rows]  # (receivers, senders)
        cluster_of = self.clusters or range(self.world)
        mine = [sender for sender, flag in enumerate(rejected_here.tolist()) if flag == 1]
        if mine:
            self.account.add_rejected(len(mine))
            clusters = ", ".join(str(cluster_of[sender]) for sender in mine)
            me = f"cluster {cluster_of[self.rank]}"
            if not self.clusters:  # a static run: the global rank too (an elastic cluster is its own world)
                me = f"rank {dist.get_rank()} ({me})"
            print(
                f"dilocox: warning: {me} rejected the slow-link payload of cluster {clusters} in exchange {exchange}: "
                "its HMAC-SHA256 tag does not verify under network.auth_key_file (another key, or forged or corrupted "
                "on the way); every cluster leaves it out of this exchange",
                file=sys.stderr,
                flush=True,
            )
        left_out, cut_off = rejection_verdict(rejected)
        if self.stop_if_cut_off:
            stop = bool(cut_off) or len(left_out) == self.world
        else:
            stop = self.rank in cut_off
        if stop:
            what = _rejection_message(rejected, cut_off, list(cluster_of), exchange)
            if self.stop_if_cut_off:
                then = (
                    "a cluster whose payloads are refused trains apart from the others"
                    if cut_off
                    else "the clusters have no update in common"
                )
                what += (
                    f"; {then}, so the run stops: give every cluster the same key file, and look for what alters "
                    "payloads on the way if they have it"
                )
            raise PayloadsRejected(what)
        return left_out


def rejection_verdict(rejected: Sequence[Sequence[bool]]) -> tuple[list[int], list[int]]:
    """What the members of a group do with the payloads of one authenticated exchange, from every member's verdicts
    (`rejected[r][s]`: member r rejected sender s's payload). Returns (left_out, cut_off): cut_off, the senders that
    every other member rejected; left_out, the cut-off senders and those that any other member rejected, which every
    member leaves out alike, so that they all average the same payloads. A cut-off member's own verdicts do not
    count: it is the odd one out (another key), and the others can go on without it."""
    members = range(len(rejected))
    cut_off = [s for s in members if len(rejected) > 1 and all(rejected[r][s] for r in members if r != s)]
    judges = [r for r in members if r not in cut_off]
    left_out = [s for s in members if s in cut_off or any(rejected[r][s] for r in judges if r != s)]
    return left_out, cut_off


def _rejection_message(
    rejected: Sequence[Sequence[bool]], cut_off: list[int], clusters: list[int], exchange: int
) -> str:
    """What `PayloadsRejected` says happened: the cut-off clusters (or, with none, who rejected whom) and why."""
    why = (
        f"{'its HMAC-SHA256 tag does' if len(cut_off) == 1 else 'their HMAC-SHA256 tags do'} not verify under "
        "network.auth_key_file: another key there, or payloads forged or corrupted on the way"
    )
    if cut_off:
        named = ", ".join(str(clusters[s]) for s in cut_off)
        what = (
            f"every other cluster rejected the slow-link payload of cluster{'s' if len(cut_off) > 1 else ''} {named} "
            f"in exchange {exchange}"
        )
    else:
        by = [", ".join(str(clusters[r]) for r, row in enumerate(rejected) if row[s]) for s in range(len(rejected))]
        pairs = "; ".join(f"cluster {clusters[s]}'s by cluster {who}" for s, who in enumerate(by) if who)
        what = f"no slow-link payload of exchange {exchange} verified on every cluster (rejected: {pairs})"
    return f"{what} ({why})"
