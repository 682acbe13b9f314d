"""benchmarks/gpu.py end to end in its CPU smoke mode: the debug flavor on the CPU, where CI proves that the script
runs, reads every run's summary and metrics right and writes the report's fields (its numbers are not reported)."""

import json
import subprocess
import sys

import pytest

from tests.e2e.helpers import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_the_gpu_benchmark_runs_on_the_cpu_and_writes_its_report(tmp_path):
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    command = [sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--cpu-smoke", f"--out-dir={out}"]
    result = subprocess.run([*command, f"--scratch={scratch}"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "CPU smoke run: these numbers are not reported" in result.stdout

    results = json.loads((out / "results.json").read_text())
    assert results["mode"] == "cpu-smoke" and results["reported"] is False and "not reported" in results["note"]
    device = results["device"]
    assert device["kind"] == "cpu" and device["slug"] == "cpu" and device["name"].startswith("CPU")
    assert device["bf16_peak_tflops"] is None and "no bf16 tensor-core peak" in device["mfu_omitted"]
    assert device["torch"] and results["gpu_sampling"] == "no CUDA device"

    (plain,) = results["plain"]
    assert plain["status"] == "ok" and plain["flavor"] == "debug" and plain["tokens_per_s"] > 0
    assert plain["mfu"] is None and plain["gpu_util_pct"] == "no CUDA device"

    runs = {(run["sync_kind"], run["link"]): run for run in results["runs"]}
    assert set(runs) == {(kind, link) for kind in ("dilocox", "allreduce") for link in ("off", "on")}
    for (kind, link), run in runs.items():
        assert run["status"] == "ok", run.get("error")
        assert run["num_params"] == plain["num_params"]  # the plain loop trains the same Decoder
        assert run["bandwidth"] == ("1Gbps" if link == "on" else "unlimited")
        # the first logged window (start-up) is not measured, nor dilocox's last (the final flush)
        windows_left_out = 2 if kind == "dilocox" else 1
        assert run["measured_steps"] == run["steps"] - windows_left_out * run["log_interval"] > 0
        assert run["tokens_per_s_total"] == pytest.approx(2 * run["tokens_per_s_per_cluster"], rel=1e-3)
        assert run["share_of_plain"] == pytest.approx(run["tokens_per_s_total"] / plain["tokens_per_s"], abs=2e-3)
        assert run["mfu"] is None and run["gpu_util_pct"] == "no CUDA device"
        assert run["final_eval_loss"] > 0
    # slow-link bytes as the runs' summaries count them: AllReduce sends its yardstick, dilocox far less
    allreduce, dilocox = runs[("allreduce", "on")], runs[("dilocox", "on")]
    assert allreduce["wan_bytes_total"] == allreduce["allreduce_equiv_bytes"] > 0
    assert 0 < dilocox["wan_bytes_total"] < dilocox["allreduce_equiv_bytes"]
    assert 0.0 <= dilocox["hidden_share_run"] <= 1.0 and dilocox["link_busy_s"] > 0

    report = (out / "results.md").read_text()
    assert report.startswith(f"# GPU benchmark: {device['name']}") and "its numbers are not reported" in report
    assert report.count("| debug |") == 5  # the plain loop and the four runs
    assert not (scratch / "runs").exists()  # run directories and checkpoints removed
    assert not (REPO / "benchmarks" / "results" / "gpu" / "cpu").exists()  # smoke numbers never land in the repo
