"""`[network]`: the slow link between clusters, owned and validated here (the link model is in `link.py`).

cfg = NetworkConfig(bandwidth="100Mbps", latency="20ms")
cfg.validate()                                   # ValueError naming network.<field> and the fix
"""

from __future__ import annotations

from dataclasses import dataclass

from dilocox.checks import check_types
from dilocox.net.link import parse_bandwidth, parse_duration


@dataclass
class NetworkConfig:
    bandwidth: str = "1Gbps"
    """Uplink bandwidth of one cluster, shared by its ranks that sync at once: e.g. 1Gbps, 100Mbps, unlimited."""
    latency: str = "10ms"
    """One-way latency added to every slow-link collective: e.g. 10ms, 0."""

    @property
    def bandwidth_bytes_per_s(self) -> float | None:
        """The bandwidth in bytes per second; None when unlimited (no emulation)."""
        return parse_bandwidth(self.bandwidth)

    @property
    def latency_s(self) -> float:
        return parse_duration(self.latency)

    def validate(self) -> None:
        parse_bandwidth(self.bandwidth)  # first: their messages say which units are understood
        parse_duration(self.latency)
        check_types("network", self)
