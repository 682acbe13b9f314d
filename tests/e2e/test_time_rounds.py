"""`dilocox train --sync.round.mode=time` with a virtually slow cluster: the steps each cluster does, the records and
the summary that say so, a resume equal to the uninterrupted run, and the settings refused before anything is
written."""

import json

import pytest
import torch

from dilocox.checkpoint import load_rank_state
from tests.e2e.helpers import DEBUG, dilocox, metrics, train_refusal

pytestmark = pytest.mark.e2e

TIME_ROUNDS = [
    "--config",
    DEBUG,
    "--topology.num_clusters=3",
    "--sync.inner_steps=8",
    "--train.steps=24",  # 3 rounds
    "--sync.round.mode=time",
    "--faults.slow_clusters=2:2.0",
    "--faults.slow_mode=virtual",
    # the one-step delay and a codec with error feedback: the checkpoint holds a sync in flight and residuals
    "--sync.sync_delay=1",
    "--compression.kind=int4",
    "--sync.local_residual=true",
    "--eval.interval=0",
    "--checkpoint.interval=8",
    "--checkpoint.keep=5",
    "--metrics.log_interval=1",
]
TOKENS_PER_STEP = 8 * 64  # micro_batch_size x seq_len of one cluster (dp 1)


@pytest.mark.slow
def test_time_rounds_give_the_slow_cluster_fewer_steps_and_resume_exactly(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    result = dilocox("train", *TIME_ROUNDS, f"--run.out_dir={straight}")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(straight)
    landed = [entry for r in rows for entry in r.get("rounds_landed", [])]
    # H = 8, cluster 2 at 2x: 4 steps per round, the others 8; rounds 2 and 3 land at the last step (the delay)
    assert [entry["round"] for entry in landed] == [1, 2, 3]
    assert all(entry["cluster_steps"] == [8, 8, 4] for entry in landed)
    assert all(entry["cluster_tokens"] == [s * TOKENS_PER_STEP for s in (8, 8, 4)] for entry in landed)
    assert [r["round_cluster_steps"] for r in rows if "round_cluster_steps" in r] == [[8, 8, 4]] * 2
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["outer_steps"] == 3 and summary["steps"] == 24  # cluster 0's own steps
    assert summary["tokens"] == 3 * (8 + 8 + 4) * TOKENS_PER_STEP  # every cluster's own tokens
    assert summary["cluster_tokens"] == [24 * TOKENS_PER_STEP, 24 * TOKENS_PER_STEP, 12 * TOKENS_PER_STEP]
    assert len(summary["cluster_train_s"]) == 3
    assert rows[-1]["tokens"] == summary["tokens"]
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    # checkpoints by round: the same boundary on every cluster, named by its nominal step
    assert sorted(p.name for p in (straight / "checkpoints").iterdir()) == [
        "step_00000008",
        "step_00000016",
        "step_00000024",
    ]
    assert [load_rank_state(straight / "checkpoints" / "step_00000016", r)["trainer"]["step"] for r in range(3)] == [
        16,
        16,
        8,
    ]

    result = dilocox(
        "train",
        *TIME_ROUNDS,
        f"--run.out_dir={resumed}",
        f"--checkpoint.resume={straight / 'checkpoints' / 'step_00000008'}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    want = {r["step"]: r for r in rows}
    got = metrics(resumed)
    assert [r["step"] for r in got] == list(range(9, 25))
    for row in got:
        assert row["loss"] == want[row["step"]]["loss"], row["step"]
    assert got[-1]["eval_loss"] == want[24]["eval_loss"]
    resumed_summary = json.loads((resumed / "summary.json").read_text())
    assert resumed_summary["wan_bytes_total"] == summary["wan_bytes_total"]
    assert resumed_summary["tokens"] == summary["tokens"]
    for rank in range(3):  # the slow cluster's parameters too
        a = load_rank_state(straight / "checkpoints" / "step_00000024", rank)
        b = load_rank_state(resumed / "checkpoints" / "step_00000024", rank)
        for name, tensor in a["model"].items():
            assert torch.equal(tensor, b["model"][name]), (rank, name)
        assert torch.equal(a["sync"]["fragments"][0]["outer_params"], b["sync"]["fragments"][0]["outer_params"])


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--faults.slow_clusters=5:2.0"], "faults.slow_clusters names cluster '5', which is not a cluster"),
        (["--faults.slow_clusters=1:0.5"], "a factor must be a number >= 1"),
    ],
    ids=["unknown-cluster", "factor-below-one"],
)
def test_a_bad_slow_or_time_setting_is_one_line_exit_2_and_writes_nothing(tmp_path, flags, words):
    run_dir = tmp_path / "run"
    refusal = train_refusal("--config", DEBUG, "--topology.num_clusters=3", f"--run.out_dir={run_dir}", *flags)
    assert refusal is not None and "\n" not in refusal and words in refusal, refusal
    assert not run_dir.exists()
