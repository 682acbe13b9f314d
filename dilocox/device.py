"""Which device a rank computes on (`run.device`), and what the other parts need to know about it.

Inside a cluster, parameters, activations, gradients, the inner optimizer, the pseudo-gradient and the codec work
live on the rank's device; the pp and dp groups use NCCL on CUDA and gloo on the CPU. The slow link between
clusters is always gloo over TCP on host memory: the channel stages device tensors through the host
(docs/design.md §9). Several ranks may share one GPU (`cuda:{local_rank % device_count}`), which is how one box
emulates several clusters; NCCL refuses two ranks of one group on one GPU, so a cluster whose pp or dp degree is
above 1 needs one GPU per rank.

    device = resolve_device("auto", local_rank=0)    # cuda:0 where a GPU is visible, else cpu
    describe(device)                                 # "cuda:0 (NVIDIA H100 80GB HBM3)" or "cpu"
"""

from __future__ import annotations

import torch

from dilocox.config import DEVICES  # `run.device`: auto (cuda when a GPU is visible), cpu or cuda


def resolve_device(setting: str, *, local_rank: int) -> torch.device:
    """The device of the rank with `local_rank` on its machine; ValueError when `cuda` is asked for but absent."""
    if setting not in DEVICES:
        raise ValueError(f"run.device = {setting!r} is not one of: {', '.join(DEVICES)}")
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ValueError(
            f"run.device = cuda but torch {torch.__version__} ({build}) sees no CUDA GPU; use run.device = cpu, or "
            "install a CUDA build of torch on a machine with a GPU (leave -c constraints.txt out there)"
        )
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def intra_cluster_backend(device: torch.device) -> str:
    """The backend of the pp and dp groups: NCCL between GPUs, gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)
