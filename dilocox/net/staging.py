"""Host staging of slow-link payloads: how a device tensor crosses the gloo link without stalling the GPU.

The slow link is gloo over TCP on host memory (docs/design.md §9), and every collective runs on the WAN channel's
communicator thread. A payload made on a GPU must reach host memory before gloo sends it, and what arrives must go
back to the GPU. A plain `.cpu()` on the communicator thread would copy on the default stream, where the trainer's
kernels run: the copy waits for every kernel queued before it, and every kernel queued after it waits for the copy.
`HostStaging` keeps the two apart:

- at launch, on the trainer's thread, an event is recorded on the compute stream right after the payload was made
  (`ticket`);
- on the communicator thread, a side stream of the device waits for that event only, then copies the payload into
  a pinned host buffer (`to_host`); only the communicator thread waits for the copy;
- what arrives is copied back on the side stream (`to_device`, `copy_to_device_`), an event is recorded after it
  (`finish`), and the compute stream waits for that event when the trainer takes the result (`StagingTicket.
  before_use`, called by `PendingTransfer.wait`), never for the link itself.

The pinned buffers are reused from one transfer to the next (`HostBuffers`), so a run of rounds with payloads of
the same sizes allocates them once. On the CPU there is no ticket and every step returns its input: the tensors are
already in host memory, and the collective runs on them as it always did.

    ticket = staging.ticket(payload.device)             # trainer thread, at launch
    with staging.running(ticket):                       # communicator thread
        host = staging.to_host(payload)                 # pinned, on the side stream
        dist.all_reduce(host, group=group)
        staging.copy_to_device_(payload, host)
        staging.finish(ticket, payload)
    ticket.before_use()                                 # trainer thread, in wait()
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["HostBuffers", "HostStaging", "StagingTicket"]

_MIN_BUFFER_BYTES = 1 << 16
"""The smallest pinned buffer allocated: small payloads (lengths, tags, low-rank factors of tiny tensors) share
one size class instead of pinning a page each."""


class HostBuffers:
    """Host buffers reused across transfers: the k-th buffer one transfer takes is the k-th buffer of the transfer
    before, grown when it is too small (to the next power of two of bytes, so payloads that vary a little from
    round to round, like the adaptive codec's, do not allocate every round).

        buffers = HostBuffers(pin=True)
        send = buffers.take(numel, torch.float32)      # (numel,) view of the first buffer
        recv = buffers.take(numel, torch.float32)      # the second
        ...                                            # copies and the collective
        buffers.release()                              # the transfer is done; the next one takes them again

    `pin=True` page-locks them (`torch.empty(..., pin_memory=True)`, needs CUDA), which lets the GPU copy to and
    from them asynchronously. One transfer at a time uses them: the channel's communicator thread.
    """

    def __init__(self, *, pin: bool) -> None:
        self.pin = pin
        self._buffers: list[torch.Tensor] = []  # uint8, one per position in a transfer
        self._taken = 0
        self.num_allocations = 0
        """Buffers allocated so far (a new position, or one grown)."""

    @property
    def nbytes(self) -> int:
        """Bytes held, pinned when `pin`."""
        return sum(buffer.numel() for buffer in self._buffers)

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A (numel,) tensor of `dtype` in the next buffer of this transfer; its values are whatever it held."""
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        if self._taken == len(self._buffers):
            self._buffers.append(torch.empty(0, dtype=torch.uint8))
        buffer = self._buffers[self._taken]
        if buffer.numel() < nbytes:
            capacity = max(_MIN_BUFFER_BYTES, 1 << (nbytes - 1).bit_length())
            buffer = torch.empty(capacity, dtype=torch.uint8, pin_memory=self.pin)
            self._buffers[self._taken] = buffer
            self.num_allocations += 1
        self._taken += 1
        return buffer[:nbytes].view(dtype)

    def release(self) -> None:
        """The transfer that took the buffers is done with them (its copies have completed)."""
        self._taken = 0


@dataclass(eq=False)
class StagingTicket:
    """What one transfer of a CUDA payload needs to stage it: the streams and the events between them."""

    device: torch.device
    compute_stream: torch.cuda.Stream
    """The stream current on the trainer's thread at launch: it made the payload and will use the result."""
    side_stream: torch.cuda.Stream
    """The device's staging stream: the copies to and from the host run on it."""
    ready: torch.cuda.Event
    """Recorded on the compute stream at launch: the payload is complete once it has passed."""
    done: torch.cuda.Event | None = field(default=None)
    """Recorded on the side stream after the last copy back (`HostStaging.finish`)."""

    def before_use(self) -> None:
        """Make the compute stream wait for the copies back to the device (trainer thread, before it reads the
        result). The communicator thread has waited for them already, so this orders, it does not stall."""
        if self.done is not None:
            self.compute_stream.wait_event(self.done)


class HostStaging:
    """Moves slow-link payloads between a device and pinned host buffers on a side CUDA stream (module docstring).

    One per `WanChannel`. `ticket` runs on the thread that launches transfers; everything else on the communicator
    thread, one transfer at a time. A CPU payload gets no ticket, and then `to_host`, `to_device` and
    `copy_to_device_` return or write their input as it is, and `host_buffer` allocates a fresh tensor (it is
    handed to the caller).
    """

    def __init__(self) -> None:
        self.buffers = HostBuffers(pin=True)
        """The pinned buffers of CUDA transfers (allocated on first use, so a CPU run never pins memory)."""
        self._side_streams: dict[int, torch.cuda.Stream] = {}
        self._active: StagingTicket | None = None  # the ticket of the transfer running on the communicator thread

    def ticket(self, device: torch.device | None) -> StagingTicket | None:
        """At launch, on the trainer's thread: None for a host payload, else the ticket of a payload on `device`,
        with its readiness recorded on the current stream."""
        if device is None or device.type != "cuda":
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        device = torch.device("cuda", index)
        side = self._side_streams.get(index)
        if side is None:
            side = self._side_streams[index] = torch.cuda.Stream(device=device)
        compute = torch.cuda.current_stream(device)
        ready = torch.cuda.Event()
        ready.record(compute)
        return StagingTicket(device=device, compute_stream=compute, side_stream=side, ready=ready)

    @contextmanager
    def running(self, ticket: StagingTicket | None) -> Iterator[None]:
        """The scope of one transfer on the communicator thread. With a ticket, the side stream is current (every
        kernel the transfer runs, the copies and a program's local decoding, goes to it) and waits for the payload;
        on leaving, the thread waits for the side stream's work, so the pinned buffers are free for the next one."""
        if ticket is None:
            yield
            return
        with torch.cuda.device(ticket.device), torch.cuda.stream(ticket.side_stream):
            ticket.side_stream.wait_event(ticket.ready)
            self._active = ticket
            try:
                yield
            finally:
                self._active = None
                ticket.side_stream.synchronize()
                self.buffers.release()

    def finish(self, ticket: StagingTicket | None, result: Any) -> None:
        """After the transfer's last copy: record `done`, and hand the CUDA tensors of `result` (a tensor, or
        lists, tuples and dicts holding some) to the compute stream, so the caching allocator does not reuse their
        memory on the side stream while the trainer still reads them."""
        if ticket is None:
            return
        for tensor in _cuda_tensors(result):
            tensor.record_stream(ticket.compute_stream)
        ticket.done = torch.cuda.Event()
        ticket.done.record(ticket.side_stream)

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A (numel,) host tensor to receive into: a pinned reused buffer inside a CUDA transfer (what arrives is
        copied to the device before the transfer ends), a fresh tensor otherwise (it is the result itself)."""
        if self._active is None:
            return torch.empty(numel, dtype=dtype)
        return self.buffers.take(numel, dtype)

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`'s values in host memory, of its shape, contiguous: a host tensor itself (made contiguous), a
        CUDA one copied into a pinned buffer on the side stream (this thread waits for the copy, the compute
        stream does not). Outside a CUDA transfer's scope a CUDA tensor is copied the plain blocking way."""
        if tensor.device.type == "cpu":
            return tensor.contiguous()
        if self._active is None:
            return tensor.cpu()
        host = self.buffers.take(tensor.numel(), tensor.dtype)
        host.copy_(tensor.reshape(-1), non_blocking=True)
        self._active.side_stream.synchronize()  # gloo reads the host bytes next
        return host.view(tensor.shape)

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A host tensor's values on `device`: itself for the CPU; a new tensor copied on the side stream for CUDA
        (ordered before the compute stream's use by `finish` and `StagingTicket.before_use`)."""
        if device.type == "cpu":
            return host
        if self._active is None:
            return host.to(device)
        out = torch.empty(host.shape, dtype=host.dtype, device=device)  # the side stream's memory until `finish`
        out.copy_(host, non_blocking=True)
        return out

    def copy_to_device_(self, tensor: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        """Write `host`'s values into `tensor` (in place): a plain copy on the CPU, on the side stream for CUDA."""
        tensor.copy_(host, non_blocking=self._active is not None)
        return tensor


def _cuda_tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        if value.is_cuda:
            yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _cuda_tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _cuda_tensors(item)
