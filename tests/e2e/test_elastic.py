"""Elastic clusters as a user meets them (docs/design.md §10.1): kill -9 one cluster's process mid-run; the others go
on, the launcher starts it again, it heals from a live peer and ends bit-identical to them."""

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dilocox.checkpoint import list_checkpoints, verify_checkpoint
from dilocox.metrics import read_metrics
from dilocox.net.lighthouse import run_lighthouse
from dilocox.tools.linkcheck import namespaces
from tests.e2e.helpers import (
    DEBUG,
    LOOPBACK,
    REPO,
    descendant_pids,
    dilocox,
    listening_sockets,
    non_loopback_interface,
    wait_until_gone,
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

    def __init__(self, run_dir: Path, *flags: str, env: dict | None = None, prefix: tuple[str, ...] = ()) -> None:
        self.run_dir = run_dir
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "dilocox", "train", "--config", DEBUG, f"--run.out_dir={run_dir}", *flags],
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

    def ranks_of(self, cluster: int) -> list[int]:
        """The pids of every rank of `cluster`'s last start, in rank order."""
        found = [re.match(rf"dilocox: elastic: cluster {cluster} started \(pid ([\d ]+),", line) for line in self.lines]
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
    """Starts `dilocox train` runs in tmp_path/NAME (or a given directory); each run's whole output is kept in
    tmp_path/NAME.log, and printed in full when the test fails (with every live rank's stack when it hung)."""
    runs: dict[str, Run] = {}

    def start(
        name: str, *flags: str, env: dict | None = None, run_dir: Path | None = None, prefix: tuple[str, ...] = ()
    ) -> Run:
        """`run_dir`: another run's directory (a run resumed there), by default tmp_path/NAME; `prefix`: what the
        command runs under (e.g. `ip netns exec NS`)."""
        runs[name] = Run(run_dir or tmp_path / name, *flags, env=env, prefix=prefix)
        return runs[name]

    yield start
    report = getattr(request.node, "rep_call", None)
    failed = report is None or report.failed
    for name, run in runs.items():
        run.stop(dump_stacks=failed)
        (tmp_path / f"{name}.log").write_text(run.output + "\n")
        if failed:
            print(f"----- the whole output of run {name!r} (exit code {run.proc.returncode}) -----\n{run.output}")


def _checkpoints(run_dir: Path) -> list[str]:
    """The complete checkpoints of a run directory, as `cluster{c}/step_N`, oldest first (`list_checkpoints`)."""
    return [str(path.relative_to(run_dir / "checkpoints")) for path in list_checkpoints(run_dir)]


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
    # each cluster's only checkpoint is the final one, written after the heal: there was nothing on disk it could read
    assert sorted(_checkpoints(tmp_path / "killed")) == [f"cluster{c}/step_{steps:08d}" for c in range(3)]
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
    proc, url = run_lighthouse("127.0.0.1:0", heartbeat="0.5s", stall_timeout="5s", cwd=REPO)
    try:
        yield url, proc
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
    assert "clusters [2] of this machine finished; the run's metrics and summary are written by cluster 0's " \
        "machine, each cluster's checkpoints by its own" in b.output  # fmt: skip
    assert not (tmp_path / "machine_b" / "summary.json").exists()
    # each machine holds its own clusters' checkpoints, from which it can resume
    assert sorted(_checkpoints(tmp_path / "machine_a")) == ["cluster0/step_00000040", "cluster1/step_00000040"]
    assert _checkpoints(tmp_path / "machine_b") == ["cluster2/step_00000040"]

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
    # the launcher watches the Lighthouse and stops its clusters once it has been silent for network.stall_timeout
    # (5 s here), or when a cluster fails first on it: long before network.timeout
    flags = [*ELASTIC, "--network.timeout=600s", "--topology.num_clusters=3", "--train.steps=100000",
             "--sync.inner_steps=10", f"--network.lighthouse={url}"]  # fmt: skip
    run = start_run("orphaned", *flags)
    run.wait_for_step(15)
    proc.kill()
    proc.wait()
    assert run.finish(timeout=120) == 1
    errors = [line for line in run.lines if line.startswith("dilocox: error:")]
    said = (
        rf"dilocox: error: the Lighthouse at {re.escape(url)} (does not answer|has not answered for \d+s \(network\.)"
    )
    assert len(errors) == 1 and re.match(said, errors[0]) and "so no cluster can go on" in errors[0], run.output
    # the command that starts it again (it wrote no checkpoint: checkpoint.interval = 0 and the run is far from its end)
    assert "; no checkpoint was written yet: `dilocox train --config " in errors[0], errors[0]
    assert errors[0].endswith(f"` on every machine of the run, once the Lighthouse at {url} runs starts the run again")
    assert "starting it again" not in run.output


@pytest.mark.timeout(240)
@pytest.mark.parametrize("shape", ["--topology.pp_degree=2", "--topology.dp_degree=2"], ids=["pp2", "dp2"])
def test_clusters_of_several_ranks_without_faults_are_bit_identical_to_the_static_run(tmp_path, start_run, shape):
    # each rank settles its stage's (and replica's) slice with the same rank of the other cluster, as in a static run
    flags = ["--topology.num_clusters=2", shape, "--train.steps=20", "--sync.inner_steps=5"]
    static_flags = [flag for flag in ELASTIC if not flag.startswith(("--topology.elastic", "--network."))]
    static = start_run("static", *static_flags, *flags)
    assert static.finish() == 0, "the static run failed"
    elastic = start_run("elastic", *ELASTIC, *flags)
    assert elastic.finish() == 0, "the elastic run failed"
    summaries = [json.loads((tmp_path / name / "summary.json").read_text()) for name in ("static", "elastic")]
    assert summaries[0]["final_eval_loss"] == summaries[1]["final_eval_loss"]
    losses = [[r["loss"] for r in read_metrics(tmp_path / name) if "loss" in r] for name in ("static", "elastic")]
    assert len(losses[0]) == 20 and losses[0] == losses[1]
    records = _records(tmp_path / "elastic")
    assert sorted(records) == [0, 1] and records[0]["outer_params_sha256"] == records[1]["outer_params_sha256"]


@pytest.mark.timeout(240)
def test_killing_one_rank_of_a_cluster_restarts_the_whole_cluster_which_heals_every_stage(tmp_path, start_run):
    steps = 40
    flags = [*ELASTIC, "--topology.num_clusters=3", "--topology.pp_degree=2", f"--train.steps={steps}",
             "--sync.inner_steps=10"]  # fmt: skip
    run = start_run("killed", *flags)
    run.wait_for_step(15)
    first_start = run.ranks_of(2)
    assert len(first_start) == 2
    os.kill(first_start[1], signal.SIGKILL)  # the last stage of cluster 2; its first stage is alive
    assert run.finish() == 0, "the run failed"
    out = run.output
    assert "dilocox: elastic: cluster 2 failed (exit code -9); starting it again" in out
    restarted = run.ranks_of(2)
    assert len(restarted) == 2 and not set(restarted) & set(first_start) and "start 2)" in out
    assert len(re.findall(r"dilocox: elastic: cluster 2 rejoined at step \d+ .*healed from a live peer", out)) == 1
    records = _records(tmp_path / "killed")
    assert sorted(records) == [0, 1, 2] and all(r["step"] == steps for r in records.values())
    # both stages' outer params (the digest of the stages' digests) are bit-identical on every cluster
    assert len({r["outer_params_sha256"] for r in records.values()}) == 1, records
    assert records[2]["healed_from_peer"] and not records[0]["healed_from_peer"]


@pytest.mark.timeout(300)
def test_hosts_in_network_namespaces_heal_a_killed_host_across_a_shaped_link(tmp_path, start_run):
    # Three "hosts": each a network namespace whose only way out is a veth capped at 100 Mbit/s by tc tbf (the
    # linkcheck tool's network), each running its own launcher for its one cluster; the Lighthouse runs on host 0.
    # Killing host 2's cluster: its launcher starts it again and it heals from a live peer across the shaped link.
    reason = namespaces.unavailable_reason()
    if reason is not None:
        pytest.skip(f"real network namespaces and tc shaping are not available here: {reason}")
    steps = 40
    with namespaces.shaped_network(3) as net:
        for command in namespaces.shape_commands(net, 12.5e6):  # 100 Mbit/s uplinks
            namespaces.run_command(command)
        env = {**os.environ, "GLOO_SOCKET_IFNAME": namespaces.CLUSTER_IFNAME, "PYTHONPATH": str(REPO)}
        host = [("ip", "netns", "exec", net.cluster_ns(cluster)) for cluster in range(3)]
        lighthouse, url = run_lighthouse(
            f"{net.cluster_addr(0)}:0", heartbeat="0.5s", stall_timeout="5s", prefix=host[0], env=env, cwd=REPO
        )
        try:
            flags = [*ELASTIC, "--topology.num_clusters=3", f"--train.steps={steps}", "--sync.inner_steps=10",
                     "--network.bandwidth=unlimited", f"--network.lighthouse={url}"]  # fmt: skip
            runs = [
                start_run(f"host{cluster}", *flags, f"--topology.local_clusters={cluster}",
                          f"--network.advertise_host={net.cluster_addr(cluster)}", env=env, prefix=host[cluster])
                for cluster in range(3)
            ]  # fmt: skip
            runs[0].wait_for_step(15)
            os.kill(runs[2].pid_of(2), signal.SIGKILL)
            assert [run.finish() for run in runs] == [0, 0, 0]
            shaped_bytes = [namespaces.qdisc_counters(net, cluster)["qdisc_bytes"] for cluster in range(3)]
        finally:
            lighthouse.terminate()
            lighthouse.wait(timeout=20)
    out = runs[2].output
    assert "dilocox: elastic: cluster 2 failed" in out and "start 2)" in out
    assert re.search(r"dilocox: elastic: cluster 2 rejoined at step \d+ .*healed from a live peer", out)
    records = {c: _records(tmp_path / f"host{c}")[c] for c in range(3)}
    assert len({r["outer_params_sha256"] for r in records.values()}) == 1, records  # bit-identical on every host
    assert records[2]["healed_from_peer"] and all(r["step"] == steps for r in records.values())
    # every host's traffic went through its shaped uplink, and the heal (at least the outer params, 4 bytes x 164,416
    # values) left one of the live hosts through it: that host sent about that much more than the other
    assert all(sent > 0 for sent in shaped_bytes), shaped_bytes
    assert abs(shaped_bytes[0] - shaped_bytes[1]) > 0.8 * 4 * 164_416, shaped_bytes


# checkpoints every round (H = 10) of a 30-step run of 2 clusters
ON_DISK = [*[f for f in ELASTIC if not f.startswith("--checkpoint.interval")], "--checkpoint.interval=10",
           "--topology.num_clusters=2", "--train.steps=30", "--sync.inner_steps=10"]  # fmt: skip


@pytest.mark.timeout(240)
def test_every_elastic_cluster_writes_checkpoints_that_verify_are_pruned_and_that_eval_and_export_read(
    tmp_path, start_run
):
    run = start_run("run", *ON_DISK, "--checkpoint.keep=2")
    assert run.finish() == 0, "the run failed"
    run_dir = tmp_path / "run"
    # each cluster is its own world and writes its own ranks' state, pruned to checkpoint.keep like a static run's
    assert _checkpoints(run_dir) == [
        "cluster1/step_00000020", "cluster0/step_00000020", "cluster1/step_00000030", "cluster0/step_00000030"
    ]  # fmt: skip
    for path in list_checkpoints(run_dir):
        meta = verify_checkpoint(path)  # every rank file listed, for a world of the cluster's dp x pp ranks
        assert meta["world_size"] == 1 and sorted(meta["files"]) == ["rank_00000.pt"]
        assert meta["elastic_cluster"] == int(path.parent.name.removeprefix("cluster"))

    loss = json.loads((run_dir / "summary.json").read_text())["final_eval_loss"]
    evaluated = dilocox("eval", run_dir, "--json", "--max-batches", "8")  # eval.final_max_batches = 8
    assert evaluated.returncode == 0, evaluated.stderr
    report = json.loads(evaluated.stdout)
    assert report["checkpoint"] == str(run_dir / "checkpoints" / "cluster0" / "step_00000030")
    assert report["loss"] == loss  # the agreed model (outer params) the run scored at its end
    exported = dilocox("export", run_dir, "--out", tmp_path / "hf", "--json")
    assert exported.returncode == 0, exported.stderr
    assert json.loads(exported.stdout)["weights"] == "outer parameters"
    assert (tmp_path / "hf" / "model.safetensors").is_file()

    # the run directory of an elastic run is not resumed as a static run (its rank files are per cluster)
    static = [f for f in ON_DISK if f != "--topology.elastic=true"]
    refused = dilocox("train", "--config", DEBUG, f"--run.out_dir={run_dir}", *static, "--train.steps=40")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f"dilocox: error: cannot resume {run_dir / 'checkpoints' / 'cluster0' / 'step_00000030'}: topology.elastic "
        "was true in the checkpoint, false now; resume with --topology.elastic=true or start a new run directory"
    ]


def _kill_entirely(run: Run, *checkpoints: Path) -> None:
    """SIGKILL the launcher and every process below it once each of `checkpoints` is complete."""
    deadline = time.monotonic() + 120
    while not all((path / "meta.json").is_file() for path in checkpoints):
        assert run.proc.poll() is None and time.monotonic() < deadline, f"no checkpoints {checkpoints}:\n{run.output}"
        time.sleep(0.02)
    pids = [run.proc.pid, *descendant_pids(run.proc.pid)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    run.finish()
    assert not wait_until_gone(pids), "processes of the killed run are still alive"


@pytest.mark.timeout(300)
def test_an_elastic_run_killed_entirely_resumes_from_disk_and_ends_as_the_uninterrupted_run(tmp_path, start_run):
    clean = start_run("clean", *ON_DISK, "--checkpoint.keep=5")
    assert clean.finish() == 0, "the clean run failed"
    clean_records = _records(tmp_path / "clean")

    killed = start_run("killed", *ON_DISK, "--checkpoint.keep=5")
    first = [tmp_path / "killed" / "checkpoints" / f"cluster{c}" / "step_00000010" for c in (0, 1)]
    _kill_entirely(killed, *first)
    shutil.copytree(tmp_path / "killed", tmp_path / "lost")  # the same run, where cluster 1's disk is lost below

    # every cluster loads its own checkpoint of step 10 (inner optimizer, data position, residuals, the sync in
    # flight) and presents that step to torchft: the run ends bit for bit as the uninterrupted one
    resumed = start_run("resumed", *ON_DISK, "--checkpoint.keep=5", f"--checkpoint.resume={first[0]}",
                        run_dir=tmp_path / "killed")  # fmt: skip
    assert resumed.finish() == 0, "the resumed run failed"
    records = _records(tmp_path / "killed")
    assert [records[c]["resumed_from_checkpoint"] for c in (0, 1)] == [str(path) for path in first]
    assert not any(r["healed_from_peer"] for r in records.values())
    for cluster in (0, 1):
        assert records[cluster]["outer_params_sha256"] == clean_records[cluster]["outer_params_sha256"]
    assert records[0]["last_eval_loss"] == clean_records[0]["last_eval_loss"]

    # cluster 1 has no checkpoint left: cluster 0 resumes from its own (checkpoint.resume = auto, the same command as
    # the first start) and cluster 1 heals from it at the first quorum, then trains the next round with it
    lost = tmp_path / "lost" / "checkpoints"
    for path in [*lost.glob("cluster1/step_*"), *[p for p in lost.glob("cluster0/step_*") if p.name > "step_00000010"]]:
        shutil.rmtree(path)
    healed = start_run("healed", *ON_DISK, "--checkpoint.keep=5", run_dir=tmp_path / "lost")
    assert healed.finish() == 0, "the run resumed without cluster 1's checkpoint failed"
    assert f"dilocox: resuming from {lost / 'cluster0' / 'step_00000010'} (checkpoint.resume = auto" in healed.output
    assert "cluster 1 rejoined at step 10 (outer step 1), healed from its peers resumed from disk" in healed.output
    records = _records(tmp_path / "lost")
    assert records[1]["healed_from_peer"] and records[1]["resumed_from_checkpoint"] is None
    assert records[0]["resumed_from_checkpoint"] == str(lost / "cluster0" / "step_00000010")
    assert records[0]["outer_params_sha256"] == records[1]["outer_params_sha256"]
    assert all(r["step"] == 30 for r in records.values())
    loss, clean_loss = records[0]["last_eval_loss"], clean_records[0]["last_eval_loss"]
    print(f"final eval loss: uninterrupted {clean_loss:.4f}, resumed with cluster 1 healed {loss:.4f}")
    assert abs(loss - clean_loss) / clean_loss < 0.05


@pytest.mark.timeout(300)
def test_when_every_cluster_dies_the_launcher_gives_the_command_that_resumes_the_run_from_disk(tmp_path, start_run):
    run = start_run("run", *ON_DISK)
    checkpoints = [tmp_path / "run" / "checkpoints" / f"cluster{c}" / "step_00000010" for c in (0, 1)]
    deadline = time.monotonic() + 120
    while not all((path / "meta.json").is_file() for path in checkpoints):
        assert run.proc.poll() is None and time.monotonic() < deadline, run.output
        time.sleep(0.02)
    for cluster in (0, 1):
        os.kill(run.pid_of(cluster), signal.SIGKILL)
    # the restarts meet each other only: none holds the run's state, so they stop rather than train it from step 0
    assert run.finish(timeout=120) == 1
    assert "no live cluster holds the run's state to heal from (every cluster died)" in run.output
    hint = [line for line in run.lines if line.startswith("dilocox: elastic: every cluster of this machine is lost")]
    assert len(hint) == 1, run.output
    command = re.search(r"resume it with `([^`]+)` \(from (\S+); checkpoint\.resume = auto\)", hint[0])
    assert command and shlex.split(command.group(1))[:2] == ["dilocox", "train"], hint[0]
    newest = Path(command.group(2))
    assert newest in list_checkpoints(tmp_path / "run") and newest.name >= "step_00000010"

    resumed = dilocox(*shlex.split(command.group(1))[1:])  # the command as printed
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"dilocox: resuming from {newest} (checkpoint.resume = auto" in resumed.stdout
    records = _records(tmp_path / "run")
    assert records[0]["resumed_from_checkpoint"] == str(newest) or records[0]["healed_from_peer"]
    assert records[0]["outer_params_sha256"] == records[1]["outer_params_sha256"]
    assert all(r["step"] == 30 for r in records.values())


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


@pytest.mark.timeout(240)
def test_a_resumed_run_waits_for_a_machine_that_starts_after_the_join_timeout(tmp_path, start_run, lighthouse):
    # Cluster 1 holds the newest checkpoint, cluster 0 an older one, and cluster 2's machine starts 8 s later than
    # the others, past the Lighthouse's join timeout (network.stall_timeout = 5 s): the first quorum forms without
    # it, cluster 0 heals there from cluster 1, and both must wait for cluster 2 rather than cluster 0 going on while
    # cluster 1 still waits (which broke cluster 0's first collective: "Connection closed by peer").
    flags = [*ELASTIC, "--topology.num_clusters=3", "--sync.inner_steps=10", "--checkpoint.interval=10",
             f"--network.lighthouse={lighthouse}", "--network.advertise_host=127.0.0.1"]  # fmt: skip
    first = start_run("first", *flags, "--train.steps=30")
    assert first.finish() == 0, "the first run failed"
    shutil.rmtree(tmp_path / "first" / "checkpoints" / "cluster0" / "step_00000030")
    shutil.copytree(tmp_path / "first", tmp_path / "machine_b")  # the same run directory on the late machine
    a = start_run("machine_a", *flags, "--train.steps=50", "--topology.local_clusters=0-1", run_dir=tmp_path / "first")
    deadline = time.time() + 60
    while not any("cluster 1 started" in line for line in a.lines) and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(8)
    b = start_run(
        "machine_b", *flags, "--train.steps=50", "--topology.local_clusters=2", run_dir=tmp_path / "machine_b"
    )
    assert (a.finish(), b.finish()) == (0, 0), "a launcher failed"
    assert "failed" not in a.output + b.output
    assert "cluster 0 rejoined at step 30 (outer step 3), healed from its peers resumed from disk" in a.output
    records = {**_records(tmp_path / "first"), **{2: _records(tmp_path / "machine_b")[2]}}
    assert all(r["step"] == 50 for r in records.values())
    assert len({r["outer_params_sha256"] for r in records.values()}) == 1, records
