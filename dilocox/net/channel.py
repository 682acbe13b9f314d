"""The WAN channel: the one object through which every collective on the slow `cluster_group` goes (§5 of
docs/design.md). `WanChannel` composes three parts, a module each: the transport (`dilocox.net.transport`: the
communicator thread, `Wire` programs), the link's accounting and emulation (`dilocox.net.accounting`) and the
authentication of payloads (`dilocox.net.sealing`)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dilocox.net.accounting import STAT_KEYS, LinkAccount
from dilocox.net.auth import TAG_BYTES, PayloadAuth
from dilocox.net.clock import Clock, MonotonicClock
from dilocox.net.link import parse_bandwidth, parse_duration, ring_all_gather_bytes, ring_all_reduce_bytes
from dilocox.net.sealing import PayloadSeal, PayloadsRejected, rejection_verdict
from dilocox.net.staging import HostStaging
from dilocox.net.transport import Communicator, LocalWire, Outcome, PendingTransfer, ResultT, Wire, gather_payloads

__all__ = [
    "PayloadsRejected",
    "PendingTransfer",
    "WanChannel",
    "Wire",
    "rejection_verdict",
    "ring_all_gather_bytes",
    "ring_all_reduce_bytes",
]

_REDUCE_OPS = ("sum", "avg")
_LENGTH_BYTES = 8  # one int64 element count per rank in the length exchange of an all-gather


def _counter(name: str) -> property:
    """A read-only view of one of the account's counters (`WanChannel.stats`)."""
    return property(lambda self: self.account.read(name), doc=f"`stats()['{name}']`.")


class WanChannel:
    """Every collective on the slow `cluster_group`, with exact byte counts and an emulated FIFO link (DiLoCoX §5).

        with WanChannel.from_strings(groups.cluster_group, bandwidth="1Gbps", latency="10ms", num_sharing=dp) as ch:
            transfer = ch.launch_all_reduce(shard, op="avg")   # returns at once; the link works in the background
            avg_shard = transfer.wait()                        # blocked time is counted in ch.exposed_s

    Collectives run in launch order on one background thread (so every rank issues the same sequence on the
    group), each as a real blocking gloo collective. In emulation mode (`bandwidth` in bytes/s) the thread then
    sleeps until a `LinkModel` says the transfer arrived: it starts when launched and the previous transfer has
    left the wire, occupies it for `max(sent, recv) / bandwidth` (full duplex) and lands one `latency_s` later;
    latency is paid once per collective and pipelined. If the real collective is slower, completion is later.
    `bandwidth=None` turns emulation off: no sleeping (latency is ignored) and link time is the measured time of
    the real collective.

    Sharing model: `bandwidth` is the uplink of one cluster (DiLoCoX: 8 GPUs of a node share its 1 Gbps). The
    `num_sharing` ranks of a cluster that use the slow link at the same time (the dp replicas syncing their
    shards together) get an even share each: this rank's link model runs at `bandwidth / num_sharing`. Equal
    shards launched together therefore finish when one cluster-wide transfer of their sum would.

    `group` None or a group of one (a single cluster) makes every operation a local no-op that moves 0 bytes.
    Note that None means "no slow link", not the default group. Counters (`stats()`) cover completed transfers:
    payload bytes by the ring conventions of `dilocox.net.link` (unpadded), `control_bytes` for the length
    exchange of all-gathers (and, on a real link, the one value all-reduced before each all-reduce), `link_busy_s` as
    the union of the link model's [start, done] intervals (when unlimited, the measured collective time after every
    peer had joined: those two exchanges tell when), and the
    trainer's time blocked in `wait()` in two parts: `exposed_s` until the link would have delivered, the
    communication training did not hide, and `peer_wait_s` after that, waiting for a cluster that sent late.

    `auth` (a `PayloadAuth` of network.auth_key_file) tags every all-gathered payload and checks every peer's tag
    (docs/design.md §5): `payloads_rejected` counts a payload that fails and one warning line names its cluster.
    The members then exchange their verdicts (one byte per sender, a second step of the all-gather counted in
    `control_bytes`), and `wait()` returns None in place of every payload that a member rejected
    (`rejection_verdict`), this rank's own included, so that every member averages the same payloads. A payload that
    every other member rejected (its cluster holds another key, or someone forges its payloads) fails the transfer
    with `PayloadsRejected` on every member, which stops the run; with `stop_if_cut_off` False (an elastic run) only
    on the cut-off member, which heals from a live peer, while the others go on without it. Summed collectives cannot
    be checked per sender, so an authenticated channel refuses all-reduces and programs.

    `clock` (default: real time) stamps launches and completions, holds each emulated transfer until its arrival and
    times the trainer's waits; a virtual clock makes the emulated schedule exact whatever the machine's load.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        *,
        bandwidth: float | None,
        latency_s: float,
        num_sharing: int = 1,
        auth: PayloadAuth | None = None,
        stop_if_cut_off: bool = True,
        clock: Clock | None = None,
    ) -> None:
        if isinstance(num_sharing, bool) or not isinstance(num_sharing, int) or num_sharing < 1:
            raise ValueError(
                f"num_sharing = {num_sharing!r} must be an int >= 1: the number of ranks of a cluster that use its "
                "uplink at the same time (topology.dp_degree for a sharded outer sync, 1 otherwise)"
            )
        self.clock: Clock = MonotonicClock() if clock is None else clock
        """Stamps launches and completions, holds emulated transfers and times the trainer's waits."""
        self.account = LinkAccount(None if bandwidth is None else bandwidth / num_sharing, latency_s, self.clock)
        """The link's numbers (bytes, busy time, the trainer's waits, the peak in flight) and its emulation."""
        self.group = group
        self.num_sharing = num_sharing
        self.latency_s = latency_s
        self.uplink_bytes_per_s = bandwidth
        if group is None:
            self.world_size, self.group_rank = 1, 0
        else:
            self.world_size, self.group_rank = dist.get_world_size(group), dist.get_rank(group)
            if self.group_rank < 0:
                raise ValueError("this rank is not a member of the WanChannel's group: pass its own cluster_group")
        self.clusters: tuple[int, ...] = tuple(range(self.world_size))
        """The cluster of each group rank (an elastic round's members, `rebind`)."""
        self.staging = HostStaging()  # device payloads cross through pinned host buffers on a side stream
        self.communicator = Communicator(self.account, self.staging)
        """The thread that runs the collectives, in launch order."""
        # A tag names the group by its global ranks: a payload of another group (another stage) does not verify.
        self._group_ranks = () if group is None else tuple(dist.get_process_group_ranks(group))
        self._identity = self._group_ranks  # an elastic round's group: its quorum id and clusters (`rebind`)
        self.seal: PayloadSeal | None = None
        """With `auth`: the tags of this rank's payloads and the verdicts on its peers' (`PayloadSeal`)."""
        if auth is not None:
            self.seal = PayloadSeal(auth, staging=self.staging, account=self.account, stop_if_cut_off=stop_if_cut_off)
            self.seal.bind(rank=self.group_rank, world=self.world_size, identity=self._identity)
        self._next_signer: PayloadAuth | None = None  # the key of the next sealed payload (`sign_next_with`)

    @classmethod
    def from_strings(
        cls,
        group: dist.ProcessGroup | None,
        *,
        bandwidth: str,
        latency: str,
        num_sharing: int = 1,
        auth: PayloadAuth | None = None,
    ) -> WanChannel:
        """Build from the `[network]` config strings, e.g. `bandwidth="1Gbps", latency="10ms"`."""
        return cls(
            group,
            bandwidth=parse_bandwidth(bandwidth),
            latency_s=parse_duration(latency),
            num_sharing=num_sharing,
            auth=auth,
        )

    # ----------------------------------------------------------------------------------------- properties

    @property
    def emulated(self) -> bool:
        """True when a finite bandwidth is emulated (completion waits for the link model)."""
        return self.account.link is not None

    @property
    def bytes_per_s(self) -> float | None:
        """This rank's share of the uplink: `bandwidth / num_sharing` (None when unlimited)."""
        return self.account.bytes_per_s

    bytes_sent = _counter("bytes_sent")
    bytes_recv = _counter("bytes_recv")
    control_bytes = _counter("control_bytes")
    link_busy_s = _counter("link_busy_s")
    exposed_s = _counter("exposed_s")
    peer_wait_s = _counter("peer_wait_s")
    num_transfers = _counter("num_transfers")
    payloads_rejected = _counter("payloads_rejected")
    peak_in_flight_bytes = _counter("peak_in_flight_bytes")
    """The most payload bytes this rank had launched on the link and not yet delivered at any one time (the sum of
    `nbytes_sent` over the accounted transfers whose [launch, done] spans that time): the burst the link must carry
    at once; transfers launched `off_peak` (the end-of-run drain) do not count. Exact in emulation, where launch and
    arrival are the link model's times."""

    @property
    def num_in_flight(self) -> int:
        """Transfers launched and not yet completed (or failed), the one on the communicator thread included."""
        return self.communicator.num_in_flight

    @contextlib.contextmanager
    def off_peak(self) -> Iterator[None]:
        """Transfers launched inside do not count towards `peak_in_flight_bytes`: the end of training's one-off
        transfers (the drain of the held-back residual), so the peak is that of the rounds' syncs."""
        with self.account.off_peak():
            yield

    @property
    def tag_bytes(self) -> int:
        """Bytes added to every all-gathered payload: an HMAC-SHA256 tag with `auth`, else 0."""
        return 0 if self.seal is None else TAG_BYTES

    def stats(self) -> dict[str, float | int]:
        """Cumulative counters: bytes_sent, bytes_recv, control_bytes, link_busy_s, exposed_s (waited for the
        link), peer_wait_s (waited for late peers), num_transfers, payloads_rejected (peers' payloads whose tag did
        not verify, counted even when not accounted), and the peak_in_flight_bytes so far."""
        return self.account.stats()

    def state_dict(self) -> dict[str, float | int]:
        """The counters, so cumulative metrics survive a checkpoint resume (the link's clock does not), and the
        number of collectives launched, which numbers the tags of authenticated payloads."""
        launched = self.communicator.num_launched
        return {**self.stats(), "num_launched": launched}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Restore counters saved by `state_dict()`; call before launching transfers."""
        missing = [k for k in STAT_KEYS if k not in state]
        if missing:
            raise ValueError(f"WanChannel state is missing {missing}; expected the keys of WanChannel.state_dict()")
        self.account.load_state_dict(state)
        # Every rank of the group saved the same count at the same step, so the resumed ranks keep numbering their
        # exchanges alike (a state saved before it existed restarts at 0 on every rank alike).
        self.communicator.number_from(submitted=int(state["num_transfers"]), launched=int(state.get("num_launched", 0)))

    def rebind(
        self, group: dist.ProcessGroup, *, identity: Sequence[int] | None = None, clusters: Sequence[int] = ()
    ) -> None:
        """Carry later collectives over `group`, the slow link of an elastic run's new round (torchft reconfigures
        it when clusters leave or join, docs/design.md §10.1). Transfers already launched must have completed; an
        earlier failure is forgotten, since it belonged to the old group. Counters and the link model go on.

        `identity` names the group in the tags of authenticated payloads (an elastic round's quorum id and member
        clusters); needed with `auth`. A new identity is a new group, whose members all number their exchanges from
        0, so a payload replayed from another round's group, or from another position in it, does not verify.
        `clusters`: the cluster of each group rank, kept in `self.clusters` (default: rank r is cluster r)."""
        if self.seal is not None and identity is None:
            raise ValueError("an authenticated WanChannel changes its group only with the group's identity")
        self.group = group
        self.world_size, self.group_rank = group.size(), group.rank()
        self.clusters = tuple(clusters) or tuple(range(self.world_size))
        self._group_ranks = ()
        new_group = identity is not None and tuple(identity) != self._identity
        if new_group:
            self._identity = tuple(identity)
        if self.seal is not None:
            self.seal.bind(rank=self.group_rank, world=self.world_size, identity=self._identity, clusters=clusters)
        self.communicator.rebound(new_group=new_group)

    def release(self) -> None:
        """Let go of the group (and of the failure it left, whose frames hold it) after a collective on it failed,
        so that it can be destroyed and its sockets close; nothing can be launched until the next `rebind`."""
        self.group = None
        self.communicator.release()

    def abandon(self, error: BaseException) -> None:
        """Stop waiting for what was launched: every transfer in flight fails with `error` now, and the collective on
        the wire is left to its communicator thread, which ends when the collective returns (a peer that resumes, or
        the group's timeout) and then touches nothing of this channel. For a member of an elastic round that stalled
        in the middle of a transfer (`dilocox.elastic.stall`): its peers must not wait for it until `network.timeout`.
        Later collectives run on a new communicator thread, over the group of the next `rebind`."""
        self.communicator.abandon(error)

    # ----------------------------------------------------------------------------------------- collectives

    def launch_all_reduce(
        self, tensor: torch.Tensor, *, op: str = "avg", account: bool = True
    ) -> PendingTransfer[torch.Tensor]:
        """Start an in-place ring all-reduce ("sum" or "avg") of a floating `tensor` over the group.

        The caller must not read or write `tensor` until `wait()`, which returns it reduced. `account=False` runs
        the collective without counting it or emulating its link time: for a transfer that a resumed run sends
        again although the counters restored from its checkpoint already hold it.
        """
        if op not in _REDUCE_OPS:
            raise ValueError(f"all_reduce op = {op!r} is not supported; use one of {list(_REDUCE_OPS)}")
        if not tensor.is_floating_point():
            raise ValueError(
                f"all_reduce of a {tensor.dtype} tensor: integer sums wrap around on the wire; convert to a float "
                "dtype first, or all_gather quantized payloads and reduce them locally"
            )
        self._refuse_unauthenticated("all_reduce")
        if self.world_size == 1:
            return PendingTransfer.completed("all_reduce", tensor, self.clock.now())
        run = lambda _: self._run_all_reduce(tensor, op)  # noqa: E731
        return self.communicator.submit("all_reduce", run, account, device=tensor.device)

    def launch_all_gather(
        self, tensor: torch.Tensor, *, max_numel: int | None = None, account: bool = True
    ) -> PendingTransfer[list[torch.Tensor | None]]:
        """Start an all-gather of 1-D tensors whose lengths may differ per rank (same dtype on every rank).

        `wait()` returns one tensor per group rank, in group rank order; this rank's entry is `tensor` itself.
        gloo gathers equal sizes only, so the lengths are exchanged first (one int64 per rank, counted in
        `control_bytes` by the ring all-gather convention: `8 (C-1)` per call) and payloads padded to the longest;
        payload bytes are counted unpadded, as a variable-size ring would send them. The link is charged the
        payload's `max(sent, recv)` plus the length bytes and one latency (the lengths ride as a header).

        `max_numel` is the longest payload any rank may declare, which the receiver must know before it allocates:
        the codec's largest payload for the slice (`Codec.max_nbytes_list`), or by default this rank's own length
        (payloads of equal size). A longer declared length fails the transfer with an error naming the rank.
        With `auth`, each payload travels as its bytes and a 32-byte tag (counted as payload bytes), and an entry
        whose tag does not verify is None.
        """
        if tensor.dim() != 1:
            raise ValueError(
                f"all_gather takes a 1-D tensor, got shape {tuple(tensor.shape)}; pass tensor.reshape(-1) and "
                "restore the shape after the gather"
            )
        limit = tensor.numel() if max_numel is None else max_numel
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < tensor.numel():
            raise ValueError(
                f"all_gather max_numel = {max_numel!r} must be an int of at least this rank's own {tensor.numel()} "
                "elements: the longest payload a peer may send"
            )
        if self.world_size == 1:
            return PendingTransfer.completed("all_gather", [tensor], self.clock.now())
        signer, self._next_signer = self._next_signer, None
        run = functools.partial(self._run_all_gather, tensor, limit, signer=signer)
        return self.communicator.submit("all_gather", run, account, device=tensor.device)

    def sign_next_with(self, signer: PayloadAuth) -> None:
        """The next payload this rank seals (an all-gather's) is tagged under `signer` instead
        of the shared key: under a key no other cluster holds, it is a payload its receivers must reject. Needs
        `auth`."""
        if self.seal is None:
            raise ValueError("sign_next_with needs an authenticated WanChannel (network.auth_key_file)")
        self._next_signer = signer

    def launch_program(
        self,
        program: Callable[[Wire], ResultT],
        *,
        kind: str = "program",
        account: bool = True,
        device: torch.device | None = None,
    ) -> PendingTransfer[ResultT]:
        """Start a multi-step collective: `program(wire)` runs on the communicator thread and returns the result.

        For reductions that decode, average and re-encode between steps (the scalable compressed mean). The program
        runs on the same thread and in the same launch order as every other collective of this channel, so state it
        reads or writes is never raced by another transfer; it must not touch tensors the trainer is using. The
        link is charged the program's `max(sent, recv)` bytes and one latency per step. `wait()` raises what the
        program raised. `device`: where the tensors the program reads and returns live; on a CUDA device the
        program runs on the channel's side stream, after the compute stream's work queued before this launch.
        """
        self._refuse_unauthenticated(kind)
        if self.world_size == 1:
            assert self.group is None or dist.get_world_size(self.group) == 1
            return PendingTransfer.completed(kind, program(LocalWire()), self.clock.now())
        run = functools.partial(self._run_program, program)
        return self.communicator.submit(kind, run, account, device=device)

    def all_reduce(self, tensor: torch.Tensor, *, op: str = "avg") -> torch.Tensor:
        """Blocking `launch_all_reduce(...).wait()`."""
        return self.launch_all_reduce(tensor, op=op).wait()

    def all_gather(self, tensor: torch.Tensor, *, max_numel: int | None = None) -> list[torch.Tensor | None]:
        """Blocking `launch_all_gather(...).wait()`."""
        return self.launch_all_gather(tensor, max_numel=max_numel).wait()

    # ----------------------------------------------------------------------------------------- lifecycle

    def close(self, *, cancel: bool = False) -> None:
        """Stop the communicator thread; idempotent, and a no-op if it never started.

        By default every launched transfer is carried out first (peers expect them). With `cancel=True`
        (error paths) transfers not yet started fail instead, and a collective already on the wire is waited for
        only briefly, since a peer that went away would leave it blocked.
        """
        self.communicator.close(cancel=cancel)

    def __enter__(self) -> WanChannel:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.close(cancel=exc_type is not None)

    # ----------------------------------------------------------------------------------------- internals

    def _refuse_unauthenticated(self, kind: str) -> None:
        if self.seal is not None:
            raise ValueError(
                f"an authenticated WanChannel cannot run {kind}: values summed or re-encoded in transit carry no tag "
                "of their sender; all-gather tagged payloads and reduce them locally (compression.reduction = gather)"
            )

    def _run_all_reduce(self, tensor: torch.Tensor, op: str) -> Outcome:
        # the group of its launch: a thread `abandon` left to it must not go on over the group of a later `rebind`
        group, world, rank = self.group, self.world_size, self.group_rank
        peers_ready, control_bytes = None, 0
        if self.account.link is None:  # a real link: one value all-reduced first says when every peer has joined
            dist.all_reduce(torch.zeros(1), group=group)
            peers_ready = self.clock.now()
            control_bytes, _ = ring_all_reduce_bytes(1, 4, world, rank)
        # gloo reduces contiguous host buffers only; reduce a copy and write it back so the call stays in-place.
        buffer = self.staging.to_host(tensor)
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
        if op == "avg":
            buffer.div_(world)
        if buffer is not tensor:
            self.staging.copy_to_device_(tensor, buffer)
        sent, recv = ring_all_reduce_bytes(tensor.numel(), tensor.element_size(), world, rank)
        return Outcome(tensor, sent, recv, control_bytes, peers_ready=peers_ready)

    def _run_all_gather(
        self, tensor: torch.Tensor, max_numel: int, exchange: int, *, signer: PayloadAuth | None = None
    ) -> Outcome:
        group, world, rank = self.group, self.world_size, self.group_rank  # of its launch, as `_run_all_reduce`
        if self.seal is None:
            wire, limit, unit = tensor, max_numel, "elements"
        else:  # the payload's bytes and their tag, one uint8 vector
            wire = self.seal.seal(tensor, exchange, signer=signer)
            limit, unit = max_numel * tensor.element_size() + TAG_BYTES, "bytes"
        # gloo gathers equal sizes only: exchange the lengths, pad to the longest, trim on arrival.
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(lengths, torch.tensor([wire.numel()], dtype=torch.int64), group=group)
        peers_ready = self.clock.now()  # every peer has launched its side: what follows is the link's
        numels = [int(n.item()) for n in lengths]
        for peer, numel in enumerate(numels):  # before allocating anything of that size
            if not 0 <= numel <= limit:
                raise ValueError(
                    f"slow-link all-gather: rank {peer} of the group{self._global_rank_note(peer)} declared a payload "
                    f"of {numel:,} {unit}, outside the "
                    f"0 ... {limit:,} this transfer can carry: its config differs (model, topology, compression) or "
                    "the length was corrupted on the way"
                )
        control_bytes, _ = ring_all_gather_bytes([_LENGTH_BYTES] * world, rank)
        gathered: list[torch.Tensor | None] = list(gather_payloads(group, wire, numels, rank, self.staging))
        sizes = [n * wire.element_size() for n in numels]
        sent, recv = ring_all_gather_bytes(sizes, rank)
        if self.seal is None:
            gathered[rank] = tensor
            return Outcome(gathered, sent, recv, control_bytes, peers_ready=peers_ready)
        opened = self.seal.open(gathered, tensor, exchange, group=group)
        # the verdicts travel once the payloads have arrived: a second step, with its own latency
        verdict_bytes, _ = ring_all_gather_bytes([world] * world, rank)
        return Outcome(opened, sent, recv, control_bytes + verdict_bytes, phases=2, peers_ready=peers_ready)

    def _global_rank_note(self, peer: int) -> str:
        return f" (global rank {self._group_ranks[peer]})" if peer < len(self._group_ranks) else ""

    def _run_program(self, program: Callable[[Wire], Any], exchange: int) -> Outcome:
        assert self.group is not None
        wire = Wire(self.group, self.world_size, self.group_rank, staging=self.staging)
        result = program(wire)
        return Outcome(result, wire.nbytes_sent, wire.nbytes_recv, phases=wire.phases)
