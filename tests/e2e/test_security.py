"""`network.auth_key_file` through the CLI: tagged payloads, exact bytes with their tags, and a key that never
reaches the run directory; a one-machine run that listens on the loopback only."""

import json
import os
import signal

import pytest

from tests.e2e.helpers import (
    DEBUG,
    LOOPBACK,
    descendant_pids,
    dilocox,
    listening_sockets,
    metrics,
    non_loopback_interface,
    rank_pids,
    start_long_run,
    wait_for_training,
)

pytestmark = pytest.mark.e2e
TAG_BYTES = 32


def test_an_authenticated_run_counts_its_tags_and_never_stores_the_key(tmp_path):
    key = b"e2e-secret-key-that-must-not-leak-0123456789"
    key_file = tmp_path / "wan.key"
    key_file.write_bytes(key + b"\n")
    run_dir = tmp_path / "run"
    result = dilocox(
        "train", "--config", DEBUG, f"--run.out_dir={run_dir}", "--preset=dilocox-lowrank", "--compression.kind=int4",
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
    assert result.stderr.startswith(
        "dilocox: error: network.auth_key_file does not work with compression.kind = 'none': its values are summed"
    )
    assert not run_dir.exists()
    short = tmp_path / "short.key"
    short.write_bytes(b"12345")
    result = dilocox("train", "--config", DEBUG, f"--run.out_dir={run_dir}", f"--network.auth_key_file={short}")
    assert result.returncode == 2 and "holds 5 bytes, fewer than the 16 a key needs" in result.stderr
    assert not run_dir.exists()


def test_a_one_machine_run_listens_on_the_loopback_only(tmp_path):
    # as a user who keeps GLOO_SOCKET_IFNAME on a network interface for torchrun jobs (or has none set)
    env = {key: value for key, value in os.environ.items() if key != "GLOO_SOCKET_IFNAME"}
    interface = non_loopback_interface()
    if interface is not None:
        env["GLOO_SOCKET_IFNAME"] = interface
    run_dir = tmp_path / "run"
    proc = start_long_run(run_dir, env=env)
    try:
        wait_for_training(run_dir, proc, timeout=240)
        ranks = rank_pids(proc.pid)
        assert len(ranks) == 2
        listening = {pid: listening_sockets(pid) for pid in [proc.pid, *descendant_pids(proc.pid)]}
        assert len(listening[proc.pid]) == 1  # the job's store
        assert all(listening[rank] for rank in ranks)  # each rank's gloo groups
        outside = {pid: [s for s in sockets if s[0] not in LOOPBACK] for pid, sockets in listening.items()}
        assert not any(outside.values()), f"listening beyond the loopback (GLOO_SOCKET_IFNAME={interface}): {outside}"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)


def test_an_advertise_host_this_machine_cannot_listen_on_is_one_line_before_anything_is_written(tmp_path):
    run_dir = tmp_path / "run"
    result = dilocox(
        "train", "--config", DEBUG, f"--run.out_dir={run_dir}", "--topology.elastic=true", "--preset=dilocox-lowrank",
        "--sync.merge=eager", "--sync.local_residual=false", "--sync.drain_residual=false",
        "--network.advertise_host=203.0.113.77",  # TEST-NET-3: documentation only, no machine's address
    )  # fmt: skip
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr[-3000:]
    assert result.stderr.startswith(
        "dilocox: error: network.advertise_host = '203.0.113.77' is not an address this machine can listen on ("
    )
    assert not run_dir.exists()
