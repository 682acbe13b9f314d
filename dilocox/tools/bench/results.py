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
from dilocox.tools.bench.runs import PROCESS_FILE
from dilocox.tools.bench.spec import BenchSpec
from dilocox.tools.bench.table import format_table
from dilocox.tools.plot import load_run, plot_runs, plot_throughput


def collect(spec: BenchSpec, out_dir: Path, names: list[str]) -> dict[str, Any]:
    """Per-run rows (from each run's summary.json and metrics.jsonl) with the comparisons to the baseline."""
    rows, summaries = [], {}
    for name in names:
        run_dir = out_dir / "runs" / name
        summary = summaries[name] = RunSummary.read(run_dir)
        metrics = read_metrics(run_dir)
        run = next(r for r in spec.runs if r.name == name)
        process_file = run_dir / PROCESS_FILE
        rows.append(
            {
                "name": name,
                "label": run.label or name,
                "overrides": run.overrides,
                "summary": dataclasses.asdict(summary),
                # the whole `dilocox train` process: start-up, data preparation, training, evaluation, checkpoints
                "process_s": float(process_file.read_text()) if process_file.exists() else None,
                "curve": [
                    {"tokens": m["tokens"], "elapsed_s": m["elapsed_s"], "eval_loss": m["eval_loss"]}
                    for m in metrics
                    if m.get("eval_loss") is not None
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


def compare(summary: RunSummary, baseline: RunSummary | None) -> dict[str, Any]:
    """The table's derived columns for one run."""
    loss, tps, wan = summary.final_eval_loss, summary.tokens_per_s, summary.wan_bytes_total
    out: dict[str, Any] = {
        "final_eval_loss": loss,
        "tokens_per_s": tps,
        "wan_bytes_per_token": wan / summary.tokens,
        "compression_vs_allreduce": summary.allreduce_equiv_bytes / wan if wan else math.inf,
        "hidden_comm_fraction": summary.hidden_comm_fraction,
        "wall_s": summary.wall_s,
        "gap_to_baseline_pct": None,
        "speedup_vs_baseline": None,
    }
    if baseline is not None:
        out["gap_to_baseline_pct"] = 100.0 * (loss - baseline.final_eval_loss) / baseline.final_eval_loss
        out["speedup_vs_baseline"] = tps / baseline.tokens_per_s
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
