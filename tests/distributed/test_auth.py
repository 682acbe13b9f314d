"""Authenticated slow-link payloads and bounded control messages on 3 real gloo ranks (clusters).

Faults are injected by test-only subclasses of the channel (bits flipped on the way to one receiver only, a
replayed payload), by a cluster that holds another key and by `faults.kind = forge`. The receivers must drop exactly
those payloads, count them and say so on stderr; every cluster must then leave out the same payloads and average the
rest, exactly, and a cluster whose payload every other cluster rejects stops the run on every cluster alike.
"""

import contextlib
import io

import pytest
import torch
import torch.distributed as dist

from dilocox.compress import CompressionConfig, Payload
from dilocox.net.auth import TAG_BYTES, PayloadAuth
from dilocox.net.channel import PayloadsRejected, WanChannel, rejection_verdict
from dilocox.net.json_gather import all_gather_json
from dilocox.net.link import ring_all_gather_bytes
from dilocox.sync.faults import FORGER
from dilocox.sync.reducer_factory import build_reducer
from tests.multiproc import run_ranks

NUM_CLUSTERS = 3
SHAPES = [torch.Size([12, 10]), torch.Size([10])]
KEY = b"the shared key of every cluster!"
OTHER_KEY = b"a key that nobody else holds....."


def flipping_on_arrival(channel: WanChannel) -> WanChannel:
    """Flips one bit of cluster 1's payload as it arrives here, before the tag is checked (corruption or tampering on
    the way to this receiver only: the other receivers get it whole)."""
    open_ = channel.seal.open

    def open(sealed: list, tensor: torch.Tensor, exchange: int, *, group) -> list:
        sealed[1] = sealed[1].clone()
        sealed[1][3] ^= 0x04
        return open_(sealed, tensor, exchange, group=group)

    channel.seal.open = open
    return channel


def replaying(channel: WanChannel) -> WanChannel:
    """Sends, from its second exchange on, the correctly tagged bytes of its first one again (a replay)."""
    seal, first = channel.seal.seal, []

    def replay(tensor: torch.Tensor, exchange: int, **kwargs) -> torch.Tensor:
        sealed = seal(tensor, exchange, **kwargs)
        first.append(sealed)
        return first[0].clone()

    channel.seal.seal = replay
    return channel


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

    # 1. cluster 1's payload is corrupted on its way to cluster 0 only: cluster 0 rejects it, cluster 2 verifies it,
    # and every cluster (cluster 1 too) leaves it out, so all three average the same payloads (0 and 2)
    channel = WanChannel(group, bandwidth=None, latency_s=0.0, auth=PayloadAuth(KEY))
    with flipping_on_arrival(channel) if rank == 0 else channel:
        reducer, pending, mean, delta, warning = _gather_round(channel, 0, rank)
    payloads = round0 = _all_payloads(pending.sent)
    out["partial"] = {
        "exact": torch.equal(mean, _mean_of(reducer, payloads, [0, 2])),
        "excluded": sorted(pending.excluded),
        "rejected": delta["payloads_rejected"],
        "bytes": (delta["bytes_sent"], delta["bytes_recv"]),
        "want_bytes": ring_all_gather_bytes([payloads[0].numel() + TAG_BYTES] * NUM_CLUSTERS, rank),
        # the lengths, then the verdicts: one byte per sender from every cluster
        "control": delta["control_bytes"],
        "want_control": ring_all_gather_bytes([8] * NUM_CLUSTERS, rank)[0]
        + ring_all_gather_bytes([NUM_CLUSTERS] * NUM_CLUSTERS, rank)[0],
        "warning": warning,
    }

    # 2. cluster 2 holds another key: clusters 0 and 1 reject its payload, so it is cut off and every cluster stops
    # with the same line; elastic (stop_if_cut_off = False): cluster 2 alone stops (to heal), the others average
    # their own two payloads (cluster 2's verdicts against them do not count)
    auth = PayloadAuth(OTHER_KEY if rank == 2 else KEY)
    with WanChannel(group, bandwidth=None, latency_s=0.0, auth=auth) as channel:
        with pytest.raises(PayloadsRejected) as info:
            _gather_round(channel, 0, rank)
    out["cut_off"] = str(info.value)
    with WanChannel(group, bandwidth=None, latency_s=0.0, auth=auth, stop_if_cut_off=False) as channel:
        if rank == 2:
            with pytest.raises(PayloadsRejected) as info:
                _gather_round(channel, 0, rank)
            out["elastic"] = str(info.value)
        else:
            reducer, pending, mean, delta, warning = _gather_round(channel, 0, rank)
            exact = torch.equal(mean, _mean_of(reducer, round0, [0, 1]))  # the same round-0 payloads as in 1.
            out["elastic"] = (sorted(pending.excluded), delta["payloads_rejected"], exact)

    # 3. a replay: cluster 1 sends its correctly tagged first payload again in the second exchange; and a forged tag
    # (faults.kind = forge) in the third: each time every other cluster rejects it and the run stops
    channel = WanChannel(group, bandwidth=None, latency_s=0.0, auth=PayloadAuth(KEY))
    with replaying(channel) if rank == 1 else channel:
        first = _gather_round(channel, 0, rank)
        with pytest.raises(PayloadsRejected) as info:
            _gather_round(channel, 1, rank)
        with pytest.raises(ValueError, match="authenticated WanChannel cannot run all_reduce"):
            channel.launch_all_reduce(torch.zeros(3))
    out["replay"] = (first[3]["payloads_rejected"], str(info.value))
    with WanChannel(group, bandwidth=None, latency_s=0.0, auth=PayloadAuth(KEY)) as channel:
        honest = _gather_round(channel, 0, rank)
        if rank == 1:
            channel.sign_next_with(FORGER)
        with pytest.raises(PayloadsRejected) as info:
            _gather_round(channel, 1, rank)
    out["forged"] = (honest[3]["payloads_rejected"], str(info.value))

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
def test_a_payload_one_cluster_rejects_is_left_out_by_every_cluster_and_all_average_the_same(results):
    partial = [r["partial"] for r in results]
    assert [p["exact"] for p in partial] == [True] * NUM_CLUSTERS  # the mean of clusters 0 and 2 on every cluster
    assert [p["excluded"] for p in partial] == [[1]] * NUM_CLUSTERS  # cluster 1 leaves its own out too
    assert [p["rejected"] for p in partial] == [1, 0, 0]  # counted where the tag failed
    for p in partial:  # every tag crossed the link: 32 bytes per payload, counted as payload; verdicts as control
        assert p["bytes"] == p["want_bytes"] and p["control"] == p["want_control"]
    warning = partial[0]["warning"]
    assert len(warning.splitlines()) == 1 and "rank 0 (cluster 0) rejected the slow-link payload of cluster 1 in " \
        "exchange 0" in warning and "every cluster leaves it out of this exchange" in warning  # fmt: skip
    assert partial[1]["warning"] == partial[2]["warning"] == ""


@pytest.mark.dist
def test_a_cluster_every_other_cluster_rejects_stops_every_cluster_with_one_line(results):
    messages = {r["cut_off"] for r in results}
    assert len(messages) == 1  # the same verdict on every cluster
    (message,) = messages
    assert "\n" not in message
    assert message.startswith("every other cluster rejected the slow-link payload of cluster 2 in exchange 0 (its ")
    assert "does not verify under network.auth_key_file" in message and "so the run stops" in message
    # elastic: cluster 2 alone stops (to heal from a live peer); the others average their own two payloads
    assert results[0]["elastic"] == results[1]["elastic"] == ([2], 1, True)
    assert results[2]["elastic"].startswith("every other cluster rejected the slow-link payload of cluster 2 in ")
    assert "so the run stops" not in results[2]["elastic"]


@pytest.mark.dist
def test_a_replayed_or_forged_payload_stops_the_run(results):
    assert [r["replay"][0] for r in results] == [0, 0, 0]
    assert {r["replay"][1] for r in results} == {results[0]["replay"][1]}
    assert "payload of cluster 1 in exchange 1" in results[0]["replay"][1]
    assert [r["forged"][0] for r in results] == [0, 0, 0]
    assert {r["forged"][1] for r in results} == {results[0]["forged"][1]}
    assert "payload of cluster 1 in exchange 1" in results[0]["forged"][1]


@pytest.mark.parametrize(
    "rejected, left_out, cut_off",
    [
        ([[0, 0, 0], [0, 0, 0], [0, 0, 0]], [], []),
        ([[0, 1, 0], [0, 0, 0], [0, 0, 0]], [1], []),  # one receiver only: left out by all, nobody cut off
        ([[0, 0, 1], [0, 0, 1], [1, 1, 0]], [2], [2]),  # cluster 2 holds another key: its own verdicts do not count
        ([[0, 1], [0, 0]], [1], [1]),  # two clusters: one rejection cuts the other off
        ([[0, 1], [1, 0]], [0, 1], [0, 1]),  # ... or both, each by the other
        ([[0, 0, 1, 1], [0, 0, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]], [0, 1, 2, 3], []),  # two keys, two camps
    ],
)
def test_rejection_verdict(rejected, left_out, cut_off):
    assert rejection_verdict([[bool(v) for v in row] for row in rejected]) == (left_out, cut_off)


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
