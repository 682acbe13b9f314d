"""`run.device`: which device a rank computes on, and the error when a GPU is asked for where there is none."""

import pytest
import torch

from dilocox.config import load_config
from dilocox.device import intra_cluster_backend, resolve_device


def test_cpu_and_auto_without_a_gpu():
    assert resolve_device("cpu", local_rank=3) == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto", local_rank=3) == torch.device("cpu")
    assert intra_cluster_backend(torch.device("cpu")) == "gloo"
    assert intra_cluster_backend(torch.device("cuda", 1)) == "nccl"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: asking for cuda is not an error here")
def test_cuda_without_a_gpu_names_the_fix():
    with pytest.raises(ValueError, match=r"run.device = cuda but torch .* sees no CUDA GPU; use run.device = cpu"):
        resolve_device("cuda", local_rank=0)


@pytest.mark.gpu
def test_ranks_share_the_gpus_round_robin():
    count = torch.cuda.device_count()
    assert [resolve_device("cuda", local_rank=r).index for r in range(2 * count)] == [*range(count)] * 2
    assert resolve_device("auto", local_rank=0).type == "cuda"


def test_unknown_device_is_a_config_error():
    with pytest.raises(ValueError, match="run.device = 'tpu' is not one of: auto, cpu, cuda"):
        load_config(None, ["--run.device=tpu"]).validate()
