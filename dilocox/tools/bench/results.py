"""A bench's results: one row per run, read from its run directory, compared with the baseline, and written out.

Rows come from each run directory's summary.json and metrics.jsonl; `write_results` writes them out:

    results = collect(spec, out_dir, ["allreduce", "dilocox"])
    write_results(results, out_dir)          # results.json, results.md and the plots (frontier.png: bytes vs gap)

Run directories (`OUT/runs/`) are not committed, results.json is: a bench re-run with `--only` on a fresh checkout
keeps the rows of the other runs from the results.json already in OUT (`kept_rows`), so adding one run to a
committed table does not drop the rest.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dilocox.fileio import write_atomic
from dilocox.metrics import METRICS_FILE, RunSummary, read_metrics
from dilocox.tools.bench.runs import PROCESS_FILE, finished_seeds, seed_run_dir
from dilocox.tools.bench.spec import BenchSpec
from dilocox.tools.bench.table import format_table
from dilocox.tools.plot import (
    FRONTIER_FILE,
    RunCurves,
    frontier,
    frontier_points,
    load_run,
    plot_frontier,
    plot_runs,
    plot_seed_spread,
    plot_throughput,
)


def _curve(run_dir: Path) -> list[dict[str, float]]:
    """The run's evaluations: tokens, elapsed seconds and eval loss (of the model the clusters agree on)."""
    return [
        {"tokens": m["tokens"], "elapsed_s": m["elapsed_s"], "eval_loss": m["eval_loss"]}
        for m in read_metrics(run_dir)
        if m.get("eval_loss") is not None
    ]


TAIL = 0.1
"""The share of a run's last steps whose training loss `train_loss_tail` averages."""


def train_loss_tail(run_dir: Path) -> float | None:
    """The training loss of rank 0's cluster over the run's last `TAIL` of steps (each logged mean weighted by the
    steps it covers): how well the clusters themselves train, where the eval loss scores the model they agree on."""
    records = [m for m in read_metrics(run_dir) if m.get("loss") is not None and "event" not in m]
    if not records:
        return None
    first = records[-1]["step"] * (1 - TAIL)
    covered, total, previous = 0, 0.0, 0
    for record in records:
        steps = record["step"] - previous
        previous = record["step"]
        if record["step"] > first:
            covered += steps
            total += record["loss"] * steps
    return total / covered if covered else None


@dataclass(frozen=True)
class SeedResult:
    """What a gap needs of one seed of a run (`RunSummary` has the same fields): for rows kept from results.json."""

    run_seed: int
    final_eval_loss: float
    tokens_per_s: float
    split_seed: int | None = None


def _seed_results(row: dict[str, Any]) -> list[SeedResult]:
    """A results.json row's seeds (every seed gets the row's mean throughput, which is all a comparison uses)."""
    return [
        SeedResult(s["run_seed"], s["final_eval_loss"], row["tokens_per_s"], s.get("split_seed")) for s in row["seeds"]
    ]


def kept_rows(spec: BenchSpec, out_dir: Path, *, quick: bool, exclude: list[str]) -> dict[str, dict[str, Any]]:
    """The rows of `out_dir/results.json` a re-run keeps, by run name: runs of this bench not in `exclude` (those
    with a run directory), written in the same mode (`--quick` or not) with the same common and run overrides.
    A row whose settings changed since is dropped with a one-line notice; so is a results.json of another bench."""
    path = out_dir / "results.json"
    if not path.is_file():
        return {}
    try:
        previous = json.loads(path.read_text())
        written = (previous["bench"], previous["common_overrides"], bool(previous.get("quick")))
        rows = {row["name"]: row for row in previous["runs"]}
    except (ValueError, KeyError, TypeError) as err:
        print(f"note: {path} is not a bench's results ({err}); its rows are not kept", file=sys.stderr)
        return {}
    if written != (spec.name, spec.overrides, quick):
        print(f"note: {path} holds another bench, mode or common overrides; its rows are not kept", file=sys.stderr)
        return {}
    kept = {}
    for run in spec.runs:
        row = rows.get(run.name)
        if row is None or run.name in exclude:
            continue
        if row.get("overrides") != run.overrides or "seeds" not in row:
            print(f"note: run {run.name} changed since {path} was written; its old row is dropped", file=sys.stderr)
            continue
        kept[run.name] = {**row, "label": run.label or run.name}
    return kept


def collect(
    spec: BenchSpec, out_dir: Path, names: list[str], kept: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Per-run rows (from each run's summary.json and metrics.jsonl, every finished seed) with the comparisons to
    the baseline: means over seeds, their spread, and gaps paired seed by seed (docs/design.md §8).

    `kept` (from `kept_rows`, which leaves out `names`): rows of runs without a run directory, taken as they were
    written except for their gaps, which are paired again with the baseline of this table; rows follow the bench
    file's order."""
    runs_dir = out_dir / "runs"
    kept = kept or {}
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
                    {
                        "run_seed": s.run_seed,
                        "split_seed": s.split_seed,
                        "final_eval_loss": s.final_eval_loss,
                        "train_loss_tail": train_loss_tail(d),
                        "curve": _curve(d),
                    }
                    for s, d in zip(summaries[name], dirs, strict=True)
                ],
            }
        )
    # every run's seeds, whether read from its run directory or kept from results.json
    seed_results: dict[str, Sequence[RunSummary | SeedResult]] = {
        name: _seed_results(row) for name, row in kept.items()
    }
    seed_results.update(summaries)
    baseline = seed_results.get(spec.baseline)
    for row in rows:
        row.update(compare(summaries[row["name"]], baseline))
    for row in kept.values():
        row = dict(row)
        row.update(paired_gaps(seed_results[row["name"]], baseline, row["tokens_per_s"]))
        rows.append(row)
    order = [run.name for run in spec.runs]
    rows.sort(key=lambda row: order.index(row["name"]))
    base_row = next((row for row in rows if row["name"] == spec.baseline), None)
    for row in rows:
        row["train_gap_pct"] = train_gap(row, base_row)
    tuned = best_baseline([row for row in rows if row["name"] in spec.tuned_baseline])
    if tuned is not None:
        for row in rows:
            gaps = paired_gaps(seed_results[row["name"]], seed_results[tuned], row["tokens_per_s"])
            row.update({f"tuned_{key}": gaps[key] for key in ("gap_to_baseline_pct", "gap_sd_pct", "gap_resolved")})
    results = {
        "bench": spec.name,
        "source": str(spec.source),
        "base_config": spec.base,
        "common_overrides": spec.overrides,
        "baseline": spec.baseline,
        "tuned_baseline": tuned,
        "tuned_baseline_candidates": [name for name in spec.tuned_baseline if name in seed_results],
        "notes": spec.notes,
        "date": datetime.date.today().isoformat(),
        "runs": rows,
    }
    results["frontier"] = [point.name for point in frontier(frontier_points(results))]
    return results


def train_gap(row: dict[str, Any], base: dict[str, Any] | None) -> float | None:
    """The mean over paired seeds of the gap of the clusters' training loss (`train_loss_tail`) to the baseline's, in
    percent; None without a pair."""
    if base is None:
        return None
    by_seed = {seed["run_seed"]: seed.get("train_loss_tail") for seed in base["seeds"]}
    gaps = [
        100.0 * (seed["train_loss_tail"] - by_seed[seed["run_seed"]]) / by_seed[seed["run_seed"]]
        for seed in row["seeds"]
        if seed.get("train_loss_tail") is not None and by_seed.get(seed["run_seed"])
    ]
    return _mean(gaps) if gaps else None


def best_baseline(candidates: list[dict[str, Any]]) -> str | None:
    """The name of the tuned baseline among `candidates` (rows of the baseline at other settings): the lowest mean
    eval loss among those with the most seeds, so that one lucky seed cannot win over a 3-seed mean."""
    if not candidates:
        return None
    most = max(row["num_seeds"] for row in candidates)
    return min((row for row in candidates if row["num_seeds"] == most), key=lambda row: row["final_eval_loss"])["name"]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _sd(values: list[float]) -> float | None:
    """Sample standard deviation; None for fewer than 2 values."""
    if len(values) < 2:
        return None
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def compare(
    runs: RunSummary | list[RunSummary], baseline: RunSummary | Sequence[RunSummary | SeedResult] | None
) -> dict[str, Any]:
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
    }
    out.update(paired_gaps(runs, base, out["tokens_per_s"]))
    return out


def paired_gaps(runs: Sequence[SeedResult | RunSummary], base: Sequence[SeedResult | RunSummary] | None,
                tokens_per_s: float) -> dict[str, Any]:  # fmt: skip
    """The gap columns of `compare`: seed k against the baseline's seed k scored on the same held-out split (the
    first of each when no seed pairs and the two score one split; no gap when they score different splits), their
    mean, spread and range, whether that resolves, and the speedup of `tokens_per_s` over the baseline's."""
    by_seed = {_pairing(b): b for b in base or []}
    pairs = [(s, by_seed[_pairing(s)]) for s in runs if _pairing(s) in by_seed]
    if not pairs and base and _pairing(runs[0])[1] == _pairing(base[0])[1]:
        pairs = [(runs[0], base[0])]
    if not pairs:
        return {"gap_to_baseline_pct": None, "gap_sd_pct": None, "gap_range_pct": None, "gap_resolved": False,
                "speedup_vs_baseline": None}  # fmt: skip
    gaps = [100.0 * (s.final_eval_loss - b.final_eval_loss) / b.final_eval_loss for s, b in pairs]
    sd = _sd(gaps)
    mean = _mean(gaps)
    return {
        "gap_to_baseline_pct": mean,
        "gap_sd_pct": sd,
        "gap_range_pct": [min(gaps), max(gaps)],
        "gap_resolved": sd is not None and (min(gaps) > 0 or max(gaps) < 0) and abs(mean) > sd,
        "speedup_vs_baseline": tokens_per_s / _mean([b.tokens_per_s for b in base]),
    }


def _pairing(run: SeedResult | RunSummary) -> tuple[int, int]:
    """What a gap pairs seeds on: run.seed and the held-out split scored (run.seed's where none was recorded)."""
    return run.run_seed, run.run_seed if run.split_seed is None else run.split_seed


def write_results(results: dict[str, Any], out_dir: Path) -> None:
    """`results.json`, `results.md` (the table) and the plots of `dilocox plot` for the bench's runs (their curves
    from `OUT/runs/NAME`, the throughput bars from the table), into `out_dir`. A row kept from an earlier
    results.json, without its run directory, plots the eval-loss curve it stored and is absent from the other
    panels."""
    write_atomic(out_dir / "results.json", json.dumps(results, indent=2).encode())
    write_atomic(out_dir / "results.md", format_table(results).encode())
    rows = results["runs"]
    plot_runs([_curves(out_dir / "runs" / row["name"], row) for row in rows], out_dir, title=results["bench"])
    plot_throughput([row["label"] for row in rows], [row["tokens_per_s"] for row in rows], out_dir / "throughput.png",
                    title=results["bench"])  # fmt: skip
    if any(row.get("num_seeds", 1) > 1 for row in rows):
        plot_seed_spread(rows, out_dir / "loss_vs_tokens_seeds.png", title=results["bench"])
    if len(frontier_points(results)) > 1:
        plot_frontier([results], out_dir / FRONTIER_FILE, title=results["bench"])


def _curves(run_dir: Path, row: dict[str, Any]) -> RunCurves:
    """The run's metrics.jsonl when its directory is here, else the evaluations its row stored."""
    return (
        load_run(run_dir, row["label"])
        if (run_dir / METRICS_FILE).is_file()
        else RunCurves(row["label"], run_dir, row["curve"])
    )
