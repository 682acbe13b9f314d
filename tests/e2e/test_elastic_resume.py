"""Elastic runs on disk (docs/design.md §10.1): every cluster's checkpoints, a run killed entirely that resumes from
disk, a cluster whose disk fills, a bad Lighthouse URL, a stopped cluster named and recorded, a machine that starts
late."""

import contextlib
import json
import os
import re
import resource
import shlex
import shutil
import signal
import socket
import time
from pathlib import Path

import pytest

from dilocox.checkpoint import list_checkpoints, verify_checkpoint
from dilocox.metrics import read_metrics
from tests.e2e.elastic_runs import ELASTIC, Run, checkpoints_of, records_of
from tests.e2e.helpers import (
    DEBUG,
    descendant_pids,
    dilocox,
    wait_until_gone,
)

pytest.importorskip("torchft")
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

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
    assert checkpoints_of(run_dir) == [
        "cluster1/step_00000020", "cluster0/step_00000020", "cluster1/step_00000030", "cluster0/step_00000030"
    ]  # fmt: skip
    for path in list_checkpoints(run_dir):
        meta = verify_checkpoint(path)  # every rank file listed, for a world of the cluster's dp x pp ranks
        assert meta["world_size"] == 1 and sorted(meta["files"]) == [".metadata", "__0_0.distcp"]
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

    # the run directory of an elastic run is not resumed as a static run (its rank files are per cluster); without
    # --checkpoint.resume=latest a static run would be a new one beside it (another setting)
    static = [f for f in ON_DISK if f != "--topology.elastic=true"]
    refused = dilocox("train", "--config", DEBUG, f"--run.out_dir={run_dir}", *static, "--train.steps=40",
                      "--checkpoint.resume=latest")  # fmt: skip
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f"dilocox: error: cannot resume {run_dir / 'checkpoints' / 'cluster0' / 'step_00000030'}: topology.elastic "
        "was true in the checkpoint, false now; resume with --topology.elastic=true or start a new run directory"
    ]


def _wait_for(run: Run, *checkpoints: Path) -> None:
    """Return once each of `checkpoints` is complete, the run still going."""
    deadline = time.monotonic() + 120
    while not all((path / "meta.json").is_file() for path in checkpoints):
        assert run.proc.poll() is None and time.monotonic() < deadline, f"no checkpoints {checkpoints}:\n{run.output}"
        time.sleep(0.02)


def _first_checkpoints(run_dir: Path) -> list[Path]:
    """Each cluster's checkpoint of step 10 in `run_dir`."""
    return [run_dir / "checkpoints" / f"cluster{c}" / "step_00000010" for c in (0, 1)]


def _kill_entirely(run: Run, *checkpoints: Path) -> None:
    """SIGKILL the launcher and every process below it once each of `checkpoints` is complete."""
    _wait_for(run, *checkpoints)
    pids = [run.proc.pid, *descendant_pids(run.proc.pid)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    run.finish()
    assert not wait_until_gone(pids), "processes of the killed run are still alive"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "shape",
    [
        [],
        # clusters of dp 2 and 1: cluster 0's replica 1 follows replica 0's sync and checkpoints only its own part
        ["--topology.clusters=dp2,dp1"],
    ],
    ids=["uniform", "mixed_dp"],
)
def test_an_elastic_run_killed_entirely_resumes_from_disk_and_ends_as_the_uninterrupted_run(tmp_path, start_run, shape):
    clean = start_run("clean", *ON_DISK, *shape, "--checkpoint.keep=5")
    assert clean.finish() == 0, "the clean run failed"
    clean_records = records_of(tmp_path / "clean")

    killed = start_run("killed", *ON_DISK, *shape, "--checkpoint.keep=5")
    first = _first_checkpoints(tmp_path / "killed")
    _kill_entirely(killed, *first)
    shutil.copytree(tmp_path / "killed", tmp_path / "lost")  # the same run, where cluster 1's disk is lost below

    # every cluster loads its own checkpoint of step 10 (inner optimizer, data position, residuals, the sync in
    # flight) and presents that step to torchft: the run ends bit for bit as the uninterrupted one
    resumed = start_run("resumed", *ON_DISK, *shape, "--checkpoint.keep=5", f"--checkpoint.resume={first[0]}",
                        run_dir=tmp_path / "killed")  # fmt: skip
    assert resumed.finish() == 0, "the resumed run failed"
    records = records_of(tmp_path / "killed")
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
    healed = start_run("healed", *ON_DISK, *shape, "--checkpoint.keep=5", run_dir=tmp_path / "lost")
    assert healed.finish() == 0, "the run resumed without cluster 1's checkpoint failed"
    assert f"dilocox: resuming from {lost / 'cluster0' / 'step_00000010'} (checkpoint.resume = auto" in healed.output
    assert "cluster 1 rejoined at step 10 (outer step 1), healed from its peers resumed from disk" in healed.output
    records = records_of(tmp_path / "lost")
    assert records[1]["healed_from_peer"] and records[1]["resumed_from_checkpoint"] is None
    assert records[0]["resumed_from_checkpoint"] == str(lost / "cluster0" / "step_00000010")
    assert records[0]["outer_params_sha256"] == records[1]["outer_params_sha256"]
    assert all(r["step"] == 30 for r in records.values())
    loss, clean_loss = records[0]["last_eval_loss"], clean_records[0]["last_eval_loss"]
    print(f"final eval loss: uninterrupted {clean_loss:.4f}, resumed with cluster 1 healed {loss:.4f}")
    assert abs(loss - clean_loss) / clean_loss < 0.05


@pytest.mark.timeout(300)
def test_ctrl_c_stops_every_cluster_with_the_command_that_resumes_the_run(tmp_path, start_run):
    run = start_run("run", *ON_DISK)
    _wait_for(run, *_first_checkpoints(tmp_path / "run"))
    os.kill(run.proc.pid, signal.SIGINT)
    assert run.finish(timeout=120) == 130
    hint = [line for line in run.lines if line.startswith("dilocox: interrupted, every cluster stopped; ")]
    assert len(hint) == 1, run.output
    command = re.search(r"resume it with `([^`]+)` \(from (\S+); checkpoint\.resume = auto\)", hint[0])
    assert command and shlex.split(command.group(1))[:2] == ["dilocox", "train"], hint[0]
    resumed = dilocox(*shlex.split(command.group(1))[1:])  # the command as printed
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"dilocox: resuming from {command.group(2)} (checkpoint.resume = auto" in resumed.stdout
    assert all(r["step"] == 30 for r in records_of(tmp_path / "run").values())


@pytest.mark.timeout(300)
def test_a_cluster_that_cannot_write_its_checkpoint_restarts_alone_and_the_run_goes_on(tmp_path, start_run):
    """Cluster 1's machine lets a file grow to 64 KB only (a real kernel limit, as a disk that fills up: a checkpoint
    is ~5 MB): its step-10 checkpoint fails, the cluster alone stops and is started again (without the limit), heals
    from cluster 0 and writes the later checkpoints; cluster 0 never stops."""
    run = start_run("run", *ON_DISK)
    deadline = time.monotonic() + 120
    while 1 not in run.pids():
        assert run.proc.poll() is None and time.monotonic() < deadline, run.output
        time.sleep(0.02)
    for pid in run.ranks_of(1):
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (64 << 10, resource.prlimit(pid, resource.RLIMIT_FSIZE)[1]))
    assert run.finish() == 0, run.output
    root = tmp_path / "run" / "checkpoints" / "cluster1"
    assert f"dilocox: elastic: cluster 1: checkpoint step 10 could not be written to {root} (File too large;" in (
        run.output
    )
    assert len(run.pids()[0]) == 1 and len(run.pids()[1]) == 2  # cluster 0 ran through, cluster 1 started twice
    assert "cluster1/step_00000010" not in checkpoints_of(tmp_path / "run")
    assert "cluster1/step_00000030" in checkpoints_of(tmp_path / "run")
    assert not [p for p in root.iterdir() if p.name.endswith(".partial")]
    records = records_of(tmp_path / "run")
    assert all(r["step"] == 30 for r in records.values())
    assert records[0]["outer_params_sha256"] == records[1]["outer_params_sha256"]


@pytest.mark.timeout(300)
def test_when_every_cluster_dies_the_launcher_gives_the_command_that_resumes_the_run_from_disk(tmp_path, start_run):
    run = start_run("run", *ON_DISK)
    _wait_for(run, *_first_checkpoints(tmp_path / "run"))
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
    records = records_of(tmp_path / "run")
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


# the dilocox preset as it is, in 2 fragments: a fragment's sync launched over the 3 clusters is judged by the peer
# check after the other fragment moved the channel to the quorum without the stopped cluster
AS_DEFAULT = [
    "--preset=dilocox",
    "--sync.fragments=2",
    *[f for f in ELASTIC if not f.startswith(("--preset", "--sync."))],
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "setting",
    # mixed_dp: cluster 2 of dp 2, whose replica 0 (the process stopped) syncs for it and replica 1 follows
    [ELASTIC, AS_DEFAULT, [*ELASTIC, "--topology.clusters=dp1,dp1,dp2"]],
    ids=["lowrank", "default_fragments", "mixed_dp"],
)
def test_a_stopped_cluster_is_named_left_out_and_the_run_finishes_with_the_change_recorded_and_plotted(
    tmp_path, start_run, setting
):
    # SIGSTOP freezes every thread of cluster 2, its heartbeat to the Lighthouse too: the others name it within
    # network.stall_timeout (5 s, far below network.timeout = 60 s), in the round's transfer if it froze there, or at
    # the next round's quorum, and go on without it; SIGCONT: it finds itself behind, and heals or is stopped
    flags = [*setting, "--topology.num_clusters=3", "--train.steps=40", "--sync.inner_steps=10"]
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
    assert len(run.pids()[0]) == len(run.pids()[1]) == 1, run.output  # the others went on: neither stopped
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
    ended = records_of(tmp_path / "stopped")
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
    # a finished run continued for 20 more steps: asked for (--checkpoint.resume=latest), never found by auto
    more = ["--train.steps=50", "--checkpoint.resume=latest"]
    a = start_run("machine_a", *flags, *more, "--topology.local_clusters=0-1", run_dir=tmp_path / "first")
    a.wait_for_line("cluster 1 started", timeout=60)
    time.sleep(8)
    b = start_run("machine_b", *flags, *more, "--topology.local_clusters=2", run_dir=tmp_path / "machine_b")
    assert (a.finish(), b.finish()) == (0, 0), "a launcher failed"
    assert "failed" not in a.output + b.output
    assert "cluster 0 rejoined at step 30 (outer step 3), healed from its peers resumed from disk" in a.output
    records = {**records_of(tmp_path / "first"), **{2: records_of(tmp_path / "machine_b")[2]}}
    assert all(r["step"] == 50 for r in records.values())
    assert len({r["outer_params_sha256"] for r in records.values()}) == 1, records


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lighthouse_proc", ["2s"], indirect=True)  # a loaded machine's pause must not drop a cluster
def test_clusters_run_as_torchrun_jobs_killed_entirely_resume_from_disk_as_the_uninterrupted_run(
    tmp_path, start_run, lighthouse
):
    """Each of 2 clusters is its own torchrun job meeting at one Lighthouse: both jobs killed after their step-10
    checkpoints, the two commands started again with that step resume each cluster from its own checkpoint, and both
    end on the outer parameters of the run that was not interrupted."""
    steps = 200
    flags = [*[f for f in ON_DISK if not f.startswith("--train.steps")], f"--train.steps={steps}",
             f"--network.lighthouse={lighthouse}", "--network.advertise_host=127.0.0.1"]  # fmt: skip

    def jobs(name: str, run_dir: Path, resume: list[Path] | None = None) -> list[Run]:
        return [
            start_run(f"{name}{c}", *flags, f"--topology.local_clusters={c}",
                      *([f"--checkpoint.resume={resume[c]}"] if resume else []), run_dir=run_dir / f"c{c}",
                      torchrun=("--standalone", "--nproc-per-node=1", "--max-restarts=0"))
            for c in (0, 1)
        ]  # fmt: skip

    assert [job.finish() for job in jobs("clean", tmp_path / "clean")] == [0, 0], "the clean run failed"
    clean = {c: records_of(tmp_path / "clean" / f"c{c}")[c] for c in (0, 1)}
    killed = jobs("killed", tmp_path / "killed")
    first = [tmp_path / "killed" / f"c{c}" / "checkpoints" / f"cluster{c}" / "step_00000010" for c in (0, 1)]
    _wait_for(killed[0], *first)
    pids = [pid for job in killed for pid in (job.proc.pid, *descendant_pids(job.proc.pid))]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for job in killed:
        job.finish()
    assert not wait_until_gone(pids), "processes of the killed jobs are still alive"
    resumed = jobs("resumed", tmp_path / "killed", first)  # a later checkpoint of one cluster may be complete
    assert [job.finish() for job in resumed] == [0, 0], "the resumed run failed"
    records = {c: records_of(tmp_path / "killed" / f"c{c}")[c] for c in (0, 1)}
    for c in (0, 1):
        assert f"dilocox: resuming from {first[c]}" in resumed[c].output
        assert records[c]["resumed_from_checkpoint"] == str(first[c]) and not records[c]["healed_from_peer"]
        assert records[c]["outer_params_sha256"] == clean[c]["outer_params_sha256"], (records, clean)
