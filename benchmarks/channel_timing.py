"""Measure the WAN channel's emulated link in real seconds against its link model, on 2 gloo ranks.

    python benchmarks/channel_timing.py                      # 40 Mbps, 20 ms, 1 MiB transfers
    python benchmarks/channel_timing.py --bandwidth 1e7 --latency 0.01 --repeats 5

The tests check the same schedule exactly on a virtual clock (`tests/distributed/test_channel.py`); this measures
what a real run gets: how close completion comes to `latency + bytes / bandwidth` on this machine, how much of a
transfer behind enough compute is still exposed (scheduling jitter), and that queued transfers run one after the
other. Each row is the median over `--repeats` of rank 0's measurement; error is measured / model - 1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dilocox.net.channel import WanChannel, ring_all_reduce_bytes

NUMEL = 262_144  # fp32 elements: 1 MiB


def measure(channel: WanChannel, bandwidth: float, latency_s: float) -> dict[str, tuple[float, float]]:
    """(measured, model) seconds of each case on this rank."""
    sent, recv = ring_all_reduce_bytes(NUMEL, 4, channel.world_size, channel.group_rank)
    wire_s = max(sent, recv) / bandwidth
    one = latency_s + wire_s
    rows: dict[str, tuple[float, float]] = {}

    dist.barrier()
    started = time.perf_counter()
    channel.launch_all_reduce(torch.ones(NUMEL)).wait()
    rows["blocking transfer"] = (time.perf_counter() - started, one)

    dist.barrier()
    exposed_before = channel.exposed_s
    transfer = channel.launch_all_reduce(torch.ones(NUMEL))
    time.sleep(1.1 * one)  # stands in for inner steps
    transfer.wait()
    rows["exposed behind 1.1x compute"] = (channel.exposed_s - exposed_before, 0.0)

    dist.barrier()
    started = time.perf_counter()
    first = channel.launch_all_reduce(torch.ones(NUMEL))
    second = channel.launch_all_reduce(torch.ones(NUMEL))
    first.wait()
    rows["first of two queued"] = (time.perf_counter() - started, one)
    second.wait()
    rows["second of two queued"] = (time.perf_counter() - started, 2 * wire_s + latency_s)
    return rows


def worker(rank: int, init_file: str, bandwidth: float, latency_s: float, repeats: int, queue) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    runs = []
    with WanChannel(dist.group.WORLD, bandwidth=bandwidth, latency_s=latency_s) as channel:
        channel.all_reduce(torch.zeros(1))  # start the communicator thread and the gloo pairs
        for _ in range(repeats):
            runs.append(measure(channel, bandwidth, latency_s))
    if rank == 0:
        queue.put({name: (statistics.median(r[name][0] for r in runs), runs[0][name][1]) for name in runs[0]})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bandwidth", type=float, default=5e6, help="bytes/s (default 5e6: 40 Mbps)")
    parser.add_argument("--latency", type=float, default=0.02, help="seconds (default 0.02)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            worker,
            args=(os.path.join(tmp, "init"), args.bandwidth, args.latency, args.repeats, queue),
            nprocs=2,
            start_method="spawn",
        )
    rows = queue.get()
    print(f"| case ({args.bandwidth:.3g} B/s, {args.latency * 1e3:g} ms, 1 MiB) | measured s | model s | error |")
    print("| --- | --- | --- | --- |")
    for name, (measured, model) in rows.items():
        error = f"{measured / model - 1:+.1%}" if model else "-"
        print(f"| {name} | {measured:.3f} | {model:.3f} | {error} |")


if __name__ == "__main__":
    main()
