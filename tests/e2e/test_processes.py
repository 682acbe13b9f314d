"""The processes of a run as a user meets them: Ctrl+C, SIGTERM and a killed launcher stop every rank, a crashed
rank stops the others, a live run locks its directory; torchrun runs each rank and a rerun resumes."""

import json
import os
import signal
import subprocess
import time

import pytest

from tests.e2e.helpers import (
    DEBUG,
    REPO,
    TORCHRUN,
    alive_pids,
    descendant_pids,
    dilocox,
    metrics,
    rank_pids,
    start_long_run,
    torchrun_workers,
    wait_for_training,
    wait_until_gone,
)

pytestmark = pytest.mark.e2e


def test_ctrl_c_stops_all_ranks(tmp_path):
    run_dir = tmp_path / "interrupted"
    proc = start_long_run(run_dir)
    wait_for_training(run_dir, proc)
    ranks = descendant_pids(proc.pid)
    assert len(rank_pids(proc.pid)) == 2
    os.kill(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr[-3000:]
    assert "dilocox: interrupted, all 2 ranks stopped; no checkpoint was written yet: `dilocox train " in stderr
    assert not wait_until_gone(ranks)


def test_a_live_run_locks_its_directory_and_sigterm_stops_every_rank(tmp_path):
    """A second run into a live run's directory is refused; SIGTERM to the launcher stops every rank and frees the
    lock; a shorter run then starts beside the stopped one, in a directory of its own."""
    run_dir = tmp_path / "locked"
    proc = start_long_run(run_dir)
    wait_for_training(run_dir, proc)
    ranks = descendant_pids(proc.pid)
    assert len(rank_pids(proc.pid)) == 2
    second = dilocox("train", "--config", DEBUG, f"--run.out_dir={run_dir}", timeout=60)
    assert second.returncode == 2 and f"in use by a live run (pid {proc.pid}" in second.stderr
    os.kill(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "stopped by SIGTERM, all 2 ranks stopped" in stderr
    assert not wait_until_gone(ranks)
    assert not (run_dir / ".dilocox.lock").exists()
    again = dilocox("train", "--config", DEBUG, f"--run.out_dir={run_dir}", "--train.steps=10", timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{run_dir} holds a run of other settings (train.steps: 100000 -> 10)" in again.stdout
    assert json.loads((tmp_path / "locked-2" / "summary.json").read_text())["steps"] == 10


def test_ranks_die_with_a_killed_launcher(tmp_path):
    run_dir = tmp_path / "orphans"
    proc = start_long_run(run_dir)
    wait_for_training(run_dir, proc)
    ranks, everything = rank_pids(proc.pid), descendant_pids(proc.pid)
    assert len(ranks) == 2 and len(everything) >= 3  # the fork server, its 2 ranks (and a resource tracker)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    wait_until_gone(everything)
    assert not alive_pids(ranks), "ranks kept training after their launcher was killed"
    assert not alive_pids(everything), "the fork server or the resource tracker outlived the launcher"


def test_crashed_rank_stops_the_others(tmp_path):
    run_dir = tmp_path / "crashed"
    proc = start_long_run(run_dir)
    wait_for_training(run_dir, proc)
    ranks = rank_pids(proc.pid)
    assert len(ranks) == 2
    os.kill(ranks[-1], signal.SIGKILL)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "failed" in stderr and "all ranks stopped" in stderr


@pytest.mark.slow
def test_torchrun_runs_each_rank(tmp_path):
    run_dir = tmp_path / "torchrun"
    result = subprocess.run(
        [*TORCHRUN, "-m", "dilocox", "train", "--config", DEBUG, f"--run.out_dir={run_dir}", "--train.steps=20"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
        env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 20 and summary["outer_steps"] == 2
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]


@pytest.mark.slow
def test_torchrun_rerun_after_a_killed_rank_resumes_where_it_stopped(tmp_path):
    """A worker killed under torchrun ends the job; starting the same command again (what torchrun --max-restarts
    or a job scheduler does) resumes from the newest checkpoint under checkpoint.resume = auto, taking over the
    lock its dead rank 0 left, and finishes with every step logged once."""

    def torchrun(steps: int) -> subprocess.Popen:
        return subprocess.Popen(
            [*TORCHRUN, "--monitor-interval=0.5", "-m", "dilocox", "train", "--config", DEBUG,
             f"--run.out_dir={run_dir}", f"--train.steps={steps}", "--checkpoint.interval=20", "--eval.interval=0"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
            env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"},
        )  # fmt: skip

    run_dir = tmp_path / "restarted"
    proc = torchrun(200)
    deadline = time.time() + 180
    while not list((run_dir / "checkpoints").glob("step_*")) and time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    workers = torchrun_workers(proc.pid)
    assert workers, "no torchrun worker found"
    os.kill(workers[0], signal.SIGKILL)  # rank 0: it holds the run directory's lock
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    done = max(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))
    again = torchrun(200)
    stdout, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr[-3000:]
    assert f"resuming from {run_dir / 'checkpoints'}" in stdout and "stale lock" in stderr
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 200
    steps = [r["step"] for r in metrics(run_dir)]
    assert steps == sorted(set(steps)) and steps[-1] == 200 and done < 200  # redone steps were truncated, not doubled
