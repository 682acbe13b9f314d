"""The peer check against one lying cluster of three, per codec (docs/design.md §4.5; docs/results.md has the table).

For each seed and codec: a clean run and one run per lie (cluster 2 sends its pseudo-gradient x4, x9 or negated from
round 2 on, or x1000, which every check leaves out: the cost of losing its data), the dilocox preset on the debug
config (3 clusters, 120 steps or `--steps`, H = 10, the default merge rule), the link not emulated. The gap of a
lying run is taken against the clean run of the same seed and codec (paired). Runs one `dilocox train` at a time
and keeps every finished run in results.json: an interrupted sweep goes on where it stopped.

    python benchmarks/guard_codecs.py                                  # every codec, seeds 0-2
    python benchmarks/guard_codecs.py --codecs topk_int4 --seeds 0 1 2
    python benchmarks/guard_codecs.py --codecs topk_int4 --steps 60 --out benchmarks/results/guard_codecs_60
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results" / "guard_codecs"
CODECS = ["topk_int4", "int4", "lowrank_int4", "adaptive", "none"]
LIES = {
    "clean": [],
    "x4": ["--faults.kind=scale", "--faults.scale=4", "--faults.cluster=2"],
    "x9": ["--faults.kind=scale", "--faults.scale=9", "--faults.cluster=2"],
    "sign": ["--faults.kind=sign", "--faults.cluster=2"],
    "x1000": ["--faults.kind=scale", "--faults.scale=1000", "--faults.cluster=2"],  # out of every sync: the floor
}
COMMON = [
    "--config=configs/debug.toml",
    "--preset=dilocox",
    "--topology.num_clusters=3",
    "--network.bandwidth=unlimited",
]


def run(codec: str, lie: str, seed: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        args = [*COMMON, f"--train.steps={steps}", f"--compression.kind={codec}", f"--run.seed={seed}",
                f"--run.out_dir={tmp}/run", *LIES[lie]]  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-m", "dilocox", "train", *args], cwd=REPO, capture_output=True, text=True, timeout=900
        )
        command = "python -m dilocox train " + " ".join(a for a in args if not a.startswith("--run.out_dir"))
        diverged = re.search(r"training diverged on rank \d+ \(cluster \d+\) at step (\d+)", done.stderr)
        if done.returncode == 2 and diverged:  # eval.divergence_ratio stopped it: a result, not a failure
            return {"codec": codec, "lie": lie, "seed": seed, "final_eval_loss": None,
                    "stopped_at_step": int(diverged.group(1)), "command": command}  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"{codec} {lie} seed {seed} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        summary = json.loads((Path(tmp) / "run" / "summary.json").read_text())
        rounds = []
        for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines():
            rounds += json.loads(line).get("round_exclusions", [])
    return {
        "codec": codec,
        "lie": lie,
        "seed": seed,
        "final_eval_loss": summary["final_eval_loss"],
        "excluded": summary["guard_excluded_updates"],
        "excluded_liar": sum(e["cluster"] == 2 for e in rounds),
        "excluded_honest": sum(e["cluster"] != 2 for e in rounds),
        "command": command,
    }


def table(results: list[dict]) -> str:
    """Per codec and lie: the paired gap to the clean run (mean +- sd over seeds) and what was left out."""
    lines = [
        "| codec | lie | seeds | final eval loss (mean) | gap to clean, paired (mean +- sd) | liar left out (syncs) | "
        "honest left out |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    by_key = {(r["codec"], r["lie"], r["seed"]): r for r in results}
    for codec in CODECS:
        for lie in LIES:
            rows = [r for r in results if r["codec"] == codec and r["lie"] == lie]
            stopped = [r for r in rows if r["final_eval_loss"] is None]
            rows = [r for r in rows if r["final_eval_loss"] is not None]
            if stopped:  # the divergence check (eval.divergence_ratio) stopped these runs
                steps = ", ".join(f"seed {r['seed']} at step {r['stopped_at_step']}" for r in stopped)
                lines.append(f"| {codec} | {lie} | {len(stopped)} | stopped: diverged ({steps}) | - | - | - |")
            if not rows:
                continue
            gaps = [
                100 * (r["final_eval_loss"] / by_key[codec, "clean", r["seed"]]["final_eval_loss"] - 1)
                for r in rows
                if (codec, "clean", r["seed"]) in by_key
            ]
            gap = "-" if lie == "clean" or not gaps else f"{statistics.mean(gaps):+.2f}%"
            if lie != "clean" and len(gaps) > 1:
                gap += f" +- {statistics.stdev(gaps):.2f}"
            liar = "-" if lie == "clean" else " ".join(str(r["excluded_liar"]) for r in rows)
            honest = " ".join(str(r["excluded_honest"]) for r in rows)
            loss = statistics.mean(r["final_eval_loss"] for r in rows)
            lines.append(f"| {codec} | {lie} | {len(rows)} | {loss:.4f} | {gap} | {liar} | {honest} |")
    return "\n".join(lines)


def write(results: list[dict], out: Path, steps: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    text = (
        "# The peer check per codec: one lying cluster of three\n\n"
        f"`python benchmarks/guard_codecs.py --steps {steps}`: the dilocox preset on configs/debug.toml, 3 clusters, "
        f"{steps} steps, H = 10 ({steps // 10 - 1} rounds, then the drained residual: {steps // 10} syncs), the link "
        "not emulated; cluster 2 lies from round 2 on. x1000 is a lie every check catches: its gap is what losing "
        "cluster 2's data from round 2 on costs, the floor of the other lies'. Gap: final eval loss over the clean "
        "run's of the same seed and codec. Left out: per seed, the syncs (rounds and the drain) that left the liar "
        "out, and those that left out an honest cluster. `none` averages by an all-reduce: no receiver sees one "
        "cluster's update, so the peer check cannot run (docs/design.md §4.5).\n\n"
        + table(results)
        + "\n\nEvery command: results.json.\n"
    )
    (out / "results.md").write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codecs", nargs="+", default=CODECS, choices=CODECS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--lies", nargs="+", default=list(LIES), choices=list(LIES))
    parser.add_argument("--steps", type=int, default=120, help="training steps of every run (H = 10)")
    parser.add_argument("--out", type=Path, default=OUT, help="where results.json and results.md go")
    args = parser.parse_args()
    path = args.out / "results.json"
    results = json.loads(path.read_text()) if path.is_file() else []
    done = {(r["codec"], r["lie"], r["seed"]) for r in results}
    for codec in args.codecs:
        for seed in args.seeds:
            for lie in args.lies:
                if (codec, lie, seed) in done:
                    continue
                results.append(run(codec, lie, seed, args.steps))
                write(results, args.out, args.steps)
                print(json.dumps(results[-1]), flush=True)
    write(results, args.out, args.steps)


if __name__ == "__main__":
    main()
