"""Clusters of different speeds: step rounds against time rounds (`sync.round.mode`), with one cluster at half speed.

    python benchmarks/hetero.py                          # writes benchmarks/results/hetero/results.{json,md}
    python benchmarks/hetero.py --only speed             # the throughput rows only (nothing else on the machine)
    python benchmarks/hetero.py --only loss --loss-config configs/debug.toml --loss-preset dilocox   # another model
    python benchmarks/hetero.py --steps 60 --seeds 1 --out /tmp/hetero      # a quicker look

Setting: `dilocox train`'s own (the `tiny` model, the dilocox preset: top-k int4, the one-step delay, H = 12 unless
--inner-steps, an emulated 1 Gbps / 10 ms link) with each average applied at the end of the next round
(`sync.overlap_steps = 0`, which time rounds need), 3 clusters, one rank each, cluster 2 slowed by 2x.

Throughput rows (`faults.slow_mode = sleep`: cluster 2's every step really takes twice its compute time), one seed:
homogeneous (no slowdown, step rounds), step rounds with the slow cluster, time rounds with the slow cluster. For
each: total tokens/s (every cluster's tokens over the run's training time), the sum of the clusters' own speeds (a
cluster's tokens over its own training seconds, its waits at round boundaries excluded: `summary.json`'s
`cluster_tokens` and `cluster_train_s`) and their ratio. Step rounds make every cluster wait for the slow one, so the
total is about 3 x the slow cluster's speed; time rounds aim at >= 90% of the sum.

Loss rows (`faults.slow_mode = virtual`: deterministic schedules, nothing sleeps), `--seeds` seeds paired: the
homogeneous run against time rounds with the virtually slow cluster given train.steps x 3 / 2.5 so that both train on
the same number of tokens; the final eval loss of the model the clusters agree on, and the gap per seed.

Timings on a shared machine are noisy and several ranks share its cores; the ratios are what to read.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG: Path | None = None
"""The `--config` of every run; None: `dilocox train`'s own setting."""
SLOW = "--faults.slow_clusters=2:2.0"
SPEED_ROWS = {
    "homogeneous": [],
    "steps-slow": [SLOW, "--faults.slow_mode=sleep"],
    "time-slow": [SLOW, "--faults.slow_mode=sleep", "--sync.round.mode=time"],
}
LABELS = {
    "homogeneous": "homogeneous (no slowdown)",
    "steps-slow": "step rounds, cluster 2 at half speed",
    "time-slow": "time rounds, cluster 2 at half speed",
}


def train(
    run_dir: Path, steps: int, inner_steps: int, seed: int, flags: list[str], config: Path | None = CONFIG
) -> dict:
    """One `dilocox train` run (of `config` if given); its summary.json."""
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [
        sys.executable, "-m", "dilocox", "train", *(["--config", str(config)] if config else []),
        f"--run.out_dir={run_dir}",
        "--topology.num_clusters=3", f"--train.steps={steps}", f"--sync.inner_steps={inner_steps}",
        f"--run.seed={seed}", "--data.split_seed=0", "--eval.interval=0", "--eval.final_max_batches=32",
        "--checkpoint.interval=0", "--metrics.progress=false", "--sync.overlap_steps=0", *flags,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def speeds(summary: dict) -> dict:
    own = [t / s for t, s in zip(summary["cluster_tokens"], summary["cluster_train_s"], strict=True)]
    return {
        "tokens": summary["tokens"],
        "tokens_per_s": summary["tokens_per_s"],
        "own_tokens_per_s": own,
        "sum_own_tokens_per_s": sum(own),
        "ratio": summary["tokens_per_s"] / sum(own),
        "cluster_tokens": summary["cluster_tokens"],
        "final_eval_loss": summary["final_eval_loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=240, help="train.steps of the homogeneous runs")
    parser.add_argument("--inner-steps", type=int, default=12, help="H")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the loss rows")
    parser.add_argument("--loss-config", type=Path, default=CONFIG, help="the config of the loss rows")
    parser.add_argument("--loss-preset", default="", help="a preset for the loss rows (e.g. dilocox)")
    parser.add_argument("--only", choices=("speed", "loss"), help="run one part, keep the other's earlier results")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "hetero")
    args = parser.parse_args()
    work = args.out / "runs"
    earlier = args.out / "results.json"
    results: dict = json.loads(earlier.read_text()) if args.only and earlier.exists() else {"speed": {}, "loss": []}
    part = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared)",
        "command": "python benchmarks/hetero.py " + " ".join(sys.argv[1:]),
        "steps": args.steps,
        "inner_steps": args.inner_steps,
    }
    if args.only != "loss":
        results["speed_run"] = part
        results["speed"] = {}
        for name, flags in SPEED_ROWS.items():
            results["speed"][name] = speeds(train(work / name, args.steps, args.inner_steps, 0, flags))
            print(name, json.dumps(results["speed"][name]), flush=True)
    if args.only != "speed":
        config = str(args.loss_config.resolve().relative_to(ROOT))
        results["loss_run"] = {**part, "config": config + (f" --preset={args.loss_preset}" if args.loss_preset else "")}
        results["loss"] = []
    equal_tokens = round(args.steps * 3 / 2.5)  # the slow cluster trains half as many tokens per round
    preset = [f"--preset={args.loss_preset}"] if args.loss_preset else []
    for seed in range(args.seeds if args.only != "speed" else 0):
        base = train(work / f"loss-homogeneous-{seed}", args.steps, args.inner_steps, seed, preset, args.loss_config)
        timed = train(
            work / f"loss-time-virtual-{seed}",
            equal_tokens,
            args.inner_steps,
            seed,
            [*preset, SLOW, "--faults.slow_mode=virtual", "--sync.round.mode=time"],
            args.loss_config,
        )
        row = {
            "seed": seed,
            "homogeneous": {"tokens": base["tokens"], "final_eval_loss": base["final_eval_loss"]},
            "time_virtual": {"tokens": timed["tokens"], "final_eval_loss": timed["final_eval_loss"]},
            "gap_percent": 100 * (timed["final_eval_loss"] / base["final_eval_loss"] - 1),
        }
        results["loss"].append(row)
        print(json.dumps(row), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "results.md").write_text(table(results))
    print(table(results))


def table(results: dict) -> str:
    speed, loss = results.get("speed_run"), results.get("loss_run")
    lines = ["# Clusters of different speeds", ""]
    if speed:
        lines += [
            f"Throughput ({speed['date']}, {speed['machine']}): `{speed['command']}`: 3 clusters of "
            f"dilocox train's setting, H = {speed['inner_steps']}, {speed['steps']} steps (homogeneous), cluster 2 "
            "slowed 2x (sleep), one seed.",
            "",
        ]
    if loss:
        lines += [
            f"Loss ({loss['date']}): `{loss['command']}`: 3 clusters of {loss['config']}, H = {loss['inner_steps']}, "
            f"{loss['steps']} steps (homogeneous), cluster 2 virtually 2x slower, equal tokens.",
            "",
        ]
    lines += [
        "| run | total tokens/s | sum of own speeds | ratio | cluster tokens |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for name, row in results["speed"].items():
        lines.append(
            f"| {LABELS[name]} | {row['tokens_per_s']:,.0f} | {row['sum_own_tokens_per_s']:,.0f} | "
            f"{100 * row['ratio']:.0f}% | {', '.join(f'{t:,}' for t in row['cluster_tokens'])} |"
        )
    gaps = [row["gap_percent"] for row in results["loss"]]
    lines += [
        "",
        "| seed | tokens | homogeneous eval loss | time rounds (virtual 2x) eval loss | gap |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in results["loss"]:
        lines.append(
            f"| {row['seed']} | {row['homogeneous']['tokens']:,} / {row['time_virtual']['tokens']:,} | "
            f"{row['homogeneous']['final_eval_loss']:.4f} | {row['time_virtual']['final_eval_loss']:.4f} | "
            f"{row['gap_percent']:+.2f}% |"
        )
    if gaps:
        spread = statistics.stdev(gaps) / len(gaps) ** 0.5 if len(gaps) > 1 else 0.0
        lines.append(f"| mean | | | | {statistics.mean(gaps):+.2f} ± {spread:.2f}% |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
