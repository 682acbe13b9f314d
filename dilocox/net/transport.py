"""The slow link's transport: one communicator thread per channel runs its collectives in launch order, each as a
real blocking gloo collective, and hands its result to the trainer's `PendingTransfer.wait()`.

    communicator = Communicator(account, staging)
    transfer = communicator.submit("all_gather", run)   # run(exchange) -> Outcome, on the communicator thread
    result = transfer.wait()                            # the blocked time is counted by the account

A multi-step collective is a program of `Wire` steps (`WanChannel.launch_program`), each counted exactly; what a
collective carried and how long the link took is the `LinkAccount`'s (`dilocox.net.accounting`).
"""

from __future__ import annotations

import atexit
import math
import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from dilocox.net.accounting import LinkAccount
from dilocox.net.link import ring_all_gather_bytes
from dilocox.net.sealing import PayloadsRejected
from dilocox.net.staging import HostStaging, StagingTicket

ResultT = TypeVar("ResultT")

_CANCEL_JOIN_S = 5.0  # how long close(cancel=True) waits for a collective already on the wire
_OPEN: weakref.WeakSet[Communicator] = weakref.WeakSet()
"""Communicators whose thread runs: closed at interpreter exit (`_close_at_exit`)."""


@atexit.register
def _close_at_exit() -> None:
    """A program that ends (an exception in the user's loop) with a channel open: stop its communicator thread before
    the interpreter finalizes. A daemon thread still inside a torch collective then would be unwound through C++ code
    that cannot be, and the process would abort ("terminate called without an active exception", SIGABRT) instead of
    exiting with the program's own error."""
    for communicator in list(_OPEN):
        communicator.close(cancel=True)


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
    _account: LinkAccount | None = field(default=None, repr=False)
    """Where its wait is counted (None: a transfer that completed at its launch)."""
    _staged: StagingTicket | None = field(default=None, repr=False)
    """How a CUDA payload is staged through the host (None for a host payload)."""
    _in_peak: bool = field(default=True, repr=False)
    """Whether it counts towards `WanChannel.peak_in_flight_bytes` (not a transfer launched `off_peak`)."""

    @classmethod
    def completed(cls, kind: str, result: Any, now: float) -> PendingTransfer[Any]:
        """A transfer that moved nothing (a group of one), done at its launch, `now`."""
        transfer: PendingTransfer[Any] = cls(kind, launch_time=now, start_time=now, done_time=now, link_done_time=now)
        transfer._complete(result)
        return transfer

    def done(self) -> bool:
        """True once `wait()` would return (or raise) without blocking."""
        return self._finished.is_set()

    def wait(self) -> ResultT:
        """Block until the transfer completes and return its result; the blocked time counts as exposed until the
        link would have delivered it, and as a wait for peers after that (`split_wait`)."""
        if not self._finished.is_set():
            if self._account is None:
                self._finished.wait()
            else:
                clock = self._account.clock
                blocked_from = clock.now()
                clock.block(self._finished)
                self._account.add_wait(*self.split_wait(blocked_from, clock.now()))
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
class Outcome:
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


@dataclass
class Job:
    transfer: PendingTransfer[Any]
    run: Callable[[int], Outcome]
    """Runs the collective; takes the job's `exchange`."""
    account: bool = True
    exchange: int = 0
    """Position among every collective launched on this channel (accounted or not), the same on every rank of the
    group: the sequence number authenticated payloads are tagged with."""


def _drained(jobs: queue.Queue) -> Iterator[Job]:
    """The jobs still queued on a communicator's queue, each taken off it (the stop marker, None, is skipped)."""
    while True:
        try:
            job = jobs.get_nowait()
        except queue.Empty:
            return
        if job is not None:
            yield job


class Communicator:
    """The communicator thread of one channel: runs the collectives submitted to it one at a time, in launch order (so
    every rank issues the same sequence on the group), and completes each `PendingTransfer` once its `LinkAccount`
    has counted it (and, emulated, once the link model delivered it).

    A collective that fails fails every later one (the group's sequence is broken) until `rebound`; `release` lets go
    of a failed group; `abandon` stops waiting for what is on the wire; `close` stops the thread.
    """

    def __init__(self, account: LinkAccount, staging: HostStaging) -> None:
        self.account = account
        self.staging = staging
        self._lock = threading.Lock()  # guards the lifecycle flags and the counts below
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._abandoned: set[threading.Thread] = set()  # communicator threads left to a collective (`abandon`)
        self._closed = False
        self._cancelled = False
        self._failure: BaseException | None = None
        self._released = False  # release() let go of the group; rebound() ends that
        self._in_flight = 0  # launched and not yet completed or failed
        self._running: Job | None = None  # the job on the communicator thread
        self._previous_end = -math.inf  # when the communicator thread's last collective returned
        self._submitted = 0  # accounted transfers launched so far (the next one's `seq`)
        self._launched = 0  # collectives launched so far, accounted or not (the next one's `Job.exchange`)

    @property
    def num_in_flight(self) -> int:
        """Transfers launched and not yet completed (or failed), the one on the communicator thread included."""
        with self._lock:
            return self._in_flight

    @property
    def num_launched(self) -> int:
        """Collectives launched so far, accounted or not: the exchange number of the next one."""
        with self._lock:
            return self._launched

    def number_from(self, *, submitted: int, launched: int) -> None:
        """Number the next transfers after `submitted` accounted ones and `launched` collectives (a restored state)."""
        with self._lock:
            self._submitted, self._launched = submitted, launched

    def rebound(self, *, new_group: bool) -> None:
        """Later collectives run over another group: an earlier failure is forgotten (it was the old group's), and a
        `new_group` (another identity) numbers its collectives from 0."""
        with self._lock:
            if new_group:
                self._launched = 0
            self._failure = None
            self._released = False

    def release(self) -> None:
        """Forget the failure, whose frames hold the group; nothing can be launched until `rebound`."""
        with self._lock:
            self._failure = None
            self._released = True

    def submit(
        self, kind: str, run: Callable[[int], Outcome], account: bool = True, *, device: torch.device | None = None
    ) -> PendingTransfer[Any]:
        """Queue `run` (called with the collective's exchange number, on the communicator thread, which starts here
        if it is not running); `account`: count it and, emulated, hold it until the link model's arrival."""
        transfer: PendingTransfer[Any] = PendingTransfer(
            kind=kind, launch_time=self.account.clock.now(), _account=self.account, _in_peak=self.account.counts_peak
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
            transfer._staged = self.staging.ticket(device)  # on this thread: after the payload's kernels
            self._queue.put(Job(transfer, run, account, exchange=self._launched))
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

    def _serve(self, jobs: queue.SimpleQueue[Job | None]) -> None:
        """Communicator thread: run the collectives of `jobs` in launch order until the stop sentinel. A thread that
        `abandon` left to its collective fails nothing and counts nothing once that collective returns."""
        job: Job | None = None
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

    def _execute(self, job: Job) -> None:
        transfer = job.transfer
        # when this rank could start it: launched, and the previous collective off this thread
        real_start = max(transfer.launch_time, self._previous_end)
        with self.staging.running(transfer._staged):
            outcome = job.run(job.exchange)
            self.staging.finish(transfer._staged, outcome.result)
        real_end = self._previous_end = self.account.clock.now()
        with self._lock:
            if self._is_abandoned():  # its waiter was failed (`abandon`): the link and the counters go on without it
                return
        # the time the collective waited for late peers is not the link's
        peers_s = 0.0 if outcome.peers_ready is None else max(0.0, outcome.peers_ready - real_start)
        if job.account:
            start, done, link_done = self.account.deliver(
                outcome.nbytes_sent,
                outcome.nbytes_recv,
                outcome.control_bytes,
                phases=outcome.phases,
                launch_time=transfer.launch_time,
                started=real_start,
                ended=real_end,
                peers_s=peers_s,
                in_peak=transfer._in_peak,
            )
        else:  # neither counted nor emulated: the collective's own times
            start, done, link_done = real_start, real_end, real_end - peers_s
        transfer.nbytes_sent, transfer.nbytes_recv = outcome.nbytes_sent, outcome.nbytes_recv
        transfer.start_time, transfer.done_time, transfer.link_done_time = start, done, link_done
        transfer.link_s = link_done - start
        transfer._complete(outcome.result)


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
        self, group: dist.ProcessGroup, world_size: int, rank: int, *, staging: HostStaging | None = None
    ) -> None:
        self.group = group
        self.world_size = world_size
        self.rank = rank
        self.staging = staging if staging is not None else HostStaging()
        self.nbytes_sent = 0
        self.nbytes_recv = 0
        self.phases = 0

    def all_to_all(self, chunks: list[torch.Tensor], recv_sizes: list[int]) -> list[torch.Tensor]:
        """Send 1-D uint8 `chunks[j]` to rank j; return the chunk every rank i sent here, of `recv_sizes[i]` bytes.

        A direct exchange (each chunk crosses the link once): this rank sends `sum(chunks) - chunks[rank]` and
        receives `sum(recv_sizes) - recv_sizes[rank]` bytes; its own chunk stays local. Every rank calls it with
        sizes that follow the shapes, so where this rank has nothing to send or receive, neither has any other.
        """
        world, rank = self.world_size, self.rank
        if len(chunks) != world or len(recv_sizes) != world:
            raise ValueError(f"all_to_all needs one chunk and one receive size per rank ({world})")
        if any(chunk.dim() != 1 or chunk.dtype != torch.uint8 for chunk in chunks):
            raise ValueError("all_to_all takes 1-D uint8 chunks (encoded payloads)")
        if recv_sizes[rank] != chunks[rank].numel():
            raise ValueError(f"rank {rank} keeps its own chunk of {chunks[rank].numel()} bytes, not {recv_sizes[rank]}")
        send_sizes = [chunk.numel() for chunk in chunks]
        self.phases += 1
        if not any(send_sizes) and not any(recv_sizes):  # then every rank has nothing
            return list(chunks)
        received = self.staging.host_buffer(sum(recv_sizes), torch.uint8)
        sending = self.staging.to_host(torch.cat(chunks))
        dist.all_to_all_single(
            received, sending, output_split_sizes=recv_sizes, input_split_sizes=send_sizes, group=self.group
        )
        self.nbytes_sent += sum(send_sizes) - send_sizes[rank]
        self.nbytes_recv += sum(recv_sizes) - recv_sizes[rank]
        parts = list(torch.split(self.staging.to_device(received, chunks[rank].device), recv_sizes))
        parts[rank] = chunks[rank]
        return parts

    def all_gather(self, tensor: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        """Ring all-gather of 1-D uint8 payloads, rank i's of `sizes[i]` bytes; returns them in rank order."""
        world, rank = self.world_size, self.rank
        if len(sizes) != world or sizes[rank] != tensor.numel() or tensor.dim() != 1:
            raise ValueError(f"all_gather needs this rank's 1-D payload of sizes[{rank}] bytes and one size per rank")
        self.phases += 1
        gathered = gather_payloads(self.group, tensor, list(sizes), rank, self.staging)
        sent, recv = ring_all_gather_bytes(list(sizes), rank)
        self.nbytes_sent += sent
        self.nbytes_recv += recv
        return gathered


class LocalWire(Wire):
    """The wire of a group of one: every step is local and moves nothing."""

    def __init__(self) -> None:
        super().__init__(group=None, world_size=1, rank=0)  # type: ignore[arg-type]

    def all_to_all(self, chunks: list[torch.Tensor], recv_sizes: list[int]) -> list[torch.Tensor]:
        return list(chunks)

    def all_gather(self, tensor: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        return [tensor]


def gather_payloads(
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
