"""Pipeline parallelism inside a cluster: the stage split (no torch.distributed) and the pipeline runner."""

from dilocox.parallel.pipeline import (
    SCHEDULES,
    PipelineRunner,
    broadcast_from_last_stage,
    clip_grad_norm_,
    mean_token_cross_entropy,
    microbatch_size,
)
from dilocox.parallel.split import (
    build_stage,
    check_split,
    format_split,
    split_layers,
    stage_parameter_counts,
    stage_tensor_counts,
)

__all__ = [
    "SCHEDULES",
    "PipelineRunner",
    "broadcast_from_last_stage",
    "build_stage",
    "check_split",
    "clip_grad_norm_",
    "format_split",
    "mean_token_cross_entropy",
    "microbatch_size",
    "split_layers",
    "stage_parameter_counts",
    "stage_tensor_counts",
]
