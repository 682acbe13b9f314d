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


REGIMES = ("as-configured", "paper")
NO_COMM_RUN = "no-communication"
"""The reference the paper regime adds: every cluster trains alone (one sync at the very end), link off."""
LINK_OFF = ["--network.bandwidth=unlimited", "--network.latency=0"]


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
    regime: str = "as-configured"
    """"as-configured" (every run on the config's link) or "paper" (see `run_paper_regime`)."""


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
    unknown = set(bench) - {"name", "base", "overrides", "baseline", "notes", "regime"}
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
        regime=bench.get("regime", "as-configured"),
    )
    if spec.regime not in REGIMES:
        raise ValueError(f"bench config {path}: regime = {spec.regime!r} is not one of {list(REGIMES)}")
    if spec.baseline not in names:
        raise ValueError(f"bench config {path}: baseline {spec.baseline!r} is not one of the runs {names}")
    return spec


def _run_overrides(spec: BenchSpec, run: BenchRun, quick: bool) -> list[str]:
    return [*spec.overrides, *(QUICK_OVERRIDES if quick else []), *run.overrides]


def _train_command(
    spec: BenchSpec, run: BenchRun, run_dir: Path, quick: bool, extra: list[str] | tuple[str, ...] = ()
) -> list[str]:
    return [
        sys.executable, "-m", "dilocox", "train", "--config", spec.base, *_run_overrides(spec, run, quick), *extra,
        f"--run.out_dir={run_dir}", "--run.overwrite=true", "--metrics.progress=false",
    ]  # fmt: skip


def _train(spec: BenchSpec, run: BenchRun, run_dir: Path, log: Path, quick: bool, extra: list[str], tag: str) -> dict:
    """One `dilocox train` subprocess; returns its summary.json (raises RuntimeError with the log's tail)."""
    command = _train_command(spec, run, run_dir, quick, extra)
    print(f"{tag} {run.name}: dilocox train {' '.join(command[5:])}", flush=True)
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
    return summary


def run_bench(
    path: Path,
    *,
    out_dir: Path | None = None,
    quick: bool = False,
    only: list[str] | None = None,
    regime: str | None = None,
) -> dict:
    """Run every run of the bench file (or those named in `only`), then write the table, JSON and plots.

    `regime` overrides the file's: "paper" runs `run_paper_regime` instead of one run per strategy."""
    spec = load_bench(path)
    if regime is not None:
        if regime not in REGIMES:
            raise ValueError(f"--regime {regime!r} is not one of {list(REGIMES)}")
        spec.regime = regime
    suffix = ("-paper" if spec.regime == "paper" and not spec.name.endswith("paper") else "") + ("-quick" * quick)
    out_dir = out_dir or Path("benchmarks/results") / (spec.name + suffix)
    out_dir.mkdir(parents=True, exist_ok=True)
    selected = [r for r in spec.runs if not only or r.name in only]
    if only and len(selected) != len(only):
        raise ValueError(f"--only {only}: unknown run names; the bench has {[r.name for r in spec.runs]}")
    if spec.regime == "paper":
        return run_paper_regime(spec, selected, out_dir, quick=quick)
    for index, run in enumerate(selected, 1):
        _train(spec, run, out_dir / "runs" / run.name, out_dir / f"{run.name}.log", quick, [],
               f"[{index}/{len(selected)}]")  # fmt: skip
    results = collect(
        spec, out_dir, [r.name for r in spec.runs if (out_dir / "runs" / r.name / "summary.json").exists()]
    )
    results["quick"] = quick
    write_atomic(out_dir / "results.json", json.dumps(results, indent=2).encode())
    write_atomic(out_dir / "results.md", format_table(results).encode())
    plot(results, out_dir)
    print(format_table(results))
    return results


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """A run directory's metrics.jsonl, one dict per logged step."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _is_per_step(kind: str) -> bool:
    """Strategies that talk over the slow link every step (their "round" is one step)."""
    return kind in ("allreduce", "cocktail")


def window_steps(kind: str, inner_steps: int) -> int:
    """Steps of a timed run in the paper regime: enough for one steady round before the last step.

    Per-step strategies: 2 steps (AllReduce's take minutes each there). Outer-loop strategies: 2H + 1, so that the
    window (H, 2H] holds a whole round and the wait for the sync launched at step H, while the last step, which
    flushes the delayed sync and evaluates, stays outside it."""
    return 2 if _is_per_step(kind) else 2 * inner_steps + 1


def steady_tokens_per_s(metrics: list[dict[str, Any]], kind: str, inner_steps: int, steps: int) -> float:
    """Tokens/s over the steady window of a timed run (`window_steps`), from its per-step metrics records."""
    by_step = {m["step"]: m for m in metrics}
    start, end = (0 if _is_per_step(kind) else inner_steps), steps - 1
    missing = [s for s in (start, end) if s and s not in by_step]
    if missing:
        raise RuntimeError(f"metrics lack steps {missing}; timed runs must log every step (--metrics.log_interval=1)")
    t0, k0 = (0.0, 0) if start == 0 else (by_step[start]["elapsed_s"], by_step[start]["tokens"])
    return (by_step[end]["tokens"] - k0) / (by_step[end]["elapsed_s"] - t0)


def steady_hidden_fraction(
    metrics: list[dict[str, Any]], kind: str, inner_steps: int, steps: int, whole_run: float | None
) -> float | None:
    """Share of the link time hidden behind compute for the syncs waited for inside the steady window (per-step
    strategies log no per-sync times: their whole run's figure, which for them is the same every step)."""
    start, end = (0 if _is_per_step(kind) else inner_steps), steps - 1
    rounds = [m for m in metrics if start < m["step"] <= end and m.get("round_link_s")]
    link = sum(m["round_link_s"] for m in rounds)
    if not link:
        return whole_run
    return max(0.0, 1.0 - sum(m["round_exposed_s"] for m in rounds) / link)


def run_paper_regime(spec: BenchSpec, selected: list[BenchRun], out_dir: Path, *, quick: bool) -> dict[str, Any]:
    """DiLoCoX's comparison in the paper's regime (docs/planner.md, "The paper regime"), in three steps:

    1. Convergence, link off: every run for the whole token budget, plus `no-communication` (every cluster alone,
       one sync at the very end), the compute-only reference. Loss, bytes and curves come from these runs (loss
       does not depend on bandwidth: the delay is one round whatever the link; fit_link must be off).
    2. The bandwidth: `paper_regime_bandwidth` from the reference's measured compute time per step and the fp32
       gradient, so one AllReduce step waits on the link 357.5 times its compute, as in the paper.
    3. Throughput, link on at that bandwidth: every run again for `window_steps`, tokens/s over its steady window
       (`steady_tokens_per_s`), hidden communication from those runs; and the reference on the outer-loop runs'
       window (no sync inside it), the "no communication" throughput the others are divided by.
    """
    from dilocox.config import load_config
    from dilocox.net.link import parse_duration
    from dilocox.tools.bench.planner import format_bandwidth, paper_regime_bandwidth, paper_regime_ratio

    configs = {run.name: load_config(spec.base, _run_overrides(spec, run, quick)) for run in selected}
    for name, cfg in configs.items():
        if cfg.compression.fit_link:
            raise ValueError(f"run {name}: compression.fit_link changes H with the link; the paper regime needs it off")
    steps = next(iter(configs.values())).train.steps
    reference = BenchRun(NO_COMM_RUN, ["--sync.kind=diloco", f"--sync.inner_steps={steps}", "--checkpoint.interval=0"],
                         "no communication (each cluster alone)")  # fmt: skip
    earlier = out_dir / "results.json"
    partial = len(selected) < len(spec.runs)
    reuse = partial and earlier.exists() and "regime" in json.loads(earlier.read_text())
    # A partial re-run keeps the earlier bandwidth, so that its rows stay comparable with the rows it keeps.
    runs = selected if reuse else [reference, *selected]
    # The compute-only reference on the same window as the outer-loop runs: H steps after H steps, no sync between.
    outer = [cfg.sync.inner_steps for cfg in configs.values() if not _is_per_step(cfg.sync.kind)]
    timed_runs = [(reference, window_steps("diloco", outer[0]))] if outer else []
    timed_runs += [(run, window_steps(configs[run.name].sync.kind, configs[run.name].sync.inner_steps))
                   for run in selected]  # fmt: skip
    total = len(runs) + len(timed_runs)
    for index, run in enumerate(runs, 1):
        _train(spec, run, out_dir / "runs" / run.name, out_dir / f"{run.name}.log", quick, LINK_OFF,
               f"[{index}/{total}] link off:")  # fmt: skip
    ref_dir = out_dir / "runs" / NO_COMM_RUN
    ref = json.loads((ref_dir / "summary.json").read_text())
    if reuse:
        regime = json.loads(earlier.read_text())["regime"]
        print(f"paper regime: keeping the earlier link of {regime['bandwidth']} (a partial re-run)", flush=True)
    else:
        compute_s = ref["tokens"] / ref["tokens_per_s"] / ref["steps"]  # one step of every cluster, no comm
        latency_s = parse_duration(next(iter(configs.values())).network.latency)
        grad_bytes = 4 * ref["num_params"]
        bandwidth = paper_regime_bandwidth(compute_s, grad_bytes, num_clusters=ref["num_clusters"],
                                           latency_s=latency_s)  # fmt: skip
        regime = {
            "ratio": paper_regime_ratio(),
            "compute_s_per_step": compute_s,
            "grad_bytes": grad_bytes,
            "bandwidth_bytes_per_s": bandwidth,
            "bandwidth": format_bandwidth(bandwidth),
            "latency_s": latency_s,
            "no_communication_tokens_per_s": ref["tokens_per_s"],
        }
        print(
            f"paper regime: {compute_s:.3f} s of compute per step, fp32 gradient {grad_bytes / 1e6:.2f} MB -> "
            f"{bandwidth * 8 / 1e6:.4g} Mbps (AllReduce waits {regime['ratio']:.1f}x its compute per step)",
            flush=True,
        )
    for index, (run, window) in enumerate(timed_runs, len(runs) + 1):
        extra = [
            f"--network.bandwidth={regime['bandwidth']}",
            f"--train.steps={window}",
            "--train.warmup_steps=0",
            "--eval.interval=0",
            "--eval.max_batches=1",
            "--checkpoint.interval=0",
            "--metrics.log_interval=1",
        ]
        _train(spec, run, out_dir / "timed" / run.name, out_dir / f"{run.name}.timed.log", quick, extra,
               f"[{index}/{total}] paper link:")  # fmt: skip
    timed: dict[str, dict] = {}
    for run in [reference, *spec.runs]:  # this call's timed runs and, after a partial re-run, the earlier ones
        run_dir = out_dir / "timed" / run.name
        if not (run_dir / "summary.json").exists():
            continue
        summary = json.loads((run_dir / "summary.json").read_text())
        metrics = read_metrics(run_dir)
        kind, inner_steps = summary["sync_kind"], summary["inner_steps"]
        if run.name == NO_COMM_RUN:  # no sync before the last step: its window is the outer-loop runs' one
            inner_steps = (summary["steps"] - 1) // 2
        summary["window_steps"] = summary["steps"]
        summary["steady_tokens_per_s"] = steady_tokens_per_s(metrics, kind, inner_steps, summary["steps"])
        summary["steady_hidden_comm_fraction"] = steady_hidden_fraction(
            metrics, kind, inner_steps, summary["steps"], summary.get("hidden_comm_fraction")
        )
        timed[run.name] = summary

    spec.runs = [reference, *[r for r in spec.runs if r.name != NO_COMM_RUN]]
    names = [NO_COMM_RUN]
    names += [
        r.name for r in spec.runs if r.name in timed and r.name != NO_COMM_RUN and (out_dir / "runs" / r.name).exists()
    ]
    results = collect(spec, out_dir, names)
    results["quick"] = quick
    results["regime"] = regime
    base_tps = timed[spec.baseline]["steady_tokens_per_s"] if spec.baseline in timed else None
    # "no communication" throughput: the timed compute-only run when there is one, else the link-off run's
    no_comm_tps = timed[NO_COMM_RUN]["steady_tokens_per_s"] if NO_COMM_RUN in timed else ref["tokens_per_s"]
    regime["no_communication_steady_tokens_per_s"] = no_comm_tps
    for row in results["runs"]:
        t = timed.get(row["name"])
        if row["name"] == NO_COMM_RUN:
            row.update(tokens_per_s=no_comm_tps, speedup_vs_baseline=None, hidden_comm_fraction=None)
        elif t is None:
            raise RuntimeError(f"run {row['name']} has no timed run in {out_dir / 'timed'}")
        else:
            row.update(
                tokens_per_s=t["steady_tokens_per_s"],
                speedup_vs_baseline=t["steady_tokens_per_s"] / base_tps if base_tps else None,
                hidden_comm_fraction=t["steady_hidden_comm_fraction"],
                timed_window_steps=t["window_steps"],
                timed_wall_s=t["wall_s"],
            )
        row["of_no_communication"] = row["tokens_per_s"] / no_comm_tps
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
        metrics = read_metrics(run_dir)
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


def _gap_cell(gap: float | None) -> str:
    return ("+" if gap is not None and gap > 0 else "") + _fmt(gap, ".2f") + ("%" if gap is not None else "")


def _bytes_ratio_cell(row: dict[str, Any]) -> str:
    return "1/" + _fmt(row["compression_vs_allreduce"], ",.0f") if row["wan_bytes_per_token"] else "0"


def _hidden_cell(hidden: float | None) -> str:
    return _fmt(None if hidden is None else 100 * hidden, ".0f") + ("%" if hidden is not None else "")


def format_table(results: dict[str, Any]) -> str:
    """The markdown table of a bench (one row per run)."""
    if results.get("regime"):
        return format_paper_table(results)
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
                gap=_gap_cell(gap),
                tps=_fmt(row["tokens_per_s"], ",.0f"),
                speed=_fmt(row["speedup_vs_baseline"], ".2f") + ("x" if row["speedup_vs_baseline"] else ""),
                bpt=_fmt(row["wan_bytes_per_token"], ",.1f"),
                ratio=_bytes_ratio_cell(row),
                hidden=_hidden_cell(row["hidden_comm_fraction"]),
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


def format_paper_table(results: dict[str, Any]) -> str:
    """The paper-regime table: loss from the link-off runs, tokens/s from the timed runs on the paper's link."""
    b = results["baseline"]
    lines = [
        f"| run | eval loss (link off) | gap to {b} | tokens/s (paper link) | speedup vs {b} | of no-comm throughput "
        "| slow-link bytes/token | bytes vs AllReduce | hidden comm |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in results["runs"]:
        gap, speed, hidden = row["gap_to_baseline_pct"], row["speedup_vs_baseline"], row["hidden_comm_fraction"]
        lines.append(
            "| {label} | {loss} | {gap} | {tps} | {speed} | {nocomm} | {bpt} | {ratio} | {hidden} |".format(
                label=row["label"],
                loss=_fmt(row["final_eval_loss"], ".4f"),
                gap=_gap_cell(gap),
                tps=_fmt(row["tokens_per_s"], ",.1f"),
                speed=_fmt(speed, ",.1f") + ("x" if speed else ""),
                nocomm=_fmt(100 * row["of_no_communication"], ".1f") + "%",
                bpt=_fmt(row["wan_bytes_per_token"], ",.1f"),
                ratio=_bytes_ratio_cell(row),
                hidden=_hidden_cell(hidden),
            )
        )
    r = results["regime"]
    s = results["runs"][0]["summary"] if results["runs"] else {}
    quick = " (quick)" if results.get("quick") else ""
    footer = [
        "",
        f"Bench `{results['bench']}` in the paper regime ({results['source']}), {results['date']}{quick}: "
        f"{s.get('flavor')} ({s.get('num_params', 0):,} params), {s.get('num_clusters')} clusters x dp "
        f"{s.get('dp_degree')} x pp {s.get('pp_degree')}, {s.get('tokens', 0):,} tokens per convergence run.",
        f"Link: {r['bandwidth_bytes_per_s'] * 8 / 1e6:.4g} Mbps per cluster uplink, {r['latency_s'] * 1e3:g} ms, "
        f"chosen so that one AllReduce step's transfer of the fp32 gradient ({r['grad_bytes'] / 1e6:.2f} MB) takes "
        f"{r['ratio']:.1f} x the measured compute time of a step ({r['compute_s_per_step']:.3f} s, from the "
        "no-communication run), as AllReduce did in the paper (3,728 / 10.4 - 1).",
        "Eval loss, gaps and bytes come from the convergence runs with the link off; tokens/s, speedups and hidden "
        "communication (of the syncs waited for inside the window) from timed runs on that link (2 steps for "
        "per-step strategies, 2H + 1 for outer-loop ones; tokens/s over the last whole round before the final step). "
        "The no-communication row (every cluster alone) is timed on the same window as the outer-loop runs, with no "
        "sync inside it; its loss is from its link-off run.",
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
    parser.add_argument(
        "--regime",
        choices=REGIMES,
        default=None,
        help="paper: convergence with the link off, throughput on a link as slow relative to compute as the paper's",
    )
    args = parser.parse_args(argv)
    try:
        run_bench(
            Path(args.config),
            out_dir=Path(args.out) if args.out else None,
            quick=args.quick,
            only=[n for n in args.only.split(",") if n] or None,
            regime=args.regime,
        )
    except ValueError as exc:
        print(f"dilocox: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"dilocox: {exc}", file=sys.stderr)
        return 1
    return 0
