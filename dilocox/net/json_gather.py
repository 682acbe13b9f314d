"""Small control messages between ranks as JSON of bounded size: never pickle across the network.

`torch.distributed`'s `*_object` collectives unpickle what peers send, so any peer, or anyone who can reach its
port, can run code on the receiver. These messages (a start-up error, the memory report, the summary's byte totals)
travel as UTF-8 JSON in a uint8 tensor instead, after their lengths, and a length above the receiver's bound is
refused before anything of that size is allocated.

    errors = all_gather_json(error, group=dist.group.WORLD, max_bytes=64 << 10)   # one decoded value per rank
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


def all_gather_json(obj: Any, *, group: dist.ProcessGroup | None, max_bytes: int) -> list[Any]:
    """Every rank's `obj` (JSON-serializable), in group rank order, as `json.loads(json.dumps(obj))` gives it back
    (tuples become lists). `group=None` is the default (world) group, as in torch.distributed; a group of one
    communicates nothing.

    Each rank first says how many bytes it sends (one int64); if any says more than `max_bytes` (this rank
    included: every rank sees the same lengths, so all of them stop), a ValueError names that rank and nothing
    else is exchanged. Then the JSON bytes are all-gathered, padded to the longest (gloo gathers equal sizes).
    """
    data = json.dumps(obj, allow_nan=False, separators=(",", ":")).encode()
    world = dist.get_world_size(group)
    if world == 1:
        return [json.loads(data)]
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64), group=group)
    declared = [int(n.item()) for n in lengths]
    for peer, length in enumerate(declared):
        if not 0 <= length <= max_bytes:
            who = peer if group is None else dist.get_global_rank(group, peer)
            raise ValueError(
                f"rank {who} declared a control message of {length:,} bytes, outside the 0 ... {max_bytes:,} this "
                "exchange allows: a rank of another dilocox version, or a corrupted or forged message"
            )
    longest = max(declared)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # JSON text is never empty
    slots = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(slots, mine, group=group)
    values = []
    for peer, (slot, length) in enumerate(zip(slots, declared, strict=True)):
        try:
            values.append(json.loads(slot[:length].numpy().tobytes()))
        except ValueError:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
            who = peer if group is None else dist.get_global_rank(group, peer)
            raise ValueError(f"rank {who} sent a control message that is not valid JSON") from None
    return values
