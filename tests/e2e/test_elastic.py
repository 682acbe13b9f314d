"""Elastic clusters as a user meets them (docs/design.md §10.1): kill -9 one cluster's process mid-run; the others go
on, the launcher starts it again, it heals from a live peer and ends bit-identical to them."""

import contextlib
import json
import os
import re
import signal

import pytest

from dilocox.elastic.lighthouse import run_lighthouse
from dilocox.metrics import read_metrics
from dilocox.tools.linkcheck import namespaces
from tests.e2e.elastic_runs import ELASTIC, checkpoints_of, records_of
from tests.e2e.helpers import (
    LOOPBACK,
    REPO,
    child_pids,
    descendant_pids,
    listening_sockets,
    non_loopback_interface,
)

pytest.importorskip("torchft")
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


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
    # in the last round (it ends at step 40): the launcher marks the restart at once, the others wait for it at the
    # end of training (ElasticMembership.wait_for_restarts, unless it asked already), and it heals there from a live
    # peer, at train.steps, with no step left to train, whatever the machine's load (a kill mid-run: the two-launcher
    # test below)
    run.wait_for_step(31)
    os.kill(run.pid_of(2), signal.SIGKILL)
    assert run.finish() == 0, "the killed run failed"
    out = run.output
    assert "dilocox: elastic: cluster 2 failed" in out
    assert "dilocox: elastic: cluster 2 started" in out and "start 2)" in out
    assert f"dilocox: elastic: cluster 2 rejoined at step {steps} " in out and "healed from a live peer" in out

    records = records_of(tmp_path / "killed")
    assert sorted(records) == [0, 1, 2]
    digests = {r["outer_params_sha256"] for r in records.values()}
    assert len(digests) == 1, records  # the agreed parameters are bit-identical on every cluster
    assert records[2]["healed_from_peer"] and records[2]["resumed_from_checkpoint"] is None
    # each cluster's only checkpoint is the final one, cluster 2's written after the heal at the end
    assert sorted(checkpoints_of(tmp_path / "killed")) == [f"cluster{c}/step_{steps:08d}" for c in range(3)]
    assert not records[0]["healed_from_peer"] and not records[1]["healed_from_peer"]
    assert all(r["step"] == steps for r in records.values())

    loss = json.loads((tmp_path / "killed" / "summary.json").read_text())["final_eval_loss"]
    print(f"final eval loss: clean {clean_loss:.4f}, with cluster 2 killed in the last round and healed {loss:.4f}")
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
    assert sorted(checkpoints_of(tmp_path / "machine_a")) == ["cluster0/step_00000040", "cluster1/step_00000040"]
    assert checkpoints_of(tmp_path / "machine_b") == ["cluster2/step_00000040"]

    records = {**records_of(tmp_path / "machine_a"), **records_of(tmp_path / "machine_b")}
    assert sorted(records_of(tmp_path / "machine_a")) == [0, 1] and sorted(records_of(tmp_path / "machine_b")) == [2]
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
@pytest.mark.parametrize(
    "shape",
    [["--topology.pp_degree=2"], ["--topology.dp_degree=2"], ["--topology.dp_degree=2", "--topology.dp_mode=shard"]],
    ids=["pp2", "dp2", "dp2_shard"],
)
def test_clusters_of_several_ranks_without_faults_are_bit_identical_to_the_static_run(tmp_path, start_run, shape):
    # each rank settles its stage's (and replica's) slice, or its shard, with the same rank of the other cluster, as
    # in a static run
    flags = ["--topology.num_clusters=2", *shape, "--train.steps=20", "--sync.inner_steps=5"]
    static_flags = [flag for flag in ELASTIC if not flag.startswith(("--topology.elastic", "--network."))]
    static = start_run("static", *static_flags, *flags)
    assert static.finish() == 0, "the static run failed"
    elastic = start_run("elastic", *ELASTIC, *flags)
    assert elastic.finish() == 0, "the elastic run failed"
    summaries = [json.loads((tmp_path / name / "summary.json").read_text()) for name in ("static", "elastic")]
    assert summaries[0]["final_eval_loss"] == summaries[1]["final_eval_loss"]
    # the AllReduce yardstick: the elastic summary holds cluster 0's ranks, the static one both clusters' alike
    assert summaries[0]["allreduce_equiv_bytes"] == 2 * summaries[1]["allreduce_equiv_bytes"] > 0
    losses = [[r["loss"] for r in read_metrics(tmp_path / name) if "loss" in r] for name in ("static", "elastic")]
    assert len(losses[0]) == 20 and losses[0] == losses[1]
    records = records_of(tmp_path / "elastic")
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
    records = records_of(tmp_path / "killed")
    assert sorted(records) == [0, 1, 2] and all(r["step"] == steps for r in records.values())
    # both stages' outer params (the digest of the stages' digests) are bit-identical on every cluster
    assert len({r["outer_params_sha256"] for r in records.values()}) == 1, records
    assert records[2]["healed_from_peer"] and not records[0]["healed_from_peer"]


@contextlib.contextmanager
def _shaped_hosts(bytes_per_s: float):
    """Three "hosts", each a network namespace whose only way out is a veth capped at `bytes_per_s` by tc tbf (the
    linkcheck tool's network), with a Lighthouse on host 0: (the network, the ranks' environment, each host's command
    prefix, the Lighthouse's URL). Skips where namespaces and tc are not available."""
    reason = namespaces.unavailable_reason()
    if reason is not None:
        pytest.skip(f"real network namespaces and tc shaping are not available here: {reason}")
    with namespaces.shaped_network(3) as net:
        for command in namespaces.shape_commands(net, bytes_per_s):
            namespaces.run_command(command)
        env = {**os.environ, "GLOO_SOCKET_IFNAME": namespaces.CLUSTER_IFNAME, "PYTHONPATH": str(REPO)}
        host = [("ip", "netns", "exec", net.cluster_ns(index)) for index in range(3)]
        lighthouse, url = run_lighthouse(
            f"{net.cluster_addr(0)}:0", heartbeat="0.5s", stall_timeout="5s", prefix=host[0], env=env, cwd=REPO
        )
        try:
            yield net, env, host, url
        finally:
            lighthouse.terminate()
            lighthouse.wait(timeout=20)


@pytest.mark.timeout(300)
def test_hosts_in_network_namespaces_heal_a_killed_host_across_a_shaped_link(tmp_path, start_run):
    # Three "hosts": each a network namespace whose only way out is a veth capped at 100 Mbit/s by tc tbf (the
    # linkcheck tool's network), each running its own launcher for its one cluster; the Lighthouse runs on host 0.
    # Killing host 2's cluster: its launcher starts it again and it heals from a live peer across the shaped link.
    steps = 40
    with _shaped_hosts(12.5e6) as (net, env, host, url):  # 100 Mbit/s uplinks
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
    out = runs[2].output
    assert "dilocox: elastic: cluster 2 failed" in out and "start 2)" in out
    assert re.search(r"dilocox: elastic: cluster 2 rejoined at step \d+ .*healed from a live peer", out)
    records = {c: records_of(tmp_path / f"host{c}")[c] for c in range(3)}
    assert len({r["outer_params_sha256"] for r in records.values()}) == 1, records  # bit-identical on every host
    assert records[2]["healed_from_peer"] and all(r["step"] == steps for r in records.values())
    # every host's traffic went through its shaped uplink, and the heal (at least the outer params, 4 bytes x 164,416
    # values) left one of the live hosts through it: that host sent about that much more than the other
    assert all(sent > 0 for sent in shaped_bytes), shaped_bytes
    assert abs(shaped_bytes[0] - shaped_bytes[1]) > 0.8 * 4 * 164_416, shaped_bytes


@pytest.mark.timeout(240)
def test_the_end_of_the_run_waits_for_a_torchrun_job_starting_its_cluster_again(tmp_path, start_run, lighthouse):
    # Cluster 1 is a torchrun job; nothing tells cluster 0's launcher when torchrun starts it again. Its rank is
    # stopped (SIGSTOP) at step 20: cluster 0 names it stalled, trains on alone to the end, and there waits for it,
    # silent for less than network.timeout. Only then is the stopped rank killed: torchrun starts the job again,
    # the restart heals from cluster 0 in the last quorum, and both end on the same outer params (before, cluster 0
    # finished at once and the restart found no live peer: exit 5).
    steps = 60
    flags = [*ELASTIC, "--topology.num_clusters=2", f"--train.steps={steps}", "--sync.inner_steps=10",
             f"--network.lighthouse={lighthouse}", "--network.advertise_host=127.0.0.1",
             "--network.timeout=120s"]  # fmt: skip
    live = start_run("cluster0", *flags, "--topology.local_clusters=0")
    job = start_run("cluster1", *flags, "--topology.local_clusters=1",
                    torchrun=("--standalone", "--nproc-per-node=1", "--max-restarts=1"))  # fmt: skip
    live.wait_for_step(20)
    (worker,) = child_pids(job.proc.pid)
    os.kill(worker, signal.SIGSTOP)
    live.wait_for_line("cluster 0 waits for clusters [1], started again or silent")
    assert job.proc.poll() is None
    os.kill(worker, signal.SIGKILL)
    assert [run.finish(timeout=180) for run in (live, job)] == [0, 0]
    assert re.search(rf"dilocox: elastic: cluster 1 rejoined at step {steps}: .*healed from a live peer", live.output)
    records = {0: records_of(tmp_path / "cluster0")[0], 1: records_of(tmp_path / "cluster1")[1]}
    assert records[0]["outer_params_sha256"] == records[1]["outer_params_sha256"], records  # bit-identical
    assert records[1]["healed_from_peer"] and all(r["step"] == steps for r in records.values())


@pytest.mark.timeout(300)
def test_a_cluster_spread_over_two_hosts_by_torchrun_heals_a_killed_rank_across_a_shaped_link(tmp_path, start_run):
    # Three "hosts", each a network namespace behind its own veth capped at 1 Gbit/s: cluster 0 is started by
    # `dilocox train` on host 0 (with the Lighthouse); cluster 1 is one torchrun job of 2 nodes, hosts 1 and 2, one
    # rank each, so its own data-parallel all-reduce crosses the shaped link. Killing its rank on host 2 makes
    # torchrun start the job again on both hosts (--max-restarts 3, as the launcher's topology.max_cluster_restarts: a
    # loaded machine may make the cluster miss a heartbeat later), and the cluster heals from cluster 0. Cluster 0
    # trains almost 800 steps after the kill, about twice what it trains while the restart takes place (both share
    # this machine's cores).
    steps = 800
    with _shaped_hosts(125e6) as (net, env, host, url):  # 1 Gbit/s uplinks
        flags = [*ELASTIC, "--topology.num_clusters=2", "--topology.dp_degree=2", f"--train.steps={steps}",
                 "--sync.inner_steps=10", "--network.bandwidth=unlimited", f"--network.lighthouse={url}"]  # fmt: skip
        live = start_run("cluster0", *flags, "--topology.local_clusters=0",
                         f"--network.advertise_host={net.cluster_addr(0)}", env=env, prefix=host[0])  # fmt: skip
        job = ["--nnodes=2", "--nproc-per-node=1", "--max-restarts=3", "--rdzv-backend=c10d", "--rdzv-id=cluster1",
               f"--rdzv-endpoint={net.cluster_addr(1)}:29400"]  # fmt: skip
        nodes = [  # host 1 serves the rendezvous (torchrun cannot tell its own address inside a namespace)
            start_run(f"node{node}", *flags, "--topology.local_clusters=1",
                      f"--network.advertise_host={net.cluster_addr(1 + node)}", env=env, prefix=host[1 + node],
                      run_dir=tmp_path / "cluster1", torchrun=(*job, f"--local-addr={net.cluster_addr(1 + node)}",
                                                               f"--rdzv-conf=is_host={node == 0}"))
            for node in range(2)
        ]  # fmt: skip
        live.wait_for_step(15)
        (worker,) = child_pids(nodes[1].proc.pid)  # torchrun's one worker on host 2
        os.kill(worker, signal.SIGKILL)
        assert [run.finish(timeout=240) for run in (live, *nodes)] == [0, 0, 0]
        shaped_bytes = [namespaces.qdisc_counters(net, index)["qdisc_bytes"] for index in range(3)]
    assert re.search(r"dilocox: elastic: cluster 1 left at step \d+", live.output)
    assert re.search(r"dilocox: elastic: cluster 1 rejoined at step \d+: .*healed from a live peer", live.output)
    records = {0: records_of(tmp_path / "cluster0")[0], 1: records_of(tmp_path / "cluster1")[1]}
    assert records[0]["outer_params_sha256"] == records[1]["outer_params_sha256"], records  # bit-identical
    assert records[1]["healed_from_peer"] and all(r["step"] == steps for r in records.values())
    # cluster 1's ranks all-reduce their gradients across the shaped link at every step they train together: half
    # the debug model's 164,416 fp32 gradients at least leave each of its hosts through its uplink at each one
    assert min(shaped_bytes[1:]) > 50 * 4 * 164_416 / 2, shaped_bytes
