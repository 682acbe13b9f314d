"""The linkcheck report: markdown tables, results.md and results.json."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from dilocox.tools.linkcheck.results import LinkcheckResult
from dilocox.tools.linkcheck.units import format_size

OP_LABELS = {"all_reduce": "all_reduce fp32", "all_gather": "all_gather uint8"}


def _fmt_s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.4f}"


def _fmt_range(samples: Sequence[float]) -> str:
    return f"{min(samples):.4f}-{max(samples):.4f}" if samples else "-"


def _fmt_rate(bits_per_s: float) -> str:
    return f"{bits_per_s / 1e9:.3f} Gbit/s" if bits_per_s >= 1e9 else f"{bits_per_s / 1e6:.1f} Mbit/s"


def format_table(result: LinkcheckResult) -> str:
    """Markdown: one table per shaped rate, with the unshaped baseline beside every row."""
    blocks = []
    for link in result.links:
        tbf = link.tbf
        lines = [
            f"### {link.bandwidth} per cluster uplink ({link.bytes_per_s:,.0f} B/s; tbf rate {tbf['rate_bits']}bit, "
            f"burst {tbf['burst_bytes']:,} B), {result.num_clusters} clusters, latency 0",
            "",
            "| op | payload/rank | bytes charged | unshaped s | shaped s | (min-max) | emulated s | "
            "shaped vs emulated | achieved (charged bytes) |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for row in link.rows:
            lines.append(
                f"| {OP_LABELS.get(row.op, row.op)} | {format_size(row.size_bytes)} | {row.charged_bytes:,} | "
                f"{_fmt_s(result.unshaped(row.op, row.size_bytes))} | {_fmt_s(row.shaped_s)} | "
                f"{_fmt_range(row.samples_s)} | {_fmt_s(row.emulated_s)} | {row.diff_pct:+.1f}% | "
                f"{_fmt_rate(row.achieved_bits_per_s)} |"
            )
        if link.wire:
            lines.append("")
            parts = []
            for wire in link.wire:
                ratio = wire.get("wire_per_payload")
                shown = "-" if ratio is None else f"{ratio:.4f}"
                parts.append(
                    f"cluster {wire['cluster']}: {wire['qdisc_bytes']:,} B in {wire['qdisc_packets']:,} packets, "
                    f"{wire['qdisc_drops']} dropped, wire/payload {shown}"
                )
            lines.append("tbf counters (warm-up included): " + "; ".join(parts) + ".")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def format_markdown(result: LinkcheckResult) -> str:
    """results.md: the command, the date, the setting, the tables."""
    head = [
        "# Shaped link vs emulated link",
        "",
        f"`{result.command}`, {result.date}.",
        "",
        f"{result.topology} Sizes are payload bytes per rank; every time is the median over {result.repeats} "
        f"repeats (after {result.warmup} warm-up) of the slowest rank, measured by a `WanChannel` with "
        "`bandwidth=None` around the real gloo collective. *Emulated* is `LinkModel(bandwidth, latency 0)` applied "
        "to the channel's own byte counts (`max(sent, recv)` + control bytes). *Shaped vs emulated* is "
        "`(shaped - emulated) / emulated`: positive means the real link was slower than the model.",
        "",
    ]
    return "\n".join(head) + "\n" + format_table(result) + "\n"


def write_results(result: LinkcheckResult, out_dir: Path) -> tuple[Path, Path]:
    """Write `results.md` and `results.json` into `out_dir` (created if needed); returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md_path, json_path = out_dir / "results.md", out_dir / "results.json"
    md_path.write_text(format_markdown(result))
    json_path.write_text(json.dumps(result.to_dict(), indent=2, allow_nan=False) + "\n")
    return md_path, json_path
