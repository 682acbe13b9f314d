"""A checkpoint that one rank cannot write (its disk is full) stops every rank with the same line, on 2 real gloo
ranks, and leaves the checkpoints before it as they were."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dilocox.checkpoint import CheckpointNotWritten, list_checkpoints, save_checkpoint, verify_checkpoint
from tests.multiproc import run_ranks


def _worker(rank: int, world_size: int, run_dir: str) -> str:
    def save(step: int) -> Path:
        state = {"w": torch.full((256, 256), float(rank))}
        return save_checkpoint(Path(run_dir), step, state, rank=rank, meta={"world_size": 2}, keep=3, group=None)

    save(10)
    if rank == 1:  # only this rank's disk is full: what the kernel says then (/dev/full)
        real_save = torch.save

        def onto_full_disk(obj, handle):
            with open("/dev/full", "wb") as full:
                real_save(obj, full)

        torch.save = onto_full_disk
    try:
        save(20)
    except CheckpointNotWritten as exc:
        dist.barrier()
        return str(exc)
    return "saved"


@pytest.mark.dist
def test_a_rank_with_a_full_disk_stops_every_rank_with_one_line_and_no_partial(tmp_path):
    lines = run_ranks(_worker, 2, args=(str(tmp_path),))
    root = tmp_path / "checkpoints"
    assert lines[0] == lines[1] and lines[0].startswith(
        f"the disk is full: checkpoint step 20 could not be written to {root}"
    )
    assert sorted(p.name for p in root.iterdir()) == ["step_00000010"]
    verify_checkpoint(list_checkpoints(tmp_path)[0])
