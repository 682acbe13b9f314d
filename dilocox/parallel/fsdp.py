"""A cluster's dp ranks and their stage: FSDP2 shards (`topology.dp_mode = "shard"`, `fully_shard`, as torchtitan
does) or DDP replicas (`replicate`, the default: `replicate_stage`).

With pipelining, the sharded stage module is what `PipelineStage` runs (torchtitan's order): the schedule
reduce-scatters the gradients once, after the last microbatch's backward.

Each block of the stage, then the stage itself, is `fully_shard`ed over the cluster's `dp_group` (a `DeviceMesh` of
that group): a rank keeps dim-0 shard d of every parameter (a `DTensor` whose `to_local()` is that shard), its
gradient after FSDP's reduce-scatter (the mean over the dp ranks) and the inner optimizer's state of it. The outer
sync works on the local shards (`local_shard`), so dp rank d of every cluster exchanges shard d over the slow link,
as the replicated stage's rank d exchanges slice d; nothing gathers the whole stage outside FSDP's forward.

    shard_stage(model, groups.dp_group)           # before the inner optimizer is built
    state = local_state(model.state_dict())       # a checkpoint's tensors: this rank's shards
    load_local_state_(model.state_dict(), state)

Checkpoints hold each rank's shards under its own keys; `consolidated_model_state` concatenates the dp ranks'
shards.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def shard_stage(model: nn.Module, dp_group: dist.ProcessGroup) -> None:
    """`fully_shard` every transformer block of `model` (one all-gather per block in forward and backward), then the
    stage (its embedding, final norm and head), over a one-dimensional mesh of `dp_group`.

    The stage reshards after its forward too (FSDP2 keeps the root's parameters gathered until the backward by
    default): an evaluation has no backward, and the gathered copy it left would be used by the next forward in
    place of the shards that the inner step and the outer sync write to."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    device = next(model.parameters()).device
    mesh = DeviceMesh.from_group(dp_group, device.type)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)


def replicate_stage(model: nn.Module, dp_group: dist.ProcessGroup) -> nn.Module:
    """`topology.dp_mode = "replicate"` with more than one replica: `model` in `DistributedDataParallel` over
    `dp_group`, whose gradient all-reduce runs bucket by bucket during the backward. The pipeline runs the wrapper
    (torch.distributed.pipelining reduces once, after the last microbatch's backward); `model` stays the stage for
    its state, the optimizers and the outer sync (the same parameters under the same names). DDP's first backward
    reduces one bucket; from the second on, buckets in the order the gradients arrive (the first of 1 MiB), each
    all-reduced as soon as it is full. The gradients are views into the buckets (no second copy of them), and buffers
    are not synced at every forward: they are the same on every replica (the rotary tables)."""
    from torch.nn.parallel import DistributedDataParallel

    device = next(model.parameters()).device
    return DistributedDataParallel(
        model,
        device_ids=[device] if device.type == "cuda" else None,
        process_group=dp_group,
        forward_sync_buffers=False,
        gradient_as_bucket_view=True,
    )


def local_state(state: Any) -> Any:
    """`state` (a state dict, nested) with every `DTensor` replaced by this rank's shard (`to_local()`)."""
    if isinstance(state, dict):
        return {key: local_state(value) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(local_state(value) for value in state)
    return state.to_local() if hasattr(state, "to_local") else state


def load_local_state_(current: dict[str, Any], saved: dict[str, Any]) -> None:
    """Copy the shards of `saved` (a `local_state` of a model's state dict) into the tensors of `current` (the
    model's `state_dict()`, DTensors or not), in place."""
    missing = sorted(set(current) ^ set(saved))
    if missing:
        raise ValueError(f"the saved model state does not match this stage: {', '.join(missing[:3])} differ")
    with torch.no_grad():
        for name, tensor in current.items():
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            local.copy_(saved[name])


def load_local_optimizer_state_(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Load an optimizer's `local_state` of its state dict: its per-parameter tensors become DTensors again, of the
    parameter's mesh and placement (a step count stays a plain tensor)."""
    from torch.distributed.tensor import DTensor

    optimizer.load_state_dict(saved)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for param in params:
        if not isinstance(param, DTensor) or param not in optimizer.state:
            continue
        state = optimizer.state[param]
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() > 0:
                state[key] = DTensor.from_local(
                    value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
                )
