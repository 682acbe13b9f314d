"""`[network]`: the slow link between clusters, owned and validated here (the link model is in `link.py`).

cfg = NetworkConfig(bandwidth="100Mbps", latency="20ms", auth_key_file="/etc/dilocox/wan.key")
cfg.validate()                                   # ValueError naming network.<field> and the fix
auth = cfg.payload_auth()                        # PayloadAuth of the key file, or None
"""

from __future__ import annotations

from dataclasses import dataclass

from dilocox.checks import check_types
from dilocox.net.auth import PayloadAuth, read_auth_key
from dilocox.net.link import parse_bandwidth, parse_duration


@dataclass
class NetworkConfig:
    bandwidth: str = "1Gbps"
    """Uplink bandwidth of one cluster, shared by its ranks that sync at once: e.g. 1Gbps, 100Mbps, unlimited."""
    latency: str = "10ms"
    """One-way latency added to every slow-link collective: e.g. 10ms, 0."""
    auth_key_file: str = ""
    """File holding a shared secret (>= 16 bytes, the same on all clusters): HMAC-tag slow-link payloads; "" = off."""

    @property
    def bandwidth_bytes_per_s(self) -> float | None:
        """The bandwidth in bytes per second; None when unlimited (no emulation)."""
        return parse_bandwidth(self.bandwidth)

    @property
    def latency_s(self) -> float:
        return parse_duration(self.latency)

    def payload_auth(self) -> PayloadAuth | None:
        """The tagger of `auth_key_file` (the key is read here, in the rank, and kept only in memory), or None."""
        return PayloadAuth.from_file(self.auth_key_file) if self.auth_key_file else None

    def validate(self) -> None:
        parse_bandwidth(self.bandwidth)  # first: their messages say which units are understood
        parse_duration(self.latency)
        check_types("network", self)
        if self.auth_key_file:
            read_auth_key(self.auth_key_file)  # exists, readable, long enough; only the path stays in the config
