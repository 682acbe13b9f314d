"""Time rounds (`sync.round.mode = time`) on 3 gloo ranks, one per cluster, cluster 2 virtually twice as slow: the step
counts each cluster decides, and the token-weighted average against the test's own computation from the clusters'
parameters.

With plain averaging (outer SGD lr 1, momentum 0) and a blocking sync, phi after a round is the average the sync
computed of the clusters' parameters at the round's end; weighted by tokens it must be sum_c n_c theta_c / sum_c n_c,
n_c = the cluster's steps x its tokens per step (8, 8 and 4 steps with H = 8)."""

import pytest
import torch

from dilocox.config import load_config
from dilocox.net.channel import WanChannel
from dilocox.net.link import ring_all_gather_bytes, ring_all_reduce_bytes
from dilocox.sync import TokenWeights, build_sync
from dilocox.sync.rounds import REPORT_FIELDS
from dilocox.topology import Topology, build_process_groups
from tests.distributed.test_outer_reference import flat, inner_step, make_model
from tests.multiproc import run_ranks

NUM_CLUSTERS, H, STEPS, TOKENS_PER_STEP = 3, 8, 16, 100
WANT_STEPS = [8, 8, 4]  # floor(H / factor) per round


def _time_rounds(rank: int, world_size: int, flags: list[str]):
    """This rank's toy model, channel, diloco sync with time rounds (cluster 2 twice as slow, on the virtual clock)
    and inner optimizer, with `flags` on top."""
    groups = build_process_groups(Topology(NUM_CLUSTERS, 1, 1), rank)
    cfg = load_config(
        None,
        [
            "--preset=diloco",
            f"--topology.num_clusters={NUM_CLUSTERS}",
            f"--sync.inner_steps={H}",
            f"--train.steps={STEPS}",
            "--sync.round.mode=time",
            "--faults.slow_clusters=2:2.0",
            "--faults.slow_mode=virtual",
            "--sync.outer.lr=1",
            "--sync.outer.momentum=0",
            "--sync.guard.peers=false",  # random data: the clusters' updates of this toy model point apart
            *flags,
        ],
    )
    cfg.validate(world_size=world_size)
    model = make_model()
    channel = WanChannel(groups.cluster_group, bandwidth=None, latency_s=0.0)
    sync = build_sync(
        cfg, model.parameters(), channel=channel, dp_group=groups.dp_group, weights=TokenWeights(TOKENS_PER_STEP)
    )
    return model, channel, sync, torch.optim.SGD(model.parameters(), lr=0.1)


def _drive(rank, world_size, compression: list[str]):
    model, channel, sync, optimizer = _time_rounds(rank, world_size, ["--sync.sync_delay=0", *compression])
    rounds, step = [], 0
    while not sync.status().done:
        step += 1
        inner_step(model, optimizer, rank, step, sync)
        theta = flat(model).clone()  # before the sync of a round that ends here
        phi_before = sync.outer_params.clone()
        stats = sync.after_inner_step(step)
        if sync.status().boundary:
            rounds.append(
                {
                    "theta": theta,
                    "phi_before": phi_before,
                    "phi": sync.outer_params.clone(),
                    "cluster_steps": stats.cluster_steps,
                    "cluster_tokens": stats.cluster_tokens,
                    "record": stats.to_record(),
                }
            )
    sync.flush()
    sent = channel.stats()["bytes_sent"]
    channel.close()
    return {"rounds": rounds, "steps": step, "bytes_sent": sent, "numel": sync.status().numel}


@pytest.mark.parametrize(
    "compression, tolerance",
    [
        (["--compression.kind=none"], 1e-6),
        (["--compression.kind=fp16", "--compression.reduction=gather", "--compression.error_feedback=false"], 5e-4),
        (["--compression.kind=fp16", "--compression.reduction=scalable", "--compression.error_feedback=false"], 5e-4),
    ],
    ids=["dense", "gather", "scalable"],
)
def test_time_rounds_weigh_each_cluster_by_its_tokens(compression, tolerance):
    results = run_ranks(_drive, world_size=NUM_CLUSTERS, args=(compression,))
    for rank, result in enumerate(results):
        # ceil(16 / 8) = 2 rounds for every cluster; the slow one does half the steps in each
        assert result["steps"] == 2 * WANT_STEPS[rank]
        assert len(result["rounds"]) == 2
        for landed in result["rounds"]:
            assert list(landed["cluster_steps"]) == WANT_STEPS
            assert list(landed["cluster_tokens"]) == [s * TOKENS_PER_STEP for s in WANT_STEPS]
            assert landed["record"]["round_cluster_steps"] == WANT_STEPS
    weights = torch.tensor(WANT_STEPS, dtype=torch.float64)
    for index in range(2):
        thetas = torch.stack([results[c]["rounds"][index]["theta"].double() for c in range(NUM_CLUSTERS)])
        weighted = (weights[:, None] * thetas).sum(0) / weights.sum()
        unweighted = thetas.mean(0)
        assert (weighted - unweighted).abs().max() > 10 * tolerance  # the check below can tell them apart
        for result in results:  # every cluster holds the same phi: the token-weighted mean
            phi = result["rounds"][index]["phi"].double()
            torch.testing.assert_close(phi, weighted, rtol=0, atol=tolerance)
    if compression == ["--compression.kind=none"]:
        # exact bytes: per round one report all-gather (3 float64 per cluster) and the dense ring all-reduce
        for rank, result in enumerate(results):
            report = ring_all_gather_bytes([8 * REPORT_FIELDS] * NUM_CLUSTERS, rank)[0]
            payload = ring_all_reduce_bytes(result["numel"], 4, NUM_CLUSTERS, rank)[0]
            assert result["bytes_sent"] == 2 * (report + payload)


@pytest.mark.dist
def test_a_robust_aggregate_of_time_rounds_takes_the_median_of_the_updates_scaled_by_their_tokens():
    """sync.aggregate = median: phi moves by the coordinate-wise median of the clusters' updates each times n_c over the
    median cluster's tokens (`token_weighted_factor`), here the median of (delta_0, delta_1, delta_2 / 2)."""
    compression = ["--compression.kind=fp16", "--compression.reduction=gather", "--compression.error_feedback=false"]
    results = run_ranks(_drive, world_size=NUM_CLUSTERS, args=([*compression, "--sync.aggregate=median"],))
    scales = torch.tensor(WANT_STEPS, dtype=torch.float64)[:, None] / 8
    for index in range(2):
        phi_before = results[0]["rounds"][index]["phi_before"].double()
        deltas = torch.stack([phi_before - results[c]["rounds"][index]["theta"].double() for c in range(NUM_CLUSTERS)])
        want = phi_before - (scales * deltas).median(dim=0).values
        mean = phi_before - (scales * deltas).sum(0) / scales.sum()
        assert (want - mean).abs().max() > 1e-2  # the median is not the weighted mean here
        for result in results:  # every cluster holds the same phi
            torch.testing.assert_close(result["rounds"][index]["phi"].double(), want, rtol=0, atol=5e-4)


def _fragments(rank, world_size):
    """Time rounds with 2 fragments: cluster 2 does 4 steps to the others' 8 per round, and each fragment's round
    ends halfway through the clock's round (fragment 0) or at its end (fragment 1). Every landing is recorded with the
    clusters' parameters at that fragment's boundary."""
    model, channel, sync, optimizer = _time_rounds(rank, world_size, ["--sync.fragments=2"])
    landings, step = [], 0
    while not sync.status().done:
        step += 1
        inner_step(model, optimizer, rank, step, sync)
        theta = flat(model).clone()
        stats = sync.after_inner_step(step)
        for landed in [] if stats is None else [stats, *stats.also_landed]:
            landings.append({"fragment": landed.fragment, "theta": theta, "phi": sync.outer_params.clone(),
                             "tokens": landed.cluster_tokens})  # fmt: skip
    stats = sync.flush()  # the rounds that ended with the run's last one come with the flush
    for landed in [] if stats is None else [stats, *stats.also_landed]:
        landings.append({"fragment": landed.fragment, "theta": theta, "phi": sync.outer_params.clone(),
                         "tokens": landed.cluster_tokens})  # fmt: skip
    channel.close()
    return {"landings": landings, "steps": step, "bounds": sync.diloco.bounds}


@pytest.mark.dist
def test_time_rounds_with_fragments_weigh_each_fragments_round_by_its_tokens():
    results = run_ranks(_fragments, world_size=NUM_CLUSTERS)
    numels = [p.numel() for p in make_model().parameters()]
    offsets = [sum(numels[:i]) for i in range(len(numels) + 1)]
    for rank, result in enumerate(results):
        assert result["steps"] == 2 * WANT_STEPS[rank]
        # blocking: each fragment lands at each of its 2 boundaries on every cluster, fragment 0 first
        assert [landed["fragment"] for landed in result["landings"]] == [0, 1, 0, 1]
    for index in range(4):
        fragment = results[0]["landings"][index]["fragment"]
        first, end = results[0]["bounds"][fragment]
        part = slice(offsets[first], offsets[end])
        # fragment 0's first round is half a clock round (4, 4 and 2 steps), its second from halfway to halfway
        # (8, 8, 4); fragment 1's rounds are the clock's
        want_tokens = [s * TOKENS_PER_STEP // (2 if index == 0 else 1) for s in WANT_STEPS]
        weights = torch.tensor(want_tokens, dtype=torch.float64)
        thetas = torch.stack([r["landings"][index]["theta"][part].double() for r in results])
        weighted = (weights[:, None] * thetas).sum(0) / weights.sum()
        assert (weighted - thetas.mean(0)).abs().max() > 1e-4  # the weights make a difference
        for result in results:
            assert list(result["landings"][index]["tokens"]) == want_tokens
            torch.testing.assert_close(result["landings"][index]["phi"][part].double(), weighted, rtol=0, atol=1e-6)


def _overlapped(rank, world_size, flags):
    """Time rounds with an overlap of 4 of H = 8 steps: every step's parameters and each landing's step and phi."""
    model, channel, sync, optimizer = _time_rounds(rank, world_size, ["--sync.overlap_steps=4", *flags])
    thetas, landings, step = {0: flat(model).clone()}, [], 0
    while not sync.status().done:
        step += 1
        inner_step(model, optimizer, rank, step, sync)
        thetas[step] = flat(model).clone()  # before the sync of this step
        if sync.after_inner_step(step) is not None:
            landings.append({"step": step, "phi": sync.outer_params.clone()})
    sync.flush()
    channel.close()
    return {"thetas": thetas, "landings": landings}


@pytest.mark.dist
@pytest.mark.parametrize(
    "delay, overlap, launched, landed",
    [
        (0, 4, [[4, 4, 2]], [[8, 8, 4]]),  # streamed: launched 4 (cluster 2: 2) steps before the boundary, lands there
        (1, 4, [[8, 8, 4]], [[12, 12, 6]]),  # delayed: launched at the boundary, lands 4 (cluster 2: 2) steps in
        # 3 of 8 is 1.5 of cluster 2's 4 steps: rounded down, as the fragments' boundaries are, to 1 step in
        (1, 3, [[8, 8, 4]], [[11, 11, 5]]),
    ],
    ids=["streamed", "delayed", "delayed_rounded_down"],
)
def test_time_rounds_land_an_overlapped_sync_the_same_share_of_each_clusters_round_in(delay, overlap, launched, landed):
    """overlap_steps = 4 of H = 8 is half a round: 4 steps of the clusters that do 8 a round, 2 of the one that does 4
    (`DiLoCoSync._planned_events`: the share of H placed at max(1, floor(share x steps / H)) of a cluster's round).
    Plain averaging (lr 1, no momentum, alpha 0 / the eager merge): phi after the first landing is the token-weighted
    mean of the clusters' parameters at their own launch steps, weighted by the steps each trained before it."""
    flags = [f"--sync.sync_delay={delay}", "--sync.alpha=0"] if delay == 0 else ["--sync.sync_delay=1"]
    flags.append(f"--sync.overlap_steps={overlap}")
    results = run_ranks(_overlapped, world_size=NUM_CLUSTERS, args=(flags,))
    want = _weighted_mean(results, launched[0])
    for rank, result in enumerate(results):
        assert result["landings"][0]["step"] == landed[0][rank]
        torch.testing.assert_close(result["landings"][0]["phi"].double(), want, rtol=0, atol=1e-6)
    # an overlap of 4 steps whatever the round would have left cluster 2 (4 steps a round) no launch before its
    # boundary (its parameters after step 4 in the mean), and no landing inside its next round (at step 8)
    if delay == 0:
        assert (_weighted_mean(results, [4, 4, 4]) - want).abs().max() > 1e-3


def _weighted_mean(results, steps: list[int]) -> torch.Tensor:
    """sum_c n_c theta_c / sum_c n_c with theta_c cluster c's parameters after its step n_c of the first round."""
    return sum(n * r["thetas"][n].double() for n, r in zip(steps, results, strict=True)) / sum(steps)


def _one_step_rounds(rank, world_size):
    """Time rounds with 2 fragments and cluster 2 eight times as slow: one step a round, at which both its fragments'
    rounds end. The run's parameters and phi at the end."""
    model, channel, sync, optimizer = _time_rounds(
        rank, world_size, ["--sync.fragments=2", "--faults.slow_clusters=2:8.0"]
    )
    step = 0
    while not sync.status().done:
        step += 1
        inner_step(model, optimizer, rank, step, sync)
        sync.after_inner_step(step)
    theta = flat(model).clone()
    sync.flush()
    channel.close()
    return {"steps": step, "theta": theta, "phi": sync.outer_params.clone(), "bounds": sync.diloco.bounds}


@pytest.mark.dist
def test_time_rounds_with_more_fragments_than_a_clusters_steps_end_together():
    """The run ends after the clock's last round, with fragment 0 in a round the clock began halfway through the last
    one: 4 steps on clusters 0 and 1, none on cluster 2 (its one step a round ended both fragments). Every cluster still
    ends that round, cluster 2 weighing 0 tokens, and all end on one phi: fragment 0's the mean of the others'."""
    results = run_ranks(_one_step_rounds, world_size=NUM_CLUSTERS)
    assert [result["steps"] for result in results] == [16, 16, 2]
    assert all(torch.equal(result["phi"], results[0]["phi"]) for result in results)
    numels = [p.numel() for p in make_model().parameters()]
    first, end = results[0]["bounds"][0]
    part = slice(sum(numels[:first]), sum(numels[:end]))
    want = (results[0]["theta"][part].double() + results[1]["theta"][part].double()) / 2
    torch.testing.assert_close(results[0]["phi"][part].double(), want, rtol=0, atol=1e-6)


@pytest.mark.dist
@pytest.mark.parametrize(
    "delay, launched, landed",
    [
        (0, [4, 4, 1], [8, 8, 1]),  # streamed: cluster 2 launches at its one step, and lands at once
        (1, [8, 8, 1], [12, 12, 2]),  # delayed: cluster 2 lands at its next round's one step, before that round's end
    ],
    ids=["streamed", "delayed"],
)
def test_a_time_round_of_one_step_launches_or_lands_its_overlapped_sync_at_that_step(delay, launched, landed):
    """Cluster 2 eight times as slow does one step a round, which has no step inside it for an overlap: its sync
    launches (streamed) or lands (delayed) at that step, just before the round ends (as its own events, at which an
    elastic run meets: tests/e2e/test_elastic_composed.py). phi after the first landing is the token-weighted mean of
    the clusters' parameters at their launch steps."""
    flags = [f"--sync.sync_delay={delay}", "--faults.slow_clusters=2:8.0"]
    flags += ["--sync.alpha=0"] if delay == 0 else []
    results = run_ranks(_overlapped, world_size=NUM_CLUSTERS, args=(flags,))
    want = _weighted_mean(results, launched)
    for rank, result in enumerate(results):
        assert result["landings"][0]["step"] == landed[rank]
        torch.testing.assert_close(result["landings"][0]["phi"].double(), want, rtol=0, atol=1e-6)


def _event_order(rank, world_size, flags):
    """Time rounds of 2 fragments with an overlap of 3 of H = 8, cluster 2 four times as slow (2 steps a round): every
    event this cluster ran, as (step, fragment, what), and phi at the end."""
    model, channel, sync, optimizer = _time_rounds(
        rank, world_size, ["--sync.fragments=2", "--sync.overlap_steps=3", "--faults.slow_clusters=2:4.0", *flags]
    )
    diloco, events = sync.diloco, []
    run = diloco._run

    def logged(fragment, what, step, *, newcomer):
        events.append((step, diloco.fragments.index(fragment), what))
        return run(fragment, what, step, newcomer=newcomer)

    diloco._run = logged
    step = 0
    while not sync.status().done:
        step += 1
        inner_step(model, optimizer, rank, step, sync)
        sync.after_inner_step(step)
    sync.flush()
    channel.close()
    return {"events": events, "phi": sync.outer_params.clone()}


@pytest.mark.dist
@pytest.mark.parametrize(
    "delay, want, slow_steps",
    [
        # streamed: fragment k launches 3 of H = 8 before its boundary at 4 (k + 1); cluster 2's 2 steps a round
        # put both launches and fragment 0's boundary on its first step (shares 1, 4, 5 of 8), in that order
        (0, [(1, 0, "launch"), (4, 0, "end"), (5, 1, "launch"), (8, 1, "end")], [1, 1, 1, 2, 3, 3, 3, 4, 4]),
        # delayed: fragment k lands 3 after its boundary, the last fragment's in the next round (share 3 of 8, before
        # fragment 0's boundary at 4; on cluster 2 both on one step, which rounded from each boundary came the other
        # way round)
        (1, [(4, 0, "end"), (7, 0, "land"), (8, 1, "end")], [1, 1, 2, 3, 3, 3, 4, 4]),
    ],
    ids=["streamed", "delayed"],
)
def test_time_rounds_of_several_fragments_run_their_overlapped_events_in_one_order_on_every_cluster(
    delay, want, slow_steps
):
    """Every cluster runs the same events in the same order whatever its steps a round (an elastic run's clusters
    meet at each one): those of the full-speed clusters at their steps of a round of H, the slow one's on its 2 steps
    in the order of their shares of the round; all end on one phi."""
    flags = [f"--sync.sync_delay={delay}"] + (["--sync.alpha=0.5"] if delay == 0 else [])
    results = run_ranks(_event_order, world_size=NUM_CLUSTERS, args=(flags,))
    second = [(8 + step, k, what) for step, k, what in want]
    if delay == 1:
        second.insert(0, (11, 1, "land"))  # the last fragment's sync of the first round, 3 into the second
    flush = [(16, 0, "end")]  # fragment 0's round from its last boundary, ended with the run (`DiLoCoSync.end_round`)
    assert results[0]["events"] == results[1]["events"] == want + second + flush
    orders = [[(k, what) for _, k, what in result["events"]] for result in results]
    assert orders[2] == orders[0]
    assert [step for step, _, _ in results[2]["events"]] == slow_steps  # share p at max(1, floor(p x 2 / 8))
    assert all(torch.equal(result["phi"], results[0]["phi"]) for result in results)
