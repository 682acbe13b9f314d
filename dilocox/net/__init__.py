"""The slow link between clusters: the WAN channel (channel.py) composed of its transport (the communicator thread,
transport.py), its accounting and FIFO link emulation (accounting.py, link.py) and payload authentication (sealing.py,
auth.py); bounded JSON control messages (json_gather.py)."""

from dilocox.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "dilocox.net.accounting": ("LinkAccount",),
        "dilocox.net.auth": ("PayloadAuth",),
        "dilocox.net.channel": ("WanChannel",),
        "dilocox.net.json_gather": ("all_gather_json",),
        "dilocox.net.link": (
            "LinkModel",
            "link_charge_bytes",
            "parse_bandwidth",
            "parse_duration",
            "ring_all_gather_bytes",
            "ring_all_reduce_bytes",
            "ring_chunk_numels",
        ),
        "dilocox.net.sealing": ("PayloadSeal", "PayloadsRejected", "rejection_verdict"),
        "dilocox.net.transport": ("Communicator", "PendingTransfer", "Wire"),
    },
)
