"""What a channel's slow link carried and how long it took: exact bytes, link busy time, the trainer's waits, the peak
of bytes in flight; in emulation mode the FIFO `LinkModel`'s arrival, until which each transfer is held (§5 of
docs/design.md).

    account = LinkAccount(bandwidth / num_sharing, latency_s=0.01, clock=MonotonicClock())
    start, done, link_done = account.deliver(sent, recv, control, phases=1, launch_time=t0, started=t1, ended=t2)
    account.stats()["bytes_sent"]

The communicator thread calls `deliver` once a collective has run; the trainer's thread adds what it waited
(`add_wait`) and reads the counters, so every counter is read and written under one lock.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator

from dilocox.net.clock import Clock
from dilocox.net.link import LinkModel, link_charge_bytes

COUNTERS = ("bytes_sent", "bytes_recv", "control_bytes", "link_busy_s", "exposed_s", "peer_wait_s", "num_transfers",
            "payloads_rejected", "peak_in_flight_bytes")  # fmt: skip
"""Every counter, in the order of `stats()`; those ending in _s are seconds (float), the others counts (int)."""
STAT_KEYS = ("bytes_sent", "bytes_recv", "control_bytes", "link_busy_s", "exposed_s", "num_transfers")
"""The counters every saved state holds; the others are newer than some checkpoints (0 when a state lacks them)."""


class LinkAccount:
    """One rank's slow link as numbers: what it carried, how long it was busy, how long the trainer waited for it.

    `bytes_per_s` is this rank's share of the uplink (None: unlimited, no emulation); `latency_s` is paid once per
    dependent step of a transfer. In emulation a transfer starts when it is launched and the previous one has left
    the wire (`LinkModel`), and `deliver` holds the communicator thread until the model's arrival on `clock`.
    """

    def __init__(self, bytes_per_s: float | None, latency_s: float, clock: Clock) -> None:
        link = LinkModel(bytes_per_s, latency_s)  # validates both values, naming network.bandwidth / latency
        self.link: LinkModel | None = None if bytes_per_s is None else link
        self.clock = clock
        self.counts_peak = True
        """Transfers launched now count towards `peak_in_flight_bytes` (False inside `off_peak`)."""
        self._lock = threading.Lock()
        self._counters: dict[str, float | int] = {key: 0.0 if key.endswith("_s") else 0 for key in COUNTERS}
        self._arrivals: collections.deque[tuple[float, int]] = collections.deque()
        """(done time, bytes sent) of the accounted transfers that may still overlap a later launch."""

    @property
    def bytes_per_s(self) -> float | None:
        return None if self.link is None else self.link.bytes_per_s

    def read(self, key: str) -> float | int:
        with self._lock:
            return self._counters[key]

    def stats(self) -> dict[str, float | int]:
        with self._lock:
            return dict(self._counters)

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Restore counters saved by `stats()` (those not in `STAT_KEYS` may be missing: 0)."""
        with self._lock:
            for key in COUNTERS:
                value = state.get(key, 0)
                self._counters[key] = float(value) if key.endswith("_s") else int(value)

    @contextlib.contextmanager
    def off_peak(self) -> Iterator[None]:
        """Transfers launched inside do not count towards `peak_in_flight_bytes`."""
        self.counts_peak = False
        try:
            yield
        finally:
            self.counts_peak = True

    def add_wait(self, link_s: float, peers_s: float) -> None:
        """The trainer was blocked `link_s` waiting for the link and `peers_s` for late peers."""
        with self._lock:
            self._counters["exposed_s"] += link_s
            self._counters["peer_wait_s"] += peers_s

    def add_rejected(self, num_payloads: int) -> None:
        """Peers' payloads whose tag did not verify here."""
        with self._lock:
            self._counters["payloads_rejected"] += num_payloads

    def deliver(
        self,
        nbytes_sent: int,
        nbytes_recv: int,
        control_bytes: int,
        *,
        phases: int,
        launch_time: float,
        started: float,
        ended: float,
        peers_s: float = 0.0,
        in_peak: bool = True,
    ) -> tuple[float, float, float]:
        """Count a collective that ran from `started` to `ended` (launched at `launch_time`, of which `peers_s` waited
        for late peers) and return its (start, done, link_done) times. Emulated, the link model schedules it and
        this call returns at its arrival (or at `ended`, if the real collective was slower); unlimited, the link's
        time is the measured one after every peer had joined."""
        if self.link is None:
            start, done, link_done = started, ended, ended - peers_s
            busy_s = link_done - started
        else:
            charge = link_charge_bytes(nbytes_sent, nbytes_recv) + control_bytes
            busy_before = self.link.busy_s
            start, link_done = self.link.schedule(charge, launch_time, phases=max(1, phases))
            busy_s = self.link.busy_s - busy_before
            self.clock.sleep_until(link_done)
            done = max(link_done, ended)
        with self._lock:
            counters = self._counters
            counters["bytes_sent"] += nbytes_sent
            counters["bytes_recv"] += nbytes_recv
            counters["control_bytes"] += control_bytes
            counters["link_busy_s"] += busy_s
            counters["num_transfers"] += 1
            if in_peak:
                self._count_in_flight(launch_time, done, nbytes_sent)
        return start, done, link_done

    def _count_in_flight(self, launch_time: float, done: float, nbytes: int) -> None:
        """Raise the peak of bytes in flight by a transfer that just completed (call under the lock). Transfers are
        launched and completed in order, so every transfer launched before this one has completed and none launched
        after it is counted at its launch time; the bytes in flight peak at a launch: here, the sum over this one and
        the earlier ones that had not arrived when it was launched."""
        while self._arrivals and self._arrivals[0][0] <= launch_time:
            self._arrivals.popleft()  # arrived before this launch, so before every later one
        self._arrivals.append((done, nbytes))
        peak = sum(n for _, n in self._arrivals)
        self._counters["peak_in_flight_bytes"] = max(self._counters["peak_in_flight_bytes"], peak)
