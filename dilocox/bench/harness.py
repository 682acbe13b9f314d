"""`dilocox bench`: run strategies on the same model, data, topology, seeds, tokens and link; tabulate and plot.

A bench file (TOML) names a base training config, overrides shared by every run, and the runs:

    [bench]
    name = "default"
    base = "configs/default.toml"
    overrides = ["--train.steps=400"]
    [[runs]]
    name = "allreduce"
    overrides = ["--sync.kind=allreduce"]

Each run is a real `dilocox train` in a subprocess (its own ranks, its own run directory under `OUT/runs/`); the
harness then writes `OUT/results.json`, `OUT/results.md` and plots (eval loss vs tokens, eval loss vs wall time,
throughput). `--quick` shrinks every run to the debug flavor and a few steps, for tests and smoke checks.

    results = run_bench(Path("benchmarks/configs/default.toml"), out_dir=Path("benchmarks/results/default"))
"""

from __future__ import annotations

import datetime
import json
import math
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dilocox.checkpoint import write_atomic

QUICK_OVERRIDES = [
    "--model.flavor=debug",
    "--data.vocab_size=512",
    "--train.steps=20",
    "--train.seq_len=64",
    "--train.micro_batch_size=4",
    "--train.warmup_steps=2",
    "--sync.inner_steps=5",
    "--eval.interval=10",
    "--eval.max_batches=2",
    "--checkpoint.interval=0",
    "--metrics.log_interval=5",
]


@dataclass
class BenchRun:
    name: str
    overrides: list[str]
    label: str = ""


@dataclass
class BenchSpec:
    name: str
    base: str
    overrides: list[str]
    runs: list[BenchRun]
    baseline: str = "allreduce"
    notes: str = ""
    source: Path = field(default_factory=Path)


def load_bench(path: Path) -> BenchSpec:
    """Read and check a bench file; errors name the file and the key."""
    if not path.is_file():
        raise ValueError(f"bench config {path}: no such file (see benchmarks/configs/)")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"bench config {path}: not valid TOML ({exc})") from None
    bench = data.get("bench")
    if not isinstance(bench, dict) or "base" not in bench:
        raise ValueError(f'bench config {path}: needs a [bench] table with base = "path/to/train.toml"')
    unknown = set(bench) - {"name", "base", "overrides", "baseline", "notes"}
    if unknown or set(data) - {"bench", "runs"}:
        raise ValueError(f"bench config {path}: unknown keys {sorted(unknown | (set(data) - {'bench', 'runs'}))}")
    runs = []
    for index, run in enumerate(data.get("runs", [])):
        if "name" not in run or set(run) - {"name", "overrides", "label"}:
            raise ValueError(f"bench config {path}: runs[{index}] needs name (and only overrides, label)")
        runs.append(BenchRun(run["name"], list(run.get("overrides", [])), run.get("label", "")))
    if not runs:
        raise ValueError(f"bench config {path}: no [[runs]]")
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise ValueError(f"bench config {path}: run names repeat: {names}")
    base = Path(bench["base"])
    if not base.is_absolute():
        base = (path.parent / base) if (path.parent / base).is_file() else base
    spec = BenchSpec(
        name=bench.get("name", path.stem),
        base=str(base),
        overrides=list(bench.get("overrides", [])),
        runs=runs,
        baseline=bench.get("baseline", "allreduce"),
        notes=bench.get("notes", ""),
        source=path,
    )
    if spec.baseline not in names:
        raise ValueError(f"bench config {path}: baseline {spec.baseline!r} is not one of the runs {names}")
    return spec


def _train_command(spec: BenchSpec, run: BenchRun, run_dir: Path, quick: bool) -> list[str]:
    return [
        sys.executable, "-m", "dilocox", "train", "--config", spec.base,
        *spec.overrides, *(QUICK_OVERRIDES if quick else []), *run.overrides,
        f"--run.out_dir={run_dir}", "--run.overwrite=true", "--metrics.progress=false",
    ]  # fmt: skip


def run_bench(path: Path, *, out_dir: Path | None = None, quick: bool = False, only: list[str] | None = None) -> dict:
    """Run every run of the bench file (or those named in `only`), then write the table, JSON and plots."""
    spec = load_bench(path)
    out_dir = out_dir or Path("benchmarks/results") / (spec.name + ("-quick" if quick else ""))
    out_dir.mkdir(parents=True, exist_ok=True)
    selected = [r for r in spec.runs if not only or r.name in only]
    if only and len(selected) != len(only):
        raise ValueError(f"--only {only}: unknown run names; the bench has {[r.name for r in spec.runs]}")
    for index, run in enumerate(selected, 1):
        run_dir = out_dir / "runs" / run.name
        command = _train_command(spec, run, run_dir, quick)
        print(f"[{index}/{len(selected)}] {run.name}: dilocox train {' '.join(command[5:])}", flush=True)
        log = out_dir / f"{run.name}.log"
        started = time.perf_counter()
        with open(log, "w") as f:
            status = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT).returncode
        if status != 0:
            tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
            raise RuntimeError(f"bench run {run.name} failed (exit {status}); last lines of {log}:\n{tail}")
        write_atomic(run_dir / "process_s.txt", f"{time.perf_counter() - started:.1f}\n".encode())
        summary = json.loads((run_dir / "summary.json").read_text())
        print(
            f"    eval loss {summary['final_eval_loss']:.4f}, {summary['tokens_per_s']:,.0f} tokens/s, "
            f"{summary['wan_bytes_total'] / 1e6:,.2f} MB on the slow link, {summary['wall_s']:.1f} s",
            flush=True,
        )
    results = collect(
        spec, out_dir, [r.name for r in spec.runs if (out_dir / "runs" / r.name / "summary.json").exists()]
    )
    results["quick"] = quick
    write_atomic(out_dir / "results.json", json.dumps(results, indent=2).encode())
    write_atomic(out_dir / "results.md", format_table(results).encode())
    plot(results, out_dir)
    print(format_table(results))
    return results


def collect(spec: BenchSpec, out_dir: Path, names: list[str]) -> dict[str, Any]:
    """Per-run rows (from each run's summary.json and metrics.jsonl) with the comparisons to the baseline."""
    rows = []
    for name in names:
        run_dir = out_dir / "runs" / name
        summary = json.loads((run_dir / "summary.json").read_text())
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        run = next(r for r in spec.runs if r.name == name)
        process_file = run_dir / "process_s.txt"
        rows.append(
            {
                "name": name,
                "label": run.label or name,
                "overrides": run.overrides,
                "summary": summary,
                # the whole `dilocox train` process: start-up, data preparation, training, evaluation, checkpoints
                "process_s": float(process_file.read_text()) if process_file.exists() else None,
                "curve": [
                    {"tokens": m["tokens"], "elapsed_s": m["elapsed_s"], "eval_loss": m["eval_loss"]}
                    for m in metrics
                    if m.get("eval_loss") is not None
                ],
            }
        )
    base = next((r for r in rows if r["name"] == spec.baseline), None)
    for row in rows:
        row.update(compare(row["summary"], base["summary"] if base else None))
    return {
        "bench": spec.name,
        "source": str(spec.source),
        "base_config": spec.base,
        "common_overrides": spec.overrides,
        "baseline": spec.baseline,
        "notes": spec.notes,
        "date": datetime.date.today().isoformat(),
        "runs": rows,
    }


def compare(summary: dict[str, Any], baseline: dict[str, Any] | None) -> dict[str, Any]:
    """The table's derived columns for one run."""
    loss, tps, wan = summary["final_eval_loss"], summary["tokens_per_s"], summary["wan_bytes_total"]
    out: dict[str, Any] = {
        "final_eval_loss": loss,
        "tokens_per_s": tps,
        "wan_bytes_per_token": wan / summary["tokens"],
        "compression_vs_allreduce": summary["allreduce_equiv_bytes"] / wan if wan else math.inf,
        "hidden_comm_fraction": summary.get("hidden_comm_fraction"),
        "wall_s": summary["wall_s"],
        "gap_to_baseline_pct": None,
        "speedup_vs_baseline": None,
    }
    if baseline is not None:
        out["gap_to_baseline_pct"] = 100.0 * (loss - baseline["final_eval_loss"]) / baseline["final_eval_loss"]
        out["speedup_vs_baseline"] = tps / baseline["tokens_per_s"]
    return out


def _fmt(value: Any, spec: str, none: str = "-") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return none if value is None else "inf"
    return format(value, spec)


def format_table(results: dict[str, Any]) -> str:
    """The markdown table of a bench (one row per run)."""
    head = (
        "| run | eval loss | gap to {b} | tokens/s | speedup vs {b} | slow-link bytes/token | "
        "bytes vs AllReduce | hidden comm | wall s |".format(b=results["baseline"])
    )
    lines = [head, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in results["runs"]:
        gap = row["gap_to_baseline_pct"]
        lines.append(
            "| {label} | {loss} | {gap} | {tps} | {speed} | {bpt} | {ratio} | {hidden} | {wall} |".format(
                label=row["label"],
                loss=_fmt(row["final_eval_loss"], ".4f"),
                gap=("+" if gap is not None and gap > 0 else "") + _fmt(gap, ".2f") + ("%" if gap is not None else ""),
                tps=_fmt(row["tokens_per_s"], ",.0f"),
                speed=_fmt(row["speedup_vs_baseline"], ".2f") + ("x" if row["speedup_vs_baseline"] else ""),
                bpt=_fmt(row["wan_bytes_per_token"], ",.1f"),
                ratio="1/" + _fmt(row["compression_vs_allreduce"], ",.0f") if row["wan_bytes_per_token"] else "0",
                hidden=_fmt(None if row["hidden_comm_fraction"] is None else 100 * row["hidden_comm_fraction"], ".0f")
                + ("%" if row["hidden_comm_fraction"] is not None else ""),
                wall=_fmt(row["wall_s"], ".1f"),
            )
        )
    s = results["runs"][0]["summary"] if results["runs"] else {}
    setting = (
        f"{s.get('flavor')} ({s.get('num_params', 0):,} params), {s.get('num_clusters')} clusters x dp "
        f"{s.get('dp_degree')} x pp {s.get('pp_degree')}, {s.get('tokens', 0):,} tokens per run, link "
        f"{s.get('bandwidth')} / {s.get('latency')}"
    )
    quick = " (quick)" if results.get("quick") else ""
    footer = [
        "",
        f"Bench `{results['bench']}` ({results['source']}), {results['date']}{quick}: "
        f"{setting}. Every run: base config `{results['base_config']}` with {results['common_overrides'] or 'no'} "
        "common overrides.",
    ]
    if results.get("notes"):
        footer.append(results["notes"])
    return "\n".join(lines + footer) + "\n"


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """eval loss vs tokens, eval loss vs wall time, and a throughput bar chart (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("plots need matplotlib: pip install 'dilocox[bench]'") from None
    paths = []
    for key, xlabel, filename in (
        ("tokens", "tokens", "loss_vs_tokens.png"),
        ("elapsed_s", "wall time (s)", "loss_vs_time.png"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for row in results["runs"]:
            if row["curve"]:
                ax.plot([p[key] for p in row["curve"]], [p["eval_loss"] for p in row["curve"]], marker="o",
                        markersize=3, label=row["label"])  # fmt: skip
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss")
        ax.set_title(f"{results['bench']}: validation loss vs {xlabel}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / filename, dpi=120)
        plt.close(fig)
        paths.append(out_dir / filename)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = [row["label"] for row in results["runs"]]
    ax.barh(labels, [row["tokens_per_s"] for row in results["runs"]], color="tab:blue")
    ax.set_xlabel("tokens/s (training, all ranks)")
    ax.set_title(f"{results['bench']}: throughput")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(out_dir / "throughput.png", dpi=120)
    plt.close(fig)
    paths.append(out_dir / "throughput.png")
    return paths


def main(argv: list[str]) -> int:
    """`dilocox bench [CONFIG] [--out DIR] [--quick] [--only a,b]`."""
    import argparse

    parser = argparse.ArgumentParser(prog="dilocox bench", description="Compare strategies on one setting.")
    parser.add_argument("config", nargs="?", default="benchmarks/configs/default.toml", help="bench TOML file")
    parser.add_argument("--out", default=None, help="output directory (default benchmarks/results/NAME)")
    parser.add_argument("--quick", action="store_true", help="debug flavor, 20 steps: a smoke check of the table")
    parser.add_argument("--only", default="", help="comma-separated run names to (re)run; others are kept")
    args = parser.parse_args(argv)
    try:
        run_bench(
            Path(args.config),
            out_dir=Path(args.out) if args.out else None,
            quick=args.quick,
            only=[n for n in args.only.split(",") if n] or None,
        )
    except ValueError as exc:
        print(f"dilocox: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"dilocox: {exc}", file=sys.stderr)
        return 1
    return 0
