"""One bench run: a real `dilocox train` in a subprocess, with its own ranks and run directory.

    summary = train_run(spec, run, out_dir / "runs" / run.name, out_dir / f"{run.name}.log", quick=False)

The bench reads a run's metrics.jsonl with the runtime's `dilocox.metrics.read_metrics` and its summary.json as
the runtime's `dilocox.metrics.RunSummary`.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from dilocox.fileio import write_atomic
from dilocox.metrics import SUMMARY_FILE, RunSummary
from dilocox.tools.bench.spec import BenchRun, BenchSpec, run_overrides

PROCESS_FILE = "process_s.txt"
"""Seconds of the whole `dilocox train` process (start-up, data, training, evaluation, checkpoints), in a run dir."""


def train_command(spec: BenchSpec, run: BenchRun, run_dir: Path, quick: bool, extra: Sequence[str] = ()) -> list[str]:
    return [
        sys.executable, "-m", "dilocox", "train", "--config", spec.base, *run_overrides(spec, run, quick), *extra,
        f"--run.out_dir={run_dir}", "--run.overwrite=true", "--metrics.progress=false",
    ]  # fmt: skip


def seed_run_dir(runs_dir: Path, name: str, index: int) -> Path:
    """The run directory of seed `index` (0 = the config's run.seed, k = run.seed + k) of run `name`."""
    return runs_dir / (name if index == 0 else f"{name}.seed{index}")


def seed_overrides(base_seed: int, index: int) -> list[str]:
    """The overrides of seed `index`: none for the config's own seed, `--run.seed=base + index` for the others."""
    return [] if index == 0 else [f"--run.seed={base_seed + index}"]


def finished_seeds(runs_dir: Path, name: str) -> list[int]:
    """The seed indices of run `name` that finished, in order (0, 1, ... up to the first missing one)."""
    found = []
    while has_summary(seed_run_dir(runs_dir, name, len(found))):
        found.append(len(found))
    return found


def has_summary(run_dir: Path) -> bool:
    """Whether the run in `run_dir` finished (a run writes its summary last)."""
    return (run_dir / SUMMARY_FILE).exists()


def train_run(
    spec: BenchSpec,
    run: BenchRun,
    run_dir: Path,
    log: Path,
    *,
    quick: bool,
    extra: Sequence[str] = (),
    tag: str = "",
) -> RunSummary:
    """One `dilocox train` subprocess; returns its summary (raises RuntimeError with the log's tail)."""
    command = train_command(spec, run, run_dir, quick, extra)
    print(f"{tag} {run.name}: dilocox train {' '.join(command[5:])}", flush=True)
    started = time.perf_counter()
    with open(log, "w") as f:
        status = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT).returncode
    if status != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise RuntimeError(f"bench run {run.name} failed (exit {status}); last lines of {log}:\n{tail}")
    write_atomic(run_dir / PROCESS_FILE, f"{time.perf_counter() - started:.1f}\n".encode())
    summary = RunSummary.read(run_dir)
    print(
        f"    eval loss {summary.final_eval_loss:.4f}, {summary.tokens_per_s:,.0f} tokens/s, "
        f"{summary.wan_bytes_total / 1e6:,.2f} MB on the slow link, {summary.wall_s:.1f} s",
        flush=True,
    )
    return summary


def train_seeds(
    spec: BenchSpec,
    run: BenchRun,
    runs_dir: Path,
    out_dir: Path,
    *,
    quick: bool,
    seeds: int,
    base_seed: int,
    extra: Sequence[str] = (),
    tag: str = "",
) -> list[RunSummary]:
    """`train_run` once per seed (`seed_run_dir`, `seed_overrides`); logs go to OUT/NAME.log, OUT/NAME.seedK.log."""
    summaries = []
    for index in range(seeds):
        run_dir = seed_run_dir(runs_dir, run.name, index)
        log = out_dir / f"{run_dir.name}.log"
        seed_tag = f"{tag} seed {base_seed + index}:" if seeds > 1 else tag
        summaries.append(
            train_run(
                spec, run, run_dir, log, quick=quick, extra=[*extra, *seed_overrides(base_seed, index)], tag=seed_tag
            )  # fmt: skip
        )
    return summaries
