"""The scalable compressed mean (compression.reduction = "scalable") on real gloo ranks: C = 2, 3, 4."""

import math

import pytest
import torch

from dilocox.compress import CompressionConfig, build_codec
from dilocox.net.channel import WanChannel
from dilocox.sync import DiLoCoSync, SyncConfig
from dilocox.sync.scalable import ScalableElementwiseReducer, ScalableLowRankReducer
from tests.distributed.resume import simulated, straight_and_resumed
from tests.multiproc import run_ranks

SHAPES = [torch.Size([12, 10]), torch.Size([10]), torch.Size([6, 10]), torch.Size([6])]
NUMEL = sum(s.numel() for s in SHAPES)  # 226


def inputs(cluster: int, round_index: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * round_index + cluster)
    return torch.randn(NUMEL, generator=g)


def low_rank_inputs(cluster: int, round_index: int, rank: int) -> torch.Tensor:
    """Matrices A B_i^T sharing their column space A (so the mean is rank `rank` too), small tensors random."""
    shared = torch.Generator().manual_seed(7 + round_index)
    own = torch.Generator().manual_seed(100 * cluster + round_index)
    parts = []
    for shape in SHAPES:
        if len(shape) == 1:
            parts.append(torch.randn(shape[0], generator=own))
        else:
            a = torch.randn(shape[0], rank, generator=shared)
            b = torch.randn(shape[1], rank, generator=own)
            parts.append((a @ b.T).reshape(-1))
    return torch.cat(parts)


def _mean_once(rank, world_size, kind, codec_rank):
    codec = build_codec(kind, rank=codec_rank, group_size=8)
    with WanChannel(torch.distributed.group.WORLD, bandwidth=None, latency_s=0.0) as channel:
        cls = ScalableElementwiseReducer if kind == "int4" else ScalableLowRankReducer
        reducer = cls(codec, SHAPES, error_feedback=True, channel=channel, dp_group=None)
        x = inputs(rank) if kind == "int4" else low_rank_inputs(rank, 0, codec_rank)
        pending = reducer.launch(x)
        mean = pending.wait().clone()
        return mean, channel.stats(), pending.cost.payload_bytes


def int4_bytes(k: int, group: int = 8) -> int:
    return 2 * math.ceil(k / group) + math.ceil(k / 2)


def chunks(numel: int, world: int) -> list[int]:
    base, extra = divmod(numel, world)
    return [base + (1 if j < extra else 0) for j in range(world)]


def expected_bytes(sizes: list[int], rank: int) -> int:
    """All-to-all sends every chunk but its own; the ring all-gather forwards all but its successor's."""
    world, total = len(sizes), sum(sizes)
    return (total - sizes[rank]) + (total - sizes[(rank + 1) % world])


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3, 4])
def test_int4_mean_is_shared_close_and_costs_about_two_payloads(world):
    results = run_ranks(_mean_once, world, args=("int4", 1))
    exact = torch.stack([inputs(c) for c in range(world)]).mean(0)
    sizes = [int4_bytes(k) for k in chunks(NUMEL, world)]  # chunk j of the whole slice, int4 with group 8
    for rank, (mean, stats, payload) in enumerate(results):
        assert torch.equal(mean, results[0][0])  # every cluster holds the same mean
        # two int4 roundings (each input, then the mean), each at most half a step of its group's absmax / 7
        bound = max(inputs(c).abs().max() for c in range(world)) / 14 + exact.abs().max() / 14 + 1e-2
        assert (mean - exact).abs().max() <= bound
        assert payload == sum(sizes)
        assert stats["bytes_sent"] == expected_bytes(sizes, rank)
        assert stats["bytes_sent"] <= 2 * (world - 1) / world * sum(sizes) + 2 * world * 3  # ~2 x payload
        assert stats["num_transfers"] == 1


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3, 4])
def test_lowrank_mean_of_rank_r_inputs_is_exact_and_bytes_follow_the_formula(world):
    r = 2
    results = run_ranks(_mean_once, world, args=("lowrank", r))
    exact = torch.stack([low_rank_inputs(c, 0, r) for c in range(world)]).mean(0)
    # fp32 factors: step 1 carries P (12x2 + 6x2) then the small tensors (10 + 6), step 2 carries Q (10x2 + 10x2)
    step1 = [4 * (a + b) for a, b in zip(chunks(36, world), chunks(16, world), strict=True)]
    step2 = [4 * k for k in chunks(40, world)]
    for rank, (mean, stats, payload) in enumerate(results):
        torch.testing.assert_close(mean, exact, rtol=1e-5, atol=1e-5)
        assert payload == sum(step1) + sum(step2)
        assert stats["bytes_sent"] == expected_bytes(step1, rank) + expected_bytes(step2, rank)


def _feedback_rounds(rank, world_size):
    codec = build_codec("lowrank", rank=1)  # rank 1 of random matrices: most of each round is left behind
    total_in, total_out = torch.zeros(NUMEL), torch.zeros(NUMEL)
    with WanChannel(torch.distributed.group.WORLD, bandwidth=None, latency_s=0.0) as channel:
        reducer = ScalableLowRankReducer(codec, SHAPES, error_feedback=True, channel=channel, dp_group=None, seed=3)
        for round_index in range(4):
            x = inputs(rank, round_index)
            total_in += x
            total_out += reducer.launch(x).wait()
    residual = torch.cat([r.reshape(-1) for r in reducer.feedback.residuals])
    return total_in, total_out, residual


@pytest.mark.dist
def test_error_feedback_loses_nothing_over_rounds():
    """mean over clusters of the inputs' sum == sum of the averaged results + mean of the final residuals."""
    results = run_ranks(_feedback_rounds, 3)
    mean_in = torch.stack([r[0] for r in results]).mean(0)
    mean_residual = torch.stack([r[2] for r in results]).mean(0)
    total_out = results[0][1]
    assert mean_residual.abs().max() > 0.5  # rank 1 really dropped a lot
    torch.testing.assert_close(total_out + mean_residual, mean_in, rtol=1e-5, atol=1e-4)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.Tanh(), torch.nn.Linear(10, 6))


def _delayed_resume(rank, world_size):
    """dilocox with scalable lowrank_int4 on a slow link, checkpointed with a sync in flight and resumed."""
    inner_steps, rounds = 2, 6
    bandwidth = 2_000 / 0.25  # ~2 kB a sync: ~0.25 s of link against 0.06 virtual s of compute a round

    def fresh():
        model = make_model()
        channel = simulated(
            lambda clock: WanChannel(torch.distributed.group.WORLD, bandwidth=bandwidth, latency_s=0.0, clock=clock)
        )
        compression = CompressionConfig(
            kind="lowrank_int4", rank=2, group_size=8, stochastic_rounding=True, reduction="scalable"
        )
        sync = DiLoCoSync(model.parameters(), SyncConfig(inner_steps=inner_steps, sync_delay=1), compression,
                          channel=channel, dp_group=None, total_steps=rounds * inner_steps)  # fmt: skip
        return model, channel, sync, torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step(model, optimizer, step):
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(8, 12, generator=g), torch.randn(8, 6, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    out = straight_and_resumed(
        fresh, train_step, total_steps=rounds * inner_steps, save_after=3 * inner_steps, step_s=0.03
    )
    return out["straight"], out["resumed"], out["in_flight"]


@pytest.mark.dist
def test_delayed_scalable_sync_agrees_across_clusters_and_resumes_exactly():
    results = run_ranks(_delayed_resume, 3)
    for straight, resumed, in_flight in results:
        assert in_flight
        assert torch.equal(straight[0], results[0][0][0])  # the three clusters end with the same parameters
        assert torch.equal(straight[0], resumed[0])
        assert straight[1] == resumed[1]


def _quorums(rank, world_size, kind):
    """Elastic runs (counted): cluster 2 abstains from round 0; then every cluster launches round 1 over the three,
    and clusters 0 and 1 send it again over a quorum of the two of them (an elastic redo)."""
    codec = build_codec(kind, rank=2, group_size=8)
    cls = ScalableElementwiseReducer if kind == "int4" else ScalableLowRankReducer
    pair = torch.distributed.new_group([0, 1])
    x = [inputs(rank, r) if kind == "int4" else low_rank_inputs(rank, r, 2) for r in range(2)]
    with WanChannel(torch.distributed.group.WORLD, bandwidth=None, latency_s=0.0) as channel:
        reducer = cls(codec, SHAPES, error_feedback=True, channel=channel, dp_group=None, counted=True)
        abstained = reducer.abstain(x[0]) if rank == 2 else reducer.launch(x[0])
        first = abstained.wait().clone()
        held = torch.cat([r.reshape(-1) for r in reducer.feedback.residuals]) if rank < 2 else None
        u = x[1] + held if rank < 2 else None  # the second round's codec input
        pending = reducer.launch(x[1])
        pending.wait()
        if rank == 2:
            return first, None, None, None
        channel.rebind(pair)
        again = reducer.relaunch(pending.sent, account=True)
        second = again.wait().clone()
        # what the new encoding sent, plus what it left in the residuals, is the input: nothing lost to the re-cut
        restored = reducer._input_of(again.sent[16:], 2)
        return first, second, u, restored


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["int4", "lowrank"])
def test_counted_means_leave_an_abstainer_out_and_a_redo_over_fewer_clusters_cuts_its_chunks_again(kind):
    results = run_ranks(_quorums, 3, args=(kind,))
    make = inputs if kind == "int4" else lambda c, r: low_rank_inputs(c, r, 2)
    exact_first = torch.stack([make(c, 0) for c in (0, 1)]).mean(0)  # cluster 2 left out, not counted as zeros
    assert all(torch.equal(result[0], results[0][0]) for result in results)
    if kind == "lowrank":  # rank-2 inputs sharing their column space: exact
        torch.testing.assert_close(results[0][0], exact_first, rtol=1e-5, atol=1e-5)
    else:  # two int4 roundings
        bound = max(make(c, 0).abs().max() for c in (0, 1)) / 14 + exact_first.abs().max() / 14 + 1e-2
        assert (results[0][0] - exact_first).abs().max() <= bound
        assert (results[0][0] - exact_first * 2 / 3).abs().max() > bound  # an abstainer counted as zeros is off
    exact_second = torch.stack([results[c][2] for c in (0, 1)]).mean(0)
    assert torch.equal(results[0][1], results[1][1])
    if kind == "lowrank":
        torch.testing.assert_close(results[0][1], exact_second, rtol=1e-5, atol=1e-4)
    else:
        bound = max(results[c][2].abs().max() for c in (0, 1)) / 14 + exact_second.abs().max() / 14 + 1e-2
        assert (results[0][1] - exact_second).abs().max() <= bound
    for c in (0, 1):
        torch.testing.assert_close(results[c][3], results[c][2], rtol=0, atol=1e-5)
