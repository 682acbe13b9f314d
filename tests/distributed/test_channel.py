import threading
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from dilocox.net.channel import PendingTransfer, WanChannel, ring_all_gather_bytes, ring_all_reduce_bytes
from tests.clock import SharedClock, SimulatedClock
from tests.multiproc import run_ranks

BANDWIDTH = 5e6  # bytes/s (40 Mbps): a 1 MiB transfer takes ~0.21 s
LATENCY_S = 0.02


def _assert_zero_stats(channel: WanChannel) -> None:
    assert channel.stats() == {
        "bytes_sent": 0,
        "bytes_recv": 0,
        "control_bytes": 0,
        "link_busy_s": 0.0,
        "exposed_s": 0.0,
        "peer_wait_s": 0.0,
        "num_transfers": 0,
        "payloads_rejected": 0,
        "peak_in_flight_bytes": 0,
    }


# ---------------------------------------------------------------------------------------------- no process group


def test_group_of_none_is_a_local_noop():
    with WanChannel(None, bandwidth=BANDWIDTH, latency_s=LATENCY_S) as channel:
        grads = torch.arange(5.0)
        assert channel.all_reduce(grads, op="sum") is grads
        assert torch.equal(grads, torch.arange(5.0))
        payload = torch.arange(3, dtype=torch.uint8)
        transfer = channel.launch_all_gather(payload)
        assert transfer.done()
        assert transfer.wait()[0] is payload and len(transfer.wait()) == 1
        _assert_zero_stats(channel)
        assert channel.bytes_per_s == BANDWIDTH and channel.emulated
    channel.close()  # idempotent


def test_channel_argument_errors():
    channel = WanChannel(None, bandwidth=None, latency_s=0.0)
    with pytest.raises(ValueError, match=r"int64.*float"):
        channel.launch_all_reduce(torch.arange(4))
    with pytest.raises(ValueError, match="'max'.*'sum', 'avg'"):
        channel.all_reduce(torch.zeros(2), op="max")
    with pytest.raises(ValueError, match=r"1-D.*\(2, 3\).*reshape"):
        channel.all_gather(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"network\.bandwidth"):
        WanChannel(None, bandwidth=0.0, latency_s=0.0)
    with pytest.raises(ValueError, match=r"network\.latency"):
        WanChannel(None, bandwidth=1e6, latency_s=-1.0)
    with pytest.raises(ValueError, match="num_sharing = 0"):
        WanChannel(None, bandwidth=1e6, latency_s=0.0, num_sharing=0)
    with pytest.raises(ValueError, match="missing"):
        channel.load_state_dict({"bytes_sent": 3})
    built = WanChannel.from_strings(None, bandwidth="1Gbps", latency="10ms", num_sharing=4)
    assert built.bytes_per_s == pytest.approx(1.25e8 / 4) and built.latency_s == pytest.approx(0.01)
    assert WanChannel.from_strings(None, bandwidth="unlimited", latency="0").bytes_per_s is None


# ---------------------------------------------------------------------------------------------- real gloo ranks


def _exact_worker(rank: int, world_size: int) -> dict[str, float | int]:
    cluster_group = dist.new_group(list(range(world_size)))
    solo_groups = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group, in order
    expected_sent = expected_recv = expected_control = 0
    channel = WanChannel(cluster_group, bandwidth=None, latency_s=0.01)
    assert channel.world_size == world_size and channel.group_rank == rank and not channel.emulated

    # avg of an odd number of fp32 elements
    grads = torch.arange(7, dtype=torch.float32) + 10.0 * rank
    transfer = channel.launch_all_reduce(grads)
    assert isinstance(transfer, PendingTransfer)
    assert transfer.wait() is grads
    torch.testing.assert_close(grads, torch.arange(7, dtype=torch.float32) + 10.0 * (world_size - 1) / 2)
    sent, recv = ring_all_reduce_bytes(7, 4, world_size, rank)
    assert (transfer.nbytes_sent, transfer.nbytes_recv) == (sent, recv)
    expected_sent, expected_recv = expected_sent + sent, expected_recv + recv

    # sum in fp64, odd size again
    values = torch.full((11,), float(rank + 1), dtype=torch.float64)
    channel.all_reduce(values, op="sum")
    assert torch.equal(values, torch.full((11,), world_size * (world_size + 1) / 2, dtype=torch.float64))
    sent, recv = ring_all_reduce_bytes(11, 8, world_size, rank)
    expected_sent, expected_recv = expected_sent + sent, expected_recv + recv

    # a non-contiguous view is reduced in place, and bf16 works
    base = torch.ones(4, 6)
    view = base[:, ::2]
    channel.all_reduce(view, op="sum")
    assert torch.equal(base[:, ::2], torch.full((4, 3), float(world_size))) and torch.equal(
        base[:, 1::2], torch.ones(4, 3)
    )
    sent, recv = ring_all_reduce_bytes(12, 4, world_size, rank)
    expected_sent, expected_recv = expected_sent + sent, expected_recv + recv
    half = torch.full((5,), float(rank), dtype=torch.bfloat16)
    channel.all_reduce(half)
    assert torch.equal(half, torch.full((5,), (world_size - 1) / 2, dtype=torch.bfloat16))
    sent, recv = ring_all_reduce_bytes(5, 2, world_size, rank)
    expected_sent, expected_recv = expected_sent + sent, expected_recv + recv

    # all-gather of unequal lengths (one rank empty when there are three), fp32 then uint8
    numels = [3, 5, 0, 2][:world_size]
    mine = torch.arange(numels[rank], dtype=torch.float32) + 100.0 * rank
    transfer = channel.launch_all_gather(mine, max_numel=max(numels))
    gathered = transfer.wait()
    assert len(gathered) == world_size and gathered[rank] is mine
    for r, tensor in enumerate(gathered):
        torch.testing.assert_close(tensor, torch.arange(numels[r], dtype=torch.float32) + 100.0 * r)
    sent, recv = ring_all_gather_bytes([4 * n for n in numels], rank)
    assert (transfer.nbytes_sent, transfer.nbytes_recv) == (sent, recv)
    expected_sent, expected_recv = expected_sent + sent, expected_recv + recv
    expected_control += 8 * (world_size - 1)

    payload = torch.full((rank * 3 + 1,), rank, dtype=torch.uint8)
    gathered = channel.all_gather(payload, max_numel=3 * world_size - 2)
    assert [t.tolist() for t in gathered] == [[r] * (r * 3 + 1) for r in range(world_size)]
    sent, recv = ring_all_gather_bytes([r * 3 + 1 for r in range(world_size)], rank)
    expected_sent, expected_recv = expected_sent + sent, expected_recv + recv
    expected_control += 8 * (world_size - 1)

    empty = channel.all_gather(torch.empty(0))
    assert [t.numel() for t in empty] == [0] * world_size
    expected_control += 8 * (world_size - 1)

    # on a real link each of the 4 all-reduces first all-reduces one fp32 value: when every peer has joined
    expected_control += 4 * ring_all_reduce_bytes(1, 4, world_size, rank)[0]

    with pytest.raises(ValueError, match="int32"):
        channel.launch_all_reduce(torch.ones(3, dtype=torch.int32))

    stats = channel.stats()
    assert stats["bytes_sent"] == expected_sent and stats["bytes_recv"] == expected_recv, stats
    assert stats["control_bytes"] == expected_control and stats["num_transfers"] == 7, stats
    assert stats["link_busy_s"] > 0.0 and stats["exposed_s"] >= 0.0
    resumed = WanChannel(cluster_group, bandwidth=None, latency_s=0.0)
    resumed.load_state_dict(channel.state_dict())
    assert resumed.stats() == stats
    channel.close()
    channel.close()
    with pytest.raises(RuntimeError, match="closed"):
        channel.launch_all_reduce(torch.zeros(1))

    # a real group of one: nothing moves, nothing is counted
    with WanChannel(solo_groups[rank], bandwidth=BANDWIDTH, latency_s=LATENCY_S) as solo:
        alone = torch.arange(4.0)
        assert solo.all_reduce(alone) is alone and torch.equal(alone, torch.arange(4.0))
        assert solo.all_gather(alone)[0] is alone
        _assert_zero_stats(solo)

    _check_failures(cluster_group)
    return stats


def _check_failures(group: dist.ProcessGroup) -> None:
    """Faults injected on every rank alike, so no rank is left inside a real collective."""
    with mock.patch("torch.distributed.all_reduce", side_effect=RuntimeError("injected gloo failure")):
        channel = WanChannel(group, bandwidth=BANDWIDTH, latency_s=LATENCY_S)
        first = channel.launch_all_reduce(torch.zeros(3))
        with pytest.raises(RuntimeError, match="all_reduce.*failed on the communicator thread") as info:
            first.wait()
        assert "injected gloo failure" in str(info.value.__cause__)
        with pytest.raises(RuntimeError, match="earlier transfer"):
            channel.launch_all_reduce(torch.zeros(3))
        channel.close()  # returns after an error (a hang would fail the test by its timeout)
        assert channel.num_transfers == 0 and channel.num_in_flight == 0

    # Leaving the context on an exception cancels the transfers that have not started: the first is held on the
    # wire until the second is failed, so the order is the same on a machine of any speed.
    started, release, ran = threading.Event(), threading.Event(), []

    def held_collective(*args, **kwargs):
        ran.append(1)
        started.set()
        release.wait()

    with mock.patch("torch.distributed.all_reduce", side_effect=held_collective):
        with pytest.raises(KeyError), WanChannel(group, bandwidth=None, latency_s=0.0) as channel:
            transfers = [channel.launch_all_reduce(torch.zeros(2)) for _ in range(3)]
            started.wait()
            threading.Thread(target=lambda: (transfers[1]._finished.wait(), release.set()), daemon=True).start()
            raise KeyError("trainer crashed")
        assert len(ran) == 2  # only the transfer already on the wire ran: on a real link its handshake and data
        assert all(t.done() for t in transfers) and channel.num_in_flight == 0
        transfers[0].wait()
        for transfer in transfers[1:]:
            with pytest.raises(RuntimeError, match="cancel"):
                transfer.wait()


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_channel_results_and_exact_bytes(world_size):
    stats = run_ranks(_exact_worker, world_size)
    # Every byte one rank sends, another receives.
    assert sum(s["bytes_sent"] for s in stats) == sum(s["bytes_recv"] for s in stats)


def _timing_worker(rank: int, world_size: int) -> dict[str, float]:
    """The emulated link's schedule on a virtual clock: a collective takes no virtual time and the trainer's compute
    is `clock.sleep`, so every time below is the link model's, exactly, however loaded the machine is."""
    cluster_group = dist.new_group(list(range(world_size)))
    out: dict[str, float] = {}
    one_mib = 262_144  # fp32 elements
    clock = SimulatedClock()
    with clock.follow(WanChannel(cluster_group, bandwidth=BANDWIDTH, latency_s=LATENCY_S, clock=clock)) as channel:

        def timed(transfer: PendingTransfer) -> float:
            launched = clock.now()
            transfer.wait()
            return clock.now() - launched

        channel.all_reduce(torch.zeros(1))  # start the thread and warm the gloo pairs
        sent, recv = ring_all_reduce_bytes(one_mib, 4, world_size, rank)
        out["wire_s"] = max(sent, recv) / BANDWIDTH

        # Blocking: launch -> wait takes latency + bytes / bandwidth, and all of it is exposed.
        exposed_before = channel.exposed_s
        transfer = channel.launch_all_reduce(torch.ones(one_mib))
        out["blocking_s"] = timed(transfer)
        out["blocking_link_s"] = transfer.link_s
        out["blocking_exposed_s"] = channel.exposed_s - exposed_before

        # Overlapped: the same transfer behind more compute than it needs is not exposed at all.
        exposed_before = channel.exposed_s
        transfer = channel.launch_all_reduce(torch.ones(one_mib))
        clock.sleep(1.1 * (LATENCY_S + out["wire_s"]))  # stands in for inner steps
        transfer.wait()
        out["overlap_link_s"] = transfer.link_s
        out["overlap_exposed_s"] = channel.exposed_s - exposed_before

        # Behind less compute than it needs, the rest is exposed.
        exposed_before = channel.exposed_s
        transfer = channel.launch_all_reduce(torch.ones(one_mib))
        clock.sleep(0.1)
        transfer.wait()
        out["partial_exposed_s"] = channel.exposed_s - exposed_before

        # FIFO: two back-to-back transfers queue on the wire; the latencies overlap.
        busy_before = channel.link_busy_s
        started = clock.now()
        first = channel.launch_all_reduce(torch.ones(one_mib))
        second = channel.launch_all_reduce(torch.ones(one_mib))
        first.wait()
        out["fifo_first_s"] = clock.now() - started
        second.wait()
        out["fifo_both_s"] = clock.now() - started
        out["fifo_start_gap_s"] = second.start_time - first.start_time
        out["fifo_busy_s"] = channel.link_busy_s - busy_before

        # Unequal all-gather: charged max(sent, recv) payload bytes plus the length header.
        sizes = [800_000, 400_000, 600_000][:world_size]
        transfer = channel.launch_all_gather(torch.zeros(sizes[rank], dtype=torch.uint8), max_numel=max(sizes))
        out["gather_s"] = timed(transfer)
        out["gather_model_s"] = LATENCY_S + (max(ring_all_gather_bytes(sizes, rank)) + 8 * (world_size - 1)) / BANDWIDTH

    # Two ranks of a cluster sharing its uplink each get half of it.
    clock = SimulatedClock()
    channel = WanChannel(cluster_group, bandwidth=BANDWIDTH, latency_s=LATENCY_S, num_sharing=2, clock=clock)
    with clock.follow(channel) as shared:
        assert shared.bytes_per_s == BANDWIDTH / 2
        transfer = shared.launch_all_reduce(torch.ones(one_mib))
        out["shared_s"] = timed(transfer)
    return out


@pytest.mark.dist
def test_channel_emulated_timing():
    """The FIFO link model's times, as the channel applies them: latency + bytes / bandwidth per transfer, queued
    transfers one after the other, blocked time exposed and compute-covered time hidden. The same schedule in real
    seconds is measured by `benchmarks/channel_timing.py`."""
    for out in run_ranks(_timing_worker, 2):
        one = LATENCY_S + out["wire_s"]  # ~0.23 s
        exact = lambda value: pytest.approx(value, rel=1e-9, abs=1e-12)  # noqa: E731
        assert out["wire_s"] == pytest.approx(2**20 / BANDWIDTH)  # two ranks: each sends and receives N
        assert out["blocking_s"] == exact(one) and out["blocking_link_s"] == exact(one)
        assert out["blocking_exposed_s"] == exact(one)
        assert out["overlap_link_s"] == exact(one) and out["overlap_exposed_s"] == 0.0
        assert out["partial_exposed_s"] == exact(one - 0.1)
        assert out["fifo_first_s"] == exact(one)
        assert out["fifo_both_s"] == exact(2 * out["wire_s"] + LATENCY_S)
        assert out["fifo_start_gap_s"] == exact(out["wire_s"])
        assert out["fifo_busy_s"] == exact(2 * out["wire_s"] + LATENCY_S)
        assert out["gather_s"] == exact(out["gather_model_s"])
        assert out["shared_s"] == exact(LATENCY_S + 2 * out["wire_s"])


def _peak_worker(rank: int, world_size: int) -> list[int]:
    """The peak of bytes in flight on a virtual clock: transfers queued together add up, one launched after the
    last arrived does not, those launched `off_peak` do not count."""
    cluster_group = dist.new_group(list(range(world_size)))
    clock = SimulatedClock()
    peaks = []
    with clock.follow(WanChannel(cluster_group, bandwidth=BANDWIDTH, latency_s=LATENCY_S, clock=clock)) as channel:
        big, small = torch.ones(100_000), torch.ones(25_000)  # fp32: 400 kB and 100 kB
        channel.all_reduce(big)
        peaks.append(channel.peak_in_flight_bytes)
        channel.all_reduce(small)  # alone on the wire: the peak stays that of the big one
        peaks.append(channel.peak_in_flight_bytes)
        first, second, third = (channel.launch_all_reduce(t) for t in (big.clone(), small.clone(), small.clone()))
        third.wait()
        peaks.append(channel.peak_in_flight_bytes)
        with channel.off_peak():  # the end of training's drain: two big ones queued together do not count
            drains = [channel.launch_all_reduce(big.clone()) for _ in range(2)]
        drains[-1].wait()
        channel.all_reduce(small)  # counted again after the block
        peaks.append(channel.peak_in_flight_bytes)
        assert channel.stats()["peak_in_flight_bytes"] == peaks[-1]
        resumed = WanChannel(cluster_group, bandwidth=None, latency_s=0.0)
        resumed.load_state_dict(channel.state_dict())
        assert resumed.peak_in_flight_bytes == peaks[-1]
        resumed.close()
    return peaks


@pytest.mark.dist
def test_peak_in_flight_bytes_sums_the_transfers_launched_and_not_yet_arrived():
    peaks = run_ranks(_peak_worker, 2)
    big, small = ring_all_reduce_bytes(100_000, 4, 2, 0)[0], ring_all_reduce_bytes(25_000, 4, 2, 0)[0]
    for rank_peaks in peaks:
        assert rank_peaks == [big, big, big + 2 * small, big + 2 * small]


# ---------------------------------------------------------------------------------------------- a late peer


def _late_peer_worker(rank: int, world_size: int, store_path: str, bandwidth: float | None, collective: str) -> dict:
    """Cluster 1 computes 5 s longer than cluster 0 (on a clock shared by the ranks, moved only by them) and sends
    only once cluster 0 waits; each rank reports how its wait split between the link and the late peer."""
    clock = SharedClock(dist.FileStore(store_path, world_size), rank)
    channel = WanChannel(dist.new_group([0, 1]), bandwidth=bandwidth, latency_s=0.01, clock=clock)
    if rank == 1:
        clock.store.wait([SharedClock.blocked_key(0)])  # cluster 0 waits from t = 0
        clock.advance_to(5.0)
    if collective == "all_gather":
        transfer = channel.launch_all_gather(torch.arange(1000, dtype=torch.uint8))
    else:
        transfer = channel.launch_all_reduce(torch.ones(250))  # 1,000 bytes
    transfer.wait()
    stats = channel.stats()
    channel.close()
    return {"link_s": transfer.link_s, **stats}


@pytest.mark.parametrize("collective", ["all_gather", "all_reduce"])
@pytest.mark.parametrize("bandwidth", [1.25e8, None], ids=["emulated-1Gbps", "unlimited"])
def test_a_wait_for_a_late_peer_is_not_counted_against_the_link(tmp_path, bandwidth, collective):
    """1,000 bytes (an all-gather's also its 8-byte length) take the emulated link 10.008 ms (1 Gbps, 10 ms
    latency) or nothing (unlimited: a real link, measured after every peer joined): that is cluster 0's link time and
    its wait for the link; the 5 s it waited for cluster 1 to send are `peer_wait_s`, never `exposed_s` nor link
    time. Cluster 1, which sent late, waited only for the link."""
    length = 8 if collective == "all_gather" else 0
    link = (1000 + length) / 1.25e8 + 0.01 if bandwidth else 0.0
    args = (str(tmp_path / "clock"), bandwidth, collective)
    results = run_ranks(_late_peer_worker, world_size=2, args=args)
    for rank, result in enumerate(results):
        assert result["link_s"] == pytest.approx(link, abs=1e-9), rank
        assert result["link_busy_s"] == pytest.approx(link, abs=1e-9), rank
        assert result["exposed_s"] == pytest.approx(link, abs=1e-9), rank
    # cluster 0 waited until 5.0 s, or until cluster 1's own link delivered at 5.01 s if that came first
    assert 5.0 - link - 1e-9 <= results[0]["peer_wait_s"] <= 5.0 + 1e-9
    assert results[1]["peer_wait_s"] == pytest.approx(0.0, abs=1e-9)
