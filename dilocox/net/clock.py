"""The clock of the slow link's emulation: when a transfer is launched, when the emulated link delivers it, and how
long the trainer waited for it.

`WanChannel(..., clock=...)` reads every time through one `Clock`. The default, `MonotonicClock`, is real time
(`time.perf_counter`); a clock that counts virtual seconds lets a test assert the link's schedule, the exposed time
and the H that `sync.round.fit_link` chooses exactly, on a machine of any speed (`tests/clock.py`).
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

__all__ = ["Clock", "MonotonicClock"]


class Clock(Protocol):
    """Seconds for the WAN channel: `now()` stamps launches and completions, the communicator thread calls
    `sleep_until` to hold a transfer until the emulated link delivers it, and the trainer calls `block` to wait for
    a transfer (its blocked time is the exposed communication)."""

    def now(self) -> float:
        """The current time in seconds (any origin; only differences matter)."""
        ...

    def sleep_until(self, deadline: float) -> None:
        """Return once `now() >= deadline`."""
        ...

    def block(self, done: threading.Event) -> None:
        """Return once `done` is set."""
        ...


class MonotonicClock:
    """Real time: `time.perf_counter()` seconds, real sleeps and waits."""

    def now(self) -> float:
        return time.perf_counter()

    def sleep_until(self, deadline: float) -> None:
        # time.sleep may wake a little early on some platforms; loop so completion is never before the deadline.
        while (remaining := deadline - time.perf_counter()) > 0:
            time.sleep(remaining)

    def block(self, done: threading.Event) -> None:
        done.wait()
