"""Synchronization strategies behind one protocol (`sync.kind`): allreduce, diloco and dilocox."""

from __future__ import annotations

import torch.distributed as dist

from dilocox.config import Config
from dilocox.net.channel import WanChannel
from dilocox.sync.allreduce import AllReduceSync, allreduce_bytes_per_step
from dilocox.sync.base import SyncStrategy
from dilocox.sync.diloco import DiLoCoSync

__all__ = ["AllReduceSync", "DiLoCoSync", "SyncStrategy", "allreduce_bytes_per_step", "build_sync"]


def build_sync(cfg: Config, params, *, channel: WanChannel, dp_group: dist.ProcessGroup | None) -> SyncStrategy:
    """The strategy named by `sync.kind`, over this rank's parameters."""
    if cfg.sync.kind == "allreduce":
        return AllReduceSync(params, channel=channel, dp_group=dp_group)
    if cfg.sync.kind in ("diloco", "dilocox"):
        return DiLoCoSync(
            params,
            channel=channel,
            dp_group=dp_group,
            inner_steps=cfg.sync.inner_steps,
            outer_lr=cfg.sync.outer_lr,
            outer_momentum=cfg.sync.outer_momentum,
            nesterov=cfg.sync.nesterov,
            sync_delay=cfg.sync.sync_delay,
            merge=cfg.sync.merge,
            total_steps=cfg.train.steps,
        )
    raise ValueError(f"sync.kind = {cfg.sync.kind!r} is not one of: allreduce, diloco, dilocox")
