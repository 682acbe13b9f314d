import math

import pytest
import torch

from dilocox.net.link import (
    LinkModel,
    link_charge_bytes,
    parse_bandwidth,
    parse_duration,
    ring_all_gather_bytes,
    ring_all_reduce_bytes,
    ring_chunk_numels,
)

# ---------------------------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("text", "bytes_per_s"),
    [
        ("1Gbps", 1.25e8),
        ("100Mbps", 1.25e7),
        ("2.5Gbps", 3.125e8),
        ("500Kbps", 62_500.0),
        ("500kbps", 62_500.0),
        ("1bps", 0.125),
        ("1gbps", 1.25e8),
        (" 1 Gbps ", 1.25e8),
        ("10MBps", 1e7),
        ("10mBps", 1e7),
        ("1GBps", 1e9),
        ("1GBPS", 1e9),
        ("1e3Mbps", 1.25e8),
    ],
)
def test_parse_bandwidth_units(text, bytes_per_s):
    assert parse_bandwidth(text) == pytest.approx(bytes_per_s)


@pytest.mark.parametrize("text", ["unlimited", "Unlimited", "inf", " INF "])
def test_parse_bandwidth_unlimited(text):
    assert parse_bandwidth(text) is None


@pytest.mark.parametrize("text", ["", "fast", "1Gb", "1G", "1000", "1Xbps", "Gbps", "1 Gbit/s", "0Gbps", "0bps"])
def test_parse_bandwidth_rejects(text):
    with pytest.raises(ValueError, match=r"network\.bandwidth.*'1Gbps'.*unlimited"):
        parse_bandwidth(text)


@pytest.mark.parametrize("text", ["-1Gbps", "1e999Gbps"])
def test_parse_bandwidth_rejects_non_positive_or_infinite(text):
    with pytest.raises(ValueError, match=r"network\.bandwidth.*positive"):
        parse_bandwidth(text)


def test_parse_bandwidth_rejects_non_string():
    with pytest.raises(ValueError, match=r"network\.bandwidth = 1000 .*string"):
        parse_bandwidth(1000)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("10ms", 0.01), ("0", 0.0), ("0ms", 0.0), ("1.5s", 1.5), ("250us", 250e-6), ("250µs", 250e-6), ("2 MS", 0.002)],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "soon", "1h", "ms", "10 minutes"])
def test_parse_duration_rejects_garbage(text):
    with pytest.raises(ValueError, match=r"network\.latency.*'10ms'"):
        parse_duration(text)


def test_parse_duration_rejects_negative_and_unitless():
    with pytest.raises(ValueError, match=r"network\.latency = '-5ms'.*non-negative"):
        parse_duration("-5ms")
    with pytest.raises(ValueError, match=r"network\.latency = '10' needs a unit.*'10ms'"):
        parse_duration("10")
    with pytest.raises(ValueError, match=r"network\.latency"):
        parse_duration(0.01)


# ---------------------------------------------------------------------------------------------- link model


def test_link_back_to_back_transfers_queue_with_pipelined_latency():
    link = LinkModel(100.0, latency_s=0.5)  # 100 B/s
    assert link.schedule(100, launch_time=0.0) == pytest.approx((0.0, 1.5))
    # Launched while the first is on the wire: starts when the first has left it (t=1), not when it lands (1.5).
    assert link.schedule(200, launch_time=0.2) == pytest.approx((1.0, 3.5))
    assert link.busy_s == pytest.approx(3.5)  # [0, 1.5] U [1, 3.5]


def test_link_idle_gap_is_not_busy():
    link = LinkModel(100.0, latency_s=0.5)
    link.schedule(100, launch_time=0.0)  # busy [0, 1.5]
    assert link.schedule(50, launch_time=10.0) == pytest.approx((10.0, 11.0))  # the link went idle: no queueing
    assert link.busy_s == pytest.approx(1.5 + 1.0)
    # Launched during the previous transfer's latency tail: the wire is free, the busy intervals overlap.
    assert link.schedule(50, launch_time=10.8) == pytest.approx((10.8, 11.8))
    assert link.busy_s == pytest.approx(1.5 + 1.0 + 0.8)


def test_link_unlimited_and_durations():
    link = LinkModel(None, latency_s=0.01)
    assert link.schedule(10**12, launch_time=3.0) == pytest.approx((3.0, 3.01))
    assert link.serialize_s(10**12) == 0.0
    gbps = LinkModel(parse_bandwidth("1Gbps"), latency_s=parse_duration("10ms"))
    assert gbps.duration_s(125_000_000) == pytest.approx(1.01)


def test_link_rejects_bad_settings():
    with pytest.raises(ValueError, match=r"network\.bandwidth"):
        LinkModel(0.0)
    with pytest.raises(ValueError, match=r"network\.bandwidth"):
        LinkModel(math.inf)
    with pytest.raises(ValueError, match=r"network\.latency"):
        LinkModel(1e6, latency_s=-0.1)
    with pytest.raises(ValueError, match="nbytes"):
        LinkModel(1e6).schedule(-1, 0.0)


# ---------------------------------------------------------------------------------------------- ring bytes


def _simulated_ring_all_reduce(numel: int, elem_size: int, world: int) -> list[tuple[int, int]]:
    """Slow reference: play the ring step by step and tally which chunk each rank sends to its successor."""
    chunk_bytes = [k * elem_size for k in ring_chunk_numels(numel, world)]
    sent, recv = [0] * world, [0] * world
    for phase_offset in (0, 1):  # reduce-scatter, then all-gather shifted by one chunk
        for step in range(world - 1):
            for rank in range(world):
                chunk = (rank - step + phase_offset) % world
                sent[rank] += chunk_bytes[chunk]
                recv[(rank + 1) % world] += chunk_bytes[chunk]
    return list(zip(sent, recv, strict=True))


def _simulated_ring_all_gather(sizes: list[int]) -> list[tuple[int, int]]:
    world = len(sizes)
    sent, recv = [0] * world, [0] * world
    for step in range(world - 1):
        for rank in range(world):
            payload = (rank - step) % world  # forward what arrived last step, starting with one's own
            sent[rank] += sizes[payload]
            recv[(rank + 1) % world] += sizes[payload]
    return list(zip(sent, recv, strict=True))


def test_ring_chunks_match_tensor_split():
    for numel in (0, 1, 7, 10, 64):
        for world in (1, 2, 3, 4, 5):
            expected = [c.numel() for c in torch.tensor_split(torch.empty(numel), world)]
            assert ring_chunk_numels(numel, world) == expected


def test_ring_all_reduce_bytes_by_hand():
    # C = 2: each rank sends and receives the whole tensor once, whatever the split.
    assert ring_all_reduce_bytes(10, 4, world=2, rank=0) == (40, 40)
    assert ring_all_reduce_bytes(7, 4, world=2, rank=1) == (28, 28)
    # C = 3, n = 10, e = 2: chunks of 4, 3, 3 elements = 8, 6, 6 bytes, N = 20.
    assert [ring_all_reduce_bytes(10, 2, 3, r) for r in range(3)] == [(28, 26), (26, 28), (26, 26)]
    # C = 3, n = 5, e = 4: chunks 8, 8, 4 bytes, N = 20.
    assert [ring_all_reduce_bytes(5, 4, 3, r) for r in range(3)] == [(28, 24), (28, 28), (24, 28)]
    # C = 4, n = 7, e = 1: chunks 2, 2, 2, 1.
    assert [ring_all_reduce_bytes(7, 1, 4, r) for r in range(4)] == [(10, 10), (11, 10), (11, 11), (10, 11)]
    assert ring_all_reduce_bytes(1000, 4, world=1, rank=0) == (0, 0)


def test_ring_all_gather_bytes_by_hand():
    assert [ring_all_gather_bytes([3, 5, 7], r) for r in range(3)] == [(10, 12), (8, 10), (12, 8)]
    assert [ring_all_gather_bytes([4, 6], r) for r in range(2)] == [(4, 6), (6, 4)]
    assert ring_all_gather_bytes([9], 0) == (0, 0)


@pytest.mark.parametrize("world", [2, 3, 4, 5])
@pytest.mark.parametrize("numel", [0, 1, 6, 7, 11, 1000])
def test_ring_formulas_match_simulated_ring(world, numel):
    per_rank = [ring_all_reduce_bytes(numel, 2, world, r) for r in range(world)]
    assert per_rank == _simulated_ring_all_reduce(numel, 2, world)
    # Every byte sent is received by someone: totals agree, and equal 2 (C-1) N.
    assert sum(s for s, _ in per_rank) == sum(r for _, r in per_rank) == 2 * (world - 1) * numel * 2
    sizes = [(numel + 3 * r) % 17 for r in range(world)]
    gathered = [ring_all_gather_bytes(sizes, r) for r in range(world)]
    assert gathered == _simulated_ring_all_gather(sizes)
    assert sum(s for s, _ in gathered) == sum(r for _, r in gathered) == (world - 1) * sum(sizes)


def test_ring_formulas_reject_bad_arguments():
    with pytest.raises(ValueError, match="rank 3 is outside a group of 3"):
        ring_all_reduce_bytes(10, 4, world=3, rank=3)
    with pytest.raises(ValueError, match="group size 0"):
        ring_all_reduce_bytes(10, 4, world=0, rank=0)
    with pytest.raises(ValueError, match="numel"):
        ring_all_reduce_bytes(-1, 4, world=2, rank=0)
    with pytest.raises(ValueError, match="sizes"):
        ring_all_gather_bytes([4, -1], 0)
    assert link_charge_bytes(10, 12) == 12
