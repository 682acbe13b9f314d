"""Failure detection: a heartbeat through the job's store names a stopped, hung or cut-off rank in bounded time.

Without it a rank stopped by SIGSTOP, a frozen host or a dead link blocks every other rank inside a collective
until gloo's timeout (30 minutes by default) and then fails with a message that names nobody. Every rank runs one
daemon thread that, every `network.heartbeat`,

    store.add("beat/<rank>", 1)                            # its own counter: this process is alive
    store.multi_get(["beat/0", ..., "beat/W-1", "abort"])  # everyone's counter in one round trip

A rank whose counter has not moved for `network.stall_timeout` is stalled. Counters are compared, never clocks:
each watcher times the silence on its own monotonic clock from the last change it saw, so hosts' clocks may
differ. The first watcher to see a stall claims the `abort` key (compare-and-set), prints one line naming the
rank(s) with their cluster / dp / pp coordinates, and every rank, also one blocked in a collective, exits with
`EXIT_STALLED` from its watchdog thread (`os._exit`: a stalled run writes no checkpoint; the complete ones stay).

    watchdog = Watchdog.from_config(JobStore(store, "the launcher's store"), cfg.network, rank=rank, topology=topo)
    watchdog.start()    # after the process groups exist, so every rank starts within the same second
    watchdog.stop()     # a rank that finishes marks itself done: slower finishers are not reported

The thread keeps beating while the training thread evaluates or writes a checkpoint; only a frozen process (or
one whose C code holds the GIL longer than `network.stall_timeout`) stops beating. A TCPStore client waits for
ever on a server that is frozen (measured: its own timeout does not bound a reply that never comes), so every
store call runs on a helper thread that is waited for at most `op_timeout_s`, and a watcher that has had no
answer for `network.stall_timeout` says the store's host is unreachable and exits. Cost per interval and rank:
two store round trips of O(world) bytes. docs/design.md §10.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.distributed as dist

    from dilocox.net.config import NetworkConfig
    from dilocox.topology import Topology

EXIT_STALLED = 4
"""A rank exits with this code when the watchdog found a stalled rank or an unreachable store."""

DONE = 1 << 40
"""Added to a rank's counter when it stops on purpose: the others no longer watch it."""

MAX_NAMED = 6  # parts of the message that name ranks or clusters; the rest are counted


@dataclass(frozen=True)
class JobStore:
    """The job's key-value store (a `torch.distributed.Store`: the launcher's TCPStore or torchrun's) and how an
    error message calls its host."""

    store: dist.Store
    name: str = "the job's store"
    namespace: str = "dilocox/watchdog"
    """Key prefix; a restart inside one torchrun job uses its own (`TORCHELASTIC_RESTART_COUNT`)."""


def describe_ranks(ranks: list[int], topology: Topology) -> str:
    """`rank 3 (cluster 1, dp 0, pp 1)`; a cluster all of whose ranks are listed is named once."""
    parts: list[str] = []
    by_cluster: dict[int, list[int]] = {}
    for rank in sorted(ranks):
        by_cluster.setdefault(topology.coords(rank).cluster, []).append(rank)
    for cluster, members in by_cluster.items():
        if len(members) == len(topology.ranks_of_cluster(cluster)) > 1:
            parts.append(f"every rank of cluster {cluster} (ranks {members[0]}-{members[-1]})")
            continue
        for rank in members:
            c = topology.coords(rank)
            parts.append(f"rank {rank} (cluster {c.cluster}, dp {c.dp}, pp {c.pp})")
    if len(parts) > MAX_NAMED:
        parts = [*parts[:MAX_NAMED], f"{len(parts) - MAX_NAMED} more"]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _exit_process(message: str | None) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(EXIT_STALLED)


def _bounded(fn: Callable[[], Any], timeout_s: float) -> Any:
    """`fn()` on a daemon thread, waited for at most `timeout_s`; TimeoutError if it has not returned by then (the
    thread is abandoned, with the store client it was using)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=run, name="dilocox-watchdog-store", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no answer in {timeout_s:.1f} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def run_was_stopped(job_store: JobStore, *, timeout_s: float = 5.0) -> bool:
    """Whether a watchdog of this job reported a stall (its ranks then exit with `EXIT_STALLED`): a rank whose
    collective broke because a peer exited, or the launcher, asks this to say nothing more than that line."""
    key = f"{job_store.namespace}/abort"

    def read() -> bool:
        store = job_store.store.clone()
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
        return store.check([key]) and store.get(key) != b"0"

    try:
        return bool(_bounded(read, timeout_s))
    except Exception:
        return False


class Watchdog:
    """Beats this rank's counter in the job's store and stops the process when another rank stops beating.

    `on_stall(message)` ends the process (default: flush and `os._exit(EXIT_STALLED)`); `message` is the line this
    rank printed, or None when another rank reported first. Tests pass their own to watch it in one process, and a
    `clock` of their own (default `time.monotonic`) to decide silences on time they move themselves."""

    def __init__(
        self,
        job_store: JobStore,
        *,
        rank: int,
        topology: Topology,
        heartbeat_s: float,
        stall_timeout_s: float,
        setting: str | None = None,
        on_stall: Callable[[str | None], None] = _exit_process,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < 2 * heartbeat_s <= stall_timeout_s:
            raise ValueError(f"stall_timeout_s = {stall_timeout_s} must be at least 2 x heartbeat_s = {heartbeat_s}")
        self.rank = rank
        self.topology = topology
        self.heartbeat_s = heartbeat_s
        self.stall_timeout_s = stall_timeout_s
        self.op_timeout_s = max(heartbeat_s, stall_timeout_s / 4)
        self.setting = setting or f"network.stall_timeout = {stall_timeout_s:g}s"
        self.store_name = job_store.name
        self.on_stall = on_stall
        self.clock = clock
        ns = job_store.namespace
        self._beat_keys = [f"{ns}/beat/{r}" for r in range(topology.world_size)]
        self._abort_key, self._reported_key = f"{ns}/abort", f"{ns}/reported"
        # A client of our own, cloned on the caller's thread: store clients are not thread-safe, and the process
        # group keeps using the original. Only ever cloned again, never used for calls itself.
        self._template = job_store.store.clone()
        self._client: dist.Store | None = None
        self._keys_exist = False
        self._last_seen: list[int | None] = [None] * topology.world_size
        self._changed_at = [0.0] * topology.world_size
        self._last_answer = 0.0
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.report: str | None = None
        """The line this rank printed, once it found a stall."""

    @classmethod
    def from_config(
        cls, job_store: JobStore, cfg: NetworkConfig, *, rank: int, topology: Topology, **kwargs: Any
    ) -> Watchdog:
        return cls(
            job_store,
            rank=rank,
            topology=topology,
            heartbeat_s=cfg.heartbeat_s,
            stall_timeout_s=cfg.stall_timeout_s,
            setting=f"network.stall_timeout = {cfg.stall_timeout}",
            **kwargs,
        )

    # ------------------------------------------------------------------------------------------------ lifetime
    def start(self) -> None:
        now = self.clock()
        self._last_answer = now
        self._changed_at = [now] * len(self._changed_at)
        self._thread = threading.Thread(target=self._run, name="dilocox-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop beating and mark this rank done (best effort: a store that does not answer is left alone)."""
        if self._thread is None:
            return
        self._stopping.set()
        self._thread.join(timeout=2 * self.op_timeout_s + self.heartbeat_s)
        alive, self._thread = self._thread.is_alive(), None
        if alive:  # still waiting for a store that does not answer: nothing more to tell it
            return
        try:
            self._call(lambda store: store.add(self._beat_keys[self.rank], DONE))
        except Exception:
            pass

    # ------------------------------------------------------------------------------------------------ the loop
    def _run(self) -> None:
        while not self._stopping.is_set():
            self.check_once()
            self._stopping.wait(self.heartbeat_s)

    def check_once(self) -> None:
        """One heartbeat: beat, read every counter, and stop the process if a rank (or the store) went silent."""
        try:
            self._call(lambda store: store.add(self._beat_keys[self.rank], 1))
            if not self._keys_exist:  # once: a rank that has not started yet must not make multi_get wait
                self._call(self._create_keys)
                self._keys_exist = True
            values = self._call(lambda store: store.multi_get([*self._beat_keys, self._abort_key]))
        except Exception:
            silent = self.clock() - self._last_answer
            if silent >= self.stall_timeout_s and not self._stopping.is_set():
                self._stop_run(
                    f"dilocox: error: rank {self.rank} has had no answer from {self.store_name} for {silent:.0f} s "
                    f"({self.setting}): its host is stopped, hung or cut off; the run stops",
                    claim=False,
                )
            return
        now = self._last_answer = self.clock()
        if values[-1] != b"0":
            self._follow_report()
            return
        stalled = []
        for rank, raw in enumerate(values[:-1]):
            count = int(raw)
            if rank == self.rank or count >= DONE:
                continue
            if count != self._last_seen[rank]:
                self._last_seen[rank], self._changed_at[rank] = count, now
            elif now - self._changed_at[rank] >= self.stall_timeout_s:
                stalled.append(rank)
        if stalled and not self._stopping.is_set():
            silent = max(now - self._changed_at[rank] for rank in stalled)
            verb = "has" if len(stalled) == 1 else "have"
            self._stop_run(
                f"dilocox: error: {describe_ranks(stalled, self.topology)} {verb} not sent a heartbeat for "
                f"{silent:.0f} s ({self.setting}): {'it is' if len(stalled) == 1 else 'they are'} stopped, hung or "
                "cut off; the run stops",
                claim=True,
            )

    def _create_keys(self, store: dist.Store) -> None:
        keys = [*self._beat_keys, self._abort_key]
        if not store.check(keys):
            for key in keys:
                store.add(key, 0)  # creates it at 0, or leaves its count as it is

    # ------------------------------------------------------------------------------------------------ stopping
    def _stop_run(self, message: str, *, claim: bool) -> None:
        """Print `message` unless another rank already reported (one line per job), then end the process."""
        if claim:
            mine = f"{self.rank}\n{message}"
            try:
                won = self._call(lambda store: store.compare_set(self._abort_key, "0", mine)) == mine.encode()
            except Exception:
                won = True  # the store went away meanwhile: say it here rather than nowhere
            if not won:
                self._follow_report()
                return
        self.report = message
        print(message, file=sys.stderr, flush=True)
        if claim:
            try:
                self._call(lambda store: store.set(self._reported_key, "1"))
            except Exception:
                pass
        self._stopping.set()
        self.on_stall(message)

    def _follow_report(self) -> None:
        """Another rank claimed the report: give it a moment to print it, then stop too."""
        deadline = time.monotonic() + self.op_timeout_s
        while time.monotonic() < deadline:
            try:
                if self._call(lambda store: store.check([self._reported_key])):
                    break
            except Exception:
                break
            time.sleep(0.05)
        self._stopping.set()
        self.on_stall(None)

    def _call(self, fn: Callable[[dist.Store], Any]) -> Any:
        """`fn(client)` bounded by `op_timeout_s`; a client that failed or timed out is replaced by a new one."""
        if self._client is None:
            client = _bounded(self._template.clone, self.op_timeout_s)
            client.set_timeout(datetime.timedelta(seconds=self.op_timeout_s))
            self._client = client
        client = self._client
        try:
            return _bounded(lambda: fn(client), self.op_timeout_s)
        except Exception:
            self._client = None
            raise
