"""Cut a decoder into pipeline stages balanced by parameter count, and build one stage with the full model's weights.

DiLoCoX (arXiv 2506.21263) splits the model into pipeline stages inside each cluster so that no rank holds the whole
107B model. A stage owns a contiguous range of transformer blocks; stage 0 also owns the token embedding and the last
stage the final norm and the output head. Those two matrices are as large as about one block of the big models
(Qwen1.5-107B: 1.25B each against 1.36B per block), so an even split by layer count would leave the first and last
stages heavier: `split_layers` balances the parameter counts exactly instead.

    args = model_args("small", vocab_size=2048)
    ranges = split_layers(args, num_stages=4)                 # [range(0, 3), range(3, 6), range(6, 9), range(9, 12)]
    stage = build_stage(args, stage=1, num_stages=4, seed=0)  # layers 3..5 only, under the full model's names

This module never imports torch.distributed.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from dilocox.models import Decoder, ModelArgs


@dataclass(frozen=True)
class _Costs:
    """Parameter counts of the pieces a stage can own."""

    layer: int
    """One transformer block (all blocks have the same shape)."""
    embedding: int
    """The token embedding (stage 0)."""
    head: int
    """Final norm + output projection (last stage), counted as its own matrix even when the full model ties it."""


def _costs(args: ModelArgs) -> _Costs:
    # Counted on a one-block model on the meta device, so that the numbers follow the decoder's real structure
    # (biases, norms) without allocating anything; remove_duplicate=False keeps a tied head's own count.
    with torch.device("meta"):
        model = Decoder(replace(args, num_layers=1))
    counts = {"tok_embeddings": 0, "pos_embeddings": 0, "layers": 0, "norm": 0, "output": 0}
    for name, param in model.named_parameters(remove_duplicate=False):
        counts[name.split(".", 1)[0]] += param.numel()
    embedding = counts["tok_embeddings"] + counts["pos_embeddings"]
    return _Costs(layer=counts["layers"], embedding=embedding, head=counts["norm"] + counts["output"])


def _check_num_stages(args: ModelArgs, num_stages: int) -> None:
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ValueError(f"topology.pp_degree = {num_stages!r} must be a positive integer (the number of stages)")
    if num_stages > args.num_layers:
        raise ValueError(
            f"topology.pp_degree = {num_stages} exceeds the model's {args.num_layers} layers; every stage needs at "
            f"least one layer: use pp_degree <= {args.num_layers} or a deeper model.flavor"
        )


def check_split(args: ModelArgs, num_stages: int) -> None:
    """Raise ValueError when the model cannot be cut into `num_stages` pipeline stages (the launcher's preflight
    calls this before any rank starts or any file is written; `build_stage` calls it too)."""
    _check_num_stages(args, num_stages)
    if args.tie_embeddings and num_stages > 1:
        raise ValueError(
            "model.flavor has tie_embeddings=True, which cannot be split into pipeline stages: the embedding (stage "
            "0) and the output head (last stage) would be two copies that drift apart; use an untied model.flavor "
            "or topology.pp_degree = 1"
        )


def _stage_extras(costs: _Costs, num_stages: int) -> list[int]:
    extras = [0] * num_stages
    extras[0] += costs.embedding
    extras[-1] += costs.head
    return extras


def _reachable(prefix: list[int], extras: list[int], low: int, high: int) -> list[list[bool]]:
    """reach[s][i]: layers [0, i) can be covered by stages 0..s-1 with every stage's count within [low, high].

    Layer counts are positive, so `prefix` is strictly increasing and the start positions j that give stage s a
    count in [low, high] for an end position i form one interval, found by bisection; a running sum of reach[s]
    answers "is any of them reachable" in O(1). O(num_stages x num_layers x log num_layers) in all.
    """
    num_layers = len(prefix) - 1
    reach = [[False] * (num_layers + 1) for _ in range(len(extras) + 1)]
    reach[0][0] = True
    for s, extra in enumerate(extras):
        running = [0]
        for flag in reach[s]:
            running.append(running[-1] + flag)
        for i in range(1, num_layers + 1):
            # stage s covers layers [j, i): extra + prefix[i] - prefix[j] within [low, high], and j < i.
            j_min = bisect.bisect_left(prefix, prefix[i] + extra - high)
            j_max = min(bisect.bisect_right(prefix, prefix[i] + extra - low) - 1, i - 1)
            if j_min <= j_max and running[j_max + 1] - running[j_min] > 0:
                reach[s + 1][i] = True
    return reach


def _bisect_int(lo: int, hi: int, ok: Callable[[int], bool], *, want_min: bool) -> int:
    """The smallest (want_min) or largest integer in [lo, hi] for which the monotone predicate `ok` holds."""
    while lo < hi:
        if want_min:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
        else:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def _balanced_ranges(layer_costs: list[int], extras: list[int]) -> list[range]:
    """Exact min-max contiguous partition; among the optimal ones the lightest smallest stage is made as heavy as
    possible, and the remaining ties go to the split that gives earlier stages fewer layers."""
    num_stages, num_layers = len(extras), len(layer_costs)
    prefix = [0]
    for cost in layer_costs:
        prefix.append(prefix[-1] + cost)
    total = prefix[-1] + sum(extras)

    def feasible(low: int, high: int) -> bool:
        return _reachable(prefix, extras, low, high)[num_stages][num_layers]

    # Parameter counts are integers, so bisection over integers finds the exact optimum of each criterion.
    best_max = _bisect_int(0, total, lambda high: feasible(0, high), want_min=True)
    best_min = _bisect_int(0, best_max, lambda low: feasible(low, best_max), want_min=False)
    # Reachability of the suffixes (run on the reversed problem) lets the walk below pick each stage's end greedily.
    reversed_prefix = [prefix[-1] - p for p in reversed(prefix)]
    suffix = _reachable(reversed_prefix, extras[::-1], best_min, best_max)
    ranges: list[range] = []
    start = 0
    for s in range(num_stages):
        stages_after = num_stages - 1 - s
        for end in range(start + 1, num_layers + 1):
            cost = extras[s] + prefix[end] - prefix[start]
            # suffix[k][m]: the last k stages can cover the last m layers within the bounds.
            if best_min <= cost <= best_max and suffix[stages_after][num_layers - end]:
                break
        else:
            raise AssertionError("no feasible stage end although the partition was proven feasible")
        ranges.append(range(start, end))
        start = end
    return ranges


def split_layers(args: ModelArgs, num_stages: int) -> list[range]:
    """Contiguous layer ranges, one per stage, that minimize the largest stage's parameter count.

    Stage 0 also holds the token embedding and the last stage the final norm and output head, so those stages get
    fewer layers. The result is exact and deterministic: first the largest stage is minimized, then the smallest
    one maximized, then earlier stages get fewer layers (they keep more microbatches in flight under 1F1B).
    """
    _check_num_stages(args, num_stages)
    if num_stages == 1:
        return [range(args.num_layers)]
    costs = _costs(args)
    return _balanced_ranges([costs.layer] * args.num_layers, _stage_extras(costs, num_stages))


def stage_parameter_counts(args: ModelArgs, num_stages: int) -> list[int]:
    """Parameters of each stage of `split_layers(args, num_stages)` (a single stage counts a tied head once)."""
    ranges = split_layers(args, num_stages)
    costs = _costs(args)
    extras = _stage_extras(costs, num_stages)
    counts = [len(layers) * costs.layer + extra for layers, extra in zip(ranges, extras, strict=True)]
    if num_stages == 1 and args.tie_embeddings:
        counts[0] -= args.vocab_size * args.dim  # the output projection shares the embedding's matrix
    return counts


def _human(count: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if count >= scale:
            return f"{count / scale:.2f}{suffix}"
    return str(count)


def format_split(args: ModelArgs, num_stages: int) -> str:
    """A plain-text table of the split (stage, layers, parameters) with the max/min balance, for logs and notes."""
    ranges = split_layers(args, num_stages)
    counts = stage_parameter_counts(args, num_stages)
    total = sum(counts)
    rows = [("stage", "layers", "num_layers", "params", "human", "share", "also holds")]
    for stage, (layers, count) in enumerate(zip(ranges, counts, strict=True)):
        extras = []
        if stage == 0:
            extras.append("tok_embeddings")
        if stage == num_stages - 1:
            extras.append("norm, output")
        rows.append(
            (
                str(stage),
                f"{layers.start}-{layers.stop - 1}",
                str(len(layers)),
                f"{count:,}",
                _human(count),
                f"{100 * count / total:.1f}%",
                ", ".join(extras),
            )
        )
    widths = [max(len(row[col]) for row in rows) for col in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.append(f"total {total:,} ({_human(total)}); max/min = {max(counts) / min(counts):.3f}")
    return "\n".join(lines)


def build_stage(
    args: ModelArgs, stage: int, num_stages: int, *, seed: int, device: torch.device | str = "cpu"
) -> Decoder:
    """The decoder restricted to what `stage` owns under `split_layers`, with exactly the full model's weights.

    Built on the meta device, stripped of the blocks outside the stage's range (and of the embedding unless stage 0,
    of the final norm and head unless the last stage), then materialized on `device` and initialized from (seed,
    parameter name): parameter names stay those of the full model, so checkpoints and parity tests match by name.
    """
    model = stage_on_meta(args, stage, num_stages)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model


def stage_on_meta(args: ModelArgs, stage: int, num_stages: int) -> Decoder:
    """Stage `stage` of the decoder on the meta device: its modules and shapes, no storage."""
    check_split(args, num_stages)
    if not isinstance(stage, int) or not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage!r} is outside the {num_stages} pipeline stages (0..{num_stages - 1})")
    layers = split_layers(args, num_stages)[stage]
    with torch.device("meta"):
        model = Decoder(args)
    for index in range(args.num_layers):
        if index not in layers:
            del model.layers[str(index)]
    if stage != 0:
        model.tok_embeddings = None
        model.pos_embeddings = None
    if stage != num_stages - 1:
        model.norm = None
        model.output = None
    return model


def stage_tensor_counts(args: ModelArgs, num_stages: int) -> list[int]:
    """Trainable parameter tensors of each stage (what `sync.fragments` splits), counted on the meta device."""
    return [
        sum(p.requires_grad for p in stage_on_meta(args, stage, num_stages).parameters())
        for stage in range(num_stages)
    ]
