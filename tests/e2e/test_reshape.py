"""A checkpoint of 2 data-parallel replicas per cluster resumed at 4 and at 1 (dilocox/reshape.py): the run goes on,
and what the checkpoint holds carries over exactly: the model the clusters agreed on, the outer optimizer, and the
sync that was in flight, which lands with the uninterrupted run's average."""

import json
import shutil

import pytest
import torch

from dilocox.checkpoint import consolidated_model_state, load_rank_state, read_meta, saved_outer_params
from tests.e2e.helpers import DEBUG, dilocox

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 40
RUN = ["--config", DEBUG, "--preset=dilocox", f"--train.steps={STEPS}", "--checkpoint.interval=10",
       "--checkpoint.keep=5", "--eval.interval=0", "--metrics.log_interval=1", "--network.bandwidth=unlimited",
       "--network.latency=0"]  # fmt: skip
"""The dilocox preset (the one-step delay, the average landing 7 steps into the next round), rounds of H = 10."""


def _checkpoint(run_dir, step):
    return run_dir / "checkpoints" / f"step_{step:08d}"


def _phi(run_dir, step, rank):
    return saved_outer_params(load_rank_state(_checkpoint(run_dir, step), rank)["sync"])


def _agreed(run_dir, step):
    """Cluster 0's agreed model of a checkpoint, its shards put together."""
    return consolidated_model_state(_checkpoint(run_dir, step), agreed=True)[0]


@pytest.fixture(
    scope="module",
    params=[["--compression.kind=none"], [], ["--compression.kind=none", "--topology.dp_mode=shard"]],
    ids=["fp32", "topk_int4", "fp32_sharded"],
)
def dp2_run(request, tmp_path_factory):
    """40 steps of 2 clusters of 2 replicas (4 sequences each; or 2 FSDP2 shards), checkpoints every round."""
    run_dir = tmp_path_factory.mktemp("reshape") / "dp2"
    result = dilocox("train", *RUN, *request.param, "--topology.dp_degree=2", "--train.micro_batch_size=4",
                     f"--run.out_dir={run_dir}", timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, request.param


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dp", [4, 1])
def test_a_dp2_checkpoint_resumes_at_another_dp_with_what_it_holds(dp2_run, tmp_path, dp):
    """Resumed at step 20 with the same 8 sequences a cluster: the sync launched at step 20 lands at step 27 and is
    applied at 30, so the step-30 checkpoint's agreed model depends only on the step-20 checkpoint. Uncompressed it
    equals the uninterrupted run's bit for bit, on every replica (sharded: put together from the new shards); with
    top-k int4 every replica re-encodes its new slice of the decoded update, so it differs by what the codec holds
    back of it, and stays close."""
    run_dir, codec = dp2_run
    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed)
    result = dilocox("train", *RUN, *codec, f"--topology.dp_degree={dp}", f"--train.micro_batch_size={8 // dp}",
                     f"--run.out_dir={resumed}", f"--checkpoint.resume={_checkpoint(resumed, 20)}",
                     timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"(topology.dp_degree: 2 -> {dp}; train.micro_batch_size: 4 -> {8 // dp})" in result.stdout
    if "--topology.dp_mode=shard" in codec:  # each rank holds its rows of phi: compared put together
        reference, reshaped = _agreed(run_dir, 30), _agreed(resumed, 30)
        assert reference.keys() == reshaped.keys()
        assert all(torch.equal(reference[key], reshaped[key]) for key in reference)
    else:
        reference = _phi(run_dir, 30, 0)
        replicas = [_phi(resumed, 30, replica) for replica in range(dp)]  # cluster 0's replicas, one stage
        assert all(torch.equal(replica, replicas[0]) for replica in replicas)
        if codec:  # top-k int4: the same update re-cut into other slices
            change = (replicas[0] - _phi(run_dir, 20, 0)).norm()
            assert (replicas[0] - reference).norm() < 0.5 * change
        else:
            assert torch.equal(replicas[0], reference)
    uninterrupted, reshaped = (json.loads((d / "summary.json").read_text()) for d in (run_dir, resumed))
    assert reshaped["final_eval_loss"] < reshaped["initial_eval_loss"] - 0.25  # it goes on learning
    assert abs(reshaped["final_eval_loss"] - uninterrupted["final_eval_loss"]) < 0.05 * uninterrupted["final_eval_loss"]


@pytest.mark.timeout(600)
def test_an_elastic_runs_clusters_each_resume_at_another_dp_from_their_own_checkpoint(tmp_path):
    """Each elastic cluster writes its own checkpoint, its ranks numbered inside it; resumed at dp 1, each builds its
    rank from its own two replicas' files. Uncompressed, both clusters' step-30 phi is the uninterrupted run's bit for
    bit (the sync launched at step 20 lands at 27), and the run goes on learning."""
    elastic = [*RUN, "--compression.kind=none", "--topology.elastic=true"]
    run_dir, resumed = tmp_path / "dp2", tmp_path / "resumed"
    result = dilocox("train", *elastic, "--topology.dp_degree=2", "--train.micro_batch_size=4",
                     f"--run.out_dir={run_dir}", timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    shutil.copytree(run_dir, resumed)
    chosen = resumed / "checkpoints" / "cluster0" / "step_00000020"
    result = dilocox("train", *elastic, "--topology.dp_degree=1", "--train.micro_batch_size=8",
                     f"--run.out_dir={resumed}", f"--checkpoint.resume={chosen}", timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(topology.dp_degree: 2 -> 1; train.micro_batch_size: 4 -> 8)" in result.stdout
    for cluster in (0, 1):
        old, new = (d / "checkpoints" / f"cluster{cluster}" / "step_00000030" for d in (run_dir, resumed))
        assert read_meta(old)["world_size"] == 2 and read_meta(new)["world_size"] == 1
        phi_old, phi_new = (saved_outer_params(load_rank_state(path, 0)["sync"]) for path in (old, new))
        assert torch.equal(phi_new, phi_old)
    reshaped = json.loads((resumed / "summary.json").read_text())
    assert reshaped["final_eval_loss"] < reshaped["initial_eval_loss"] - 0.25


@pytest.mark.timeout(600)
def test_a_checkpoint_resumes_at_another_pp_degree_with_what_it_holds(dp2_run, tmp_path):
    """The dp-2 run of one stage resumed at step 20 as 2 pipeline stages: each stage takes its tensors' model, inner
    optimizer state, phi, outer optimizer state, residuals and share of the sync in flight from the saved stage by
    name. The step-30 agreed model (the stages put together) is the uninterrupted run's bit for bit uncompressed,
    replicated or sharded, and close with top-k int4; the link counters carry over."""
    run_dir, codec = dp2_run
    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed)
    result = dilocox("train", *RUN, *codec, "--topology.dp_degree=2", "--train.micro_batch_size=4",
                     "--topology.pp_degree=2", f"--run.out_dir={resumed}",
                     f"--checkpoint.resume={_checkpoint(resumed, 20)}", timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(topology.pp_degree: 1 -> 2; train.num_microbatches: 1 -> 2)" in result.stdout
    reference, reshaped = _agreed(run_dir, 30), _agreed(resumed, 30)
    assert reference.keys() == reshaped.keys()
    if "--compression.kind=none" in codec:
        assert all(torch.equal(reference[key], reshaped[key]) for key in reference)
    else:
        before = _agreed(run_dir, 20)
        change = sum((reference[k] - before[k]).norm() ** 2 for k in reference) ** 0.5
        assert sum((reshaped[k] - reference[k]).norm() ** 2 for k in reference) ** 0.5 < 0.5 * change
    uninterrupted, reshaped = (json.loads((d / "summary.json").read_text()) for d in (run_dir, resumed))
    assert reshaped["final_eval_loss"] < reshaped["initial_eval_loss"] - 0.25
    assert abs(reshaped["final_eval_loss"] - uninterrupted["final_eval_loss"]) < 0.05 * uninterrupted["final_eval_loss"]


@pytest.mark.timeout(600)
def test_two_stages_resume_as_one(tmp_path):
    """2 stages x 2 replicas, resumed at step 20 as 1 stage: the saved stages put together by name; the step-30
    agreed model is the uninterrupted run's bit for bit (fp32)."""
    plain = [*RUN, "--compression.kind=none", "--topology.dp_degree=2", "--train.micro_batch_size=4"]
    run_dir, resumed = tmp_path / "pp2", tmp_path / "resumed"
    result = dilocox("train", *plain, "--topology.pp_degree=2", f"--run.out_dir={run_dir}", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    shutil.copytree(run_dir, resumed)
    result = dilocox("train", *plain, f"--run.out_dir={resumed}", f"--checkpoint.resume={_checkpoint(resumed, 20)}",
                     timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    reference, reshaped = _agreed(run_dir, 30), _agreed(resumed, 30)
    assert reference.keys() == reshaped.keys() and all(torch.equal(reference[k], reshaped[k]) for k in reference)
    uninterrupted, reshaped = (json.loads((d / "summary.json").read_text()) for d in (run_dir, resumed))
    # every saved stage's link counters carry over once; the sync in flight at the checkpoint is counted by whether it
    # had arrived on the first saved stage, which the second may not share: within that one sync's bytes
    one_sync = uninterrupted["wan_bytes_total"] / uninterrupted["outer_steps"]
    assert abs(reshaped["wan_bytes_total"] - uninterrupted["wan_bytes_total"]) <= one_sync
