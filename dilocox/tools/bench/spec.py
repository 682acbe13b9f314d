"""The bench file: an optional base training config, overrides shared by every run, and the runs (TOML).

A bench file looks like this (benchmarks/configs/ has the real ones) and is read with `load_bench`; without `base`
every run starts from what `dilocox train` runs with no --config (the default preset and the field defaults):

    [bench]
    name = "default"
    overrides = ["--train.steps=400"]
    [[runs]]
    name = "allreduce"
    overrides = ["--preset=allreduce"]

    spec = load_bench(Path("benchmarks/configs/default.toml"))

`[[workloads]]` tables (name, label, overrides), where a bench has them, run every run once per workload, each
workload's overrides after the bench's and before the run's (benchmarks/configs/workloads.toml).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from dilocox.config import parse_overrides, read_toml

MIN_STEADY_STEPS = 48
"""The paper regime: the fewest steps the steady window of an outer-loop run spans (whole rounds): one 12-step
round of top-k timed 99.1% and 92.5% of the no-communication throughput in two runs of one config on this shared
2-core machine."""

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
    "--eval.final_max_batches=4",
    "--checkpoint.interval=0",
    "--metrics.log_interval=5",
]
"""What `--quick` adds to every run: the debug flavor, few steps, a short final eval (tests and smoke checks)."""

REGIMES = ("as-configured", "paper")
"""How a bench runs (`BenchSpec.regime`, `--regime`)."""


@dataclass
class BenchRun:
    name: str
    overrides: list[str]
    label: str = ""


@dataclass
class BenchSpec:
    name: str
    base: str | None
    """The `dilocox train --config` file of every run; None: none (the default preset, `dilocox train`)."""
    overrides: list[str]
    runs: list[BenchRun]
    baseline: str = "allreduce"
    notes: str = ""
    source: Path = field(default_factory=Path)
    regime: str = "as-configured"
    """"as-configured" (every run on the config's link) or "paper" (see `run_paper_regime`)."""
    timing_repeats: int = 1
    """Paper regime: how many times each timed run goes (interleaved; rows report the median)."""
    workloads: list[BenchRun] = field(default_factory=list)
    """The settings every run goes on, one after the other (their overrides come after the bench's); none: one."""
    tuned_baseline: list[str] = field(default_factory=list)
    """Runs of the baseline at other settings (e.g. inner learning rates): the table adds a column of gaps to the
    best of them, the one with the lowest mean eval loss among those with the most seeds, so every row is also
    compared with the baseline at its best rather than at one setting."""

    def on_workload(self, workload: BenchRun) -> BenchSpec:
        """The bench on one of its workloads: the workload's overrides after the bench's, named bench/workload."""
        overrides = [*self.overrides, *workload.overrides]
        return replace(self, name=f"{self.name}/{workload.name}", overrides=overrides, workloads=[])


def load_bench(path: Path) -> BenchSpec:
    """Read and check a bench file; errors name the file and the key."""
    data = read_toml(path, "bench config", hint=" (see benchmarks/configs/)")
    bench = data.get("bench")
    if not isinstance(bench, dict):
        raise ValueError(f"bench config {path}: needs a [bench] table (name, overrides, baseline; base optional)")
    keys = {"name", "base", "overrides", "baseline", "notes", "regime", "timing_repeats", "tuned_baseline"}
    unknown = (set(bench) - keys) | (set(data) - {"bench", "runs", "workloads"})
    if unknown:
        raise ValueError(f"bench config {path}: unknown keys {sorted(unknown)}")
    runs = _named_tables(path, data, "runs")
    if not runs:
        raise ValueError(f"bench config {path}: no [[runs]]")
    names = [r.name for r in runs]
    workloads = _named_tables(path, data, "workloads")
    base = Path(bench["base"]) if "base" in bench else None
    if base is not None and not base.is_absolute():
        base = (path.parent / base) if (path.parent / base).is_file() else base
    spec = BenchSpec(
        name=bench.get("name", path.stem),
        base=None if base is None else str(base),
        overrides=list(bench.get("overrides", [])),
        runs=runs,
        baseline=bench.get("baseline", "allreduce"),
        notes=bench.get("notes", ""),
        source=path,
        regime=bench.get("regime", "as-configured"),
        timing_repeats=bench.get("timing_repeats", 1),
        tuned_baseline=bench.get("tuned_baseline", []),
        workloads=workloads,
    )
    if not isinstance(spec.timing_repeats, int) or isinstance(spec.timing_repeats, bool) or spec.timing_repeats < 1:
        raise ValueError(f"bench config {path}: timing_repeats = {spec.timing_repeats!r} must be an integer >= 1")
    if spec.regime not in REGIMES:
        raise ValueError(f"bench config {path}: regime = {spec.regime!r} is not one of {list(REGIMES)}")
    if spec.baseline not in names:
        raise ValueError(f"bench config {path}: baseline {spec.baseline!r} is not one of the runs {names}")
    tuned = spec.tuned_baseline
    if not isinstance(tuned, list) or not all(isinstance(name, str) for name in tuned):
        raise ValueError(f"bench config {path}: tuned_baseline = {tuned!r} must be a list of run names")
    if missing := [name for name in tuned if name not in names]:
        raise ValueError(f"bench config {path}: tuned_baseline names {missing}, which are not runs of it: {names}")
    if tuned and spec.regime != "as-configured":
        raise ValueError(
            f"bench config {path}: tuned_baseline is a column of the link-off table; the {spec.regime} regime's table "
            "has none: compare the settings in a link-off bench (e.g. benchmarks/configs/paper_decomposition.toml)"
        )
    if workloads and spec.regime != "as-configured":
        raise ValueError(f"bench config {path}: [[workloads]] run link off, as configured; the {spec.regime} regime "
                         "times one setting: give it a bench of its own")  # fmt: skip
    return spec


def _named_tables(path: Path, data: dict, key: str) -> list[BenchRun]:
    """The `[[runs]]` or `[[workloads]]` of a bench file: each a name, its overrides and a label; names unique."""
    tables = []
    for index, table in enumerate(data.get(key, [])):
        if "name" not in table or set(table) - {"name", "overrides", "label"}:
            raise ValueError(f"bench config {path}: {key}[{index}] needs name (and only overrides, label)")
        tables.append(BenchRun(table["name"], list(table.get("overrides", [])), table.get("label", "")))
    names = [table.name for table in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"bench config {path}: {key} names repeat: {names}")
    return tables


QUICK_OVERLAP_STEPS = 2
"""`--quick`'s `sync.overlap_steps` for a run that sets one: it must stay below the quick H of 5 (1 with fragments)."""


def run_overrides(spec: BenchSpec, run: BenchRun, quick: bool) -> list[str]:
    """The `dilocox train` overrides of one run: the bench's, then `--quick`'s, then the run's own. Under `--quick`
    a run's fragments become 2 (the quick H of 5 has room for no more), and a nonzero `sync.overlap_steps` it sets
    becomes `QUICK_OVERLAP_STEPS`, or 1 with fragments (below their shortest round, 2 steps); an auto one follows."""
    flags = [*spec.overrides, *(QUICK_OVERRIDES if quick else []), *run.overrides]
    if not quick:
        return flags
    given = dict(parse_overrides(flags))  # each option's last value
    fragments = given.get("sync.fragments", "1") != "1"
    if fragments:
        flags.append("--sync.fragments=2")
    if given.get("sync.overlap_steps", "0") not in ("0", "auto"):
        flags.append(f"--sync.overlap_steps={1 if fragments else QUICK_OVERLAP_STEPS}")
    return flags
