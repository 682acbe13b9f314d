"""`dilocox train` with clusters of different data-parallel degree (`topology.clusters`, docs/design.md §2.1): it
learns, checkpoints, resumes exactly with a compressed sync in flight, and its checkpoint evaluates; bad shapes are
refused in one line before anything is written."""

import json

import pytest

from tests.e2e.helpers import DEBUG, dilocox, metrics, train_refusal

pytestmark = pytest.mark.e2e

SHORT = ["--train.steps=20", "--eval.interval=10", "--checkpoint.interval=10", "--checkpoint.keep=5"]
MIXED = ["--config", DEBUG, "--topology.clusters=dp2,dp1,dp1", "--preset=dilocox", *SHORT]
"""3 clusters of dp 2, 1, 1 (4 ranks) with the dilocox preset: delayed, top-k int4, the drain."""


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("shapes") / "mixed"
    result = dilocox("train", *MIXED, f"--run.out_dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def test_clusters_of_dp_2_1_1_learn_and_count_every_replicas_tokens(mixed_run):
    summary = json.loads((mixed_run / "summary.json").read_text())
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.5
    assert (summary["num_clusters"], summary["dp_degree"], summary["dp_degrees"]) == (3, 2, [2, 1, 1])
    assert summary["tokens"] == 20 * 8 * 64 * 4  # steps x micro_batch_size x seq_len x the 4 replicas' shards
    assert summary["cluster_tokens"] == [20 * 8 * 64 * 2, 20 * 8 * 64, 20 * 8 * 64]  # cluster 0: its 2 replicas'
    assert 0 < summary["wan_bytes_total"] < summary["allreduce_equiv_bytes"] / 10
    meta = json.loads((mixed_run / "checkpoints" / "step_00000020" / "meta.json").read_text())
    assert (meta["world_size"], meta["dp_degrees"]) == (4, [2, 1, 1])


@pytest.mark.slow
def test_clusters_of_dp_2_1_1_resume_exactly_with_the_delayed_sync_in_flight(mixed_run, tmp_path):
    resumed = tmp_path / "resumed"
    checkpoint = mixed_run / "checkpoints" / "step_00000010"
    result = dilocox("train", *MIXED, f"--run.out_dir={resumed}", f"--checkpoint.resume={checkpoint}")
    assert result.returncode == 0, result.stderr[-3000:]
    want = {r["step"]: r for r in metrics(mixed_run)}
    got = metrics(resumed)
    assert [r["step"] for r in got] == [r["step"] for r in metrics(mixed_run) if r["step"] > 10]
    for row in got:  # the byte counter between boundaries holds a sync in flight once it arrived: compared at the end
        assert row["loss"] == want[row["step"]]["loss"]
    assert got[-1]["wan_bytes_sent"] == want[20]["wan_bytes_sent"]
    assert got[-1]["eval_loss"] == want[20]["eval_loss"]
    # the checkpoint's agreed model evaluates to what training logged (debug.toml: final_max_batches = 16)
    result = dilocox("eval", mixed_run, "--json", "--max-batches", "16")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["loss"] == pytest.approx(want[20]["eval_loss"], abs=1e-6)
    # another shape cannot resume it: its rank files and data shards are laid out for dp 2, 1, 1
    other = tmp_path / "other"
    shape = ["--topology.clusters=dp1,dp1,dp2", f"--checkpoint.resume={checkpoint}", f"--run.out_dir={other}"]
    result = dilocox("train", *MIXED, *shape, timeout=60)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "data-parallel degrees 2, 1, 1, this run's 1, 1, 2" in result.stderr and not other.exists()


def test_pipelined_clusters_of_dp_2_and_1_learn(tmp_path):
    run_dir = tmp_path / "pp2"
    args = ["--config", DEBUG, "--topology.clusters=pp2xdp2,pp2xdp1", "--preset=diloco", *SHORT]
    result = dilocox("train", *args, f"--run.out_dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.5
    assert (summary["pp_degree"], summary["dp_degrees"], summary["tokens"]) == (2, [2, 1], 20 * 8 * 64 * 3)
    assert summary["cluster_tokens"] == [20 * 8 * 64 * 2, 20 * 8 * 64]  # the first stage of each replica counts
    assert "on 2 clusters x dp 2, 1 x pp 2" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--topology.clusters=dp2,pp1x1"], "topology.clusters[1] = 'pp1x1' is not a cluster shape"),
        (["--topology.clusters=pp2xdp1,pp1xdp1"], "every cluster needs the same pipeline degree"),
        (
            ["--topology.clusters=dp2,dp1", "--topology.dp_mode=shard"],
            "(clusters of different data-parallel degrees) does not work with topology.dp_mode = 'shard'",
        ),
    ],
)
def test_a_bad_cluster_shape_is_one_line_exit_2_and_writes_nothing(tmp_path, args, message):
    run_dir = tmp_path / "bad"
    refusal = train_refusal("--config", DEBUG, f"--run.out_dir={run_dir}", *args)
    assert refusal is not None and "\n" not in refusal and message in refusal, refusal
    assert not run_dir.exists()
