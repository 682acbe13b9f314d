"""Authenticated slow-link payloads and bounded control messages on 3 real gloo ranks (clusters).

Faults are injected by test-only subclasses of the channel, after the sender tags its payload (bits flipped on the
way, a replayed payload), and by a cluster that holds another key. The receivers must drop exactly those payloads,
count them, say so on stderr, and average the ones they accepted, exactly.
"""

import contextlib
import io

import pytest
import torch
import torch.distributed as dist

from dilocox.compress import CompressionConfig, Payload
from dilocox.net.auth import TAG_BYTES, PayloadAuth
from dilocox.net.channel import WanChannel
from dilocox.net.json_gather import all_gather_json
from dilocox.net.link import ring_all_gather_bytes
from dilocox.sync.reducers import build_reducer
from tests.multiproc import run_ranks

NUM_CLUSTERS = 3
SHAPES = [torch.Size([12, 10]), torch.Size([10])]
KEY = b"the shared key of every cluster!"
OTHER_KEY = b"a key that nobody else holds....."


class FlippingChannel(WanChannel):
    """Flips one bit of every payload it sends, after tagging it (corruption or tampering on the way)."""

    def _seal(self, tensor: torch.Tensor, exchange: int) -> torch.Tensor:
        sealed = super()._seal(tensor, exchange)
        sealed[3] ^= 0x04
        return sealed


class ReplayingChannel(WanChannel):
    """Sends, from its second exchange on, the correctly tagged bytes of its first one again (a replay)."""

    first: torch.Tensor | None = None

    def _seal(self, tensor: torch.Tensor, exchange: int) -> torch.Tensor:
        sealed = super()._seal(tensor, exchange)
        if self.first is None:
            self.first = sealed
        return self.first.clone()


def _pseudo_grad(cluster: int, round_index: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(10 * cluster + round_index)
    return torch.randn(sum(shape.numel() for shape in SHAPES), generator=generator)


def _mean_of(reducer, payloads: list[torch.Tensor], accepted: list[int]) -> torch.Tensor:
    """What `GatherReducer` must return: the decoded accepted payloads summed in cluster order, / their number."""
    total = torch.zeros(sum(shape.numel() for shape in SHAPES))
    for index in accepted:
        decoded = reducer.codec.decode_list(Payload(payloads[index]), reducer.slice.shapes)
        total += torch.cat([d.reshape(-1) for d in decoded])
    return total.div_(len(accepted))


def _all_payloads(sent: torch.Tensor) -> list[torch.Tensor]:
    """Every cluster's payload as it left the codec (untagged), over a plain gloo all-gather: the reference."""
    parts = [torch.empty_like(sent) for _ in range(NUM_CLUSTERS)]
    dist.all_gather(parts, sent)
    return parts


def _gather_round(channel: WanChannel, round_index: int, rank: int):
    reducer = build_reducer(CompressionConfig(kind="int4"), SHAPES, channel=channel, dp_group=None)
    before = channel.stats()
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        pending = reducer.launch(_pseudo_grad(rank, round_index))
        mean = pending.wait().clone()
    after = channel.stats()
    return reducer, pending, mean, {k: after[k] - before[k] for k in before}, stderr.getvalue()


def _worker(rank: int, world_size: int) -> dict:
    group = dist.new_group(list(range(world_size)))
    out: dict = {}

    # 1. cluster 1's bits flip after tagging; cluster 2 holds another key
    channel_type = FlippingChannel if rank == 1 else WanChannel
    auth = PayloadAuth(OTHER_KEY if rank == 2 else KEY)
    with channel_type(group, bandwidth=None, latency_s=0.0, auth=auth) as channel:
        reducer, pending, mean, delta, warning = _gather_round(channel, 0, rank)
    payloads = _all_payloads(pending.sent)
    accepted = {0: [0], 1: [0, 1], 2: [2]}[rank]
    out["faults"] = {
        "exact": torch.equal(mean, _mean_of(reducer, payloads, accepted)),
        "rejected": delta["payloads_rejected"],
        "bytes": (delta["bytes_sent"], delta["bytes_recv"]),
        "want_bytes": ring_all_gather_bytes([payloads[0].numel() + TAG_BYTES] * NUM_CLUSTERS, rank),
        "warning": warning,
    }

    # 2. a replay: cluster 1 sends its correctly tagged first payload again in the second exchange
    channel_type = ReplayingChannel if rank == 1 else WanChannel
    with channel_type(group, bandwidth=None, latency_s=0.0, auth=PayloadAuth(KEY)) as channel:
        first = _gather_round(channel, 0, rank)
        second = _gather_round(channel, 1, rank)
        with pytest.raises(ValueError, match="authenticated WanChannel cannot run all_reduce"):
            channel.launch_all_reduce(torch.zeros(3))
    out["replay"] = [r[3]["payloads_rejected"] for r in (first, second)]
    payloads = _all_payloads(second[1].sent)
    accepted = [0, 2] if rank != 1 else [0, 1, 2]
    out["replay_exact"] = torch.equal(second[2], _mean_of(second[0], payloads, accepted))

    # 3. a declared length above the receiver's bound fails before anything of that size is allocated
    mine = torch.zeros(10 if rank == 2 else 4, dtype=torch.uint8)
    with WanChannel(group, bandwidth=None, latency_s=0.0) as channel:
        transfer = channel.launch_all_gather(mine, max_numel=10 if rank == 2 else 4)
        if rank == 2:
            out["too_long"] = None
            transfer.wait()  # its own bound lets it go on: released below by the others
        else:
            with pytest.raises(RuntimeError) as info:
                transfer.wait()
            out["too_long"] = str(info.value.__cause__)
            slots = [torch.empty(10, dtype=torch.uint8) for _ in range(world_size)]
            dist.all_gather(slots, torch.zeros(10, dtype=torch.uint8), group=group)

    # 4. control messages: JSON both ways, and a rank that declares more than the bound stops every rank
    message = {"rank": rank, "values": [1, 2.5, None, "é"], "nested": {"ok": True}}
    out["json"] = all_gather_json(message, group=group, max_bytes=1024)
    out["json_world"] = all_gather_json((rank, "x"), group=None, max_bytes=64)
    big = "x" * (5000 if rank == 2 else 10)
    with pytest.raises(ValueError) as info:
        all_gather_json(big, group=group, max_bytes=1024)
    out["json_too_long"] = str(info.value)
    solo = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group, in order
    out["json_solo"] = all_gather_json((1, 2), group=solo[rank], max_bytes=8)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, NUM_CLUSTERS)


@pytest.mark.dist
def test_forged_and_corrupted_payloads_are_rejected_counted_and_the_mean_uses_the_rest(results):
    faults = [r["faults"] for r in results]
    assert [f["exact"] for f in faults] == [True] * NUM_CLUSTERS  # mean of exactly the accepted payloads
    # cluster 0 drops 1 (flipped) and 2 (other key); 1 drops 2; 2 (other key) verifies nobody's
    assert [f["rejected"] for f in faults] == [2, 1, 2]
    for f in faults:  # every tag crossed the link: 32 bytes per payload, counted as payload
        assert f["bytes"] == f["want_bytes"]
    assert "cluster 1, 2 in exchange 0" in faults[0]["warning"]
    assert "uses its own only" in faults[0]["warning"] and len(faults[0]["warning"].splitlines()) == 1
    assert "cluster 2 in exchange 0" in faults[1]["warning"] and "goes on without it" in faults[1]["warning"]
    assert "cluster 0, 1 in exchange 0" in faults[2]["warning"] and "uses its own only" in faults[2]["warning"]


@pytest.mark.dist
def test_a_replayed_payload_is_rejected(results):
    assert [r["replay"] for r in results] == [[0, 1], [0, 0], [0, 1]]
    assert all(r["replay_exact"] for r in results)


@pytest.mark.dist
def test_a_declared_length_above_the_bound_is_refused_naming_the_rank(results):
    for rank in (0, 1):
        assert (
            "rank 2 of the group (global rank 2) declared a payload of 10 elements, outside the 0 ... 4"
            in (results[rank]["too_long"])
        )


@pytest.mark.dist
def test_control_messages_are_bounded_json(results):
    for r in results:
        assert r["json"] == [{"rank": i, "values": [1, 2.5, None, "é"], "nested": {"ok": True}} for i in range(3)]
        assert r["json_world"] == [[i, "x"] for i in range(3)]
        assert "rank 2 declared a control message of 5,002 bytes, outside the 0 ... 1,024" in r["json_too_long"]
        assert r["json_solo"] == [[1, 2]]
