"""Synchronization strategies behind one protocol (`sync.kind`): allreduce, cocktail, diloco and dilocox."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dilocox.lazy import lazy_exports

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from dilocox.config import Config
    from dilocox.elastic.membership import ElasticMembership
    from dilocox.net.channel import WanChannel
    from dilocox.sync.base import SyncStrategy
    from dilocox.sync.replica import StageMirror
    from dilocox.sync.rounds import TokenWeights

__getattr__, __dir__, _names = lazy_exports(
    __name__,
    {
        "dilocox.sync.allreduce": ("AllReduceSync", "allreduce_bytes_per_step"),
        "dilocox.sync.base": ("CodecCost", "ElasticSync", "RoundStats", "SyncStrategy"),
        "dilocox.sync.cocktail": ("CocktailSync",),
        "dilocox.sync.config": ("GuardConfig", "OuterConfig", "RoundConfig", "SyncConfig"),
        "dilocox.sync.diloco": ("DiLoCoSync",),
        "dilocox.sync.outer": ("OuterSync",),
        "dilocox.sync.reducer_factory": ("build_reducer",),
        "dilocox.sync.reducers": ("DenseReducer", "GatherReducer", "PendingMean", "Reducer"),
        "dilocox.sync.replica": ("FollowerSync", "StageMirror"),
        "dilocox.sync.rounds": ("TokenWeights",),
        "dilocox.sync.scalable": ("ScalableElementwiseReducer", "ScalableLowRankReducer"),
    },
)
__all__ = sorted([*_names, "build_sync"])


def build_sync(
    cfg: Config,
    params,
    *,
    channel: WanChannel,
    dp_group: dist.ProcessGroup | None,
    pp_group: dist.ProcessGroup | None = None,
    agree_group: dist.ProcessGroup | None = None,
    inner_optimizer: torch.optim.Optimizer | None = None,
    membership: ElasticMembership | None = None,
    weights: TokenWeights | None = None,
    sharded: bool = False,
    dp_reduced: bool = False,
    mirror: StageMirror | None = None,
) -> SyncStrategy:
    """The strategy named by `sync.kind`, over this rank's parameters. The outer-loop kinds get the public
    `OuterSync` around `DiLoCoSync`, so `dilocox train` and a user's own loop (docs/api.md) run one object;
    `inner_optimizer` has its state reset when the guard heals this cluster; over `pp_group` (the cluster's pipeline)
    the stages agree on what the guard leaves out; `weights`: how this cluster's tokens weigh its updates
    (`TokenWeights`: under `sync.round.mode = time`, and always for clusters of different dp); `sharded`: `params`
    are FSDP shards over `dp_group` (`topology.dp_mode = shard`): each rank syncs its own shard; `dp_reduced`: the
    gradients of a replicated stage arrive averaged over `dp_group` already (the trainer's DDP stage,
    `dilocox.parallel.fsdp.replicate_stage`); `mirror`: this rank is replica 0 of its stage and syncs it for the
    replicas that follow (`dilocox.sync.replica`); `agree_group`: the ranks that sync, which agree on fit_link's H
    (None: every rank)."""
    from dilocox.sync.allreduce import AllReduceSync
    from dilocox.sync.cocktail import CocktailSync
    from dilocox.sync.outer import OuterSync

    replicas = None if sharded else dp_group  # FSDP averaged a sharded stage's gradients over dp_group
    if cfg.sync.kind == "allreduce":
        return AllReduceSync(params, channel=channel, dp_group=replicas, dp_reduced=dp_reduced)
    if cfg.sync.kind == "cocktail":
        return CocktailSync(
            params, cfg.cocktail, channel=channel, dp_group=replicas, seed=cfg.run.seed, dp_reduced=dp_reduced
        )
    return OuterSync.from_configs(
        params,
        cfg.sync,
        cfg.compression,
        channel=channel,
        dp_group=dp_group,
        pp_group=pp_group,
        agree_group=agree_group,
        seed=cfg.run.seed,
        total_steps=cfg.train.steps,
        inner_optimizer=inner_optimizer,
        faults=cfg.faults,
        membership=membership,
        weights=weights,
        sharded=sharded,
        dp_reduced=dp_reduced,
        mirror=mirror,
    )
