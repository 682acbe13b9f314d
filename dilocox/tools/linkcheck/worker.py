"""One cluster's rank of a linkcheck, inside its namespace: time every transfer through an unlimited WanChannel.

The runner starts one per cluster (`ip netns exec NS python -m dilocox.tools.linkcheck.worker --sizes ...`), with
RANK, WORLD_SIZE, MASTER_ADDR/PORT and GLOO_SOCKET_IFNAME set; each writes its records and channel stats as JSON.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

from dilocox.tools.args import ToolParser, user_error

OPS = ("all_reduce", "all_gather")
NUM_WARMUP = 1


def main(argv: list[str]) -> int:
    """Run the worker with `argv`; writes `--out` and returns the exit code (2 for bad arguments)."""
    parser = ToolParser(prog="python -m dilocox.tools.linkcheck.worker")
    parser.add_argument("--sizes", required=True, help="comma-separated payload bytes per rank")
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=NUM_WARMUP)
    parser.add_argument("--out", type=Path, required=True)
    try:
        args = parser.parse_args(argv)
        sizes = [int(s) for s in args.sizes.split(",")]
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except ValueError as exc:
        return user_error(exc)

    import torch
    import torch.distributed as dist

    from dilocox.net.channel import WanChannel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
    try:
        group = dist.group.WORLD
        records = []
        with WanChannel(group, bandwidth=None, latency_s=0.0) as channel:
            for op in OPS:
                for size in sizes:
                    if op == "all_reduce":
                        payload = torch.zeros(size // 4, dtype=torch.float32)  # (size / 4,) fp32
                    else:
                        payload = torch.zeros(size, dtype=torch.uint8)  # (size,) bytes, e.g. a packed int4 payload
                    for step in range(args.warmup + args.repeats):
                        dist.barrier(group=group)  # every rank starts together, so no rank's time includes a wait
                        control_before = channel.control_bytes
                        if op == "all_reduce":
                            transfer = channel.launch_all_reduce(payload, op="sum")
                        else:
                            transfer = channel.launch_all_gather(payload)
                        transfer.wait()
                        if step >= args.warmup:
                            records.append(
                                {
                                    "op": op,
                                    "size_bytes": size,
                                    "repeat": step - args.warmup,
                                    "link_s": transfer.link_s,
                                    "nbytes_sent": transfer.nbytes_sent,
                                    "nbytes_recv": transfer.nbytes_recv,
                                    "control_bytes": channel.control_bytes - control_before,
                                }
                            )
            dist.barrier(group=group)
            stats = channel.stats()
        args.out.write_text(json.dumps({"rank": dist.get_rank(), "records": records, "stats": stats}))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
