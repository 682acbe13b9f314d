"""`dilocox train` with `sync.fragments`: each fragment's sync is a round record at its own steps, a run resumed
from a checkpoint taken while a fragment's sync is in flight ends bit for bit where the straight run ends, and an
impossible split is one line before anything is written."""

import pytest

from tests.e2e.helpers import DEBUG, dilocox, metrics, train_refusal

pytestmark = pytest.mark.e2e

STREAMING = [
    "--preset=dilocox",  # top-k int4 with error feedback, the one-step delay, own_payload, local and drained residual
    "--sync.overlap_steps=0",
    "--sync.inner_steps=10",
    "--sync.fragments=2",
    "--checkpoint.interval=15",  # step 15 ends fragment 0's round while fragment 1's sync (launched at 10) travels
    "--checkpoint.keep=5",
]


def test_fragments_sync_at_their_steps_and_resume_bit_exact(tmp_path):
    straight = tmp_path / "straight"
    result = dilocox("train", "--config", DEBUG, f"--run.out_dir={straight}", *STREAMING)
    assert result.returncode == 0, result.stderr[-3000:]
    records = metrics(straight)
    rounds = [(r["step"], r["round_fragment"], r["round_inner_steps"]) for r in records if "round_fragment" in r]
    # fragment 0 launches at 5, 15, 25, 35, 40 and fragment 1 at 10, 20, 30, 40; under the delay each sync lands at
    # the fragment's next boundary, and at the last step the final flush lands the last ones
    assert rounds == [(15, 0, 10), (20, 1, 10), (25, 0, 10), (30, 1, 10), (35, 0, 10),
                      (40, 0, 5), (40, 1, 10), (40, 0, 10), (40, 1, 10)]  # fmt: skip
    assert sorted(p.name for p in (straight / "checkpoints").iterdir()) == [
        "step_00000015", "step_00000030", "step_00000040"]  # fmt: skip
    resumed = tmp_path / "resumed"
    result = dilocox("train", "--config", DEBUG, f"--run.out_dir={resumed}", *STREAMING,
                     f"--checkpoint.resume={straight / 'checkpoints' / 'step_00000015'}")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    by_step = {r["step"]: r for r in records if "event" not in r}
    again = [r for r in metrics(resumed) if "event" not in r]
    assert [r["step"] for r in again] == [s for s in by_step if s > 15]
    for row in again:
        assert row["loss"] == by_step[row["step"]]["loss"]
        # the bytes of the syncs that landed at the step; the counter also holds the other fragment's sync in flight
        # once it arrived, which depends on the machine's speed, so it is compared at the end, with nothing in flight
        assert row.get("round_bytes_sent") == by_step[row["step"]].get("round_bytes_sent")
    assert again[-1]["wan_bytes_sent"] == by_step[40]["wan_bytes_sent"]
    assert again[-1]["eval_loss"] == by_step[40]["eval_loss"]


def test_an_impossible_split_is_one_line_before_anything_is_written(tmp_path):
    run_dir = tmp_path / "run"
    args, message = ["--sync.inner_steps=500", "--sync.fragments=400"], "sync.fragments = 400 is more than the "
    refusal = train_refusal("--config", DEBUG, f"--run.out_dir={run_dir}", *args)
    assert refusal is not None and "\n" not in refusal and message in refusal, refusal
    assert not run_dir.exists()


def test_a_lying_cluster_is_left_out_of_every_fragments_rounds_and_the_clusters_agree(tmp_path):
    """3 clusters, 2 fragments, cluster 2 sends NaN in rounds 2 and 3 of each fragment: the guard leaves it out of
    exactly those 4 syncs (each fragment's own rounds 2 and 3), and every cluster ends on the same outer params."""
    import torch

    from dilocox.checkpoint import load_rank_state, saved_outer_params

    run_dir = tmp_path / "run"
    result = dilocox("train", "--config", DEBUG, f"--run.out_dir={run_dir}", "--preset=dilocox",
                     "--topology.num_clusters=3", "--sync.inner_steps=6", "--sync.fragments=2", "--train.steps=24",
                     "--faults.kind=nan", "--faults.cluster=2", "--faults.rounds=2-3")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    left_out = sorted(
        (entry["round"], r.get("round_fragment"))
        for r in metrics(run_dir)
        for entry in r.get("round_exclusions", [])
        if entry["cluster"] == 2 and entry["round"] is not None
    )
    assert left_out == [(2, 0), (2, 1), (3, 0), (3, 1)], left_out
    checkpoint = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    phis = [saved_outer_params(load_rank_state(checkpoint, rank)["sync"]) for rank in range(3)]
    assert torch.isfinite(phis[0]).all() and all(torch.equal(phi, phis[0]) for phi in phis)
