"""The slow link between clusters: exact byte accounting, FIFO link emulation, and the communicator thread."""

from dilocox.net.channel import PendingTransfer, WanChannel
from dilocox.net.link import (
    LinkModel,
    link_charge_bytes,
    parse_bandwidth,
    parse_duration,
    ring_all_gather_bytes,
    ring_all_reduce_bytes,
    ring_chunk_numels,
)

__all__ = [
    "LinkModel",
    "PendingTransfer",
    "WanChannel",
    "link_charge_bytes",
    "parse_bandwidth",
    "parse_duration",
    "ring_all_gather_bytes",
    "ring_all_reduce_bytes",
    "ring_chunk_numels",
]
