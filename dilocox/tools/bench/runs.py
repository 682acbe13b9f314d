"""One bench run: a real `dilocox train` in a subprocess, with its own ranks and run directory.

    summary = train_run(spec, run, out_dir / "runs" / run.name, out_dir / f"{run.name}.log", quick=False)

The bench reads a run's metrics.jsonl with the runtime's `dilocox.metrics.read_metrics` and its summary.json as
the runtime's `dilocox.metrics.RunSummary`.
"""

from __future__ import annotations

import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

from dilocox.config import load_config, to_dict
from dilocox.fileio import write_atomic
from dilocox.metrics import SUMMARY_FILE, RunSummary
from dilocox.tools.bench.spec import BenchRun, BenchSpec, run_overrides

PROCESS_FILE = "process_s.txt"
"""Seconds of the whole `dilocox train` process (start-up, data, training, evaluation, checkpoints), in a run dir."""


def train_command(spec: BenchSpec, run: BenchRun, run_dir: Path, quick: bool, extra: Sequence[str] = ()) -> list[str]:
    return [
        sys.executable, "-m", "dilocox", "train", *(["--config", spec.base] if spec.base else []),
        *run_overrides(spec, run, quick), *extra,
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


WHERE_AND_HOW = (("run", "out_dir"), ("run", "overwrite"), ("metrics", "progress"))
"""The settings of a bench run that say where it wrote and how it printed, not what it computed."""


def same_finished_run(spec: BenchSpec, run: BenchRun, run_dir: Path, *, quick: bool, extra: Sequence[str]) -> bool:
    """Whether `run_dir` holds a finished run (its summary.json) whose resolved config (its config.toml) is the one
    this run would train now, but for `WHERE_AND_HOW`: what `--resume` keeps instead of training it again."""
    if not has_summary(run_dir):
        return False
    with warnings.catch_warnings():  # a renamed key or a kind without its preset warns once, at training time
        warnings.simplefilter("ignore")
        try:
            done = to_dict(load_config(run_dir / "config.toml"))
        except (OSError, ValueError):  # no config.toml, or one this version cannot read: train it again
            return False
        wanted = to_dict(load_config(spec.base, [*run_overrides(spec, run, quick), *extra]))
    for section, key in WHERE_AND_HOW:
        done[section].pop(key, None)
        wanted[section].pop(key, None)
    return done == wanted


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
    resume: bool = False,
) -> list[RunSummary]:
    """`train_run` once per seed (`seed_run_dir`, `seed_overrides`); logs go to OUT/NAME.log, OUT/NAME.seedK.log.
    `resume`: a seed whose run directory already holds a finished run of the same settings (`same_finished_run`)
    is read back instead of trained again."""
    summaries = []
    for index in range(seeds):
        run_dir = seed_run_dir(runs_dir, run.name, index)
        log = out_dir / f"{run_dir.name}.log"
        seed_tag = f"{tag} seed {base_seed + index}:" if seeds > 1 else tag
        seed_extra = [*extra, *seed_overrides(base_seed, index)]
        if resume and same_finished_run(spec, run, run_dir, quick=quick, extra=seed_extra):
            print(f"{seed_tag} {run.name}: kept, {run_dir} holds a finished run of these settings", flush=True)
            summaries.append(RunSummary.read(run_dir))
            continue
        summaries.append(train_run(spec, run, run_dir, log, quick=quick, extra=seed_extra, tag=seed_tag))
    return summaries
