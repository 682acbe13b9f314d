"""`network.auth_key_file` through the CLI: tagged payloads, exact bytes with their tags, and a key that never
reaches the run directory."""

import json

import pytest

from tests.e2e.helpers import DEBUG, dilocox, metrics

pytestmark = pytest.mark.e2e
TAG_BYTES = 32


def test_an_authenticated_run_counts_its_tags_and_never_stores_the_key(tmp_path):
    key = b"e2e-secret-key-that-must-not-leak-0123456789"
    key_file = tmp_path / "wan.key"
    key_file.write_bytes(key + b"\n")
    run_dir = tmp_path / "run"
    result = dilocox(
        "train", "--config", DEBUG, f"--run.out_dir={run_dir}", "--sync.kind=dilocox", "--compression.kind=int4",
        "--train.steps=20", f"--network.auth_key_file={key_file}", "--metrics.log_interval=10",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rejected" not in result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["payloads_rejected"] == 0
    rounds = [r for r in metrics(run_dir) if "round_payload_bytes" in r]
    assert rounds and all(r["payloads_rejected"] == 0 for r in metrics(run_dir))
    # 2 clusters: each rank sends its payload and its tag once per round
    assert all(r["round_bytes_sent"] == r["round_payload_bytes"] + TAG_BYTES for r in rounds)
    assert f'auth_key_file = "{key_file}"' in (run_dir / "config.toml").read_text()
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(p.name == "meta.json" for p in files)
    assert not [p for p in files if key in p.read_bytes()]
    assert key.decode() not in result.stdout + result.stderr


def test_a_summed_reduction_with_a_key_is_refused_before_anything_is_written(tmp_path):
    key_file = tmp_path / "wan.key"
    key_file.write_bytes(b"k" * 32)
    run_dir = tmp_path / "run"
    result = dilocox("train", "--config", DEBUG, f"--run.out_dir={run_dir}", f"--network.auth_key_file={key_file}")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert result.stderr.startswith("dilocox: error: network.auth_key_file cannot tag compression.kind = none")
    assert not run_dir.exists()
    short = tmp_path / "short.key"
    short.write_bytes(b"12345")
    result = dilocox("train", "--config", DEBUG, f"--run.out_dir={run_dir}", f"--network.auth_key_file={short}")
    assert result.returncode == 2 and "holds 5 bytes, fewer than the 16 a key needs" in result.stderr
    assert not run_dir.exists()
