"""The shaped network: namespaces, veths, a bridge and `tc tbf` qdiscs, built and always torn down.

Every cluster is a network namespace with one interface `wan0` (address 10.213.0.<i+1>/24), the end of a veth pair
whose other end is a port of a bridge in a separate *hub* namespace; a `tbf` qdisc on each `wan0` caps the
cluster's uplink. The pure parts (`ShapedNetwork`, the `*_commands` functions, `stale_namespaces`) build the `ip`
and `tc` command lines; the rest runs them (root only).

    with shaped_network(num_clusters=2) as net:      # raises ShapingError, with the fix, when it cannot run here
        for command in shape_commands(net, 12_500_000.0):
            run_command(command)
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

PREFIX = "dlxshape"
CLUSTER_IFNAME = "wan0"
BRIDGE = "br0"
SUBNET = "10.213.0"  # only ever configured inside namespaces this module creates

# tbf lets `burst` bytes leave at line rate after an idle moment: a large bucket banks idle time that a real line
# loses, hiding the sender's pauses (measured, 16 MB ring all-reduce at 100 Mbit: 1.46 s with a 16 KB bucket,
# 1.36 s with 128 KB) and makes small transfers look faster than the rate. Too small a bucket and the qdisc's timer
# cannot keep up at Gbit rates (one TCP stream over veth at 1 Gbit: 924 Mbit/s with 3 KB, 954-957 with 8-64 KB).
# 16 KiB, or 100 us at the rate when that is larger, is the smallest bucket that delivers the full rate.
TBF_MIN_BURST = 16384
TBF_BURST_S = 1e-4
TBF_LATENCY = "50ms"  # queue limit as a delay: deep enough that TCP is never tail-dropped on a local veth

_ROOT_HINT = (
    "run it as root (e.g. `sudo $(command -v dilocox) linkcheck ...`) on a Linux host, or in a container started "
    "with `--cap-add NET_ADMIN --cap-add SYS_ADMIN` (or `--privileged`)"
)


class ShapingError(RuntimeError):
    """Real link shaping cannot run here (not root, no `ip`/`tc`, a kernel without veth/bridge/tbf) or it failed.

    The message says what was wrong and what to do; the CLI prints it as one line and exits non-zero.
    """


def tbf_burst_bytes(bytes_per_s: float) -> int:
    """tbf bucket size for a rate: `TBF_MIN_BURST`, or `TBF_BURST_S` of traffic when that is larger (see there)."""
    return max(TBF_MIN_BURST, math.ceil(bytes_per_s * TBF_BURST_S))


def tbf_rate_bits(bytes_per_s: float) -> int:
    """tc takes integer bit/s; the model's bytes/s x 8, rounded."""
    return round(bytes_per_s * 8)


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


def run_command(command: list[str], *, timeout_s: float = 30.0) -> str:
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
    return [line.split(" ", 1)[0] for line in run_command(["ip", "netns", "list"]).splitlines() if line.strip()]


def remove_stale_namespaces() -> list[str]:
    """Delete namespaces of earlier runs that were killed before their `finally` (SIGKILL, power loss)."""
    removed = []
    for name in stale_namespaces(run_command(["ip", "netns", "list"]), alive=_pid_alive):
        with contextlib.suppress(ShapingError):
            run_command(["ip", "netns", "del", name])
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
            run_command(command)
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
                run_command(command)
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
                run_command(command)
    except ShapingError as exc:
        return str(exc)
    return None


def qdisc_counters(net: ShapedNetwork, cluster: int) -> dict[str, int]:
    out = run_command(["tc", "-n", net.cluster_ns(cluster), "-s", "-j", "qdisc", "show", "dev", CLUSTER_IFNAME])
    for qdisc in json.loads(out or "[]"):
        if qdisc.get("kind") == "tbf":
            return {
                "qdisc_bytes": int(qdisc.get("bytes", 0)),
                "qdisc_packets": int(qdisc.get("packets", 0)),
                "qdisc_drops": int(qdisc.get("drops", 0)),
            }
    raise ShapingError(f"no tbf qdisc on {CLUSTER_IFNAME} in {net.cluster_ns(cluster)} (was it removed meanwhile?)")
