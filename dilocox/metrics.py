"""Metrics of a run: `metrics.jsonl` (one object per logged step), a progress bar, and `summary.json`.

Only rank 0 logs. The progress bar is drawn with rich when stdout is a terminal; otherwise (CI, pipes,
`metrics.progress = false`) a plain line is printed at every logged step. Optional sinks receive every numeric key
of each record with `step` as the x axis: TensorBoard event files in `RUN_DIR/tensorboard` (`metrics.tensorboard`)
and a Weights & Biases run in `RUN_DIR/wandb` (`metrics.wandb`).

    check_sinks(tensorboard=True, wandb="offline")        # before the run directory exists: a missing extra fails
    logger = MetricsLogger(run_dir, total_steps=300, start_step=0, progress=True, tensorboard=True)
    logger.log({"step": 10, "loss": 5.1, ...})
    logger.close()
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dilocox.fileio import write_atomic
from dilocox.net.link import parse_bandwidth

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
TENSORBOARD_DIR = "tensorboard"
"""TensorBoard event files of a run, under its run directory (`tensorboard --logdir RUN_DIR/tensorboard`)."""


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf; a diverged loss is logged as null and reported by the trainer
    return value


def truncate_metrics(run_dir: Path, last_step: int) -> None:
    """Drop lines logged after `last_step` (a resumed run rewrites what the interrupted run logged past its
    checkpoint, so the file stays one line per step), and a last line a killed run left half written."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return
    kept = [line for line, record in _complete_records(path) if record["step"] <= last_step]
    write_atomic(path, "".join(line + "\n" for line in kept).encode())


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl, also while the run is writing it (`dilocox plot` of a live run)."""
    path = Path(run_dir) / METRICS_FILE
    return [record for _, record in _complete_records(path)] if path.exists() else []


def _complete_records(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(line, record) for every complete line of a metrics.jsonl. The text after the last newline is a record still
    being written, or one a killed run tore, and is left out; a complete line that is not JSON is an error."""
    records = []
    for number, line in enumerate(path.read_text().split("\n")[:-1], start=1):
        if not line.strip():
            continue
        try:
            records.append((line, json.loads(line)))
        except ValueError as err:
            raise ValueError(
                f"{path} line {number} is not a metrics record ({err}): the file was edited or damaged; remove that "
                "line, or the file (the run's summary.json and checkpoints do not depend on it)"
            ) from None
    return records


def numeric_items(record: dict[str, Any]) -> dict[str, float]:
    """The keys of a metrics record that the sinks plot: finite numbers (not bools); strings and None are skipped."""
    return {
        key: value
        for key, value in record.items()
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    }


def _missing_extra(option: str, package: str, extra: str) -> ValueError:
    return ValueError(f"{option} needs the {package} package, which is not installed: pip install 'dilocox[{extra}]'")


def check_sinks(*, tensorboard: bool, wandb: str) -> None:
    """Raise ValueError when an enabled sink cannot work here: its package is missing (naming the extra to install),
    or `wandb = online` without W&B credentials. Run before the run directory is created; touches no network."""
    if tensorboard:
        try:
            importlib.import_module("tensorboard")  # torch.utils.tensorboard needs it; torch does not require it
            importlib.import_module("torch.utils.tensorboard")
        except ImportError:
            raise _missing_extra("metrics.tensorboard = true", "tensorboard", "tensorboard") from None
    if wandb == "off":
        return
    try:
        import wandb as wb
    except ImportError:
        raise _missing_extra(f"metrics.wandb = {wandb}", "wandb", "wandb") from None
    if wandb == "online":
        # Credentials from WANDB_API_KEY, a settings file or ~/.netrc (what `wandb login` writes); silent, so that
        # wandb does not ask the server for the user name, and no prompt: this may run without a terminal.
        wb.setup(wb.Settings(silent=True))
        try:
            logged_in = wb.login(verify=False, prompt=False)
        finally:
            wb.teardown()
        if not logged_in:
            raise ValueError(
                "metrics.wandb = online needs a W&B login: run `wandb login` (or set WANDB_API_KEY) first, or use "
                "--metrics.wandb=offline and upload later with `wandb sync RUN_DIR/wandb/offline-run-*`"
            )


class TensorBoardSink:
    """Every numeric key of each record as a TensorBoard scalar at `step`, in `RUN_DIR/tensorboard`.

    A resumed run purges what the interrupted run wrote after its checkpoint (`purge_step`), as metrics.jsonl does."""

    def __init__(self, run_dir: Path, *, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge_step = start_step + 1 if start_step else None  # steps the resumed run logs again are replaced
        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / TENSORBOARD_DIR), purge_step=purge_step)

    def log(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for key, value in numeric_items(record).items():
            if key != "step":
                self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()  # a crashed run keeps what it logged

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Every numeric key of each record, logged to a W&B run at `step`, with the run's files in `RUN_DIR/wandb`.

    `mode` is offline (written locally, no network; `wandb sync` uploads it later) or online (needs `wandb login`).
    The project is `WANDB_PROJECT`, else "dilocox"; the run is named after the run directory and carries the
    resolved config. W&B's console capture is off (dilocox prints its own progress). A resumed run is a new W&B run
    that starts at the checkpoint's step."""

    def __init__(self, run_dir: Path, *, mode: str, config: dict[str, Any] | None, start_step: int) -> None:
        import wandb

        run_dir = Path(run_dir).resolve()
        name = run_dir.name if start_step == 0 else f"{run_dir.name} (resumed at step {start_step})"
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "dilocox"),
            name=name,
            group=run_dir.name,
            dir=str(run_dir),
            mode=mode,
            config=config,
            settings=wandb.Settings(console="off", disable_git=True, save_code=False),
        )

    def log(self, record: dict[str, Any]) -> None:
        values = numeric_items(record)
        step = values.pop("step")
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class MetricsLogger:
    """Appends metric records to metrics.jsonl (and the enabled sinks) and shows progress on the launching
    terminal."""

    def __init__(
        self,
        run_dir: Path,
        *,
        total_steps: int,
        start_step: int = 0,
        progress: bool = True,
        tensorboard: bool = False,
        wandb: str = "off",
        config: dict[str, Any] | None = None,
    ) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.file = open(self.path, "a")  # noqa: SIM115 - kept open for the run, closed in close()
        self.total_steps = total_steps
        self.sinks: list[TensorBoardSink | WandbSink] = []
        if tensorboard:
            self.sinks.append(TensorBoardSink(run_dir, start_step=start_step))
        if wandb != "off":
            self.sinks.append(WandbSink(run_dir, mode=wandb, config=config, start_step=start_step))
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
        for sink in self.sinks:
            sink.log(record)
        info = f"loss {record['loss']:.3f}"
        if record.get("eval_loss") is not None:
            info += f"  eval {record['eval_loss']:.3f}"
        info += f"  {record['tokens_per_s']:,.0f} tok/s  wan {record['wan_bytes_sent'] / 1e6:,.1f} MB"
        if self._progress is not None:
            self._progress.update(self._task, completed=record["step"], info=info)
        else:
            print(f"step {record['step']:>6}/{self.total_steps}  outer {record['outer_step']:>4}  {info}", flush=True)

    def log_event(self, record: dict[str, Any]) -> None:
        """An event record (`event` names its kind, e.g. an elastic run's membership change): metrics.jsonl only, not
        the sinks' scalars nor the progress line."""
        self.file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self.file.flush()

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
        while self.sinks:
            self.sinks.pop().close()


@dataclass
class RunSummary:
    """The result of a run, written by rank 0 to `summary.json` and read back by `RunSummary.read` (the bench)."""

    final_eval_loss: float | None
    """Validation loss at the end, of the model every cluster holds after the flush (eval.final_max_batches)."""
    initial_eval_loss: float | None
    """Validation loss before the first step."""
    tokens: int
    """Training tokens of all ranks."""
    wall_s: float
    """Seconds of training, evaluation included, across resumes."""
    tokens_per_s: float
    """tokens / (wall_s - eval_s)."""
    eval_s: float
    """Seconds rank 0 spent evaluating during training."""
    wan_bytes_total: int
    """Bytes the ranks of `wan_bytes_clusters` put on the slow link (all ranks of a static run)."""
    allreduce_equiv_bytes: int
    """Bytes an AllReduce run of the same steps would have put on it from the same ranks (every strategy's
    yardstick)."""
    link_busy_s: float
    """Link time of rank 0's transfers."""
    exposed_comm_s: float
    """Time rank 0 was blocked waiting for the link to deliver (the communication training did not hide)."""
    hidden_comm_fraction: float | None
    """1 - exposed / busy, in [0, 1]; None when nothing crossed the link."""
    steps: int
    outer_steps: int
    sync_kind: str
    sync_delay: int
    merge: str
    inner_steps: int
    """The configured H."""
    final_inner_steps: int
    """H of the last round (sync.round.fit_link may raise it)."""
    flavor: str
    num_params: int
    rank_state_bytes: list[dict[str, int]]
    """Every rank's training state bytes (params, grads, inner and outer state)."""
    num_clusters: int
    dp_degree: int
    pp_degree: int
    bandwidth: str
    latency: str
    checkpoint: str | None
    """The newest checkpoint directory."""
    run_dir: str
    final_eval_tokens: int = 0
    """Tokens scored by the final evaluation (0 in summaries written before it was recorded)."""
    run_seed: int = 0
    """run.seed: the initial weights, the data order and the codecs' random draws."""
    split_seed: int | None = None
    """The seed of the held-out split the evals scored (data.split_seed, or run.seed where that is -1); None in
    summaries written before it was recorded, which scored run.seed's split."""
    guard_excluded_updates: int = 0
    """sync.guard: clusters' updates left out of a mean, summed over rounds and the final drain (judged alike by
    every rank of every cluster)."""
    guard_skipped_rounds: int = 0
    """sync.guard: rounds without a usable mean, whose outer step was skipped (stage 0)."""
    payloads_rejected: int = 0
    """Slow-link payloads all ranks dropped because their HMAC tag did not verify (network.auth_key_file)."""
    peak_in_flight_bytes: int = 0
    """The most payload bytes any one rank had launched on the slow link and not yet delivered at one time
    (`WanChannel.peak_in_flight_bytes`; 0 in summaries written before it was recorded)."""
    fragments: int = 1
    """sync.fragments: the parts each stage's outer sync is streamed in."""
    peer_wait_s: float = 0.0
    """Time rank 0 was blocked after the link had delivered, waiting for a cluster that sent late (a straggler, a
    slower or busier cluster: not the link; 0 in summaries written before it was recorded)."""
    cluster_tokens: list[int] | None = None
    """Each cluster's training tokens (its own steps x its tokens per step; they differ with sync.round.mode = time);
    None in an elastic run's summary and in summaries written before it was recorded."""
    cluster_train_s: list[float] | None = None
    """Each cluster's training seconds, its first rank's: its inner steps only, without evaluations, checkpoints
    and waits at round boundaries (a cluster's own speed is its tokens over these)."""
    wan_bytes_clusters: list[int] | None = None
    """The clusters whose ranks the byte counts cover: None for every cluster (a static run). An elastic run's
    clusters are separate worlds that never pool their counters, so its summary counts the ranks of the cluster
    that wrote it ([0])."""
    dp_degrees: list[int] | None = None
    """Each cluster's data-parallel degree where they differ (topology.clusters; `dp_degree` is then the largest);
    None for clusters of one shape."""
    checkpoint_s: float = 0.0
    """Seconds rank 0's training waited for checkpoints in its last process (with checkpoint.async_save: copying the
    state and the previous save; 0 in summaries written before it was recorded)."""

    def write(self, run_dir: Path) -> None:
        data = {k: _clean(v) for k, v in dataclasses.asdict(self).items()}
        write_atomic(Path(run_dir) / SUMMARY_FILE, json.dumps(data, indent=2).encode())

    @classmethod
    def read(cls, run_dir: Path) -> RunSummary:
        """The summary of a finished run (ValueError when the run did not finish or wrote another layout)."""
        path = Path(run_dir) / SUMMARY_FILE
        if not path.is_file():
            raise ValueError(f"{run_dir} has no {SUMMARY_FILE}: the run did not finish (see its output)")
        data = json.loads(path.read_text())
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise ValueError(f"{path} lacks {', '.join(missing)}: written by another dilocox version; run it again")
        return cls(**{name: data[name] for name in names & set(data)})


def format_summary(s: RunSummary) -> str:
    """A short human summary printed at the end of a run."""

    def fmt_bytes(n: float) -> str:
        for unit in ("B", "KB", "MB", "GB", "TB"):
            if abs(n) < 1000 or unit == "TB":
                return f"{n:,.1f} {unit}"
            n /= 1000
        return f"{n:,.1f} TB"

    # an unlimited link is not emulated: its latency is not applied either
    link = f"{s.bandwidth} / {s.latency}" if parse_bandwidth(s.bandwidth) is not None else "unlimited (not emulated)"
    ratio = s.allreduce_equiv_bytes / s.wan_bytes_total if s.wan_bytes_total else float("inf")
    versus = f"{ratio:,.1f}x" if s.allreduce_equiv_bytes else "one cluster: no slow link"
    senders, scope = "all ranks", ""
    if s.wan_bytes_clusters is not None:
        names = ", ".join(str(c) for c in s.wan_bytes_clusters)
        senders = f"cluster {names}'s ranks" if len(s.wan_bytes_clusters) == 1 else f"the ranks of clusters {names}"
        scope = f"; an elastic run counts each cluster alone, not all {s.num_clusters}"
    first = s.initial_eval_loss
    shape = f"dp {s.dp_degree}" if s.dp_degrees is None else f"dp {', '.join(map(str, s.dp_degrees))}"
    loss = f"{first:.3f} -> {s.final_eval_loss:.3f}" if first is not None else f"{s.final_eval_loss:.3f}"
    return "\n".join(
        [
            f"done: {s.sync_kind} on {s.num_clusters} clusters x {shape} x pp {s.pp_degree}, "
            f"{s.steps} steps, {s.outer_steps} outer steps, link {link}",
            f"  eval loss   {loss}   (perplexity {math.exp(min(s.final_eval_loss, 50)):,.1f})",
            f"  throughput  {s.tokens:,} tokens in {s.wall_s:.1f} s = {s.tokens_per_s:,.0f} tokens/s",
            f"  slow link   {fmt_bytes(s.wan_bytes_total)} sent by {senders}; AllReduce would send "
            f"{fmt_bytes(s.allreduce_equiv_bytes)} ({versus}{scope})",
            f"  link time   busy {s.link_busy_s:.2f} s; rank 0 waited {s.exposed_comm_s:.2f} s for the link"
            + (f" ({100 * s.hidden_comm_fraction:.0f}% hidden)" if s.hidden_comm_fraction is not None else "")
            + f" and {s.peer_wait_s:.2f} s for other clusters"
            + (f"; at most {fmt_bytes(s.peak_in_flight_bytes)} in flight per rank" if s.peak_in_flight_bytes else "")
            + (f" ({s.fragments} fragments per stage)" if s.fragments > 1 else ""),
        ]
        + (
            [
                f"  guard       {s.guard_excluded_updates} cluster updates left out, {s.guard_skipped_rounds} "
                "rounds without an outer step (see the guard lines above)"
            ]
            if s.guard_excluded_updates or s.guard_skipped_rounds
            else []
        )
        + (
            [f"  rejected    {s.payloads_rejected:,} slow-link payloads whose tag did not verify (see the warnings)"]
            if s.payloads_rejected
            else []
        )
        + [f"  run dir     {s.run_dir}"]
        + [
            "  compare     the same setting with --preset diloco (blocking DiLoCo), allreduce or cocktail"
            if s.sync_kind == "dilocox"
            else "  compare     the same setting with --preset dilocox (DiLoCoX: the sync hidden, compressed)"
        ]
    )
