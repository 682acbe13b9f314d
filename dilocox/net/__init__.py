"""The slow link between clusters: exact byte accounting, FIFO link emulation, the communicator thread, payload
authentication, and bounded JSON control messages."""

from dilocox.net.auth import PayloadAuth
from dilocox.net.channel import PendingTransfer, WanChannel
from dilocox.net.json_gather import all_gather_json
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
    "PayloadAuth",
    "PendingTransfer",
    "WanChannel",
    "all_gather_json",
    "link_charge_bytes",
    "parse_bandwidth",
    "parse_duration",
    "ring_all_gather_bytes",
    "ring_all_reduce_bytes",
    "ring_chunk_numels",
]
