"""The WAN channel: the one object through which every collective on the slow `cluster_group` goes.

It runs each collective for real (gloo) on a background communicator thread, counts the exact bytes the ring
algorithm puts on the wire (conventions in `dilocox.net.link`), and, in emulation mode, completes each transfer
only when a FIFO model of the slow link says it would have arrived. Training overlaps with the transfer exactly
as it would with a real slow link; time the trainer spends blocked in `wait()` is recorded as exposed. With a
`PayloadAuth` (network.auth_key_file) every all-gathered payload carries an HMAC-SHA256 tag, and a payload whose
tag does not verify is dropped (None in its place) and counted, never used. The members then tell each other which
payloads they dropped, so that every member leaves out the same ones and all of them average the same payloads; a
cluster whose payload every other member dropped stops the run (`PayloadsRejected`).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import math
import queue
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from dilocox.net.auth import MIN_KEY_BYTES, TAG_BYTES, PayloadAuth
from dilocox.net.clock import Clock, MonotonicClock
from dilocox.net.link import (
    LinkModel,
    link_charge_bytes,
    parse_bandwidth,
    parse_duration,
    ring_all_gather_bytes,
    ring_all_reduce_bytes,
)
from dilocox.net.staging import HostStaging, StagingTicket

__all__ = [
    "PendingTransfer",
    "WanChannel",
    "Wire",
    "ring_all_gather_bytes",
    "ring_all_reduce_bytes",
]

ResultT = TypeVar("ResultT")

_REDUCE_OPS = ("sum", "avg")
_LENGTH_BYTES = 8  # one int64 element count per rank in the length exchange of an all-gather
_CANCEL_JOIN_S = 5.0  # how long close(cancel=True) waits for a collective already on the wire
_OPEN: weakref.WeakSet[WanChannel] = weakref.WeakSet()
"""Channels whose communicator thread runs: closed at interpreter exit (`_close_at_exit`)."""


@atexit.register
def _close_at_exit() -> None:
    """A program that ends (an exception in the user's loop) with a channel open: stop its communicator thread before
    the interpreter finalizes. A daemon thread still inside a torch collective then would be unwound through C++ code
    that cannot be, and the process would abort ("terminate called without an active exception", SIGABRT) instead of
    exiting with the program's own error."""
    for channel in list(_OPEN):
        channel.close(cancel=True)


_STAT_KEYS = ("bytes_sent", "bytes_recv", "control_bytes", "link_busy_s", "exposed_s", "num_transfers")
_FORGER = PayloadAuth(b"dilocox/faults/a-key-no-cluster-holds".ljust(MIN_KEY_BYTES))
"""faults.kind = forge: what a forger without the shared key tags its payloads with."""
_ADDED_STAT_KEYS = ("payloads_rejected", "peak_in_flight_bytes", "peer_wait_s")
"""Counters newer than some checkpoints: 0 when a saved state lacks them."""


class PayloadsRejected(ValueError):
    """Every other member rejected a cluster's authenticated payload (or no payload verified on every member): the
    same one line on every member of the group, which stops the run rather than let that cluster train apart."""


@dataclass(eq=False)
class PendingTransfer(Generic[ResultT]):
    """An in-flight collective of a `WanChannel`; `wait()` returns its result once the emulated link delivers it.

        transfer = channel.launch_all_reduce(pseudo_grad, op="avg")
        ...                                     # compute while the link is busy; do not touch pseudo_grad
        avg_pseudo_grad = transfer.wait()

    Times are seconds of the channel's clock (`time.perf_counter()` by default). The byte and time fields are final
    once `done()` is true (the sizes of an all-gather are only known after its length exchange on the communicator
    thread).
    """

    kind: str
    """"all_reduce", "all_gather", or the kind given to `launch_program`."""
    launch_time: float
    """When the trainer launched the transfer."""
    nbytes_sent: int = 0
    """Payload bytes this rank put on the wire (ring convention, unpadded)."""
    nbytes_recv: int = 0
    """Payload bytes this rank took off the wire."""
    start_time: float = 0.0
    """When the transfer started on the (emulated) link: after its launch and after the previous one left."""
    done_time: float = 0.0
    """When the transfer completed: the link model's arrival, or later if the real collective was slower (a peer
    that sent late)."""
    link_done_time: float = 0.0
    """When the link alone would have delivered it, had every peer sent at once: the link model's arrival in
    emulation; on a real link, its start plus the collective's time after every peer had arrived."""
    link_s: float = 0.0
    """`link_done_time - start_time`: link time of this transfer alone, without the wait for late peers."""
    seq: int = -1
    """Position among this channel's accounted transfers (the first is 0); -1 when not accounted. Transfers
    complete in order, so transfer `seq` is in the counters exactly when `num_transfers > seq`."""
    _finished: threading.Event = field(default_factory=threading.Event, repr=False)
    _result: Any = field(default=None, repr=False)
    _error: BaseException | None = field(default=None, repr=False)
    _channel: WanChannel | None = field(default=None, repr=False)
    _staged: StagingTicket | None = field(default=None, repr=False)
    """How a CUDA payload is staged through the host (None for a host payload)."""
    _in_peak: bool = field(default=True, repr=False)
    """Whether it counts towards `WanChannel.peak_in_flight_bytes` (not a transfer launched `off_peak`)."""

    def done(self) -> bool:
        """True once `wait()` would return (or raise) without blocking."""
        return self._finished.is_set()

    def wait(self) -> ResultT:
        """Block until the transfer completes and return its result; the blocked time counts as exposed until the
        link would have delivered it, and as a wait for peers after that (`split_wait`)."""
        if not self._finished.is_set():
            if self._channel is None:
                self._finished.wait()
            else:
                clock = self._channel.clock
                blocked_from = clock.now()
                clock.block(self._finished)
                self._channel._add_wait(*self.split_wait(blocked_from, clock.now()))
        if isinstance(self._error, PayloadsRejected):  # a verdict of the members, not a broken transfer
            raise self._error
        if self._error is not None:
            raise RuntimeError(
                f"WAN channel {self.kind} launched at t={self.launch_time:.3f}s failed on the communicator thread: "
                f"{self._error!r}"
            ) from self._error
        if self._staged is not None:
            self._staged.before_use()  # the compute stream reads the result after its copy back, not before
        return self._result

    def split_wait(self, blocked_from: float, blocked_until: float) -> tuple[float, float]:
        """(waited for the link, waited for peers): the part of a wait from `blocked_from` to `blocked_until` before
        `link_done_time`, when the link alone would have delivered the transfer, and the rest, when the link had
        delivered and the collective still waited for a cluster that sent late (a straggler, not the link)."""
        link = max(0.0, min(blocked_until, self.link_done_time) - blocked_from)
        return link, max(0.0, blocked_until - blocked_from - link)

    def _complete(self, result: Any) -> None:
        self._result = result
        self._finished.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._finished.set()


@dataclass
class _Outcome:
    """What one collective did on this rank, measured on the communicator thread."""

    result: Any
    nbytes_sent: int
    nbytes_recv: int
    control_bytes: int = 0
    phases: int = 1
    """Dependent communication steps (each pays one latency): 1 for a single collective."""
    peers_ready: float | None = None
    """When every peer had joined the collective (an all-gather's length exchange, or on a real link the one-value
    all-reduce before an all-reduce, returned); None where the collective does not tell (a program, an emulated
    all-reduce, whose link time is the model's): its whole time counts as link time."""


class Wire:
    """The slow-link steps a multi-step program may take on the communicator thread, each counted exactly.

    A `WanChannel.launch_program` program receives a `Wire` and may call its steps in any order, with local
    compute in between (e.g. decode what arrived, average, encode again). Every rank of the group must call the
    same steps with the same sizes. Bytes follow `dilocox.net.link`'s conventions, unpadded; sizes are passed in
    by the caller (who knows them from the shapes), so no length exchange is needed or counted.

        def program(wire: Wire):
            mine = wire.all_to_all(chunks, recv_sizes)   # chunk j to rank j; returns what each rank sent me
            ...                                          # reduce my chunk
            return wire.all_gather(reduced, sizes)       # everyone's reduced chunk
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        world_size: int,
        rank: int,
        *,
        staging: HostStaging | None = None,
        sealer: _Sealer | None = None,
    ) -> None:
        self.group = group
        self.world_size = world_size
        self.rank = rank
        self.staging = staging if staging is not None else HostStaging()
        self.sealer = sealer
        """An authenticated channel's tags: every chunk of a payload step carries one (`all_to_all`)."""
        self.left_out: set[int] = set()
        """The senders (group ranks) whose chunks a sealed step left out on every member, this rank included."""
        self.nbytes_sent = 0
        self.nbytes_recv = 0
        self.control_bytes = 0
        self.phases = 0

    def all_to_all(
        self, chunks: list[torch.Tensor], recv_sizes: list[int], *, header: bool = False, skip_empty: bool = True
    ) -> list[torch.Tensor]:
        """Send 1-D uint8 `chunks[j]` to rank j; return the chunk every rank i sent here, of `recv_sizes[i]` bytes.

        A direct exchange (each chunk crosses the link once): this rank sends `sum(chunks) - chunks[rank]` and
        receives `sum(recv_sizes) - recv_sizes[rank]` bytes; its own chunk stays local. `header=True`: the lengths of
        the payloads the next step carries, counted in `control_bytes` (what this rank sends) and riding with that
        step, so without a latency of their own (as the length exchange of `WanChannel.launch_all_gather`).
        `skip_empty`: a rank with nothing to send or receive skips the collective, right where the sizes follow the
        shapes (then every rank has nothing); pass False where one rank may have nothing while others exchange.
        """
        world, rank = self.world_size, self.rank
        if len(chunks) != world or len(recv_sizes) != world:
            raise ValueError(f"all_to_all needs one chunk and one receive size per rank ({world})")
        if any(chunk.dim() != 1 or chunk.dtype != torch.uint8 for chunk in chunks):
            raise ValueError("all_to_all takes 1-D uint8 chunks (encoded payloads)")
        if recv_sizes[rank] != chunks[rank].numel():
            raise ValueError(f"rank {rank} keeps its own chunk of {chunks[rank].numel()} bytes, not {recv_sizes[rank]}")
        if self.sealer is not None and not header:
            return self._sealed_all_to_all(chunks, recv_sizes, skip_empty=skip_empty)
        send_sizes = [chunk.numel() for chunk in chunks]
        self.phases += not header
        if skip_empty and not any(send_sizes) and not any(recv_sizes):  # then every rank has nothing
            return list(chunks)
        received = self.staging.host_buffer(sum(recv_sizes), torch.uint8)
        sending = self.staging.to_host(torch.cat(chunks))
        dist.all_to_all_single(
            received, sending, output_split_sizes=recv_sizes, input_split_sizes=send_sizes, group=self.group
        )
        if header:
            self.control_bytes += sum(send_sizes) - send_sizes[rank]
        else:
            self.nbytes_sent += sum(send_sizes) - send_sizes[rank]
            self.nbytes_recv += sum(recv_sizes) - recv_sizes[rank]
        parts = list(torch.split(self.staging.to_device(received, chunks[rank].device), recv_sizes))
        parts[rank] = chunks[rank]
        return parts

    def _sealed_all_to_all(
        self, chunks: list[torch.Tensor], recv_sizes: list[int], *, skip_empty: bool
    ) -> list[torch.Tensor]:
        """`all_to_all` on an authenticated channel: every non-empty chunk travels with its tag (counted as payload
        bytes); a chunk whose tag does not verify on its receiver, or whose sender any member rejected, arrives
        empty on every member (`_Sealer.verdict`), so each leaves the same senders out."""
        sealer, world, rank = self.sealer, self.world_size, self.rank
        assert sealer is not None
        sealed = [chunk if peer == rank or not chunk.numel() else sealer.seal(chunk, peer)
                  for peer, chunk in enumerate(chunks)]  # fmt: skip
        sizes = [n + (TAG_BYTES if n and peer != rank else 0) for peer, n in enumerate(recv_sizes)]
        self.sealer = None  # the plain step with the sealed chunks; the next payload step is sealed again
        try:
            parts = self.all_to_all(sealed, sizes, skip_empty=skip_empty)
        finally:
            self.sealer = sealer
        rejected_here = torch.full((world,), NOTHING_ARRIVED, dtype=torch.uint8)  # (senders,) 1: rejected, 0: kept
        opened = []
        for peer, part in enumerate(parts):
            if peer == rank or not part.numel():
                opened.append(part)
                continue
            data = sealer.open(part, peer)
            rejected_here[peer] = data is None
            opened.append(part[:0] if data is None else data)
        left_out = sealer.verdict(self.group, rejected_here)
        self.left_out.update(left_out)
        self.control_bytes += ring_all_gather_bytes([world] * world, rank)[0]
        return [part[:0] if peer in left_out else part for peer, part in enumerate(opened)]

    def all_gather(self, tensor: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        """Ring all-gather of 1-D uint8 payloads, rank i's of `sizes[i]` bytes; returns them in rank order."""
        world, rank = self.world_size, self.rank
        if len(sizes) != world or sizes[rank] != tensor.numel() or tensor.dim() != 1:
            raise ValueError(f"all_gather needs this rank's 1-D payload of sizes[{rank}] bytes and one size per rank")
        self.phases += 1
        gathered = _gather_payloads(self.group, tensor, list(sizes), rank, self.staging)
        sent, recv = ring_all_gather_bytes(list(sizes), rank)
        self.nbytes_sent += sent
        self.nbytes_recv += recv
        return gathered


NOTHING_ARRIVED = 2
"""A member's verdict on a sender whose payload it did not get (a lane exchange sends each rank only its lanes)."""


class _Sealer:
    """The tags of one authenticated program (`WanChannel.launch_program(..., sealed=True)`): a chunk from sender s
    to receiver r is tagged under the program's exchange number, s, and the group with r appended (after a -1, which
    no rank is), so it verifies only where it was sent, in this exchange."""

    def __init__(self, channel: WanChannel, exchange: int, *, forge: bool = False) -> None:
        self.channel = channel
        self.exchange = exchange
        self.forge = forge
        """faults.kind = forge: this rank's chunks go out under a key no cluster holds."""

    def _group(self, receiver: int) -> tuple[int, ...]:
        return (*self.channel._tag_group, -1, receiver)

    def seal(self, chunk: torch.Tensor, receiver: int) -> torch.Tensor:
        """`chunk` (uint8, on the host) followed by its tag for `receiver`."""
        auth = _FORGER if self.forge else self.channel._auth
        assert auth is not None
        data = self.channel._staging.to_host(chunk)
        tag = auth.tag(data.numpy(), seq=self.exchange, sender=self.channel.group_rank, group=self._group(receiver))
        return torch.cat([data, torch.frombuffer(bytearray(tag), dtype=torch.uint8).to(chunk.device)])

    def open(self, part: torch.Tensor, sender: int) -> torch.Tensor | None:
        """The bytes of a sealed chunk from `sender` if its tag verifies here, else None."""
        return self.channel._open_chunk(part, sender, self.exchange, group=self._group(self.channel.group_rank))

    def verdict(self, group: dist.ProcessGroup, rejected_here: torch.Tensor) -> list[int]:
        """The senders every member leaves out, from every member's rejections (`WanChannel._judge`)."""
        return self.channel._judge(rejected_here, self.exchange, group=group)


@dataclass
class _Job:
    transfer: PendingTransfer[Any]
    run: Callable[[int], _Outcome]
    """Runs the collective; takes the job's `exchange`."""
    account: bool = True
    exchange: int = 0
    """Position among every collective launched on this channel (accounted or not), the same on every rank of the
    group: the sequence number authenticated payloads are tagged with."""


def _drained(jobs: queue.Queue) -> Iterator[_Job]:
    """The jobs still queued on a communicator's queue, each taken off it (the stop marker, None, is skipped)."""
    while True:
        try:
            job = jobs.get_nowait()
        except queue.Empty:
            return
        if job is not None:
            yield job


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
        # LinkModel validates both values and names network.bandwidth / network.latency in its errors.
        link = LinkModel(None if bandwidth is None else bandwidth / num_sharing, latency_s)
        self._link: LinkModel | None = None if bandwidth is None else link
        self.group = group
        self.num_sharing = num_sharing
        self.latency_s = latency_s
        self.uplink_bytes_per_s = bandwidth
        self.clock: Clock = MonotonicClock() if clock is None else clock
        """Stamps launches and completions, holds emulated transfers and times the trainer's waits."""
        if group is None:
            self.world_size, self.group_rank = 1, 0
        else:
            self.world_size, self.group_rank = dist.get_world_size(group), dist.get_rank(group)
            if self.group_rank < 0:
                raise ValueError("this rank is not a member of the WanChannel's group: pass its own cluster_group")
        self._auth = auth
        self._staging = HostStaging()  # device payloads cross through pinned host buffers on a side stream
        self.stop_if_cut_off = stop_if_cut_off
        """With `auth`: a payload every other member rejected fails the transfer on every member
        (`PayloadsRejected`); else only on the cut-off member, and the others leave its payload out."""
        # A tag names the group by its global ranks: a payload of another group (another stage) does not verify.
        self._group_ranks = () if group is None else tuple(dist.get_process_group_ranks(group))
        self._tag_group = self._group_ranks  # an elastic round's group: its quorum id and clusters (`rebind`)
        self._clusters: tuple[int, ...] = ()  # the cluster of each group rank where it is not the group rank

        self._lock = threading.Lock()  # guards the counters and the lifecycle flags below
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._abandoned: set[threading.Thread] = set()  # communicator threads left to a collective (`abandon`)
        self._closed = False
        self._cancelled = False
        self._failure: BaseException | None = None
        self._released = False  # release() let go of the group; rebind() gives it a new one
        self._bytes_sent = 0
        self._bytes_recv = 0
        self._control_bytes = 0
        self._link_busy_s = 0.0
        self._exposed_s = 0.0
        self._peer_wait_s = 0.0
        self._num_transfers = 0
        self._payloads_rejected = 0
        self._peak_in_flight_bytes = 0
        self._arrivals: collections.deque[tuple[float, int]] = collections.deque()
        """(done time, bytes sent) of the accounted transfers that may still overlap a later launch."""
        self._off_peak = False  # transfers launched now do not count towards the peak in flight (`off_peak`)
        self._forge_next = False  # faults.kind = forge: the next all-gathered payload carries a forged tag
        self._in_flight = 0  # launched and not yet completed or failed
        self._running: _Job | None = None  # the job on the communicator thread
        self._previous_end = -math.inf  # when the communicator thread's last collective returned
        self._submitted = 0  # accounted transfers launched so far (the next one's `seq`)
        self._launched = 0  # collectives launched so far, accounted or not (the next one's `_Job.exchange`)

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
        return self._link is not None

    @property
    def bytes_per_s(self) -> float | None:
        """This rank's share of the uplink: `bandwidth / num_sharing` (None when unlimited)."""
        return None if self._link is None else self._link.bytes_per_s

    @property
    def bytes_sent(self) -> int:
        with self._lock:
            return self._bytes_sent

    @property
    def bytes_recv(self) -> int:
        with self._lock:
            return self._bytes_recv

    @property
    def control_bytes(self) -> int:
        with self._lock:
            return self._control_bytes

    @property
    def link_busy_s(self) -> float:
        with self._lock:
            return self._link_busy_s

    @property
    def exposed_s(self) -> float:
        with self._lock:
            return self._exposed_s

    @property
    def peer_wait_s(self) -> float:
        with self._lock:
            return self._peer_wait_s

    @property
    def num_transfers(self) -> int:
        with self._lock:
            return self._num_transfers

    @property
    def num_in_flight(self) -> int:
        """Transfers launched and not yet completed (or failed), the one on the communicator thread included."""
        with self._lock:
            return self._in_flight

    @property
    def payloads_rejected(self) -> int:
        with self._lock:
            return self._payloads_rejected

    @property
    def peak_in_flight_bytes(self) -> int:
        """The most payload bytes this rank had launched on the link and not yet delivered at any one time (the sum
        of `nbytes_sent` over the accounted transfers whose [launch, done] spans that time): the burst the link must
        carry at once; transfers launched `off_peak` (the end-of-run drain) do not count. Exact in emulation, where
        launch and arrival are the link model's times."""
        with self._lock:
            return self._peak_in_flight_bytes

    @contextlib.contextmanager
    def off_peak(self) -> Iterator[None]:
        """Transfers launched inside do not count towards `peak_in_flight_bytes`: the end of training's one-off
        transfers (the drain of the held-back residual), so the peak is that of the rounds' syncs."""
        self._off_peak = True
        try:
            yield
        finally:
            self._off_peak = False

    @property
    def tag_bytes(self) -> int:
        """Bytes added to every all-gathered payload: an HMAC-SHA256 tag with `auth`, else 0."""
        return 0 if self._auth is None else TAG_BYTES

    def stats(self) -> dict[str, float | int]:
        """Cumulative counters: bytes_sent, bytes_recv, control_bytes, link_busy_s, exposed_s (waited for the
        link), peer_wait_s (waited for late peers), num_transfers, payloads_rejected (peers' payloads whose tag did
        not verify, counted even when not accounted), and the peak_in_flight_bytes so far."""
        with self._lock:
            return {
                "bytes_sent": self._bytes_sent,
                "bytes_recv": self._bytes_recv,
                "control_bytes": self._control_bytes,
                "link_busy_s": self._link_busy_s,
                "exposed_s": self._exposed_s,
                "peer_wait_s": self._peer_wait_s,
                "num_transfers": self._num_transfers,
                "payloads_rejected": self._payloads_rejected,
                "peak_in_flight_bytes": self._peak_in_flight_bytes,
            }

    def state_dict(self) -> dict[str, float | int]:
        """The counters, so cumulative metrics survive a checkpoint resume (the link's clock does not), and the
        number of collectives launched, which numbers the tags of authenticated payloads."""
        with self._lock:
            launched = self._launched
        return {**self.stats(), "num_launched": launched}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Restore counters saved by `state_dict()`; call before launching transfers."""
        missing = [k for k in _STAT_KEYS if k not in state]
        if missing:
            raise ValueError(f"WanChannel state is missing {missing}; expected the keys of WanChannel.state_dict()")
        with self._lock:
            self._bytes_sent = int(state["bytes_sent"])
            self._bytes_recv = int(state["bytes_recv"])
            self._control_bytes = int(state["control_bytes"])
            self._link_busy_s = float(state["link_busy_s"])
            self._exposed_s = float(state["exposed_s"])
            self._peer_wait_s = float(state.get("peer_wait_s", 0.0))
            self._num_transfers = int(state["num_transfers"])
            self._payloads_rejected = int(state.get("payloads_rejected", 0))
            self._peak_in_flight_bytes = int(state.get("peak_in_flight_bytes", 0))
            self._submitted = self._num_transfers
            # Every rank of the group saved the same count at the same step, so the resumed ranks keep numbering
            # their exchanges alike (a state saved before it existed restarts at 0 on every rank alike).
            self._launched = int(state.get("num_launched", 0))

    def rebind(
        self, group: dist.ProcessGroup, *, identity: Sequence[int] | None = None, clusters: Sequence[int] = ()
    ) -> None:
        """Carry later collectives over `group`, the slow link of an elastic run's new round (torchft reconfigures
        it when clusters leave or join, docs/design.md §10.1). Transfers already launched must have completed; an
        earlier failure is forgotten, since it belonged to the old group. Counters and the link model go on.

        `identity` names the group in the tags of authenticated payloads (an elastic round's quorum id and member
        clusters); needed with `auth`. A new identity is a new group, whose members all number their exchanges from
        0, so a payload replayed from another round's group, or from another position in it, does not verify.
        `clusters`: the cluster of each group rank, for messages."""
        if self._auth is not None and identity is None:
            raise ValueError("an authenticated WanChannel changes its group only with the group's identity")
        with self._lock:
            self.group = group
            self.world_size, self.group_rank = group.size(), group.rank()
            self._group_ranks = ()
            self._clusters = tuple(clusters)
            if identity is not None and tuple(identity) != self._tag_group:
                self._tag_group = tuple(identity)
                self._launched = 0
            self._failure = None
            self._released = False

    def release(self) -> None:
        """Let go of the group (and of the failure it left, whose frames hold it) after a collective on it failed,
        so that it can be destroyed and its sockets close; nothing can be launched until the next `rebind`."""
        with self._lock:
            self.group = None
            self._failure = None
            self._released = True

    def abandon(self, error: BaseException) -> None:
        """Stop waiting for what was launched: every transfer in flight fails with `error` now, and the collective on
        the wire is left to its communicator thread, which ends when the collective returns (a peer that resumes, or
        the group's timeout) and then touches nothing of this channel. For a member of an elastic round that stalled
        in the middle of a transfer (`dilocox.elastic.stall`): its peers must not wait for it until `network.timeout`.
        Later collectives run on a new communicator thread, over the group of the next `rebind`."""
        with self._lock:
            jobs, self._queue = self._queue, queue.SimpleQueue()
            thread, self._thread = self._thread, None
            running, self._running = self._running, None
            if thread is not None:
                self._abandoned.add(thread)
            self._in_flight = 0
            self._failure = None
        if running is not None:
            running.transfer._fail(error)
        for job in _drained(jobs):
            job.transfer._fail(error)
        jobs.put(None)  # the abandoned thread stops once its collective returns

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
            return self._completed("all_reduce", tensor)
        return self._submit("all_reduce", lambda _: self._run_all_reduce(tensor, op), account, device=tensor.device)

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
            return self._completed("all_gather", [tensor])
        forge, self._forge_next = self._forge_next, False
        run = functools.partial(self._run_all_gather, tensor, limit, forge=forge)
        return self._submit("all_gather", run, account, device=tensor.device)

    def forge_next_payload(self) -> None:
        """`faults.kind = forge`: the next all-gathered payload goes out under the tag of a key no cluster holds, as
        a forger's would (its values are this rank's own). Needs `auth`."""
        if self._auth is None:
            raise ValueError("faults.kind = 'forge' needs network.auth_key_file: without it no tag is sent")
        self._forge_next = True

    def launch_program(
        self,
        program: Callable[[Wire], ResultT],
        *,
        kind: str = "program",
        account: bool = True,
        device: torch.device | None = None,
        sealed: bool = False,
    ) -> PendingTransfer[ResultT]:
        """Start a multi-step collective: `program(wire)` runs on the communicator thread and returns the result.

        For reductions that decode, average and re-encode between steps (the scalable compressed mean). The program
        runs on the same thread and in the same launch order as every other collective of this channel, so state it
        reads or writes is never raced by another transfer; it must not touch tensors the trainer is using. The
        link is charged the program's `max(sent, recv)` bytes and one latency per step. `wait()` raises what the
        program raised. `device`: where the tensors the program reads and returns live; on a CUDA device the
        program runs on the channel's side stream, after the compute stream's work queued before this launch.
        `sealed`: the program only moves each sender's own payloads, never sums (the lanes' exchange), so on an
        authenticated channel every chunk of its payload steps carries a tag (`Wire.all_to_all`).
        """
        if not sealed:
            self._refuse_unauthenticated(kind)
        if self.world_size == 1:
            assert self.group is None or dist.get_world_size(self.group) == 1
            return self._completed(kind, program(_LocalWire()))
        forge, self._forge_next = (self._forge_next, False) if sealed else (False, self._forge_next)
        run = functools.partial(self._run_program, program, sealed=sealed, forge=forge)
        return self._submit(kind, run, account, device=device)

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
        with self._lock:
            if cancel:
                self._cancelled = True
            if self._closed:
                thread = None
            else:
                self._closed = True
                thread = self._thread
        if thread is None:
            return
        if cancel:
            # Fail queued transfers here rather than on the thread, which may be stuck behind a vanished peer.
            while True:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job.transfer._fail(RuntimeError("the WanChannel was closed with cancel=True before this ran"))
                    self._job_ended()
        self._queue.put(None)
        thread.join(timeout=_CANCEL_JOIN_S if cancel else None)

    def __enter__(self) -> WanChannel:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.close(cancel=exc_type is not None)

    # ----------------------------------------------------------------------------------------- internals

    def _completed(self, kind: str, result: Any) -> PendingTransfer[Any]:
        now = self.clock.now()
        transfer: PendingTransfer[Any] = PendingTransfer(
            kind=kind, launch_time=now, start_time=now, done_time=now, link_done_time=now
        )
        transfer._complete(result)
        return transfer

    def _refuse_unauthenticated(self, kind: str) -> None:
        if self._auth is not None:
            raise ValueError(
                f"an authenticated WanChannel cannot run {kind}: values summed or re-encoded in transit carry no tag "
                "of their sender; all-gather tagged payloads and reduce them locally (compression.reduction = gather)"
            )

    def _submit(
        self, kind: str, run: Callable[[int], _Outcome], account: bool = True, *, device: torch.device | None = None
    ) -> PendingTransfer[Any]:
        transfer: PendingTransfer[Any] = PendingTransfer(
            kind=kind, launch_time=self.clock.now(), _channel=self, _in_peak=not self._off_peak
        )
        with self._lock:
            if self._closed:
                raise RuntimeError(f"cannot launch {kind}: the WanChannel is closed")
            if self._released:
                raise RuntimeError(f"cannot launch {kind}: the WanChannel let go of its failed group; rebind it first")
            if self._failure is not None:
                raise RuntimeError(
                    f"cannot launch {kind}: an earlier transfer on this WanChannel failed ({self._failure!r})"
                ) from self._failure
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._serve, args=(self._queue,), name="dilocox-wan-channel", daemon=True
                )
                self._thread.start()
                _OPEN.add(self)
            if account:
                transfer.seq = self._submitted
                self._submitted += 1
            transfer._staged = self._staging.ticket(device)  # on this thread: after the payload's kernels
            self._queue.put(_Job(transfer, run, account, exchange=self._launched))
            self._launched += 1
            self._in_flight += 1
        return transfer

    def _job_ended(self) -> None:
        with self._lock:
            if not self._is_abandoned():
                self._in_flight -= 1

    def _is_abandoned(self) -> bool:
        """Whether the calling communicator thread was left to its collective (`abandon`); call under the lock."""
        return threading.current_thread() in self._abandoned

    def _add_wait(self, link_s: float, peers_s: float) -> None:
        with self._lock:
            self._exposed_s += link_s
            self._peer_wait_s += peers_s

    def _serve(self, jobs: queue.SimpleQueue[_Job | None]) -> None:
        """Communicator thread: run the collectives of `jobs` in launch order until the stop sentinel. A thread that
        `abandon` left to its collective fails nothing and counts nothing once that collective returns."""
        job: _Job | None = None
        try:
            while (job := jobs.get()) is not None:
                with self._lock:
                    failure, cancelled, abandoned = self._failure, self._cancelled, self._is_abandoned()
                    if not abandoned:
                        self._running = job
                if abandoned:  # taken just as `abandon` ran: it belongs to the waits that were failed
                    job.transfer._fail(RuntimeError("the WanChannel stopped waiting for its transfers"))
                elif cancelled:
                    job.transfer._fail(RuntimeError("the WanChannel was closed with cancel=True before this ran"))
                elif failure is not None:
                    # The group's collective sequence is broken: running later ones could pair with the wrong peers.
                    job.transfer._fail(RuntimeError(f"skipped: an earlier transfer failed ({failure!r})"))
                else:
                    try:
                        self._execute(job)
                    except BaseException as exc:  # handed to wait(); the thread itself must never die silently
                        with self._lock:
                            if not self._is_abandoned():
                                self._failure = exc
                        job.transfer._fail(exc)
                self._job_ended()
                with self._lock:
                    if self._running is job:
                        self._running = None
                job = None
        finally:
            # Only reached early on an interpreter-level failure: never leave a waiter blocked forever.
            if job is not None:
                if not job.transfer.done():
                    job.transfer._fail(RuntimeError("the WanChannel communicator thread stopped"))
                self._job_ended()
            for leftover in _drained(jobs):
                leftover.transfer._fail(RuntimeError("the WanChannel communicator thread stopped"))
                self._job_ended()
            with self._lock:
                self._abandoned.discard(threading.current_thread())

    def _execute(self, job: _Job) -> None:
        transfer = job.transfer
        # when this rank could start it: launched, and the previous collective off this thread
        real_start = max(transfer.launch_time, self._previous_end)
        with self._staging.running(transfer._staged):
            outcome = job.run(job.exchange)
            self._staging.finish(transfer._staged, outcome.result)
        real_end = self._previous_end = self.clock.now()
        with self._lock:
            if self._is_abandoned():  # its waiter was failed (`abandon`): the link and the counters go on without it
                return
        # the time the collective waited for late peers is not the link's
        peers_s = 0.0 if outcome.peers_ready is None else max(0.0, outcome.peers_ready - real_start)
        if not job.account:
            transfer.nbytes_sent, transfer.nbytes_recv = outcome.nbytes_sent, outcome.nbytes_recv
            transfer.start_time, transfer.done_time = real_start, real_end
            transfer.link_done_time = real_end - peers_s
            transfer.link_s = transfer.link_done_time - real_start
            transfer._complete(outcome.result)
            return
        if self._link is None:
            start, done, link_done = real_start, real_end, real_end - peers_s
            busy_s = link_done - real_start
        else:
            charge = link_charge_bytes(outcome.nbytes_sent, outcome.nbytes_recv) + outcome.control_bytes
            busy_before = self._link.busy_s
            start, link_done = self._link.schedule(charge, transfer.launch_time, phases=max(1, outcome.phases))
            busy_s = self._link.busy_s - busy_before
            self.clock.sleep_until(link_done)
            done = max(link_done, real_end)
        transfer.nbytes_sent, transfer.nbytes_recv = outcome.nbytes_sent, outcome.nbytes_recv
        transfer.start_time, transfer.done_time, transfer.link_done_time = start, done, link_done
        transfer.link_s = link_done - start
        with self._lock:
            self._bytes_sent += outcome.nbytes_sent
            self._bytes_recv += outcome.nbytes_recv
            self._control_bytes += outcome.control_bytes
            self._link_busy_s += busy_s
            self._num_transfers += 1
            if transfer._in_peak:
                self._count_in_flight(transfer.launch_time, done, outcome.nbytes_sent)
        transfer._complete(outcome.result)

    def _count_in_flight(self, launch_time: float, done: float, nbytes: int) -> None:
        """Raise the peak of bytes in flight by a transfer that just completed (call under the lock). Transfers are
        launched and completed in order, so every transfer launched before this one has completed and none launched
        after it is counted at its launch time; the bytes in flight peak at a launch: here, the sum over this one and
        the earlier ones that had not arrived when it was launched."""
        while self._arrivals and self._arrivals[0][0] <= launch_time:
            self._arrivals.popleft()  # arrived before this launch, so before every later one
        self._arrivals.append((done, nbytes))
        self._peak_in_flight_bytes = max(self._peak_in_flight_bytes, sum(n for _, n in self._arrivals))

    def _run_all_reduce(self, tensor: torch.Tensor, op: str) -> _Outcome:
        peers_ready, control_bytes = None, 0
        if self._link is None:  # a real link: one value all-reduced first says when every peer has joined
            dist.all_reduce(torch.zeros(1), group=self.group)
            peers_ready = self.clock.now()
            control_bytes, _ = ring_all_reduce_bytes(1, 4, self.world_size, self.group_rank)
        # gloo reduces contiguous host buffers only; reduce a copy and write it back so the call stays in-place.
        buffer = self._staging.to_host(tensor)
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self.group)
        if op == "avg":
            buffer.div_(self.world_size)
        if buffer is not tensor:
            self._staging.copy_to_device_(tensor, buffer)
        sent, recv = ring_all_reduce_bytes(tensor.numel(), tensor.element_size(), self.world_size, self.group_rank)
        return _Outcome(tensor, sent, recv, control_bytes, peers_ready=peers_ready)

    def _run_all_gather(self, tensor: torch.Tensor, max_numel: int, exchange: int, *, forge: bool = False) -> _Outcome:
        world, rank = self.world_size, self.group_rank
        if self._auth is None:
            wire, limit, unit = tensor, max_numel, "elements"
        else:  # the payload's bytes and their tag, one uint8 vector
            wire, limit, unit = self._seal(tensor, exchange), max_numel * tensor.element_size() + TAG_BYTES, "bytes"
            if forge:
                tag = _FORGER.tag(wire[:-TAG_BYTES].numpy(), seq=exchange, sender=rank, group=self._tag_group)
                wire[-TAG_BYTES:] = torch.frombuffer(bytearray(tag), dtype=torch.uint8)
        # gloo gathers equal sizes only: exchange the lengths, pad to the longest, trim on arrival.
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(lengths, torch.tensor([wire.numel()], dtype=torch.int64), group=self.group)
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
        gathered: list[torch.Tensor | None] = list(_gather_payloads(self.group, wire, numels, rank, self._staging))
        sizes = [n * wire.element_size() for n in numels]
        sent, recv = ring_all_gather_bytes(sizes, rank)
        if self._auth is None:
            gathered[rank] = tensor
            return _Outcome(gathered, sent, recv, control_bytes, peers_ready=peers_ready)
        opened = self._open(gathered, tensor, exchange)
        # the verdicts travel once the payloads have arrived: a second step, with its own latency
        verdict_bytes, _ = ring_all_gather_bytes([world] * world, rank)
        return _Outcome(opened, sent, recv, control_bytes + verdict_bytes, phases=2, peers_ready=peers_ready)

    def _global_rank_note(self, peer: int) -> str:
        return f" (global rank {self._group_ranks[peer]})" if peer < len(self._group_ranks) else ""

    def _seal(self, tensor: torch.Tensor, exchange: int) -> torch.Tensor:
        """(nbytes + 32,) uint8 on the host: the bytes of `tensor` followed by their tag for this exchange."""
        assert self._auth is not None
        data = self._staging.to_host(tensor).view(torch.uint8)  # (nbytes,)
        tag = self._auth.tag(data.numpy(), seq=exchange, sender=self.group_rank, group=self._tag_group)
        return torch.cat([data, torch.frombuffer(bytearray(tag), dtype=torch.uint8)])

    def _open(
        self, sealed: list[torch.Tensor | None], tensor: torch.Tensor, exchange: int
    ) -> list[torch.Tensor | None]:
        """Every payload that the members of the group kept, as `tensor`'s dtype on its device (this rank's own is
        `tensor`); None for those any of them rejected (`rejection_verdict`). The payloads this rank rejects are
        counted and named in one warning line; the members all-gather their verdicts (one byte per sender), so each
        leaves out the same payloads."""
        assert self._auth is not None
        opened: list[torch.Tensor | None] = []
        rejected_here = torch.zeros(self.world_size, dtype=torch.uint8)  # (senders,) 1: this rank rejected it, 0: kept
        for sender, wire in enumerate(sealed):
            assert wire is not None
            if sender == self.group_rank:
                opened.append(tensor)
                continue
            nbytes = wire.numel() - TAG_BYTES
            ok = (
                nbytes >= 0
                and nbytes % tensor.element_size() == 0
                and self._auth.verify(
                    wire[:nbytes].numpy(),
                    wire[nbytes:].numpy(),
                    seq=exchange,
                    sender=sender,
                    group=self._tag_group,
                )
            )
            opened.append(self._staging.to_device(wire[:nbytes].view(tensor.dtype), tensor.device) if ok else None)
            rejected_here[sender] = not ok
        left_out = self._judge(rejected_here, exchange, group=self.group)
        return [None if sender in left_out else payload for sender, payload in enumerate(opened)]

    def _open_chunk(
        self, part: torch.Tensor, sender: int, exchange: int, *, group: tuple[int, ...]
    ) -> torch.Tensor | None:
        """The bytes of a sealed lane chunk from `sender` (`_Sealer`) if its tag verifies here, else None."""
        assert self._auth is not None
        nbytes = part.numel() - TAG_BYTES
        host = self._staging.to_host(part)
        ok = nbytes >= 0 and self._auth.verify(
            host[:nbytes].numpy(), host[nbytes:].numpy(), seq=exchange, sender=sender, group=group
        )
        return part[:nbytes] if ok else None

    def _judge(self, rejected_here: torch.Tensor, exchange: int, *, group: dist.ProcessGroup) -> list[int]:
        """The senders every member of `group` leaves out of an authenticated exchange, from every member's
        rejections (`rejected_here[s]`: this rank rejected sender s's payload; one all-gathered byte per sender): the
        payloads this rank rejected are counted and named in one warning line, and a sender that every other member
        rejected stops the run (`PayloadsRejected`, `rejection_verdict`)."""
        rows = [torch.empty(self.world_size, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(rows, rejected_here, group=group)
        rejected = [[v == 1 for v in row.tolist()] for row in rows]  # (receivers, senders)
        received = [[v != NOTHING_ARRIVED for v in row.tolist()] for row in rows]
        cluster_of = self._clusters or range(self.world_size)
        mine = [sender for sender, flag in enumerate(rejected_here.tolist()) if flag == 1]
        if mine:
            with self._lock:
                self._payloads_rejected += len(mine)
            clusters = ", ".join(str(cluster_of[sender]) for sender in mine)
            me = f"cluster {cluster_of[self.group_rank]}"
            if not self._clusters:  # a static run: the global rank too (an elastic cluster is its own world)
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
            stop = bool(cut_off) or len(left_out) == self.world_size
        else:
            stop = self.group_rank in cut_off
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

    def _run_program(
        self, program: Callable[[Wire], Any], exchange: int, *, sealed: bool = False, forge: bool = False
    ) -> _Outcome:
        assert self.group is not None
        sealer = _Sealer(self, exchange, forge=forge) if sealed and self._auth is not None else None
        wire = Wire(self.group, self.world_size, self.group_rank, staging=self._staging, sealer=sealer)
        result = program(wire)
        return _Outcome(result, wire.nbytes_sent, wire.nbytes_recv, wire.control_bytes, phases=wire.phases)


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


def _gather_payloads(
    group: dist.ProcessGroup, tensor: torch.Tensor, numels: list[int], rank: int, staging: HostStaging
) -> list[torch.Tensor]:
    """Every rank's payload, on the device of this rank's `tensor` (see `_gather_host_payloads`). The slow link is
    gloo over TCP on host memory: a device payload crosses it through `staging` (docs/design.md §9)."""
    gathered = _gather_host_payloads(group, staging.to_host(tensor), numels, rank, staging)
    return [tensor if peer == rank else staging.to_device(part, tensor.device) for peer, part in enumerate(gathered)]


def _gather_host_payloads(
    group: dist.ProcessGroup, tensor: torch.Tensor, numels: list[int], rank: int, staging: HostStaging
) -> list[torch.Tensor]:
    """Every rank's 1-D `tensor` of `numels[i]` elements, in rank order (this rank's entry is `tensor` itself).

    Two ranks swap their payloads directly, the receive posted before the send, so both directions of the link
    are busy at once and nothing is padded; gloo's all-gather, measured on a tc-shaped link
    (`benchmarks/results/shaped_link/`), often ran the two directions one after the other (up to 2x the time).
    More ranks use gloo's all-gather padded to the longest payload (it gathers equal sizes only)."""
    world = len(numels)
    if world == 2:
        peer = 1 - rank
        received = staging.host_buffer(numels[peer], tensor.dtype)
        if numels[peer] or numels[rank]:
            # group ranks, not global ones: an elastic run's group (torchft's) is not in the default world
            pending = []
            if numels[peer]:
                pending.append(dist.irecv(received, group=group, group_src=peer))
            if numels[rank]:
                pending.append(dist.isend(tensor.contiguous(), group=group, group_dst=peer))
            for work in pending:
                work.wait()
        return [tensor, received] if rank == 0 else [received, tensor]
    longest = max(numels)
    if longest == 0:
        return [tensor[:0] for _ in range(world)]
    if tensor.numel() == longest and tensor.is_contiguous():
        padded = tensor
    else:
        padded = staging.host_buffer(longest, tensor.dtype)
        padded[: tensor.numel()] = tensor
        padded[tensor.numel() :] = 0
    slots = [staging.host_buffer(longest, tensor.dtype) for _ in range(world)]
    dist.all_gather(slots, padded, group=group)
    gathered = [slot[:n] for slot, n in zip(slots, numels, strict=True)]
    gathered[rank] = tensor
    return gathered


class _LocalWire(Wire):
    """The wire of a group of one: every step is local and moves nothing."""

    def __init__(self) -> None:
        super().__init__(group=None, world_size=1, rank=0)  # type: ignore[arg-type]

    def all_to_all(
        self, chunks: list[torch.Tensor], recv_sizes: list[int], *, header: bool = False, skip_empty: bool = True
    ) -> list[torch.Tensor]:
        return list(chunks)

    def all_gather(self, tensor: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        return [tensor]
