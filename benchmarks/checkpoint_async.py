"""How long training waits for its checkpoints, written in the foreground or in the background (checkpoint.async_save).

    python benchmarks/checkpoint_async.py                    # medium flavor, 2 clusters, 60 steps, a save every 10
    python benchmarks/checkpoint_async.py --flavor small --repeats 3 --out benchmarks/results/checkpoint_async
    python benchmarks/checkpoint_async.py --flavor small --dp 4 --repeats 1 --steps 20   # 2 clusters of 4 replicas

Each trial is a real `dilocox train` run (configs/debug.toml with `--model.flavor`, no evaluation in the loop, the slow
link not emulated) in a fresh run directory, alternating `checkpoint.async_save = false` and `true`, so that both modes
see the same machine load. From the run's summary.json it reads `checkpoint_s` (rank 0's time blocked in saves: the
whole write in the foreground; the host copy of the state and the wait for the previous save in the background) and
`wall_s`; from the checkpoint it reads the bytes every save wrote. The last save of a run is written in the foreground
in both modes (the run ends after it), so the table also gives the waits of the other saves alone. Prints one row per
trial and the medians; writes results.md / results.json with --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def trial(work: Path, name: str, args: argparse.Namespace, background: bool) -> dict:
    run_dir = work / name
    result = subprocess.run(
        [sys.executable, "-m", "dilocox", "train", "--config", str(REPO / "configs" / "debug.toml"),
         f"--run.out_dir={run_dir}", f"--model.flavor={args.flavor}", f"--train.steps={args.steps}",
         f"--topology.dp_degree={args.dp}",
         f"--checkpoint.interval={args.interval}", f"--checkpoint.keep={args.steps // args.interval}",
         f"--checkpoint.async_save={str(background).lower()}", "--eval.interval=0", "--eval.final_max_batches=1",
         "--network.bandwidth=unlimited", "--network.latency=0", "--metrics.progress=false"],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{result.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    last = Path(summary["checkpoint"])
    meta = json.loads((last / "meta.json").read_text())
    saves = args.steps // args.interval
    row = {
        "mode": "background" if background else "foreground",
        "saves": saves,
        "checkpoint_mb": sum(f["bytes"] for f in meta["files"].values()) / 1e6,
        "checkpoint_s": summary["checkpoint_s"],
        "wall_s": summary["wall_s"],
    }
    row["per_save_s"] = row["checkpoint_s"] / saves
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="medium")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--interval", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dp", type=int, default=1, help="replicas per cluster (topology.dp_degree)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="checkpoint_async_") as tmp:
        for repeat in range(args.repeats):
            for background in (False, True):
                row = trial(Path(tmp), f"r{repeat}_{int(background)}", args, background)
                rows.append(row)
                print(
                    f"{row['mode']:>10}: {row['saves']} saves of {row['checkpoint_mb']:.0f} MB, training waited "
                    f"{row['checkpoint_s']:.2f} s ({row['per_save_s']:.3f} s per save), wall {row['wall_s']:.1f} s",
                    flush=True,
                )
    medians = {
        mode: {key: statistics.median(r[key] for r in rows if r["mode"] == mode) for key in ("checkpoint_s", "wall_s")}
        for mode in ("foreground", "background")
    }
    for mode, values in medians.items():
        print(f"median {mode}: waited {values['checkpoint_s']:.2f} s, wall {values['wall_s']:.1f} s")
    if args.out is None:
        return
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, Python {platform.python_version()}",
        "command": " ".join(["python", "benchmarks/checkpoint_async.py", *sys.argv[1:]]),
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
        "medians": medians,
    }
    (args.out / "results.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        "# Checkpoints written in the foreground and in the background",
        "",
        f"`{record['command']}` ({record['date']}, {record['machine']}; 2 clusters of {args.dp} rank(s), CPU, gloo).",
        "",
        "| mode | saves | MB per checkpoint | training waited (s) | per save (s) | wall (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['saves']} | {r['checkpoint_mb']:.0f} | {r['checkpoint_s']:.2f} | "
            f"{r['per_save_s']:.3f} | {r['wall_s']:.1f} |"
        )
    (args.out / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
