import pytest
import torch
import torch.distributed as dist

from tests.multiproc import run_ranks


def _worker(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _failing(rank, world_size):
    if rank == 1:
        raise RuntimeError("boom on rank 1")
    return rank


@pytest.mark.dist
def test_run_ranks_all_reduce():
    assert run_ranks(_worker, 2) == [3.0, 3.0]


@pytest.mark.dist
def test_run_ranks_reports_failure():
    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_ranks(_failing, 2)
