"""The WAN channel's collectives through its host staging, on real gloo ranks.

Each rank keeps its tensors on a device of its own (`devices[rank]`): here every rank is on the CPU, where the
staging must hand gloo the tensors themselves and give the results of the plain path (a `.cpu()` copy reduced or
gathered by gloo, computed beside it on a second group); tests/gpu/test_staging.py runs the same worker with CUDA
ranks, where the payloads cross through pinned buffers on a side stream and must give the same bytes.
"""

import pytest
import torch
import torch.distributed as dist

from dilocox.net.auth import PayloadAuth
from dilocox.net.channel import WanChannel, Wire, ring_all_gather_bytes, ring_all_reduce_bytes
from tests.multiproc import run_ranks

KEY = b"the shared key of every cluster!"
ROUNDS = 3


def _values(rank: int, round_index: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * rank + round_index)
    return torch.randn(5, 7, generator=generator)  # (5, 7) fp32, on the CPU


def staging_worker(rank: int, world_size: int, devices: tuple[str, ...]) -> dict:
    """All-reduce (a strided tensor, in place, several rounds), all-gather of unequal payloads (plain and
    authenticated) and a two-step program, on this rank's device; returns the results on the CPU, the plain path's
    results and how many staging buffers the channel allocated after each round."""
    device = torch.device(devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = dist.new_group(list(range(world_size)))
    reference_group = dist.new_group(list(range(world_size)))  # the plain path's collectives, beside the channel's
    peers = range(world_size)
    out: dict = {"all_reduce": [], "plain_all_reduce": [], "allocations": []}
    with WanChannel(group, bandwidth=None, latency_s=0.0) as channel:
        for round_index in range(ROUNDS):
            values = _values(rank, round_index)
            grads = values.to(device).t()  # (7, 5), strided: gloo reduces a contiguous copy, written back in place
            reduced = channel.launch_all_reduce(grads, op="avg").wait()
            assert reduced is grads and grads.device == device and not grads.is_contiguous()
            plain = values.t().contiguous()
            dist.all_reduce(plain, group=reference_group)
            out["all_reduce"].append(grads.cpu())
            out["plain_all_reduce"].append(plain / world_size)
            out["allocations"].append(channel.staging.buffers.num_allocations)

        payload = (torch.arange(rank + 3, dtype=torch.int64) * (rank + 1)).to(torch.uint8).to(device)
        gathered = channel.all_gather(payload, max_numel=world_size + 2)
        assert gathered[rank] is payload and all(part.device == device for part in gathered)
        out["all_gather"] = [part.cpu() for part in gathered]

        chunks = [
            torch.full((peer + 1,), 10 * rank + peer, dtype=torch.uint8, device=device) for peer in range(world_size)
        ]

        def program(wire: Wire) -> list[torch.Tensor]:
            mine = wire.all_to_all(chunks, [rank + 1] * world_size)  # chunk `rank` of every rank
            assert all(part.device == device for part in mine)
            summed = torch.stack([part.to(torch.int64) for part in mine]).sum(0).to(torch.uint8)
            return wire.all_gather(summed, [peer + 1 for peer in peers])

        result = channel.launch_program(program, kind="sum_chunks", device=device).wait()
        assert all(part.device == device for part in result)
        out["program"] = [part.cpu() for part in result]
        out["bytes"] = (channel.bytes_sent, channel.bytes_recv)

    with WanChannel(group, bandwidth=None, latency_s=0.0, auth=PayloadAuth(KEY)) as channel:
        sealed = channel.all_gather(payload, max_numel=world_size + 2)
        assert sealed[rank] is payload and all(part is not None and part.device == device for part in sealed)
        out["authenticated"] = [part.cpu() for part in sealed]
        out["rejected"] = channel.payloads_rejected
    return out


def check_staging_results(results: list[dict], world_size: int) -> None:
    """What every rank must have received, whatever device it staged from."""
    for rank, out in enumerate(results):
        for got, plain in zip(out["all_reduce"], out["plain_all_reduce"], strict=True):
            assert torch.equal(got, plain), rank  # bit for bit the plain path's mean
        mean = [sum(_values(r, i) for r in range(world_size)).t() / world_size for i in range(ROUNDS)]
        for got, want in zip(out["all_reduce"], mean, strict=True):
            torch.testing.assert_close(got, want)
        expected = [(torch.arange(r + 3, dtype=torch.int64) * (r + 1)).to(torch.uint8) for r in range(world_size)]
        assert all(torch.equal(a, b) for a, b in zip(out["all_gather"], expected, strict=True)), rank
        assert all(torch.equal(a, b) for a, b in zip(out["authenticated"], expected, strict=True)), rank
        assert out["rejected"] == 0
        total = 10 * sum(range(world_size))
        sums = [torch.full((j + 1,), total + world_size * j, dtype=torch.uint8) for j in range(world_size)]
        assert all(torch.equal(a, b) for a, b in zip(out["program"], sums, strict=True)), rank
        # exact bytes: the all-reduce's ring share, the payloads of the all-gather and of the program's two steps
        sent = ROUNDS * ring_all_reduce_bytes(35, 4, world_size, rank)[0]
        sent += ring_all_gather_bytes([r + 3 for r in range(world_size)], rank)[0]
        sent += sum(r + 1 for r in range(world_size)) - (rank + 1)  # all_to_all: chunk j (j + 1 bytes) to rank j
        sent += ring_all_gather_bytes([r + 1 for r in range(world_size)], rank)[0]
        assert out["bytes"][0] == sent, rank


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_host_payloads_go_to_gloo_as_they_are(world_size):
    """On the CPU the staging is a no-op: the plain path's results bit for bit, and no staging buffer allocated
    (2 ranks swap payloads directly, 3 gather them padded)."""
    results = run_ranks(staging_worker, world_size=world_size, args=(("cpu",) * world_size,))
    check_staging_results(results, world_size)
    assert all(out["allocations"] == [0] * ROUNDS for out in results)
