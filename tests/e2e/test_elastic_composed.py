"""Elastic runs of the setting users run, composed with the features that arrived after elasticity: the `dilocox`
preset as it is (the one-step delay with each average landing 7 steps into the next round, top-k int4, the
own_payload merge, the local and drained residual), with its syncs in 2 streaming fragments (over 2 pipeline
stages), in rounds of time with a cluster twice as slow, or over clusters of sharded stages. Without failures the
elastic run is bit-identical to the static one; with a cluster killed mid-run, every fragment (and every shard) of the
restarted cluster heals from a live peer and all end on the same outer parameters."""

import json
import os
import re
import signal

import pytest

from dilocox.metrics import read_metrics
from tests.e2e.elastic_runs import records_of

pytest.importorskip("torchft")
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 36
COMPOSED = [
    "--preset=dilocox", f"--train.steps={STEPS}", "--eval.interval=0",
    "--eval.final_max_batches=8", "--checkpoint.interval=0", "--metrics.log_interval=1",
]  # fmt: skip
OVERLAPPED_TIME_FRAGMENTS = [
    "--sync.round.mode=time", "--faults.slow_clusters=1:6.0", "--faults.slow_mode=virtual",
    "--sync.overlap_steps=5", "--sync.fragments=2",
]  # fmt: skip
ELASTIC = ["--topology.elastic=true", "--network.heartbeat=0.5s", "--network.stall_timeout=5s", "--network.timeout=60s"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "flags",
    [
        # two pipeline stages at the preset's H (debug.toml sets 10): both fragments' last rounds end at the last
        # step, where one fragment's payload is in flight while the other's members report (each on its own group,
        # or gloo pairs them across)
        ["--sync.fragments=2", "--topology.pp_degree=2", "--sync.inner_steps=12"],
        # cluster 1 counts its steps twice as long: 6 steps to cluster 0's 12 in every round of the same budget
        [
            "--sync.round.mode=time",
            "--faults.slow_clusters=1:2.0",
            "--faults.slow_mode=virtual",
            "--sync.overlap_steps=0",
        ],
        # cluster 1 thirteen times as slow: one step a round, at which both fragments' rounds end (its peers end
        # them 6 steps apart); at the end its peers' fragment 0 is 6 steps into a round, its own has none
        [
            "--sync.round.mode=time",
            "--faults.slow_clusters=1:13.0",
            "--faults.slow_mode=virtual",
            "--sync.overlap_steps=0",
            "--sync.fragments=2",
        ],
        # the preset's overlap of 7 steps under time rounds: 7 of cluster 0's 12 steps, and cluster 1's one step a
        # round lands the last round's sync before it ends the round, each its own meeting
        [
            "--sync.round.mode=time",
            "--faults.slow_clusters=1:13.0",
            "--faults.slow_mode=virtual",
            "--sync.overlap_steps=7",
        ],
        # the same in 2 fragments with an overlap of 5: cluster 1 at 2 steps a round puts the last fragment's landing
        # (5 of 12 into the round) and fragment 0's boundary (6 of 12) on one step, in that order as on cluster 0
        OVERLAPPED_TIME_FRAGMENTS,
    ],
    ids=["fragments", "time_rounds", "one_step_time_rounds", "overlapped_time_rounds", "overlapped_time_fragments"],
)
def test_the_preset_elastic_without_failures_is_bit_identical_to_the_static_run(tmp_path, start_run, flags):
    static = start_run("static", *COMPOSED, *flags, "--topology.num_clusters=2")
    assert static.finish() == 0, "the static run failed"
    elastic = start_run("elastic", *COMPOSED, *flags, *ELASTIC, "--topology.num_clusters=2")
    assert elastic.finish() == 0, "the elastic run failed"
    assert "settling round" not in elastic.output  # no collective failed: nothing waited for a timeout
    summaries = [json.loads((tmp_path / name / "summary.json").read_text()) for name in ("static", "elastic")]
    assert summaries[0]["final_eval_loss"] == summaries[1]["final_eval_loss"]
    losses = [[r["loss"] for r in read_metrics(tmp_path / name) if "loss" in r] for name in ("static", "elastic")]
    assert len(losses[0]) == STEPS and losses[0] == losses[1]  # cluster 0's steps
    records = records_of(tmp_path / "elastic")
    assert sorted(records) == [0, 1] and records[0]["outer_params_sha256"] == records[1]["outer_params_sha256"]


@pytest.mark.timeout(300)
def test_elastic_clusters_of_different_dp_train_as_the_static_ones_do(tmp_path, start_run):
    """Clusters of dp 2 and 1 under the preset with an fp32 sync: replica 0 of each cluster syncs the whole stage
    weighted by its cluster's tokens and the other replica follows it, over torchft's quorum (elastic) or the static
    cluster group. The two average the same values in another order: every step's loss and the final eval agree to
    float rounding, and both clusters of the elastic run end on one digest."""
    shape = ["--topology.clusters=dp2,dp1", "--compression.kind=none"]
    static = start_run("static", *COMPOSED, *shape)
    assert static.finish() == 0, "the static run failed"
    elastic = start_run("elastic", *COMPOSED, *shape, *ELASTIC)
    assert elastic.finish() == 0, "the elastic run failed"
    summaries = [json.loads((tmp_path / name / "summary.json").read_text()) for name in ("static", "elastic")]
    assert summaries[0]["final_eval_loss"] == pytest.approx(summaries[1]["final_eval_loss"], abs=1e-3)
    losses = [[r["loss"] for r in read_metrics(tmp_path / name) if "loss" in r] for name in ("static", "elastic")]
    assert len(losses[0]) == STEPS and losses[0] == pytest.approx(losses[1], abs=1e-4)
    records = records_of(tmp_path / "elastic")
    assert sorted(records) == [0, 1] and records[0]["outer_params_sha256"] == records[1]["outer_params_sha256"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("shape", "kill_at"),
    [
        (["--sync.fragments=2"], 16),  # mid-round: fragment 0 lands 7 steps after its boundaries at 6, 18, 30
        (["--topology.dp_degree=2", "--topology.dp_mode=shard"], 15),
        # the scalable reduction of shared low-rank factors: the survivors' shares cut again for a quorum of two,
        # the restart counted out of the mean while it abstains
        (["--compression.kind=lowrank_int4", "--compression.reduction=scalable"], 16),
        # clusters of dp 1, 1 and 2: the rank killed is cluster 2's replica 1, which follows its replica 0's sync
        (["--topology.clusters=dp1,dp1,dp2"], 16),
    ],
    ids=["fragments", "sharded", "scalable", "mixed_dp"],
)
def test_a_killed_rank_restarts_its_cluster_which_heals_every_fragment_and_shard(tmp_path, start_run, shape, kill_at):
    """3 elastic clusters under the preset, the last rank of cluster 2 killed: its cluster restarts and heals from a
    live peer, and every cluster ends on the same outer parameters. In 2 fragments, every fragment heals; in clusters
    of 2 ranks that each hold half of every tensor (topology.dp_mode = shard, FSDP2), each rank heals its own shard
    from the same rank of a live peer (the record's digest covers both shards); under the scalable reduction, every
    cluster decodes the same chunks whatever the quorum's size."""
    run = start_run("killed", *COMPOSED, *ELASTIC, "--topology.num_clusters=3", *shape)
    run.wait_for_step(kill_at)
    os.kill(run.ranks_of(2)[-1], signal.SIGKILL)
    assert run.finish() == 0, "the killed run failed"
    out = run.output
    assert "dilocox: elastic: cluster 2 failed (exit code -9); starting it again" in out
    assert re.search(r"dilocox: elastic: cluster 2 rejoined at step \d+ .*healed from a live peer", out)
    records = records_of(tmp_path / "killed")
    assert sorted(records) == [0, 1, 2] and all(r["step"] == STEPS for r in records.values())
    assert len({r["outer_params_sha256"] for r in records.values()}) == 1, records  # bit for bit
    assert records[2]["healed_from_peer"] and not records[0]["healed_from_peer"]


@pytest.mark.timeout(300)
def test_a_killed_cluster_heals_into_time_rounds_of_overlapped_fragments(tmp_path, start_run):
    """3 elastic clusters under the preset in time rounds of 2 fragments with an overlap of 5, cluster 1 six times as
    slow: cluster 2's last rank killed mid-round, its cluster restarts, heals from a live peer at one of the events its
    peers meet at, runs the rest of that round's events with them, and all end on the same outer parameters."""
    run = start_run("killed", *COMPOSED, *ELASTIC, "--topology.num_clusters=3", *OVERLAPPED_TIME_FRAGMENTS)
    run.wait_for_step(16)
    os.kill(run.ranks_of(2)[-1], signal.SIGKILL)
    assert run.finish() == 0, "the killed run failed"
    assert re.search(r"dilocox: elastic: cluster 2 rejoined at step \d+ .*healed from a live peer", run.output)
    records = records_of(tmp_path / "killed")
    assert sorted(records) == [0, 1, 2] and len({r["outer_params_sha256"] for r in records.values()}) == 1, records
    assert records[2]["healed_from_peer"] and not records[0]["healed_from_peer"]


@pytest.mark.timeout(300)
def test_a_lying_cluster_in_an_elastic_run_is_left_out_and_heals(tmp_path, start_run):
    """3 elastic clusters under the preset, cluster 2 sends 1000 x its update in round 2: every cluster leaves it out
    of that sync, cluster 2 heals from the agreed parameters, and all end on the same outer params."""
    run = start_run("liar", *COMPOSED, *ELASTIC, "--topology.num_clusters=3", "--faults.kind=scale",
                    "--faults.cluster=2", "--faults.rounds=2")  # fmt: skip
    assert run.finish() == 0, "the run failed"
    exclusions = [
        entry
        for record in read_metrics(tmp_path / "liar")
        for entry in record.get("round_exclusions", [])
        if entry["round"] is not None
    ]
    assert [(e["round"], e["cluster"]) for e in exclusions] == [(2, 2)], exclusions
    records = records_of(tmp_path / "liar")
    assert sorted(records) == [0, 1, 2] and len({r["outer_params_sha256"] for r in records.values()}) == 1, records
