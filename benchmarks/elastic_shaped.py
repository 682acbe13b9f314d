"""Elastic clusters over a real shaped link against the emulated one: the same run, hosts in network namespaces
behind `tc tbf`, and on the loopback with the link model. Root only; not in the default suite.

    sudo python benchmarks/elastic_shaped.py                       # 100 Mbit/s, 3 hosts, about 2 minutes
    sudo python benchmarks/elastic_shaped.py --rate 50Mbps --out /tmp/eshaped

Three "hosts", each a network namespace whose only way out is a veth capped by `tc tbf` at `--rate` (the linkcheck
tool's network, docs/guides/benchmarking.md), each running its own `dilocox train` launcher for its one cluster, the
Lighthouse on host 0: configs/debug.toml, `--preset diloco` (blocking fp32 DiLoCo: every round's sync is one
uncompressed all-reduce the training waits for), H = 10, 60 steps, `network.bandwidth = unlimited` (nothing
emulated: the channel times the real collective on the shaped link). The same run on the loopback with
`network.bandwidth = RATE`, `network.latency = 0` gives the link model's time for the same bytes. Reported: cluster
0's slow-link bytes, its link time per round on the shaped link and in the model, and their ratio. Writes
results.json and results.md to `--out` (default benchmarks/results/elastic_shaped/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dilocox.elastic.lighthouse import run_lighthouse  # noqa: E402
from dilocox.net.link import parse_bandwidth  # noqa: E402
from dilocox.tools.linkcheck import namespaces  # noqa: E402

CLUSTERS = 3
FLAGS = [
    "--config", str(ROOT / "configs" / "debug.toml"), "--topology.elastic=true", "--preset=diloco",
    "--sync.inner_steps=10", "--train.steps=60", f"--topology.num_clusters={CLUSTERS}", "--network.heartbeat=0.5s",
    "--network.stall_timeout=10s", "--network.timeout=120s", "--eval.interval=0", "--eval.final_max_batches=4",
    "--checkpoint.interval=0", "--metrics.progress=false",
]  # fmt: skip


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def shaped(rate_bytes: float, work: Path) -> dict:
    """The run with every host behind a tbf at `rate_bytes`: cluster 0's summary."""
    with namespaces.shaped_network(CLUSTERS) as net:
        for command in namespaces.shape_commands(net, rate_bytes):
            namespaces.run_command(command)
        env = {**os.environ, "GLOO_SOCKET_IFNAME": namespaces.CLUSTER_IFNAME, "PYTHONPATH": str(ROOT)}
        host = [["ip", "netns", "exec", net.cluster_ns(cluster)] for cluster in range(CLUSTERS)]
        lighthouse, url = run_lighthouse(
            f"{net.cluster_addr(0)}:0", heartbeat="0.5s", stall_timeout="10s", prefix=host[0], env=env, cwd=ROOT
        )
        try:
            launchers = []
            for cluster in range(CLUSTERS):
                command = [*host[cluster], sys.executable, "-m", "dilocox", "train", *FLAGS,
                           f"--run.out_dir={work / f'host{cluster}'}", "--network.bandwidth=unlimited",
                           f"--network.lighthouse={url}", f"--topology.local_clusters={cluster}",
                           f"--network.advertise_host={net.cluster_addr(cluster)}"]  # fmt: skip
                log = (work / f"host{cluster}.log").open("w")
                launchers.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env))
            codes = [launcher.wait(timeout=900) for launcher in launchers]
            if codes != [0] * CLUSTERS:
                raise RuntimeError(f"the shaped run failed ({codes}): see {work}/host*.log")
        finally:
            lighthouse.terminate()
            lighthouse.wait(timeout=20)
    return summary(work / "host0")


def emulated(rate: str, work: Path) -> dict:
    """The same run on the loopback, the link model at `rate`: its summary."""
    run_dir = work / "emulated"
    command = [sys.executable, "-m", "dilocox", "train", *FLAGS, f"--run.out_dir={run_dir}",
               f"--network.bandwidth={rate}", "--network.latency=0"]  # fmt: skip
    with (work / "emulated.log").open("w") as log:
        if subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode != 0:
            raise RuntimeError(f"the emulated run failed: see {work}/emulated.log")
    return summary(run_dir)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="100Mbps", help="every host's uplink (tbf) and the model's bandwidth")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "elastic_shaped")
    args = parser.parse_args()
    reason = namespaces.unavailable_reason()
    if reason is not None:
        print(f"elastic_shaped: real shaping is not available here: {reason}", file=sys.stderr)
        return 2
    rate_bytes = parse_bandwidth(args.rate)
    if rate_bytes is None:
        print("elastic_shaped: --rate must be a bandwidth such as 100Mbps", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="dilocox-elastic-shaped-") as tmp:
        work = Path(tmp)
        real, model = shaped(rate_bytes, work), emulated(args.rate, work)
    rows = []
    for name, run in (("shaped (tc tbf, real collectives)", real), ("emulated (link model)", model)):
        rounds = run["outer_steps"]
        per_round = run["link_busy_s"] / rounds
        rows.append({"link": name, "wan_bytes": run["wan_bytes_total"], "rounds": rounds,
                     "link_s_per_round": per_round, "final_eval_loss": run["final_eval_loss"]})  # fmt: skip
    ratio = rows[0]["link_s_per_round"] / rows[1]["link_s_per_round"]
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "command": " ".join(["python benchmarks/elastic_shaped.py", *sys.argv[1:]]),
        "rate": args.rate,
        "rows": rows,
        "shaped_over_emulated": ratio,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# Elastic clusters over a shaped link ({result['date']}, {result['machine']})",
        "",
        f"`{result['command']}`: {CLUSTERS} hosts (network namespaces, one launcher each, {args.rate} tbf uplinks), "
        "debug model, blocking fp32 DiLoCo, H = 10, 60 steps; cluster 0's numbers.",
        "",
        "| link | slow-link bytes | rounds | link s per round | final eval loss |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [f"| {r['link']} | {r['wan_bytes']:,} | {r['rounds']} | {r['link_s_per_round']:.3f} | "
              f"{r['final_eval_loss']:.4f} |" for r in rows]  # fmt: skip
    lines += ["", f"Shaped over emulated: {ratio:.2f}x."]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
