"""A member of an elastic round that stops answering while the others wait on the round's transfer: named within
`network.stall_timeout`, and the wait fails so that the live members settle the round without it (docs/design.md
§10.1).

A cluster frozen in the middle of a slow-link collective (SIGSTOP, a frozen host) keeps its sockets open, so its
peers' gloo collective neither completes nor fails until gloo's timeout, `network.timeout` (600 s by default, sized
for the longest legitimate transfer). Its heartbeat to the Lighthouse stops, though: torchft's manager server beats
from a thread of its own every 100 ms, whatever the training thread is doing, so a long but live transfer keeps
beating and a frozen process does not. While this cluster waits, a `StallWatch` thread reads the Lighthouse's
heartbeat ages every `network.heartbeat`; a member silent for longer than `network.stall_timeout` is named, and
`on_stall` fails the wait (`WanChannel.abandon`).

    watch = StallWatch(ages=lambda: heartbeat_ages(url), stall_timeout_s=60, poll_s=5)
    with watch.watching([0, 2], on_stall=fail_the_wait):
        pending.wait()      # fails at once when on_stall fails it
"""

from __future__ import annotations

import contextlib
import http.client
import re
import threading
from collections.abc import Callable, Collection, Iterator, Mapping


class MemberStalled(RuntimeError):
    """Members of this round stopped answering (no heartbeat for network.stall_timeout) during its transfer."""

    def __init__(self, silent: Mapping[int, float], stall_timeout_s: float) -> None:
        self.silent = dict(silent)
        named = ", ".join(f"cluster {cluster} (no heartbeat for {age:.1f}s)" for cluster, age in sorted(silent.items()))
        super().__init__(f"{named} stalled in the round's transfer (network.stall_timeout = {stall_timeout_s:g}s)")


def cluster_ages(ages: Mapping[str, float]) -> dict[int, float]:
    """Seconds since each cluster last beat, from the Lighthouse's ages by replica id. torchft names a cluster's
    replica `cluster{c}:{uuid}`, a new uuid for each process, and the Lighthouse keeps the ids of ended processes, so
    a cluster's age is that of its most recent id (a restarted cluster beats under its new one)."""
    by_cluster: dict[int, float] = {}
    for replica, age in ages.items():
        found = _REPLICA.fullmatch(replica)
        if found:
            cluster = int(found.group(1))
            by_cluster[cluster] = min(age, by_cluster.get(cluster, age))
    return by_cluster


_REPLICA = re.compile(r"cluster(\d+)(?::.*)?")


class StallWatch:
    """Watches a round's other members while this cluster waits on the round's transfer.

    `ages()` returns the seconds since each replica's last heartbeat, by replica id (`heartbeat_ages` of the
    Lighthouse); a Lighthouse that does not answer is read again at the next poll (its own loss is the launcher's to
    report). `poll_s` is network.heartbeat."""

    def __init__(self, *, ages: Callable[[], Mapping[str, float]], stall_timeout_s: float, poll_s: float) -> None:
        self.ages = ages
        self.stall_timeout_s = stall_timeout_s
        self.poll_s = poll_s

    def heartbeat_ages(self) -> dict[int, float]:
        """Seconds since each cluster's last heartbeat (`cluster_ages`); empty when the Lighthouse does not answer."""
        try:
            return cluster_ages(self.ages())
        except (OSError, http.client.HTTPException):
            return {}

    def silent(self, clusters: Collection[int]) -> dict[int, float]:
        """The clusters whose last heartbeat is older than network.stall_timeout, with its age in seconds; a cluster
        the Lighthouse has never heard of is not judged."""
        ages = self.heartbeat_ages()
        return {cluster: ages[cluster] for cluster in clusters if ages.get(cluster, 0.0) > self.stall_timeout_s}

    @contextlib.contextmanager
    def watching(self, clusters: Collection[int], on_stall: Callable[[MemberStalled], None]) -> Iterator[None]:
        """While the body runs, call `on_stall` once (from the watching thread) when some of `clusters` are silent
        for longer than network.stall_timeout. No thread for no clusters or a watch turned off (stall_timeout 0)."""
        if not clusters or self.stall_timeout_s <= 0:
            yield
            return
        done = threading.Event()
        lock = threading.Lock()  # on_stall never runs once the body has ended

        def watch() -> None:
            while not done.wait(self.poll_s):
                silent = self.silent(clusters)
                with lock:
                    if silent and not done.is_set():
                        on_stall(MemberStalled(silent, self.stall_timeout_s))
                        return

        # not joined: a poll in progress may wait for the Lighthouse's answer, and must not delay the round
        threading.Thread(target=watch, name="dilocox-stall-watch", daemon=True).start()
        try:
            yield
        finally:
            with lock:
                done.set()
