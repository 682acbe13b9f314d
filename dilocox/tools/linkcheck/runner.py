"""One linkcheck run: the workers timed on the unshaped veth, then under each shaped rate.

Needs root; the namespaces are removed afterwards, also on errors, Ctrl+C and SIGTERM:

    result = run_linkcheck([("100Mbps", 12_500_000.0)], num_clusters=2, sizes=[1_000_000])
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dilocox
from dilocox.tools.linkcheck.namespaces import (
    CLUSTER_IFNAME,
    TBF_LATENCY,
    ShapedNetwork,
    ShapingError,
    fresh_tcp_commands,
    qdisc_counters,
    run_command,
    shape_commands,
    shaped_network,
    tbf_burst_bytes,
    tbf_rate_bits,
    unshape_commands,
)
from dilocox.tools.linkcheck.results import LinkcheckResult, ShapedLink, summarize, transfer_key
from dilocox.tools.linkcheck.worker import NUM_WARMUP

MASTER_PORT = 29500  # free by construction: cluster 0's namespace is new
DEFAULT_REPEATS = 3
MAX_CLUSTERS = 64  # every cluster is one process on this machine; beyond this the CPU, not the link, is measured

_PACKAGE_ROOT = str(Path(dilocox.__file__).resolve().parents[1])  # the directory holding the `dilocox` package


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
        run_command(command)
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
            command += ["-m", "dilocox.tools.linkcheck.worker"]
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
            unshaped_s[transfer_key(row.op, row.size_bytes)] = row.shaped_s
        for label, bytes_per_s in links:
            transfer_s = estimate_transfer_s(sizes, bytes_per_s, num_clusters=num_clusters, num_runs=repeats + warmup)
            say(f"shaping every uplink to {label} (tbf); the model expects {transfer_s:.1f} s of transfers")
            for command in shape_commands(net, bytes_per_s):
                run_command(command)
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
                counters = qdisc_counters(net, cluster)
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
                run_command(command)
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
