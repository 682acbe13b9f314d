"""Failure detection as a user meets it: a rank frozen with SIGSTOP is named and every process of the run stops."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import (
    DEBUG,
    REPO,
    TORCHRUN,
    alive_pids,
    rank_pids,
    torchrun_workers,
    wait_for_training,
    wait_until_gone,
)

pytestmark = pytest.mark.e2e

FAST_WATCHDOG = ["--network.heartbeat=0.5s", "--network.stall_timeout=20s"]
"""Quicker than the defaults, yet long enough that a machine loaded several times over is not taken for a stall
(torchrun's store went 11 s without an answer while two test suites and a benchmark shared 2 cores)."""


def _complete_checkpoints(run_dir: Path) -> dict[Path, bytes]:
    root = run_dir / "checkpoints"
    done = [d for d in root.glob("step_*") if (d / "meta.json").is_file()] if root.is_dir() else []
    return {f: f.read_bytes() for d in done for f in sorted(d.rglob("*")) if f.is_file()}


def _kill_what_is_left(proc: subprocess.Popen, pids: list[int]) -> None:
    """After a test, pass or fail: no rank and no launcher of its run is left running."""
    for pid in alive_pids(pids):
        os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def _by_start_time(pids: list[int]) -> list[int]:
    """Ranks in spawn order (rank 0 first): field 22 of /proc/PID/stat is the start time in clock ticks."""
    return sorted(pids, key=lambda pid: int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]))


def test_a_stopped_rank_is_named_within_the_stall_timeout_and_every_rank_exits(tmp_path):
    run_dir = tmp_path / "stalled"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dilocox", "train", "--config", DEBUG, f"--run.out_dir={run_dir}",
         "--train.steps=100000", "--metrics.log_interval=1", "--eval.interval=0", "--checkpoint.interval=20",
         *FAST_WATCHDOG],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    ranks: list[int] = []
    try:
        wait_for_training(run_dir, proc)
        ranks = _by_start_time(rank_pids(proc.pid))
        assert len(ranks) == 2
        deadline = time.time() + 120
        while not _complete_checkpoints(run_dir) and time.time() < deadline:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        os.kill(ranks[1], signal.SIGSTOP)  # rank 1: cluster 1 of 2
        checkpoints = _complete_checkpoints(run_dir)
        assert checkpoints
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 4, stderr[-3000:]
        lines = [line for line in stderr.splitlines() if line.startswith("dilocox:")]
        assert len(lines) == 2, stderr[-3000:]
        assert lines[0].startswith("dilocox: error: rank 1 (cluster 1, dp 0, pp 0) has not sent a heartbeat for ")
        assert lines[0].endswith("s (network.stall_timeout = 20s): it is stopped, hung or cut off; the run stops")
        assert lines[1].startswith(
            "dilocox: a rank stopped sending heartbeats (named above): all 2 ranks stopped, exit 4"
        )
        assert "; resume it with `dilocox train " in lines[1] and f"--run.out_dir={run_dir}`" in lines[1]
        assert "Traceback" not in stderr
        assert not wait_until_gone(ranks), "a rank of the stopped run survived"
        # what was saved before the stall is intact; a checkpoint rank 0 was finishing may have landed, whole
        after = _complete_checkpoints(run_dir)
        assert {f: after.get(f) for f in checkpoints} == checkpoints, "the stalled run changed its checkpoints"
        assert all((d / "meta.json").is_file() for d in (run_dir / "checkpoints").glob("step_*"))
    finally:
        _kill_what_is_left(proc, ranks)


@pytest.mark.slow
def test_under_torchrun_a_stopped_rank_0_is_named_by_rank_1(tmp_path):
    """torchrun's agent serves the store, so rank 0 frozen does not silence it: rank 1 names rank 0 and exits 4;
    torchrun then sends the frozen worker SIGTERM, which waits until the process runs again (torchrun's own grace
    SIGKILLs it 30 s later). The test continues it once rank 1 has exited, as an operator would, rather than wait."""
    run_dir = tmp_path / "torchrun-stalled"
    proc = subprocess.Popen(
        [*TORCHRUN, "--monitor-interval=0.5", "-m", "dilocox", "train", "--config", DEBUG,
         f"--run.out_dir={run_dir}", "--train.steps=100000", "--metrics.log_interval=1", "--eval.interval=0",
         "--checkpoint.interval=0", *FAST_WATCHDOG],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"},
    )  # fmt: skip
    workers: list[int] = []
    try:
        wait_for_training(run_dir, proc)
        workers = _by_start_time(torchrun_workers(proc.pid))
        assert len(workers) == 2
        os.kill(workers[0], signal.SIGSTOP)
        assert not wait_until_gone(workers[1:]), "rank 1 did not stop after rank 0's stall"
        os.kill(workers[0], signal.SIGCONT)
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode != 0
        reports = [line for line in stderr.splitlines() if "has not sent a heartbeat" in line]
        assert len(reports) == 1, stderr[-3000:]
        assert reports[0].startswith("dilocox: error: rank 0 (cluster 0, dp 0, pp 0) has not sent a heartbeat for ")
        assert "exitcode  : 4" in stderr  # torchrun's report: rank 1 exited with EXIT_STALLED
        assert not wait_until_gone(workers)
    finally:
        _kill_what_is_left(proc, workers)
