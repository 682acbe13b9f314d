"""The strategies on real gloo ranks against slow single-process references (docs/design.md §8)."""

import pytest
import torch

from dilocox.net.channel import WanChannel, ring_all_reduce_bytes
from dilocox.sync import AllReduceSync, DiLoCoSync, SyncConfig
from dilocox.sync.base import shard_bounds
from dilocox.sync.config import OuterConfig
from dilocox.topology import Topology, build_process_groups
from tests.multiproc import run_ranks

DIM_IN, DIM_OUT, BATCH = 7, 5, 4


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # identical start on every rank, as build_model's seeded init gives
    return torch.nn.Sequential(torch.nn.Linear(DIM_IN, DIM_OUT), torch.nn.Tanh(), torch.nn.Linear(DIM_OUT, 3))


def batch(shard: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * shard + step)
    return torch.randn(BATCH, DIM_IN, generator=g), torch.randn(BATCH, 3, generator=g)


def local_step(model, optimizer, shard, step, sync=None):
    x, y = batch(shard, step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    if sync is not None:
        sync.reduce_gradients()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def params_of(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _run_strategy(rank, world_size, kind, topo_args, steps, inner_steps, outer_lr, outer_momentum, lr):
    topo = Topology(*topo_args)
    groups = build_process_groups(topo, rank)
    model = make_model()
    channel = WanChannel(groups.cluster_group, bandwidth=None, latency_s=0.0)
    if kind == "allreduce":
        sync = AllReduceSync(model.parameters(), channel=channel, dp_group=groups.dp_group)
    else:
        cfg = SyncConfig(inner_steps=inner_steps, outer=OuterConfig(lr=outer_lr, momentum=outer_momentum))
        sync = DiLoCoSync(model.parameters(), cfg, channel=channel, dp_group=groups.dp_group, total_steps=steps)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    trajectory = []
    for step in range(1, steps + 1):
        local_step(model, optimizer, topo.shard_index(rank), step, sync)
        sync.after_inner_step(step)
        if sync.status().boundary:
            trajectory.append(params_of(model))
    stats = channel.stats()
    channel.close()
    return trajectory, stats, sync.flat.numel


def _both(rank, world_size, topo_args, steps):
    allreduce = _run_strategy(rank, world_size, "allreduce", topo_args, steps, 1, 1.0, 0.0, 0.1)
    diloco = _run_strategy(rank, world_size, "diloco", topo_args, steps, 1, 1.0, 0.0, 0.1)
    return allreduce, diloco


@pytest.mark.dist
@pytest.mark.parametrize("topo_args", [(2, 1, 1), (2, 2, 1)], ids=["C2", "C2xD2"])
def test_diloco_h1_plain_sgd_equals_allreduce(topo_args):
    """DiLoCo with plain SGD inner, H = 1, outer lr 1, momentum 0 is data parallelism (docs/design.md §8)."""
    world = topo_args[0] * topo_args[1]
    results = run_ranks(_both, world, args=(topo_args, 6))
    for (ar_traj, ar_stats, _numel), (dl_traj, dl_stats, _) in results:
        assert len(ar_traj) == len(dl_traj) == 6
        for ar_params, dl_params in zip(ar_traj, dl_traj, strict=True):
            for a, d in zip(ar_params, dl_params, strict=True):
                torch.testing.assert_close(d, a, rtol=0, atol=1e-6)
        # the same number of cross-cluster all-reduces of the same size: identical slow-link bytes
        assert ar_stats["bytes_sent"] == dl_stats["bytes_sent"] > 0
    # every rank ends with the same model
    final = [r[1][0][-1] for r in results]
    for other in final[1:]:
        for a, b in zip(final[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def reference_diloco(num_clusters, steps, inner_steps, outer_lr, outer_momentum, lr):
    """Single-process DiLoCo: every cluster's model simulated here; the outer step written out by hand
    (Nesterov: buf = m * buf + g; phi -= lr * (g + m * buf)) and cross-checked against torch.optim.SGD."""
    phi = [p.detach().clone() for p in make_model().parameters()]
    buf = [torch.zeros_like(p) for p in phi]
    torch_phi = [p.clone().requires_grad_(True) for p in phi]
    torch_outer = torch.optim.SGD(torch_phi, lr=outer_lr, momentum=outer_momentum, nesterov=True)
    trajectory = []
    models = [make_model() for _ in range(num_clusters)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=lr) for m in models]
    for step in range(1, steps + 1):
        for cluster, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            local_step(model, optimizer, cluster, step)
        if step % inner_steps == 0:
            deltas = [[p0 - p.detach() for p0, p in zip(phi, m.parameters(), strict=True)] for m in models]
            avg = [torch.stack(ds).mean(0) for ds in zip(*deltas, strict=True)]
            for i, g in enumerate(avg):
                buf[i] = outer_momentum * buf[i] + g
                phi[i] = phi[i] - outer_lr * (g + outer_momentum * buf[i])
                torch_phi[i].grad = g.clone()
            torch_outer.step()
            for mine, theirs in zip(phi, torch_phi, strict=True):
                torch.testing.assert_close(mine, theirs.detach(), rtol=0, atol=1e-6)
            for model in models:
                with torch.no_grad():
                    for p, p0 in zip(model.parameters(), phi, strict=True):
                        p.copy_(p0)
            trajectory.append([p.clone() for p in phi])
    return trajectory


def _diloco_only(rank, world_size, steps, inner_steps):
    return _run_strategy(rank, world_size, "diloco", (world_size, 1, 1), steps, inner_steps, 0.7, 0.9, 0.05)


@pytest.mark.dist
def test_outer_nesterov_matches_reference():
    """3 clusters, H = 3, 3 rounds, outer SGD 0.7 / Nesterov 0.9: the distributed run equals the reference."""
    steps, inner_steps = 9, 3
    reference = reference_diloco(3, steps, inner_steps, 0.7, 0.9, 0.05)
    results = run_ranks(_diloco_only, 3, args=(steps, inner_steps))
    for trajectory, _stats, _numel in results:
        assert len(trajectory) == 3
        for got, want in zip(trajectory, reference, strict=True):
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=0, atol=1e-5)


def _sharded_bytes(rank, world_size, dp_degree):
    topo = Topology(world_size // dp_degree, dp_degree, 1)
    _, stats, numel = _run_strategy(rank, world_size, "diloco", (topo.num_clusters, dp_degree, 1), 4, 2, 0.7, 0.9, 0.1)
    groups_rank = topo.coords(rank)
    return stats["bytes_sent"], stats["bytes_recv"], numel, groups_rank.dp, groups_rank.cluster


@pytest.mark.dist
def test_sharded_outer_sync_sends_one_dp_share_per_rank():
    """With D replicas each rank puts exactly its 1/D shard of the pseudo-gradient on the slow link."""
    unsharded = run_ranks(_sharded_bytes, 2, args=(1,))
    sharded = run_ranks(_sharded_bytes, 4, args=(2,))
    numel = unsharded[0][2]
    rounds = 2
    for sent, recv, _, _, cluster in unsharded:
        assert (sent, recv) == tuple(rounds * b for b in ring_all_reduce_bytes(numel, 4, 2, cluster))
    for sent, recv, _, dp, cluster in sharded:
        start, end = shard_bounds(numel, 2, dp)
        assert (sent, recv) == tuple(rounds * b for b in ring_all_reduce_bytes(end - start, 4, 2, cluster))
    # the same total, split over twice the ranks: each rank sends half (to one element of rounding)
    assert sum(r[0] for r in sharded) == sum(r[0] for r in unsharded)
    assert max(r[0] for r in sharded) <= rounds * 4 * (numel // 2 + 1)


def _agreed_model(rank, world_size, steps, merge="keep_local"):
    groups = build_process_groups(Topology(2, 1, 1), rank)
    model = make_model()
    channel = WanChannel(groups.cluster_group, bandwidth=None, latency_s=0.0)
    cfg = SyncConfig(inner_steps=3, sync_delay=1, merge=merge, outer=OuterConfig(lr=0.7, momentum=0.9))
    sync = DiLoCoSync(model.parameters(), cfg, channel=channel, dp_group=None, total_steps=100)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, steps + 1):
        local_step(model, optimizer, rank, step, sync)
        sync.after_inner_step(step)
    local = params_of(model)
    x, _ = batch(99, 0)
    with torch.no_grad():
        with sync.agreed_model() as swapped:
            agreed_out = model(x)
        reference = make_model()  # a fresh model holding the outer params directly
        torch.nn.utils.vector_to_parameters(sync.outer_params, reference.parameters())
        reference_out = reference(x)
    restored = params_of(model)
    channel.close()
    return swapped, agreed_out, reference_out, local, restored, sync.outer_params.clone()


@pytest.mark.dist
@pytest.mark.parametrize("merge", ["keep_local", "eager"])
def test_agreed_model_is_the_outer_params(merge):
    """Evaluating inside `agreed_model()` scores phi (the outer params with every landed update), which every
    cluster holds, not the local model; the local parameters come back bit for bit."""
    results = run_ranks(_agreed_model, 2, args=(8, merge))  # step 8: mid-round, a delayed sync in flight
    for swapped, agreed_out, reference_out, local, restored, _ in results:
        assert swapped
        assert torch.equal(agreed_out, reference_out)
        assert all(torch.equal(a, b) for a, b in zip(local, restored, strict=True))
        flat_local = torch.cat([p.reshape(-1) for p in local])
        assert not torch.equal(flat_local, results[0][5])  # the local model is not the agreed one here
    assert torch.equal(results[0][5], results[1][5])  # both clusters agree on phi
    assert torch.equal(results[0][1], results[1][1])
