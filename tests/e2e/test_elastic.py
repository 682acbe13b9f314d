"""Elastic clusters as a user meets them (docs/design.md §10.1): kill -9 one cluster's process mid-run; the others go
on, the launcher starts it again, it heals from a live peer and ends bit-identical to them."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.e2e.test_cli import DEBUG, REPO

pytest.importorskip("torchft")
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ELASTIC = [
    "--topology.elastic=true", "--sync.kind=dilocox", "--network.heartbeat=0.5s", "--network.stall_timeout=5s",
    "--eval.interval=0", "--checkpoint.interval=0", "--metrics.log_interval=1",
]  # fmt: skip


class Run:
    """`dilocox train` in a subprocess, its output read as it comes (the launcher prints each cluster's pid)."""

    def __init__(self, run_dir: Path, *flags: str) -> None:
        self.run_dir = run_dir
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dilocox", "train", "--config", DEBUG, f"--run.out_dir={run_dir}", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
        )  # fmt: skip
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def pid_of(self, cluster: int) -> int:
        for line in self.lines:
            found = re.match(rf"dilocox: elastic: cluster {cluster} started \(pid (\d+)", line)
            if found:
                return int(found.group(1))
        raise AssertionError(f"cluster {cluster} has no pid line:\n" + "\n".join(self.lines[-40:]))

    def wait_for_step(self, step: int, timeout: float = 120) -> None:
        metrics = self.run_dir / "metrics.jsonl"
        deadline = time.time() + timeout
        while time.time() < deadline:
            if metrics.exists():
                steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()]
                if steps and steps[-1] >= step:
                    return
            assert self.proc.poll() is None, "\n".join(self.lines[-40:])
            time.sleep(0.05)
        raise AssertionError(f"step {step} not reached")

    def finish(self, timeout: float = 240) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code

    @property
    def output(self) -> str:
        return "\n".join(self.lines)


def _records(run_dir: Path) -> dict[int, dict]:
    return {
        int(p.stem.removeprefix("cluster")): json.loads(p.read_text()) for p in (run_dir / "elastic").glob("*.json")
    }


@pytest.mark.timeout(240)
def test_a_killed_cluster_rejoins_heals_from_a_peer_and_ends_bit_identical(tmp_path):
    flags = [*ELASTIC, "--topology.num_clusters=3", "--train.steps=60", "--sync.inner_steps=10"]
    clean = Run(tmp_path / "clean", *flags)
    assert clean.finish() == 0, clean.output[-4000:]
    clean_loss = json.loads((tmp_path / "clean" / "summary.json").read_text())["final_eval_loss"]

    run = Run(tmp_path / "killed", *flags)
    # mid-round (rounds end at multiples of 10). The restarted process takes a few seconds to start (~20 s on 2 busy
    # cores): it rejoins at a round boundary, or, if the others reach the end first, at the end of training, where
    # they wait for it (ElasticMembership.wait_for_restarts); either way it heals from a live peer
    run.wait_for_step(15)
    os.kill(run.pid_of(2), signal.SIGKILL)
    assert run.finish() == 0, run.output[-4000:]
    out = run.output
    assert "dilocox: elastic: cluster 2 failed" in out
    assert "dilocox: elastic: cluster 2 started" in out and "start 2)" in out
    assert re.search(r"dilocox: elastic: cluster 2 rejoined at step \d+ .*healed from a live peer", out), out[-4000:]

    records = _records(tmp_path / "killed")
    assert sorted(records) == [0, 1, 2]
    digests = {r["outer_params_sha256"] for r in records.values()}
    assert len(digests) == 1, records  # the agreed parameters are bit-identical on every cluster
    assert records[2]["healed_from_peer"] and records[2]["resumed_from_checkpoint"] is None
    # the only checkpoint is the final one, written after the heal: there was nothing on disk it could have read
    assert [p.name for p in (tmp_path / "killed" / "checkpoints").iterdir()] == ["step_00000060"]
    assert not records[0]["healed_from_peer"] and not records[1]["healed_from_peer"]
    assert all(r["step"] == 60 for r in records.values())

    loss = json.loads((tmp_path / "killed" / "summary.json").read_text())["final_eval_loss"]
    waited = "waits for restarted clusters [2] before the last sync" in out
    print(
        f"final eval loss: clean {clean_loss:.4f}, with cluster 2 killed and rejoined at step "
        f"{records[2]['rejoined_at_step']} {loss:.4f} ({'at the end, the others waited' if waited else 'mid-run'})"
    )
    assert abs(loss - clean_loss) / clean_loss < 0.05


def test_below_min_clusters_the_run_stops_with_one_line(tmp_path):
    flags = [*ELASTIC, "--topology.num_clusters=2", "--sync.min_clusters=2", "--topology.max_cluster_restarts=0",
             "--train.steps=100000", "--sync.inner_steps=10"]  # fmt: skip
    run = Run(tmp_path / "few", *flags)
    run.wait_for_step(15)
    os.kill(run.pid_of(1), signal.SIGKILL)
    assert run.finish(timeout=120) == 2, run.output[-4000:]
    errors = [line for line in run.lines if line.startswith("dilocox: error:")]
    assert errors == [
        "dilocox: error: only 1 of 2 clusters (clusters [0]) are left in the round, fewer than sync.min_clusters = 2: "
        "the run stops"
    ], run.output[-3000:]
