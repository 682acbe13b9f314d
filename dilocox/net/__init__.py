"""The slow link between clusters: exact byte accounting, FIFO link emulation, the communicator thread, payload
authentication, and bounded JSON control messages."""

from dilocox.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "dilocox.net.auth": ("PayloadAuth",),
        "dilocox.net.channel": ("PendingTransfer", "WanChannel"),
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
    },
)
