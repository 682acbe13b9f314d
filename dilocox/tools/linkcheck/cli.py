"""`dilocox linkcheck`: arguments, the run, the printed table and the results files."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from dilocox.tools.args import ToolParser, user_error
from dilocox.tools.linkcheck.namespaces import ShapingError
from dilocox.tools.linkcheck.report import format_table, write_results
from dilocox.tools.linkcheck.runner import DEFAULT_REPEATS, run_linkcheck
from dilocox.tools.linkcheck.units import parse_bandwidths, parse_sizes
from dilocox.tools.linkcheck.worker import NUM_WARMUP

DEFAULT_BANDWIDTH = "100Mbps"
DEFAULT_SIZES = "256KB,1MB,4MB,16MB"

DESCRIPTION = f"""Check the emulated slow link against a real one: put each cluster in its own Linux network namespace,
join them with veth links through a bridge, cap every cluster's uplink with `tc tbf`, and time the same ring
all-reduces (fp32) and all-gathers (uint8) that the WanChannel emulates. Prints, per transfer, the bytes the model
charges, the measured time on the unshaped veth (the overhead floor) and on the shaped link, the model's time at
the same rate (latency 0: netem is not available, so latency is not shaped) and their relative difference.

Needs root (network namespaces and qdiscs) and iproute2; everything it creates is removed at the end, also on
Ctrl+C. Optional: nothing else in dilocox depends on it.

examples:
  sudo dilocox linkcheck                                   # 2 clusters at {DEFAULT_BANDWIDTH}
  sudo dilocox linkcheck --bandwidth 100Mbps,1Gbps --out benchmarks/results/shaped_link
  sudo dilocox linkcheck --clusters 3 --sizes 1MB,8MB --repeats 5 --json"""


def _parser() -> ToolParser:
    parser = ToolParser(
        prog="dilocox linkcheck", description=DESCRIPTION, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--bandwidth",
        default=DEFAULT_BANDWIDTH,
        help=f"cluster uplink rate, or several separated by commas, e.g. 100Mbps,1Gbps (default {DEFAULT_BANDWIDTH})",
    )
    parser.add_argument("--clusters", type=int, default=2, help="clusters, one namespace and rank each (default 2)")
    parser.add_argument(
        "--sizes", default=DEFAULT_SIZES, help=f"payload bytes per rank, comma-separated (default {DEFAULT_SIZES})"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=DEFAULT_REPEATS,
        help=(
            f"timed repeats per transfer after {NUM_WARMUP} warm-up; the median is reported (default {DEFAULT_REPEATS})"
        ),
    )
    parser.add_argument("--json", action="store_true", help="print results.json's content instead of the table")
    parser.add_argument("--out", type=Path, help="also write results.md and results.json into this directory")
    return parser


def main(argv: list[str]) -> int:
    """Run `dilocox linkcheck` with `argv` (the arguments after `linkcheck`); returns the exit code."""
    try:
        args = _parser().parse_args(argv)
        links = parse_bandwidths(args.bandwidth)
        sizes = parse_sizes(args.sizes)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except ValueError as exc:
        return user_error(exc)

    def log(message: str) -> None:
        print(f"linkcheck: {message}", file=sys.stderr, flush=True)

    load_before = os.getloadavg()[0]
    try:
        result = run_linkcheck(links, num_clusters=args.clusters, sizes=sizes, repeats=args.repeats, log=log)
    except (ShapingError, ValueError) as exc:
        return user_error(exc)
    except KeyboardInterrupt:
        print("dilocox: interrupted; the namespaces were removed", file=sys.stderr)
        return 130
    result.command = shlex.join(["dilocox", "linkcheck", *argv])
    result.date = datetime.date.today().isoformat()
    result.host = _host_info(load_before)
    if args.out is not None:
        md_path, json_path = write_results(result, args.out)
        log(f"wrote {md_path} and {json_path}")
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, allow_nan=False))
    else:
        print(format_table(result))
    return 0


def _host_info(load_before: float) -> dict[str, Any]:
    import platform

    import torch

    return {
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        # the timings share this machine's cores: a machine busy before the run reads as a slow link
        "loadavg_1m_before": load_before,
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
