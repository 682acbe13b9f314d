"""Clusters of different data-parallel degree against equal clusters at the same total tokens (docs/design.md §2.1).

Three settings of the debug model (configs/debug.toml, DiLoCoX's defaults: `--preset=dilocox`, H = 10, link off so
that only the loss and the exact byte counters are compared), each over the same seeds:

- `mixed`: clusters of dp 2, 1, 1 (4 replicas), STEPS steps;
- `elastic-mixed`: the same clusters in an elastic run (replica 0 of each cluster syncs for it, §10.1);
- `equal-3x1`: 3 clusters of dp 1 with 4/3 the steps (the same tokens: 3 x 4/3 = 4 replicas' worth);
- `equal-4x1`: 4 clusters of dp 1, STEPS steps (the same replicas, each its own cluster);
- `equal-2x2`: 2 clusters of dp 2, STEPS steps (the same replicas and steps, in equal clusters).

Every run scores the agreed model on the whole held-out split at the end. The gaps are paired seed by seed against
`equal-3x1`. Bytes: rank 0's slow-link bytes (its own counter, exact) and the sum over all ranks (summary.json; an elastic
run's: cluster 0's ranks).

    python benchmarks/cluster_shapes.py --seeds 3        # about 13 minutes on 2 idle cores
    python benchmarks/cluster_shapes.py --seeds 3 --only equal-2x2     # one setting again, the others kept
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results" / "cluster_shapes"
STEPS = 120
COMMON = [
    "--config",
    "configs/debug.toml",
    "--preset=dilocox",
    "--sync.inner_steps=10",
    "--eval.interval=0",
    "--eval.final_max_batches=0",
    "--checkpoint.interval=0",
    "--network.bandwidth=unlimited",
    "--network.latency=0",
    "--metrics.progress=false",
]
SETTINGS = {
    "mixed": ("clusters of dp 2, 1, 1", ["--topology.clusters=dp2,dp1,dp1", f"--train.steps={STEPS}"]),
    "elastic-mixed": (
        "clusters of dp 2, 1, 1, elastic",
        [
            "--topology.clusters=dp2,dp1,dp1",
            f"--train.steps={STEPS}",
            "--topology.elastic=true",
            "--network.heartbeat=0.5s",
            "--network.stall_timeout=5s",
            "--network.timeout=60s",
        ],
    ),
    "equal-3x1": (
        "3 clusters of dp 1, 4/3 the steps",
        ["--topology.num_clusters=3", f"--train.steps={STEPS * 4 // 3}"],
    ),
    "equal-4x1": ("4 clusters of dp 1", ["--topology.num_clusters=4", f"--train.steps={STEPS}"]),
    "equal-2x2": (
        "2 clusters of dp 2",
        ["--topology.num_clusters=2", "--topology.dp_degree=2", f"--train.steps={STEPS}"],
    ),
}
BASELINE = "equal-3x1"


def run(name: str, seed: int, root: Path) -> dict:
    run_dir = root / f"{name}-seed{seed}"
    _, flags = SETTINGS[name]
    command = [
        sys.executable,
        "-m",
        "dilocox",
        "train",
        *COMMON,
        *flags,
        f"--run.seed={seed}",
        f"--run.out_dir={run_dir}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if result.returncode:
        raise SystemExit(f"{name} seed {seed} failed:\n{result.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rank0 = [r for r in records if "wan_bytes_sent" in r][-1]
    return {
        "eval_loss": summary["final_eval_loss"],
        "tokens": summary["tokens"],
        "steps": summary["steps"],
        "outer_steps": summary["outer_steps"],
        "rank0_bytes_sent": rank0["wan_bytes_sent"],
        "rank0_bytes_recv": rank0["wan_bytes_recv"],
        "bytes_all_ranks": summary["wan_bytes_total"],
        "num_ranks": len(summary["rank_state_bytes"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--only", nargs="+", choices=list(SETTINGS), help="run these, keep the others' results")
    args = parser.parse_args()
    seeds = list(range(args.seeds))
    earlier = json.loads((OUT / "results.json").read_text())["runs"] if args.only else {}
    running = args.only or list(SETTINGS)
    results: dict[str, list[dict]] = {name: [] if name in running else earlier[name] for name in SETTINGS}
    with tempfile.TemporaryDirectory(prefix="cluster-shapes-") as tmp:
        for seed in seeds:  # seed by seed, so an interrupted bench still has paired runs
            for name in running:
                results[name].append(run(name, seed, Path(tmp)))
                print(name, seed, results[name][-1], flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps({"seeds": seeds, "runs": results}, indent=2) + "\n")
    lines = [
        "| run | eval loss | gap to equal-3x1 | steps | outer steps | tokens | rank 0 bytes sent | bytes, all ranks |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    base = [r["eval_loss"] for r in results[BASELINE]]
    for name, (label, _) in SETTINGS.items():
        rows = results[name]
        losses = [r["eval_loss"] for r in rows]
        gaps = [100 * (loss / b - 1) for loss, b in zip(losses, base, strict=True)]
        gap = "-" if name == BASELINE else f"{statistics.mean(gaps):+.2f} ± {statistics.stdev(gaps):.2f}%"
        first = rows[0]
        lines.append(
            f"| {name}: {label} | {statistics.mean(losses):.4f} ± {statistics.stdev(losses):.4f} | {gap} | "
            f"{first['steps']} | {first['outer_steps']} | {first['tokens']:,} | {first['rank0_bytes_sent']:,} | "
            f"{first['bytes_all_ranks']:,} |"
        )
    lines += [
        "",
        f"`python benchmarks/cluster_shapes.py {' '.join(sys.argv[1:])}`, {datetime.date.today()}: debug model "
        f"(configs/debug.toml), `--preset=dilocox` with H = 10, link off, {len(seeds)} seeds (run.seed 0..), eval "
        "loss of the agreed model on the whole held-out split: mean ± sample standard deviation; gaps paired seed by "
        "seed. Bytes are the channel's exact counters of seed 0's run (an elastic run's summary holds cluster 0's "
        "ranks only).",
    ]
    (OUT / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
