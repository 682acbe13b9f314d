"""Elastic clusters as a user meets them (docs/design.md §10.1): kill -9 one cluster's process mid-run; the others go
on, the launcher starts it again, it heals from a live peer and ends bit-identical to them."""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dilocox.metrics import read_metrics
from tests.e2e.helpers import (
    DEBUG,
    LOOPBACK,
    REPO,
    descendant_pids,
    dilocox,
    listening_sockets,
    non_loopback_interface,
)

pytest.importorskip("torchft")
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ELASTIC = [
    "--topology.elastic=true", "--preset=dilocox-lowrank", "--sync.merge=eager", "--sync.local_residual=false",
    "--sync.drain_residual=false", "--network.heartbeat=0.5s", "--network.stall_timeout=5s",
    "--network.timeout=60s", "--eval.interval=0", "--eval.final_max_batches=8", "--checkpoint.interval=0",
    "--metrics.log_interval=1",
]  # fmt: skip


class Run:
    """`dilocox train` in a subprocess, its output read as it comes (the launcher prints each cluster's pid)."""

    def __init__(self, run_dir: Path, *flags: str, env: dict | None = None) -> None:
        self.run_dir = run_dir
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dilocox", "train", "--config", DEBUG, f"--run.out_dir={run_dir}", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env,
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
            found = re.match(r"dilocox: elastic: cluster (\d+) started \(pid (\d+)", line)
            if found:
                started.setdefault(int(found.group(1)), []).append(int(found.group(2)))
        return started

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


@pytest.fixture
def start_run(request, tmp_path):
    """Starts `dilocox train` runs in tmp_path/NAME; each run's whole output is kept in tmp_path/NAME.log, and
    printed in full when the test fails (with every live rank's stack when it hung)."""
    runs: dict[str, Run] = {}

    def start(name: str, *flags: str, env: dict | None = None) -> Run:
        runs[name] = Run(tmp_path / name, *flags, env=env)
        return runs[name]

    yield start
    report = getattr(request.node, "rep_call", None)
    failed = report is None or report.failed
    for name, run in runs.items():
        run.stop(dump_stacks=failed)
        (tmp_path / f"{name}.log").write_text(run.output + "\n")
        if failed:
            print(f"----- the whole output of run {name!r} (exit code {run.proc.returncode}) -----\n{run.output}")


def _records(run_dir: Path) -> dict[int, dict]:
    return {
        int(p.stem.removeprefix("cluster")): json.loads(p.read_text()) for p in (run_dir / "elastic").glob("*.json")
    }


@pytest.mark.timeout(240)
def test_a_killed_cluster_rejoins_heals_from_a_peer_and_ends_bit_identical(tmp_path, start_run):
    steps = 40
    flags = [*ELASTIC, "--topology.num_clusters=3", f"--train.steps={steps}", "--sync.inner_steps=10"]
    clean = start_run("clean", *flags)
    assert clean.finish() == 0, "the clean run failed"
    clean_summary = json.loads((tmp_path / "clean" / "summary.json").read_text())
    clean_loss = clean_summary["final_eval_loss"]
    # cluster 0's slow-link bytes against what AllReduce would have sent from its place among the 3 clusters, and the
    # summary says so; no line about NCCL's flight recorder (torchft warns about it on a CPU build, for a gloo group)
    assert clean_summary["allreduce_equiv_bytes"] > clean_summary["wan_bytes_total"] > 0
    assert clean_summary["wan_bytes_clusters"] == [0]
    assert "sent by cluster 0's ranks" in clean.output and "flight recorder" not in clean.output

    run = start_run("killed", *flags)
    # mid-round (rounds end at multiples of 10). The restarted process is forked in a second or a few: it rejoins at
    # a round boundary, or, if the others reach the end first, at the end of training, where they wait for it
    # (ElasticMembership.wait_for_restarts); either way it heals from a live peer
    run.wait_for_step(15)
    os.kill(run.pid_of(2), signal.SIGKILL)
    assert run.finish() == 0, "the killed run failed"
    out = run.output
    assert "dilocox: elastic: cluster 2 failed" in out
    assert "dilocox: elastic: cluster 2 started" in out and "start 2)" in out
    assert re.search(r"dilocox: elastic: cluster 2 rejoined at step \d+ .*healed from a live peer", out)

    records = _records(tmp_path / "killed")
    assert sorted(records) == [0, 1, 2]
    digests = {r["outer_params_sha256"] for r in records.values()}
    assert len(digests) == 1, records  # the agreed parameters are bit-identical on every cluster
    assert records[2]["healed_from_peer"] and records[2]["resumed_from_checkpoint"] is None
    # the only checkpoint is the final one, written after the heal: there was nothing on disk it could have read
    assert [p.name for p in (tmp_path / "killed" / "checkpoints").iterdir()] == [f"step_{steps:08d}"]
    assert not records[0]["healed_from_peer"] and not records[1]["healed_from_peer"]
    assert all(r["step"] == steps for r in records.values())

    loss = json.loads((tmp_path / "killed" / "summary.json").read_text())["final_eval_loss"]
    waited = "waits for restarted clusters [2] before the last sync" in out
    print(
        f"final eval loss: clean {clean_loss:.4f}, with cluster 2 killed and rejoined at step "
        f"{records[2]['rejoined_at_step']} {loss:.4f} ({'at the end, the others waited' if waited else 'mid-run'})"
    )
    assert abs(loss - clean_loss) / clean_loss < 0.05


@pytest.mark.timeout(240)
def test_a_one_machine_elastic_run_listens_on_the_loopback_only(start_run):
    # the launcher's cluster stores and Lighthouse; in each cluster torchft's manager server, its heal server (it
    # serves the outer params), the round's gloo group and the cluster's own gloo groups: none of them beyond the
    # loopback, even for a user who keeps GLOO_SOCKET_IFNAME on a network interface (docs/design.md §11)
    env = {key: value for key, value in os.environ.items() if key != "GLOO_SOCKET_IFNAME"}
    interface = non_loopback_interface()
    if interface is not None:
        env["GLOO_SOCKET_IFNAME"] = interface
    flags = [*ELASTIC, "--topology.num_clusters=2", "--train.steps=100000", "--sync.inner_steps=10"]
    run = start_run("listening", *flags, env=env)
    run.wait_for_step(12, timeout=240)  # past the first boundary: the round's group is built
    launcher = run.proc.pid
    listening = {pid: listening_sockets(pid) for pid in [launcher, *descendant_pids(launcher)]}
    assert len(listening[launcher]) == 2 + 1, listening  # a store per cluster and the Lighthouse
    clusters = [run.pid_of(cluster) for cluster in (0, 1)]
    assert all(len(listening[pid]) >= 3 for pid in clusters), listening  # manager, heal server, gloo groups
    outside = {pid: [s for s in sockets if s[0] not in LOOPBACK] for pid, sockets in listening.items()}
    assert not any(outside.values()), f"listening beyond the loopback (GLOO_SOCKET_IFNAME={interface}): {outside}"


def test_below_min_clusters_the_run_stops_with_one_line(start_run):
    flags = [*ELASTIC, "--topology.num_clusters=2", "--sync.min_clusters=2", "--topology.max_cluster_restarts=0",
             "--train.steps=100000", "--sync.inner_steps=10"]  # fmt: skip
    run = start_run("few", *flags)
    run.wait_for_step(15)
    os.kill(run.pid_of(1), signal.SIGKILL)
    assert run.finish(timeout=120) == 2
    errors = [line for line in run.lines if line.startswith("dilocox: error:")]
    assert errors == [
        "dilocox: error: only 1 of 2 clusters (clusters [0]) are left in the round, fewer than sync.min_clusters = 2: "
        "the run stops"
    ]


@pytest.fixture
def lighthouse_proc():
    """`dilocox lighthouse` in a subprocess, with the heartbeat and stall timeout of ELASTIC: (its URL, process)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dilocox", "lighthouse", "--bind", "127.0.0.1:0", "--network.heartbeat=0.5s",
         "--network.stall_timeout=5s"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        found = re.search(r"--network\.lighthouse=(http://\S+);", first)
        assert found, f"no address in the lighthouse's first line: {first!r}"
        yield found.group(1), proc
    finally:
        if proc.poll() is None:  # a test may have killed it
            proc.terminate()
            assert proc.wait(timeout=20) == 0  # SIGTERM is its normal end
            assert proc.stdout.read().strip() == "dilocox: lighthouse stopped"


@pytest.fixture
def lighthouse(lighthouse_proc):
    """The URL of a `dilocox lighthouse` (`lighthouse_proc`)."""
    return lighthouse_proc[0]


@pytest.mark.timeout(240)
def test_clusters_of_two_launchers_meet_at_one_lighthouse_and_a_killed_one_heals_across_them_authenticated(
    tmp_path, start_run, lighthouse
):
    # two machines, as two launchers that share nothing but the Lighthouse, the network and the payload key: A starts
    # clusters 0 and 1, B starts cluster 2, each with its own run directory
    steps = 40
    key = tmp_path / "wan.key"
    key.write_bytes(bytes(range(32)))
    flags = [*ELASTIC, "--topology.num_clusters=3", f"--train.steps={steps}", "--sync.inner_steps=10",
             f"--network.auth_key_file={key}"]  # fmt: skip
    static = start_run("static", *[f for f in flags if f != "--topology.elastic=true"])
    assert static.finish() == 0, "the static run failed"
    static_loss = json.loads((tmp_path / "static" / "summary.json").read_text())["final_eval_loss"]

    across = [*flags, f"--network.lighthouse={lighthouse}", "--network.advertise_host=127.0.0.1"]
    a = start_run("machine_a", *across, "--topology.local_clusters=0-1")
    b = start_run("machine_b", *across, "--topology.local_clusters=2")
    a.wait_for_step(15)  # mid-round: cluster 0 (on A) writes the run's metrics
    os.kill(b.pid_of(2), signal.SIGKILL)
    assert a.finish() == 0, "launcher A failed"
    assert b.finish() == 0, "launcher B failed"
    assert sorted(a.pids()) == [0, 1] and sorted(b.pids()) == [2]
    assert "dilocox: elastic: cluster 2 failed" in b.output and "start 2)" in b.output
    assert re.search(r"dilocox: elastic: cluster 2 rejoined at step \d+ .*healed from a live peer", b.output)
    assert "clusters [2] of this machine finished; the run's metrics, summary and checkpoints are written by " \
        "cluster 0's machine" in b.output  # fmt: skip
    assert not (tmp_path / "machine_b" / "summary.json").exists()

    records = {**_records(tmp_path / "machine_a"), **_records(tmp_path / "machine_b")}
    assert sorted(_records(tmp_path / "machine_a")) == [0, 1] and sorted(_records(tmp_path / "machine_b")) == [2]
    assert len({r["outer_params_sha256"] for r in records.values()}) == 1, records  # bit-identical across machines
    assert records[2]["healed_from_peer"] and not records[0]["healed_from_peer"]
    assert all(r["step"] == steps for r in records.values())
    summary = json.loads((tmp_path / "machine_a" / "summary.json").read_text())
    assert summary["payloads_rejected"] == 0  # every payload was tagged under the shared key and verified
    assert "rejected the slow-link payload" not in a.output + b.output
    loss = summary["final_eval_loss"]
    print(f"final eval loss: static {static_loss:.4f}, two launchers with cluster 2 killed and healed {loss:.4f}")
    assert abs(loss - static_loss) / static_loss < 0.05


@pytest.mark.timeout(180)
def test_machines_started_with_other_settings_stop_with_one_line_at_the_first_boundary(tmp_path, start_run, lighthouse):
    flags = [*ELASTIC, "--topology.num_clusters=3", "--train.steps=40", "--sync.inner_steps=10",
             f"--network.lighthouse={lighthouse}", "--network.advertise_host=127.0.0.1"]  # fmt: skip
    a = start_run("machine_a", *flags, "--topology.local_clusters=0-1")
    b = start_run("machine_b", *flags, "--topology.local_clusters=2", "--train.lr=1e-3")  # a typo on one machine
    assert (a.finish(), b.finish()) == (2, 2)
    same = (
        r" \(train\.lr: 0\.003 on clusters 0-1, 0\.001 on cluster 2\): every machine must give the same values "
        r"to \[model\], \[data\], .* and run\.seed, except data\.path"
    )
    for run, pattern in [(a, r"clusters \[2\] run other settings than cluster [01]"),
                         (b, r"clusters \[0, 1\] run other settings than cluster 2")]:  # fmt: skip
        errors = [line for line in run.lines if line.startswith("dilocox: error:")]
        assert len(errors) == 1 and re.match(f"dilocox: error: {pattern}{same}", errors[0]), run.output
    assert not (tmp_path / "machine_a" / "checkpoints").exists()


@pytest.mark.timeout(180)
def test_when_the_lighthouse_dies_the_launcher_stops_its_clusters_with_one_line(start_run, lighthouse_proc):
    # restarting clusters cannot help (each would wait network.timeout for the Lighthouse): one line and exit 1
    url, proc = lighthouse_proc
    flags = [*ELASTIC, "--network.timeout=10s", "--topology.num_clusters=3", "--train.steps=100000",
             "--sync.inner_steps=10", f"--network.lighthouse={url}"]  # fmt: skip
    run = start_run("orphaned", *flags)
    run.wait_for_step(15)
    proc.kill()
    proc.wait()
    assert run.finish(timeout=120) == 1
    errors = [line for line in run.lines if line.startswith("dilocox: error:")]
    assert len(errors) == 1 and errors[0].startswith(f"dilocox: error: the Lighthouse at {url} does not answer, so no "
                                                     "cluster can go on"), run.output  # fmt: skip
    assert "starting it again" not in run.output


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("http://[::1", "network.lighthouse = 'http://[::1' is not a URL (Invalid IPv6 URL)"),
        ("unreachable", "no Lighthouse answers at network.lighthouse = http://127.0.0.1:"),
    ],
)
def test_a_bad_or_unreachable_lighthouse_url_fails_with_one_line_and_nothing_written(tmp_path, url, said):
    with socket.socket() as unused:  # bound, never listening: nothing answers there
        unused.bind(("127.0.0.1", 0))
        if url == "unreachable":
            url = f"http://127.0.0.1:{unused.getsockname()[1]}"
        result = dilocox("train", "--config", DEBUG, f"--run.out_dir={tmp_path / 'run'}", *ELASTIC,
                         "--topology.num_clusters=3", f"--network.lighthouse={url}", timeout=120)  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == "" and result.stderr.count("\n") == 1, result.stderr  # one line, no traceback
    assert result.stderr.startswith(f"dilocox: error: {said}")
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(240)
def test_a_stopped_cluster_is_named_left_out_and_the_run_finishes_with_the_change_recorded_and_plotted(
    tmp_path, start_run
):
    # SIGSTOP freezes every thread of cluster 2, its heartbeat to the Lighthouse too: the others name it within
    # network.stall_timeout (5 s, far below network.timeout = 60 s), in the round's transfer if it froze there, or at
    # the next round's quorum, and go on without it; SIGCONT: it finds itself behind, and heals or is stopped
    flags = [*ELASTIC, "--topology.num_clusters=3", "--train.steps=40", "--sync.inner_steps=10"]
    run = start_run("stopped", *flags)
    run.wait_for_step(15)
    victim = run.pid_of(2)
    os.kill(victim, signal.SIGSTOP)
    try:
        deadline = time.time() + 120
        while not [r for r in read_metrics(tmp_path / "stopped") if r.get("event") == "elastic"]:
            assert time.time() < deadline and run.proc.poll() is None, "cluster 2's stop was never recorded"
            time.sleep(0.1)
    finally:
        os.kill(victim, signal.SIGCONT)
    assert run.finish() == 0, "the run failed"
    records = read_metrics(tmp_path / "stopped")
    events = [r for r in records if r.get("event") == "elastic"]
    first = events[0]
    assert (first["cluster"], first["kind"]) in {(2, "stalled"), (2, "left")}, events
    assert first["seconds"] > 2 * 0.5 and "no heartbeat for" in first["reason"]  # silent past the heartbeat timeout
    line = f"dilocox: elastic: cluster 2 {first['kind']} at step {first['step']}: no heartbeat for"
    assert sum(line in out_line for out_line in run.lines) == 1, run.output  # one line, by one cluster
    # the others went on without it: a round settled without cluster 2 after its stop, and the run reached its end
    steps = [(r["step"], r["round_clusters"]) for r in records if "round_clusters" in r]
    assert any(step >= first["step"] and clusters == [0, 1] for step, clusters in steps), steps
    assert steps[-1][0] == 40
    ended = _records(tmp_path / "stopped")
    assert len({r["outer_params_sha256"] for r in ended.values() if r["step"] == 40}) == 1, ended

    assert dilocox("plot", str(tmp_path / "stopped"), "--out", str(tmp_path / "plots")).returncode == 0
    assert (tmp_path / "plots" / "membership.png").is_file()
