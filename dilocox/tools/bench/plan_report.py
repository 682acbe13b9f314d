"""What `dilocox plan` prints: the projection table, and the paper's measured numbers beside it for the preset.

The table, and for `--json` the same comparison with the paper as a dict:

    print(format_plan_table(plan(paper_107b_input()), paper=True))
    paper_section(plan(paper_107b_input()))
"""

from __future__ import annotations

from typing import Any

from dilocox.tools.bench.planner import GIB, PAPER, PlanResult, paper_regime


def _fmt_tokens(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.1f}" if value < 100 else f"{value:,.0f}"


def _fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds == 0.0:
        return "0"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1.0:
        return f"{seconds * 1e3:.1f} ms"
    if seconds < 600.0:
        return f"{seconds:.2f} s"
    return f"{seconds / 60.0:.1f} min"


def _fmt_count(value: float) -> str:
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:,.4g}{unit}"
    return f"{value:,.0f}"


def _fmt_flops(value: float) -> str:
    for scale, unit in ((1e15, "PFLOP/s"), (1e12, "TFLOP/s"), (1e9, "GFLOP/s"), (1e6, "MFLOP/s")):
        if value >= scale:
            return f"{value / scale:,.4g} {unit}"
    return f"{value:,.4g} FLOP/s"


def _fmt_bytes(value: float) -> str:
    for scale, unit in ((GIB, "GiB"), (1024**2, "MiB"), (1024, "KiB")):
        if value >= scale:
            return f"{value / scale:,.1f} {unit}"
    return f"{value:,.0f} B"


def _fmt_speedup(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}x" if value < 10 else f"{value:,.0f}x"


def _fmt_rate(bits_per_s: float | None) -> str:
    if bits_per_s is None:
        return "unlimited"
    for scale, unit in ((1e12, "Tbps"), (1e9, "Gbps"), (1e6, "Mbps"), (1e3, "Kbps")):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:g} {unit}"
    return f"{bits_per_s:g} bps"


def _paper_columns() -> dict[str, tuple[float | None, str]]:
    return {
        "allreduce": (PAPER.allreduce_tokens_per_s, _fmt_tokens(PAPER.allreduce_tokens_per_s)),
        "diloco": (None, "could not run"),
        "dilocox": (PAPER.dilocox_tokens_per_s, _fmt_tokens(PAPER.dilocox_tokens_per_s)),
        "dilocox_no_overlap": (
            PAPER.dilocox_no_overlap_tokens_per_s,
            "~" + _fmt_tokens(PAPER.dilocox_no_overlap_tokens_per_s),
        ),
        "dilocox_no_compression": (
            PAPER.dilocox_no_compression_tokens_per_s,
            _fmt_tokens(PAPER.dilocox_no_compression_tokens_per_s),
        ),
    }


def paper_section(result: PlanResult) -> dict[str, Any]:
    """The paper's measured numbers, the model's projection over them, and the ratios the paper implies."""
    regime = paper_regime()
    allreduce = result.strategies["allreduce"]
    model_over_paper = {}
    for name, (measured, _) in _paper_columns().items():
        projected = result.tokens_per_s(name)
        model_over_paper[name] = None if measured is None or projected is None else projected / measured
    return {
        "allreduce_tokens_per_s": PAPER.allreduce_tokens_per_s,
        "diloco_tokens_per_s": None,
        "dilocox_tokens_per_s": PAPER.dilocox_tokens_per_s,
        "dilocox_no_overlap_tokens_per_s": PAPER.dilocox_no_overlap_tokens_per_s,
        "dilocox_no_compression_tokens_per_s": PAPER.dilocox_no_compression_tokens_per_s,
        "reported_speedup": PAPER.reported_speedup,
        "model_over_paper": model_over_paper,
        "allreduce_comm_over_compute": {
            "paper": regime.allreduce_comm_over_compute,
            "model": allreduce.slow_comm_per_round_s / (allreduce.inner_steps * allreduce.step_compute_s),
        },
        "implied_compression_ratio": regime.implied_compression_ratio,
        "implied_inner_steps": regime.implied_inner_steps,
    }


def format_plan_table(result: PlanResult, paper: bool) -> str:
    """The setting, one row per strategy, and the notes; with `paper`, the paper's measured numbers beside them."""
    inp = result.input
    model = inp.label or "model"
    lines = [
        f"model    {model}, {_fmt_count(inp.num_params)} parameters"
        + (f", {inp.num_layers} layers" if inp.num_layers else ""),
        f"layout   {inp.num_clusters} clusters x dp {inp.dp_degree} x tp {inp.tp_degree} x pp {inp.pp_degree} = "
        f"{inp.num_gpus} x {inp.gpu.name} ({_fmt_flops(inp.gpu.peak_flops)}, "
        f"{_fmt_bytes(inp.gpu.memory_bytes)}), MFU {inp.effective_mfu:.2f}",
        f"batch    {inp.tokens_per_step:,} tokens/step = {inp.num_clusters} x {inp.dp_degree} x "
        f"{result.num_microbatches} microbatches x {inp.microbatch_size} x {inp.seq_len:,} tokens; "
        f"pipeline bubble {result.strategies['allreduce'].bubble_fraction:.1%}",
        f"links    slow {_fmt_rate(inp.slow_link_bps)} per {inp.slow_link_scope} uplink, {_fmt_s(inp.slow_latency_s)}; "
        f"intra {_fmt_rate(inp.intra_link_bps)} per rank",
        f"sync     H = {inp.inner_steps}, DiLoCoX payload {inp.compression_ratio:.3g}x smaller than fp32 "
        f"({inp.compressed_reduce}), overlap {'on' if inp.overlap else 'off'}; AllReduce gradients "
        f"{inp.grad_bytes_per_element:g} B/element, pseudo-gradients {inp.pseudo_grad_bytes_per_element:g}",
        "",
    ]
    header = ["strategy", "tokens/s", "step compute", "comm/step", "vs AllReduce", "state/GPU"]
    if paper:
        header += ["paper tokens/s", "model/paper"]
    rows = [header]
    columns = _paper_columns()
    for name, item in result.strategies.items():
        speedup = result.speedup_vs_allreduce(name)
        memory = _fmt_bytes(item.memory_bytes_per_gpu) + ("" if item.fits_memory else " (!)")
        row = [
            item.label,
            _fmt_tokens(item.tokens_per_s) if item.can_run else "cannot run",
            _fmt_s(item.step_compute_s) if item.can_run else "-",
            _fmt_s(item.exposed_comm_per_step_s) if item.can_run else "-",
            _fmt_speedup(speedup),
            memory,
        ]
        if paper:
            measured, shown = columns[name]
            projected = item.tokens_per_s
            row += [shown, "-" if measured is None or projected is None else f"{projected / measured:.2f}"]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for index, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells).rstrip())
        if index == 0:
            lines.append("  ".join("-" * width for width in widths))
    lines.append("")
    lines.append(
        f"comm/step: communication the trainer waits for per step. No-communication limit: "
        f"{_fmt_tokens(result.compute_only_tokens_per_s)} tokens/s."
    )
    for item in result.strategies.values():
        if item.reason:
            lines.append(f"{item.label}: {item.reason}.")
    if any(not item.fits_memory for item in result.strategies.values() if item.can_run):
        lines.append("(!) the estimated training state exceeds the GPU's memory.")
    if paper:
        section = paper_section(result)
        ratio = section["allreduce_comm_over_compute"]
        lines.append(
            f"AllReduce slow-link time / compute per step: model {ratio['model']:,.0f}, paper {ratio['paper']:,.1f} "
            f"(3,728 / 10.4 - 1). The paper's ablations imply a payload {section['implied_compression_ratio']:.1f}x "
            f"smaller than uncompressed and H ~ {section['implied_inner_steps']:.0f} (docs/planner.md)."
        )
    return "\n".join(lines)
