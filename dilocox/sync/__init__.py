"""Synchronization strategies behind one protocol (`sync.kind`): allreduce, cocktail, diloco and dilocox."""

from __future__ import annotations

import torch.distributed as dist

from dilocox.compress import build_codec
from dilocox.config import Config
from dilocox.net.channel import WanChannel
from dilocox.sync.allreduce import AllReduceSync, allreduce_bytes_per_step
from dilocox.sync.base import SyncStrategy
from dilocox.sync.cocktail import CocktailSync
from dilocox.sync.diloco import DiLoCoSync

__all__ = ["AllReduceSync", "CocktailSync", "DiLoCoSync", "SyncStrategy", "allreduce_bytes_per_step", "build_sync"]


def build_sync(cfg: Config, params, *, channel: WanChannel, dp_group: dist.ProcessGroup | None) -> SyncStrategy:
    """The strategy named by `sync.kind`, over this rank's parameters."""
    if cfg.sync.kind == "allreduce":
        return AllReduceSync(params, channel=channel, dp_group=dp_group)
    if cfg.sync.kind == "cocktail":
        c = cfg.compression
        return CocktailSync(
            params,
            channel=channel,
            dp_group=dp_group,
            sample_ratio=c.sample_ratio,
            topk_ratio=c.topk_ratio,
            group_size=c.group_size,
            error_feedback=c.error_feedback,
            seed=cfg.run.seed,
        )
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
            codec=build_pseudo_grad_codec(cfg),
            error_feedback=cfg.compression.error_feedback,
            reduction=cfg.compression.reduction,
            fit_link=cfg.compression.fit_link,
            fit_link_max_steps=cfg.compression.fit_link_max_steps,
            seed=cfg.run.seed,
            total_steps=cfg.train.steps,
        )
    raise ValueError(f"sync.kind = {cfg.sync.kind!r} is not one of: allreduce, cocktail, diloco, dilocox")


def build_pseudo_grad_codec(cfg: Config):
    """The codec of `compression.kind`, or None for the uncompressed fp32 all-reduce."""
    c = cfg.compression
    if c.kind == "none":
        return None
    return build_codec(
        c.kind,
        rank=c.rank,
        group_size=c.group_size,
        stochastic_rounding=c.stochastic_rounding,
        seed=cfg.run.seed,
        rank_min=c.rank_min,
        rank_max=c.rank_max,
        energy=c.energy,
        window=c.window,
        schedule=c.schedule,
        ramp_rounds=c.ramp_rounds,
    )
