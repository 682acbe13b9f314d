"""`dilocox bench`: the bench file, the derived columns, the tables, the paper regime's windows, the exit codes."""

import dataclasses
import json
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from dilocox.config import load_config
from dilocox.metrics import METRICS_FILE, RunSummary
from dilocox.tools.bench.bench_cli import main as bench_main
from dilocox.tools.bench.paper_regime import (
    WINDOW_FILE,
    steady_hidden_fraction,
    steady_tokens_per_s,
    timed_figures,
    timed_repeats,
    timed_run_dir,
    window_steps,
)
from dilocox.tools.bench.results import collect, compare, kept_rows, train_loss_tail, write_results
from dilocox.tools.bench.spec import load_bench, run_overrides
from dilocox.tools.bench.table import format_table, format_workloads_table

REPO = Path(__file__).resolve().parents[2]


def summary(loss, tps, wan, equiv, hidden=None, tokens=1000) -> RunSummary:
    return RunSummary(
        final_eval_loss=loss, initial_eval_loss=7.0, tokens=tokens, wall_s=10.0, tokens_per_s=tps, eval_s=0.5,
        wan_bytes_total=wan, allreduce_equiv_bytes=equiv, link_busy_s=1.0, exposed_comm_s=0.1,
        hidden_comm_fraction=hidden, steps=10, outer_steps=1, sync_kind="diloco", sync_delay=0, merge="keep_local",
        inner_steps=10, final_inner_steps=10, flavor="tiny", num_params=5, rank_state_bytes=[], num_clusters=2,
        dp_degree=1, pp_degree=1, bandwidth="1Gbps", latency="10ms", checkpoint=None, run_dir="r",
    )  # fmt: skip


def test_compare_against_the_baseline():
    base = summary(4.0, 100.0, 8000, 8000)
    row = compare(summary(4.1, 250.0, 80, 8000, hidden=0.95), base)
    assert row["gap_to_baseline_pct"] == pytest.approx(2.5)
    assert row["speedup_vs_baseline"] == pytest.approx(2.5)
    assert row["compression_vs_allreduce"] == pytest.approx(100)
    assert row["wan_bytes_per_token"] == pytest.approx(0.08)
    assert compare(base, base)["gap_to_baseline_pct"] == 0
    assert compare(base, None)["speedup_vs_baseline"] is None


def test_table_has_a_row_per_run_with_the_columns():
    base = summary(4.0, 100.0, 8000, 8000)
    runs = []
    for name, s in (("allreduce", base), ("dilocox", summary(4.1, 250.0, 80, 8000, hidden=0.95))):
        runs.append({"name": name, "label": name, "summary": dataclasses.asdict(s), **compare(s, base)})
    table = format_table(
        {
            "bench": "t",
            "source": "x.toml",
            "date": "2026-11-21",
            "baseline": "allreduce",
            "base_config": "c.toml",
            "common_overrides": [],
            "runs": runs,
        }
    )
    lines = table.splitlines()
    assert lines[0].startswith("| run | eval loss | gap to allreduce | clusters' training loss, gap | tokens/s |")
    assert lines[2] == "| allreduce | 4.0000 | 0.00% | - | 100 | 1.00x | 8.0 | 1/1 | - | 10.0 |"
    assert lines[3] == "| dilocox | 4.1000 | +2.50% | - | 250 | 2.50x | 0.1 | 1/100 | 95% | 10.0 |"
    assert "tiny (5 params), 2 clusters" in table


def test_bench_file_errors(tmp_path):
    path = tmp_path / "b.toml"
    path.write_text("[bench]\nbase = 'x.toml'\n")
    with pytest.raises(ValueError, match="no \\[\\[runs\\]\\]"):
        load_bench(path)
    path.write_text("[bench]\nbase = 'x.toml'\nbaseline = 'ar'\n[[runs]]\nname = 'diloco'\n")
    with pytest.raises(ValueError, match="baseline 'ar' is not one of the runs"):
        load_bench(path)
    path.write_text("[bench]\nbase = 'x.toml'\ncolour = 1\n[[runs]]\nname = 'a'\n")
    with pytest.raises(ValueError, match="unknown keys"):
        load_bench(path)
    with pytest.raises(ValueError, match="no such file"):
        load_bench(tmp_path / "missing.toml")
    for bad in ("0", "2.5", "true"):
        path.write_text(f"[bench]\nbase = 'x.toml'\ntiming_repeats = {bad}\n[[runs]]\nname = 'allreduce'\n")
        with pytest.raises(ValueError, match="timing_repeats = .* must be an integer >= 1"):
            load_bench(path)


def test_paper_regime_windows_and_steady_throughput():
    assert window_steps("allreduce", 50) == 2 and window_steps("cocktail", 50) == 2
    assert window_steps("dilocox", 50) == 101  # the round (50, 100] and the flushing last step
    assert window_steps("dilocox", 48) == 97 and window_steps("diloco", 49) == 99  # one round spans 48 steps
    assert window_steps("dilocox", 12) == 61  # the 4 rounds (12, 60] span 48 steps; then the flushing last step
    assert window_steps("dilocox", 47) == 142  # 2 rounds: (47, 141]
    # outer loop, H = 2, 5 steps: the steady window is steps (2, 4]: 2 steps x 100 tokens in 7.0 - 3.0 s
    records = [{"step": s, "tokens": 100 * s, "elapsed_s": t} for s, t in ((1, 1.0), (2, 3.0), (3, 4.0), (4, 7.0),
                                                                          (5, 30.0))]  # fmt: skip
    assert steady_tokens_per_s(records, "diloco", 2, 5) == pytest.approx(200 / 4.0)
    # per step, 2 steps: from the start to step 1 (the second step flushes nothing but is left out alike)
    assert steady_tokens_per_s(records[:2], "allreduce", 50, 2) == pytest.approx(100 / 1.0)
    with pytest.raises(RuntimeError, match="log every step"):
        steady_tokens_per_s(records[::2], "diloco", 2, 5)
    # hidden: the syncs waited for inside the window (2, 4]; the flush at step 5 is outside it
    syncs = [{"step": 2, "round_link_s": 8.0, "round_exposed_s": 8.0}, {"step": 4, "round_link_s": 4.0,
             "round_exposed_s": 1.0}, {"step": 5, "round_link_s": 4.0, "round_exposed_s": 4.0}]  # fmt: skip
    assert steady_hidden_fraction(syncs, "dilocox", 2, 5, 0.2) == pytest.approx(0.75)
    assert steady_hidden_fraction(records[:2], "allreduce", 50, 2, 0.0) == 0.0  # no per-sync log: the whole run


def write_timed_run(run_dir: Path, elapsed: list[float], exposed: float, *, steps: int = 5, inner_steps: int = 2):
    """A timed run of H = 2 and 5 steps as `dilocox train` leaves it: 100 tokens a step, step k ends at elapsed[k-1],
    one sync of 4 s of link waited for at step 4 (inside the window (2, 4]), `exposed` of it exposed."""
    run_dir.mkdir(parents=True)
    dataclasses.replace(summary(4.0, 1.0, 80, 8000), steps=steps, inner_steps=inner_steps, sync_kind="dilocox").write(
        run_dir
    )
    records = [{"step": k, "tokens": 100 * k, "elapsed_s": t} for k, t in enumerate(elapsed, 1)]
    records[3].update(round_link_s=4.0, round_exposed_s=exposed)
    (run_dir / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))


def test_timed_repeats_report_the_median_and_every_run(tmp_path):
    # three timed runs of one row: 200 tokens over the window (2, 4] in 4, 2 and 5 s; 1, 0 and 2 s of 4 exposed
    for repeat, (window_s, exposed) in enumerate(((4.0, 1.0), (2.0, 0.0), (5.0, 2.0))):
        write_timed_run(timed_run_dir(tmp_path, "dilocox", repeat), [1.0, 3.0, 4.0, 3.0 + window_s, 30.0], exposed)
    write_timed_run(timed_run_dir(tmp_path, "dilocox", 4), [1.0, 3.0, 4.0, 5.0, 6.0], 0.0)  # after a gap: not read
    dirs = timed_repeats(tmp_path, "dilocox")
    assert [d.name for d in dirs] == ["dilocox", "dilocox.rep1", "dilocox.rep2"]
    figures = timed_figures(dirs)
    assert figures["steady_tokens_per_s_repeats"] == pytest.approx([50.0, 100.0, 40.0])
    assert figures["steady_tokens_per_s"] == pytest.approx(50.0)  # the median, not the mean (63.3)
    assert figures["steady_hidden_comm_fraction"] == pytest.approx(0.75)  # median of 0.75, 1.0, 0.5
    assert timed_figures(dirs[:2])["steady_tokens_per_s"] == pytest.approx(75.0)  # an even count: the middle two
    # the no-communication reference is timed on the outer-loop runs' window, which its WINDOW_FILE names
    write_timed_run(timed_run_dir(tmp_path, "no-communication", 0), [1.0, 2.0, 3.0, 4.0, 5.0], 0.0, inner_steps=5)
    (timed_run_dir(tmp_path, "no-communication", 0) / WINDOW_FILE).write_text("3\n")
    reference = timed_figures(timed_repeats(tmp_path, "no-communication"), reference=True)
    assert reference["steady_tokens_per_s"] == pytest.approx(100.0)  # steps (3, 4]: 100 tokens in 1 s


def test_paper_table_names_where_each_number_comes_from():
    base = summary(4.0, 100.0, 8000, 8000)
    fast = summary(4.1, 250.0, 80, 8000, hidden=0.95)
    runs = []
    for name, s, tps, nocomm in (("no-communication", base, 1000.0, 1.0), ("allreduce", base, 2.5, 0.0025),
                                  ("dilocox", fast, 980.0, 0.98)):  # fmt: skip
        row = {"name": name, "label": name, "summary": dataclasses.asdict(s), **compare(s, base)}
        row.update(tokens_per_s=tps, speedup_vs_baseline=tps / 2.5, of_no_communication=nocomm)
        runs.append(row)
    regime = {"ratio": 357.46, "compute_s_per_step": 0.3, "grad_bytes": 5_250_000, "bandwidth_bytes_per_s": 48_958.0,
              "latency_s": 0.01}  # fmt: skip
    table = format_table({"bench": "paper", "source": "p.toml", "date": "2026-11-21", "baseline": "allreduce",
                          "runs": runs, "regime": regime})  # fmt: skip
    lines = table.splitlines()
    assert lines[0].startswith("| run | eval loss (link off) | gap to allreduce | tokens/s (paper link) |")
    assert lines[3] == "| allreduce | 4.0000 | 0.00% | 2.5 | 1.0x | 0.2% | 8.0 | 1/1 | - |"
    assert lines[4] == "| dilocox | 4.1000 | +2.50% | 980.0 | 392.0x | 98.0% | 0.1 | 1/100 | 95% |"
    assert "0.3917 Mbps per cluster uplink, 10 ms" in table
    assert "357.5 x the measured compute time of a step (0.300 s" in table
    assert "with the link off" in table and "timed runs on that link" in table
    assert "median" not in table  # one timed run per row
    runs[2].update(timed_tokens_per_s_repeats=[960.0, 980.0, 1010.0], of_no_communication_range=[0.96, 1.01])
    runs[1].update(timed_tokens_per_s_repeats=[2.5])
    runs[0].update(timed_tokens_per_s_repeats=[990.0, 1000.0, 1020.0], of_no_communication_range=[0.99, 1.02])
    table = format_table({"bench": "paper", "source": "p.toml", "date": "2026-11-21", "baseline": "allreduce",
                          "runs": runs, "regime": regime})  # fmt: skip
    assert (
        table.splitlines()[4]
        == "| dilocox | 4.1000 | +2.50% | 980.0 | 392.0x | 98.0% (96.0-101.0) | 0.1 | 1/100 | 95% |"
    )
    assert table.splitlines()[3].endswith("| 0.2% | 8.0 | 1/1 | - |")  # one timed run: no range
    assert "the median over 3 timed runs of each row (allreduce: 1), interleaved" in table


def test_collect_reads_what_the_runtime_wrote(tmp_path):
    # A run directory as `dilocox train` leaves it: summary.json by the runtime's writer, metrics.jsonl, process_s.
    run_dir = tmp_path / "runs" / "allreduce"
    run_dir.mkdir(parents=True)
    summary(4.0, 100.0, 8000, 8000).write(run_dir)
    records = [
        {"step": 5, "tokens": 500, "elapsed_s": 1.0, "eval_loss": None},
        {"step": 10, "tokens": 1000, "elapsed_s": 2.0, "eval_loss": 4.0},
    ]
    (run_dir / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "process_s.txt").write_text("12.5\n")
    path = tmp_path / "b.toml"
    path.write_text("[bench]\nbase = 'x.toml'\n[[runs]]\nname = 'allreduce'\nlabel = 'AllReduce'\n")
    results = collect(load_bench(path), tmp_path, ["allreduce"])
    (row,) = results["runs"]
    assert row["label"] == "AllReduce" and RunSummary(**row["summary"]) == summary(4.0, 100.0, 8000, 8000)
    assert row["curve"] == [{"tokens": 1000, "elapsed_s": 2.0, "eval_loss": 4.0}]  # only the evaluated steps
    assert row["process_s"] == 12.5
    assert row["gap_to_baseline_pct"] == 0 and row["speedup_vs_baseline"] == 1.0


def test_cli_help_exits_0_and_its_example_bench_file_is_one(capsys, tmp_path):
    assert bench_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: dilocox bench" in out
    example = out.split("a bench file (more in benchmarks/configs/):")[1].split("\n[bench] may also")[0]
    path = tmp_path / "mine.toml"
    path.write_text(textwrap.dedent(example).replace("../../configs/debug.toml", str(REPO / "configs/debug.toml")))
    spec = load_bench(path)
    assert [run.name for run in spec.runs] == ["allreduce", "allreduce-lr4e-3", "dilocox"]
    assert spec.baseline == "allreduce" and spec.tuned_baseline == ["allreduce", "allreduce-lr4e-3"]
    for run in spec.runs:
        load_config(spec.base, run_overrides(spec, run, False)).validate()


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--nonsense"], "unrecognized arguments: --nonsense"),
        (["--regime", "fast"], "--regime"),
        (["missing.toml"], "no such file"),
        ([str(REPO / "benchmarks/configs/default.toml"), "--retime"], "are for the paper regime"),
        ([str(REPO / "benchmarks/configs/paper.toml"), "--timing-repeats", "0"], "--timing-repeats 0 must be >= 1"),
        ([str(REPO / "benchmarks/configs/paper.toml"), "--retime", "--out", "/nonexistent/x"], "no results.json"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(capsys, argv, named):
    assert bench_main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("dilocox: error: ") and named in captured.err and captured.err.count("\n") == 1


def seeded(loss, seed, tps=100.0) -> RunSummary:
    return dataclasses.replace(summary(loss, tps, 80, 8000), run_seed=seed)


def write_seeded_runs(runs: Path, losses: dict[str, list[float]]) -> None:
    """Run directories as `dilocox bench --seeds N` leaves them: NAME, NAME.seed1, ..., one evaluation each."""
    for name, by_seed in losses.items():
        for seed, loss in enumerate(by_seed):
            run_dir = runs / (name if seed == 0 else f"{name}.seed{seed}")
            run_dir.mkdir(parents=True)
            seeded(loss, seed).write(run_dir)
            (run_dir / METRICS_FILE).write_text(json.dumps({"step": 10, "tokens": 1000, "elapsed_s": 1.0,
                                                            "eval_loss": loss}) + "\n")  # fmt: skip


def test_retime_without_an_earlier_bench_creates_nothing(tmp_path, capsys):
    out = tmp_path / "never-benched"
    assert bench_main([str(REPO / "benchmarks/configs/paper.toml"), "--retime", "--out", str(out)]) == 2
    assert "no results.json" in capsys.readouterr().err and not out.exists()


def test_seeds_give_means_spreads_and_paired_gaps():
    base = [seeded(4.0, 0), seeded(4.2, 1), seeded(3.8, 2)]
    # +1%, +2%, +3% against the baseline's own seeds: resolved although the losses spread by 5%
    row = compare([seeded(4.04, 0), seeded(4.284, 1), seeded(3.914, 2)], base)
    assert row["num_seeds"] == 3
    assert row["final_eval_loss"] == pytest.approx((4.04 + 4.284 + 3.914) / 3)
    assert row["final_eval_loss_sd"] == pytest.approx(0.1881, abs=1e-4)
    assert row["gap_to_baseline_pct"] == pytest.approx(2.0)
    assert row["gap_sd_pct"] == pytest.approx(1.0)
    assert row["gap_range_pct"] == pytest.approx([1.0, 3.0])
    assert row["gap_resolved"]
    # a gap that changes sign across seeds is not resolved, whatever its mean
    mixed = compare([seeded(4.2, 0), seeded(4.158, 1), seeded(3.8, 2)], base)
    assert mixed["gap_range_pct"][0] < 0 < mixed["gap_range_pct"][1] and not mixed["gap_resolved"]
    # pairs by run.seed, not by position; one seed never resolves
    assert compare([seeded(4.04, 0)], base)["gap_to_baseline_pct"] == pytest.approx(1.0)
    assert not compare([seeded(4.04, 0)], base)["gap_resolved"]
    assert compare([seeded(4.284, 1)], base)["gap_to_baseline_pct"] == pytest.approx(2.0)
    # and on the held-out split scored: seed 1 on seed 0's split (data.split_seed = 0) does not pair with a seed 1
    # that scored its own split (nor, without a pair, with a first seed on another split), and pairs with one scored
    # on split 0 (seed 0 scores split 0 either way)
    on_split0 = [dataclasses.replace(seeded(4.284, 1), split_seed=0)]
    assert compare(on_split0, base[1:])["gap_to_baseline_pct"] is None
    assert compare(on_split0, base)["gap_to_baseline_pct"] == pytest.approx(7.1)  # seed 0 of the baseline: split 0
    base_split0 = [dataclasses.replace(seeded(4.0, 0), split_seed=0), dataclasses.replace(seeded(4.2, 1), split_seed=0)]
    assert compare(on_split0, base_split0)["gap_to_baseline_pct"] == pytest.approx(2.0)
    assert compare([seeded(4.04, 0)], base_split0)["gap_to_baseline_pct"] == pytest.approx(1.0)


def test_collect_reads_every_seed_and_the_table_shows_the_spread(tmp_path):
    runs = tmp_path / "runs"
    write_seeded_runs(runs, {"allreduce": [4.0, 4.2], "dilocox": [4.4, 4.41]})
    path = tmp_path / "b.toml"
    path.write_text("[bench]\nbase = 'x.toml'\n[[runs]]\nname = 'allreduce'\n[[runs]]\nname = 'dilocox'\n")
    results = collect(load_bench(path), tmp_path, ["allreduce", "dilocox"])
    row = results["runs"][1]
    assert [s["run_seed"] for s in row["seeds"]] == [0, 1]
    assert [s["curve"][0]["eval_loss"] for s in row["seeds"]] == [4.4, 4.41]
    assert row["gap_to_baseline_pct"] == pytest.approx((10.0 + 5.0) / 2)
    table = format_table({**results, "date": "d"})
    assert "4.4050 ± 0.0071" in table and "+7.50 ± 3.54%" in table and "over 2 seeds" in table
    assert "within noise" not in table.split("dilocox")[1].splitlines()[0]  # both seeds agree, gap > sd


@pytest.mark.parametrize("path", sorted((REPO / "benchmarks" / "configs").glob("*.toml")), ids=lambda p: p.name)
@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
def test_every_run_of_every_shipped_bench_file_is_a_valid_config(path, quick):
    """What the e2e bench test no longer runs strategy by strategy: each run's `dilocox train` config validates."""
    spec = load_bench(path)
    assert spec.runs, f"{path.name} has no runs"
    for one in [spec.on_workload(workload) for workload in spec.workloads] or [spec]:
        for run in one.runs:
            cfg = load_config(one.base, run_overrides(one, run, quick))
            try:
                cfg.validate()
            except ValueError as exc:
                raise AssertionError(f"{path.name} ({one.name}) run {run.name}: {exc}") from None


def test_quick_keeps_a_runs_overlap_below_its_shortest_round(tmp_path):
    """`--quick` trains H = 5: a run's overlap becomes 2, or 1 over its fragments, cut to 2 (rounds of 2, 3 steps)."""
    path = tmp_path / "b.toml"
    rows = {"blocking": [], "streamed": ["--sync.overlap_steps=15"], "auto": ["--sync.overlap_steps=auto"],
            "fragments": ["--sync.fragments=4", "--sync.overlap_steps=4"], "one": ["--sync.fragments=1"]}  # fmt: skip
    bench = "[bench]\nname = 'q'\noverrides = ['--preset=paper', '--sync.sync_delay=0']\nbaseline = 'blocking'\n"
    path.write_text(bench + "".join(f"[[runs]]\nname = '{n}'\noverrides = {o!r}\n" for n, o in rows.items()))
    spec = load_bench(path)
    got = {}
    for run in spec.runs:
        cfg = load_config(spec.base, run_overrides(spec, run, True))
        cfg.validate()
        got[run.name] = (cfg.sync.fragments, cfg.sync.overlap_steps)
    assert run_overrides(spec, spec.runs[3], False)[-2:] == ["--sync.fragments=4", "--sync.overlap_steps=4"]
    assert got["streamed"][1] == 2 and got["fragments"] == (2, 1) and got["one"][0] == 1 and got["blocking"][1] == 0


def test_a_rerun_keeps_the_rows_of_runs_without_a_run_directory(tmp_path, capsys):
    """`--only` on a fresh checkout: results.json is committed, runs/ is not. The other rows stay, paired again with
    the baseline's stored seeds; a row whose run changed since, or a results.json of another mode, is not kept."""
    runs = tmp_path / "runs"
    write_seeded_runs(runs, {"allreduce": [4.0, 4.2], "diloco": [4.2, 4.3], "dilocox": [4.4, 4.41]})
    path = tmp_path / "b.toml"
    runs_toml = "".join(f"[[runs]]\nname = '{n}'\noverrides = ['--train.lr=1e-3']\n" for n in ("allreduce", "diloco"))
    path.write_text(f"[bench]\nbase = 'x.toml'\n{runs_toml}[[runs]]\nname = 'dilocox'\n")
    spec = load_bench(path)
    first = collect(spec, tmp_path, ["allreduce", "diloco", "dilocox"])
    write_results({**first, "quick": False}, tmp_path)
    for name in ("allreduce", "diloco", "dilocox.seed1"):  # a fresh checkout: only dilocox's seed 0 was re-run
        shutil.rmtree(runs / name)
    shutil.rmtree(runs / "allreduce.seed1")
    shutil.rmtree(runs / "diloco.seed1")
    kept = kept_rows(spec, tmp_path, quick=False, exclude=["dilocox"])
    assert sorted(kept) == ["allreduce", "diloco"]
    results = collect(spec, tmp_path, ["dilocox"], kept)
    assert [r["name"] for r in results["runs"]] == ["allreduce", "diloco", "dilocox"]  # the bench file's order
    by_name = {r["name"]: r for r in results["runs"]}
    assert by_name["diloco"]["gap_to_baseline_pct"] == pytest.approx(first["runs"][1]["gap_to_baseline_pct"])
    assert by_name["diloco"]["num_seeds"] == 2 and by_name["allreduce"]["gap_to_baseline_pct"] == 0
    assert by_name["dilocox"]["num_seeds"] == 1  # paired with the stored baseline's seed 0
    assert by_name["dilocox"]["gap_to_baseline_pct"] == pytest.approx(10.0)
    write_results({**results, "quick": False}, tmp_path)  # plots the kept rows from their stored curves
    assert [r["name"] for r in json.loads((tmp_path / "results.json").read_text())["runs"]] == list(by_name)
    assert (tmp_path / "loss_vs_tokens.png").stat().st_size > 1000
    assert kept_rows(spec, tmp_path, quick=True, exclude=[]) == {}  # written without --quick
    assert "another bench, mode or common overrides" in capsys.readouterr().err
    path.write_text(f"[bench]\nbase = 'x.toml'\n{runs_toml.replace('1e-3', '2e-3', 1)}[[runs]]\nname = 'dilocox'\n")
    assert sorted(kept_rows(load_bench(path), tmp_path, quick=False, exclude=[])) == ["diloco", "dilocox"]
    assert "run allreduce changed since" in capsys.readouterr().err


def test_a_tuned_baseline_is_the_best_mean_of_its_most_seeded_runs_and_gets_its_own_column(tmp_path):
    """`tuned_baseline`: every row is also compared, seed by seed, with the baseline at its best setting; a lucky
    single seed cannot be that best against a mean over more seeds."""
    runs = tmp_path / "runs"
    write_seeded_runs(
        runs,
        {
            "allreduce": [4.0, 4.2],
            "allreduce-lr4e-3": [3.9, 4.1],  # the best mean with 2 seeds
            "allreduce-lr8e-3": [3.5],  # lower, but one seed
            "dilocox": [4.29, 4.51],
        },
    )
    path = tmp_path / "b.toml"
    names = ("allreduce", "allreduce-lr4e-3", "allreduce-lr8e-3", "dilocox")
    path.write_text(
        "[bench]\nbase = 'x.toml'\ntuned_baseline = ['allreduce', 'allreduce-lr4e-3', 'allreduce-lr8e-3']\n"
        + "".join(f"[[runs]]\nname = '{name}'\n" for name in names)
    )
    results = collect(load_bench(path), tmp_path, list(names))
    assert results["tuned_baseline"] == "allreduce-lr4e-3"
    by_name = {row["name"]: row for row in results["runs"]}
    dilocox = by_name["dilocox"]
    assert dilocox["gap_to_baseline_pct"] == pytest.approx((7.25 + 7.380952) / 2)  # against allreduce, unchanged
    assert dilocox["tuned_gap_to_baseline_pct"] == pytest.approx((10.0 + 10.0) / 2)  # 4.29 / 3.9, 4.51 / 4.1
    assert dilocox["tuned_gap_sd_pct"] == pytest.approx(0.0, abs=1e-9)
    assert by_name["allreduce"]["tuned_gap_to_baseline_pct"] == pytest.approx((2.564103 + 2.439024) / 2)
    assert by_name["allreduce-lr8e-3"]["tuned_gap_to_baseline_pct"] == pytest.approx(-10.25641)  # seed 0 only
    table = format_table({**results, "date": "d"})
    header = table.splitlines()[0]
    assert "| gap to allreduce | gap to the tuned baseline |" in header
    row = next(line for line in table.splitlines() if line.startswith("| dilocox |"))
    assert row.split(" | ")[2:4] == ["+7.32 ± 0.09%", "+10.00 ± 0.00%"]
    assert "Tuned baseline (allreduce-lr4e-3): the lowest mean eval loss" in table
    # without a tuned baseline the table keeps its columns
    plain = format_table({**results, "tuned_baseline": None, "date": "d"})
    assert "tuned" not in plain.splitlines()[0] and plain.splitlines()[1].count("---") == 10


def test_tuned_baseline_errors(tmp_path):
    path = tmp_path / "b.toml"
    runs = "[[runs]]\nname = 'allreduce'\n[[runs]]\nname = 'dilocox'\n"
    for value, match in (
        ("['allreduce', 'ar-lr4e-3']", "tuned_baseline names \\['ar-lr4e-3'\\], which are not runs of it"),
        ("'allreduce'", "tuned_baseline = 'allreduce' must be a list of run names"),
    ):
        path.write_text(f"[bench]\nbase = 'x.toml'\ntuned_baseline = {value}\n{runs}")
        with pytest.raises(ValueError, match=match):
            load_bench(path)
    path.write_text(f"[bench]\nbase = 'x.toml'\nregime = 'paper'\ntuned_baseline = ['allreduce']\n{runs}")
    with pytest.raises(ValueError, match="tuned_baseline is a column of the link-off table"):
        load_bench(path)


def test_bench_output_goes_under_the_ignored_runs_folder_by_default():
    from dilocox.tools.bench.harness import default_out_dir

    assert default_out_dir("default", regime=None, quick=False) == Path("runs/bench/default")
    assert default_out_dir("default", regime=None, quick=True) == Path("runs/bench/default-quick")
    assert default_out_dir("outer", regime="paper", quick=True) == Path("runs/bench/outer-paper-quick")
    assert default_out_dir("paper", regime="paper", quick=False) == Path("runs/bench/paper")


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)


@pytest.fixture
def git_checkout():
    if shutil.which("git") is None or _git("rev-parse", "--is-inside-work-tree").stdout.strip() != "true":
        pytest.skip("needs the repository's git checkout (a source tree without .git has no ignore rules to check)")


def test_git_ignores_what_runs_and_benches_leave_and_keeps_only_tables_and_plots_of_results(git_checkout):
    """The README's example folders and every bench's default output are ignored; a bench written into
    benchmarks/results keeps its tables and plots there, not its run directories and logs."""
    new = "benchmarks/results/new"
    ignored = ["runs/bench/default-quick/results.json", "runs/default/metrics.jsonl", "data/shakespeare/index.json",
               "hf/model.safetensors", "plots/loss.png", f"{new}/runs/allreduce/summary.json",
               f"{new}/timed/dilocox/metrics.jsonl", f"{new}/allreduce.log"]  # fmt: skip
    kept = [f"{new}/results.json", f"{new}/results.md", f"{new}/loss_vs_tokens.png"]
    checked = _git("check-ignore", "--no-index", *ignored, *kept).stdout.split()
    assert checked == ignored
    tracked = _git("ls-files", "benchmarks/results").stdout.split()
    assert tracked, "no committed benchmark results"
    tables = (".png", "/results.json", ".md", "/snapshot/snapshot.json")  # the last: benchmarks/snapshot.py records
    others = [p for p in tracked if not p.endswith(tables)]
    assert others == [], f"per-run files committed under benchmarks/results: {others[:5]}"


def test_a_partial_paper_rerun_without_the_run_directories_is_refused_before_it_runs(tmp_path, capsys):
    """A results.json from git (tables and plots only): `--only` would re-read every other row from runs/ and timed/,
    so it stops at once and says why, instead of dropping those rows."""
    out = tmp_path / "paper"
    out.mkdir()
    rows = [{"name": name} for name in ("no-communication", "allreduce", "dilocox")]
    (out / "results.json").write_text(json.dumps({"bench": "paper", "regime": {"bandwidth": "1Mbps"}, "runs": rows}))
    argv = [str(REPO / "benchmarks/configs/paper.toml"), "--quick", "--only", "dilocox", "--out", str(out)]
    assert bench_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dilocox: error: {out}: a partial re-run reads every other row back")
    assert err.count("\n") == 1
    assert "['no-communication', 'allreduce'] have none here" in err
    assert sorted(p.name for p in out.iterdir()) == ["results.json"]  # nothing ran, nothing was written


def test_resume_keeps_only_a_finished_run_of_exactly_the_settings_it_would_train(tmp_path):
    """`--resume` reads back a seed whose config.toml resolves to the settings this run would train (where it wrote
    and how it printed aside), and trains again one that never finished, or ran other settings or another seed."""
    from dilocox.config import to_toml
    from dilocox.tools.bench.runs import same_finished_run, seed_overrides

    spec = load_bench(REPO / "benchmarks" / "configs" / "default.toml")
    run = next(r for r in spec.runs if r.name == "diloco")

    def run_dir_of(overrides, name, *, finished=True):
        cfg = load_config(spec.base, [*overrides, f"--run.out_dir={tmp_path / name}", "--metrics.progress=true"])
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.toml").write_text(to_toml(cfg))
        if finished:
            (tmp_path / name / "summary.json").write_text("{}")
        return tmp_path / name

    same = run_overrides(spec, run, False)
    assert same_finished_run(spec, run, run_dir_of(same, "done"), quick=False, extra=[])
    assert not same_finished_run(spec, run, run_dir_of(same, "stopped", finished=False), quick=False, extra=[])
    assert not same_finished_run(spec, run, run_dir_of([*same, "--sync.outer.lr=0.5"], "other"), quick=False,
                                 extra=[])  # fmt: skip
    assert not same_finished_run(spec, run, run_dir_of(same, "seed0"), quick=False, extra=seed_overrides(0, 1))
    assert not same_finished_run(spec, run, run_dir_of(same, "quick"), quick=True, extra=[])
    assert not same_finished_run(spec, run, tmp_path / "missing", quick=False, extra=[])


def test_collect_marks_the_frontier_and_draws_it(tmp_path):
    """The rows with the fewest slow-link bytes for each gap, named in results.json and the table; frontier.png."""
    runs = tmp_path / "runs"
    sent = {"allreduce": (4.0, 8000), "int4": (4.1, 80), "sign": (4.3, 40), "fp32": (4.2, 100)}
    for name, (loss, wan) in sent.items():
        (runs / name).mkdir(parents=True)
        summary(loss, 100.0, wan, 8000).write(runs / name)
        (runs / name / METRICS_FILE).write_text(
            json.dumps({"step": 10, "tokens": 1000, "elapsed_s": 1.0, "eval_loss": loss}) + "\n"
        )
    path = tmp_path / "b.toml"
    path.write_text("[bench]\nbase = 'x.toml'\n" + "".join(f"[[runs]]\nname = '{name}'\n" for name in sent))
    results = collect(load_bench(path), tmp_path, list(sent))
    assert results["frontier"] == ["sign", "int4", "allreduce"]  # fp32: more bytes and a larger gap than int4
    assert "Frontier (the fewest slow-link bytes per token for each gap to allreduce" in format_table(results)
    assert "): sign; int4; allreduce." in format_table(results)
    write_results(results, tmp_path)
    assert (tmp_path / "frontier.png").stat().st_size > 0


def test_the_clusters_training_loss_over_the_last_tenth_and_its_paired_gap(tmp_path):
    """Rank 0's logged training losses after 90% of the steps, each weighted by the steps it covers; its gap to the
    baseline's, seed by seed, beside the agreed model's eval-loss gap."""
    runs = tmp_path / "runs"
    for name, scale in (("allreduce", 1.0), ("dilocox", 1.1)):
        for seed in (0, 1):
            run_dir = runs / (name if seed == 0 else f"{name}.seed{seed}")
            run_dir.mkdir(parents=True)
            seeded(4.0 * scale, seed).write(run_dir)
            records = [{"step": s, "tokens": s, "elapsed_s": s, "loss": 9.0} for s in (40, 80)]
            records += [{"step": 88, "tokens": 88, "elapsed_s": 88, "loss": 5.0 * scale}]  # covers steps 81-88
            records += [{"step": 94, "tokens": 94, "elapsed_s": 94, "loss": (2.0 + seed) * scale}]  # 89-94: in
            records += [{"step": 100, "tokens": 100, "elapsed_s": 100, "loss": (4.0 + seed) * scale}]  # 95-100
            records += [{"step": 100, "event": "elastic", "loss": 99.0}]  # not a training record
            (run_dir / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    assert train_loss_tail(runs / "allreduce") == pytest.approx((2.0 * 6 + 4.0 * 6) / 12)
    path = tmp_path / "b.toml"
    path.write_text("[bench]\nbase = 'x.toml'\n[[runs]]\nname = 'allreduce'\n[[runs]]\nname = 'dilocox'\n")
    results = collect(load_bench(path), tmp_path, ["allreduce", "dilocox"])
    assert [s["train_loss_tail"] for s in results["runs"][1]["seeds"]] == pytest.approx([3.3, 4.4])
    assert results["runs"][1]["train_gap_pct"] == pytest.approx(10.0)
    assert results["runs"][0]["train_gap_pct"] == 0
    assert "| +10.00 ± 0.00% | +10.00% |" in format_table(results)  # eval-loss gap, then the clusters'


def test_workloads_run_every_run_on_each_and_the_table_gives_each_gap_and_their_mean(tmp_path):
    path = tmp_path / "b.toml"
    path.write_text(textwrap.dedent("""\
        [bench]
        name = "w"
        overrides = ["--train.steps=40"]
        [[workloads]]
        name = "chars"
        label = "a character model"
        overrides = ["--model.flavor=gpt2-char", "--data.vocab_size=257", "--train.steps=80"]
        [[workloads]]
        name = "plays"
        [[runs]]
        name = "allreduce"
        overrides = ["--preset=allreduce"]
        [[runs]]
        name = "dilocox"
        overrides = ["--train.steps=20"]
    """))
    spec = load_bench(path)
    chars, plays = (spec.on_workload(workload) for workload in spec.workloads)
    assert chars.name == "w/chars" and chars.overrides == ["--train.steps=40", *spec.workloads[0].overrides]
    assert plays.overrides == ["--train.steps=40"] and not chars.workloads
    # the workload's overrides come after the bench's and before the run's
    assert load_config(chars.base, run_overrides(chars, chars.runs[0], False)).train.steps == 80
    assert load_config(chars.base, run_overrides(chars, chars.runs[1], False)).train.steps == 20
    losses = {"chars": {"allreduce": [2.0, 2.0], "dilocox": [2.02, 2.04]},  # +1%, +2%
              "plays": {"allreduce": [4.0, 4.0], "dilocox": [4.2, 4.16]}}  # +5%, +4%  # fmt: skip
    per_workload = []
    for one, workload in zip((chars, plays), spec.workloads, strict=True):
        write_seeded_runs(tmp_path / workload.name / "runs", losses[workload.name])
        results = {**collect(one, tmp_path / workload.name, ["allreduce", "dilocox"]), "date": "d"}
        per_workload.append({"name": workload.name, "label": workload.label or workload.name, "results": results})
    table = format_workloads_table({"bench": "w", "source": str(path), "baseline": "allreduce",
                                    "workloads": per_workload})  # fmt: skip
    assert "| run | gap, chars | gap, plays | mean gap |" in table
    row = next(line for line in table.splitlines() if line.startswith("| dilocox |"))
    assert "+1.50 ± 0.71%" in row and "+4.50 ± 0.71%" in row and "| +3.00% |" in row
    assert "`chars`: a character model" in table and "over 2 seeds" in table


def test_workload_errors(tmp_path):
    path = tmp_path / "b.toml"
    runs = "[[runs]]\nname = 'allreduce'\n"
    path.write_text("[bench]\n[[workloads]]\nname = 'a'\n[[workloads]]\nname = 'a'\n" + runs)
    with pytest.raises(ValueError, match="workloads names repeat"):
        load_bench(path)
    path.write_text("[bench]\n[[workloads]]\noverrides = []\n" + runs)
    with pytest.raises(ValueError, match=r"workloads\[0\] needs name"):
        load_bench(path)
    path.write_text("[bench]\nregime = 'paper'\n[[workloads]]\nname = 'a'\n" + runs)
    with pytest.raises(ValueError, match="the paper regime times one setting"):
        load_bench(path)
