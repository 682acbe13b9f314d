"""A member of an elastic round frozen in the middle of the round's transfer (docs/design.md §10.1): its peers name
it from the Lighthouse's heartbeats within network.stall_timeout, stop waiting on the collective it holds up, and
settle the round without it. Clusters are threads of this process with real gloo groups and the stand-in Lighthouse
of `test_elastic_rounds`; the frozen cluster's communicator thread stops just before its collective of round 2, so
its peers' gloo collective waits on bytes that do not come, as they do for a process stopped by SIGSTOP. Its groups'
timeout is 300 s: nothing in this test may wait it out."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from dilocox.elastic.stall import MemberStalled, StallWatch
from tests.distributed.test_elastic_rounds import Cluster, Lighthouse, expected_outer, join_all

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]

STALL_TIMEOUT_S = 0.3


def test_a_member_frozen_in_the_rounds_transfer_is_named_and_the_others_settle_without_it(capsys):
    lighthouse = Lighthouse({0, 1, 2})
    clusters = [Cluster(c, lighthouse, compression="none") for c in range(3)]
    frozen_at: dict[int, float] = {}  # the Lighthouse's view: a frozen cluster's heartbeat stops when it freezes

    def ages() -> dict[str, float]:
        now = time.monotonic()
        return {f"cluster{c}:{c}f": now - frozen_at[c] if c in frozen_at else 0.0 for c in range(3)}

    for cluster in clusters[:2]:
        cluster.member.stall_watch = StallWatch(ages=ages, stall_timeout_s=STALL_TIMEOUT_S, poll_s=0.05)
    join_all(clusters)

    channel = clusters[2].sync.channel
    freeze, resume = threading.Event(), threading.Event()
    execute = channel.communicator._execute

    def frozen_execute(job):  # the communicator thread of cluster 2: its next collective waits for SIGCONT
        if freeze.is_set():
            freeze.clear()
            frozen_at[2] = time.monotonic()
            lighthouse.set_expected({0, 1})  # its heartbeat is gone: the Lighthouse no longer waits for it
            resume.wait(100)
        return execute(job)

    channel.communicator._execute = frozen_execute
    resumed: list = []

    def victim() -> None:
        clusters[2].train(1, 1, flush=False)
        clusters[2].sync.fragments[0].pending.transfer.wait()
        freeze.set()
        clusters[2].train(2, 2, flush=False)  # boundary 2: in the quorum with the others, round 2's sync launched
        resumed.append(clusters[2].sync.fragments[0].pending.transfer.wait())  # released by `resume`

    errors: list[BaseException | None] = [None] * 3

    def run(index: int, target) -> None:
        try:
            target()
        except BaseException as error:  # asserted below
            errors[index] = error

    threads = [
        threading.Thread(target=run, args=(i, t), daemon=True)
        for i, t in enumerate([clusters[0].train, clusters[1].train, victim])
    ]
    for thread in threads:
        thread.start()
    for thread in threads[:2]:
        thread.join(timeout=100)
        assert not thread.is_alive(), "a live cluster still waits on the frozen one"
    assert errors[:2] == [None, None], errors

    survivors = [clusters[0].outer(), clusters[1].outer()]
    assert torch.equal(survivors[0], survivors[1])
    # round 2 was launched over all three and never arrived: sent again between the two live ones at boundary 3
    torch.testing.assert_close(survivors[0], expected_outer([[0, 1, 2], [0, 1], [0, 1], [0, 1]]), rtol=0, atol=1e-5)
    for cluster in clusters[:2]:
        [event] = cluster.rounds.events  # named stalled, and not named again as "left" when the quorum lost it
        assert (event.kind, event.cluster, event.step) == ("stalled", 2, 3)
        assert event.seconds > STALL_TIMEOUT_S and "no heartbeat for" in event.reason
    out = capsys.readouterr().out
    stall_lines = [line for line in out.splitlines() if line.startswith("dilocox: elastic: cluster 2 stalled at step")]
    assert len(stall_lines) == 1, out  # printed once, by the lowest live member

    # SIGCONT: the frozen cluster's collective completes with the peers' abandoned ones; they count none of it
    sent = [cluster.sync.channel.bytes_sent for cluster in clusters[:2]]
    resume.set()
    threads[2].join(timeout=100)
    assert errors[2] is None and len(resumed) == 1
    deadline = time.monotonic() + 60
    communicators = [cluster.sync.channel.communicator for cluster in clusters[:2]]
    while any(communicator._abandoned for communicator in communicators) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(communicator._abandoned for communicator in communicators)  # the left threads have ended
    assert [cluster.sync.channel.bytes_sent for cluster in clusters[:2]] == sent
    assert torch.equal(clusters[0].outer(), survivors[0])


def test_a_stall_watch_names_only_members_silent_for_longer_than_the_stall_timeout():
    ages = {"cluster0:a1": 0.1, "cluster1:b2": 7.5, "cluster2:c3": 2.0}
    watch = StallWatch(ages=lambda: ages, stall_timeout_s=2.0, poll_s=0.01)
    assert watch.silent([1, 2, 3]) == {1: 7.5}  # never heard of 3: not judged
    stalled: list[MemberStalled] = []
    with watch.watching([1], stalled.append):
        deadline = time.monotonic() + 60
        while not stalled and time.monotonic() < deadline:
            time.sleep(0.01)
    assert len(stalled) == 1 and stalled[0].silent == {1: 7.5}
    assert str(stalled[0]) == (
        "cluster 1 (no heartbeat for 7.5s) stalled in the round's transfer (network.stall_timeout = 2s)"
    )
    ages["cluster1:b2"] = 0.2
    with watch.watching([1], stalled.append):  # a member that beats is never named
        time.sleep(0.05)
    assert len(stalled) == 1

    def unreachable() -> dict[str, float]:
        raise ConnectionRefusedError

    assert StallWatch(ages=unreachable, stall_timeout_s=2.0, poll_s=0.01).silent([1]) == {}
