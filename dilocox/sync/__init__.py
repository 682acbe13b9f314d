"""Synchronization strategies behind one protocol (`sync.kind`): allreduce, cocktail, diloco and dilocox."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dilocox.net.channel import WanChannel
from dilocox.sync.allreduce import AllReduceSync, allreduce_bytes_per_step
from dilocox.sync.base import CodecCost, ElasticSync, RoundStats, SyncStrategy
from dilocox.sync.cocktail import CocktailSync
from dilocox.sync.config import SyncConfig
from dilocox.sync.diloco import DiLoCoSync
from dilocox.sync.elastic import ElasticRounds, heal_state_bound
from dilocox.sync.lanes import LaneLayout, LaneReducer
from dilocox.sync.membership import ElasticError, ElasticMembership
from dilocox.sync.outer import OuterSync
from dilocox.sync.reducer_factory import build_reducer
from dilocox.sync.reducers import DenseReducer, GatherReducer, PendingMean, Reducer
from dilocox.sync.scalable import ScalableElementwiseReducer, ScalableLowRankReducer

if TYPE_CHECKING:
    from dilocox.config import Config

__all__ = [
    "AllReduceSync",
    "CocktailSync",
    "CodecCost",
    "DenseReducer",
    "DiLoCoSync",
    "ElasticError",
    "ElasticSync",
    "ElasticRounds",
    "ElasticMembership",
    "GatherReducer",
    "LaneLayout",
    "LaneReducer",
    "OuterSync",
    "PendingMean",
    "Reducer",
    "RoundStats",
    "ScalableElementwiseReducer",
    "ScalableLowRankReducer",
    "SyncConfig",
    "SyncStrategy",
    "allreduce_bytes_per_step",
    "build_reducer",
    "build_sync",
    "heal_state_bound",
]


def build_sync(
    cfg: Config,
    params,
    *,
    channel: WanChannel,
    dp_group: dist.ProcessGroup | None,
    pp_group: dist.ProcessGroup | None = None,
    inner_optimizer: torch.optim.Optimizer | None = None,
    membership: ElasticMembership | None = None,
    lanes: LaneLayout | None = None,
    tokens_per_step: int = 1,
) -> SyncStrategy:
    """The strategy named by `sync.kind`, over this rank's parameters. The outer-loop kinds get the public
    `OuterSync` around `DiLoCoSync`, so `dilocox train` and a user's own loop (docs/api.md) run one object;
    `inner_optimizer` has its state reset when the guard heals this cluster; over `pp_group` (the cluster's pipeline)
    the stages agree on what the guard leaves out; `lanes`: clusters of different data-parallel degree (outer-loop
    kinds only, docs/design.md §2.1); `tokens_per_step` (this cluster's, per inner step) weighs the clusters'
    updates by their tokens under `sync.round = time`."""
    if cfg.sync.kind == "allreduce":
        return AllReduceSync(params, channel=channel, dp_group=dp_group)
    if cfg.sync.kind == "cocktail":
        return CocktailSync(params, cfg.cocktail, channel=channel, dp_group=dp_group, seed=cfg.run.seed)
    return OuterSync.from_configs(
        params,
        cfg.sync,
        cfg.compression,
        channel=channel,
        dp_group=dp_group,
        pp_group=pp_group,
        seed=cfg.run.seed,
        total_steps=cfg.train.steps,
        inner_optimizer=inner_optimizer,
        faults=cfg.faults,
        membership=membership,
        lanes=lanes,
        tokens_per_step=tokens_per_step,
    )
