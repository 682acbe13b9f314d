"""Streaming DiLoCo (`sync.fragments`) on 2 real gloo clusters: what each fragment sends and when, against the split,
the schedule (k + 1) x H // N + multiples of H, and a hand reference of blocking averaging per fragment."""

import pytest
import torch

from dilocox.config import load_config
from dilocox.net.channel import WanChannel
from dilocox.net.link import ring_all_reduce_bytes
from dilocox.sync import build_sync
from dilocox.sync.config import OuterConfig, RoundConfig, SyncConfig
from dilocox.sync.diloco import DiLoCoSync
from dilocox.sync.faults import FaultConfig
from dilocox.topology import Topology, build_process_groups
from tests.clock import SimulatedClock
from tests.distributed.test_outer_reference import INNER_LR, flat, inner_step, load, make_model
from tests.multiproc import run_ranks

NUM_CLUSTERS, H, STEPS, FRAGMENTS = 2, 6, 14, 3
SPLIT = [(0, 1), (1, 2), (2, 4)]
"""make_model's tensors (12, 3, 6 and 2 values) in 3 fragments: the first matrix, its bias, the second layer."""


def boundaries(fragment: int) -> list[int]:
    """The formula: the steps s >= 1 with (s - (k + 1) H // N) % H == 0, and the last step."""
    offset = (fragment + 1) * H // FRAGMENTS
    return sorted({s for s in range(1, STEPS + 1) if (s - offset) % H == 0} | {STEPS})


def _drive(rank: int, flags: list[str]) -> dict:
    """Train make_model as this rank's cluster under `flags`; every fragment's launches (step, numel) are recorded
    by a spy around its real reducer, and the parameters after every step."""
    groups = build_process_groups(Topology(NUM_CLUSTERS), rank)
    cfg = load_config(None, ["--sync.kind=diloco", f"--sync.inner_steps={H}", f"--train.steps={STEPS}",
                             f"--sync.fragments={FRAGMENTS}", *flags])  # fmt: skip
    channel = WanChannel(groups.cluster_group, bandwidth=None, latency_s=0.0)
    model = make_model()
    sync = build_sync(cfg, model.parameters(), channel=channel, dp_group=groups.dp_group)
    step_now = [0]
    launches: list[list[tuple[int, int]]] = []
    for fragment in sync.diloco.fragments:
        record: list[tuple[int, int]] = []
        launches.append(record)
        real = fragment.reducer.launch

        def spy(pseudo_grad, real=real, record=record):
            record.append((step_now[0], pseudo_grad.numel()))
            return real(pseudo_grad)

        fragment.reducer.launch = spy
    optimizer = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    params, ends = [], []
    for step in range(1, STEPS + 1):
        step_now[0] = step
        inner_step(model, optimizer, rank, step, sync)
        sync.after_inner_step(step)
        if sync.status().boundary:
            ends.append(step)
        if step == STEPS:
            sync.flush()
        params.append(flat(model).clone())
    stats = channel.stats()
    channel.close()
    return {"launches": launches, "params": params, "ends": ends, "bytes_sent": stats["bytes_sent"],
            "bounds": sync.diloco.bounds, "numels": [p.numel() for p in model.parameters()]}  # fmt: skip


def _run(rank, world_size):
    return {
        "delayed": _drive(rank, ["--sync.sync_delay=1"]),
        "blocking": _drive(
            rank,
            ["--sync.sync_delay=0", "--sync.outer.lr=1.0", "--sync.outer.momentum=0", "--sync.outer.nesterov=false"],
        ),  # fmt: skip
    }


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_run, NUM_CLUSTERS)


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["delayed", "blocking"])
def test_each_fragment_sends_its_own_parameters_once_per_round_at_its_steps(runs, mode):
    for rank, result in enumerate(r[mode] for r in runs):
        assert result["bounds"] == SPLIT
        numels = result["numels"]
        fragment_numels = [sum(numels[first:end]) for first, end in SPLIT]
        assert sum(fragment_numels) == sum(numels)  # the fragments hold every parameter once
        for k, launches in enumerate(result["launches"]):
            assert [step for step, _ in launches] == boundaries(k), (k, launches)
            assert {numel for _, numel in launches} == {fragment_numels[k]}
        assert result["ends"] == sorted(set().union(*(boundaries(k) for k in range(FRAGMENTS))))
        # one dense ring all-reduce per launch over the same link: the bytes are the fragments' sum, exactly
        want = sum(
            ring_all_reduce_bytes(numel, 4, NUM_CLUSTERS, rank)[0]
            for launches in result["launches"]
            for _, numel in launches
        )
        assert result["bytes_sent"] == want


def _peak(rank, world_size):
    """The delayed fragments of `_drive` on an emulated link and a virtual clock (a second of compute per step):
    the most bytes in flight at once during training, and the largest single launch."""
    groups = build_process_groups(Topology(NUM_CLUSTERS), rank)
    cfg = load_config(None, ["--sync.kind=diloco", f"--sync.inner_steps={H}", f"--train.steps={STEPS}",
                             f"--sync.fragments={FRAGMENTS}", "--sync.sync_delay=1"])  # fmt: skip
    clock = SimulatedClock()
    channel = clock.follow(WanChannel(groups.cluster_group, bandwidth=1e6, latency_s=0.0, clock=clock))
    model = make_model()
    sync = build_sync(cfg, model.parameters(), channel=channel, dp_group=groups.dp_group)
    optimizer = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    for step in range(1, STEPS + 1):
        inner_step(model, optimizer, rank, step, sync)
        clock.sleep(1.0)
        sync.after_inner_step(step)
        if step == STEPS:
            sync.flush()
    peak = channel.peak_in_flight_bytes
    channel.close()
    return peak


@pytest.mark.dist
def test_the_peak_in_flight_is_one_fragment_not_the_stage():
    """Each fragment's sync (48, 12 and 32 bytes of fp32 ring all-reduce) arrives long before the next fragment
    launches, so at most one is in flight; the last round of every fragment ends at train.steps together with the
    others, as the end of training, which the peak leaves out."""
    largest = max(ring_all_reduce_bytes(numel, 4, NUM_CLUSTERS, 0)[0] for numel in (12, 3, 8))
    assert run_ranks(_peak, NUM_CLUSTERS) == [largest] * NUM_CLUSTERS


def test_the_schedule_is_staggered():
    # fragment 0 first, the last one at H (Streaming DiLoCo's order)
    assert [boundaries(k) for k in range(FRAGMENTS)] == [[2, 8, 14], [4, 10, 14], [6, 12, 14]]


@pytest.mark.dist
def test_blocking_fragments_become_the_cluster_mean_at_their_boundaries(runs):
    """sync_delay 0, fp32, outer SGD lr 1 without momentum: at each of its boundaries a fragment's parameters become
    the mean of the clusters' (the other fragments keep training on their own)."""
    models = [make_model() for _ in range(NUM_CLUSTERS)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=INNER_LR) for m in models]
    numels = [p.numel() for p in models[0].parameters()]
    offsets = [sum(numels[:i]) for i in range(len(numels) + 1)]
    want = []
    for step in range(1, STEPS + 1):
        for cluster, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            inner_step(model, optimizer, cluster, step)
        vectors = [flat(m).clone() for m in models]
        for k, (first, end) in enumerate(SPLIT):
            if step in boundaries(k):
                part = slice(offsets[first], offsets[end])
                mean = sum(v[part] for v in vectors) / NUM_CLUSTERS
                for v in vectors:
                    v[part] = mean
        for model, vector in zip(models, vectors, strict=True):
            load(model, vector)
        want.append(vectors)
    for cluster, result in enumerate(r["blocking"] for r in runs):
        for step, got in enumerate(result["params"], start=1):
            torch.testing.assert_close(got, want[step - 1][cluster], rtol=0, atol=1e-6, msg=f"step {step}")
    # the clusters really trained apart between boundaries, and agree on a fragment right after its boundary
    assert (want[0][0] - want[0][1]).abs().max() > 1e-3
    first = slice(0, numels[0])  # fragment 0's first boundary is step 2
    assert torch.equal(runs[0]["blocking"]["params"][1][first], runs[1]["blocking"]["params"][1][first])


def _diverge(rank, world_size):
    """Cluster 1's parameters all go non-finite after step 3 (H 4, fragments at 2, 6, 8 and 4, 8)."""
    groups = build_process_groups(Topology(NUM_CLUSTERS), rank)
    cfg = load_config(None, ["--sync.kind=diloco", "--sync.inner_steps=4", "--train.steps=8", "--sync.fragments=2"])
    channel = WanChannel(groups.cluster_group, bandwidth=None, latency_s=0.0)
    model = make_model()
    sync = build_sync(cfg, model.parameters(), channel=channel, dp_group=groups.dp_group)
    optimizer = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    finite_after = []
    for step in range(1, 9):
        inner_step(model, optimizer, rank, step, sync)
        if rank == 1 and step == 3:
            load(model, torch.full_like(flat(model), float("nan")))
        sync.after_inner_step(step)
        finite_after.append(bool(torch.isfinite(flat(model)).all()))
    sync.flush()
    channel.close()
    return {"finite_after": finite_after, "guard": sync.status().guard_counts, "params": flat(model)}


@pytest.mark.dist
def test_a_cluster_that_diverges_heals_every_fragment_at_the_first_boundary():
    """Fragment 1 ends its round at step 4 non-finite and heals to phi; fragment 0 went bad in the same steps and
    starts its round in progress again from its start (step 2), so the cluster trains on finite parameters from step
    4 and heals once, not once per fragment and round."""
    healthy, diverged = run_ranks(_diverge, NUM_CLUSTERS)
    assert diverged["finite_after"] == [True, True, False, True, True, True, True, True]
    assert all(healthy["finite_after"])
    assert diverged["guard"]["healed_rounds"] == 1 and healthy["guard"]["healed_rounds"] == 0
    assert torch.equal(healthy["params"], diverged["params"])  # the flush leaves both at phi


def _short_first_round(rank, world_size, mode):
    """Fragment 0 of 2 (H = 4) has a first round of 2 steps: its small pseudo-gradient, then a 1000 x larger full
    round; fragment 1's rounds are full from the start. `mode`: rounds of steps, or of time (every cluster at full
    speed on the virtual clock: 4 steps a round, the same boundaries)."""
    groups = build_process_groups(Topology(NUM_CLUSTERS), rank)
    outer = OuterConfig(lr=1.0, momentum=0.0, nesterov=False)
    cfg = SyncConfig(kind="diloco", inner_steps=4, fragments=2, outer=outer, round=RoundConfig(mode=mode))
    channel = WanChannel(groups.cluster_group, bandwidth=None, latency_s=0.0)
    first, second = torch.nn.Parameter(torch.zeros(8)), torch.nn.Parameter(torch.zeros(8))
    faults = FaultConfig(slow_mode="virtual") if mode == "time" else None
    sync = DiLoCoSync([first, second], cfg, channel=channel, dp_group=groups.dp_group, total_steps=8, faults=faults)
    skipped = []
    for step in range(1, 7):
        with torch.no_grad():  # the inner steps: a short early round of fragment 0, then a full one
            first.sub_({1: 1e-3, 5: 1.0}.get(step, 0.0))
            second.sub_(1e-3 if step in (1, 3) else 0.0)
        stats = sync.after_inner_step(step)
        if stats is not None:
            skipped.append((stats.fragment, stats.skipped))
    channel.close()
    return skipped, first.detach().clone()


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["steps", "time"])
def test_a_short_first_round_is_no_norm_reference_for_the_full_rounds(mode):
    """The guard judges the mean against recent rounds' norms: a short first round's norm (a fraction of H steps,
    under warm-up) would make the first full round look 1000 x outsized and skip it. Time rounds cut the fragments'
    first rounds alike, at a fraction of the first clock round."""
    for skipped, param in run_ranks(_short_first_round, NUM_CLUSTERS, args=(mode,)):
        assert skipped == [(0, False), (1, False), (0, False)]
        assert torch.allclose(param, torch.full((8,), -1.001))
