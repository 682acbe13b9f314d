"""Time encode + local decode (with error feedback) of every codec on a model-shaped pseudo-gradient.

    python benchmarks/codec_speed.py                         # tiny and small, 1 thread, every kind at its defaults
    python benchmarks/codec_speed.py --flavors small --threads 2 --rounds 10
    python benchmarks/codec_speed.py --codecs topk_int4 topk_sign:density=0.01,chunk_size=64 --flavors tiny
    python benchmarks/codec_speed.py --out benchmarks/codec_speed.md

A codec is a `compression.kind`, optionally with `CompressionConfig` fields after a colon (`kind:field=value,...`).
The table gives each codec's payload in bytes and in bits per parameter (one round's cost on the slow link), and
its time per round in ms and in ns per parameter.

The pseudo-gradient has one random tensor per parameter of `dilocox.models` at vocab 2048 (shapes from a model
built on the meta device). `--input gaussian` (i.i.d. values, a flat spectrum) is the worst case for the low-rank
codecs' error, not for their speed; `--input decaying` gives every matrix a spectrum decaying as 0.8^i plus 10%
noise, closer to a real pseudo-gradient, on which the adaptive rank has something to choose (the matrices are
independent from round to round, so warm starts do not help and the residual keeps what a round drops).

Each timed round is `ErrorFeedback.compress`: encode(pseudo_grad + residual) and decode, which is what a sender
does every outer round (a receiver's decode is the decode part). The first rounds are warm-up; rel_err is the
first round's ||decoded - pseudo_grad|| / ||pseudo_grad|| and rank the rank of the last round.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dilocox.compress import CODEC_KINDS, ErrorFeedback, build_codec, compression_ratio
from dilocox.models import Decoder, model_args


def pseudo_grad_shapes(flavor: str, vocab_size: int = 2048) -> list[torch.Size]:
    """Parameter shapes of the whole model of `flavor` (no memory: built on the meta device)."""
    with torch.device("meta"):
        model = Decoder(model_args(flavor, vocab_size=vocab_size))
    return [parameter.shape for parameter in model.parameters()]


def make_pseudo_grad(shape: torch.Size, kind: str, generator: torch.Generator) -> torch.Tensor:
    # 1e-3: about the size of a pseudo-gradient over tens of AdamW steps.
    noise = torch.randn(shape, generator=generator) * 1e-3
    if kind == "gaussian" or len(shape) < 2:
        return noise
    num_rows, num_cols = shape[0], shape[1:].numel()
    width = min(32, num_rows, num_cols)
    decay = 0.8 ** torch.arange(width, dtype=torch.float32)  # (width,)
    left = torch.randn(num_rows, width, generator=generator) * decay  # (m, width)
    signal = left @ torch.randn(width, num_cols, generator=generator)  # (m, n)
    signal *= 1e-3 * (num_rows * num_cols) ** 0.5 / signal.norm()  # the same size as the noise ...
    return signal.view(shape) * 3 + noise * 0.3  # ... then 10 to 1 in amplitude


def parse_codec(spec: str) -> tuple[str, dict]:
    """`kind` or `kind:field=value,...` -> the kind and its `CompressionConfig` fields (numbers parsed)."""
    kind, _, rest = spec.partition(":")
    if kind not in CODEC_KINDS:
        raise SystemExit(f"--codecs {spec}: {kind!r} is not one of {', '.join(CODEC_KINDS)}")
    options = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        options[key] = int(value) if value.lstrip("-").isdigit() else float(value)
    return kind, options


def time_codec(
    kind: str, shapes: list[torch.Size], *, rounds: int, warmup: int, options: dict, input_kind: str
) -> dict:
    generator = torch.Generator().manual_seed(0)
    codec = build_codec(kind, **options)
    feedback = ErrorFeedback()
    times: list[float] = []
    numel = sum(shape.numel() for shape in shapes)
    payload_bytes = 0
    rel_error = 0.0
    for index in range(warmup + rounds):
        pseudo_grads = [make_pseudo_grad(shape, input_kind, generator) for shape in shapes]
        start = time.perf_counter()
        payload, decoded = feedback.compress(codec, pseudo_grads)
        elapsed = time.perf_counter() - start
        if index >= warmup:
            times.append(elapsed)
        payload_bytes = payload.nbytes
        if index == 0:
            error = sum(float((a - b).square().sum()) for a, b in zip(decoded, pseudo_grads, strict=True))
            rel_error = (error / sum(float(g.square().sum()) for g in pseudo_grads)) ** 0.5
    median = statistics.median(times)
    return {
        "bytes": payload_bytes,
        "bits": 8 * payload_bytes / numel,
        "ratio": compression_ratio(payload_bytes, numel),
        "rel_err": rel_error,
        "ms": 1e3 * median,
        "ns": 1e9 * median / numel,
        "rank": getattr(getattr(codec, "policy", None), "rank", options["rank"] if "lowrank" in kind else ""),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavors", nargs="+", default=["tiny", "small"])
    parser.add_argument(
        "--codecs", nargs="+", default=list(CODEC_KINDS), help="kinds, each optionally kind:field=value,... "
    )
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per codec (median reported)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a training rank uses 1)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--input", default="gaussian", choices=["gaussian", "decaying"], help="pseudo-gradient values")
    parser.add_argument("--out", default="", help="also write the table (markdown) to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    options = {"rank": args.rank, "group_size": args.group_size, "rank_min": 2, "rank_max": 32}

    lines = [
        f"torch {torch.__version__}, {args.threads} thread(s), median of {args.rounds} rounds after {args.warmup} "
        f"warm-up; rank {args.rank} (adaptive: 2..32, energy 0.9), int4 groups of {args.group_size}; "
        f"{args.input} input",
        "",
        "| flavor | params | codec | bytes | bits per parameter | ratio vs fp32 | rel_err | rank | ms "
        "| ns per parameter |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    codecs = [parse_codec(spec) for spec in args.codecs]
    for flavor in args.flavors:
        shapes = pseudo_grad_shapes(flavor)
        numel = sum(shape.numel() for shape in shapes)
        for (kind, own), spec in zip(codecs, args.codecs, strict=True):
            row = time_codec(
                kind, shapes, rounds=args.rounds, warmup=args.warmup, options={**options, **own}, input_kind=args.input
            )
            lines.append(
                f"| {flavor} | {numel / 1e6:.2f}M | {spec} | {row['bytes']:,} | {row['bits']:.3f} | {row['ratio']:.1f} "
                f"| {row['rel_err']:.3f} | {row['rank']} | {row['ms']:.1f} | {row['ns']:.1f} |"
            )
            print(lines[-1], flush=True)
    table = "\n".join(lines)
    print()
    print(table)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(table + "\n")


if __name__ == "__main__":
    main()
