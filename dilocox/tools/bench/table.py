"""The markdown tables of a bench: one row per run, and the paper regime's, which says where each number comes from."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from dilocox.tools.bench.spec import MIN_STEADY_STEPS


def _fmt(value: Any, spec: str, none: str = "-") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return none if value is None else "inf"
    return format(value, spec)


def _gap_cell(gap: float | None, row: dict[str, Any] | None = None) -> str:
    """`+9.10%`, or over several seeds `+9.10 ± 1.02%` and `(within noise)` where the gap is not resolved."""
    cell = ("+" if gap is not None and gap > 0 else "") + _fmt(gap, ".2f")
    if gap is None:
        return cell
    sd = (row or {}).get("gap_sd_pct")
    if sd is None or row["name"] == row.get("baseline_name"):
        return cell + "%"
    noise = "" if row.get("gap_resolved") else " (within noise)"
    return f"{cell} ± {sd:.2f}%{noise}"


def _pct_cell(value: float | None) -> str:
    """`+2.50%`, `-0.40%`, or `-` for no value."""
    return "-" if value is None else ("+" if value > 0 else "") + f"{value:.2f}%"


def _loss_cell(row: dict[str, Any]) -> str:
    """The mean eval loss, with its standard deviation over seeds when there are several."""
    sd = row.get("final_eval_loss_sd")
    return _fmt(row["final_eval_loss"], ".4f") + ("" if sd is None else f" ± {sd:.4f}")


def _seeds_note(results: dict[str, Any]) -> list[str]:
    seeds = max((row.get("num_seeds", 1) for row in results["runs"]), default=1)
    if seeds < 2:
        return []
    return [
        f"Eval loss: mean ± sample standard deviation over {seeds} seeds (run.seed, +1, ...: initial weights, data "
        "order and codec draws, and the held-out split unless data.split_seed fixes it). Gap: mean ± standard "
        'deviation of the gaps paired seed by seed; "within noise" where the gap changes sign across seeds or is '
        "smaller than its standard deviation."
    ]


def _bytes_ratio_cell(row: dict[str, Any]) -> str:
    return "1/" + _fmt(row["compression_vs_allreduce"], ",.0f") if row["wan_bytes_per_token"] else "0"


def _hidden_cell(hidden: float | None) -> str:
    return _fmt(None if hidden is None else 100 * hidden, ".0f") + ("%" if hidden is not None else "")


def format_table(results: dict[str, Any]) -> str:
    """The markdown table of a bench (one row per run)."""
    if results.get("regime"):
        return format_paper_table(results)
    tuned = results.get("tuned_baseline")
    head = (
        "| run | eval loss | gap to {b} |{t} clusters' training loss, gap | tokens/s | speedup vs {b} | "
        "slow-link bytes/token | bytes vs AllReduce | hidden comm | wall s |".format(
            b=results["baseline"], t=" gap to the tuned baseline |" * bool(tuned)
        )
    )
    lines = [head, "| --- | ---: | ---: |" + " ---: |" * bool(tuned) + " ---: |" * 7]
    for row in results["runs"]:
        gap = row["gap_to_baseline_pct"]
        row = {**row, "baseline_name": results["baseline"]}
        tuned_cell = ""
        if tuned:
            tuned_row = {
                "name": row["name"],
                "baseline_name": tuned,
                "gap_sd_pct": row["tuned_gap_sd_pct"],
                "gap_resolved": row["tuned_gap_resolved"],
            }
            tuned_cell = f" {_gap_cell(row['tuned_gap_to_baseline_pct'], tuned_row)} |"
        lines.append(
            "| {label} | {loss} | {gap} |{tuned} {train} | {tps} | {speed} | {bpt} | {ratio} | {hidden} | {wall} "
            "|".format(
                label=row["label"],
                loss=_loss_cell(row),
                gap=_gap_cell(gap, row),
                tuned=tuned_cell,
                train=_pct_cell(row.get("train_gap_pct")),
                tps=_fmt(row["tokens_per_s"], ",.0f"),
                speed=_fmt(row["speedup_vs_baseline"], ".2f") + ("x" if row["speedup_vs_baseline"] else ""),
                bpt=_fmt(row["wan_bytes_per_token"], ",.1f"),
                ratio=_bytes_ratio_cell(row),
                hidden=_hidden_cell(row["hidden_comm_fraction"]),
                wall=_fmt(row["wall_s"], ".1f"),
            )
        )
    s = results["runs"][0]["summary"] if results["runs"] else {}
    setting = (
        f"{s.get('flavor')} ({s.get('num_params', 0):,} params), {s.get('num_clusters')} clusters x dp "
        f"{s.get('dp_degree')} x pp {s.get('pp_degree')}, {s.get('tokens', 0):,} tokens per run, link "
        f"{s.get('bandwidth')} / {s.get('latency')}"
    )
    quick = " (quick)" if results.get("quick") else ""
    footer = [
        "",
        f"Bench `{results['bench']}` ({results['source']}), {results['date']}{quick}: "
        f"{setting}. Every run: base config `{results['base_config']}` with {results['common_overrides'] or 'no'} "
        "common overrides.",
    ]
    footer += _seeds_note(results)
    footer.append(
        "Clusters' training loss: rank 0's cluster's own training loss over the last 10% of steps, its gap to the "
        f"{results['baseline']}'s paired seed by seed (the eval loss scores the model the clusters agree on)."
    )
    footer += _frontier_note(results)
    if tuned:
        labels = {row["name"]: row["label"] for row in results["runs"]}
        candidates = "; ".join(labels[name] for name in results["tuned_baseline_candidates"])
        footer.append(
            f"Tuned baseline ({labels[tuned]}): the lowest mean eval loss, among those with the most seeds, of "
            f"{candidates}. Its column pairs every row with it seed by seed, like the {results['baseline']} column."
        )
    if results.get("notes"):
        footer.append(results["notes"])
    return "\n".join(lines + footer) + "\n"


def _frontier_note(results: dict[str, Any]) -> list[str]:
    """The rows on the bytes-against-gap frontier (`results["frontier"]`), fewest bytes first."""
    if len(results.get("frontier") or ()) < 2:
        return []
    labels = {row["name"]: row["label"] for row in results["runs"]}
    return [
        f"Frontier (the fewest slow-link bytes per token for each gap to {results['baseline']}, fewest first; "
        f"frontier.png): {'; '.join(labels[name] for name in results['frontier'])}."
    ]


def _of_no_comm_cell(row: dict[str, Any]) -> str:
    """The median share of the no-communication throughput, and its range over the timed runs where there are
    several (each run's tokens/s over the reference's median)."""
    cell = _fmt(100 * row["of_no_communication"], ".1f") + "%"
    if len(row.get("timed_tokens_per_s_repeats", ())) > 1:
        low, high = row["of_no_communication_range"]
        cell += f" ({100 * low:.1f}-{100 * high:.1f})"
    return cell


def _timing_note(results: dict[str, Any]) -> list[str]:
    counts = {row["label"]: len(row.get("timed_tokens_per_s_repeats", ())) for row in results["runs"]}
    if max(counts.values(), default=1) < 2:
        return []
    most = Counter(counts.values()).most_common(1)[0][0]
    others = "; ".join(f"{label}: {n}" for label, n in counts.items() if n != most)
    return [
        f"Tokens/s, speedups and hidden communication: the median over {most} timed runs of each row"
        + (f" ({others})" if others else "")
        + ", interleaved (every row's first, then every row's second, ...) so that the shared machine's drift falls "
        "on every row alike; in brackets, the range of each run's tokens/s over the no-communication median."
    ]


def format_paper_table(results: dict[str, Any]) -> str:
    """The paper-regime table: loss from the link-off runs, tokens/s from the timed runs on the paper's link."""
    b = results["baseline"]
    lines = [
        f"| run | eval loss (link off) | gap to {b} | tokens/s (paper link) | speedup vs {b} | of no-comm throughput "
        "| slow-link bytes/token | bytes vs AllReduce | hidden comm |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in results["runs"]:
        gap, speed, hidden = row["gap_to_baseline_pct"], row["speedup_vs_baseline"], row["hidden_comm_fraction"]
        row = {**row, "baseline_name": b}
        lines.append(
            "| {label} | {loss} | {gap} | {tps} | {speed} | {nocomm} | {bpt} | {ratio} | {hidden} |".format(
                label=row["label"],
                loss=_loss_cell(row),
                gap=_gap_cell(gap, row),
                tps=_fmt(row["tokens_per_s"], ",.1f"),
                speed=_fmt(speed, ",.1f") + ("x" if speed else ""),
                nocomm=_of_no_comm_cell(row),
                bpt=_fmt(row["wan_bytes_per_token"], ",.1f"),
                ratio=_bytes_ratio_cell(row),
                hidden=_hidden_cell(hidden),
            )
        )
    r = results["regime"]
    s = results["runs"][0]["summary"] if results["runs"] else {}
    quick = " (quick)" if results.get("quick") else ""
    footer = [
        "",
        f"Bench `{results['bench']}` in the paper regime ({results['source']}), {results['date']}{quick}: "
        f"{s.get('flavor')} ({s.get('num_params', 0):,} params), {s.get('num_clusters')} clusters x dp "
        f"{s.get('dp_degree')} x pp {s.get('pp_degree')}, {s.get('tokens', 0):,} tokens per convergence run.",
        f"Link: {r['bandwidth_bytes_per_s'] * 8 / 1e6:.4g} Mbps per cluster uplink, {r['latency_s'] * 1e3:g} ms, "
        f"chosen so that one AllReduce step's transfer of the fp32 gradient ({r['grad_bytes'] / 1e6:.2f} MB) takes "
        f"{r['ratio']:.1f} x the measured compute time of a step ({r['compute_s_per_step']:.3f} s, from the "
        "no-communication run), as AllReduce did in the paper (3,728 / 10.4 - 1).",
        "Eval loss, gaps and bytes come from the convergence runs with the link off; tokens/s, speedups and hidden "
        "communication (of the syncs waited for inside the window) from timed runs on that link (2 steps for "
        "per-step strategies; for outer-loop ones the first round, then whole rounds spanning at least "
        f"{MIN_STEADY_STEPS} steps, and the final step; tokens/s over those whole rounds). "
        "The no-communication row (every cluster alone) is timed on the same window as the outer-loop runs, with no "
        "sync inside it; its loss is from its link-off run.",
    ]
    footer += _timing_note(results)
    footer += _seeds_note(results)
    if results.get("notes"):
        footer.append(results["notes"])
    return "\n".join(lines + footer) + "\n"


def format_workloads_table(combined: dict[str, Any]) -> str:
    """The markdown table of a bench over several workloads: a row per run, its gap to the baseline on each
    workload (paired seed by seed, as in each workload's own table, `WORKLOAD/results.md`), their mean and its
    slow-link bytes against AllReduce's on each."""
    workloads = combined["workloads"]
    head = " | ".join(f"gap, {w['name']}" for w in workloads)
    lines = [
        f"| run | {head} | mean gap | bytes vs AllReduce |",
        "| --- |" + " ---: |" * (len(workloads) + 2),
    ]
    rows_by_workload = [{row["name"]: row for row in w["results"]["runs"]} for w in workloads]
    for name in rows_by_workload[0]:
        rows = [rows.get(name) for rows in rows_by_workload]
        cells = [
            "-" if row is None else _gap_cell(row["gap_to_baseline_pct"], {**row, "baseline_name": combined["baseline"]})
            for row in rows
        ]
        gaps = [row["gap_to_baseline_pct"] for row in rows if row is not None and row["gap_to_baseline_pct"] is not None]
        mean = _pct_cell(sum(gaps) / len(gaps)) if len(gaps) == len(rows) else "-"
        ratios = ", ".join("-" if row is None else _bytes_ratio_cell(row) for row in rows)
        label = next(row["label"] for row in rows if row is not None)
        lines.append(f"| {label} | {' | '.join(cells)} | {mean} | {ratios} |")
    quick = " (quick)" if combined.get("quick") else ""
    footer = ["", f"Bench `{combined['bench']}` ({combined['source']}){quick}, one table per workload in its folder:"]
    for w in workloads:
        s = w["results"]["runs"][0]["summary"] if w["results"]["runs"] else {}
        footer.append(
            f"- `{w['name']}`: {w['label']}; {s.get('flavor')} ({s.get('num_params', 0):,} params), "
            f"{s.get('tokens', 0):,} tokens per run, {w['results']['date']}."
        )
    footer += _seeds_note(workloads[0]["results"])
    return "\n".join(lines + footer) + "\n"
