"""A bench's results: one row per run, read from its run directory, compared with the baseline, and written out.

Rows come from each run directory's summary.json and metrics.jsonl; `write_results` writes them out:

    results = collect(spec, out_dir, ["allreduce", "dilocox"])
    write_results(results, out_dir)          # results.json, results.md and the plots
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from pathlib import Path
from typing import Any

from dilocox.fileio import write_atomic
from dilocox.metrics import RunSummary, read_metrics
from dilocox.tools.bench.runs import PROCESS_FILE, finished_seeds, seed_run_dir
from dilocox.tools.bench.spec import BenchSpec
from dilocox.tools.bench.table import format_table
from dilocox.tools.plot import load_run, plot_runs, plot_seed_spread, plot_throughput


def _curve(run_dir: Path) -> list[dict[str, float]]:
    """The run's evaluations: tokens, elapsed seconds and eval loss (of the model the clusters agree on)."""
    return [
        {"tokens": m["tokens"], "elapsed_s": m["elapsed_s"], "eval_loss": m["eval_loss"]}
        for m in read_metrics(run_dir)
        if m.get("eval_loss") is not None
    ]


def collect(spec: BenchSpec, out_dir: Path, names: list[str]) -> dict[str, Any]:
    """Per-run rows (from each run's summary.json and metrics.jsonl, every finished seed) with the comparisons to
    the baseline: means over seeds, their spread, and gaps paired seed by seed (docs/design.md §8)."""
    runs_dir = out_dir / "runs"
    rows, summaries = [], {}
    for name in names:
        seeds = finished_seeds(runs_dir, name)
        if not seeds:
            raise ValueError(f"run {name} has no finished run in {runs_dir}")
        dirs = [seed_run_dir(runs_dir, name, k) for k in seeds]
        summaries[name] = [RunSummary.read(d) for d in dirs]
        run = next(r for r in spec.runs if r.name == name)
        process_file = dirs[0] / PROCESS_FILE
        rows.append(
            {
                "name": name,
                "label": run.label or name,
                "overrides": run.overrides,
                "summary": dataclasses.asdict(summaries[name][0]),
                # the whole `dilocox train` process: start-up, data preparation, training, evaluation, checkpoints
                "process_s": float(process_file.read_text()) if process_file.exists() else None,
                "curve": _curve(dirs[0]),
                "seeds": [
                    {"run_seed": s.run_seed, "final_eval_loss": s.final_eval_loss, "curve": _curve(d)}
                    for s, d in zip(summaries[name], dirs, strict=True)
                ],
            }
        )
    for row in rows:
        row.update(compare(summaries[row["name"]], summaries.get(spec.baseline)))
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


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _sd(values: list[float]) -> float | None:
    """Sample standard deviation; None for fewer than 2 values."""
    if len(values) < 2:
        return None
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def compare(runs: RunSummary | list[RunSummary], baseline: RunSummary | list[RunSummary] | None) -> dict[str, Any]:
    """The table's derived columns for one run: means over its seeds, the spread of its eval loss, and its gap to
    the baseline paired seed by seed (seed k against the baseline's seed k, which shares its initial weights and
    data order), with the gap's spread over those pairs.

    A gap is `gap_resolved` when it has the same sign on every pair and exceeds its standard deviation: only then
    may a table call one run better than the other (one seed never resolves a gap)."""
    runs = runs if isinstance(runs, list) else [runs]
    base = [] if baseline is None else baseline if isinstance(baseline, list) else [baseline]
    losses = [s.final_eval_loss for s in runs]
    wan = _mean([s.wan_bytes_total for s in runs])
    hidden = [s.hidden_comm_fraction for s in runs if s.hidden_comm_fraction is not None]
    out: dict[str, Any] = {
        "num_seeds": len(runs),
        "final_eval_loss": _mean(losses),
        "final_eval_loss_sd": _sd(losses),
        "tokens_per_s": _mean([s.tokens_per_s for s in runs]),
        "wan_bytes_per_token": wan / runs[0].tokens,
        "compression_vs_allreduce": runs[0].allreduce_equiv_bytes / wan if wan else math.inf,
        "hidden_comm_fraction": _mean(hidden) if hidden else None,
        "wall_s": _mean([s.wall_s for s in runs]),
        "gap_to_baseline_pct": None,
        "gap_sd_pct": None,
        "gap_range_pct": None,
        "gap_resolved": False,
        "speedup_vs_baseline": None,
    }
    if base:
        by_seed = {b.run_seed: b for b in base}
        pairs = [(s, by_seed[s.run_seed]) for s in runs if s.run_seed in by_seed] or [(runs[0], base[0])]
        gaps = [100.0 * (s.final_eval_loss - b.final_eval_loss) / b.final_eval_loss for s, b in pairs]
        sd = _sd(gaps)
        mean = _mean(gaps)
        out.update(
            gap_to_baseline_pct=mean,
            gap_sd_pct=sd,
            gap_range_pct=[min(gaps), max(gaps)],
            gap_resolved=sd is not None and (min(gaps) > 0 or max(gaps) < 0) and abs(mean) > sd,
            speedup_vs_baseline=out["tokens_per_s"] / _mean([b.tokens_per_s for b in base]),
        )
    return out


def write_results(results: dict[str, Any], out_dir: Path) -> None:
    """`results.json`, `results.md` (the table) and the plots of `dilocox plot` for the bench's runs (their curves
    from `OUT/runs/NAME`, the throughput bars from the table), into `out_dir`."""
    write_atomic(out_dir / "results.json", json.dumps(results, indent=2).encode())
    write_atomic(out_dir / "results.md", format_table(results).encode())
    rows = results["runs"]
    plot_runs([load_run(out_dir / "runs" / row["name"], row["label"]) for row in rows], out_dir, title=results["bench"])
    plot_throughput([row["label"] for row in rows], [row["tokens_per_s"] for row in rows], out_dir / "throughput.png",
                    title=results["bench"])  # fmt: skip
    if any(row.get("num_seeds", 1) > 1 for row in rows):
        plot_seed_spread(rows, out_dir / "loss_vs_tokens_seeds.png", title=results["bench"])
