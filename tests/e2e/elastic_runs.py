"""Elastic runs as the e2e tests start them (tests/e2e/test_elastic.py, test_elastic_resume.py): `dilocox train` in a
subprocess (`Run`), the settings they share and what they read back from a run directory."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from dilocox.checkpoint import list_checkpoints
from dilocox.metrics import read_metrics
from tests.e2e.helpers import DEBUG, REPO, default_sigint

ELASTIC = [
    "--topology.elastic=true", "--preset=dilocox-lowrank", "--sync.merge=eager", "--sync.local_residual=false",
    "--sync.drain_residual=false", "--network.heartbeat=0.5s", "--network.stall_timeout=5s",
    "--network.timeout=60s", "--eval.interval=0", "--eval.final_max_batches=8", "--checkpoint.interval=0",
    "--metrics.log_interval=1",
]  # fmt: skip


class Run:
    """`dilocox train` in a subprocess, its output read as it comes (the launcher prints each cluster's pid)."""

    def __init__(
        self,
        run_dir: Path,
        *flags: str,
        env: dict | None = None,
        prefix: tuple[str, ...] = (),
        torchrun: tuple[str, ...] | None = None,
    ) -> None:
        """`torchrun`: run `dilocox train` as the workers of a torchrun agent started with these arguments."""
        self.run_dir = run_dir
        launcher = ["-m", "dilocox"]
        if torchrun is not None:
            launcher = ["-m", "torch.distributed.run", *torchrun, *launcher]
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, *launcher, "train", "--config", DEBUG, f"--run.out_dir={run_dir}", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env,
            preexec_fn=default_sigint,  # the Ctrl+C test's signal must not be ignored under a CI script's `cmd &`
        )  # fmt: skip
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def pids(self) -> dict[int, list[int]]:
        """Every process the launcher started, by cluster, in the order they were started."""
        started: dict[int, list[int]] = {}
        for line in list(self.lines):
            found = re.search(r"dilocox: elastic: cluster (\d+) started \(pid (\d+)", line)
            if found:
                started.setdefault(int(found.group(1)), []).append(int(found.group(2)))
        return started

    def ranks_of(self, cluster: int) -> list[int]:
        """The pids of every rank of `cluster`'s last start, in rank order."""
        # searched, not matched: a rank's progress line may still lack its newline when the launcher prints
        found = [
            re.search(rf"dilocox: elastic: cluster {cluster} started \(pid ([\d ]+),", line) for line in self.lines
        ]
        starts = [match.group(1).split() for match in found if match]
        assert starts, f"cluster {cluster} has no pid line:\n{self.output}"
        return [int(pid) for pid in starts[-1]]

    def pid_of(self, cluster: int) -> int:
        started = self.pids().get(cluster)
        assert started, f"cluster {cluster} has no pid line:\n{self.output}"
        return started[-1]

    def wait_for_step(self, step: int, timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            steps = [record["step"] for record in read_metrics(self.run_dir)]  # complete lines only; none yet: []
            if steps and steps[-1] >= step:
                return
            assert self.proc.poll() is None, f"the run ended before step {step}"
            time.sleep(0.05)
        raise AssertionError(f"step {step} not reached within {timeout:.0f} s")

    def wait_for_line(self, text: str, timeout: float = 120) -> None:
        """Return once the run printed a line holding `text`, the run still going."""
        deadline = time.time() + timeout
        while not any(text in line for line in list(self.lines)):
            assert self.proc.poll() is None, f"the run ended without printing {text!r}"
            assert time.time() < deadline, f"{text!r} not printed within {timeout:.0f} s"
            time.sleep(0.05)

    def finish(self, timeout: float = 150) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code

    def stop(self, *, dump_stacks: bool) -> None:
        """End a run that is still going (a failed or timed-out test): with `dump_stacks`, every live rank first
        prints where its threads are (faulthandler on SIGUSR1), so a hang shows where it waited."""
        if self.proc.poll() is not None:
            return
        if dump_stacks:
            for pid in [pid for pids in self.pids().values() for pid in pids]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)
            time.sleep(2)
        self.proc.terminate()  # the launcher stops its ranks, like Ctrl+C
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=10)

    @property
    def output(self) -> str:
        return "\n".join(self.lines)


def checkpoints_of(run_dir: Path) -> list[str]:
    """The complete checkpoints of a run directory, as `cluster{c}/step_N`, oldest first (`list_checkpoints`)."""
    return [str(path.relative_to(run_dir / "checkpoints")) for path in list_checkpoints(run_dir)]


def records_of(run_dir: Path) -> dict[int, dict]:
    return {
        int(p.stem.removeprefix("cluster")): json.loads(p.read_text()) for p in (run_dir / "elastic").glob("*.json")
    }
