"""`dilocox plan`: project tokens/s of AllReduce, DiLoCo and DiLoCoX for a model, topology, links and GPU.

    dilocox plan --preset paper-107b                     # the paper's 107B setting, beside its measured numbers
    dilocox plan --flavor qwen1.5-7b --num-clusters 4 --dp-degree 2 --pp-degree 4 --bandwidth 10Gbps --json
    dilocox plan --flavor tiny --seq-len 256 --num-microbatches 1 --microbatch-size 16 \\
        --calibrate-tokens-per-s 5600 --bandwidth 100Mbps    # a run of this machine, calibrated by a measurement

User errors end with one `dilocox: error: ...` line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from typing import Any

from dilocox.net.link import parse_bandwidth, parse_duration
from dilocox.tools.args import ToolParser, user_error
from dilocox.tools.bench.plan_report import format_plan_table, paper_section
from dilocox.tools.bench.planner import (
    GPU_PRESETS,
    INT4_COMPRESSION_RATIO,
    PlanInput,
    calibrate_cpu_core,
    codec_compression_ratio,
    flavor_param_shapes,
    gpu_preset,
    paper_107b_input,
    plan,
    resolve_flavor,
)

PRESETS = ("paper-107b",)

DESCRIPTION = """Project one training round of AllReduce, DiLoCo (OpenDiLoCo: data parallel, blocking, uncompressed)
and DiLoCoX (pipeline + one-step-delay overlap + compression) and print tokens/s, step compute, exposed
communication per step and the speedup over AllReduce. The model is analytic (docs/planner.md): compute from
6 x params x tokens at the given MFU with the pipeline bubble, ring all-reduces over the fast and the slow links.
Without --preset, give the model (--flavor or --num-params) and the batch (--global-batch-tokens or
--num-microbatches; default: as many microbatches as pipeline stages)."""


def _parser() -> ToolParser:
    parser = ToolParser(prog="dilocox plan", description=DESCRIPTION, formatter_class=argparse.RawTextHelpFormatter)
    add = parser.add_argument
    add("--preset", choices=PRESETS, help="start from a named setting; other options override its values")
    model = parser.add_argument_group("model")
    model.add_argument("--flavor", help="a model flavor (`dilocox flavors`), e.g. tiny, qwen1.5-7b, qwen1.5-107b")
    model.add_argument("--vocab-size", type=int, help="vocabulary of a small flavor (default 2048, the default BPE)")
    model.add_argument("--num-params", type=float, help="parameter count instead of a flavor, e.g. 7e9")
    layout = parser.add_argument_group("layout")
    layout.add_argument("--num-clusters", type=int, help="clusters joined by the slow link (default 2)")
    layout.add_argument("--dp-degree", type=int, help="data-parallel replicas per stage in a cluster (default 1)")
    layout.add_argument("--pp-degree", type=int, help="pipeline stages (default 1)")
    layout.add_argument("--tp-degree", type=int, help="tensor-parallel ranks per stage (default 1)")
    layout.add_argument("--gpus-per-node", type=int, help="GPUs sharing a node uplink (default 8)")
    batch = parser.add_argument_group("batch")
    batch.add_argument("--seq-len", type=int, help="tokens per sequence (default 2048)")
    batch.add_argument("--global-batch-tokens", type=int, help="tokens per step over all clusters")
    batch.add_argument("--num-microbatches", type=int, help="microbatches per step per pipeline replica")
    batch.add_argument("--microbatch-size", type=int, help="sequences per microbatch (default 1)")
    hardware = parser.add_argument_group("hardware")
    hardware.add_argument("--gpu", help=f"one of {', '.join(GPU_PRESETS)} (default A800-40G)")
    hardware.add_argument("--mfu", type=float, help="model FLOPs utilization (default 0.4; 1.0 for cpu-core)")
    hardware.add_argument(
        "--calibrate-tokens-per-s",
        type=float,
        help="measured tokens/s of one rank running the whole model here: sets --gpu cpu-core to that rate",
    )
    links = parser.add_argument_group("links")
    links.add_argument("--bandwidth", help="slow-link uplink, e.g. 1Gbps, 100Mbps, unlimited (default 1Gbps)")
    links.add_argument("--latency", help="slow-link latency per collective, e.g. 10ms (default 10ms)")
    links.add_argument(
        "--slow-link-scope",
        choices=("node", "cluster"),
        help="node: one uplink per node, shared by its GPUs (default); cluster: one uplink per cluster",
    )
    links.add_argument("--intra-bandwidth", help="fast link per rank inside a cluster (default 200Gbps)")
    links.add_argument("--intra-latency", help="fast-link latency per collective (default 0)")
    sync = parser.add_argument_group("DiLoCo / DiLoCoX")
    sync.add_argument("--inner-steps", type=int, help="H, inner steps per round (default 100)")
    sync.add_argument(
        "--compression-ratio", type=float, help=f"DiLoCoX payload vs fp32 (default {INT4_COMPRESSION_RATIO:.2f}, int4)"
    )
    sync.add_argument("--codec-rank", type=int, help="low-rank factors of this rank (needs --flavor)")
    sync.add_argument("--codec-bits", type=int, help="quantize the payload to this many bits (needs --flavor)")
    sync.add_argument("--overlap", choices=("on", "off"), help="DiLoCoX one-step-delay overlap (default on)")
    sync.add_argument("--compressed-reduce", choices=("ring", "all_gather"), help="how payloads combine")
    wire = parser.add_argument_group("wire formats and memory")
    wire.add_argument("--grad-bytes", type=float, help="bytes per gradient element for AllReduce (default 2, bf16)")
    wire.add_argument("--pseudo-grad-bytes", type=float, help="bytes per uncompressed pseudo-gradient element (4)")
    wire.add_argument("--diloco-state-bytes", type=float, help="OpenDiLoCo training state per parameter (16)")
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of the table")
    return parser


def _bits_per_s(text: str, option: str) -> float | None:
    try:
        rate = parse_bandwidth(text)
    except ValueError as exc:
        raise ValueError(f"{option}: {exc}") from None
    return None if rate is None else rate * 8.0


def _seconds(text: str, option: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise ValueError(f"{option}: {exc}") from None


def build_input(argv: list[str]) -> tuple[PlanInput, argparse.Namespace]:
    """Parse `argv` into a validated PlanInput (ValueError names the bad option)."""
    args = _parser().parse_args(argv)
    fields: dict[str, Any] = {}
    base: PlanInput | None = paper_107b_input() if args.preset == "paper-107b" else None

    if args.flavor is not None and args.num_params is not None:
        raise ValueError("--flavor and --num-params both set the model; give one of them")
    if args.vocab_size is not None and args.flavor is None:
        raise ValueError("--vocab-size only applies to --flavor; give --flavor NAME or drop --vocab-size")
    if args.flavor is not None:
        try:
            num_params, num_layers = resolve_flavor(args.flavor, args.vocab_size)
        except ValueError as exc:
            raise ValueError(f"--flavor: {exc}") from None
        fields |= {"num_params": num_params, "num_layers": num_layers, "label": args.flavor}
    elif args.num_params is not None:
        if not (math.isfinite(args.num_params) and args.num_params >= 1 and args.num_params == int(args.num_params)):
            raise ValueError(f"--num-params = {args.num_params!r} must be a positive whole number, e.g. 7e9")
        fields |= {"num_params": int(args.num_params), "num_layers": None, "label": None}
    elif base is None:
        raise ValueError("no model: give --flavor NAME (see `dilocox flavors`), --num-params N or --preset paper-107b")

    simple = {
        "num_clusters": args.num_clusters,
        "dp_degree": args.dp_degree,
        "pp_degree": args.pp_degree,
        "tp_degree": args.tp_degree,
        "gpus_per_node": args.gpus_per_node,
        "seq_len": args.seq_len,
        "microbatch_size": args.microbatch_size,
        "mfu": args.mfu,
        "slow_link_scope": args.slow_link_scope,
        "inner_steps": args.inner_steps,
        "compressed_reduce": args.compressed_reduce,
        "grad_bytes_per_element": args.grad_bytes,
        "pseudo_grad_bytes_per_element": args.pseudo_grad_bytes,
        "diloco_state_bytes_per_param": args.diloco_state_bytes,
    }
    fields |= {name: value for name, value in simple.items() if value is not None}
    if args.global_batch_tokens is not None or args.num_microbatches is not None:
        # A batch given on the command line replaces the preset's, whichever of the two forms it uses.
        fields |= {"global_batch_tokens": args.global_batch_tokens, "num_microbatches": args.num_microbatches}
    elif base is None:
        fields["num_microbatches"] = args.pp_degree or 1
    if args.bandwidth is not None:
        fields["slow_link_bps"] = _bits_per_s(args.bandwidth, "--bandwidth")
    if args.latency is not None:
        fields["slow_latency_s"] = _seconds(args.latency, "--latency")
    if args.intra_bandwidth is not None:
        fields["intra_link_bps"] = _bits_per_s(args.intra_bandwidth, "--intra-bandwidth")
    if args.intra_latency is not None:
        fields["intra_latency_s"] = _seconds(args.intra_latency, "--intra-latency")
    if args.overlap is not None:
        fields["overlap"] = args.overlap == "on"

    inp = replace(base, **fields) if base is not None else PlanInput(**fields)

    if args.calibrate_tokens_per_s is not None:
        if args.gpu is not None and args.gpu.lower() != "cpu-core":
            raise ValueError(
                f"--calibrate-tokens-per-s calibrates the cpu-core GPU, but --gpu = {args.gpu!r}; drop --gpu"
            )
        inp = replace(inp, gpu=calibrate_cpu_core(inp.num_params, args.calibrate_tokens_per_s))
        if args.mfu is None:
            inp = replace(inp, mfu=None)
    elif args.gpu is not None:
        inp = replace(inp, gpu=gpu_preset(args.gpu))
        if args.mfu is None:
            inp = replace(inp, mfu=None)

    codec = args.codec_rank is not None or args.codec_bits is not None
    if codec and args.compression_ratio is not None:
        raise ValueError("--compression-ratio and --codec-rank/--codec-bits both set the compression; give one")
    if args.compression_ratio is not None:
        inp = replace(inp, compression_ratio=args.compression_ratio)
    elif codec:
        flavor = args.flavor if args.flavor is not None else (inp.label if base is not None else None)
        if flavor is None:
            raise ValueError("--codec-rank/--codec-bits need the tensor shapes: give --flavor NAME (not --num-params)")
        shapes = flavor_param_shapes(flavor, args.vocab_size)
        inp = replace(
            inp, compression_ratio=codec_compression_ratio(shapes, rank=args.codec_rank, bits=args.codec_bits)
        )
    inp.validate()
    return inp, args


def main(argv: list[str]) -> int:
    """Run `dilocox plan` with `argv` (the arguments after `plan`); returns the exit code."""
    try:
        inp, args = build_input(argv)
        result = plan(inp)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except ValueError as exc:
        return user_error(exc)
    paper = args.preset == "paper-107b"
    if args.json:
        payload = result.to_dict()
        if paper:
            payload["paper"] = paper_section(result)
        print(json.dumps(payload, indent=2, allow_nan=False))
    else:
        print(format_plan_table(result, paper))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
