"""What the e2e tests share: `dilocox` in a subprocess, its metrics, and the processes of a running launcher."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dilocox.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
DEBUG = str(REPO / "configs" / "debug.toml")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
"""torchrun with 2 workers on this machine; the program and its arguments follow."""


def dilocox(*args, timeout=240, env=None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dilocox", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=REPO,
        **kwargs,
    )


def metrics(run_dir: Path) -> list[dict]:
    assert (run_dir / "metrics.jsonl").is_file(), f"{run_dir} has no metrics.jsonl"
    return read_metrics(run_dir)


def child_pids(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def rank_pids(launcher: int) -> list[int]:
    """The ranks of a local launcher: the children of its fork server (`launch_local`)."""
    servers = [pid for pid in child_pids(launcher) if "forkserver" in Path(f"/proc/{pid}/cmdline").read_text()]
    return [rank for server in servers for rank in child_pids(server)]


def descendant_pids(pid: int) -> list[int]:
    """Every process below `pid`: the launcher's fork server, its ranks, multiprocessing's resource tracker."""
    return [d for child in child_pids(pid) for d in (child, *descendant_pids(child))]


def wait_for_training(run_dir: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text().strip():
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    raise AssertionError("training did not start")


def alive_pids(pids: list[int]) -> list[int]:
    return [
        pid
        for pid in pids
        if Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    ]


def wait_until_gone(pids: list[int], timeout: float = 120) -> list[int]:
    """Wait for `pids` to exit; returns those still alive after `timeout` (a hang guard, not a speed bound: processes
    that stop at all stop within seconds)."""
    deadline = time.monotonic() + timeout
    while (alive := alive_pids(pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def start_long_run(run_dir: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dilocox",
            "train",
            "--config",
            DEBUG,
            f"--run.out_dir={run_dir}",
            "--train.steps=100000",
            "--metrics.log_interval=1",
            "--eval.interval=0",
            "--checkpoint.interval=0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        # as from a terminal: a shell's background job (a CI script's `cmd &`) would hand down SIGINT ignored, and
        # Python then never raises KeyboardInterrupt, so Ctrl+C could not be tested
        preexec_fn=_default_sigint,
    )


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def torchrun_workers(torchrun: int) -> list[int]:
    """The dilocox workers of a torchrun job: the children of torchrun or of its agent process."""
    return [
        pid
        for agent in [torchrun, *child_pids(torchrun)]
        for pid in child_pids(agent)
        if "dilocox" in Path(f"/proc/{pid}/cmdline").read_text()
    ]
