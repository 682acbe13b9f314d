"""The compressed outer sync (gather, decode, average) on real gloo ranks."""

import pytest
import torch

from dilocox.compress import CompressionConfig, Payload, build_codec
from dilocox.net.channel import WanChannel
from dilocox.net.link import ring_all_gather_bytes
from dilocox.sync import DiLoCoSync, GatherReducer, SyncConfig
from dilocox.sync.reducers import param_aligned_bounds
from dilocox.topology import Topology, build_process_groups
from tests.multiproc import run_ranks

STEPS, H = 6, 2


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.Tanh(), torch.nn.Linear(10, 6))


def train(rank, topo_args, codec_kind, *, capture=None):
    topo = Topology(*topo_args)
    groups = build_process_groups(topo, rank)
    model = make_model()
    channel = WanChannel(groups.cluster_group, bandwidth=None, latency_s=0.0)
    compression = CompressionConfig(kind=codec_kind or "none", rank=2, group_size=8)
    sync = DiLoCoSync(model.parameters(), SyncConfig(inner_steps=H), compression, channel=channel,
                      dp_group=groups.dp_group, total_steps=STEPS)  # fmt: skip
    fragment = sync.fragments[0]
    if codec_kind == "none":  # the fp32 identity codec through the gather path, against the dense all-reduce
        fragment.reducer = GatherReducer(build_codec("none"), sync.flat.shapes, error_feedback=True, channel=channel,
                                         dp_group=groups.dp_group)  # fmt: skip
    if capture is not None:  # record what each sync sent and what it averaged to
        launch, wait = fragment.reducer.launch, fragment.wait_sync

        def launch_and_keep(pseudo_grad):
            pending = launch(pseudo_grad)
            capture.append({"transfer": pending.transfer})
            return pending

        def wait_and_keep(pending, **kwargs):
            avg, stats = wait(pending, **kwargs)
            capture[-1]["avg"] = avg.clone()
            return avg, stats

        fragment.reducer.launch, fragment.wait_sync = launch_and_keep, wait_and_keep
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    shard = topo.shard_index(rank)
    for step in range(1, STEPS + 1):
        g = torch.Generator().manual_seed(100 * shard + step)
        x, y = torch.randn(8, 12, generator=g), torch.randn(8, 6, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        sync.reduce_gradients()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync.after_inner_step(step)
    params = sync.flat.gather_data()
    stats = channel.stats()
    channel.close()
    return params, stats, sync


def _identity_and_gather(rank, world_size):
    plain, _, _ = train(rank, (2, 1, 1), None)
    identity, _, _ = train(rank, (2, 1, 1), "none")
    capture = []
    _, stats, sync = train(rank, (2, 1, 1), "lowrank_int4", capture=capture)
    payloads = [[t.clone() for t in c["transfer"].wait()] for c in capture]
    return plain, identity, stats, payloads, [c["avg"] for c in capture], sync.flat.shapes


@pytest.mark.dist
def test_identity_codec_and_gather_average():
    results = run_ranks(_identity_and_gather, 2)
    for plain, identity, _, _, _, _ in results:
        assert torch.equal(plain, identity)  # the none codec through the gather path is bit-identical
    _, _, _, payloads, avgs, shapes = results[0]
    receiver = build_codec("lowrank_int4", rank=2, group_size=8)
    for round_payloads, avg in zip(payloads, avgs, strict=True):
        decoded = [torch.cat([t.reshape(-1) for t in receiver.decode_list(Payload(p), shapes)]) for p in round_payloads]
        torch.testing.assert_close(avg, torch.stack(decoded).mean(0), rtol=0, atol=1e-6)
    for rank, (_, _, stats, payloads_rank, _, _) in enumerate(results):
        sizes = [[p.numel() for p in round_payloads] for round_payloads in payloads_rank]
        want = [ring_all_gather_bytes(s, rank) for s in sizes]
        assert stats["bytes_sent"] == sum(w[0] for w in want)
        assert stats["bytes_recv"] == sum(w[1] for w in want)
        numel = sum(s.numel() for s in results[0][5])
        assert stats["bytes_sent"] < len(sizes) * numel * 4 / 2  # well below the fp32 all-reduce


def _sharded(rank, world_size):
    params, stats, _ = train(rank, (2, 2, 1), "lowrank_int4")
    return params, stats["bytes_sent"]


@pytest.mark.dist
def test_compressed_sync_sharded_over_dp_replicas():
    results = run_ranks(_sharded, 4)
    for params, _sent in results[1:]:
        assert torch.equal(params, results[0][0])  # every rank of every cluster ends with the same model
    assert all(sent > 0 for _, sent in results)


def test_param_aligned_bounds():
    assert param_aligned_bounds([4, 4, 4, 4], 2) == [(0, 8), (8, 16)]
    assert param_aligned_bounds([10, 1, 1], 2) == [(0, 10), (10, 12)]
    assert param_aligned_bounds([3], 2) == [(0, 3), (3, 3)]  # a replica can be left with nothing to send
    bounds = param_aligned_bounds([5, 7, 2, 9, 1, 6], 3)
    assert bounds[0][0] == 0 and bounds[-1][1] == 30
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
