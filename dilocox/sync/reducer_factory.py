"""`build_reducer`: the reducer of `compression.kind` and `compression.reduction` (docs/design.md §4.4).

reducer = build_reducer(CompressionConfig(kind="int4"), flat.shapes, channel=channel, dp_group=dp_group)
pending = reducer.launch(pseudo_grad); avg_pseudo_grad = pending.wait()
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from dilocox.compress import CompressionConfig, LowRankCodec, build_codec
from dilocox.net.channel import WanChannel
from dilocox.sync.reducers import CodecReducer, DenseReducer, GatherReducer, Reducer
from dilocox.sync.robust import PeerCheck, UpdateGuard
from dilocox.sync.scalable import ScalableElementwiseReducer, ScalableLowRankReducer


def build_reducer(
    cfg: CompressionConfig,
    shapes: Sequence[torch.Size],
    *,
    channel: WanChannel,
    dp_group: dist.ProcessGroup | None,
    pp_group: dist.ProcessGroup | None = None,
    shard_group: dist.ProcessGroup | None = None,
    seed: int = 0,
    guard_max_ratio: float | None = None,
    peer_max_ratio: float | None = None,
    peer_sizes: bool = True,
    aggregate: str = "mean",
    trim_fraction: float = 0.25,
    elastic: bool = False,
) -> Reducer:
    """The reducer of `compression.kind` and `compression.reduction` over tensors of `shapes` (validated here).

    `guard_max_ratio` (None: no guard), `peer_max_ratio` (None: no peer check) and `aggregate` are
    `sync.guard.max_ratio`, `sync.guard.peer_ratio` (`peer_sizes`: `PeerCheck.sizes`) and `sync.aggregate`: only the
    gather reduction judges and robustly averages the clusters' updates one by one (`judges_each`; `SyncConfig`
    refuses a robust aggregate with the others; their guard is the check of the mean in `DiLoCoSync`). `pp_group`
    (the cluster's pipeline) and `shard_group` (a sharded stage's dp ranks) make its stages and shards agree on what
    the guard leaves out."""
    cfg.validate()
    if cfg.kind == "none":
        numel = sum(shape.numel() for shape in shapes)
        return DenseReducer(numel, channel=channel, dp_group=dp_group, counted=elastic)
    codec = build_codec(cfg, seed=seed)
    common = dict(
        error_feedback=cfg.error_feedback,
        feedback_decay=cfg.feedback_decay,
        channel=channel,
        dp_group=dp_group,
        seed=seed,
    )
    if cfg.reduction == "scalable":  # validate() allows only the kinds these two average
        low_rank = isinstance(codec, LowRankCodec)
        reducer: type[CodecReducer] = ScalableLowRankReducer if low_rank else ScalableElementwiseReducer
        return reducer(codec, shapes, **common, counted=elastic)
    gather = GatherReducer(
        codec,
        shapes,
        **common,
        guard=UpdateGuard(guard_max_ratio) if guard_max_ratio is not None else None,
        peers=PeerCheck(peer_max_ratio, sizes=peer_sizes)
        if guard_max_ratio is not None and peer_max_ratio is not None
        else None,
        pp_group=pp_group,
        shard_group=shard_group,
        how=aggregate,
        trim_fraction=trim_fraction,
    )
    if elastic:
        gather.empty_reason = "it sent none: its own was non-finite, or it is new to the round"
    return gather
