"""Memory soak: RSS, open file descriptors and threads of every rank over thousands of outer rounds.

    python benchmarks/memory_soak.py                                   # 2,400 rounds, about 18 minutes on 2 busy cores
    python benchmarks/memory_soak.py --steps 600 --warmup 200 --out /tmp/memsoak   # a quicker look

One `dilocox train` run of configs/debug.toml with the dilocox-lowrank preset (the adaptive codec with error
feedback, the one-step delay), H = 1 so that every step is an outer round, 3 clusters of one rank each, the link off
(`network.bandwidth = unlimited`), one thread per rank and a checkpoint every 250 rounds (`checkpoint.keep = 2`).
While it trains this samples, every `--interval` seconds, each rank's resident set size (VmRSS), its open file
descriptors (/proc/PID/fd) and its threads, with the step the run has logged, and the size of every rank's file in
each checkpoint as it appears. After a warm-up of `--warmup` rounds it fits a least-squares line to each series
against the round and reports the slope per 1,000 rounds with its standard error (samples are autocorrelated, so
the error is a lower bound), for all the rounds after the warm-up and for their second half, and the growth of the
checkpoint files per round. Goal: flat within noise, i.e. memory that does not grow with the number of rounds.

Writes `results.json` (every sample and the fits) and `results.md` (the table) to `--out`
(default benchmarks/results/memory_soak/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from soak import rank_pids  # noqa: E402  (the rank processes below a launcher, rank 0 first)

from dilocox.checkpoint import load_rank_state, read_meta  # noqa: E402

STEP_LINE = re.compile(r"^step\s+(\d+)/(\d+)")
PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024


def command(run_dir: Path, args: argparse.Namespace) -> list[str]:
    return [
        sys.executable, "-m", "dilocox", "train", "--config", "configs/debug.toml",
        f"--run.out_dir={run_dir}", "--run.num_threads=1", "--preset=dilocox-lowrank",
        f"--sync.inner_steps={args.inner_steps}", f"--topology.num_clusters={args.clusters}",
        f"--train.steps={args.steps}", "--network.bandwidth=unlimited", "--network.latency=0",
        "--eval.interval=0", "--eval.final_max_batches=4", f"--checkpoint.interval={args.checkpoint_interval}",
        "--checkpoint.keep=2", "--checkpoint.resume=", "--metrics.log_interval=100", "--metrics.progress=false",
    ]  # fmt: skip


def proc_sample(pid: int) -> dict[str, int] | None:
    """VmRSS (kB), open file descriptors and threads of a live process, None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if "VmRSS" not in fields:  # a zombie: it has exited
        return None
    return {
        "rss_kb": int(fields["VmRSS"].split()[0]),
        "fds": fds,
        "threads": int(fields["Threads"].strip()),
    }


def fit(xs: list[float], ys: list[float]) -> dict[str, float] | None:
    """Least-squares slope of ys against xs, its standard error and the residual standard deviation."""
    n = len(xs)
    if n < 3:
        return None
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if sxx == 0:
        return None
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sxx
    residuals = [y - mean_y - slope * (x - mean_x) for x, y in zip(xs, ys, strict=True)]
    sigma = math.sqrt(sum(r * r for r in residuals) / (n - 2))
    return {"slope": slope, "slope_se": sigma / math.sqrt(sxx), "residual_sd": sigma, "n": n}


class Run:
    """The training run in the background; a thread keeps the newest step it logged."""

    def __init__(self, cmd: list[str], log: Path) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.log = open(log, "w")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            start_new_session=True,
        )  # fmt: skip
        self.step = 0
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.write(line)
            match = STEP_LINE.match(line)
            if match:
                self.step = int(match.group(1))

    def wait(self) -> int:
        code = self.proc.wait()
        self.reader.join(timeout=10)
        self.log.close()
        return code


def checkpoint_sizes(run_dir: Path, seen: dict[int, dict[str, dict[str, int]]]) -> None:
    """Add the per-rank file size and the adaptive-rank policy's state size (bytes of its tensors) of every complete
    checkpoint not seen yet (they are pruned as the run goes)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return
    for path in root.glob("step_*"):
        step = int(path.name.split("_")[1])
        if step in seen or not (path / "meta.json").is_file():
            continue
        try:
            sizes = {}
            for rank in range(read_meta(path)["world_size"]):
                file = path / f"__{rank}_0.distcp"  # what the rank wrote (docs/design.md, checkpoints)
                state = load_rank_state(path, rank)
                sizes[file.name] = {"file": file.stat().st_size, "policy": _tensor_bytes(_find(state, "policy"))}
            seen[step] = sizes
        except (OSError, RuntimeError, EOFError):  # pruned while read
            continue


def _find(state: object, key: str) -> object:
    """The first value under `key` in nested dicts, None when there is none."""
    if isinstance(state, dict):
        if key in state:
            return state[key]
        for value in state.values():
            found = _find(value, key)
            if found is not None:
                return found
    return None


def _tensor_bytes(state: object) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_tensor_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(_tensor_bytes(v) for v in state)
    return 0


def soak(args: argparse.Namespace, work: Path) -> dict:
    run_dir = work / "run"
    cmd = command(run_dir, args)
    run = Run(cmd, work / "train.log")
    samples: list[dict] = []
    checkpoints: dict[int, dict[str, int]] = {}
    started = time.monotonic()
    try:
        code = _sample(run, args, run_dir, samples, checkpoints)
    finally:
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGTERM)
            run.wait()
    if code != 0:
        raise SystemExit(f"the run failed with exit status {code}; see {work / 'train.log'}")
    return {
        "command": " ".join(cmd[1:]).replace(str(run_dir), "RUN_DIR"),
        "wall_s": round(time.monotonic() - started, 1),
        "samples": samples,
        "checkpoint_bytes": {str(step): sizes for step, sizes in sorted(checkpoints.items())},
    }


def _sample(run: Run, args: argparse.Namespace, run_dir: Path, samples: list[dict], checkpoints: dict) -> int:
    """Sample the ranks until the run ends; returns its exit status."""
    started = time.monotonic()
    pids: list[int] = []
    num_ranks = args.clusters
    while run.proc.poll() is None:
        time.sleep(args.interval)
        if len(pids) < num_ranks:
            pids = rank_pids(run.proc.pid)
            if len(pids) < num_ranks:
                continue
        step = run.step
        ranks = [proc_sample(pid) for pid in pids]
        checkpoint_sizes(run_dir, checkpoints)
        if any(r is None for r in ranks) or step >= args.steps or step == 0:
            continue  # the run is ending (final flush, evaluation), or has not started training
        samples.append({"t": round(time.monotonic() - started, 2), "step": step, "ranks": ranks})
    code = run.wait()
    checkpoint_sizes(run_dir, checkpoints)
    return code


def analyse(result: dict, args: argparse.Namespace) -> dict:
    h = args.inner_steps
    samples = [s for s in result["samples"] if s["step"] / h >= args.warmup]
    last = max((s["step"] / h for s in samples), default=args.warmup)
    halfway = args.warmup + (last - args.warmup) / 2
    fits: dict[str, list[dict]] = {}
    for rank in range(args.clusters):
        rows = []
        late = [s for s in samples if s["step"] / h >= halfway]
        for span, chosen in (("after warm-up", samples), ("second half", late)):
            xs = [s["step"] / h / 1000 for s in chosen]  # thousands of rounds
            row: dict = {"span": span, "samples": len(chosen)}
            for key, scale in (("rss_kb", 1 / 1024), ("fds", 1), ("threads", 1)):
                row[key] = fit(xs, [s["ranks"][rank][key] * scale for s in chosen])
            if chosen:
                row["rss_mb_first"] = round(chosen[0]["ranks"][rank]["rss_kb"] / 1024, 1)
                row["rss_mb_last"] = round(chosen[-1]["ranks"][rank]["rss_kb"] / 1024, 1)
                row["rounds"] = [chosen[0]["step"] / h, chosen[-1]["step"] / h]
            rows.append(row)
        fits[str(rank)] = rows
    growth: dict[str, dict] = {}
    # the last checkpoint is written after the final flush (no sync in flight): not a round like the others
    steps = sorted(int(s) for s in result["checkpoint_bytes"] if int(s) < args.steps)
    for name in sorted({n for sizes in result["checkpoint_bytes"].values() for n in sizes}):
        growth[name] = {}
        for part in ("file", "policy"):
            points = [(step / h, result["checkpoint_bytes"][str(step)].get(name)) for step in steps]
            points = [(x, y[part]) for x, y in points if y is not None]
            growth[name][part] = fit([x for x, _ in points], [float(y) for _, y in points])
    return {"rss_fds_threads": fits, "checkpoint_bytes_per_round": growth}


def table(result: dict, args: argparse.Namespace) -> str:
    fits = result["fits"]["rss_fds_threads"]
    lines = [
        f"# Memory soak: {args.steps // args.inner_steps:,} outer rounds",
        "",
        f"`python benchmarks/memory_soak.py --steps {args.steps} --inner-steps {args.inner_steps} --clusters "
        f"{args.clusters} --warmup {args.warmup}` on {result['date']}, {result['machine']} "
        f"({result['wall_s']:.0f} s). The run: `{result['command']}`.",
        "",
        f"Least-squares slope per 1,000 rounds after a warm-up of {args.warmup} rounds (± its standard error; the "
        "samples are autocorrelated, so it is a lower bound), over all the rounds after the warm-up and over their "
        "second half:",
        "",
        "| rank | span | samples | RSS first -> last (MB) | RSS MB / 1k rounds | fds / 1k rounds "
        "| threads / 1k rounds |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: |",
    ]

    def cell(f: dict | None, digits: int) -> str:
        return "-" if f is None else f"{f['slope']:+.{digits}f} ± {f['slope_se']:.{digits}f}"

    for rank, rows in fits.items():
        for row in rows:
            lines.append(
                f"| {rank} | {row['span']} | {row['samples']} | {row.get('rss_mb_first', '-')} -> "
                f"{row.get('rss_mb_last', '-')} | {cell(row['rss_kb'], 2)} | {cell(row['fds'], 2)} | "
                f"{cell(row['threads'], 2)} |"
            )
    lines += [
        "",
        "Each rank's checkpoint file and the adaptive-rank policy's state in it (bytes of its tensors) at every "
        "checkpoint before the last (written after the final flush), and their least-squares growth per round:",
        "",
    ]
    growth = result["fits"]["checkpoint_bytes_per_round"]
    steps = [s for s in result["checkpoint_bytes"] if int(s) < args.steps]
    rounds = " | ".join(f"round {int(s) // args.inner_steps}" for s in steps)
    lines.append(f"| file | part | {rounds} | bytes / round |")
    lines.append("| --- | --- | " + " | ".join("---:" for _ in steps) + " | ---: |")
    for name, parts in growth.items():
        for part, g in parts.items():
            sizes = [result["checkpoint_bytes"][s].get(name, {}).get(part) for s in steps]
            slope = "-" if g is None else f"{g['slope']:+.1f}"
            cells = " | ".join("-" if v is None else f"{v:,}" for v in sizes)
            lines.append(f"| {name} | {part} | {cells} | {slope} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2400, help="inner steps of the run (rounds = steps / H)")
    parser.add_argument("--inner-steps", type=int, default=1, help="H")
    parser.add_argument("--clusters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=400, help="rounds left out of the fits")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--checkpoint-interval", type=int, default=250, help="steps between checkpoints")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "memory_soak")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="memory_soak_"))
    try:
        result = soak(args, work)
        result["date"] = datetime.date.today().isoformat()
        result["machine"] = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
        result["args"] = {k: str(v) for k, v in vars(args).items()}
        result["fits"] = analyse(result, args)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(result) + "\n")  # one line: a sample every few seconds
        text = table(result, args)
        (args.out / "results.md").write_text(text)
        print(text)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
