"""Metrics of a run: `metrics.jsonl` (one object per logged step), a progress bar, and `summary.json`.

Only rank 0 logs. The progress bar is drawn with rich when stdout is a terminal; otherwise (CI, pipes,
`metrics.progress = false`) a plain line is printed at every logged step.

    logger = MetricsLogger(run_dir, total_steps=300, start_step=0, progress=True)
    logger.log({"step": 10, "loss": 5.1, ...})
    logger.close()
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from dilocox.checkpoint import write_atomic

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf; a diverged loss is logged as null and reported by the trainer
    return value


def truncate_metrics(run_dir: Path, last_step: int) -> None:
    """Drop lines logged after `last_step` (a resumed run rewrites what the interrupted run logged past its
    checkpoint, so the file stays one line per step)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    write_atomic(path, "".join(line + "\n" for line in kept).encode())


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


class MetricsLogger:
    """Appends metric records to metrics.jsonl and shows progress on the launching terminal."""

    def __init__(self, run_dir: Path, *, total_steps: int, start_step: int = 0, progress: bool = True) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.file = open(self.path, "a")  # noqa: SIM115 - kept open for the run, closed in close()
        self.total_steps = total_steps
        self._progress = None
        if progress and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
            )
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, info="")
            self._progress.start()

    def log(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self.file.flush()
        info = f"loss {record['loss']:.3f}"
        if record.get("eval_loss") is not None:
            info += f"  eval {record['eval_loss']:.3f}"
        info += f"  {record['tokens_per_s']:,.0f} tok/s  wan {record['wan_bytes_sent'] / 1e6:,.1f} MB"
        if self._progress is not None:
            self._progress.update(self._task, completed=record["step"], info=info)
        else:
            print(f"step {record['step']:>6}/{self.total_steps}  outer {record['outer_step']:>4}  {info}", flush=True)

    def print(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        self.file.close()


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    write_atomic(
        Path(run_dir) / SUMMARY_FILE, json.dumps({k: _clean(v) for k, v in summary.items()}, indent=2).encode()
    )


def format_summary(s: dict[str, Any]) -> str:
    """A short human summary printed at the end of a run."""

    def fmt_bytes(n: float) -> str:
        for unit in ("B", "KB", "MB", "GB", "TB"):
            if abs(n) < 1000 or unit == "TB":
                return f"{n:,.1f} {unit}"
            n /= 1000
        return f"{n:,.1f} TB"

    ratio = s["allreduce_equiv_bytes"] / s["wan_bytes_total"] if s["wan_bytes_total"] else float("inf")
    first = s.get("initial_eval_loss")
    loss = f"{first:.3f} -> {s['final_eval_loss']:.3f}" if first is not None else f"{s['final_eval_loss']:.3f}"
    return "\n".join(
        [
            f"done: {s['sync_kind']} on {s['num_clusters']} clusters x dp {s['dp_degree']} x pp {s['pp_degree']}, "
            f"{s['steps']} steps, {s['outer_steps']} outer steps, link {s['bandwidth']} / {s['latency']}",
            f"  eval loss   {loss}   (perplexity {math.exp(min(s['final_eval_loss'], 50)):,.1f})",
            f"  throughput  {s['tokens']:,} tokens in {s['wall_s']:.1f} s = {s['tokens_per_s']:,.0f} tokens/s",
            f"  slow link   {fmt_bytes(s['wan_bytes_total'])} sent by all ranks; AllReduce would send "
            f"{fmt_bytes(s['allreduce_equiv_bytes'])} ({ratio:,.1f}x)",
            f"  link time   busy {s['link_busy_s']:.2f} s, trainer blocked {s['exposed_comm_s']:.2f} s (rank 0)"
            + (f", {100 * s['hidden_comm_fraction']:.0f}% hidden" if s.get("hidden_comm_fraction") is not None else ""),
            f"  run dir     {s['run_dir']}",
        ]
    )
