"""`dilocox bench --quick` end to end: every run per seed, the table, the plots, and the paper regime's calibration."""

import json
import statistics
from pathlib import Path

import pytest

from tests.e2e.helpers import (
    REPO,
    dilocox,
    metrics,
)

pytestmark = pytest.mark.e2e


@pytest.mark.slow
def test_bench_quick_runs_every_run_per_seed_tabulates_and_pairs_the_gaps(tmp_path):
    """One bench of three strategies over two seeds (every shipped bench file's runs are validated in
    tests/unit/test_bench.py; dilocox runs in the paper-regime bench test below and in its own e2e tests)."""
    out = tmp_path / "bench"
    result = dilocox("bench", REPO / "benchmarks" / "configs" / "default.toml", "--quick", "--only",
                     "allreduce,cocktail,diloco", "--seeds", "2", "--out", out, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summaries = {d.name: json.loads((d / "summary.json").read_text()) for d in sorted((out / "runs").iterdir())}
    assert sorted(summaries) == [f"{n}{s}" for n in ("allreduce", "cocktail", "diloco") for s in ("", ".seed1")]
    assert summaries["diloco.seed1"]["run_seed"] == 1 and summaries["diloco"]["run_seed"] == 0
    assert summaries["diloco.seed1"]["final_eval_loss"] != summaries["diloco"]["final_eval_loss"]  # seeds matter
    results = json.loads((out / "results.json").read_text())
    assert [r["name"] for r in results["runs"]] == ["allreduce", "cocktail", "diloco"]
    for row in results["runs"]:
        for key in ("final_eval_loss", "tokens_per_s", "wan_bytes_per_token", "gap_to_baseline_pct", "wall_s"):
            assert row[key] is not None and row[key] == row[key], (row["name"], key)  # present and not NaN
    by_name = {r["name"]: r for r in results["runs"]}
    assert by_name["allreduce"]["compression_vs_allreduce"] == pytest.approx(1.0)
    assert by_name["diloco"]["compression_vs_allreduce"] == pytest.approx(5.0)  # H = 5 in --quick
    assert by_name["cocktail"]["compression_vs_allreduce"] > 10  # random sparsification + int4, every step
    gaps = [
        100 * (summaries[d]["final_eval_loss"] / summaries[a]["final_eval_loss"] - 1)
        for d, a in (("diloco", "allreduce"), ("diloco.seed1", "allreduce.seed1"))
    ]
    row = by_name["diloco"]
    assert row["num_seeds"] == 2 and row["gap_to_baseline_pct"] == pytest.approx(sum(gaps) / 2)
    assert row["gap_range_pct"] == pytest.approx(sorted(gaps))
    table = (out / "results.md").read_text()
    assert table.count("\n| ") == 1 + 3 and "over 2 seeds" in table  # separator row + one row per strategy
    for png in ("loss_vs_tokens.png", "loss_vs_time.png", "throughput.png"):
        assert (out / png).stat().st_size > 1000
    assert (out / "loss_vs_tokens_seeds.png").stat().st_size > 10_000  # mean and min-max band per run
    assert dilocox("bench", "--seeds", "0", "--quick").returncode == 2

    # --resume: a third seed trains, the two finished ones are read back, untouched
    finished = {d: (out / "runs" / d / "summary.json").stat().st_mtime_ns for d in ("allreduce", "allreduce.seed1")}
    result = dilocox("bench", REPO / "benchmarks" / "configs" / "default.toml", "--quick", "--only", "allreduce",
                     "--seeds", "3", "--resume", "--out", out, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("holds a finished run of these settings") == 2
    assert {d: (out / "runs" / d / "summary.json").stat().st_mtime_ns for d in finished} == finished
    assert json.loads((out / "runs" / "allreduce.seed2" / "summary.json").read_text())["run_seed"] == 2
    rows = {r["name"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    assert rows["allreduce"]["num_seeds"] == 3 and rows["diloco"]["num_seeds"] == 2


@pytest.mark.slow
def test_bench_quick_runs_every_run_on_every_workload_and_tabulates_each(tmp_path):
    bench = tmp_path / "w.toml"
    bench.write_text(
        '[bench]\nname = "w"\n'
        '[[workloads]]\nname = "docs"\noverrides = ["--data.path=builtin:python-docs"]\n'
        '[[workloads]]\nname = "plays"\n'
        '[[runs]]\nname = "allreduce"\noverrides = ["--preset=allreduce"]\n'
        '[[runs]]\nname = "alone"\noverrides = ["--preset=allreduce", "--topology.num_clusters=1"]\n'
    )
    out = tmp_path / "bench"
    result = dilocox("bench", bench, "--quick", "--out", out, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    combined = json.loads((out / "results.json").read_text())
    assert [w["name"] for w in combined["workloads"]] == ["docs", "plays"]
    for workload, corpus in (("docs", "builtin:python-docs"), ("plays", "")):
        for run, clusters in (("allreduce", 2), ("alone", 1)):
            summary = json.loads((out / workload / "runs" / run / "summary.json").read_text())
            assert summary["num_clusters"] == clusters
            assert f'path = "{corpus}"' in (out / workload / "runs" / run / "config.toml").read_text()
        rows = {r["name"]: r for r in json.loads((out / workload / "results.json").read_text())["runs"]}
        assert rows["alone"]["summary"]["tokens"] * 2 == rows["allreduce"]["summary"]["tokens"]  # 1/C of them
    docs, plays = ({r["name"]: r for r in w["results"]["runs"]} for w in combined["workloads"])
    assert docs["allreduce"]["final_eval_loss"] != plays["allreduce"]["final_eval_loss"]
    table = (out / "results.md").read_text()
    assert "| run | gap, docs | gap, plays | mean gap |" in table and table in result.stdout
    mean = (docs["alone"]["gap_to_baseline_pct"] + plays["alone"]["gap_to_baseline_pct"]) / 2
    assert f"{mean:+.2f}%" in table.splitlines()[3]


@pytest.mark.slow
@pytest.mark.timeout(900)  # the bench's own limits: about 3.5 minutes on 2 idle cores, more when they are shared
def test_bench_quick_paper_regime_produces_a_complete_table(tmp_path):
    """Throughputs on the calibrated link follow from the calibration and the bytes the run itself reports; with
    two timed runs per row they are medians, and `--retime` re-times one row without touching the convergence runs."""
    out = tmp_path / "paper"
    result = dilocox("bench", REPO / "benchmarks" / "configs" / "paper.toml", "--quick", "--only", "allreduce,dilocox",
                     "--timing-repeats", "2", "--out", out, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "(timing 2 of 2)" in result.stdout
    check_paper_regime_results(out, repeats=2)

    converged = {d.name: (d / "summary.json").read_bytes() for d in (out / "runs").iterdir()}
    result = dilocox("bench", REPO / "benchmarks" / "configs" / "paper.toml", "--quick", "--only", "dilocox",
                     "--retime", "--out", out, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "] link off:" not in result.stdout and "keeping the earlier link" in result.stdout
    assert {d.name: (d / "summary.json").read_bytes() for d in (out / "runs").iterdir()} == converged
    # dilocox and the reference timed once more (their second timings dropped), AllReduce's two timings kept
    assert not (out / "timed" / "dilocox.rep1").exists() and not (out / "timed" / "no-communication.rep1").exists()
    by_name = {r["name"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    assert len(by_name["dilocox"]["timed_tokens_per_s_repeats"]) == 1
    assert len(by_name["allreduce"]["timed_tokens_per_s_repeats"]) == 2
    check_paper_regime_results(out, repeats=1, per_step_repeats=2)


def check_paper_regime_results(out: Path, *, repeats: int = 1, per_step_repeats: int | None = None) -> None:
    """The paper-regime bench's numbers against what its own calibration and byte counters imply: a wrong bandwidth,
    a link charge left out or a wrong window fails here. What is asserted is what the code decides (the calibrated
    link, the emulated link time, the window, the medians of the runs' own records), never how fast this machine ran.

    `repeats` timed runs of dilocox and the reference (`per_step_repeats`, default the same, of AllReduce): each
    row's tokens/s is the median of its timed runs' (the mean of two)."""
    results = json.loads((out / "results.json").read_text())
    assert [r["name"] for r in results["runs"]] == ["no-communication", "allreduce", "dilocox"]
    regime = results["regime"]
    by_name = {r["name"]: r for r in results["runs"]}
    for name in ("allreduce", "dilocox"):
        assert (out / "timed" / name / "summary.json").exists() and (out / "runs" / name / "summary.json").exists()
    # the calibration: compute per step from the link-off no-communication run, and a link on which one AllReduce
    # step's fp32 gradient (a ring of 2 sends 2 (C-1)/C = 1 gradient) takes 357.46 x that compute
    ref = json.loads((out / "runs" / "no-communication" / "summary.json").read_text())
    compute_s = regime["compute_s_per_step"]
    assert compute_s == pytest.approx(ref["tokens"] / ref["tokens_per_s"] / ref["steps"], rel=1e-9)
    grad_bytes = 4 * ref["num_params"]
    assert regime["grad_bytes"] == grad_bytes
    bandwidth, latency = regime["bandwidth_bytes_per_s"], regime["latency_s"]
    assert latency == 0.01  # the base config's 10ms
    transfer_s = latency + grad_bytes / bandwidth
    assert transfer_s == pytest.approx(357.46 * compute_s, rel=1e-3)

    # every timed run's tokens/s over its steady window, read from its own per-step metrics: steps (H, (R + 1) H] for
    # the outer-loop runs (R rounds spanning at least 48 steps), AllReduce's first step
    counts = {"no-communication": repeats, "allreduce": per_step_repeats or repeats, "dilocox": repeats}
    dirs = {
        name: [out / "timed" / (name if k == 0 else f"{name}.rep{k}") for k in range(n)] for name, n in counts.items()
    }
    for name, n in counts.items():
        assert not (out / "timed" / f"{name}.rep{n}").exists(), f"{name}: a timed run more than {n}"
    every = {name: [{m["step"]: m for m in metrics(d)} for d in run_dirs] for name, run_dirs in dirs.items()}
    timed = {name: runs[0] for name, runs in every.items()}  # the first timed run of each row, for the byte counts
    dilocox_summary = json.loads((out / "timed" / "dilocox" / "summary.json").read_text())
    h = dilocox_summary["inner_steps"]
    rounds = -(-48 // h)  # the fewest whole rounds spanning 48 steps
    end = (rounds + 1) * h
    tokens_per_step = dilocox_summary["tokens"] // dilocox_summary["steps"]
    assert timed["allreduce"][1]["tokens"] == tokens_per_step

    def window_tokens_per_s(rows: dict, start: int, end: int) -> float:
        t0, k0 = (0.0, 0) if start == 0 else (rows[start]["elapsed_s"], rows[start]["tokens"])
        return (rows[end]["tokens"] - k0) / (rows[end]["elapsed_s"] - t0)

    def median_tokens_per_s(name: str, start: int, end: int) -> float:
        return statistics.median(window_tokens_per_s(rows, start, end) for rows in every[name])

    assert by_name["allreduce"]["timed_window_steps"] == len(timed["allreduce"]) == 2
    assert by_name["dilocox"]["timed_window_steps"] == len(timed["dilocox"]) == end + 1
    no_comm_tps = median_tokens_per_s("no-communication", h, end)
    assert regime["no_communication_steady_tokens_per_s"] == pytest.approx(no_comm_tps, rel=1e-9)
    for name, (first, last) in {"allreduce": (0, 1), "dilocox": (h, end)}.items():
        each = [window_tokens_per_s(rows, first, last) for rows in every[name]]
        assert by_name[name]["timed_tokens_per_s_repeats"] == pytest.approx(each, rel=1e-9)
        assert by_name[name]["tokens_per_s"] == pytest.approx(median_tokens_per_s(name, first, last), rel=1e-9)
        assert by_name[name]["of_no_communication"] == pytest.approx(by_name[name]["tokens_per_s"] / no_comm_tps)

    # AllReduce: every step computes, then waits for the whole gradient on the link: the emulated link is busy for
    # latency + gradient / bandwidth per step (the link model's decision, exact whatever the machine's load), and no
    # step can be faster than its transfer.
    assert timed["allreduce"][1]["wan_bytes_sent"] == grad_bytes
    assert timed["allreduce"][1]["link_busy_s"] == pytest.approx(transfer_s, rel=1e-6)
    assert by_name["allreduce"]["tokens_per_s"] <= tokens_per_step / transfer_s

    # DiLoCoX: each sync launched at a round's start travels during that round and is waited for at its end. The
    # link is busy for latency + max(sent, recv) / bandwidth per sync: from the run's own byte counters over the
    # window's R syncs, within 1% (the window's totals stand in for each sync's own max(sent, recv), and the 8-byte
    # length header is noise; a link charged 0.8x or a wrong bandwidth is off by far more), and no round is shorter
    # than its sync.
    dx = timed["dilocox"]
    sent = (dx[end]["wan_bytes_sent"] - dx[h]["wan_bytes_sent"]) / rounds
    recv = (dx[end]["wan_bytes_recv"] - dx[h]["wan_bytes_recv"]) / rounds
    assert 0 < sent < grad_bytes / 4 and 0 < recv < grad_bytes / 4  # compressed
    link_s = latency + max(sent, recv) / bandwidth
    assert dx[end]["link_busy_s"] - dx[h]["link_busy_s"] == pytest.approx(rounds * link_s, rel=0.01)
    assert by_name["dilocox"]["tokens_per_s"] <= h * tokens_per_step / link_s
    # the speedup is the ratio of the two rows' throughputs
    assert by_name["dilocox"]["speedup_vs_baseline"] == pytest.approx(
        by_name["dilocox"]["tokens_per_s"] / by_name["allreduce"]["tokens_per_s"], rel=1e-9
    )
    assert by_name["allreduce"]["speedup_vs_baseline"] == 1.0
    table = (out / "results.md").read_text()
    assert table.count("\n| ") == 1 + 3 and "paper regime" in table
