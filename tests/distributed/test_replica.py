"""Replicas that follow replica 0's outer sync (docs/design.md §2.1, `dilocox.sync.replica`) on real gloo ranks:
clusters of dp 2, 1 and 1 where replica 0 of each cluster syncs the whole stage over the slow group of the three
replicas 0, weighted by its cluster's tokens, and cluster 0's replica 1 takes what replica 0's sync did. The average
equals the token-weighted reference in rounds of steps, time rounds, under the delay, in fragments, with a lying or a
non-finite cluster, under the peer check and a robust aggregate; the follower ends every step on its leader's
parameters and status, and an error of the leader's sync is raised on its follower too."""

import pytest
import torch
import torch.distributed as dist

from dilocox.config import load_config
from dilocox.elastic.membership import ElasticError
from dilocox.net.channel import WanChannel
from dilocox.sync import TokenWeights, build_sync
from dilocox.sync.replica import FollowerSync, StageMirror
from dilocox.topology import Topology, build_process_groups
from tests.distributed.resume import simulated
from tests.multiproc import run_ranks

DP_DEGREES = (2, 1, 1)  # ranks 0, 1: cluster 0; rank 2: cluster 1; rank 3: cluster 2
CLUSTER_OF_RANK = (0, 0, 1, 2)
SHAPES = [(8, 16), (16,), (12, 8), (8,)]  # 248 values
FP16 = ("--compression.kind=fp16", "--sync.local_residual=false", "--sync.drain_residual=false")
INT4_DRAINED = ("--compression.kind=int4", "--sync.local_residual=false", "--sync.drain_residual=true")
LIE = ("--faults.kind=scale", "--faults.scale=3", "--faults.cluster=0", "--faults.rounds=1")
REPLICA_TOKENS = 100  # every replica trains 100 tokens a step


def pseudo_grad(cluster: int, round_index: int = 0) -> torch.Tensor:
    """A direction the clusters share and one of their own: honest updates agree, as the peer check expects."""
    shared = torch.randn(248, generator=torch.Generator().manual_seed(999 + round_index))
    return shared + torch.randn(248, generator=torch.Generator().manual_seed(10 * cluster + round_index))


def _followed(rank, world_size, flags, fail_at):
    """Rank 0 leads cluster 0's stage for rank 1; ranks 2 and 3 are clusters of dp 1. Each cluster moves its parameters
    by its own pseudo-gradient over its round's steps (time rounds: cluster 2 is virtually twice as slow, 1 step to
    the others' 2). Returns phi at the start, and after every step the parameters, stats and outer step."""
    leaders = dist.new_group([0, 2, 3])
    replicas = dist.new_group([0, 1])
    cluster = CLUSTER_OF_RANK[rank]
    cfg = load_config(None, ["--sync.kind=diloco", "--sync.inner_steps=2", "--sync.outer.lr=1",
                             "--sync.outer.momentum=0", "--sync.guard.peers=false", "--compression.kind=none",
                             "--train.steps=2", *flags])  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]
    phi = torch.cat([p.detach().reshape(-1) for p in params])
    mirror = StageMirror(params, replicas) if cluster == 0 else None
    channel = WanChannel(leaders if rank != 1 else None, bandwidth=None, latency_s=0.0)
    if rank == 1:
        sync = FollowerSync(mirror, name="diloco", inner_optimizer=None)
    else:
        sync = build_sync(
            cfg,
            params,
            channel=channel,
            dp_group=None,
            weights=TokenWeights(
                REPLICA_TOKENS * DP_DEGREES[cluster],
                round_tokens=2 * REPLICA_TOKENS,
                first_sum=float(sum(DP_DEGREES)),
            ),
            mirror=mirror,
        )
        if rank == 0 and fail_at:
            run = sync.diloco.after_inner_step

            def failing(step):
                if step == fail_at:
                    raise ElasticError(f"only 1 of 3 clusters are left at step {step}")
                return run(step)

            sync.diloco.after_inner_step = failing
    steps = 1 if "--sync.round.mode=time" in flags and cluster == 2 else 2
    numels = [p.numel() for p in params]
    trace, left_out = [], set()
    try:
        for step in range(1, steps + 1):
            with torch.no_grad():  # theta_c = phi - its pseudo-gradient at the round's end (DDP: alike on replicas)
                for p, d in zip(params, (pseudo_grad(cluster) / steps).split(numels), strict=True):
                    p.sub_(d.view_as(p))
            stats = sync.after_inner_step(step)
            left_out |= set(stats.excluded or ()) if stats is not None else set()
            now = torch.cat([p.detach().reshape(-1) for p in params]).clone()
            trace.append((now, None if stats is None else stats.cluster_tokens, sync.status().outer_step))
        stats = sync.flush()
        left_out |= set(stats.excluded or ()) if stats is not None else set()
    except ElasticError as error:
        return phi, trace, str(error)
    finally:
        channel.close()
    now = torch.cat([p.detach().reshape(-1) for p in params]).clone()
    trace.append((now, None if stats is None else stats.cluster_tokens, sync.status().outer_step))
    return phi, trace, f"left out: {sorted(left_out)}" if left_out else None


@pytest.mark.dist
@pytest.mark.parametrize(
    "flags, tokens",
    [
        # tokens of the round: dp_c x 2 steps x 100
        (("--sync.sync_delay=0",), (400, 200, 200)),
        # cluster 2 at half speed: 1 step
        (
            (
                "--sync.sync_delay=0",
                "--sync.round.mode=time",
                "--faults.slow_clusters=2:2.0",
                "--faults.slow_mode=virtual",
            ),
            (400, 200, 100),
        ),  # fmt: skip
        # the one-step delay: the average lands at the flush; meanwhile each cluster starts where the eager rule says
        (("--sync.sync_delay=1", "--sync.merge=eager", "--sync.local_residual=false"), (400, 200, 200)),
        # each fragment (one at step 1, the other at the flush) averages its slice by the clusters' tokens
        (("--sync.sync_delay=0", "--sync.fragments=2"), (400, 200, 200)),
        # cluster 0 lies (3 x its update), unguarded: it goes into the weighted mean as it was sent
        (("--sync.sync_delay=0", "--sync.guard.enabled=false", *LIE), (400, 200, 200)),
        # cluster 0 sends a non-finite update (fp16 payloads, gathered): the others leave it out and average
        # theirs over their own weights; cluster 0 heals, its follower with it
        (
            ("--sync.sync_delay=0", *FP16, "--faults.kind=nan", "--faults.cluster=0", "--faults.rounds=1"),
            (400, 200, 200),
        ),  # fmt: skip
        # the same with int4 payloads and the drain: cluster 0, left out of its only round, drains zeros with the others
        (
            ("--sync.sync_delay=0", *INT4_DRAINED, "--faults.kind=nan", "--faults.cluster=0", "--faults.rounds=1"),
            (400, 200, 200),
        ),  # fmt: skip
        # the peer check compares each payload per unit of its weight: cluster 0's, twice its update, is no lie, nor
        # its drained residual (int4 payloads, then the residual in int4)
        (
            ("--sync.sync_delay=0", *INT4_DRAINED, "--sync.guard.peers=true", "--sync.guard.peer_ratio=1.5"),
            (400, 200, 200),
        ),  # fmt: skip
        # a robust aggregate of the weighted payloads (as time rounds take it): the median of n_c / n_ref x Delta_c
        # over the median weight, value by value
        (("--sync.sync_delay=0", *FP16, "--sync.aggregate=median", "--sync.guard.enabled=false"), (400, 200, 200)),
    ],
    ids=[
        "steps",
        "time_rounds",
        "delayed",
        "fragments",
        "lying_cluster",
        "non_finite_cluster",
        "non_finite_drained",
        "peers",
        "median",
    ],
)
def test_replica_0_syncs_the_cluster_weighted_by_its_tokens_and_its_follower_takes_its_parameters(flags, tokens):
    results = run_ranks(_followed, 4, args=(flags, 0))
    phi = results[0][0]
    lie = 3.0 if "--faults.kind=scale" in flags else 1.0
    updates = [(lie if c == 0 else 1.0) * pseudo_grad(c) for c in range(3)]
    thetas = [phi - u for u in updates]
    kept = (0, *tokens[1:]) if "--faults.kind=nan" in flags else tokens
    want = sum(n * theta for n, theta in zip(kept, thetas, strict=True)) / sum(kept)
    if "--sync.aggregate=median" in flags:  # weights 2, 1, 1: their median is 1
        want = phi - torch.stack([n / 200 * u for n, u in zip(tokens, updates, strict=True)]).median(dim=0).values
    assert (want - sum(thetas) / 3).abs().max() > 0.1  # the premise: the weights change the average
    leader, follower = results[0][1], results[1][1]
    assert len(follower) == len(leader)
    for (lead, lead_tokens, lead_outer), (mine, my_tokens, outer) in zip(leader, follower, strict=True):
        assert torch.equal(mine, lead) and my_tokens == lead_tokens and outer == lead_outer
    if "--sync.sync_delay=1" in flags:  # at the round's end: phi less this cluster's share dp_c / sum dp of it
        torch.testing.assert_close(leader[1][0], phi - 2 / 4 * pseudo_grad(0), rtol=0, atol=1e-5)
    for _phi, trace, error in results:  # the guard leaves out only the non-finite update, drained residuals included
        assert error == ("left out: [0]" if "--faults.kind=nan" in flags else None)
        kind = next((f.split("=")[1] for f in flags if f.startswith("--compression.kind=")), "none")
        atol = {"none": 1e-5, "fp16": 1e-2, "int4": 5e-2}[kind]  # fp16, int4 then its residual, of values up to 5
        torch.testing.assert_close(trace[-1][0], want, rtol=0, atol=atol)  # every cluster ends on the mean
    landed = [t for _now, t, _outer in leader if t is not None]  # the round's tokens, as each cluster reported them
    assert landed == ([(200, 100, 100), (200, 100, 100)] if "--sync.fragments=2" in flags else [tokens])


def _left_alone(rank, world_size):
    if rank < 2:
        return _followed(rank, world_size, ("--sync.sync_delay=0",), 2)
    dist.new_group([0, 2, 3])  # every rank builds the groups the others build
    dist.new_group([0, 1])
    return None


@pytest.mark.dist
def test_an_error_of_the_leaders_sync_is_raised_on_its_follower():
    """Replica 0's sync stops at step 2 with an ElasticError (fewer clusters than sync.min_clusters): its follower,
    waiting for what that step did, raises the same error instead of waiting for ever."""
    results = run_ranks(_left_alone, 4)
    for rank in (0, 1):
        _phi, trace, error = results[rank]
        assert error == "only 1 of 3 clusters are left at step 2" and len(trace) == 1


def _fit_link(rank, world_size):
    """Clusters of dp 2, 1 and 1 under the delay on an emulated link (virtual seconds, `simulated`) with
    sync.round.fit_link: each replica 0 sends the whole stage at 8,000 bytes a second, each step takes 1/16 s; the
    ranks that sync agree on H over their own group (`ProcessGroups.sync_group`) while the follower waits for its
    leader. Returns the rounds (step, H) and the H the run ended with, as each rank saw them."""
    topo = Topology.of_clusters(DP_DEGREES)
    groups = build_process_groups(topo, rank)
    cluster = CLUSTER_OF_RANK[rank]
    cfg = load_config(None, ["--sync.kind=diloco", "--sync.inner_steps=2", "--sync.sync_delay=1",
                             "--sync.round.fit_link=true", "--sync.outer.lr=1", "--sync.outer.momentum=0",
                             "--sync.guard.peers=false", "--compression.kind=none", "--train.steps=40",
                             "--topology.clusters=dp2,dp1,dp1"])  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]
    mirror = StageMirror(params, groups.dp_group) if cluster == 0 else None
    channel = simulated(lambda clock: WanChannel(groups.cluster_group, bandwidth=8000, latency_s=0.0, clock=clock))
    if rank == 1:
        sync = FollowerSync(mirror, name="diloco", inner_optimizer=None)
    else:
        weights = TokenWeights(100 * DP_DEGREES[cluster], round_tokens=200, first_sum=float(sum(DP_DEGREES)))
        sync = build_sync(cfg, params, channel=channel, dp_group=None, agree_group=groups.sync_group,
                          weights=weights, mirror=mirror)  # fmt: skip
    sync.rejoin()
    rounds = []
    for step in range(1, 41):
        channel.clock.sleep(0.0625)
        with torch.no_grad():
            params[0].add_(0.01 * (cluster + 1))  # each cluster moves its own way
        stats = sync.after_inner_step(step)
        if stats is not None:
            rounds.append((step, stats.inner_steps))
    sync.flush()
    channel.close()
    return rounds, sync.status().inner_steps


@pytest.mark.dist
def test_the_ranks_that_sync_fit_h_to_the_link_together_and_the_follower_takes_it():
    """Without their own group the leaders' agreement would wait for the follower, which is waiting for its leader."""
    results = run_ranks(_fit_link, 4, timeout=120)
    rounds, final_h = results[0]
    assert final_h > 2 and any(h > 2 for _, h in rounds)  # the link wanted a longer round than H = 2
    for other_rounds, other_h in results[1:]:  # every rank ends its rounds at the same steps with the same H
        assert other_rounds == rounds and other_h == final_h
