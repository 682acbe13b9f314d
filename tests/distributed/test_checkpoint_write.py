"""A checkpoint that one rank cannot write (its disk is full, or fills up in the middle of its file) stops every rank
with the same line, on 2 real gloo ranks, and leaves the checkpoints before it as they were; a checkpoint written in
the background (checkpoint.async_save) holds the state of its step and reports a failed write the same way."""

import contextlib
import resource
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystem

from dilocox.checkpoint import (
    CheckpointNotWritten,
    list_checkpoints,
    load_rank_state,
    save_checkpoint,
    start_checkpoint,
    verify_checkpoint,
)
from tests.multiproc import run_ranks


def _disk_full() -> None:
    """This rank's disk is full from now on: every file DCP writes goes to /dev/full, whose writes fail with ENOSPC
    as a full disk's do."""

    @contextlib.contextmanager
    def onto_full_disk(self, path, mode):
        with open("/dev/full", mode) as full:
            yield full

    FileSystem.create_stream = onto_full_disk


def _worker(rank: int, world_size: int, run_dir: str, mid_file: bool = False) -> str:
    def save(step: int) -> Path:
        state = {"w": torch.full((256, 256), float(rank))}
        return save_checkpoint(Path(run_dir), step, state, rank=rank, meta={"world_size": 2}, keep=3, group=None)

    save(10)
    if rank == 1 and mid_file:  # the file can grow to 64 KB of its 256 KB: the kernel writes what fits, then fails
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    elif rank == 1:  # only this rank's disk is full
        _disk_full()
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


@pytest.mark.dist
def test_a_file_cut_short_mid_write_stops_every_rank_with_its_os_error_and_no_partial(tmp_path):
    """A short write (a disk that fills up mid-file; here a file-size limit: Python ignores SIGXFSZ, so the write
    fails with EFBIG) is the OS error it is, not torch's "unexpected pos" crash that left the partial directory."""
    lines = run_ranks(_worker, 2, args=(str(tmp_path), True))
    root = tmp_path / "checkpoints"
    assert lines[0] == lines[1] and lines[0].startswith(
        f"checkpoint step 20 could not be written to {root} (File too large;"
    )
    assert sorted(p.name for p in root.iterdir()) == ["step_00000010"]
    verify_checkpoint(list_checkpoints(tmp_path)[0])


def _background_worker(rank: int, world_size: int, run_dir: str, fail: bool) -> dict:
    """Checkpoint 10 saved in the foreground, then 20 in the background while this rank changes its state in place
    (training goes on); with `fail`, rank 1's background write lands on a full disk."""
    weights = torch.full((256, 256), float(rank))
    group = dist.new_group(backend="gloo")  # the checkpoints' own: the thread's collectives run beside training's
    save_checkpoint(Path(run_dir), 10, {"w": weights}, rank=rank, meta={"world_size": 2}, keep=3, group=group)
    if fail and rank == 1:
        _disk_full()
    pending = start_checkpoint(Path(run_dir), 20, {"w": weights, "step": [20]}, rank=rank, meta={"world_size": 2},
                               keep=3, group=group)  # fmt: skip
    weights.add_(100.0)  # the next inner steps, while the thread writes
    if rank == 0:  # rank 0's thread completes the checkpoint by itself: no collective of the training thread
        pending._thread.join()
    dist.barrier()
    complete = [p.name for p in list_checkpoints(Path(run_dir))]
    try:
        path = pending.wait()
    except CheckpointNotWritten as exc:
        return {"complete": complete, "error": str(exc)}
    return {"complete": complete, "state": load_rank_state(path, rank)}


@pytest.mark.dist
def test_a_background_save_writes_the_state_of_its_step_and_completes_without_the_training_thread(tmp_path):
    results = run_ranks(_background_worker, 2, args=(str(tmp_path), False))
    for rank, result in enumerate(results):
        assert result["complete"] == ["step_00000010", "step_00000020"]
        assert torch.equal(result["state"]["w"], torch.full((256, 256), float(rank)))  # not the +100 after it
        assert result["state"]["step"] == [20]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000010", "step_00000020"]
    verify_checkpoint(list_checkpoints(tmp_path)[-1])


@pytest.mark.dist
def test_a_background_save_that_fails_on_one_rank_stops_every_rank_at_the_next_wait_with_its_line(tmp_path):
    results = run_ranks(_background_worker, 2, args=(str(tmp_path), True))
    root = tmp_path / "checkpoints"
    assert [r["complete"] for r in results] == [["step_00000010"]] * 2  # rank 0's thread did not complete it
    assert results[0]["error"] == results[1]["error"]
    assert results[0]["error"].startswith(f"the disk is full: checkpoint step 20 could not be written to {root}")
    assert sorted(p.name for p in root.iterdir()) == ["step_00000010"]  # no partial directory left
    verify_checkpoint(list_checkpoints(tmp_path)[0])


def _replicas_worker(rank: int, world_size: int, run_dir: str, shared: bool) -> dict:
    """Two replicas of one stage: the same model, inner optimizer and outer state, each its own residual."""
    outer = {"outer_params": torch.full((128, 256), 5.0), "residual": torch.full((16,), float(rank))}
    state = {
        "model": {"w": torch.full((256, 256), 7.0)},
        "inner_optimizer": {"state": {0: {"exp_avg": torch.full((256, 256), 3.0)}}, "param_groups": [{"params": [0]}]},
        "sync": {"fragments": [outer]},
    }
    group = dist.new_group(backend="gloo")
    path = save_checkpoint(Path(run_dir), 10, state, rank=rank, meta={"world_size": 2}, keep=1, group=group,
                           shared="cluster0/stage0" if shared else None)  # fmt: skip
    dist.barrier()
    return {"state": load_rank_state(path, rank), "bytes": sum(f.stat().st_size for f in path.glob("*.distcp"))}


@pytest.mark.dist
@pytest.mark.parametrize("shared", [True, False], ids=["replicated", "own"])
def test_a_replicated_stage_is_written_once_and_every_replica_loads_its_whole_state(tmp_path, shared):
    """DCP writes a key that several ranks hold once: the replicas' model, inner optimizer and phi (2.5 x 256 KiB)
    take one copy's bytes under the stage's key, two under the ranks' own."""
    results = run_ranks(_replicas_worker, 2, args=(str(tmp_path), shared))
    one_copy = 5 * 128 * 256 * 4
    for rank, result in enumerate(results):
        state = result["state"]
        assert torch.equal(state["model"]["w"], torch.full((256, 256), 7.0))
        assert torch.equal(state["inner_optimizer"]["state"][0]["exp_avg"], torch.full((256, 256), 3.0))
        assert state["inner_optimizer"]["param_groups"] == [{"params": [0]}]
        (fragment,) = state["sync"]["fragments"]
        assert torch.equal(fragment["outer_params"], torch.full((128, 256), 5.0))
        assert torch.equal(fragment["residual"], torch.full((16,), float(rank)))
    written = results[0]["bytes"]
    assert one_copy < written < 1.1 * one_copy if shared else 2 * one_copy < written < 2.2 * one_copy
