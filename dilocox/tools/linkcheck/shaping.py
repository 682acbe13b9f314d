"""Real link shaping: check the emulated slow link against a Linux link shaped with `tc tbf` (root only, optional).

`WanChannel` emulates the slow link between clusters: it runs each collective for real on a fast transport and
completes it when a `LinkModel` says `max(sent, recv) / bandwidth` seconds have passed. This module measures the
same collectives over a link the kernel actually shapes, so the model's times can be compared with real ones:

    dilocox linkcheck --bandwidth 100Mbps,1Gbps --out benchmarks/results/shaped_link

Topology (for any number of clusters C >= 2, one code path): every cluster is a network namespace with one
interface `wan0` (address 10.213.0.<i+1>/24), the end of a veth pair whose other end is a port of a bridge in a
separate *hub* namespace. The bridge lives in a namespace of its own, not in the host's root namespace, so the
check never touches the host's interfaces, routes or firewall (a host with `br_netfilter` and a FORWARD DROP
policy would otherwise drop the bridged traffic). A `tbf` qdisc on each `wan0` shapes the cluster's egress, which
is its *uplink* in `WanChannel`'s terms (`bandwidth` = bytes/s per cluster uplink); a cluster's downlink is not
shaped because it carries what the other clusters' shaped uplinks send. Latency is not shaped: `netem` is missing
on the kernels this was built for, so the comparison uses latency 0 and only checks bandwidth.

Names are `dlxshape-<pid>-hub` and `dlxshape-<pid>-c<i>`, so concurrent runs never collide, and namespaces are
deleted in `finally` (also on Ctrl+C and SIGTERM); namespaces left by a run that was killed with SIGKILL (its pid
no longer exists) are removed by the next run. Deleting a namespace also deletes its veth ends.

Each cluster runs one worker process (`ip netns exec NS python -m dilocox.tools.linkcheck.shaping worker`), one
gloo rank bound to `wan0`. For every payload size it runs a ring all-reduce (fp32) and an all-gather (uint8 payload)
through a `WanChannel(group, bandwidth=None, latency_s=0)`, which runs the real collective and records its measured time
and its exact byte counts; the emulated time is what `LinkModel` would charge for those bytes at the same rate.
The same transfers are timed once on the unshaped veth (the overhead floor), then under each requested rate.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dilocox
from dilocox.net.link import LinkModel, link_charge_bytes, parse_bandwidth

__all__ = [
    "LinkcheckResult",
    "LinkcheckRow",
    "ShapedLink",
    "ShapedNetwork",
    "ShapingError",
    "emulated_seconds",
    "estimate_transfer_s",
    "format_size",
    "format_table",
    "fresh_tcp_commands",
    "main",
    "median_of_slowest",
    "parse_sizes",
    "relative_diff_pct",
    "run_linkcheck",
    "setup_commands",
    "slowest_per_repeat",
    "shape_commands",
    "stale_namespaces",
    "summarize",
    "tbf_burst_bytes",
    "teardown_commands",
    "unavailable_reason",
    "unshape_commands",
    "write_results",
]

PREFIX = "dlxshape"
CLUSTER_IFNAME = "wan0"
BRIDGE = "br0"
SUBNET = "10.213.0"  # only ever configured inside namespaces this module creates
MASTER_PORT = 29500  # free by construction: cluster 0's namespace is new
DEFAULT_BANDWIDTH = "100Mbps"
DEFAULT_SIZES = "256KB,1MB,4MB,16MB"
DEFAULT_REPEATS = 3
NUM_WARMUP = 1
MAX_CLUSTERS = 64  # every cluster is one process on this machine; beyond this the CPU, not the link, is measured
OPS = ("all_reduce", "all_gather")
OP_LABELS = {"all_reduce": "all_reduce fp32", "all_gather": "all_gather uint8"}

# tbf lets `burst` bytes leave at line rate after an idle moment: a large bucket banks idle time that a real line
# loses, hiding the sender's pauses (measured, 16 MB ring all-reduce at 100 Mbit: 1.46 s with a 16 KB bucket,
# 1.36 s with 128 KB) and makes small transfers look faster than the rate. Too small a bucket and the qdisc's timer
# cannot keep up at Gbit rates (one TCP stream over veth at 1 Gbit: 924 Mbit/s with 3 KB, 954-957 with 8-64 KB).
# 16 KiB, or 100 us at the rate when that is larger, is the smallest bucket that delivers the full rate.
TBF_MIN_BURST = 16384
TBF_BURST_S = 1e-4
TBF_LATENCY = "50ms"  # queue limit as a delay: deep enough that TCP is never tail-dropped on a local veth

_PACKAGE_ROOT = str(Path(dilocox.__file__).resolve().parents[1])  # the directory holding the `dilocox` package

# The prefix is case-free ("kB" = "KB"), the unit must be "B": "Mb" would be megabits, which no payload is.
_SIZE = re.compile(r"^(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?:(?P<prefix>(?i:[kmg]i?))?B)?$")
_SIZE_FACTOR = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}
_SIZE_EXAMPLES = "'256KB,1MB,4MB,16MB' (KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024, a bare number is bytes)"

_ROOT_HINT = (
    "run it as root (e.g. `sudo $(command -v dilocox) linkcheck ...`) on a Linux host, or in a container started "
    "with `--cap-add NET_ADMIN --cap-add SYS_ADMIN` (or `--privileged`)"
)


class ShapingError(RuntimeError):
    """Real link shaping cannot run here (not root, no `ip`/`tc`, a kernel without veth/bridge/tbf) or it failed.

    The message says what was wrong and what to do; the CLI prints it as one line and exits non-zero.
    """


# --------------------------------------------------------------------------------------------- pure parts


def parse_sizes(text: str) -> list[int]:
    """Parse `--sizes` ("256KB,1MB,4MB,16MB") into payload bytes per rank.

    Sizes are decimal like the rates in `dilocox.net.link` ("1MB" = 1,000,000 bytes), so "16MB at 100Mbps" is
    exactly 1.28 s. Each must be a positive multiple of 4 bytes because it is also an fp32 all-reduce payload.
    """
    sizes: list[int] = []
    for item in text.split(","):
        item = item.strip()
        match = _SIZE.match(item)
        if match is None:
            bits = " (a lowercase b is bits; payload sizes are bytes: write B)" if item.endswith("b") else ""
            raise ValueError(f"--sizes: {item!r} is not a size{bits}; use e.g. {_SIZE_EXAMPLES}")
        value = float(match["num"]) * _SIZE_FACTOR[(match["prefix"] or "").lower()]
        nbytes = round(value)
        if abs(value - nbytes) > 1e-6 * max(1.0, value):
            raise ValueError(f"--sizes: {item!r} is {value} bytes, not a whole number of bytes")
        if nbytes <= 0 or nbytes % 4:
            raise ValueError(
                f"--sizes: {item!r} = {nbytes} bytes must be a positive multiple of 4 (it is also an fp32 "
                f"all-reduce payload); use e.g. {_SIZE_EXAMPLES}"
            )
        sizes.append(nbytes)
    return sizes


def format_size(nbytes: int) -> str:
    """A payload size as the user would have typed it: "256 KB", "1 MiB", else "1,234 B"."""
    for unit, factor in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor} {unit}"
    return f"{nbytes:,} B"


def parse_bandwidths(text: str) -> list[tuple[str, float]]:
    """Parse `--bandwidth` ("100Mbps" or "100Mbps,1Gbps") into (label, bytes/s); "unlimited" makes no sense here."""
    links: list[tuple[str, float]] = []
    for item in text.split(","):
        label = item.strip()
        bytes_per_s = parse_bandwidth(label)
        if bytes_per_s is None:
            raise ValueError(
                f"--bandwidth {label!r}: a shaped link needs a finite rate, e.g. '100Mbps' or '1Gbps' "
                "(the unshaped veth is always measured as the baseline)"
            )
        links.append((label, bytes_per_s))
    return links


def tbf_burst_bytes(bytes_per_s: float) -> int:
    """tbf bucket size for a rate: `TBF_MIN_BURST`, or `TBF_BURST_S` of traffic when that is larger (see there)."""
    return max(TBF_MIN_BURST, math.ceil(bytes_per_s * TBF_BURST_S))


def tbf_rate_bits(bytes_per_s: float) -> int:
    """tc takes integer bit/s; the model's bytes/s x 8, rounded."""
    return round(bytes_per_s * 8)


def relative_diff_pct(measured_s: float, model_s: float) -> float:
    """How much slower (+) or faster (-) the shaped link was than the model, in percent of the model's time."""
    if model_s <= 0.0:
        raise ValueError(f"model time {model_s!r} s must be > 0 to compare against it")
    return (measured_s - model_s) / model_s * 100.0


def emulated_seconds(nbytes_sent: int, nbytes_recv: int, control_bytes: int, bytes_per_s: float) -> float:
    """What the emulated channel charges one collective at latency 0: `(max(sent, recv) + control) / bandwidth`.

    This is the charge of `WanChannel._execute` in emulation mode, rebuilt from the public pieces
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
class ShapedNetwork:
    """The namespaces, interfaces and addresses of one run: a hub namespace with a bridge, one namespace per cluster.

        net = ShapedNetwork.for_this_process(num_clusters=2)
        net.cluster_ns(0), net.cluster_addr(0)      # "dlxshape-4242-c0", "10.213.0.1"

    Every name carries the pid, so two runs at once never share a namespace.
    """

    num_clusters: int
    tag: str
    """Unique part of every name: `<prefix>-<pid>`."""

    @classmethod
    def for_this_process(cls, num_clusters: int, *, prefix: str = PREFIX) -> ShapedNetwork:
        return cls(num_clusters=num_clusters, tag=f"{prefix}-{os.getpid()}")

    @property
    def hub_ns(self) -> str:
        return f"{self.tag}-hub"

    def cluster_ns(self, cluster: int) -> str:
        return f"{self.tag}-c{cluster}"

    def cluster_addr(self, cluster: int) -> str:
        return f"{SUBNET}.{cluster + 1}"

    def hub_port(self, cluster: int) -> str:
        """The hub's end of cluster `cluster`'s veth (the name only has to be unique inside the hub namespace)."""
        return f"c{cluster}"

    def namespaces(self) -> list[str]:
        return [self.hub_ns] + [self.cluster_ns(i) for i in range(self.num_clusters)]


def setup_commands(net: ShapedNetwork) -> list[list[str]]:
    """`ip` commands that build the namespaces, the bridge and one veth per cluster, all unshaped.

    Each veth is created directly with one end in the hub and the other in the cluster's namespace, so no
    interface ever appears in the host's root namespace, even for a moment.
    """
    hub = net.hub_ns
    commands = [
        ["ip", "netns", "add", hub],
        ["ip", "-n", hub, "link", "set", "lo", "up"],
        ["ip", "-n", hub, "link", "add", BRIDGE, "type", "bridge"],
        ["ip", "-n", hub, "link", "set", BRIDGE, "up"],
    ]
    for cluster in range(net.num_clusters):
        ns, port = net.cluster_ns(cluster), net.hub_port(cluster)
        commands += [
            ["ip", "netns", "add", ns],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "-n", hub, "link", "add", port, "type", "veth", "peer", "name", CLUSTER_IFNAME, "netns", ns],
            ["ip", "-n", hub, "link", "set", port, "master", BRIDGE],
            ["ip", "-n", hub, "link", "set", port, "up"],
            ["ip", "-n", ns, "addr", "add", f"{net.cluster_addr(cluster)}/24", "dev", CLUSTER_IFNAME],
            ["ip", "-n", ns, "link", "set", CLUSTER_IFNAME, "up"],
        ]
    return commands


def shape_commands(net: ShapedNetwork, bytes_per_s: float) -> list[list[str]]:
    """`tc` commands that cap every cluster's uplink (egress of its `wan0`) at `bytes_per_s` with a tbf qdisc."""
    rate = f"{tbf_rate_bits(bytes_per_s)}bit"
    burst = str(tbf_burst_bytes(bytes_per_s))  # a bare number is bytes for tc
    return [
        ["tc", "-n", net.cluster_ns(cluster), "qdisc", "add", "dev", CLUSTER_IFNAME, "root", "tbf"]
        + ["rate", rate, "burst", burst, "latency", TBF_LATENCY]
        for cluster in range(net.num_clusters)
    ]


def unshape_commands(net: ShapedNetwork) -> list[list[str]]:
    """Remove the tbf qdiscs again (the next rate starts from fresh counters)."""
    return [
        ["tc", "-n", net.cluster_ns(cluster), "qdisc", "del", "dev", CLUSTER_IFNAME, "root"]
        for cluster in range(net.num_clusters)
    ]


def fresh_tcp_commands(net: ShapedNetwork) -> list[list[str]]:
    """Forget what TCP learned about its peers in the previous phase (cached RTT, ssthresh, cwnd).

    Linux keeps per-destination TCP metrics per namespace and seeds new connections with them, so without this
    a phase at 100 Mbps would start from what the 1 Gbps (or unshaped) phase before it measured.
    """
    return [["ip", "-n", net.cluster_ns(cluster), "tcp_metrics", "flush", "all"] for cluster in range(net.num_clusters)]


def teardown_commands(net: ShapedNetwork, existing: Sequence[str] | None = None) -> list[list[str]]:
    """`ip netns del` for this run's namespaces (those in `existing`, when given); their veths go with them."""
    names = [ns for ns in net.namespaces()[::-1] if existing is None or ns in existing]
    return [["ip", "netns", "del", ns] for ns in names]


def stale_namespaces(listing: str, *, alive: Callable[[int], bool], prefix: str = PREFIX) -> list[str]:
    """Names in `ip netns list` output made by an earlier run of this module whose process no longer exists.

    Only names of the exact form `<prefix>-<pid>-hub|c<i>` with a dead pid qualify, so a concurrent run (alive)
    and anything made by someone else are never touched.
    """
    pattern = re.compile(rf"^{re.escape(prefix)}-(?P<pid>\d+)-(?:hub|c\d+)$")
    stale = []
    for line in listing.splitlines():
        name = line.split(" ", 1)[0].strip()
        match = pattern.match(name)
        if match and not alive(int(match["pid"])):
            stale.append(name)
    return stale


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


# --------------------------------------------------------------------------------------------- results


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
        return self.unshaped_s.get(_key(op, size_bytes))

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


def _key(op: str, size_bytes: int) -> str:
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


def _fmt_s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.4f}"


def _fmt_range(samples: Sequence[float]) -> str:
    return f"{min(samples):.4f}-{max(samples):.4f}" if samples else "-"


def _fmt_rate(bits_per_s: float) -> str:
    return f"{bits_per_s / 1e9:.3f} Gbit/s" if bits_per_s >= 1e9 else f"{bits_per_s / 1e6:.1f} Mbit/s"


def format_table(result: LinkcheckResult) -> str:
    """Markdown: one table per shaped rate, with the unshaped baseline beside every row."""
    blocks = []
    for link in result.links:
        tbf = link.tbf
        lines = [
            f"### {link.bandwidth} per cluster uplink ({link.bytes_per_s:,.0f} B/s; tbf rate {tbf['rate_bits']}bit, "
            f"burst {tbf['burst_bytes']:,} B), {result.num_clusters} clusters, latency 0",
            "",
            "| op | payload/rank | bytes charged | unshaped s | shaped s | (min-max) | emulated s | "
            "shaped vs emulated | achieved (charged bytes) |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for row in link.rows:
            lines.append(
                f"| {OP_LABELS.get(row.op, row.op)} | {format_size(row.size_bytes)} | {row.charged_bytes:,} | "
                f"{_fmt_s(result.unshaped(row.op, row.size_bytes))} | {_fmt_s(row.shaped_s)} | "
                f"{_fmt_range(row.samples_s)} | {_fmt_s(row.emulated_s)} | {row.diff_pct:+.1f}% | "
                f"{_fmt_rate(row.achieved_bits_per_s)} |"
            )
        if link.wire:
            lines.append("")
            parts = []
            for wire in link.wire:
                ratio = wire.get("wire_per_payload")
                shown = "-" if ratio is None else f"{ratio:.4f}"
                parts.append(
                    f"cluster {wire['cluster']}: {wire['qdisc_bytes']:,} B in {wire['qdisc_packets']:,} packets, "
                    f"{wire['qdisc_drops']} dropped, wire/payload {shown}"
                )
            lines.append("tbf counters (warm-up included): " + "; ".join(parts) + ".")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def format_markdown(result: LinkcheckResult) -> str:
    """results.md: the command, the date, the setting, the tables."""
    head = [
        "# Shaped link vs emulated link",
        "",
        f"`{result.command}`, {result.date}.",
        "",
        f"{result.topology} Sizes are payload bytes per rank; every time is the median over {result.repeats} "
        f"repeats (after {result.warmup} warm-up) of the slowest rank, measured by a `WanChannel` with "
        "`bandwidth=None` around the real gloo collective. *Emulated* is `LinkModel(bandwidth, latency 0)` applied "
        "to the channel's own byte counts (`max(sent, recv)` + control bytes). *Shaped vs emulated* is "
        "`(shaped - emulated) / emulated`: positive means the real link was slower than the model.",
        "",
    ]
    return "\n".join(head) + "\n" + format_table(result) + "\n"


def write_results(result: LinkcheckResult, out_dir: Path) -> tuple[Path, Path]:
    """Write `results.md` and `results.json` into `out_dir` (created if needed); returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md_path, json_path = out_dir / "results.md", out_dir / "results.json"
    md_path.write_text(format_markdown(result))
    json_path.write_text(json.dumps(result.to_dict(), indent=2, allow_nan=False) + "\n")
    return md_path, json_path


# --------------------------------------------------------------------------------------------- system side


def _run(command: list[str], *, timeout_s: float = 30.0) -> str:
    """Run one `ip`/`tc` command; a failure becomes a ShapingError naming the command, its stderr and a fix."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError:
        raise ShapingError(
            f"`{command[0]}` is not installed: install iproute2 (e.g. `apt-get install iproute2`)"
        ) from None
    except subprocess.TimeoutExpired:
        raise ShapingError(f"`{shlex.join(command)}` did not finish in {timeout_s:.0f} s") from None
    if done.returncode != 0:
        stderr = done.stderr.strip() or done.stdout.strip() or "(no output)"
        raise ShapingError(f"`{shlex.join(command)}` failed (exit {done.returncode}): {stderr}; {_hint(stderr)}")
    return done.stdout


def _hint(stderr: str) -> str:
    text = stderr.lower()
    if "operation not permitted" in text or "permission denied" in text:
        return f"creating namespaces and qdiscs needs CAP_SYS_ADMIN and CAP_NET_ADMIN: {_ROOT_HINT}"
    if "qdisc kind is unknown" in text or ("tbf" in text and "unknown" in text):
        return "the kernel lacks the tbf qdisc: load it with `modprobe sch_tbf` (kernel option CONFIG_NET_SCH_TBF)"
    if "unknown device type" in text or "not supported" in text:
        return "the kernel lacks veth or bridge support: `modprobe veth bridge` (CONFIG_VETH, CONFIG_BRIDGE)"
    if "file exists" in text:
        return "a namespace or interface of that name already exists: delete it with `ip netns del NAME`"
    return "check that `ip` and `tc` (iproute2) work as root on this machine"


def check_prerequisites() -> None:
    """Fail early, with the fix, when shaping cannot possibly work: not Linux, not root, no `ip` or `tc`."""
    if not sys.platform.startswith("linux"):
        raise ShapingError(f"link shaping uses Linux network namespaces and tc; this is {sys.platform}")
    if os.geteuid() != 0:
        raise ShapingError(
            f"dilocox linkcheck creates network namespaces and tc qdiscs, which needs root: {_ROOT_HINT}"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ShapingError(
                f"`{tool}` is not on PATH ({os.environ.get('PATH', '')}): install iproute2 "
                "(e.g. `apt-get install iproute2`); under sudo, keep /usr/sbin and /sbin in PATH"
            )


def _existing_namespaces() -> list[str]:
    return [line.split(" ", 1)[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def remove_stale_namespaces() -> list[str]:
    """Delete namespaces of earlier runs that were killed before their `finally` (SIGKILL, power loss)."""
    removed = []
    for name in stale_namespaces(_run(["ip", "netns", "list"]), alive=_pid_alive):
        with contextlib.suppress(ShapingError):
            _run(["ip", "netns", "del", name])
            removed.append(name)
    return removed


def teardown(net: ShapedNetwork) -> list[str]:
    """Delete this run's namespaces; never raises (it runs in `finally`), returns what could not be removed."""
    try:
        existing = _existing_namespaces()
    except ShapingError:
        existing = None
    problems = []
    for command in teardown_commands(net, existing):
        try:
            _run(command)
        except ShapingError as exc:
            problems.append(f"{command[-1]} ({exc})")
    return problems


@contextlib.contextmanager
def _signals_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt while shaping is set up, so `finally` removes the namespaces."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _uninterruptible() -> Iterator[None]:
    """Ignore Ctrl+C and SIGTERM while tearing down: a second Ctrl+C must not leave namespaces behind."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def shaped_network(num_clusters: int, *, log: Callable[[str], None] | None = None) -> Iterator[ShapedNetwork]:
    """Build the namespaces (unshaped) for the duration of the `with` block and always remove them afterwards."""
    check_prerequisites()
    removed = remove_stale_namespaces()
    if removed and log:
        log(f"removed {len(removed)} namespaces left by killed earlier runs: {', '.join(removed)}")
    net = ShapedNetwork.for_this_process(num_clusters)
    try:
        with _signals_as_interrupt():
            for command in setup_commands(net):
                _run(command)
            yield net
    finally:
        with _uninterruptible():
            problems = teardown(net)
        if problems:
            print(
                "dilocox: warning: could not remove namespaces "
                + "; ".join(problems)
                + f"; remove them with `ip netns del NAME` (list: `ip netns list | grep {net.tag}`)",
                file=sys.stderr,
            )


def unavailable_reason() -> str | None:
    """None when real shaping works here, else why not; found by building and removing a 2-cluster network.

    Checking the uid is not enough: a container's root may lack CAP_SYS_ADMIN, or the kernel tbf or veth.
    """
    try:
        with shaped_network(2) as net:
            for command in shape_commands(net, 1.25e8):
                _run(command)
    except ShapingError as exc:
        return str(exc)
    return None


def _qdisc_counters(net: ShapedNetwork, cluster: int) -> dict[str, int]:
    out = _run(["tc", "-n", net.cluster_ns(cluster), "-s", "-j", "qdisc", "show", "dev", CLUSTER_IFNAME])
    for qdisc in json.loads(out or "[]"):
        if qdisc.get("kind") == "tbf":
            return {
                "qdisc_bytes": int(qdisc.get("bytes", 0)),
                "qdisc_packets": int(qdisc.get("packets", 0)),
                "qdisc_drops": int(qdisc.get("drops", 0)),
            }
    raise ShapingError(f"no tbf qdisc on {CLUSTER_IFNAME} in {net.cluster_ns(cluster)} (was it removed meanwhile?)")


@dataclass
class _Phase:
    records_by_rank: list[list[dict[str, Any]]]
    stats_by_rank: list[dict[str, Any]]


def estimate_transfer_s(sizes: Sequence[int], bytes_per_s: float, *, num_clusters: int, num_runs: int) -> float:
    """The model's time for one phase: every op and size `num_runs` times (warm-up + repeats), latency 0.

    Uses the ring convention's per-rank volumes: an all-reduce moves about `2 (C-1)/C x size`, an all-gather
    `(C-1) x size`.
    """
    per_run = sum((2 * (num_clusters - 1) / num_clusters + (num_clusters - 1)) * size for size in sizes)
    return per_run * num_runs / bytes_per_s


def _phase_timeout_s(transfer_s: float) -> float:
    """Generous wall-clock limit of one worker phase: 2 minutes of start-up plus 3x the model's transfer time."""
    return 120.0 + 3.0 * transfer_s


def _run_workers(
    net: ShapedNetwork,
    *,
    phase: str,
    sizes: Sequence[int],
    repeats: int,
    warmup: int,
    workdir: Path,
    timeout_s: float,
) -> _Phase:
    """Start one worker per cluster inside its namespace, wait for all, return their records.

    If one fails or the phase runs past `timeout_s`, the others are killed (they would wait for it forever) and the
    error quotes the failing worker's log.
    """
    for command in fresh_tcp_commands(net):
        _run(command)
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    outs: list[Path] = []
    try:
        for rank in range(net.num_clusters):
            out, log_path = workdir / f"{phase}-rank{rank}.json", workdir / f"{phase}-rank{rank}.log"
            env = dict(os.environ)
            env.update(
                GLOO_SOCKET_IFNAME=CLUSTER_IFNAME,  # otherwise gloo binds to 127.0.0.1 and the peers cannot connect
                MASTER_ADDR=net.cluster_addr(0),
                MASTER_PORT=str(MASTER_PORT),
                RANK=str(rank),
                WORLD_SIZE=str(net.num_clusters),
                OMP_NUM_THREADS="1",
                # the worker must import this very dilocox, whatever the current directory or install
                PYTHONPATH=os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH", "")) if p),
            )
            command = ["ip", "netns", "exec", net.cluster_ns(rank), sys.executable]
            command += ["-m", "dilocox.tools.linkcheck.shaping", "worker"]
            command += ["--sizes", ",".join(map(str, sizes)), "--repeats", str(repeats)]
            command += ["--warmup", str(warmup), "--out", str(out)]
            with open(log_path, "wb") as log_file:
                procs.append(subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT))
            logs.append(log_path)
            outs.append(out)
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [proc.poll() for proc in procs]
            failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                rank = failed[0]
                raise ShapingError(
                    f"the {phase} worker of cluster {rank} exited with code {codes[rank]}:\n{_tail(logs[rank])}"
                )
            if all(code == 0 for code in codes):
                break
            if time.monotonic() > deadline:
                raise ShapingError(
                    f"the {phase} workers did not finish in {timeout_s:.0f} s; cluster 0's log:\n{_tail(logs[0])}"
                )
            time.sleep(0.05)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
    reports = [json.loads(path.read_text()) for path in outs]
    return _Phase([r["records"] for r in reports], [r["stats"] for r in reports])


def _tail(path: Path, num_lines: int = 15) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + line for line in lines[-num_lines:])


def run_linkcheck(
    links: Sequence[tuple[str, float]],
    *,
    num_clusters: int = 2,
    sizes: Sequence[int] = (256_000, 1_000_000, 4_000_000, 16_000_000),
    repeats: int = DEFAULT_REPEATS,
    warmup: int = NUM_WARMUP,
    log: Callable[[str], None] | None = None,
) -> LinkcheckResult:
    """Measure the transfers on the unshaped veth, then under each (label, bytes/s) rate; namespaces removed after.

    Raises ShapingError when shaping is impossible here or a step fails, KeyboardInterrupt on Ctrl+C / SIGTERM
    (after the clean-up), ValueError on bad arguments.
    """
    if not 2 <= num_clusters <= MAX_CLUSTERS:
        raise ValueError(
            f"--clusters {num_clusters}: use 2..{MAX_CLUSTERS} (a group of one moves nothing; each cluster is one "
            "process on this machine)"
        )
    if repeats < 1 or warmup < 0:
        raise ValueError(f"--repeats {repeats} must be >= 1 (and warm-up {warmup} >= 0)")
    if not links or not sizes:
        raise ValueError("give at least one bandwidth and one size")
    say = log or (lambda message: None)
    unshaped_s: dict[str, float] = {}
    shaped: list[ShapedLink] = []
    with shaped_network(num_clusters, log=say) as net, tempfile.TemporaryDirectory(prefix=f"{net.tag}-") as tmp:
        workdir = Path(tmp)
        say(f"namespaces {', '.join(net.namespaces())} ready; measuring the unshaped veth")
        phase = _run_workers(
            net,
            phase="unshaped",
            sizes=sizes,
            repeats=repeats,
            warmup=warmup,
            workdir=workdir,
            timeout_s=_phase_timeout_s(0.0),
        )
        for row in summarize(phase.records_by_rank, bytes_per_s=1.0):
            unshaped_s[_key(row.op, row.size_bytes)] = row.shaped_s
        for label, bytes_per_s in links:
            transfer_s = estimate_transfer_s(sizes, bytes_per_s, num_clusters=num_clusters, num_runs=repeats + warmup)
            say(f"shaping every uplink to {label} (tbf); the model expects {transfer_s:.1f} s of transfers")
            for command in shape_commands(net, bytes_per_s):
                _run(command)
            phase = _run_workers(
                net,
                phase=f"shaped-{len(shaped)}",
                sizes=sizes,
                repeats=repeats,
                warmup=warmup,
                workdir=workdir,
                timeout_s=_phase_timeout_s(transfer_s),
            )
            wire = []
            for cluster in range(num_clusters):
                counters = _qdisc_counters(net, cluster)
                stats = phase.stats_by_rank[cluster]
                payload = int(stats["bytes_sent"]) + int(stats["control_bytes"])
                wire.append(
                    {
                        "cluster": cluster,
                        **counters,
                        "payload_bytes_sent": payload,
                        "wire_per_payload": counters["qdisc_bytes"] / payload if payload else None,
                    }
                )
            for command in unshape_commands(net):
                _run(command)
            shaped.append(
                ShapedLink(
                    bandwidth=label,
                    bytes_per_s=bytes_per_s,
                    tbf={
                        "rate_bits": tbf_rate_bits(bytes_per_s),
                        "burst_bytes": tbf_burst_bytes(bytes_per_s),
                        "latency": TBF_LATENCY,
                    },
                    rows=summarize(phase.records_by_rank, bytes_per_s),
                    wire=wire,
                )
            )
    return LinkcheckResult(
        num_clusters=num_clusters,
        sizes=list(sizes),
        repeats=repeats,
        warmup=warmup,
        unshaped_s=unshaped_s,
        links=shaped,
        topology=(
            f"{num_clusters} clusters, each a network namespace whose `{CLUSTER_IFNAME}` (veth, MTU 1500) joins a "
            "bridge in a hub namespace; a `tc tbf` qdisc on each `wan0` caps that cluster's uplink; one gloo rank "
            "per cluster (1 thread); no latency shaping (netem is unavailable)."
        ),
    )


# --------------------------------------------------------------------------------------------- worker


def _worker(argv: list[str]) -> int:
    """One cluster's rank, inside its namespace: time every transfer through an unlimited WanChannel."""
    parser = argparse.ArgumentParser(prog="python -m dilocox.tools.linkcheck.shaping worker")
    parser.add_argument("--sizes", required=True, help="comma-separated payload bytes per rank")
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=NUM_WARMUP)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]

    import torch
    import torch.distributed as dist

    from dilocox.net.channel import WanChannel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
    try:
        group = dist.group.WORLD
        records = []
        with WanChannel(group, bandwidth=None, latency_s=0.0) as channel:
            for op in OPS:
                for size in sizes:
                    if op == "all_reduce":
                        payload = torch.zeros(size // 4, dtype=torch.float32)  # (size / 4,) fp32
                    else:
                        payload = torch.zeros(size, dtype=torch.uint8)  # (size,) bytes, e.g. a packed int4 payload
                    for step in range(args.warmup + args.repeats):
                        dist.barrier(group=group)  # every rank starts together, so no rank's time includes a wait
                        control_before = channel.control_bytes
                        if op == "all_reduce":
                            transfer = channel.launch_all_reduce(payload, op="sum")
                        else:
                            transfer = channel.launch_all_gather(payload)
                        transfer.wait()
                        if step >= args.warmup:
                            records.append(
                                {
                                    "op": op,
                                    "size_bytes": size,
                                    "repeat": step - args.warmup,
                                    "link_s": transfer.link_s,
                                    "nbytes_sent": transfer.nbytes_sent,
                                    "nbytes_recv": transfer.nbytes_recv,
                                    "control_bytes": channel.control_bytes - control_before,
                                }
                            )
            dist.barrier(group=group)
            stats = channel.stats()
        args.out.write_text(json.dumps({"rank": dist.get_rank(), "records": records, "stats": stats}))
    finally:
        dist.destroy_process_group()
    return 0


# --------------------------------------------------------------------------------------------- CLI

DESCRIPTION = f"""Check the emulated slow link against a real one: put each cluster in its own Linux network namespace,
join them with veth links through a bridge, cap every cluster's uplink with `tc tbf`, and time the same ring
all-reduces (fp32) and all-gathers (uint8) that the WanChannel emulates. Prints, per transfer, the bytes the model
charges, the measured time on the unshaped veth (the overhead floor) and on the shaped link, the model's time at
the same rate (latency 0: netem is not available, so latency is not shaped) and their relative difference.

Needs root (network namespaces and qdiscs) and iproute2; everything it creates is removed at the end, also on
Ctrl+C. Optional: nothing else in dilocox depends on it.

examples:
  sudo dilocox linkcheck                                   # 2 clusters at {DEFAULT_BANDWIDTH}
  sudo dilocox linkcheck --bandwidth 100Mbps,1Gbps --out benchmarks/results/shaped_link
  sudo dilocox linkcheck --clusters 3 --sizes 1MB,8MB --repeats 5 --json"""


class _Parser(argparse.ArgumentParser):
    """argparse that raises ValueError instead of printing usage and exiting, so main() owns the exit code."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(f"{message} (see `dilocox linkcheck --help`)")


def _parser() -> _Parser:
    parser = _Parser(prog="dilocox linkcheck", description=DESCRIPTION, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument(
        "--bandwidth",
        default=DEFAULT_BANDWIDTH,
        help=f"cluster uplink rate, or several separated by commas, e.g. 100Mbps,1Gbps (default {DEFAULT_BANDWIDTH})",
    )
    parser.add_argument("--clusters", type=int, default=2, help="clusters, one namespace and rank each (default 2)")
    parser.add_argument(
        "--sizes", default=DEFAULT_SIZES, help=f"payload bytes per rank, comma-separated (default {DEFAULT_SIZES})"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=DEFAULT_REPEATS,
        help=f"timed repeats per transfer after {NUM_WARMUP} warm-up; the median is reported (default 3)",
    )
    parser.add_argument("--json", action="store_true", help="print results.json's content instead of the table")
    parser.add_argument("--out", type=Path, help="also write results.md and results.json into this directory")
    return parser


def main(argv: list[str]) -> int:
    """Run `dilocox linkcheck` with `argv` (the arguments after `linkcheck`); returns the exit code."""
    try:
        args = _parser().parse_args(argv)
        links = parse_bandwidths(args.bandwidth)
        sizes = parse_sizes(args.sizes)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except ValueError as exc:
        print(f"dilocox: error: {exc}", file=sys.stderr)
        return 2

    def log(message: str) -> None:
        print(f"linkcheck: {message}", file=sys.stderr, flush=True)

    load_before = os.getloadavg()[0]
    try:
        result = run_linkcheck(links, num_clusters=args.clusters, sizes=sizes, repeats=args.repeats, log=log)
    except ShapingError as exc:
        print(f"dilocox: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"dilocox: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dilocox: interrupted; the namespaces were removed", file=sys.stderr)
        return 130
    result.command = shlex.join(["dilocox", "linkcheck", *argv])
    result.date = datetime.date.today().isoformat()
    result.host = _host_info(load_before)
    if args.out is not None:
        md_path, json_path = write_results(result, args.out)
        log(f"wrote {md_path} and {json_path}")
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, allow_nan=False))
    else:
        print(format_table(result))
    return 0


def _host_info(load_before: float) -> dict[str, Any]:
    import platform

    import torch

    return {
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        # the timings share this machine's cores: a machine busy before the run reads as a slow link
        "loadavg_1m_before": load_before,
    }


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        sys.exit(_worker(sys.argv[2:]))
    sys.exit(main(sys.argv[1:]))
