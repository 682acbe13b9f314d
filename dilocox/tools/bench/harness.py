"""`dilocox bench`: run strategies on the same model, data, topology, seeds, tokens and link; tabulate and plot.

A bench file (`spec.py`) names a base training config, overrides shared by every run, and the runs. Each run is a
real `dilocox train` in a subprocess (`runs.py`; its own ranks, its own run directory under `OUT/runs/`); the
harness then writes `OUT/results.json`, `OUT/results.md` and plots (eval loss vs tokens, eval loss vs wall time,
throughput; `results.py`). `--quick` shrinks every run to the debug flavor and a few steps, for tests and smoke
checks; the paper regime (`paper_regime.py`) replaces the one run per strategy by convergence and timed runs.

    results = run_bench(Path("benchmarks/configs/default.toml"))   # into runs/bench/default/

Output goes to `default_out_dir` (under `runs/`, which git ignores) unless `out_dir` names a place. What the
repository keeps of a bench under `benchmarks/results/NAME/` is its table (results.json, results.md) and plots; its
run directories (`runs/`, `timed/`) and logs stay where they were made (`.gitignore`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dilocox.config import load_config
from dilocox.fileio import write_atomic
from dilocox.tools.bench.paper_regime import run_paper_regime
from dilocox.tools.bench.results import collect, kept_rows, write_results
from dilocox.tools.bench.runs import has_summary, train_seeds
from dilocox.tools.bench.spec import REGIMES, BenchRun, BenchSpec, load_bench
from dilocox.tools.bench.table import format_table, format_workloads_table

BENCH_OUT = Path("runs") / "bench"
"""Where a bench writes by default: a folder per bench under the ignored `runs/`."""


def default_out_dir(name: str, *, regime: str | None, quick: bool) -> Path:
    """`runs/bench/NAME`, with `-paper` for the paper regime of a bench not named so and `-quick` under --quick."""
    suffix = ("-paper" if regime == "paper" and not name.endswith("paper") else "") + ("-quick" * quick)
    return BENCH_OUT / (name + suffix)


def run_bench(
    path: Path,
    *,
    out_dir: Path | None = None,
    quick: bool = False,
    only: list[str] | None = None,
    regime: str | None = None,
    seeds: int = 1,
    timing_repeats: int | None = None,
    retime: bool = False,
    resume: bool = False,
) -> dict[str, Any]:
    """Run every run of the bench file (or those named in `only`), then write the table, JSON and plots.

    `regime` overrides the file's: "paper" runs `run_paper_regime` instead of one run per strategy. `seeds`: each
    run (each convergence run in the paper regime) with run.seed, run.seed + 1, ...; rows report the mean and the
    spread over seeds, and gaps paired seed by seed (`results.compare`). Paper regime only: `timing_repeats` (default
    the bench file's `timing_repeats`, 1 under `quick`) times each timed run that many times, and `retime` re-runs
    only the timed runs, for the convergence runs on disk (`run_paper_regime`). `resume` keeps each seed of a
    run (a convergence run in the paper regime; timed runs always run again) whose run directory holds a finished run
    of the same settings (`runs.same_finished_run`)."""
    if seeds < 1:
        raise ValueError(f"--seeds {seeds} must be >= 1")
    if timing_repeats is not None and timing_repeats < 1:
        raise ValueError(f"--timing-repeats {timing_repeats} must be >= 1")
    spec = load_bench(path)
    if regime is not None:
        if regime not in REGIMES:
            raise ValueError(f"--regime {regime!r} is not one of {list(REGIMES)}")
        spec.regime = regime
    if spec.regime != "paper" and (retime or timing_repeats is not None):
        raise ValueError("--retime and --timing-repeats are for the paper regime (--regime paper); this bench times "
                         "every run once, on its own link")  # fmt: skip
    out_dir = out_dir or default_out_dir(spec.name, regime=spec.regime, quick=quick)
    selected = [r for r in spec.runs if not only or r.name in only]
    if only and len(selected) != len(only):
        raise ValueError(f"--only {only}: unknown run names; the bench has {[r.name for r in spec.runs]}")
    if not spec.workloads:
        return _run_setting(spec, selected, out_dir, quick=quick, seeds=seeds, timing_repeats=timing_repeats,
                            retime=retime, resume=resume)  # fmt: skip
    per_workload = []
    for index, workload in enumerate(spec.workloads, 1):
        print(f"workload {index}/{len(spec.workloads)}: {workload.name}", flush=True)
        one = spec.on_workload(workload)
        results = _run_setting(one, selected, out_dir / workload.name, quick=quick, seeds=seeds,
                               timing_repeats=timing_repeats, retime=retime, resume=resume)  # fmt: skip
        per_workload.append({"name": workload.name, "label": workload.label or workload.name, "results": results})
    combined = {"bench": spec.name, "source": str(spec.source), "baseline": spec.baseline, "quick": quick,
                "workloads": per_workload}  # fmt: skip
    table = format_workloads_table(combined)
    write_atomic(out_dir / "results.json", json.dumps(combined, indent=2).encode())
    write_atomic(out_dir / "results.md", table.encode())
    print(table)
    return combined


def _run_setting(
    spec: BenchSpec,
    selected: list[BenchRun],
    out_dir: Path,
    *,
    quick: bool,
    seeds: int,
    timing_repeats: int | None,
    retime: bool,
    resume: bool,
) -> dict[str, Any]:
    """The runs of `selected` on the one setting of `spec`, into `out_dir`: its table, JSON and plots."""
    base_seed = load_config(spec.base, spec.overrides).run.seed
    if spec.regime == "paper":  # makes out_dir itself, after checking what --retime needs from it
        repeats = timing_repeats if timing_repeats is not None else 1 if quick else spec.timing_repeats
        results = run_paper_regime(spec, selected, out_dir, quick=quick, seeds=seeds, base_seed=base_seed,
                                   timing_repeats=repeats, retime=retime, resume=resume)  # fmt: skip
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        for index, run in enumerate(selected, 1):
            train_seeds(spec, run, out_dir / "runs", out_dir, quick=quick, seeds=seeds, base_seed=base_seed,
                        tag=f"[{index}/{len(selected)}]", resume=resume)  # fmt: skip
        on_disk = [r.name for r in spec.runs if has_summary(out_dir / "runs" / r.name)]
        results = collect(spec, out_dir, on_disk, kept_rows(spec, out_dir, quick=quick, exclude=on_disk))
        results["quick"] = quick
    write_results(results, out_dir)
    print(format_table(results))
    return results
