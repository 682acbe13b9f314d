"""The AllReduce baseline: every inner step's gradients are averaged over every rank, the slow link included.

sync = AllReduceSync(model.parameters(), channel=channel, dp_group=groups.dp_group)
loss.backward(); sync.reduce_gradients(); inner_optimizer.step()
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch.distributed as dist

from dilocox.net.channel import WanChannel, ring_all_reduce_bytes
from dilocox.sync.base import FlatParams, RoundStats, StepRounds, dp_mean_, shard_bounds
from dilocox.sync.reducers import DenseReducer
from dilocox.topology import group_size


class AllReduceSync(StepRounds):
    """Data parallelism across clusters (the DiLoCoX paper's AllReduce baseline): hierarchical gradient mean,
    first over the fast dp_group, then each replica's 1/dp shard over the slow cluster_group."""

    name = "allreduce"

    def __init__(
        self, params, *, channel: WanChannel, dp_group: dist.ProcessGroup | None, dp_reduced: bool = False
    ) -> None:
        """`dp_reduced`: the gradients arrive averaged over `dp_group` already (the trainer's DDP stage)."""
        self.flat = FlatParams(params)
        self.numel = self.flat.numel
        self.dp_group = dp_group
        self.dp_reduced = dp_reduced
        self.reducer = DenseReducer(self.numel, channel=channel, dp_group=dp_group)
        self.warnings: list[str] = []

    def reduce_gradients(self) -> None:
        grads = self.flat.gather_grads()
        if not self.dp_reduced:
            dp_mean_(grads, self.dp_group)
        self.flat.scatter_grads(self.reducer.launch(grads).wait())

    def after_inner_step(self, step: int, *, step_s: float = 0.0) -> RoundStats | None:
        self.step = step
        return None  # the exchange happened inside reduce_gradients; its link time is in the channel's totals

    def flush(self) -> RoundStats | None:
        return None

    def agreed_model(self) -> AbstractContextManager[bool]:
        return nullcontext(False)  # the clusters apply the same averaged gradient every step: always agreed

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def allreduce_bytes_per_step(
    numel: int, *, dp_group: dist.ProcessGroup | None, clusters: int, position: int, elem_size: int = 4
) -> int:
    """Bytes this rank sends on the slow link for one AllReduce step of `numel` fp32 gradients, sliced over the
    replicas of `dp_group`, among `clusters` at ring `position` (exact, per the channel's ring convention): the
    yardstick `allreduce_equiv_bytes` of every strategy's summary."""
    if clusters == 1:
        return 0
    dp_size = group_size(dp_group)
    start, end = shard_bounds(numel, dp_size, dist.get_rank(dp_group) if dp_size > 1 else 0)
    sent, _ = ring_all_reduce_bytes(end - start, elem_size, clusters, position)
    return sent
