"""A virtual clock for the WAN channel's link emulation, so that tests assert exact schedules on a loaded machine.

    clock = SimulatedClock()
    channel = clock.follow(WanChannel(group, bandwidth=5e6, latency_s=0.02, clock=clock))
    transfer = channel.launch_all_reduce(shard)
    clock.sleep(0.5)              # the trainer computes for 0.5 virtual seconds
    transfer.wait()               # returns at once when the link delivered within those 0.5 s

Time moves only when the trainer computes (`sleep`) or waits for a transfer (`block`), and then only as far as the
next event: a transfer the emulated link delivers (its communicator thread parks in `sleep_until`), or the end of
the computation. A collective itself takes no virtual time: before time moves, every followed channel's communicator
thread must have finished its real gloo work and parked (or have nothing to do). Nothing depends on how fast the
machine runs: the blocked (exposed) time, each transfer's link time and the H that `sync.round.fit_link` derives from
them are exact. One thread, the trainer, drives the clock.
"""

from __future__ import annotations

import math
import threading

from dilocox.net.channel import WanChannel

_POLL_S = 0.002  # how often a waiting trainer looks again at a channel's progress (real seconds; no time is judged)


class SimulatedClock:
    """Virtual seconds, moved by the trainer thread only (see the module docstring)."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._cond = threading.Condition()
        self._parked: list[float] = []  # the deadlines of communicator threads waiting in sleep_until
        self._channels: list[WanChannel] = []

    def follow(self, channel: WanChannel) -> WanChannel:
        """Wait for `channel`'s communicator thread before moving time; returns the channel."""
        assert channel.clock is self, "build the channel with clock=this clock"
        with self._cond:
            self._channels.append(channel)
        return channel

    # ------------------------------------------------------------------------------------------ the Clock protocol
    def now(self) -> float:
        with self._cond:
            return self._now

    def sleep_until(self, deadline: float) -> None:
        """The communicator thread: park until the trainer moves time to `deadline`."""
        with self._cond:
            self._parked.append(deadline)
            self._cond.notify_all()
            while self._now < deadline:
                self._cond.wait()
            self._parked.remove(deadline)
            self._cond.notify_all()

    def block(self, done: threading.Event) -> None:
        """The trainer waits for a transfer: time jumps from one delivery to the next until `done` is set."""
        with self._cond:
            while not done.is_set():
                self._settle(done)
                if done.is_set():
                    break
                if self._parked:
                    self._advance_to(min(self._parked))
                else:  # a transfer outside the emulation (not accounted) runs in real time: wait for it
                    self._cond.wait(_POLL_S)

    # ------------------------------------------------------------------------------------------ the trainer
    def sleep(self, seconds: float) -> None:
        """The trainer computes for `seconds`: deliveries due meanwhile happen at their own times, in order."""
        with self._cond:
            target = self._now + seconds
            while True:
                self._settle()
                due = min(self._parked, default=math.inf)
                if due > target:
                    break
                self._advance_to(due)
            self._now = max(self._now, target)
            self._cond.notify_all()

    # ------------------------------------------------------------------------------------------ internals
    def _busy_channels(self) -> int:
        return sum(1 for channel in self._channels if channel.num_in_flight)

    def _settle(self, done: threading.Event | None = None) -> None:
        """Wait (condition held) until every followed channel with work has parked its communicator thread."""
        while self._busy_channels() > len(self._parked) and not (done is not None and done.is_set()):
            self._cond.wait(_POLL_S)

    def _advance_to(self, when: float) -> None:
        """Move time to `when` and wait until the transfers due by then have left their park."""
        self._now = max(self._now, when)
        self._cond.notify_all()
        while any(deadline <= self._now for deadline in self._parked):
            self._cond.wait()


class SharedClock:
    """Seconds that every rank reads from one store and that move only when a rank moves them: a cluster that
    computes longer (`advance_to`) sends late as a fact of the test, not of the machine's load. `block` tells the
    store that this rank waits (`blocked_key`), so a peer can act only once it does.

        clock = SharedClock(dist.FileStore(path, 2), rank)
        clock.advance_to(5.0)                        # this cluster computed 5 s more
    """

    def __init__(self, store, rank: int) -> None:
        self.store = store
        self.rank = rank
        store.compare_set("now", "", "0.0")  # the first rank sets the origin; later ones find it

    def now(self) -> float:
        return float(self.store.get("now"))

    def advance_to(self, seconds: float) -> None:
        """Move the time to `seconds` unless it is already later."""
        while (current := self.store.get("now")) and float(current) < seconds:
            self.store.compare_set("now", current.decode(), repr(seconds))

    def sleep_until(self, deadline: float) -> None:
        self.advance_to(deadline)

    def block(self, done: threading.Event) -> None:
        self.store.set(self.blocked_key(self.rank), "1")
        done.wait()

    @staticmethod
    def blocked_key(rank: int) -> str:
        return f"blocked{rank}"
