"""`[network]`: the slow link between clusters and failure detection, owned and validated here (the link model is
in `link.py`, the heartbeat watchdog in `watchdog.py`).

cfg = NetworkConfig(bandwidth="100Mbps", latency="20ms", stall_timeout="30s", auth_key_file="/etc/dilocox/wan.key")
cfg.validate()                                   # ValueError naming network.<field> and the fix
auth = cfg.payload_auth()                        # PayloadAuth of the key file, or None
"""

from __future__ import annotations

from dataclasses import dataclass

from dilocox.checks import check_types
from dilocox.net.auth import PayloadAuth, read_auth_key
from dilocox.net.link import parse_bandwidth, parse_duration
from dilocox.net.listen import LOOPBACK


@dataclass
class NetworkConfig:
    bandwidth: str = "1Gbps"
    """Uplink bandwidth of one cluster, shared by its ranks that sync at once: e.g. 1Gbps, 100Mbps, unlimited."""
    latency: str = "10ms"
    """One-way latency added to every slow-link collective: e.g. 10ms, 0."""
    # 600s, not gloo's 30 min: long enough for the longest legitimate wait in one collective that we know of, one
    # round's slow-link transfer at the paper's scale (the 107B int4 pseudo-gradient takes ~455 s at 1 Gbps,
    # docs/design.md §1), and for peers waiting at the checkpoint barrier while cluster 0 scores the final evaluation.
    # A stopped or cut-off rank is named sooner by the heartbeat; this bounds what beats but never finishes.
    timeout: str = "600s"
    """Longest wait of one collective before its rank fails (every process group); raise it for longer transfers."""
    heartbeat: str = "5s"
    """Every rank bumps its counter in the job's store this often and reads the others' (a daemon thread)."""
    stall_timeout: str = "60s"
    """A rank silent this long is named: the run stops (exit 4), or an elastic run goes on without it; 0: off."""
    auth_key_file: str = ""
    """File holding a shared secret (>= 16 bytes, the same on all clusters): HMAC-tag slow-link payloads; "" = off."""
    lighthouse: str = ""
    """topology.elastic: a torchft Lighthouse's URL (`dilocox lighthouse` prints it); "" = the launcher's own."""
    advertise_host: str = ""
    """elastic, several machines: this machine's address the others reach; it listens there only ("" = 127.0.0.1)."""

    @property
    def listen_host(self) -> str:
        """The address every listening socket of this machine's launcher and ranks binds (`net/listen.py`)."""
        return self.advertise_host or LOOPBACK

    @property
    def bandwidth_bytes_per_s(self) -> float | None:
        """The bandwidth in bytes per second; None when unlimited (no emulation)."""
        return parse_bandwidth(self.bandwidth)

    @property
    def latency_s(self) -> float:
        return parse_duration(self.latency)

    @property
    def timeout_s(self) -> float:
        return parse_duration(self.timeout, name="network.timeout")

    @property
    def heartbeat_s(self) -> float:
        return parse_duration(self.heartbeat, name="network.heartbeat")

    @property
    def stall_timeout_s(self) -> float:
        """Seconds without a heartbeat before a rank is called stalled; 0 when the watchdog is off."""
        return parse_duration(self.stall_timeout, name="network.stall_timeout")

    def payload_auth(self) -> PayloadAuth | None:
        """The tagger of `auth_key_file` (the key is read here, in the rank, and kept only in memory), or None."""
        return PayloadAuth.from_file(self.auth_key_file) if self.auth_key_file else None

    def validate(self) -> None:
        parse_bandwidth(self.bandwidth)  # first: their messages say which units are understood
        parse_duration(self.latency)
        for name in ("timeout", "heartbeat"):
            if getattr(self, f"{name}_s") <= 0:
                raise ValueError(f"network.{name} = {getattr(self, name)!r} must be > 0, e.g. {_EXAMPLES[name]!r}")
        stall, heartbeat, timeout = self.stall_timeout_s, self.heartbeat_s, self.timeout_s
        if stall and stall < 2 * heartbeat:
            raise ValueError(
                f"network.stall_timeout = {self.stall_timeout!r} must be at least 2 x network.heartbeat = "
                f"{self.heartbeat!r}, so that one late heartbeat does not stop the run (or 0 to turn the watchdog off)"
            )
        if stall >= timeout:
            raise ValueError(
                f"network.stall_timeout = {self.stall_timeout!r} must be shorter than network.timeout = "
                f"{self.timeout!r}: otherwise a collective times out with gloo's error before the stalled rank is named"
            )
        check_types("network", self)
        if self.auth_key_file:
            read_auth_key(self.auth_key_file)  # exists, readable, long enough; only the path stays in the config


_EXAMPLES = {"timeout": "600s", "heartbeat": "5s"}
