"""CocktailSGD on real gloo ranks against a slow single-process reference (docs/design.md §8)."""

import math
import struct

import pytest
import torch

from dilocox.compress import CocktailConfig
from dilocox.compress.sparse import SparseInt4Codec
from dilocox.net.channel import WanChannel
from dilocox.net.link import ring_all_gather_bytes, ring_all_reduce_bytes
from dilocox.sync.base import shard_bounds
from dilocox.sync.cocktail import CocktailSync
from dilocox.topology import Topology, build_process_groups
from tests.multiproc import run_ranks

DIM_IN, DIM_OUT, BATCH, LR = 64, 8, 16, 0.1
NUMEL = DIM_IN * DIM_OUT + DIM_OUT  # 520: a sample of 260 (> 256, so positions use both bytes)
OPTIONS = {"sample_ratio": 0.5, "topk_ratio": 0.1, "group_size": 8}
STEPS = 50


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # identical start on every rank
    return torch.nn.Linear(DIM_IN, DIM_OUT)


def batch(shard: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A noisy linear regression: every data shard sees the same target map."""
    target = torch.randn(DIM_OUT, DIM_IN, generator=torch.Generator().manual_seed(123))
    g = torch.Generator().manual_seed(1000 * shard + step)
    x = torch.randn(BATCH, DIM_IN, generator=g)
    return x, x @ target.T + 0.01 * torch.randn(BATCH, DIM_OUT, generator=g)


def held_out_loss(model) -> float:
    with torch.no_grad():
        x, y = batch(10_000, 0)
        return torch.nn.functional.mse_loss(model(x), y).item()


class RecordingChannel(WanChannel):
    """Keeps every all-gather so that the test can read the payloads that crossed the slow link."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gathers = []

    def launch_all_gather(self, tensor):
        transfer = super().launch_all_gather(tensor)
        self.gathers.append(transfer)
        return transfer


def _train(rank, topo, groups, *, steps, error_feedback=True, resume_at=None):
    """`steps` SGD steps under CocktailSync; with `resume_at`, the sync is rebuilt from its state_dict there."""
    model = make_model()
    channel = RecordingChannel(groups.cluster_group, bandwidth=None, latency_s=0.0)

    def build():
        cfg = CocktailConfig(error_feedback=error_feedback, **OPTIONS)
        return CocktailSync(model.parameters(), cfg, channel=channel, dp_group=groups.dp_group)

    sync = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    initial_loss = held_out_loss(model)
    local_grads, averaged, payloads = [], [], []
    for step in range(1, steps + 1):
        if step == resume_at:
            state = sync.state_dict()
            sync = build()
            sync.load_state_dict(state)
        x, y = batch(topo.shard_index(rank), step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        local_grads.append(sync.flat.gather_grads())
        sync.reduce_gradients()
        averaged.append(sync.flat.gather_grads())
        payloads.append([p.clone() for p in channel.gathers[-1].wait()])
        assert sync.after_inner_step(step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    stats = channel.stats()
    channel.close()
    return {
        "losses": (initial_loss, held_out_loss(model)),
        "params": [p.detach().clone() for p in model.parameters()],
        "local_grads": local_grads,
        "averaged": averaged,
        "payloads": payloads,
        "stats": stats,
        "payload_nbytes": sync.payload_nbytes(),
        "bytes_per_step": sync.bytes_per_step(),
        "state_bytes": sync.state_bytes(),
        "warnings": list(sync.warnings),
    }


def _worker(rank, world_size, topo_args, extra_runs):
    topo = Topology(*topo_args)
    groups = build_process_groups(topo, rank)
    results = {"main": _train(rank, topo, groups, steps=STEPS)}
    if extra_runs:
        results["no_feedback"] = _train(rank, topo, groups, steps=STEPS, error_feedback=False)
        results["straight"] = _train(rank, topo, groups, steps=10)
        results["resumed"] = _train(rank, topo, groups, steps=10, resume_at=6)
    coords = topo.coords(rank)
    results["coords"] = (coords.cluster, coords.dp)
    return results


def slow_decode(data: torch.Tensor, numel: int, step: int, codec: SparseInt4Codec) -> torch.Tensor:
    """The documented byte layout read byte by byte: positions, fp16 scales, nibbles (low first) -> dense fp64."""
    raw = bytes(data.tolist())
    m = min(numel, max(1, round(OPTIONS["sample_ratio"] * numel)))
    k = min(m, max(1, round(OPTIONS["topk_ratio"] * numel)))
    group = OPTIONS["group_size"]
    width = 2 if m <= 65536 else 4
    positions = struct.unpack_from(f"<{k}{'H' if width == 2 else 'i'}", raw, 0)
    num_groups = math.ceil(k / group)
    scales = struct.unpack_from(f"<{num_groups}e", raw, width * k)
    codes_at = width * k + 2 * num_groups
    assert len(raw) == codes_at + math.ceil(k / 2)
    sample = codec.sample_indices(numel, step=step).tolist()
    assert len(sample) == m
    dense = [0.0] * numel
    for i, position in enumerate(positions):
        byte = raw[codes_at + i // 2]
        code = byte & 0x0F if i % 2 == 0 else byte >> 4
        dense[sample[position]] = (code - 8) * scales[i // group]
    return torch.tensor(dense, dtype=torch.float64)


def check_against_reference(results, topo):
    """Replay every step in one process: dp mean, error feedback, the payload each rank must send, its slow
    decoding and the mean over clusters; every rank's averaged gradient must equal it."""
    codec = SparseInt4Codec(CocktailConfig(**OPTIONS))
    by_coords = {r["coords"]: r["main"] for r in results}
    dp = topo.dp_degree
    residuals = {coords: None for coords in by_coords}
    for step in range(STEPS):
        full = torch.zeros(NUMEL, dtype=torch.float64)
        for d in range(dp):
            start, end = shard_bounds(NUMEL, dp, d)
            shard_sum = torch.zeros(end - start, dtype=torch.float64)
            for c in range(topo.num_clusters):
                grads = torch.stack([by_coords[(c, e)]["local_grads"][step] for e in range(dp)])
                cluster_mean = grads.sum(0) / dp  # (NUMEL,) as dp_mean_ computes it
                shard = cluster_mean[start:end]
                corrected = shard if residuals[(c, d)] is None else shard + residuals[(c, d)]
                sent = by_coords[(c, d)]["payloads"][step][c]
                assert torch.equal(sent, codec.encode(corrected, step=step).data)
                for receiver in range(topo.num_clusters):  # every cluster received the same bytes from this sender
                    assert torch.equal(by_coords[(receiver, d)]["payloads"][step][c], sent)
                decoded = slow_decode(sent, end - start, step, codec)
                residuals[(c, d)] = corrected - decoded.float()
                shard_sum += decoded
            full[start:end] = shard_sum / topo.num_clusters
        for run in by_coords.values():
            torch.testing.assert_close(run["averaged"][step], full.float())


@pytest.mark.dist
@pytest.mark.parametrize("num_clusters", [2, 3])
def test_cocktail_matches_reference_counts_bytes_and_trains(num_clusters):
    topo = Topology(num_clusters, 1, 1)
    results = run_ranks(_worker, num_clusters, args=((num_clusters, 1, 1), num_clusters == 2))
    check_against_reference(results, topo)
    codec = SparseInt4Codec(CocktailConfig(**OPTIONS))
    payload = codec.expected_nbytes(NUMEL)
    for result in results:
        run, (cluster, _) = result["main"], result["coords"]
        # exact bytes: an all-gather of equal payloads, (C-1) x payload each way per step
        sent, recv = ring_all_gather_bytes([payload] * num_clusters, cluster)
        assert sent == recv == (num_clusters - 1) * payload
        assert run["payload_nbytes"] == payload and run["bytes_per_step"] == (sent, recv)
        assert (run["stats"]["bytes_sent"], run["stats"]["bytes_recv"]) == (STEPS * sent, STEPS * recv)
        dense_sent, _ = ring_all_reduce_bytes(NUMEL, 4, num_clusters, cluster)
        assert 5 * sent < dense_sent and not run["warnings"]
        assert run["state_bytes"] == 4 * NUMEL
        # error feedback makes the sparse updates add up: the loss falls clearly
        initial, final = run["losses"]
        assert final < 0.25 * initial
        if num_clusters == 2:
            assert final < result["no_feedback"]["losses"][1]
            for straight, resumed in zip(result["straight"]["params"], result["resumed"]["params"], strict=True):
                assert torch.equal(straight, resumed)  # resume from state_dict is exact
    for other in results[1:]:
        for a, b in zip(results[0]["main"]["params"], other["main"]["params"], strict=True):
            assert torch.equal(a, b)


@pytest.mark.dist
def test_cocktail_two_clusters_by_two_replicas():
    """Each replica sends its half of the gradient; the fast dp all-gather puts the halves together."""
    topo = Topology(2, 2, 1)
    results = run_ranks(_worker, 4, args=((2, 2, 1), False))
    check_against_reference(results, topo)
    codec = SparseInt4Codec(CocktailConfig(**OPTIONS))
    for result in results:
        run, (cluster, dp) = result["main"], result["coords"]
        start, end = shard_bounds(NUMEL, 2, dp)
        payload = codec.expected_nbytes(end - start)
        sent, recv = ring_all_gather_bytes([payload, payload], cluster)
        assert (run["stats"]["bytes_sent"], run["stats"]["bytes_recv"]) == (STEPS * sent, STEPS * recv)
        assert run["state_bytes"] == 4 * (end - start)
        initial, final = run["losses"]
        assert final < 0.25 * initial
    for other in results[1:]:
        for a, b in zip(results[0]["main"]["params"], other["main"]["params"], strict=True):
            assert torch.equal(a, b)
