"""What every synchronization strategy shares: the protocol, flat buffers, and the sharded cross-cluster mean.

A strategy is called by the trainer at two points of every inner step:

    loss.backward()
    sync.reduce_gradients()          # allreduce: mean over every rank; diloco: mean over dp_group only
    clip, inner_optimizer.step()
    sync.after_inner_step(step)      # diloco: at a round boundary, the outer sync and outer step
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dilocox.net.channel import PendingTransfer, WanChannel


class SyncStrategy(Protocol):
    """One way of keeping the clusters' models together (DESIGN.md section 6)."""

    name: str
    outer_step: int
    last_round: dict[str, float]
    """Link accounting of the outer sync waited for at the last round boundary (logged with that step)."""
    warnings: list[str]
    """Messages for the user (e.g. the link cannot keep up), printed once by the trainer."""

    def reduce_gradients(self) -> None:
        """Average this step's gradients over the ranks that must agree on them, before the inner step."""

    def after_inner_step(self, step: int) -> bool:
        """Called after inner step `step` (1-based); returns True when the replicas now agree (a round ended)."""

    def is_round_boundary(self, step: int) -> bool:
        """Whether the replicas agree after inner step `step` (checkpoints and evaluations of record go there)."""

    def flush(self) -> None:
        """Apply anything pending (the end of training); afterwards every cluster holds the same parameters."""

    def state_bytes(self) -> int:
        """Bytes of the strategy's own state on this rank (outer params, momentum, ...), for the memory report."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


class FlatParams:
    """A fixed list of parameters seen as one flat fp32 vector (one collective per step instead of one per tensor).

    flat = FlatParams(model.parameters())
    g = flat.gather_grads()        # (numel,)
    flat.scatter_grads(g)
    """

    def __init__(self, params) -> None:
        self.params: list[torch.nn.Parameter] = [p for p in params if p.requires_grad]
        self.numels = [p.numel() for p in self.params]
        self.shapes = [p.shape for p in self.params]
        self.numel = sum(self.numels)

    def gather_data(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).float() for p in self.params])

    def scatter_data(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            for p, chunk in zip(self.params, flat.split(self.numels), strict=True):
                p.copy_(chunk.view_as(p))

    def gather_grads(self) -> torch.Tensor:
        return torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in self.params]
        )

    def scatter_grads(self, flat: torch.Tensor) -> None:
        for p, chunk in zip(self.params, flat.split(self.numels), strict=True):
            if p.grad is None:
                p.grad = torch.empty_like(p)
            p.grad.copy_(chunk.view_as(p))


def dp_mean_(flat: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """In-place mean over the fast data-parallel group; a no-op for a group of one."""
    size = group_size(group)
    if size > 1:
        dist.all_reduce(flat, group=group)
        flat.div_(size)
    return flat


def shard_bounds(numel: int, num_shards: int, index: int) -> tuple[int, int]:
    """Equal shards (the last ones one element shorter), like torch.tensor_split."""
    base, extra = divmod(numel, num_shards)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass
class PendingMean:
    """An in-flight cross-cluster mean of one flat vector (see `launch_cross_cluster_mean`).

    `finish()` waits for the slow-link part and returns this dp replica's averaged slice; `wait()` then
    all-gathers the slices over the fast dp_group into `flat`. `sent` is what this rank put on the link, kept
    until `wait()` so that a checkpoint taken while the sync is in flight can save it and a resumed run can send
    it again (instead of stalling the checkpoint until the transfer arrives). `info` collects what the sync cost
    (bytes, codec seconds) for the per-round log."""

    flat: torch.Tensor
    bounds: list[tuple[int, int]]  # every dp replica's slice of `flat`
    finish: Callable[[], torch.Tensor]
    transfer: PendingTransfer
    dp_group: dist.ProcessGroup | None
    sent: torch.Tensor
    info: dict[str, float] = field(default_factory=dict)

    def wait(self) -> torch.Tensor:
        """Block until the slow-link part is done, then all-gather the slices over the fast dp_group."""
        return gather_slices_(self.flat, self.finish(), self.bounds, self.dp_group)


def gather_slices_(
    flat: torch.Tensor, shard: torch.Tensor, bounds: list[tuple[int, int]], dp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Write every dp replica's `shard` (replica i owns `flat[bounds[i]]`) into `flat` on all replicas."""
    size = group_size(dp_group)
    if size == 1:
        flat.copy_(shard)
        return flat
    width = max(end - start for start, end in bounds)  # gloo all-gathers equal sizes only: pad to the longest
    padded = torch.zeros(width, dtype=shard.dtype)
    padded[: shard.numel()] = shard
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded, group=dp_group)
    for (start, end), part in zip(bounds, parts, strict=True):
        flat[start:end] = part[: end - start]
    return flat


def launch_cross_cluster_mean(
    flat: torch.Tensor, *, channel: WanChannel, dp_group: dist.ProcessGroup | None, account: bool = True
) -> PendingMean:
    """Start averaging `flat` over the clusters; it must already be identical on all dp replicas of this cluster.

    The slow-link transfer is sharded over the cluster's `dp_degree` replicas (DESIGN.md section 2): replica d
    averages only shard d over `cluster_group`, then the shards are all-gathered over the fast `dp_group` in
    `wait()`, so each rank puts 1/dp of the vector on the slow link. `flat` itself stays untouched until `wait()`
    (the all-reduce works on a copy of the shard), so it is what a resumed run sends again.
    """
    size = group_size(dp_group)
    bounds = [shard_bounds(flat.numel(), size, index) for index in range(size)]
    start, end = bounds[dist.get_rank(dp_group) if size > 1 else 0]
    shard = flat[start:end].clone()
    transfer = channel.launch_all_reduce(shard, op="avg", account=account)

    def finish() -> torch.Tensor:
        return transfer.wait()

    return PendingMean(flat=flat, bounds=bounds, finish=finish, transfer=transfer, dp_group=dp_group, sent=flat)
