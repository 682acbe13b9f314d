"""How long a rank outlives its launcher after `kill -9` of the launcher (`dilocox train`, local ranks).

    python benchmarks/orphan_exit.py                        # 5 trials of the debug run, 2 ranks
    python benchmarks/orphan_exit.py --trials 10 --out benchmarks/results/orphan_exit

Each trial starts `dilocox train` on configs/debug.toml with a long `train.steps`, waits until it logs a step, finds
the ranks (the children of the launcher's fork server), opens a pidfd on each, SIGKILLs the launcher and takes the
time until each pidfd is readable (the rank exited): the number the docs bound ("ranks whose launcher was killed
exit within ..."). Prints one row per trial and the largest; writes results.md/results.json with --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _ranks(launcher: int) -> list[int]:
    servers = [pid for pid in _children(launcher) if "forkserver" in Path(f"/proc/{pid}/cmdline").read_text()]
    return [rank for server in servers for rank in _children(server)]


def trial(work: Path, index: int) -> list[float]:
    run_dir = work / f"run{index}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dilocox", "train", "--config", str(REPO / "configs" / "debug.toml"),
         f"--run.out_dir={run_dir}", "--train.steps=100000", "--metrics.log_interval=1", "--eval.interval=0",
         "--checkpoint.interval=0", "--metrics.progress=false"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended with {proc.returncode} before training")
        time.sleep(0.2)
    ranks = _ranks(proc.pid)
    handles = {os.pidfd_open(rank): rank for rank in ranks}
    killed = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    exits = []
    while handles:
        ready, _, _ = select.select(list(handles), [], [], 60)
        if not ready:
            raise RuntimeError(f"ranks {sorted(handles.values())} still alive 60 s after the launcher was killed")
        for handle in ready:
            exits.append(time.monotonic() - killed)
            os.close(handle)
            del handles[handle]
    return exits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows, load = [], os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="dilocox-orphans-") as work:
        for index in range(args.trials):
            exits = trial(Path(work), index)
            rows.append(exits)
            print(f"trial {index}: ranks exited {', '.join(f'{s * 1000:.0f} ms' for s in exits)} after the kill")
    worst = max(max(r) for r in rows)
    print(f"largest: {worst * 1000:.0f} ms over {args.trials} trials")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        record = {"when": when, "host": platform.node(), "cpus": os.cpu_count(), "load_average_1min": load}
        (args.out / "results.json").write_text(json.dumps({**record, "exits_s": rows}, indent=1))
        lines = [
            f"# Ranks after `kill -9` of their launcher ({when}, {os.cpu_count()} CPUs, load average {load:.1f})",
            "",
            "`python benchmarks/orphan_exit.py`: milliseconds from the launcher's SIGKILL to each rank's exit "
            "(debug config, 2 ranks).",
            "",
            "| trial | rank exits (ms) |",
            "| --- | --- |",
            *(f"| {i} | {', '.join(f'{s * 1000:.0f}' for s in r)} |" for i, r in enumerate(rows)),
            "",
            f"Largest: {worst * 1000:.0f} ms.",
        ]
        (args.out / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
