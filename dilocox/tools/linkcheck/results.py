"""The comparison's arithmetic and records: measured times against what the emulated link charges.

The workers' records become one row per transfer, its measured time beside the model's:

    rows = summarize(records_by_rank, bytes_per_s=12_500_000.0)
    rows[0].shaped_s, rows[0].emulated_s, rows[0].diff_pct
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dilocox.net.link import LinkModel, link_charge_bytes


def relative_diff_pct(measured_s: float, model_s: float) -> float:
    """How much slower (+) or faster (-) the shaped link was than the model, in percent of the model's time."""
    if model_s <= 0.0:
        raise ValueError(f"model time {model_s!r} s must be > 0 to compare against it")
    return (measured_s - model_s) / model_s * 100.0


def emulated_seconds(nbytes_sent: int, nbytes_recv: int, control_bytes: int, bytes_per_s: float) -> float:
    """What the emulated channel charges one collective at latency 0: `(max(sent, recv) + control) / bandwidth`.

    This is the charge of the channel's communicator (`Communicator._execute`) in emulation mode, rebuilt from the public pieces
    (`link_charge_bytes`, `LinkModel`), with the latency left out because the shaped link has none to compare.
    """
    charged = link_charge_bytes(nbytes_sent, nbytes_recv) + control_bytes
    return LinkModel(bytes_per_s, latency_s=0.0).duration_s(charged)


def slowest_per_repeat(times_by_rank: Sequence[Sequence[float]]) -> list[float]:
    """The slowest rank's time of every repeat: `times_by_rank[rank][repeat]` -> one time per repeat.

    A collective is done when its last rank is done, so each repeat counts as its slowest rank.
    """
    if not times_by_rank or not times_by_rank[0]:
        raise ValueError("slowest_per_repeat needs at least one rank with at least one repeat")
    num_repeats = len(times_by_rank[0])
    if any(len(times) != num_repeats for times in times_by_rank):
        raise ValueError(f"every rank must report the same number of repeats, got {[len(t) for t in times_by_rank]}")
    return [max(times[k] for times in times_by_rank) for k in range(num_repeats)]


def median_of_slowest(times_by_rank: Sequence[Sequence[float]]) -> float:
    """Median over repeats of the slowest rank's time (see `slowest_per_repeat`).

    The median drops the odd repeat disturbed by the other processes sharing the machine.
    """
    return statistics.median(slowest_per_repeat(times_by_rank))


@dataclass(frozen=True)
class LinkcheckRow:
    """One transfer, timed on the shaped link and charged by the model: the unit of the comparison."""

    op: str
    """"all_reduce" (fp32, sum) or "all_gather" (uint8)."""
    size_bytes: int
    """Payload per rank."""
    charged_bytes: int
    """What the emulated link charges: `max(sent, recv)` plus control bytes, the largest over ranks."""
    shaped_s: float
    """Measured on the shaped link: median over repeats of the slowest rank."""
    emulated_s: float
    """`charged_bytes / bandwidth` (latency 0): what the emulated channel would take."""
    samples_s: tuple[float, ...] = ()
    """The slowest rank's time of every repeat (`shaped_s` is their median)."""

    @property
    def diff_pct(self) -> float:
        return relative_diff_pct(self.shaped_s, self.emulated_s)

    @property
    def ratio(self) -> float:
        """shaped / emulated."""
        return self.shaped_s / self.emulated_s

    @property
    def achieved_bits_per_s(self) -> float:
        """Charged (payload) bits over the measured time: what the link delivered as the model counts bytes."""
        return self.charged_bytes * 8 / self.shaped_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "size_bytes": self.size_bytes,
            "charged_bytes": self.charged_bytes,
            "shaped_s": self.shaped_s,
            "emulated_s": self.emulated_s,
            "samples_s": list(self.samples_s),
            "diff_pct": self.diff_pct,
            "ratio": self.ratio,
            "achieved_bits_per_s": self.achieved_bits_per_s,
        }


@dataclass
class ShapedLink:
    """All rows of one shaped rate, with what the tbf qdiscs counted on the wire."""

    bandwidth: str
    bytes_per_s: float
    tbf: dict[str, Any]
    """The qdisc as configured: rate_bits, burst_bytes, latency."""
    rows: list[LinkcheckRow]
    wire: list[dict[str, Any]] = field(default_factory=list)
    """Per cluster: qdisc bytes/packets/drops and the channel's payload bytes over the whole phase."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "bandwidth": self.bandwidth,
            "bytes_per_s": self.bytes_per_s,
            "tbf": self.tbf,
            "rows": [row.to_dict() for row in self.rows],
            "wire": self.wire,
        }


@dataclass
class LinkcheckResult:
    """A whole `dilocox linkcheck`: the setting, the unshaped baseline and one `ShapedLink` per rate."""

    num_clusters: int
    sizes: list[int]
    repeats: int
    warmup: int
    unshaped_s: dict[str, float]
    """`"op/size_bytes"` -> median seconds on the unshaped veth."""
    links: list[ShapedLink]
    command: str = ""
    date: str = ""
    topology: str = ""
    host: dict[str, Any] = field(default_factory=dict)

    def unshaped(self, op: str, size_bytes: int) -> float | None:
        return self.unshaped_s.get(transfer_key(op, size_bytes))

    def to_dict(self) -> dict[str, Any]:
        return {
            "command": self.command,
            "date": self.date,
            "num_clusters": self.num_clusters,
            "sizes": self.sizes,
            "repeats": self.repeats,
            "warmup": self.warmup,
            "topology": self.topology,
            "latency_s": 0.0,
            "host": self.host,
            "unshaped_s": self.unshaped_s,
            "links": [link.to_dict() for link in self.links],
        }


def transfer_key(op: str, size_bytes: int) -> str:
    """Key of one transfer in `LinkcheckResult.unshaped_s`: "all_reduce/1000000"."""
    return f"{op}/{size_bytes}"


def summarize(records_by_rank: Sequence[Sequence[dict[str, Any]]], bytes_per_s: float) -> list[LinkcheckRow]:
    """Turn the workers' records into rows, in the order the transfers ran.

    A record is `{"op", "size_bytes", "repeat", "link_s", "nbytes_sent", "nbytes_recv", "control_bytes"}`, one
    per rank, transfer and measured repeat. Time: the median of `slowest_per_repeat`; bytes charged: the largest
    over ranks (a collective lasts as long as its busiest rank's link; uneven ring chunks differ by a few bytes).
    """
    order: list[tuple[str, int]] = []
    times: dict[tuple[str, int], list[dict[int, float]]] = {}
    charged: dict[tuple[str, int], int] = {}
    for rank, records in enumerate(records_by_rank):
        for record in records:
            key = (record["op"], int(record["size_bytes"]))
            if key not in times:
                order.append(key)
                times[key] = [{} for _ in records_by_rank]
                charged[key] = 0
            times[key][rank][int(record["repeat"])] = float(record["link_s"])
            charge = link_charge_bytes(int(record["nbytes_sent"]), int(record["nbytes_recv"]))
            charged[key] = max(charged[key], charge + int(record["control_bytes"]))
    rows = []
    for key in order:
        per_rank = times[key]
        if any(not by_repeat for by_repeat in per_rank):
            missing = [rank for rank, by_repeat in enumerate(per_rank) if not by_repeat]
            raise ValueError(f"{key[0]} of {key[1]} bytes: ranks {missing} reported no measurement")
        repeats = sorted(per_rank[0])
        samples = slowest_per_repeat([[by_repeat.get(k, math.nan) for k in repeats] for by_repeat in per_rank])
        if any(math.isnan(sample) for sample in samples):
            raise ValueError(f"{key[0]} of {key[1]} bytes: the ranks reported different repeats")
        rows.append(
            LinkcheckRow(
                op=key[0],
                size_bytes=key[1],
                charged_bytes=charged[key],
                shaped_s=statistics.median(samples),
                emulated_s=LinkModel(bytes_per_s, latency_s=0.0).duration_s(charged[key]),
                samples_s=tuple(samples),
            )
        )
    return rows
