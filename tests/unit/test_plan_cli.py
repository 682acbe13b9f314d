"""`dilocox plan`: the preset beside the paper, overrides, calibration, and one-line errors with exit code 2."""

import json
import math
import subprocess
import sys

import pytest

from dilocox.tools.bench.plan_cli import main
from dilocox.tools.bench.planner import INT4_COMPRESSION_RATIO


def test_cli_json_paper_preset_keys_are_present_and_finite(capsys):
    assert main(["--preset", "paper-107b", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    for key in ("allreduce_tokens_per_s", "dilocox_tokens_per_s"):
        assert math.isfinite(payload[key]) and payload[key] > 0
    assert payload["diloco_tokens_per_s"] is None
    for name in ("allreduce", "dilocox", "dilocox_no_overlap", "dilocox_no_compression"):
        breakdown = payload["strategies"][name]["round"]
        assert breakdown["round_s"] > 0 and all(math.isfinite(value) for value in breakdown.values())
    assert payload["strategies"]["diloco"]["round"] is None
    assert payload["paper"]["dilocox_tokens_per_s"] == 3728.0
    assert math.isfinite(payload["paper"]["model_over_paper"]["dilocox"])


def test_cli_table_shows_the_paper_side_by_side(capsys):
    assert main(["--preset", "paper-107b"]) == 0
    out = capsys.readouterr().out
    for text in ("AllReduce", "DiLoCoX", "cannot run", "3,728", "10.4", "~2,237", "1,168", "model/paper"):
        assert text in out


def test_cli_overrides_the_preset_and_calibrates(capsys):
    assert main(["--preset", "paper-107b", "--bandwidth", "10Gbps", "--inner-steps", "50", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["input"]["slow_link_bps"] == pytest.approx(1e10) and payload["input"]["inner_steps"] == 50
    argv = ["--flavor", "tiny", "--seq-len", "256", "--num-microbatches", "1", "--microbatch-size", "16"]
    assert main([*argv, "--num-clusters", "1", "--calibrate-tokens-per-s", "5600", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["allreduce_tokens_per_s"] == pytest.approx(5600.0)
    assert main([*argv, "--codec-rank", "8", "--codec-bits", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["input"]["compression_ratio"] > INT4_COMPRESSION_RATIO


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--flavor", "tiny", "--num-clusters", "0"], "--num-clusters"),
        (["--flavor", "tiny", "--bandwidth", "fast"], "--bandwidth"),
        (["--flavor", "tiny", "--latency", "10"], "--latency"),
        (["--flavor", "tiny", "--gpu", "V100"], "--gpu"),
        (["--flavor", "tiny", "--mfu", "2"], "--mfu"),
        (["--flavor", "tiny", "--pp-degree", "8"], "--pp-degree"),
        (["--flavor", "nope"], "flavor"),
        (["--num-clusters", "2"], "--flavor"),
        (["--preset", "paper-107b", "--global-batch-tokens", "1000"], "--global-batch-tokens"),
        (["--num-params", "1e9", "--codec-rank", "8"], "--flavor"),
        (["--flavor", "tiny", "--compression-ratio", "4", "--codec-bits", "4"], "--compression-ratio"),
        (["--flavor", "tiny", "--calibrate-tokens-per-s", "-3"], "--calibrate-tokens-per-s"),
        (["--flavor", "tiny", "--no-such-option"], "--no-such-option"),
        (["--preset", "paper-9000b"], "--preset"),
    ],
)
def test_cli_bad_input_exits_2_naming_the_option(capsys, argv, named):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert err.startswith("dilocox: error: ") and named in err and "\n" not in err


def test_cli_help_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "--calibrate-tokens-per-s" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_in_a_subprocess():
    # One interpreter start (torch's import dominates): a good run prints JSON, then a bad one sets the exit code.
    code = (
        "import sys; from dilocox.tools.bench.plan_cli import main; "
        "main(['--flavor', 'tiny', '--json']); sys.exit(main(['--flavor', 'tiny', '--dp-degree', '-1']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert json.loads(proc.stdout)["dilocox_tokens_per_s"] > 0
    assert proc.stderr.startswith("dilocox: error: ") and "--dp-degree" in proc.stderr
