"""Two clusters of one rank sharing one GPU, in bf16, through the staged slow link (run where a GPU is lent).

`dilocox train --run.device=cuda` on the debug config: both ranks on cuda:0, the slow link gloo from pinned host
buffers. The scalable low-rank int4 reduction runs its programs (decode, average, re-encode) on the channel's side
stream, and the delayed sync is in flight at the checkpoint, so the GPU run's checkpoint resumes on the CPU with a
transfer to send again.
"""

import json
import shutil

import pytest

from tests.e2e.helpers import DEBUG, dilocox

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

BF16_TOLERANCE = 0.03
"""Relative difference allowed between eval losses of bf16 runs on two devices: their matmuls round differently,
and 40 steps of training carry the differences forward."""


def test_two_clusters_on_one_gpu_in_bf16_match_the_cpu_and_resume_on_cpu(tmp_path):
    common = [
        "--config",
        DEBUG,
        "--preset=dilocox-lowrank",
        "--compression.kind=lowrank_int4",
        "--compression.reduction=scalable",
        "--train.dtype=bf16",
        "--train.steps=40",
        "--checkpoint.interval=20",
        "--checkpoint.keep=5",
    ]
    runs = {}
    for device in ("cpu", "cuda"):
        run_dir = tmp_path / device
        result = dilocox("train", *common, f"--run.out_dir={run_dir}", f"--run.device={device}")
        assert result.returncode == 0, result.stderr[-3000:]
        runs[device] = json.loads((run_dir / "summary.json").read_text())
        if device == "cuda":  # the start-up report names every rank's device
            assert "rank 0 cuda:0" in result.stdout and "rank 1 cuda:0" in result.stdout, result.stdout[-2000:]
    gpu, cpu = runs["cuda"], runs["cpu"]
    assert gpu["final_eval_loss"] < gpu["initial_eval_loss"] - 0.5  # it learns
    assert gpu["final_eval_loss"] == pytest.approx(cpu["final_eval_loss"], rel=BF16_TOLERANCE)
    assert gpu["wan_bytes_total"] == cpu["wan_bytes_total"]  # a fixed rank: the same exact bytes on either device
    assert gpu["hidden_comm_fraction"] is not None

    resumed = tmp_path / "cuda-then-cpu"
    shutil.copytree(tmp_path / "cuda", resumed)
    for later in sorted((resumed / "checkpoints").glob("step_*"))[1:]:
        shutil.rmtree(later)  # keep step 20, whose delayed sync is still in flight
    result = dilocox("train", *common, f"--run.out_dir={resumed}", "--run.device=cpu", "--checkpoint.resume=latest")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["final_eval_loss"] == pytest.approx(gpu["final_eval_loss"], rel=BF16_TOLERANCE)
    assert summary["wan_bytes_total"] == gpu["wan_bytes_total"]  # the transfer in flight is counted once
