"""Cross-cluster mean of a compressed pseudo-gradient: gather the payloads, decode, average (exact for any codec).

Each rank encodes its dp slice of the stage's pseudo-gradient (with error feedback), all-gathers the payloads
over the slow `cluster_group` (payload sizes may differ per cluster, e.g. an adaptive rank), decodes every
cluster's payload and averages them. Cost per rank: `(C-1) x payload` received, exact in the channel's counters.

    pending = launch_compressed_mean(pseudo_grad, shapes=flat.shapes, codec=codec, feedback=feedback,
                                     channel=channel, dp_group=dp_group)
    avg_pseudo_grad = pending.wait()
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from dilocox.compress import Codec, ErrorFeedback, Payload
from dilocox.net.channel import WanChannel
from dilocox.sync.base import PendingMean, group_size


def param_aligned_bounds(numels: Sequence[int], num_shards: int) -> list[tuple[int, int]]:
    """Split a flat vector of consecutive tensors into `num_shards` slices that start and end on tensor borders
    (a low-rank codec needs whole matrices), each close to an equal share of the elements."""
    offsets = [0]
    for n in numels:
        offsets.append(offsets[-1] + n)
    total = offsets[-1]
    bounds, start, index = [], 0, 0
    for shard in range(num_shards):
        target = total * (shard + 1) / num_shards
        end_index = index
        # take whole tensors while the slice is closer to its target with the next tensor than without it
        while end_index < len(numels) and abs(offsets[end_index + 1] - target) <= abs(offsets[end_index] - target):
            end_index += 1
        if shard == num_shards - 1:
            end_index = len(numels)
        bounds.append((start, offsets[end_index]))
        start, index = offsets[end_index], end_index
    return bounds


def _my_slice(shapes: Sequence[torch.Size], dp_group: dist.ProcessGroup | None):
    """Every replica's parameter-aligned bounds, and this replica's (start, end, tensor offsets, shapes)."""
    size = group_size(dp_group)
    numels = [shape.numel() for shape in shapes]
    bounds = param_aligned_bounds(numels, size)
    start, end = bounds[dist.get_rank(dp_group) if size > 1 else 0]
    offsets = [0]
    for n in numels:
        offsets.append(offsets[-1] + n)
    mine = [i for i in range(len(shapes)) if start <= offsets[i] and offsets[i + 1] <= end]
    return bounds, start, end, [(offsets[i], offsets[i + 1]) for i in mine], [shapes[i] for i in mine]


def launch_compressed_mean(
    flat: torch.Tensor,
    *,
    shapes: Sequence[torch.Size],
    codec: Codec,
    feedback: ErrorFeedback,
    channel: WanChannel,
    dp_group: dist.ProcessGroup | None,
) -> PendingMean:
    """Encode this replica's slice of `flat` (identical on all dp replicas of the cluster) and start the gather."""
    _, start, end, spans, my_shapes = _my_slice(shapes, dp_group)
    tensors = [flat[a:b].view(shape) for (a, b), shape in zip(spans, my_shapes, strict=True)]
    encode_from = time.perf_counter()
    payload, own_decoded = feedback.compress(codec, tensors)
    codec_s = time.perf_counter() - encode_from
    return _launch_payload(flat, payload, own_decoded, shapes=shapes, codec=codec, channel=channel,
                           dp_group=dp_group, codec_s=codec_s)  # fmt: skip


def relaunch_compressed_mean(
    sent: torch.Tensor,
    numel: int,
    *,
    shapes: Sequence[torch.Size],
    codec: Codec,
    channel: WanChannel,
    dp_group: dist.ProcessGroup | None,
    account: bool = True,
) -> PendingMean:
    """Send again a payload saved in a checkpoint while it was in flight (the codec and error feedback already
    ran for it, so they are not run again: the resumed run sends exactly the same bytes)."""
    _, _, _, _, my_shapes = _my_slice(shapes, dp_group)
    payload = Payload(sent)
    own_decoded = codec.decode_list(payload, my_shapes)
    return _launch_payload(torch.zeros(numel), payload, own_decoded, shapes=shapes, codec=codec, channel=channel,
                           dp_group=dp_group, codec_s=0.0, account=account)  # fmt: skip


def _launch_payload(
    flat: torch.Tensor,
    payload: Payload,
    own_decoded: list[torch.Tensor],
    *,
    shapes: Sequence[torch.Size],
    codec: Codec,
    channel: WanChannel,
    dp_group: dist.ProcessGroup | None,
    codec_s: float,
    account: bool = True,
) -> PendingMean:
    bounds, start, end, _, my_shapes = _my_slice(shapes, dp_group)
    info = {"payload_bytes": payload.nbytes, "dense_bytes": 4 * (end - start), "codec_s": codec_s}
    transfer = channel.launch_all_gather(payload.data, account=account)
    own_index = channel.group_rank

    def finish() -> torch.Tensor:
        payloads = transfer.wait()
        decode_from = time.perf_counter()
        total = torch.zeros(end - start, dtype=torch.float32)  # (slice,)
        for index, data in enumerate(payloads):
            decoded = own_decoded if index == own_index else codec.decode_list(Payload(data), my_shapes)
            if decoded:
                total += torch.cat([d.reshape(-1) for d in decoded])
        info["codec_s"] += time.perf_counter() - decode_from
        return total.div_(len(payloads))

    return PendingMean(flat=flat, bounds=bounds, finish=finish, transfer=transfer, dp_group=dp_group,
                       sent=payload.data, info=info)  # fmt: skip
