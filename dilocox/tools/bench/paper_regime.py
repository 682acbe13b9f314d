"""DiLoCoX's comparison in the paper's regime (docs/planner.md, "The paper regime"): convergence with the link
off, throughput on a link as slow relative to compute as the paper's, over the steady rounds of short timed runs.

    results = run_paper_regime(spec, spec.runs, Path("benchmarks/results/paper"), quick=False, timing_repeats=3)
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
from pathlib import Path
from typing import Any

from dilocox.config import load_config
from dilocox.fileio import write_atomic
from dilocox.metrics import RunSummary, read_metrics
from dilocox.net.link import parse_duration
from dilocox.tools.bench.planner import format_bandwidth, paper_regime_bandwidth, paper_regime_ratio
from dilocox.tools.bench.results import collect
from dilocox.tools.bench.runs import has_summary, train_run, train_seeds
from dilocox.tools.bench.spec import MIN_STEADY_STEPS, BenchRun, BenchSpec, run_overrides

NO_COMM_RUN = "no-communication"
"""The reference the paper regime adds: every cluster trains alone (one sync at the very end), link off."""
WINDOW_FILE = "window_inner_steps.txt"
"""In the no-communication run's timed directory: the H of the window it was timed on (without it, where no
outer-loop run was timed: its steps are 2H + 1)."""
LINK_OFF = ["--network.bandwidth=unlimited", "--network.latency=0"]
"""Overrides of the convergence runs: loss does not depend on the bandwidth, so they run without the link."""


def _is_per_step(kind: str) -> bool:
    """Strategies that talk over the slow link every step (their "round" is one step)."""
    return kind in ("allreduce", "cocktail")


def steady_rounds(inner_steps: int) -> int:
    """Whole rounds in the steady window of an outer-loop run: one, or as many as span `MIN_STEADY_STEPS`."""
    return max(1, math.ceil(MIN_STEADY_STEPS / inner_steps))


def window_steps(kind: str, inner_steps: int) -> int:
    """Steps of a timed run in the paper regime: enough for the steady rounds before the last step.

    Per-step strategies: 2 steps (AllReduce's take minutes each there). Outer-loop strategies: (R + 1) H + 1 with
    R = `steady_rounds(H)` (2H + 1 from H = 48 on), so that the window (H, (R + 1) H] holds R whole rounds and the
    waits for the syncs launched at their starts, while the first round (start-up, nothing to wait for) and the
    last step, which flushes the delayed sync and evaluates, stay outside it."""
    return 2 if _is_per_step(kind) else (steady_rounds(inner_steps) + 1) * inner_steps + 1


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


def timed_run_dir(out_dir: Path, name: str, repeat: int) -> Path:
    """The directory of timed run `repeat` of run `name` (0: `timed/NAME`, as before repeats; k: `timed/NAME.repK`)."""
    return out_dir / "timed" / (name if repeat == 0 else f"{name}.rep{repeat}")


def timed_log(out_dir: Path, name: str, repeat: int) -> Path:
    return out_dir / (f"{name}.timed.log" if repeat == 0 else f"{name}.timed.rep{repeat}.log")


def timed_repeats(out_dir: Path, name: str) -> list[Path]:
    """The finished timed runs of run `name`, in order (repeat 0, 1, ... up to the first missing one)."""
    found: list[Path] = []
    while has_summary(timed_run_dir(out_dir, name, len(found))):
        found.append(timed_run_dir(out_dir, name, len(found)))
    return found


def _drop_timed_runs(out_dir: Path, name: str) -> None:
    """Removes every timed run of `name` (and its log), so that a re-timing never mixes with an older one's repeats."""
    repeat = 0
    while timed_run_dir(out_dir, name, repeat).exists() or timed_log(out_dir, name, repeat).exists():
        shutil.rmtree(timed_run_dir(out_dir, name, repeat), ignore_errors=True)
        timed_log(out_dir, name, repeat).unlink(missing_ok=True)
        repeat += 1


def run_paper_regime(
    spec: BenchSpec,
    selected: list[BenchRun],
    out_dir: Path,
    *,
    quick: bool,
    seeds: int = 1,
    base_seed: int = 0,
    timing_repeats: int = 1,
    retime: bool = False,
    resume: bool = False,
) -> dict[str, Any]:
    """DiLoCoX's comparison in the paper's regime (docs/planner.md, "The paper regime"), in three steps; returns the
    results (`run_bench` writes them):

    1. Convergence, link off: every run for the whole token budget, plus `no-communication` (every cluster alone,
       one sync at the very end), the compute-only reference. Loss, bytes and curves come from these runs (loss
       does not depend on bandwidth: the delay is one round whatever the link; fit_link must be off).
    2. The bandwidth: `paper_regime_bandwidth` from the reference's measured compute time per step and the fp32
       gradient, so one AllReduce step waits on the link 357.5 times its compute, as in the paper.
    3. Throughput, link on at that bandwidth: every run again for `window_steps`, tokens/s over its steady window
       (`steady_tokens_per_s`), hidden communication from those runs; and the reference on the outer-loop runs'
       window (no sync inside it), the "no communication" throughput the others are divided by. With
       `timing_repeats` N every timed run goes N times, interleaved (reference, a, b, reference, a, b, ...), so that
       the machine's drift spreads over every row alike, and each row reports the median (`collect_paper_regime`).

    `retime` skips step 1 and keeps the earlier link: only the timed runs of `selected` (and the reference) run
    again, for the convergence runs on disk.
    """
    if timing_repeats < 1:
        raise ValueError(f"--timing-repeats {timing_repeats} must be >= 1")
    configs = {run.name: load_config(spec.base, run_overrides(spec, run, quick)) for run in selected}
    for name, cfg in configs.items():
        if cfg.sync.round.fit_link:
            raise ValueError(f"run {name}: sync.round.fit_link changes H with the link; the paper regime needs it off")
    steps = next(iter(configs.values())).train.steps
    reference = BenchRun(NO_COMM_RUN, ["--preset=diloco", f"--sync.inner_steps={steps}", "--checkpoint.interval=0"],
                         "no communication (each cluster alone)")  # fmt: skip
    earlier = out_dir / "results.json"
    partial = len(selected) < len(spec.runs)
    reuse = (partial or retime) and earlier.exists() and "regime" in json.loads(earlier.read_text())
    if retime:
        missing = [r.name for r in [reference, *selected] if not has_summary(out_dir / "runs" / r.name)]
        if not reuse:
            raise ValueError(f"--retime: {out_dir} has no results.json of an earlier paper-regime bench to re-time; "
                             "run the bench without --retime first")  # fmt: skip
        if missing:
            raise ValueError(
                f"--retime: {out_dir} has no convergence runs of {missing} in runs/ (run directories are not "
                "committed: re-time where they were trained, or run the bench without --retime)"
            )
    if reuse:
        _check_runs_to_read_back(out_dir, json.loads(earlier.read_text()), selected, reference, retime=retime)
    out_dir.mkdir(parents=True, exist_ok=True)
    # A partial re-run keeps the earlier bandwidth, so that its rows stay comparable with the rows it keeps.
    runs = [] if retime else selected if reuse else [reference, *selected]
    # The compute-only reference on the same window as the outer-loop runs: H steps after H steps, no sync between.
    outer = [cfg.sync.inner_steps for cfg in configs.values() if not _is_per_step(cfg.sync.kind)]
    timed_runs = [(reference, window_steps("diloco", outer[0]))] if outer else []
    timed_runs += [(run, window_steps(configs[run.name].sync.kind, configs[run.name].sync.inner_steps))
                   for run in selected]  # fmt: skip
    total = len(runs) + len(timed_runs) * timing_repeats
    for index, run in enumerate(runs, 1):  # every seed of the convergence runs; one timed run each (below)
        train_seeds(spec, run, out_dir / "runs", out_dir, quick=quick, seeds=seeds, base_seed=base_seed,
                    extra=LINK_OFF, tag=f"[{index}/{total}] link off:", resume=resume)  # fmt: skip
    ref_dir = out_dir / "runs" / NO_COMM_RUN
    ref = RunSummary.read(ref_dir)
    if reuse:
        regime = json.loads(earlier.read_text())["regime"]
        print(f"paper regime: keeping the earlier link of {regime['bandwidth']} (a partial re-run)", flush=True)
    else:
        compute_s = ref.tokens / ref.tokens_per_s / ref.steps  # one step of every cluster, no comm
        latency_s = parse_duration(next(iter(configs.values())).network.latency)
        grad_bytes = 4 * ref.num_params
        bandwidth = paper_regime_bandwidth(compute_s, grad_bytes, num_clusters=ref.num_clusters,
                                           latency_s=latency_s)  # fmt: skip
        regime = {
            "ratio": paper_regime_ratio(),
            "compute_s_per_step": compute_s,
            "grad_bytes": grad_bytes,
            "bandwidth_bytes_per_s": bandwidth,
            "bandwidth": format_bandwidth(bandwidth),
            "latency_s": latency_s,
            "no_communication_tokens_per_s": ref.tokens_per_s,
        }
        print(
            f"paper regime: {compute_s:.3f} s of compute per step, fp32 gradient {grad_bytes / 1e6:.2f} MB -> "
            f"{bandwidth * 8 / 1e6:.4g} Mbps (AllReduce waits {regime['ratio']:.1f}x its compute per step)",
            flush=True,
        )
    for run, _ in timed_runs:
        _drop_timed_runs(out_dir, run.name)
    order = [(repeat, run, window) for repeat in range(timing_repeats) for run, window in timed_runs]
    for index, (repeat, run, window) in enumerate(order, len(runs) + 1):
        extra = [
            f"--network.bandwidth={regime['bandwidth']}",
            f"--train.steps={window}",
            "--train.warmup_steps=0",
            "--eval.interval=0",
            "--eval.max_batches=1",
            "--checkpoint.interval=0",
            "--metrics.log_interval=1",
        ]
        if run is reference:  # its one sync at the very end of the window, even where that outlasts train.steps
            extra.append(f"--sync.inner_steps={window}")
        run_dir, log = timed_run_dir(out_dir, run.name, repeat), timed_log(out_dir, run.name, repeat)
        again = f" (timing {repeat + 1} of {timing_repeats})" if timing_repeats > 1 else ""
        train_run(spec, run, run_dir, log, quick=quick, extra=extra, tag=f"[{index}/{total}] paper link{again}:")
    if outer:  # the window the compute-only reference was just timed on (its own H is the whole run)
        for run_dir in timed_repeats(out_dir, NO_COMM_RUN):
            write_atomic(run_dir / WINDOW_FILE, f"{outer[0]}\n".encode())
    return collect_paper_regime(spec, out_dir, reference, regime, quick=quick)


def _check_runs_to_read_back(
    out_dir: Path, earlier: dict[str, Any], selected: list[BenchRun], reference: BenchRun, *, retime: bool
) -> None:
    """A partial re-run (`--only`, `--retime`) tabulates every row again from the run directories on disk: the
    convergence runs (`runs/NAME`) of every row and the reference, and the timed runs (`timed/NAME`) of the rows it
    does not time again. Refuse, before anything runs, where they are missing (a results.json from git, which keeps
    tables and plots only), rather than drop those rows."""
    trained = set() if retime else {run.name for run in selected}  # convergence runs this call makes
    timed = {run.name for run in selected} | {reference.name}  # timed runs this call makes
    rows = [row["name"] for row in earlier.get("runs", [])]
    names = list(dict.fromkeys([reference.name, *rows]))
    no_run = [name for name in names if name not in trained and not has_summary(out_dir / "runs" / name)]
    no_timed = [name for name in rows if name not in timed and not timed_repeats(out_dir, name)]
    missing = sorted(set(no_run) | set(no_timed), key=names.index)
    if missing:
        raise ValueError(
            f"{out_dir}: a partial re-run reads every other row back from its run directories, and {missing} have "
            "none here (runs/ and timed/ stay where a bench ran; git keeps only results.json, results.md and the "
            "plots): re-run where they were made, or run every row of the bench (without --only or --retime)"
        )


def collect_paper_regime(
    spec: BenchSpec, out_dir: Path, reference: BenchRun, regime: dict[str, Any], *, quick: bool
) -> dict[str, Any]:
    """The paper regime's results from the runs on disk: convergence rows from `runs/`, tokens/s and hidden
    communication over each timed run's steady window (`timed/`), and the link in `regime`."""
    ref = RunSummary.read(out_dir / "runs" / NO_COMM_RUN)
    timed: dict[str, dict] = {}
    for run in [reference, *spec.runs]:  # this call's timed runs and, after a partial re-run, the earlier ones
        if run_dirs := timed_repeats(out_dir, run.name):
            timed[run.name] = timed_figures(run_dirs, reference=run.name == NO_COMM_RUN)

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
    no_comm_tps = timed[NO_COMM_RUN]["steady_tokens_per_s"] if NO_COMM_RUN in timed else ref.tokens_per_s
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
        if t is not None:
            repeats = t["steady_tokens_per_s_repeats"]
            row["timed_tokens_per_s_repeats"] = repeats
            row["of_no_communication_range"] = [min(repeats) / no_comm_tps, max(repeats) / no_comm_tps]
    return results


def timed_figures(run_dirs: list[Path], *, reference: bool = False) -> dict[str, Any]:
    """One row's throughput from its timed runs (`timed_repeats`): the median over them of the tokens/s of each
    run's steady window, and of the share of link time hidden there; the per-run tokens/s as well.

    `reference`: the no-communication run, whose window is the first outer-loop run's (its `WINDOW_FILE`; without
    it, where no outer-loop run was timed, H = (steps - 1) // 2)."""
    tokens_per_s, hidden, wall_s, steps = [], [], [], []
    for run_dir in run_dirs:
        summary = RunSummary.read(run_dir)
        wall_s.append(summary.wall_s)
        steps.append(summary.steps)
        metrics = read_metrics(run_dir)
        kind, inner_steps = summary.sync_kind, summary.inner_steps
        if reference:  # no sync before the last step: timed on the first outer-loop run's window
            window_file = run_dir / WINDOW_FILE
            inner_steps = int(window_file.read_text()) if window_file.exists() else (summary.steps - 1) // 2
        tokens_per_s.append(steady_tokens_per_s(metrics, kind, inner_steps, summary.steps))
        hidden.append(steady_hidden_fraction(metrics, kind, inner_steps, summary.steps, summary.hidden_comm_fraction))
    known = [h for h in hidden if h is not None]
    return {
        "window_steps": steps[0],  # every timing of a row runs the same window
        "wall_s": statistics.median(wall_s),
        "steady_tokens_per_s": statistics.median(tokens_per_s),
        "steady_tokens_per_s_repeats": tokens_per_s,
        "steady_hidden_comm_fraction": statistics.median(known) if known else None,
    }
