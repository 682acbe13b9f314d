"""Clusters of different data-parallel degree on real gloo ranks (docs/design.md §2.1): the lane exchange's bytes
against payload sizes worked out by hand, its mean against a reference computed here, and the token-weighted outer
average of DiLoCo over clusters of dp 2, 1 and 1."""

import math

import pytest
import torch

from dilocox.compress import CompressionConfig, build_codec
from dilocox.config import load_config
from dilocox.net.auth import TAG_BYTES, PayloadAuth
from dilocox.net.channel import WanChannel
from dilocox.net.sealing import ChunkSealer
from dilocox.sync import TokenWeights, build_sync
from dilocox.sync.config import FIT_HEADROOM
from dilocox.sync.lanes import LaneLayout, LaneReducer, build_lane_reducer
from dilocox.topology import Topology, build_process_groups
from tests.distributed.resume import simulated
from tests.multiproc import run_ranks

DP_DEGREES = (2, 1, 1)  # ranks 0, 1: cluster 0; rank 2: cluster 1; rank 3: cluster 2
SHAPES = [(8, 16), (16,), (12, 8), (8,)]  # 128 + 16 + 96 + 8 = 248 values
# L = lcm(2, 1, 1) = 2 lanes, parameter-aligned: lane 0 = the (8, 16) matrix (128 values, the closest cut to 124),
# lane 1 = the other three tensors (120 values). Cluster 0's replica 0 owns lane 0, replica 1 lane 1; the replicas
# of clusters 1 and 2 own both.
LANE_NUMELS = (128, 120)
LANES_OF_RANK = ([0], [1], [0, 1], [0, 1])
CLUSTER_OF_RANK = (0, 0, 1, 2)
INT4 = CompressionConfig(kind="int4", group_size=16)
# int4 bytes of a tensor: 2 bytes of fp16 scale per group of 16, then half a byte per value.
# lane 0: (8, 16) -> 2 x 8 + 64 = 80; lane 1: (16,) -> 2 + 8 = 10, (12, 8) -> 2 x 6 + 48 = 60, (8,) -> 2 + 4 = 6: 76
INT4_LANE_BYTES = (80, 76)
FP32_LANE_BYTES = (4 * 128, 4 * 120)


def pseudo_grad(cluster: int, round_index: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(10 * cluster + round_index)
    return torch.randn(248, generator=generator)


def lane_tensors(flat: torch.Tensor, lane: int) -> list[torch.Tensor]:
    tensors = [t.view(shape) for t, shape in zip(flat.split([128, 16, 96, 8]), SHAPES, strict=True)]
    return tensors[:1] if lane == 0 else tensors[1:]


def _exchange(rank, world_size):
    topo = Topology.of_clusters(DP_DEGREES)
    groups = build_process_groups(topo, rank)
    coords = topo.coords(rank)
    layout = LaneLayout(topo, coords.cluster, coords.dp)
    shapes = [torch.Size(s) for s in SHAPES]
    out = {}
    for name, cfg in (("none", CompressionConfig(kind="none")), ("int4", INT4)):
        channel = WanChannel(groups.cluster_group, bandwidth=None, latency_s=0.0)
        reducer = LaneReducer(cfg, shapes, layout=layout, channel=channel, dp_group=groups.dp_group)
        pending = reducer.launch(pseudo_grad(coords.cluster))
        sent = pending.sent.clone()
        mean = pending.wait().clone()
        counters = (channel.bytes_sent, channel.bytes_recv, channel.control_bytes)
        # a resumed run sends the saved bytes again, uncounted, and gets the same mean
        again = LaneReducer(cfg, shapes, layout=layout, channel=channel, dp_group=groups.dp_group)
        resent = again.relaunch(sent, account=False).wait().clone()
        # round 2: cluster 2 abstains (its own update went non-finite) and is left out
        round2 = reducer.abstain(pseudo_grad(2, 1)) if coords.cluster == 2 else reducer.launch(pseudo_grad(0, 1))
        mean2 = round2.wait().clone()
        out[name] = (mean, counters, resent, mean2, dict(round2.excluded), channel.stats()["num_transfers"])
        channel.close()
    return out


@pytest.fixture(scope="module")
def exchange():
    return run_ranks(_exchange, sum(DP_DEGREES))


@pytest.mark.dist
@pytest.mark.parametrize(("name", "lane_bytes"), [("none", FP32_LANE_BYTES), ("int4", INT4_LANE_BYTES)])
def test_each_rank_sends_its_lanes_to_the_owners_in_the_other_clusters_exactly(exchange, name, lane_bytes):
    for rank, result in enumerate(exchange):
        _, (sent, recv, control), _, _, _, num_transfers = result[name]
        lanes = LANES_OF_RANK[rank]
        # each of its lanes goes to the one owner of that lane in each of the 2 other clusters, and comes from them
        assert sent == recv == sum(2 * lane_bytes[lane] for lane in lanes), rank
        assert control == 2 * 8 * len(lanes)  # one int64 length per lane and peer, sent first
        assert num_transfers == 2  # the relaunch was not counted


@pytest.mark.dist
def test_the_fp32_lane_mean_is_the_mean_over_clusters_and_a_left_out_cluster_is_not_in_it(exchange):
    want = sum(pseudo_grad(c) for c in range(3)) / 3
    want2 = (pseudo_grad(0, 1) + pseudo_grad(0, 1)) / 2  # clusters 0 and 1 sent cluster 0's round-2 values
    for result in exchange:
        mean, _, resent, mean2, excluded, _ = result["none"]
        torch.testing.assert_close(mean, want, rtol=0, atol=1e-6)
        assert torch.equal(resent, mean)
        torch.testing.assert_close(mean2, want2, rtol=0, atol=1e-6)
        assert list(excluded) == [2] and "sent none" in excluded[2]


@pytest.mark.dist
def test_the_int4_lane_mean_is_the_mean_of_the_decoded_payloads(exchange):
    # every cluster's codec of lane l starts from the seed of lane l (run.seed 0 + 7919 l): fresh codecs here
    decoded = []
    for cluster in range(3):
        parts = []
        for lane in (0, 1):
            codec = build_codec(INT4, seed=7919 * lane)
            tensors = lane_tensors(pseudo_grad(cluster), lane)
            parts += [t.reshape(-1) for t in codec.decode_list(codec.encode_list(tensors), [t.shape for t in tensors])]
        decoded.append(torch.cat(parts))
    want = sum(decoded) / 3
    assert (want - sum(pseudo_grad(c) for c in range(3)) / 3).abs().max() > 1e-3  # the premise: int4 is lossy
    for result in exchange:
        mean, _, resent, _, excluded, _ = result["int4"]
        torch.testing.assert_close(mean, want, rtol=0, atol=1e-6)
        assert torch.equal(resent, mean) and list(excluded) == [2]


def _weighted(rank, world_size, flags=("--sync.sync_delay=0",)):
    topo = Topology.of_clusters(DP_DEGREES)
    groups = build_process_groups(topo, rank)
    coords = topo.coords(rank)
    cfg = load_config(
        None,
        [
            "--sync.kind=diloco",
            "--sync.inner_steps=1",
            "--sync.outer.lr=1",
            "--sync.outer.momentum=0",
            "--compression.kind=none",
            "--train.steps=2",
            *flags,
        ],
    )
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]
    channel = WanChannel(groups.cluster_group, bandwidth=None, latency_s=0.0)
    layout = LaneLayout(topo, coords.cluster, coords.dp)
    sync = build_sync(cfg, params, channel=channel, dp_group=groups.dp_group, lanes=layout)
    phi = sync.outer_params.clone()
    with torch.no_grad():  # the cluster's round "trained" to theta_c = phi - its pseudo-gradient
        for p, start, d in zip(params, phi.split([p.numel() for p in params]), pseudo_grad(coords.cluster).split(
            [p.numel() for p in params]), strict=True):  # fmt: skip
            p.copy_(start.view_as(p) - d.view_as(p))
    sync.after_inner_step(1)
    channel.close()
    return phi, sync.outer_params.clone(), torch.cat([p.detach().reshape(-1) for p in params])


@pytest.mark.dist
def test_the_outer_average_weights_each_cluster_by_its_data_parallel_degree():
    results = run_ranks(_weighted, sum(DP_DEGREES))
    phi = results[0][0]
    thetas = [phi - pseudo_grad(c) for c in range(3)]
    want = (2 * thetas[0] + 1 * thetas[1] + 1 * thetas[2]) / 4  # sum_c dp_c theta_c / sum_c dp_c
    plain = sum(thetas) / 3
    assert (want - plain).abs().max() > 0.1  # the premise: the weights change the average
    for start, outer_params, params in results:
        assert torch.equal(start, phi)
        torch.testing.assert_close(outer_params, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(params, want, rtol=0, atol=1e-5)  # the next round starts there


@pytest.mark.dist
@pytest.mark.parametrize("merge", ["keep_local", "eager"])
def test_under_the_delay_a_cluster_starts_from_its_own_progress_in_its_own_units(merge):
    """The payload is the pseudo-gradient times C dp_c / sum dp, but the merge rules count the cluster's own
    progress: keep_local starts where the cluster's round ended, eager at phi less its share dp_c / sum dp of it."""
    flags = ("--sync.sync_delay=1", f"--sync.merge={merge}", "--sync.local_residual=false")
    results = run_ranks(_weighted, sum(DP_DEGREES), args=(flags,))
    phi = results[0][0]
    for rank, (_start, outer_params, params) in enumerate(results):
        cluster = CLUSTER_OF_RANK[rank]
        share = 1.0 if merge == "keep_local" else DP_DEGREES[cluster] / sum(DP_DEGREES)
        assert torch.equal(outer_params, phi)  # nothing landed yet: the average is one round late
        torch.testing.assert_close(params, phi - share * pseudo_grad(cluster), rtol=0, atol=1e-5)


def _composed(rank, world_size, flags):
    """Clusters of dp 2, 1 and 1 with `flags` (time rounds or fragments), blocking fp32 plain averaging: each cluster
    moves its parameters by its own pseudo-gradient over its round's steps (time rounds: cluster 2 is virtually twice
    as slow, so it does 1 step to the others' 2); returns phi before and after, and the parameters."""
    topo = Topology.of_clusters(DP_DEGREES)
    groups = build_process_groups(topo, rank)
    coords = topo.coords(rank)
    cfg = load_config(None, ["--sync.kind=diloco", "--sync.inner_steps=2", "--sync.outer.lr=1",
                             "--sync.outer.momentum=0", "--sync.guard.peers=false", "--compression.kind=none",
                             "--train.steps=2", "--topology.clusters=dp2,dp1,dp1", *flags])  # fmt: skip
    cfg.validate(world_size=world_size)
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]
    channel = WanChannel(groups.cluster_group, bandwidth=None, latency_s=0.0)
    layout = LaneLayout(topo, coords.cluster, coords.dp)
    tokens_per_step = 100 * DP_DEGREES[coords.cluster]  # every replica trains 100 tokens a step
    sync = build_sync(cfg, params, channel=channel, dp_group=groups.dp_group, lanes=layout,
                      weights=TokenWeights(tokens_per_step))  # fmt: skip
    phi = sync.outer_params.clone()
    steps = 1 if cfg.sync.round.mode == "time" and coords.cluster == 2 else 2
    numels = [p.numel() for p in params]
    for step in range(1, steps + 1):
        with torch.no_grad():  # theta_c = phi - its pseudo-gradient at the round's end
            for p, d in zip(params, (pseudo_grad(coords.cluster) / steps).split(numels), strict=True):
                p.sub_(d.view_as(p))
        sync.after_inner_step(step)
    sync.flush()
    channel.close()
    return phi, sync.outer_params.clone(), torch.cat([p.detach().reshape(-1) for p in params])


@pytest.mark.dist
@pytest.mark.parametrize(
    "flags, weights",
    [
        # tokens of the round: dp_c x steps_c x 100 = 400, 200 and 100
        (("--sync.round.mode=time", "--faults.slow_clusters=2:2.0", "--faults.slow_mode=virtual"), (4, 2, 1)),
        # each fragment (one at step 1, the other at step 2) averages its slice by dp: 2, 1 and 1
        (("--sync.fragments=2",), (2, 1, 1)),
        # a robust aggregate gives every cluster one vote: the median of the three, value by value
        (("--sync.aggregate=median", "--sync.guard.enabled=false"), None),
        # cluster 2 lies (3 x its update), unguarded: it goes into the weighted mean as it was sent
        (
            (
                "--faults.kind=scale",
                "--faults.scale=3",
                "--faults.cluster=2",
                "--faults.rounds=1",
                "--sync.guard.enabled=false",
            ),
            (2, 1, 1),
        ),
        # cluster 2's round goes non-finite: it abstains, and the others' mean is weighted by their dp alone
        (("--faults.kind=nan", "--faults.cluster=2", "--faults.rounds=1"), (2, 1, 0)),
    ],
    ids=["time_rounds", "fragments", "median", "lying_cluster", "abstaining_cluster"],
)
def test_clusters_of_different_dp_compose_with_time_rounds_fragments_robust_aggregates_and_faults(flags, weights):
    results = run_ranks(_composed, sum(DP_DEGREES), args=(flags,))
    phi = results[0][0]
    lie = 3.0 if "--faults.kind=scale" in flags else 1.0
    thetas = [phi - (lie if c == 2 else 1.0) * pseudo_grad(c) for c in range(3)]
    if weights is None:
        want = torch.stack(thetas).median(dim=0).values
    else:
        want = sum(w * theta for w, theta in zip(weights, thetas, strict=True)) / sum(weights)
    assert (want - sum(thetas) / 3).abs().max() > 0.1  # the premise: the weights change the average
    assert (want - sum(phi - pseudo_grad(c) for c in range(3)) / 3).abs().max() > 0.1
    for start, outer_params, params in results:
        assert torch.equal(start, phi)
        torch.testing.assert_close(outer_params, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(params, want, rtol=0, atol=1e-5)


def _fit_link(rank, world_size):
    """Clusters of dp 2, 1 and 1 under the delay on an emulated link (virtual seconds, `simulated`) with
    sync.round.fit_link: a replica of cluster 0 sends one lane, those of clusters 1 and 2 both, so each rank's sync
    takes its own link time; returns the rounds (step, H, link seconds of its sync), phi and the H the run ended
    with."""
    topo = Topology.of_clusters(DP_DEGREES)
    groups = build_process_groups(topo, rank)
    coords = topo.coords(rank)
    cfg = load_config(None, ["--sync.kind=diloco", "--sync.inner_steps=2", "--sync.sync_delay=1",
                             "--sync.round.fit_link=true", "--sync.outer.lr=1", "--sync.outer.momentum=0",
                             "--sync.guard.peers=false", "--compression.kind=none", "--train.steps=40",
                             "--topology.clusters=dp2,dp1,dp1"])  # fmt: skip
    cfg.validate(world_size=world_size)
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]
    channel = simulated(lambda clock: WanChannel(groups.cluster_group, bandwidth=8000, latency_s=0.0, clock=clock))
    sync = build_sync(cfg, params, channel=channel, dp_group=groups.dp_group,
                      lanes=LaneLayout(topo, coords.cluster, coords.dp))  # fmt: skip
    rounds = []
    for step in range(1, 41):
        channel.clock.sleep(0.0625)
        with torch.no_grad():
            params[0].add_(0.01 * (coords.cluster + 1))  # each cluster moves its own way
        stats = sync.after_inner_step(step)
        if stats is not None:
            rounds.append((step, stats.inner_steps, stats.link_s))
    sync.flush()
    channel.close()
    return rounds, sync.outer_params.clone(), sync.status().inner_steps


@pytest.mark.dist
def test_clusters_of_different_dp_fit_h_to_the_link_together():
    results = run_ranks(_fit_link, sum(DP_DEGREES))
    # the first sync's link time: a replica of cluster 0 sends one lane (128 or 120 values), the others both
    link_s = [rounds[0][2] for rounds, _, _ in results]
    assert max(link_s[:2]) < link_s[2] == link_s[3], link_s
    # every rank takes the H that the slowest sync wants: ceil(1.1 x its link time / 0.0625 s a step)
    wants = [math.ceil(FIT_HEADROOM * s / 0.0625) for s in link_s]
    assert max(wants[:2]) < wants[2] == 5
    steps = [(step, h) for step, h, _ in results[0][0]]
    assert steps == [(4, 2), (9, 5), (14, 5), (19, 5), (24, 5), (29, 5), (34, 5), (39, 5), (40, 1)]
    for rounds, phi, final_h in results:  # every rank ends its rounds at the same steps, on the same phi
        assert [(step, h) for step, h, _ in rounds] == steps and final_h == 5
        assert torch.equal(phi, results[0][1])


def _empty_lane(rank, world_size):
    topo = Topology.of_clusters((2, 1))  # 2 lanes of a stage of one tensor: lane 1 is empty
    groups = build_process_groups(topo, rank)
    coords = topo.coords(rank)
    channel = WanChannel(groups.cluster_group, bandwidth=None, latency_s=0.0)
    layout = LaneLayout(topo, coords.cluster, coords.dp)
    reducer = LaneReducer(CompressionConfig(kind="int4", group_size=4), [torch.Size((6,))], layout=layout,
                          channel=channel, dp_group=groups.dp_group)  # fmt: skip
    mean = reducer.launch(pseudo_grad(coords.cluster)[:6]).wait().clone()
    held = reducer.held_back(torch.device("cpu"))
    channel.close()
    return mean, held, channel.bytes_sent, channel.control_bytes


@pytest.mark.dist
def test_an_empty_lane_moves_nothing_and_the_mean_is_whole():
    results = run_ranks(_empty_lane, 3)
    codec = build_codec(CompressionConfig(kind="int4", group_size=4), seed=0)
    decoded = [codec.decode(codec.encode(pseudo_grad(c)[:6]), (6,)) for c in range(2)]
    for rank, (mean, held, sent, control) in enumerate(results):
        torch.testing.assert_close(mean, (decoded[0] + decoded[1]) / 2, rtol=0, atol=1e-6)
        torch.testing.assert_close(held, pseudo_grad(0 if rank < 2 else 1)[:6] - decoded[0 if rank < 2 else 1])
        # int4 of 6 values in groups of 4: 2 scales of 2 bytes + 3 bytes; replica 1 of cluster 0 owns the empty lane
        assert (sent, control) == ((0, 0) if rank == 1 else (7, 8)), rank


KEY = b"the shared key of every cluster!"


class FlippingOnArrival(ChunkSealer):
    """Flips one bit of every lane chunk from cluster 1 (group rank 2) as it arrives here, before its tag is checked:
    corruption on the way to this receiver only, the other receivers get it whole."""

    def open_chunk(self, part, sender):
        if sender == 2:
            part = part.clone()
            part[3] ^= 0x04
        return super().open_chunk(part, sender)


def _authenticated(rank, world_size):
    """The int4 lane exchange over an authenticated channel: a round with every payload tagged, then one in which
    cluster 1's payloads arrive corrupted at cluster 2 only (rank 3): every member leaves cluster 1 out of it."""
    topo = Topology.of_clusters(DP_DEGREES)
    groups = build_process_groups(topo, rank)
    coords = topo.coords(rank)
    layout = LaneLayout(topo, coords.cluster, coords.dp)
    channel = WanChannel(groups.cluster_group, bandwidth=None, latency_s=0.0, auth=PayloadAuth(KEY))
    reducer = LaneReducer(INT4, [torch.Size(s) for s in SHAPES], layout=layout, channel=channel,
                          dp_group=groups.dp_group)  # fmt: skip
    mean = reducer.launch(pseudo_grad(coords.cluster)).wait().clone()
    counters = (channel.bytes_sent, channel.control_bytes)
    channel.close()
    channel = WanChannel(groups.cluster_group, bandwidth=None, latency_s=0.0, auth=PayloadAuth(KEY))
    if rank == 3:
        seal = channel.seal
        seal.chunks = lambda exchange, signer=None: FlippingOnArrival(seal, exchange, signer or seal.auth)
    reducer = LaneReducer(INT4, [torch.Size(s) for s in SHAPES], layout=layout, channel=channel,
                          dp_group=groups.dp_group)  # fmt: skip
    pending = reducer.launch(pseudo_grad(coords.cluster, 1))
    mean2 = pending.wait().clone()
    rejected = channel.stats()["payloads_rejected"]
    channel.close()
    return mean, counters, mean2, dict(pending.excluded), rejected


def _decoded_mean(clusters, round_index):
    """The mean of fresh codecs' decoded int4 lane payloads of `clusters` (lane l's codec seeded 7919 l)."""
    means = []
    for cluster in clusters:
        parts = []
        for lane in (0, 1):
            codec = build_codec(INT4, seed=7919 * lane)
            tensors = lane_tensors(pseudo_grad(cluster, round_index), lane)
            decoded = codec.decode_list(codec.encode_list(tensors), [t.shape for t in tensors])
            parts += [t.reshape(-1) for t in decoded]
        means.append(torch.cat(parts))
    return sum(means) / len(means)


@pytest.mark.dist
def test_authenticated_lanes_carry_a_tag_per_payload_and_a_corrupted_cluster_is_left_out_everywhere():
    results = run_ranks(_authenticated, sum(DP_DEGREES))
    for rank, (mean, (sent, control), mean2, excluded, rejected) in enumerate(results):
        lanes = LANES_OF_RANK[rank]
        torch.testing.assert_close(mean, _decoded_mean(range(3), 0), rtol=0, atol=1e-6)
        # each lane payload to each of the 2 other clusters, one 32-byte tag per peer it sends to (ranks 0 and 1 send
        # their lane to ranks 2 and 3; ranks 2 and 3 send to the 3 ranks of the other clusters); the lengths (8 bytes
        # per lane and peer), and one verdict byte per member of the stage group to every other (3 x 4 bytes)
        peers = (2, 2, 3, 3)[rank]
        assert sent == sum(2 * INT4_LANE_BYTES[lane] for lane in lanes) + peers * TAG_BYTES, rank
        assert control == 2 * 8 * len(lanes) + 3 * 4, rank
        # round 2: only rank 3 rejected cluster 1's chunks, and every member (cluster 1's own too) leaves it out
        assert list(excluded) == [1] and "tag does not verify" in excluded[1], rank
        assert rejected == (1 if rank == 3 else 0), rank
        torch.testing.assert_close(mean2, _decoded_mean([0, 2], 1), rtol=0, atol=1e-6)


def _scalable(rank, world_size, kind):
    """The scalable reduction of the lanes over clusters of dp 2, 1 and 1: the mean, the bytes, and the same bytes
    sent again by a resumed run."""
    topo = Topology.of_clusters(DP_DEGREES)
    groups = build_process_groups(topo, rank)
    coords = topo.coords(rank)
    layout = LaneLayout(topo, coords.cluster, coords.dp)
    shapes = [torch.Size(s) for s in SHAPES]
    cfg = CompressionConfig(kind=kind, group_size=16, reduction="scalable")
    channel = WanChannel(groups.cluster_group, bandwidth=None, latency_s=0.0)
    reducer = build_lane_reducer(cfg, shapes, layout=layout, channel=channel, dp_group=groups.dp_group)
    pending = reducer.launch(pseudo_grad(coords.cluster))
    mean = pending.wait().clone()
    counters = (channel.bytes_sent, channel.bytes_recv)
    resent = reducer.relaunch(pending.sent, account=False).wait().clone()
    channel.close()
    return mean, counters, resent, pending.cost.payload_bytes


@pytest.mark.dist
@pytest.mark.parametrize(("kind", "nbytes"), [("fp16", lambda n: 2 * n), ("int4", None)])
def test_the_scalable_lane_mean_is_the_mean_over_clusters_and_each_rank_sends_two_chunks_a_peer(kind, nbytes):
    """Chunk c (of 3) of each lane goes to the lane's owner in cluster c and its mean comes back: per lane a rank
    sends the other clusters' chunks and its mean chunk twice, and receives as much."""
    results = run_ranks(_scalable, sum(DP_DEGREES), args=(kind,))
    want = sum(pseudo_grad(c) for c in range(3)) / 3
    # fp16: two roundings; int4: half a step of each input's group absmax / 7, then of the mean's
    bound = max(pseudo_grad(c).abs().max() for c in range(3)) / 14 + want.abs().max() / 14
    tolerance = 2e-3 if kind == "fp16" else float(bound)
    if nbytes is None:  # int4 in groups of 16 of each chunk: 2 bytes of scale a group, half a byte a value
        nbytes = lambda n: 2 * math.ceil(n / 16) + math.ceil(n / 2)  # noqa: E731
    for rank, (mean, (sent, recv), resent, payload) in enumerate(results):
        assert torch.equal(mean, results[0][0])  # every replica of every cluster holds the same mean
        torch.testing.assert_close(mean, want, rtol=0, atol=tolerance)
        assert torch.equal(resent, mean)
        me = CLUSTER_OF_RANK[rank]
        chunks = {lane: [nbytes(n) for n in (43, 43, 42)[:3]] if lane == 0 else [nbytes(n) for n in (40, 40, 40)]
                  for lane in LANES_OF_RANK[rank]}  # fmt: skip
        want_bytes = sum(sum(s for c, s in enumerate(sizes) if c != me) + 2 * sizes[me] for sizes in chunks.values())
        assert sent == recv == want_bytes, rank
        assert payload == sum(sum(sizes) for sizes in chunks.values())


LOWRANK = CompressionConfig(kind="lowrank", rank=2, reduction="scalable")  # fp32 factors and small tensors
# Per lane, the first average carries P = M Q (rank 2) and the small tensors, the second Q = M^T P^, each cut into 3
# chunks of fp32 values (the first ones one longer). Lane 0, the (8, 16) matrix: P 16 values (6, 5, 5), Q 32 (11, 11,
# 10). Lane 1: P of the (12, 8) matrix 24 values and the (16,) and (8,) tensors 24 (8, 8, 8 each), Q 16 (6, 5, 5).
LOWRANK_CHUNKS = {0: ([24, 20, 20], [44, 44, 40]), 1: ([64, 64, 64], [24, 20, 20])}


def _lowrank_reference(inputs: list[torch.Tensor], lane: int, warm: dict[int, torch.Tensor]) -> tuple:
    """PowerSGD's shared-factor mean of one lane over the clusters' `inputs`, by hand: (mean, next warm starts, each
    cluster's residual)."""
    from dilocox.compress.lowrank import orthonormalize

    parts = [lane_tensors(u, lane) for u in inputs]
    mean, residuals, next_warm = [], [[] for _ in inputs], {}
    for index, shape in enumerate(SHAPES[:1] if lane == 0 else SHAPES[1:]):
        if len(shape) == 1:
            mean.append(sum(p[index] for p in parts) / len(parts))
            for r in residuals:
                r.append(torch.zeros(shape))
            continue
        seed = 7919 * lane * 1_000_003 + index  # run seed 0: lane l's seed is 7919 l
        q = warm.get(index, torch.randn(shape[1], 2, generator=torch.Generator().manual_seed(seed)))
        basis = orthonormalize(sum(p[index] @ q for p in parts) / len(parts))
        own_q = [p[index].T @ basis for p in parts]
        next_warm[index] = sum(own_q) / len(parts)
        mean.append(basis @ next_warm[index].T)
        for r, p, oq in zip(residuals, parts, own_q, strict=True):
            r.append(p[index] - basis @ oq.T)
    flat = lambda ts: torch.cat([t.reshape(-1) for t in ts])  # noqa: E731
    return flat(mean), next_warm, [flat(r) for r in residuals]


def _scalable_lowrank(rank, world_size):
    """Two rounds of the low-rank scalable reduction of the lanes over clusters of dp 2, 1 and 1, a third replica of
    it resumed from the state after round 1, and the bytes of round 1."""
    topo = Topology.of_clusters(DP_DEGREES)
    groups = build_process_groups(topo, rank)
    coords = topo.coords(rank)
    layout = LaneLayout(topo, coords.cluster, coords.dp)
    shapes = [torch.Size(s) for s in SHAPES]
    channel = WanChannel(groups.cluster_group, bandwidth=None, latency_s=0.0)
    reducer = build_lane_reducer(LOWRANK, shapes, layout=layout, channel=channel, dp_group=groups.dp_group)
    pending = reducer.launch(pseudo_grad(coords.cluster))
    first = pending.wait().clone()
    counters = (channel.bytes_sent, channel.bytes_recv, pending.cost.payload_bytes)
    resent = reducer.relaunch(pending.sent, account=False).wait().clone()
    state = reducer.state_dict()
    second = reducer.launch(pseudo_grad(coords.cluster, 1)).wait().clone()
    resumed = build_lane_reducer(LOWRANK, shapes, layout=layout, channel=channel, dp_group=groups.dp_group)
    resumed.load_state_dict(state)
    again = resumed.launch(pseudo_grad(coords.cluster, 1)).wait().clone()
    channel.close()
    return first, second, again, resent, counters


@pytest.mark.dist
def test_the_lowrank_scalable_lane_mean_is_powersgds_shared_factor_mean_lane_by_lane():
    """Each lane's P factors are averaged like an elementwise lane, orthonormalized alike everywhere, then its Q
    factors: the mean equals PowerSGD's computed here by hand, round 2 starts from round 1's averaged Q and adds what
    round 1's factors lost, a reducer resumed from round 1's state gives round 2 bit for bit, and each rank sends per
    lane and average the other clusters' chunks and its mean chunk twice."""
    results = run_ranks(_scalable_lowrank, sum(DP_DEGREES))
    want_first, want_second, warm, residuals = [], [], {}, {}
    for lane in (0, 1):
        mean, warm[lane], residuals[lane] = _lowrank_reference([pseudo_grad(c) for c in range(3)], lane, {})
        want_first.append(mean)
        second = [pseudo_grad(c, 1) + _padded(residuals[lane][c], lane) for c in range(3)]  # with round 1's residual
        want_second.append(_lowrank_reference(second, lane, warm[lane])[0])
    want_first, want_second = torch.cat(want_first), torch.cat(want_second)
    for rank, (first, second, again, resent, (sent, recv, payload)) in enumerate(results):
        assert torch.equal(first, results[0][0]) and torch.equal(second, results[0][1]), rank  # one mean everywhere
        torch.testing.assert_close(first, want_first, rtol=0, atol=1e-5)
        torch.testing.assert_close(second, want_second, rtol=0, atol=1e-5)
        assert torch.equal(again, second) and torch.equal(resent, first), rank
        me = CLUSTER_OF_RANK[rank]
        steps = [sizes for lane in LANES_OF_RANK[rank] for sizes in LOWRANK_CHUNKS[lane]]
        assert sent == recv == sum(sum(s) - s[me] + 2 * s[me] for s in steps), rank
        assert payload == sum(sum(s) for s in steps), rank


def _padded(u: torch.Tensor, lane: int) -> torch.Tensor:
    """A lane's vector in its place in the whole stage's, zeros elsewhere."""
    whole = torch.zeros(248)
    whole[(0 if lane == 0 else 128) : (128 if lane == 0 else 248)] = u
    return whole
