"""Fixtures of the elastic e2e tests: runs of `dilocox train` that are stopped and logged whatever the test's end, and
a `dilocox lighthouse` in a subprocess."""

from pathlib import Path

import pytest

from dilocox.elastic.lighthouse import run_lighthouse
from tests.e2e.elastic_runs import Run
from tests.e2e.helpers import REPO


@pytest.fixture
def start_run(request, tmp_path):
    """Starts `dilocox train` runs in tmp_path/NAME (or a given directory); each run's whole output is kept in
    tmp_path/NAME.log, and printed in full when the test fails (with every live rank's stack when it hung)."""
    runs: dict[str, Run] = {}

    def start(
        name: str,
        *flags: str,
        env: dict | None = None,
        run_dir: Path | None = None,
        prefix: tuple[str, ...] = (),
        torchrun: tuple[str, ...] | None = None,
    ) -> Run:
        """`run_dir`: another run's directory (a run resumed there), by default tmp_path/NAME; `prefix`: what the
        command runs under (e.g. `ip netns exec NS`); `torchrun`: the arguments of a torchrun agent that starts it."""
        runs[name] = Run(run_dir or tmp_path / name, *flags, env=env, prefix=prefix, torchrun=torchrun)
        return runs[name]

    yield start
    report = getattr(request.node, "rep_call", None)
    failed = report is None or report.failed
    for name, run in runs.items():
        run.stop(dump_stacks=failed)
        (tmp_path / f"{name}.log").write_text(run.output + "\n")
        if failed:
            print(f"----- the whole output of run {name!r} (exit code {run.proc.returncode}) -----\n{run.output}")


@pytest.fixture
def lighthouse_proc(request, tmp_path):
    """`dilocox lighthouse` in a subprocess, with the heartbeat and stall timeout of ELASTIC: (its URL, process).
    Quiet by default: none of torchft's per-quorum INFO lines, while the clusters of the test meet there. A test whose
    rounds must keep every cluster however loaded the machine is passes a longer heartbeat (indirect parametrize): a
    cluster is left out after 2 heartbeats of silence."""
    log = tmp_path / "lighthouse.stderr"
    heartbeat = getattr(request, "param", "0.5s")
    proc, url = run_lighthouse("127.0.0.1:0", heartbeat=heartbeat, stall_timeout="5s", cwd=REPO, log=log)
    try:
        yield url, proc
    finally:
        if proc.poll() is None:  # a test may have killed it
            proc.terminate()
            assert proc.wait(timeout=20) == 0  # SIGTERM is its normal end
            assert proc.stdout.read().strip() == "dilocox: lighthouse stopped"
        assert "Quorum status" not in log.read_text()


@pytest.fixture
def lighthouse(lighthouse_proc):
    """The URL of a `dilocox lighthouse` (`lighthouse_proc`)."""
    return lighthouse_proc[0]
