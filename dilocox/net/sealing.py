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
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from dilocox.net.accounting import LinkAccount
from dilocox.net.auth import TAG_BYTES, PayloadAuth
from dilocox.net.link import ring_all_gather_bytes
from dilocox.net.staging import HostStaging

NOTHING_ARRIVED = 2
"""A member's verdict on a sender whose payload it did not get (a lane exchange sends each rank only its lanes)."""


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

    def chunks(self, exchange: int, *, signer: PayloadAuth | None = None) -> ChunkSealer:
        """The tags of one program's payload steps (`Wire.all_to_all`), under `signer` (by default the shared key)."""
        return ChunkSealer(self, exchange, signer or self.auth)

    def judge(self, rejected_here: torch.Tensor, exchange: int, *, group: dist.ProcessGroup) -> list[int]:
        """The senders every member of `group` leaves out of an authenticated exchange, from every member's
        rejections (`rejected_here[s]`: this rank rejected sender s's payload; one all-gathered byte per sender): the
        payloads this rank rejected are counted and named in one warning line, and a sender that every other member
        rejected stops the run (`PayloadsRejected`, `rejection_verdict`)."""
        rows = [torch.empty(self.world, dtype=torch.uint8) for _ in range(self.world)]
        dist.all_gather(rows, rejected_here, group=group)
        rejected = [[v == 1 for v in row.tolist()] for row in rows]  # (receivers, senders)
        received = [[v != NOTHING_ARRIVED for v in row.tolist()] for row in rows]
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
        left_out, cut_off = rejection_verdict(rejected, received)
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


class ChunkSealer:
    """The tags of one authenticated program (`WanChannel.launch_program(..., sealed=True)`): a chunk from sender s
    to receiver r is tagged under the program's exchange number, s, and the group with r appended (after a -1, which
    no rank is), so it verifies only where it was sent, in this exchange."""

    def __init__(self, seal: PayloadSeal, exchange: int, signer: PayloadAuth) -> None:
        self.seal = seal
        self.exchange = exchange
        self.signer = signer

    def _group(self, receiver: int) -> tuple[int, ...]:
        return (*self.seal.identity, -1, receiver)

    def seal_chunk(self, chunk: torch.Tensor, receiver: int) -> torch.Tensor:
        """`chunk` (uint8, on the host) followed by its tag for `receiver`."""
        data = self.seal.staging.to_host(chunk)
        tag = self.signer.tag(data.numpy(), seq=self.exchange, sender=self.seal.rank, group=self._group(receiver))
        return torch.cat([data, torch.frombuffer(bytearray(tag), dtype=torch.uint8).to(chunk.device)])

    def open_chunk(self, part: torch.Tensor, sender: int) -> torch.Tensor | None:
        """The bytes of a sealed chunk from `sender` if its tag verifies here, else None."""
        nbytes = part.numel() - TAG_BYTES
        host = self.seal.staging.to_host(part)
        group = self._group(self.seal.rank)
        ok = nbytes >= 0 and self.seal.auth.verify(
            host[:nbytes].numpy(), host[nbytes:].numpy(), seq=self.exchange, sender=sender, group=group
        )
        return part[:nbytes] if ok else None

    def all_to_all(
        self,
        send: Callable[[list[torch.Tensor], list[int]], list[torch.Tensor]],
        chunks: list[torch.Tensor],
        recv_sizes: list[int],
        *,
        group: dist.ProcessGroup,
    ) -> tuple[list[torch.Tensor], list[int], int]:
        """A payload step of `Wire.all_to_all` on an authenticated channel, `send` being the plain step: every
        non-empty chunk travels with its tag (counted as payload bytes); a chunk whose tag does not verify on its
        receiver, or whose sender any member rejected, arrives empty on every member (`PayloadSeal.judge`), so each
        leaves the same senders out. Returns what arrived, the senders left out and the verdicts' control bytes."""
        rank, world = self.seal.rank, self.seal.world
        sealed = [chunk if peer == rank or not chunk.numel() else self.seal_chunk(chunk, peer)
                  for peer, chunk in enumerate(chunks)]  # fmt: skip
        sizes = [n + (TAG_BYTES if n and peer != rank else 0) for peer, n in enumerate(recv_sizes)]
        parts = send(sealed, sizes)
        rejected_here = torch.full((world,), NOTHING_ARRIVED, dtype=torch.uint8)  # (senders,) 1: rejected, 0: kept
        opened = []
        for peer, part in enumerate(parts):
            if peer == rank or not part.numel():
                opened.append(part)
                continue
            data = self.open_chunk(part, peer)
            rejected_here[peer] = data is None
            opened.append(part[:0] if data is None else data)
        left_out = self.seal.judge(rejected_here, self.exchange, group=group)
        control_bytes = ring_all_gather_bytes([world] * world, rank)[0]
        return [part[:0] if peer in left_out else part for peer, part in enumerate(opened)], left_out, control_bytes


def rejection_verdict(
    rejected: Sequence[Sequence[bool]], received: Sequence[Sequence[bool]] | None = None
) -> tuple[list[int], list[int]]:
    """What the members of a group do with the payloads of one authenticated exchange, from every member's verdicts
    (`rejected[r][s]`: member r rejected sender s's payload; `received[r][s]`: r got a payload from s at all, by
    default every member from every other, as in an all-gather). Returns (left_out, cut_off): cut_off, the senders
    that every other member that got their payload rejected; left_out, the cut-off senders and those that any other
    member rejected, which every member leaves out alike, so that they all average the same payloads. A cut-off
    member's own verdicts do not count: it is the odd one out (another key), and the others can go on without it."""
    members = range(len(rejected))
    if received is None:
        received = [[True] * len(rejected) for _ in members]
    cut_off = [
        s
        for s in members
        if any(received[r][s] for r in members if r != s)
        and all(rejected[r][s] for r in members if r != s and received[r][s])
    ]
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
