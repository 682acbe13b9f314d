"""The slow link's host staging on a CUDA device (run where a GPU is lent; skipped with the reason elsewhere).

A CUDA payload crosses the gloo link through pinned host buffers copied on a side stream (`dilocox.net.staging`).
These tests hold it to the CPU path's bytes, reuse its buffers, and show that the compute stream does not wait for
a sync in flight: the one timing comparison of the suite, measured with CUDA events on the GPU itself.
"""

import statistics

import pytest
import torch
import torch.distributed as dist

from dilocox.net.channel import WanChannel
from dilocox.net.staging import HostStaging
from tests.distributed.test_staging import ROUNDS, check_staging_results, staging_worker
from tests.multiproc import run_ranks

pytestmark = pytest.mark.gpu


def test_a_cuda_payload_round_trips_through_reused_pinned_buffers():
    staging = HostStaging()
    device = torch.device("cuda", 0)
    allocations = []
    for round_index in range(3):
        payload = torch.randn(300, 7, device=device).t() + round_index  # (7, 300), strided, made on the compute stream
        ticket = staging.ticket(payload.device)
        assert ticket is not None and ticket.side_stream != ticket.compute_stream
        with staging.running(ticket):
            assert torch.cuda.current_stream(device) == ticket.side_stream  # the transfer's kernels go there
            host = staging.to_host(payload)
            assert host.device.type == "cpu" and host.is_pinned() and host.is_contiguous()
            assert torch.equal(host, payload.cpu())  # the bytes of the plain path
            back = staging.to_device(host, device)
            into = torch.empty_like(payload)
            staging.copy_to_device_(into, host)
            staging.finish(ticket, [back, into])
        assert ticket.done is not None and ticket.done.query()  # the communicator thread waited for the copies
        ticket.before_use()
        assert back.is_cuda and torch.equal(back, payload) and torch.equal(into, payload)
        allocations.append(staging.buffers.num_allocations)
    assert allocations == [1, 1, 1]  # one pinned buffer, allocated in the first round and reused after


@pytest.mark.dist
@pytest.mark.parametrize("devices", [("cuda", "cpu"), ("cuda", "cuda"), ("cuda", "cpu", "cuda")])
def test_the_channel_gives_the_host_path_results_from_cuda_ranks(devices):
    """Ranks on cuda:0 (several share it, as clusters emulated on one GPU do) and on the CPU in one group: every
    collective gives the plain path's bytes, and a CUDA rank's pinned buffers are allocated in the first round only."""
    world_size = len(devices)
    results = run_ranks(staging_worker, world_size=world_size, args=(devices,))
    check_staging_results(results, world_size)
    for device, out in zip(devices, results, strict=True):
        if device == "cpu":
            assert out["allocations"] == [0] * ROUNDS
        else:
            assert out["allocations"][0] > 0 and out["allocations"] == [out["allocations"][0]] * ROUNDS


_PAYLOAD_NUMEL = 256 << 20  # 1 GiB of fp32: a plain copy of it on the compute stream costs tens of milliseconds
_MATMULS = 400  # of 8192 x 8192 bf16 matrices: several hundred milliseconds of compute on an H100
_REPEATS = 3


def _overlap_worker(rank: int, world_size: int) -> dict | None:
    """Rank 0 on cuda:0 times a fixed compute workload with CUDA events, alone and while an all-reduce of a 1 GiB
    CUDA payload is in flight; rank 1 is a CPU peer (no second context on the GPU to share its time with)."""
    group = dist.new_group([0, 1])
    if rank == 1:
        with WanChannel(group, bandwidth=None, latency_s=0.0) as channel:
            for _ in range(1 + _REPEATS):
                dist.barrier()
                channel.all_reduce(torch.ones(_PAYLOAD_NUMEL), op="sum")
        return None
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    payload = torch.empty(_PAYLOAD_NUMEL, device=device)

    def timed(launch) -> tuple[float, bool]:
        """GPU seconds of the workload, and whether a launched transfer was still in flight once it was queued."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        transfer = launch() if launch is not None else None
        start.record()
        for _ in range(_MATMULS):
            torch.mm(a, b, out=c)
        end.record()
        in_flight = transfer is not None and not transfer.done()
        if transfer is not None:
            transfer.wait()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3, in_flight

    alone, during, in_flight, correct = [], [], [], []
    with WanChannel(group, bandwidth=None, latency_s=0.0) as channel:
        for repeat in range(1 + _REPEATS):  # the first round allocates the pinned buffer and warms the kernels up
            seconds_alone, _ = timed(None)
            dist.barrier()
            payload.fill_(1.0)
            seconds_during, flight = timed(lambda: channel.launch_all_reduce(payload, op="sum"))
            correct.append(bool((payload == 2.0).all()))
            if repeat:
                alone.append(seconds_alone)
                during.append(seconds_during)
                in_flight.append(flight)
    return {"alone": alone, "during": during, "in_flight": in_flight, "correct": correct}


@pytest.mark.dist
def test_a_sync_in_flight_does_not_slow_the_compute_stream():
    """The copies of a 1 GiB payload to the host and back run on the side stream while 400 matmuls run on the compute
    stream: the matmuls take as long as without the sync, within 5% (the plain `.cpu()` on the compute stream
    would add the copies' time, tens of milliseconds, in front of the queued matmuls)."""
    result = run_ranks(_overlap_worker, world_size=2)[0]
    assert all(result["correct"])
    assert all(result["in_flight"]), "the sync finished before the workload was queued: nothing was overlapped"
    alone, during = statistics.median(result["alone"]), statistics.median(result["during"])
    assert during <= alone * 1.05 + 1e-3, f"the workload took {during:.4f} s during a sync, {alone:.4f} s alone"
