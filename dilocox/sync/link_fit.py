"""When the slow link cannot keep up with the rounds: `sync.round.fit_link`'s choice of H, and the warning that says so.

`fit_inner_steps` sizes the next round so that a delayed sync, which travels during it, fits in its compute
(docs/design.md §3, `sync.round.fit_link`); `slow_link_advice` is the one-line warning when it does not (the H, the
overlap or the emulated bandwidth that would hide it).

    h, needed = fit_inner_steps(stats, round_steps=20, cfg=cfg)    # every rank agrees on h (one 8-byte all-reduce)
    warning = slow_link_advice(stats, round_steps=20, overlap_steps=0, channel=channel)
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from dilocox.net.channel import WanChannel
from dilocox.sync.base import RoundStats
from dilocox.sync.config import FIT_HEADROOM, SyncConfig


def fit_inner_steps(
    stats: RoundStats, *, round_steps: int, cfg: SyncConfig, current: int, group: dist.ProcessGroup | None = None
) -> tuple[int, int]:
    """The next round's H and the H the link wanted: large enough that the sync launched now, which travels during
    that round, fits in its compute with `FIT_HEADROOM`, judged by the sync just waited for (`stats`: same size, same
    link, `round_steps` steps of compute; `current` H when that compute is unknown).

    Never below the configured H (the user's choice when the link is fast) nor above `fit_link_max_steps`. Every rank
    measures its own link and step time, so they agree on the largest wish with one 8-byte all-reduce over every rank
    that syncs (`group`; None: every rank of the run; a control message, not counted as slow-link payload): all
    clusters and stages must end their rounds at the same steps."""
    link_s, compute_s = stats.link_s, stats.compute_s or 0.0
    step_s = compute_s / max(1, round_steps)
    needed = math.ceil(FIT_HEADROOM * link_s / step_s) if step_s > 0 else current
    wish = torch.tensor([min(max(needed, cfg.inner_steps), cfg.round.fit_link_max_steps)], dtype=torch.int64)
    if dist.is_initialized():
        dist.all_reduce(wish, op=dist.ReduceOp.MAX, group=dist.group.WORLD if group is None else group)
    return int(wish.item()), needed


def fit_link_warning(stats: RoundStats, *, round_steps: int, needed: int, cfg: SyncConfig) -> str:
    """The warning that `sync.round.fit_link` wants an H above its maximum."""
    step_s = (stats.compute_s or 0.0) / max(1, round_steps)
    return (
        f"warning: sync.round.fit_link wants H = {needed} to hide a {stats.link_s:.2f} s sync behind "
        f"{step_s:.3f} s steps, above sync.round.fit_link_max_steps = {cfg.round.fit_link_max_steps}; training waits "
        "for the link: raise fit_link_max_steps, compress harder or use a faster link"
    )


def slow_link_advice(stats: RoundStats, *, round_steps: int, overlap_steps: int, channel: WanChannel) -> str:
    """The warning that a delayed sync took longer on the link (`stats.link_s`) than the compute it could hide
    behind (`stats.compute_s`, over `round_steps` steps, or `overlap_steps` into the next round): the H or overlap
    that would hide it, and the emulated bandwidth that would (`bandwidth_advice`)."""
    link_s, compute_s, nbytes = stats.link_s, stats.compute_s or 0.0, stats.bytes_sent
    need_h = math.ceil(round_steps * link_s / compute_s)
    fit = bandwidth_advice(nbytes, compute_s, channel)
    if overlap_steps:
        return (
            f"warning: the slow link cannot keep up: one outer sync takes {link_s:.2f} s on the link but the "
            f"{round_steps} steps it may travel during (sync.overlap_steps) compute in {compute_s:.2f} s, so "
            f"training waits for it; use sync.overlap_steps >= {need_h} (below sync.inner_steps), or 0{fit}"
        )
    return (
        f"warning: the slow link cannot keep up: one outer sync takes {link_s:.2f} s on the link but a round "
        f"computes in {compute_s:.2f} s, so training waits for it; use sync.inner_steps >= {need_h}{fit} "
        "(or sync.round.fit_link = true to size H to the link as it goes)"
    )


def bandwidth_advice(nbytes: int, compute_s: float, channel: WanChannel) -> str:
    """`or network.bandwidth >= X`: the emulated uplink under which a sync of `nbytes` from this rank would fit
    in `compute_s` after the latency. Empty where no bandwidth setting helps: the bandwidth is unlimited (the
    link time is then the real collective's own), the latency alone is as long as the compute, or the uplink is
    already that fast (the real collective was slower than the emulated link)."""
    latency, uplink = channel.latency_s, channel.uplink_bytes_per_s
    if uplink is None:
        return " (network.bandwidth is unlimited: this is the real collective's time, not an emulated link's)"
    if compute_s <= latency:
        return ""
    needed = nbytes * channel.num_sharing / (compute_s - latency)  # bytes/s of the cluster's uplink
    return f" or network.bandwidth >= {format_rate(8 * needed)}" if needed > uplink else ""


def format_rate(bits_per_s: float) -> str:
    """A bandwidth as `network.bandwidth` takes it, rounded up to 3 significant digits: 1.24Gbps, 457Mbps, 7.5Kbps."""
    prefix, scale = next(((p, s) for p, s in (("G", 1e9), ("M", 1e6)) if bits_per_s >= s), ("K", 1e3))
    value = bits_per_s / scale
    digits = max(0, 2 - math.floor(math.log10(value))) if value > 0 else 0
    return f"{math.ceil(value * 10**digits) / 10**digits:g}{prefix}bps"
