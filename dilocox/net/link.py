"""The slow link as numbers: rate and duration parsing, a FIFO link model, and exact ring byte counts.

Everything here is pure Python (no torch, no process groups), so the trainer, the planner and the tests
share one definition of "how many bytes does this collective put on the wire and how long does it take".

Byte conventions (per rank, for a group of `C` ranks, the algorithms gloo/NCCL use on a ring):

- ring all-reduce of `n` elements of `e` bytes (`N = n * e`), split into `C` chunks as `torch.tensor_split`
  would (chunk `i` has `n // C + (1 if i < n % C else 0)` elements, `c[i]` its bytes). Reduce-scatter: rank `r`
  sends every chunk but `r+1` and receives every chunk but `r`; all-gather: it sends every chunk but `r+2` and
  receives every chunk but `r+1` (indices mod `C`). Hence
  `sent = (N - c[r+1]) + (N - c[r+2])`, `recv = (N - c[r]) + (N - c[r+1])`, about `2 (C-1)/C x N` each.
- ring all-gather of per-rank payloads of `s[i]` bytes: `sent = sum(s) - s[r+1]`, `recv = sum(s) - s[r]`.

Time convention: a transfer is charged `max(sent, recv)` bytes (the link is full duplex, so sending and
receiving overlap) plus one `latency` per collective. A real ring pays a latency per step (`2 (C-1)` for an
all-reduce); charging one keeps the model simple and exact for the bandwidth-dominated transfers that matter.
"""

from __future__ import annotations

import math
import re

_NUMBER = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
# "b" is bits and "B" bytes, so the unit letter keeps its case; only the SI prefix and "ps" are case-free.
_RATE = re.compile(rf"^(?P<num>{_NUMBER})\s*(?P<prefix>[kmgt]?)(?P<unit>[bB])(?:ps)$", re.IGNORECASE)
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_UNLIMITED = {"unlimited", "inf", "infinity"}

_DURATION = re.compile(rf"^(?P<num>{_NUMBER})\s*(?P<unit>s|ms|us|µs|ns)?$", re.IGNORECASE)
_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}

_BANDWIDTH_EXAMPLES = "'1Gbps', '100Mbps', '2.5Gbps', '500Kbps' (bits/s), '10MBps' (bytes/s) or 'unlimited'"
_LATENCY_EXAMPLES = "'10ms', '1.5s', '250us' or '0'"


def parse_bandwidth(text: str) -> float | None:
    """Parse `network.bandwidth` into bytes per second; None means unlimited (no emulation).

    Units are decimal SI: `b` is bits, `B` is bytes, so "1Gbps" = 1e9 bit/s = 1.25e8 B/s and "10MBps" = 1e7 B/s.
    """
    if not isinstance(text, str):
        raise ValueError(
            f"network.bandwidth = {text!r} must be a string with a unit, e.g. {_BANDWIDTH_EXAMPLES} "
            "(a bare number is ambiguous between bits and bytes)"
        )
    stripped = text.strip()
    if stripped.lower() in _UNLIMITED:
        return None
    match = _RATE.match(stripped)
    if match is None:
        raise ValueError(f"network.bandwidth = {text!r} is not a rate; use e.g. {_BANDWIDTH_EXAMPLES}")
    value = float(match["num"]) * _PREFIX[match["prefix"].lower()]
    if match["unit"] == "b":
        value /= 8.0
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(
            f"network.bandwidth = {text!r} must be a positive, finite rate; use e.g. {_BANDWIDTH_EXAMPLES}"
        )
    return value


def parse_duration(text: str, *, name: str = "network.latency") -> float:
    """Parse a duration option (`network.latency` unless `name` says which) into seconds: "10ms", "1.5s", "250us",
    "0" (a bare number must be zero)."""
    if not isinstance(text, str):
        raise ValueError(f"{name} = {text!r} must be a string with a unit, e.g. {_LATENCY_EXAMPLES}")
    match = _DURATION.match(text.strip())
    if match is None:
        raise ValueError(f"{name} = {text!r} is not a duration; use e.g. {_LATENCY_EXAMPLES}")
    value = float(match["num"])
    unit = match["unit"]
    if unit is None and value != 0.0:
        # "10" could mean seconds or milliseconds; guessing wrong is off by 1000x, so ask for the unit.
        raise ValueError(f"{name} = {text!r} needs a unit (e.g. '{match['num']}ms' or '{match['num']}s')")
    seconds = value * _SECONDS[(unit or "s").lower()]
    if not math.isfinite(seconds) or seconds < 0.0:
        raise ValueError(f"{name} = {text!r} must be a non-negative, finite duration; use e.g. {_LATENCY_EXAMPLES}")
    return seconds


def _check_rank(world: int, rank: int) -> None:
    if world < 1:
        raise ValueError(f"group size {world} must be >= 1")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a group of {world} ranks (expected 0 <= rank < {world})")


def ring_chunk_numels(numel: int, world: int) -> list[int]:
    """Element counts of the `world` chunks of a ring collective, split as `torch.tensor_split(t, world)` does."""
    if numel < 0:
        raise ValueError(f"numel {numel} must be >= 0")
    _check_rank(world, 0)
    base, extra = divmod(numel, world)
    return [base + (1 if i < extra else 0) for i in range(world)]


def ring_all_reduce_bytes(numel: int, elem_size: int, world: int, rank: int) -> tuple[int, int]:
    """(sent, received) bytes of `rank` in a ring all-reduce (reduce-scatter + all-gather) of `numel` elements.

    Rank r sends `(N - c[r+1]) + (N - c[r+2])` and receives `(N - c[r]) + (N - c[r+1])`, N = numel * elem_size,
    c the chunk bytes (see the module docstring). A group of one moves nothing.
    """
    if elem_size < 1:
        raise ValueError(f"elem_size {elem_size} must be >= 1")
    _check_rank(world, rank)
    chunks = [k * elem_size for k in ring_chunk_numels(numel, world)]
    total = numel * elem_size
    if world == 1:
        return 0, 0
    sent = (total - chunks[(rank + 1) % world]) + (total - chunks[(rank + 2) % world])
    recv = (total - chunks[rank]) + (total - chunks[(rank + 1) % world])
    return sent, recv


def ring_all_gather_bytes(sizes: list[int], rank: int) -> tuple[int, int]:
    """(sent, received) bytes of `rank` in a ring all-gather where rank i contributes `sizes[i]` bytes.

    Rank r forwards every payload but the one of r+1 (its successor, where the ring ends) and receives every
    payload but its own: `sent = sum(s) - s[r+1]`, `recv = sum(s) - s[r]`. Sizes are the unpadded payloads, what
    a variable-size ring sends.
    """
    _check_rank(len(sizes), rank)
    if any(s < 0 for s in sizes):
        raise ValueError(f"payload sizes {sizes} must be >= 0")
    world = len(sizes)
    if world == 1:
        return 0, 0
    total = sum(sizes)
    return total - sizes[(rank + 1) % world], total - sizes[rank]


def link_charge_bytes(sent: int, recv: int) -> int:
    """Bytes a full-duplex link is busy for: sending and receiving overlap, so the larger direction counts."""
    return max(sent, recv)


class LinkModel:
    """A FIFO link of `bytes_per_s` (None = unlimited) with a pipelined one-way `latency_s`.

    A transfer starts when it is launched and the previous one has left the wire, occupies the wire for
    `nbytes / bytes_per_s`, and completes `latency_s` later; the next transfer may serialize meanwhile.

        link = LinkModel(1.25e8, latency_s=0.01)          # 1 Gbps, 10 ms
        start, done = link.schedule(nbytes=50_000_000, launch_time=time.perf_counter())
        link.busy_s                                         # time with at least one transfer in flight
    """

    def __init__(self, bytes_per_s: float | None, latency_s: float = 0.0) -> None:
        if bytes_per_s is not None and not (math.isfinite(bytes_per_s) and bytes_per_s > 0.0):
            raise ValueError(
                f"network.bandwidth = {bytes_per_s!r} bytes/s must be positive and finite; "
                f"use e.g. {_BANDWIDTH_EXAMPLES}"
            )
        if not (math.isfinite(latency_s) and latency_s >= 0.0):
            raise ValueError(f"network.latency = {latency_s!r} s must be >= 0 and finite; use e.g. {_LATENCY_EXAMPLES}")
        self.bytes_per_s = bytes_per_s
        self.latency_s = latency_s
        self.busy_s = 0.0
        self.free_at = -math.inf  # when the wire can take the next transfer's first byte
        self._covered_until = -math.inf  # end of the union of [start, done] intervals seen so far

    def serialize_s(self, nbytes: int) -> float:
        """Seconds `nbytes` occupy the wire (0 when unlimited)."""
        if nbytes < 0:
            raise ValueError(f"nbytes {nbytes} must be >= 0")
        return 0.0 if self.bytes_per_s is None else nbytes / self.bytes_per_s

    def duration_s(self, nbytes: int) -> float:
        """Seconds from start to completion of one transfer on an idle link: `latency + nbytes / bandwidth`."""
        return self.serialize_s(nbytes) + self.latency_s

    def schedule(self, nbytes: int, launch_time: float, *, phases: int = 1) -> tuple[float, float]:
        """Queue a transfer of `nbytes` launched at `launch_time`; return its (start, done) times.

        `phases` > 1 is a transfer of dependent steps (a reduce-scatter whose result is all-gathered): each step
        waits one latency for the previous one, so it completes `phases` latencies after its last byte left.
        The wire is counted free once the bytes are out (the next transfer's bytes may use those waits).
        """
        if phases < 1:
            raise ValueError(f"phases {phases} must be >= 1")
        wire_s = self.serialize_s(nbytes)
        start = max(launch_time, self.free_at)
        self.free_at = start + wire_s
        done = self.free_at + phases * self.latency_s
        # Starts never decrease (each is >= the previous free_at), so a running end point gives the union.
        self.busy_s += max(0.0, done - max(start, self._covered_until))
        self._covered_until = max(self._covered_until, done)
        return start, done
