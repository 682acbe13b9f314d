"""The heartbeat watchdog against a real TCPStore: who is named, when, and that finished ranks are left alone."""

import datetime
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from dilocox.net.config import NetworkConfig
from dilocox.net.watchdog import DONE, JobStore, Watchdog, describe_ranks
from dilocox.topology import Topology

HEARTBEAT, STALL = 0.125, 1.0  # seconds of a ManualClock: binary fractions, so silences add up exactly


class ManualClock:
    """The watchdog's clock, moved by the test: silences are decided on this time, not on the machine's speed."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Outcome:
    """What `on_stall` was called with, per rank, and when on the test's clock (instead of ending the process)."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.calls: dict[int, str | None] = {}
        self.at: dict[int, float] = {}

    def handler(self, rank: int):
        def on_stall(message: str | None) -> None:
            self.calls[rank] = message
            self.at[rank] = self.clock()

        return on_stall


@pytest.fixture
def server():
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    yield store


def _watchdogs(server, topo: Topology, ranks: list[int], outcome: Outcome, namespace: str) -> list[Watchdog]:
    job = JobStore(server, "the test store", namespace=namespace)
    return [
        Watchdog(
            job,
            rank=rank,
            topology=topo,
            heartbeat_s=HEARTBEAT,
            stall_timeout_s=STALL,
            on_stall=outcome.handler(rank),
            clock=outcome.clock,
        )
        for rank in ranks
    ]


def _heartbeat(clock: ManualClock, dogs: list[Watchdog], outcome: Outcome) -> None:
    """One heartbeat of every watchdog that has not stopped, `HEARTBEAT` later on the clock."""
    clock.now += HEARTBEAT
    for dog in dogs:
        if dog.rank not in outcome.calls:
            dog.check_once()


def test_a_silent_rank_is_named_once_with_its_coordinates(server):
    """Ranks 0-2 beat; rank 3 (cluster 1, dp 0, pp 1) beats twice and then stops, as a SIGSTOPped process does."""
    topo = Topology(num_clusters=2, dp_degree=1, pp_degree=2)
    clock = ManualClock()
    outcome = Outcome(clock)
    dogs = _watchdogs(server, topo, [0, 1, 2], outcome, "silent")
    server.add("silent/beat/3", 1)
    _heartbeat(clock, dogs, outcome)
    _heartbeat(clock, dogs, outcome)
    server.add("silent/beat/3", 1)
    last_beat = clock()
    for _ in range(100):
        _heartbeat(clock, dogs, outcome)
        if len(outcome.calls) == 3:
            break
    assert sorted(outcome.calls) == [0, 1, 2], "every watching rank stops"
    reports = [m for m in outcome.calls.values() if m is not None]
    assert len(reports) == 1, reports  # one line per job: the first to claim the abort key
    report = reports[0]
    assert report.startswith("dilocox: error: rank 3 (cluster 1, dp 0, pp 1) has not sent a heartbeat for ")
    assert "1 s (network.stall_timeout = 1s): it is stopped, hung or cut off; the run stops" in report
    # its last beat is seen at the next heartbeat, and it is named exactly one stall timeout after that
    assert min(outcome.at.values()) - last_beat == HEARTBEAT + STALL
    assert [dog.report for dog in dogs].count(report) == 1


def test_finished_ranks_are_not_reported_and_a_clean_run_never_trips(server):
    """A rank that stops on purpose marks itself done; the ones still running keep watching the others only."""
    topo = Topology(num_clusters=3)
    clock = ManualClock()
    outcome = Outcome(clock)
    dogs = _watchdogs(server, topo, [0, 1, 2], outcome, "clean")
    for _ in range(3):
        _heartbeat(clock, dogs, outcome)
    dogs[2].start()  # its own thread, for stop() to end: the first to finish
    dogs[2].stop()
    assert int(server.get("clean/beat/2")) >= DONE
    for _ in range(int(4 * STALL / HEARTBEAT)):
        _heartbeat(clock, dogs[:2], outcome)
    assert outcome.calls == {}


def test_a_stalled_whole_cluster_is_named_as_a_cluster():
    topo = Topology(num_clusters=3, dp_degree=2, pp_degree=2)
    assert describe_ranks([4, 5, 6, 7], topo) == "every rank of cluster 1 (ranks 4-7)"
    assert describe_ranks([9, 4], topo) == "rank 4 (cluster 1, dp 0, pp 0) and rank 9 (cluster 2, dp 0, pp 1)"
    many = describe_ranks([0, 1, 2, 4, 5, 6, 8, 9], Topology(num_clusters=3, dp_degree=4, pp_degree=1))
    assert many.endswith("rank 6 (cluster 1, dp 2, pp 0) and 2 more") and many.count("rank ") == 6


_FROZEN_SERVER = """
import datetime, sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
print(store.port, flush=True)
time.sleep(600)
"""


def _wait_until_stopped(pid: int) -> None:
    """Return once process `pid` is stopped (state T in /proc), a SIGSTOP sent to it delivered."""
    deadline = time.monotonic() + 60
    while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.005)


def test_a_frozen_store_host_is_reported_and_the_watchdog_does_not_hang():
    """A TCPStore client waits for ever on a frozen server: every heartbeat still returns (its store calls are
    bounded), and the silence, counted on the test's clock from the last answer, is reported."""
    host = subprocess.Popen([sys.executable, "-c", _FROZEN_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(host.stdout.readline())
        client = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=2))
        clock = ManualClock()
        outcome = Outcome(clock)
        job = JobStore(client, f"the job's store at 127.0.0.1:{port} (hosted by rank 0)")
        dog = Watchdog(job, rank=1, topology=Topology(2), heartbeat_s=HEARTBEAT, stall_timeout_s=STALL,
                       on_stall=outcome.handler(1), clock=clock)  # fmt: skip
        client.add("dilocox/watchdog/beat/0", 1)
        for _ in range(2):  # under the stall timeout: nothing to report, however slow the store answered
            _heartbeat(clock, [dog], outcome)
        # each store call is bounded in real time: on a loaded machine a heartbeat can go unanswered, so the freeze
        # comes right after one that was answered
        for _ in range(20):
            if dog._last_answer == clock():
                break
            _heartbeat(clock, [dog], outcome)
        assert outcome.calls == {} and dog._last_answer == clock()
        os.kill(host.pid, signal.SIGSTOP)
        _wait_until_stopped(host.pid)  # the signal is delivered later on a loaded machine: one more store call may pass
        frozen_at = clock()
        for _ in range(100):
            _heartbeat(clock, [dog], outcome)
            if outcome.calls:
                break
        assert outcome.at[1] - frozen_at == STALL  # silence counts from the last answer, the heartbeat before
        message = outcome.calls[1]
        assert message.startswith(
            f"dilocox: error: rank 1 has had no answer from the job's store at 127.0.0.1:{port} (hosted by rank 0) for"
        )
        assert "its host is stopped, hung or cut off; the run stops" in message
    finally:
        os.kill(host.pid, signal.SIGKILL)
        host.wait()
        host.stdout.close()
        # the abandoned store calls fail once the host is gone; let them end before the interpreter does
        deadline = time.monotonic() + 30
        while any(t.name == "dilocox-watchdog-store" for t in threading.enumerate()) and time.monotonic() < deadline:
            time.sleep(0.1)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"timeout": "0s"}, "network.timeout = '0s' must be > 0"),
        ({"timeout": "soon"}, "network.timeout = 'soon' is not a duration"),
        ({"heartbeat": "0"}, "network.heartbeat = '0' must be > 0"),
        ({"heartbeat": "5"}, "network.heartbeat = '5' needs a unit"),
        ({"stall_timeout": "-1s"}, "network.stall_timeout = '-1s' must be a non-negative"),
        ({"heartbeat": "5s", "stall_timeout": "8s"}, "network.stall_timeout = '8s' must be at least 2 x network.heart"),
        ({"stall_timeout": "600s"}, "network.stall_timeout = '600s' must be shorter than network.timeout = '600s'"),
    ],
)
def test_bad_failure_detection_settings_name_the_option(fields, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(").replace(")", r"\)")):
        NetworkConfig(**fields).validate()


def test_failure_detection_defaults_and_off():
    cfg = NetworkConfig()
    cfg.validate()
    assert (cfg.timeout_s, cfg.heartbeat_s, cfg.stall_timeout_s) == (600.0, 5.0, 60.0)
    off = NetworkConfig(stall_timeout="0")
    off.validate()
    assert off.stall_timeout_s == 0.0
