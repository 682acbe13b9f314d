"""Soak: 20 injected faults of mixed kinds in one long run of the real CLI, not in the default suite.

    python benchmarks/soak.py                                   # about 8 minutes on 2 cores, writes the results
    python benchmarks/soak.py --process-only --reuse-clean --out benchmarks/results/soak/process_only
    python benchmarks/soak.py --steps 400 --faults 10 --out /tmp/soak --skip-clean   # a quicker look

One `dilocox train` run (configs/debug.toml, 3 clusters, the dilocox-lowrank preset, H = 10, a checkpoint every round,
`checkpoint.resume = auto`, link off, `network.stall_timeout = 5s`) is broken again and again on a seeded schedule.
The run is cut into segments; each segment is the same command, re-launched in the same run directory, and carries

- one **numeric fault** on its command line (`--faults.kind=nan|scale|random|sign|diverge --faults.cluster=K
  --faults.rounds=R`, R one to three rounds after the segment's resume point), which the guard should leave out
  (nan, scale, diverge; sign and random are finite lies of normal size that the guard cannot see by design,
  docs/design.md §4.5: they are recorded as absorbed), and then
- one **process fault**, injected by this script at a seeded step one to three rounds after the checkpoint that
  records the numeric fault's exclusion, plus a seeded delay of up to 0.3 s (so some land inside a checkpoint
  save): SIGKILL a rank, SIGSTOP a rank (the watchdog must name it, every rank exits 4), SIGKILL or SIGTERM the
  launcher (its ranks must die with it), or SIGKILL a rank and flip one bit of the newest checkpoint before the
  re-launch (the resume must fall back to the one before; this fault loses a round more by construction).

The last segment has no fault and trains to the end. Measured per fault: work lost (process faults: the newest step
the segment logged minus the step the next one resumed from; numeric: cluster updates left out), the recovery time
(fault to the first step of the re-launched run) and the time until the run is back at the step it had reached.
Checked (a failed check is a bug, and the script exits 1 after writing the results): no process of a stopped run
survives, every re-launch resumes from the newest checkpoint that verifies (only the one corrupted on purpose may be
skipped), every checkpoint that was complete still verifies, no process fault loses more than one round (two for
the corrupted checkpoint), the guard leaves out every nan, scale and diverge fault, and the run finishes. A clean
run of the same command (no faults) gives the final eval loss to compare with.

Rank pids are the children of the launcher's fork server, in start order (the launcher starts rank 0 first);
the SIGSTOP fault checks the order, since the watchdog names the rank it stopped. `--process-only` leaves the numeric
faults out: resume is exact, so the final loss must then equal the clean run's (checked).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # audit checkpoints with the code of this tree, the one the runs train with

from dilocox.checkpoint import CorruptCheckpoint, list_checkpoints, verify_checkpoint  # noqa: E402

H = 10
PROCESS_KINDS = ("kill_rank", "stop_rank", "kill_launcher", "term_launcher", "corrupt_checkpoint")
NUMERIC_KINDS = ("nan", "scale", "random", "sign", "diverge")
GUARDED_KINDS = ("nan", "scale", "diverge")
"""Numeric faults the guard must leave out; sign and random change a finite update without changing its size."""
EXPECTED_EXIT = {"kill_rank": 1, "corrupt_checkpoint": 1, "stop_rank": 4, "kill_launcher": -9, "term_launcher": 143}
"""The launcher's exit status after each process fault (Popen: -9 = killed by SIGKILL)."""
ORPHAN_WAIT_S = 15.0
"""How long a stopped run's processes may take to disappear before one is called an orphan."""
STEP_LINE = re.compile(r"^step\s+(\d+)/(\d+)")
RESUME_LINE = re.compile(r"resuming from (\S+)")
STALL_LINE = re.compile(r"rank (\d+) \(cluster \d+, dp \d+, pp \d+\) has not sent a heartbeat")
GUARD_LINE = re.compile(r"guard: round (\d+): cluster (\d+)'s update left out \((.*)\)")


# ------------------------------------------------------------------------------------------------ processes
def _stat(pid: int) -> tuple[int, str, int] | None:
    """(ppid, state, start time in clock ticks) of a live process, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
    return int(fields[1]), fields[0], int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """{pid: start time} of every live process below `root` (not `root` itself)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and stat[1] != "Z":
                children.setdefault(stat[0], []).append(int(entry))
                starts[int(entry)] = stat[2]
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = starts[child]
            todo.append(child)
    return found


def rank_pids(launcher: int) -> list[int]:
    """The launcher's rank processes in start order: rank 0 first."""
    ranks = []
    for pid, start in descendants(launcher).items():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        stat = _stat(pid)
        # forked ranks keep the fork server's command line; the server itself is the launcher's child
        if b"forkserver" in cmdline and stat is not None and stat[0] != launcher:
            ranks.append((start, pid))
    return [pid for _, pid in sorted(ranks)]


def alive(processes: dict[int, int]) -> list[int]:
    """The processes of `processes` ({pid: start time}) still running (a zombie is dead; a reused pid is not ours)."""
    survivors = []
    for pid, start in processes.items():
        stat = _stat(pid)
        if stat is not None and stat[1] != "Z" and stat[2] == start:
            survivors.append(pid)
    return survivors


class Segment:
    """One launch of the run's command; a thread timestamps every line it prints into `lines` and the log."""

    def __init__(self, command: list[str], log: Path) -> None:
        self.log = open(log, "w")  # noqa: SIM115 - closed in wait()
        self.started = time.monotonic()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # its own session, so a stray terminal signal reaches only this script; faults go to chosen pids only
        self.proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            start_new_session=True,
        )  # fmt: skip
        self.lines: list[tuple[float, str]] = []
        self.steps: list[tuple[float, int]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            now = time.monotonic()
            self.log.write(line)
            self.lines.append((now, line.rstrip("\n")))
            match = STEP_LINE.match(line)
            if match:
                self.steps.append((now, int(match.group(1))))

    def newest_step(self) -> int | None:
        return self.steps[-1][1] if self.steps else None

    def wait_for_step(self, step: int, timeout_s: float) -> bool:
        """Until the run has logged `step` or later; False when it exited or the time ran out first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            newest = self.newest_step()
            if newest is not None and newest >= step:
                return True
            if self.proc.poll() is not None:
                self.reader.join(timeout=5)
                newest = self.newest_step()
                return newest is not None and newest >= step
            time.sleep(0.02)
        return False

    def wait(self, timeout_s: float) -> int | None:
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        self.reader.join(timeout=10)
        self.log.close()
        return code

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def first_step_time(self) -> float | None:
        return self.steps[0][0] if self.steps else None

    def time_at_step(self, step: int) -> float | None:
        """When the run first logged a step after `step`."""
        return next((t for t, s in self.steps if s > step), None)


# ------------------------------------------------------------------------------------------------ schedule
@dataclass
class Fault:
    index: int
    kind: str
    family: str  # process or numeric
    segment: int
    target: int | None = None  # the cluster (numeric) or the rank (process)
    round: int | None = None  # numeric: the 1-based round the cluster misbehaves in
    at_step: int | None = None  # process: injected once the run logs this step
    delay_s: float = 0.0  # process: and this long after
    # measured
    fault_step: int | None = None  # process: the newest step logged when the signal was sent
    newest_step: int | None = None  # process: the newest step the segment logged (it may go on briefly)
    resumed_step: int | None = None  # process: where the next segment resumed
    expected_resume_step: int | None = None
    lost_steps: int | None = None
    lost_rounds: float | None = None
    recovery_s: float | None = None  # fault to the first step of the re-launched run
    regain_s: float | None = None  # fault to the re-launched run logging a step past `newest_step`
    exit_code: int | None = None
    orphans: list[int] = field(default_factory=list)
    stopped_within_s: float | None = None  # every process of the run gone this long after the fault
    named: str | None = None  # stop_rank: the watchdog's line
    corrupted: str | None = None  # corrupt_checkpoint: the file and bit flipped
    excluded: bool | None = None  # numeric: the guard left the update out
    guard_line: str | None = None
    excluded_at_step: int | None = None
    problems: list[str] = field(default_factory=list)


def schedule(num_faults: int, *, seed: int, clusters: int) -> list[Fault]:
    """Half numeric, half process faults; segment i carries numeric fault i, then process fault i. The kinds of
    each family repeat in equal shares (one corrupted checkpoint at most) and are shuffled by the seed."""
    rng = random.Random(seed)
    segments = num_faults // 2
    process = ["corrupt_checkpoint"] + [PROCESS_KINDS[i % 4] for i in range(segments - 1)]
    numeric = [NUMERIC_KINDS[i % 5] for i in range(segments)]
    rng.shuffle(process)
    rng.shuffle(numeric)
    faults = []
    for segment in range(segments):
        faults.append(Fault(len(faults) + 1, numeric[segment], "numeric", segment, target=rng.randrange(clusters)))
        faults.append(
            Fault(
                len(faults) + 1,
                process[segment],
                "process",
                segment,
                target=rng.randrange(clusters),  # one rank per cluster here; unused by the launcher faults
                delay_s=round(rng.uniform(0.0, 0.3), 3),
            )
        )
    return faults


def place(numeric: Fault, process: Fault, resume_step: int, rng: random.Random) -> None:
    """Choose the rounds and steps of a segment's faults from where it resumed (known only at run time)."""
    resume_round = resume_step // H
    numeric.round = resume_round + 1 + rng.randint(1, 3)
    # the exclusion of round R is judged at the end of round R + 1 (one-step delay) and checkpointed there
    process.at_step = (numeric.round + 1) * H + rng.randint(1, 3 * H)
    if process.kind == "corrupt_checkpoint":  # the checkpoint before the corrupted one must hold the exclusion
        process.at_step = (numeric.round + 2) * H + rng.randint(1, 2 * H)


# ------------------------------------------------------------------------------------------------ checkpoints
def audit_checkpoints(run_dir: Path, corrupted_on_purpose: set[str]) -> tuple[list[int], list[str]]:
    """(steps of the complete checkpoints that verify, problems of the others not corrupted on purpose)."""
    good, problems = [], []
    for path in list_checkpoints(run_dir):
        try:
            verify_checkpoint(path)
            good.append(int(path.name.split("_")[1]))
        except CorruptCheckpoint as exc:
            if str(path) not in corrupted_on_purpose:
                problems.append(str(exc))
    return good, problems


def flip_bit(run_dir: Path, rng: random.Random) -> str:
    """Flip one seeded bit of one file of the newest complete checkpoint (a rank's or DCP's index); returns what was
    flipped."""
    newest = list_checkpoints(run_dir)[-1]
    file = rng.choice(sorted([*newest.glob("*.distcp"), newest / ".metadata"]))
    offset = rng.randrange(file.stat().st_size)
    bit = rng.randrange(8)
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))
    return f"{file.relative_to(run_dir)} byte {offset:,} bit {bit}"


# ------------------------------------------------------------------------------------------------ the soak
def base_command(run_dir: Path, *, steps: int, clusters: int) -> list[str]:
    return [
        sys.executable, "-m", "dilocox", "train", "--config", "configs/debug.toml",
        "--preset=dilocox-lowrank", f"--topology.num_clusters={clusters}", f"--train.steps={steps}",
        "--train.warmup_steps=20", f"--sync.inner_steps={H}", f"--checkpoint.interval={H}",
        "--checkpoint.resume=auto", f"--run.out_dir={run_dir}",
        "--network.bandwidth=unlimited", "--network.latency=0",
        "--network.stall_timeout=5s", "--network.heartbeat=1s",
        "--eval.interval=100", "--metrics.log_interval=1",
    ]  # fmt: skip


def numeric_args(fault: Fault | None) -> list[str]:
    if fault is None:
        return ["--faults.kind=none"]
    return [f"--faults.kind={fault.kind}", f"--faults.cluster={fault.target}", f"--faults.rounds={fault.round}"]


def inject(fault: Fault, seg: Segment) -> tuple[float, dict[int, int]]:
    """Send the process fault; returns its time and the run's processes at that moment."""
    processes = {seg.proc.pid: _stat(seg.proc.pid)[2], **descendants(seg.proc.pid)}
    ranks = rank_pids(seg.proc.pid)
    time.sleep(fault.delay_s)
    fault.fault_step = seg.newest_step()
    if fault.kind in ("kill_rank", "corrupt_checkpoint"):
        os.kill(ranks[fault.target], signal.SIGKILL)
    elif fault.kind == "stop_rank":
        os.kill(ranks[fault.target], signal.SIGSTOP)
    elif fault.kind == "kill_launcher":
        os.kill(seg.proc.pid, signal.SIGKILL)
    elif fault.kind == "term_launcher":
        os.kill(seg.proc.pid, signal.SIGTERM)
    return time.monotonic(), processes


def wait_gone(processes: dict[int, int], since: float) -> tuple[list[int], float | None]:
    """Orphans left after ORPHAN_WAIT_S (killed then, they are ours) and when the last process went."""
    while time.monotonic() - since < ORPHAN_WAIT_S:
        if not alive(processes):
            return [], time.monotonic() - since
        time.sleep(0.05)
    survivors = alive(processes)
    for pid in survivors:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    return survivors, None


def check_numeric(fault: Fault, seg: Segment, run_dir: Path) -> None:
    """Whether the guard left the update out: its `guard:` line and round_excluded in metrics.jsonl."""
    for _, line in seg.lines:
        match = GUARD_LINE.search(line)
        if match and int(match.group(1)) == fault.round and int(match.group(2)) == fault.target:
            fault.guard_line = line.strip()
    judged_at = (fault.round + 1) * H  # the one-step delay: round R's update is judged at the end of round R + 1
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    record = next((r for r in records if r["step"] == judged_at and "round_excluded" in r), None)
    if record is None:
        fault.problems.append(f"no round record at step {judged_at} in metrics.jsonl (the segment stopped before it)")
        return
    fault.excluded = record["round_excluded"] >= 1 and fault.guard_line is not None
    fault.excluded_at_step = judged_at if fault.excluded else None
    if fault.kind in GUARDED_KINDS and not fault.excluded:
        fault.problems.append(f"the guard did not leave out cluster {fault.target}'s {fault.kind} update of round "
                              f"{fault.round} (round_excluded = {record['round_excluded']})")  # fmt: skip


def measure_recovery(fault: Fault, fault_time: float, seg: Segment, *, resumed: int, expected: int) -> None:
    """Work lost and recovery times of a process fault, from the segment re-launched after it."""
    fault.resumed_step, fault.expected_resume_step = resumed, expected
    fault.lost_steps = fault.newest_step - resumed
    fault.lost_rounds = fault.lost_steps / H
    first = seg.first_step_time()
    fault.recovery_s = round(first - fault_time, 2) if first else None
    if seg.time_at_step(fault.newest_step) is None:
        seg.wait_for_step(fault.newest_step + 1, timeout_s=120)
    regained = seg.time_at_step(fault.newest_step)
    fault.regain_s = round(regained - fault_time, 2) if regained else None
    if resumed != expected:
        fault.problems.append(
            f"resumed from step {resumed}, the newest verified checkpoint was step {expected}: a checkpoint was lost"
        )
    limit = 2 * H if fault.kind == "corrupt_checkpoint" else H
    if fault.lost_steps > limit:
        fault.problems.append(f"lost {fault.lost_steps} steps, more than {limit}")


def run_soak(args: argparse.Namespace, work: Path) -> dict:
    run_dir = work / "soak"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    command = base_command(run_dir, steps=args.steps, clusters=args.clusters)
    faults = schedule(args.faults, seed=args.seed, clusters=args.clusters)
    rng = random.Random(args.seed + 1)  # placement and corruption; the schedule has its own stream
    corrupted: set[str] = set()
    problems: list[str] = []
    segments = []
    soak_start = time.monotonic()
    expected_resume = 0  # the newest checkpoint that verifies: where the next segment must resume
    previous: Fault | None = None  # the last process fault, measured by the segment that follows it
    previous_time = 0.0
    num_segments = args.faults // 2 + 1
    for index in range(num_segments):
        last = index == num_segments - 1
        numeric = None if last else faults[2 * index]
        process = None if last else faults[2 * index + 1]
        if numeric is not None:
            place(numeric, process, expected_resume, rng)
            if process.at_step + 2 * H > args.steps:
                raise SystemExit(f"soak: --steps {args.steps} is too short for {args.faults} faults; raise it")
        injected = None if args.process_only else numeric
        seg = Segment(command + numeric_args(injected), logs / f"segment_{index:02d}.log")
        record = {"segment": index, "command": " ".join(command[2:] + numeric_args(injected))}
        # ---- the resume of the previous fault
        ok = seg.wait_for_step(expected_resume + 1, timeout_s=180)
        match = RESUME_LINE.search(seg.text())
        record["resumed_step"] = int(Path(match.group(1)).name.split("_")[1]) if match else 0
        if previous is not None:
            measure_recovery(previous, previous_time, seg, resumed=record["resumed_step"], expected=expected_resume)
        if not ok:
            seg.proc.kill()
            seg.wait(30)
            problems.append(f"segment {index} did not resume and train (see {seg.log.name}):\n{seg.text()[-2000:]}")
            break
        if last:
            code = seg.wait(timeout_s=1800)
            record["exit_code"] = code
            if code != 0:
                problems.append(f"the last segment exited with {code} (see {seg.log.name}):\n{seg.text()[-2000:]}")
            segments.append(record)
            break
        # ---- this segment's process fault
        if not seg.wait_for_step(process.at_step, timeout_s=600):
            seg.proc.kill()
            seg.wait(30)
            problems.append(f"segment {index} stopped before step {process.at_step}:\n{seg.text()[-2000:]}")
            break
        fault_time, processes = inject(process, seg)
        code = seg.wait(timeout_s=120)
        process.exit_code = code
        if code is None:
            process.problems.append("the launcher did not exit within 120 s of the fault")
            os.kill(seg.proc.pid, signal.SIGKILL)
            seg.wait(30)
        process.orphans, gone = wait_gone(processes, fault_time)
        process.stopped_within_s = round(gone, 2) if gone is not None else None
        if process.orphans:
            process.problems.append(f"processes {process.orphans} of the stopped run were still running after "
                                    f"{ORPHAN_WAIT_S:.0f} s (killed now)")  # fmt: skip
        if code is not None and code != EXPECTED_EXIT[process.kind]:
            process.problems.append(f"the launcher exited with {code}, expected {EXPECTED_EXIT[process.kind]}")
        if process.kind == "stop_rank":
            match = STALL_LINE.search(seg.text())
            process.named = match.group(0) if match else None
            if match is None or int(match.group(1)) != process.target:
                process.problems.append(f"the watchdog did not name rank {process.target}: {process.named}")
        process.newest_step = max(seg.newest_step() or 0, process.fault_step or 0)
        if not args.process_only:
            check_numeric(numeric, seg, run_dir)
        good, lost = audit_checkpoints(run_dir, corrupted)
        for problem in lost:
            process.problems.append(f"a complete checkpoint no longer verifies: {problem}")
        if process.kind == "corrupt_checkpoint":
            process.corrupted = flip_bit(run_dir, rng)
            corrupted.add(str(list_checkpoints(run_dir)[-1]))
            good, _ = audit_checkpoints(run_dir, corrupted)
        expected_resume = good[-1] if good else 0
        record.update(exit_code=code, fault=process.kind, newest_step=process.newest_step)
        segments.append(record)
        previous, previous_time = process, fault_time
        trouble = "; ".join(process.problems + numeric.problems)
        verdict = "not injected" if args.process_only else "left out" if numeric.excluded else "not left out"
        print(
            f"soak: segment {index}: {numeric.kind} (cluster {numeric.target}, round {numeric.round}) "
            f"{verdict}; {process.kind} ({_target(process)}) at step "
            f"{process.fault_step}, exit {code}, newest step {process.newest_step}, next resume from "
            f"{expected_resume}{'; ' + trouble if trouble else ''}",
            flush=True,
        )  # fmt: skip
    wall_s = time.monotonic() - soak_start
    # ---- the end
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    final_good, final_lost = audit_checkpoints(run_dir, set())
    partials = sorted(p.name for p in (run_dir / "checkpoints").glob(".*.partial"))
    if final_lost:
        problems += [f"at the end, a checkpoint does not verify: {p}" for p in final_lost]
    if summary.get("steps") != args.steps:
        problems.append(f"the run did not finish: summary.json has steps = {summary.get('steps')}")
    expected_excluded = sum(1 for f in faults if f.family == "numeric" and f.excluded)
    if summary and summary.get("guard_excluded_updates") != expected_excluded:
        problems.append(
            f"summary.json counts {summary.get('guard_excluded_updates')} excluded updates, the soak saw "
            f"{expected_excluded} exclusions survive"
        )
    for fault in faults:
        problems += [f"fault {fault.index} ({fault.kind}): {p}" for p in fault.problems]
    return {
        "command": re.sub(r"--run.out_dir=\S+", "--run.out_dir=RUN_DIR", " ".join(command[2:])),
        "faults": [asdict(f) for f in faults if not (args.process_only and f.family == "numeric")],
        "segments": segments,
        "wall_s": round(wall_s, 1),
        "final_eval_loss": summary.get("final_eval_loss"),
        "guard_excluded_updates": summary.get("guard_excluded_updates"),
        "final_checkpoints": final_good,
        "final_checkpoints_verify": not final_lost,
        "leftover_partials": partials,
        "problems": problems,
    }


def run_clean(args: argparse.Namespace, work: Path) -> dict:
    run_dir = work / "clean"
    if args.reuse_clean and (run_dir / "summary.json").exists():
        summary = json.loads((run_dir / "summary.json").read_text())
        if summary.get("steps") == args.steps:
            return {"exit_code": 0, "wall_s": None, "final_eval_loss": summary["final_eval_loss"], "reused": True}
    if run_dir.exists():
        shutil.rmtree(run_dir)
    start = time.monotonic()
    seg = Segment(base_command(run_dir, steps=args.steps, clusters=args.clusters), work / "logs" / "clean.log")
    code = seg.wait(timeout_s=1800)
    summary = json.loads((run_dir / "summary.json").read_text()) if code == 0 else {}
    wall_s = round(time.monotonic() - start, 1)
    return {"exit_code": code, "wall_s": wall_s, "final_eval_loss": summary.get("final_eval_loss")}


# ------------------------------------------------------------------------------------------------ report
def aggregate(faults: list[dict]) -> list[dict]:
    rows = []
    for kind in PROCESS_KINDS + NUMERIC_KINDS:
        group = [f for f in faults if f["kind"] == kind]
        if not group:
            continue
        row = {"kind": kind, "family": group[0]["family"], "count": len(group)}
        if group[0]["family"] == "process":
            lost = [f["lost_steps"] for f in group if f["lost_steps"] is not None]
            recovery = [f["recovery_s"] for f in group if f["recovery_s"] is not None]
            regain = [f["regain_s"] for f in group if f["regain_s"] is not None]
            row.update(
                lost_steps_mean=statistics.fmean(lost) if lost else None,
                lost_steps_max=max(lost) if lost else None,
                recovery_s_mean=statistics.fmean(recovery) if recovery else None,
                recovery_s_max=max(recovery) if recovery else None,
                regain_s_mean=statistics.fmean(regain) if regain else None,
                regain_s_max=max(regain) if regain else None,
            )
        else:
            excluded = [f for f in group if f["excluded"]]
            row.update(excluded=len(excluded), lost_cluster_rounds=len(excluded))
        rows.append(row)
    return rows


def _target(fault: Fault | dict) -> str:
    kind, target = (fault["kind"], fault["target"]) if isinstance(fault, dict) else (fault.kind, fault.target)
    return "launcher" if kind.endswith("launcher") else f"rank {target}"


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def write_results(out: Path, work: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    soak, clean = result["soak"], result.get("clean") or {}
    clusters = result["settings"]["clusters"]
    process = [f for f in soak["faults"] if f["family"] == "process"]
    numeric = [f for f in soak["faults"] if f["family"] == "numeric"]
    lost = [f["lost_steps"] for f in process if f["lost_steps"] is not None]
    lines = [
        f"# Soak: {len(soak['faults'])} faults in one run",
        "",
        f"`python benchmarks/soak.py` on {result['date']}, {result['machine']}. One run of `dilocox train "
        f"{soak['command'].split('train ', 1)[1]}`, {result['settings']['steps']} steps "
        f"(H = {H}, a checkpoint every round), broken {len(soak['faults'])} times and re-launched with the same "
        f"command after each process fault (`checkpoint.resume = auto`). Seed {result['settings']['seed']}.",
        "",
        "## By kind",
        "",
        "| fault | n | work lost (steps) mean / max | rounds max | fault to first step (s) mean / max "
        "| fault to back where it was (s) mean / max |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in result["by_kind"]:
        if row["family"] != "process":
            continue
        lines.append(
            f"| {row['kind']} | {row['count']} | {_fmt(row['lost_steps_mean'])} / {_fmt(row['lost_steps_max'], 'd')} "
            f"| {_fmt(row['lost_steps_max'] / H if row['lost_steps_max'] is not None else None)} "
            f"| {_fmt(row['recovery_s_mean'])} / {_fmt(row['recovery_s_max'])} "
            f"| {_fmt(row['regain_s_mean'])} / {_fmt(row['regain_s_max'])} |"
        )
    if numeric:
        lines += ["", "| numeric fault | n | left out by the guard | work lost |", "| --- | --- | --- | --- |"]
    for row in result["by_kind"]:
        if row["family"] != "numeric":
            continue
        what = (
            f"{row['excluded']} cluster-round(s) (1/{clusters} of a round each)"
            if row["excluded"]
            else "none left out: a finite lie of normal size reaches the mean (the guard cannot see it)"
        )
        lines.append(f"| {row['kind']} | {row['count']} | {row['excluded']} of {row['count']} | {what} |")
    gap = None
    if clean.get("final_eval_loss") and soak.get("final_eval_loss"):
        gap = soak["final_eval_loss"] / clean["final_eval_loss"] - 1
    lines += [
        "",
        "## Totals",
        "",
        f"- Process faults: {len(process)}; work lost {_fmt(statistics.fmean(lost) if lost else None)} steps on "
        f"average, at most {max(lost) if lost else '-'} ({max(lost) / H if lost else '-'} rounds; goal: at most one "
        "round, two for the checkpoint corrupted on purpose).",
        f"- Checkpoints lost: {result['checkpoints_lost']} (goal 0). Remaining checkpoints "
        f"{soak['final_checkpoints']} verify: {soak['final_checkpoints_verify']}; leftover `.partial` directories: "
        f"{len(soak['leftover_partials'])}.",
        f"- Orphans (a process of a stopped run still running {ORPHAN_WAIT_S:.0f} s after the fault): "
        f"{result['orphans']}.",
        f"- Numeric faults: {len(numeric)}; left out by the guard: {sum(1 for f in numeric if f['excluded'])} "
        f"(summary.json: guard_excluded_updates = {soak['guard_excluded_updates']}).",
        f"- Final eval loss: {_fmt(soak['final_eval_loss'], '.4f')} with the faults, "
        f"{_fmt(clean.get('final_eval_loss'), '.4f')} clean: gap {_fmt(None if gap is None else gap * 100, '+.2f')}%.",
        f"- Wall time: soak {soak['wall_s']:.0f} s, clean run {_fmt(clean.get('wall_s'), '.0f')} s.",
        f"- Problems: {len(soak['problems'])}" + "".join(f"\n  - {p.splitlines()[0]}" for p in soak["problems"]),
        "",
        "## Every fault",
        "",
        "| # | segment | fault | target | when | exit | gone after (s) | newest step | resumed from | lost steps "
        "| fault to first step (s) | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for f in soak["faults"]:
        if f["family"] == "process":
            note = f["named"] or f["corrupted"] or ""
            lines.append(
                f"| {f['index']} | {f['segment']} | {f['kind']} | {_target(f)} | step {f['at_step']} "
                f"+ {f['delay_s']:.2f} s | {f['exit_code']} | {_fmt(f['stopped_within_s'], '.2f')} "
                f"| {f['newest_step']} | {f['resumed_step']} | {f['lost_steps']} | {_fmt(f['recovery_s'])} | {note} |"
            )
        else:
            note = f["guard_line"] or "not left out"
            lines.append(
                f"| {f['index']} | {f['segment']} | {f['kind']} | cluster {f['target']} | round {f['round']} | | | | "
                f"| {'1 cluster-round' if f['excluded'] else '-'} | | {note} |"
            )
    lines += [
        "",
        "Work lost: process faults, the newest step the stopped run logged minus the step the re-launch resumed from; "
        "numeric faults, the cluster updates the guard left out. Recovery includes detection (the 5 s stall timeout "
        "for SIGSTOP), stopping the ranks and starting the new ones on a loaded 2-core machine.",
        "",
    ]
    (out / "results.md").write_text("\n".join(lines))  # the run directories and logs stay in WORK


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "soak")
    parser.add_argument("--work", type=Path, default=Path("/tmp/dilocox-soak"), help="run directories and logs")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--faults", type=int, default=20, help="an even number: half numeric, half process")
    parser.add_argument("--clusters", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-clean", action="store_true", help="no clean run to compare the final loss with")
    parser.add_argument(
        "--process-only",
        action="store_true",
        help="process faults only: the loss must equal the clean run's",
    )
    parser.add_argument("--reuse-clean", action="store_true", help="take the clean run from WORK/clean if it finished")
    parser.add_argument("--report-only", action="store_true", help="re-write results.md from OUT/results.json")
    args = parser.parse_args()
    if args.report_only:
        write_results(args.out, args.work, json.loads((args.out / "results.json").read_text()))
        return 0
    if args.faults < 2 or args.faults % 2:
        parser.error("--faults must be an even number >= 2")
    args.work.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    soak = run_soak(args, args.work)
    clean = None if args.skip_clean else run_clean(args, args.work)
    if args.process_only and clean and soak["final_eval_loss"] != clean["final_eval_loss"]:
        soak["problems"].append(  # resume is exact (tests/e2e), so process faults alone must not move the loss
            f"with process faults only, the final eval loss {soak['final_eval_loss']} differs from the clean run's "
            f"{clean['final_eval_loss']}: a resume was not exact"
        )
    checkpoints_lost = sum(
        1 for f in soak["faults"] for p in f["problems"] if "checkpoint was lost" in p or "no longer verifies" in p
    ) + sum(1 for p in soak["problems"] if p.startswith("at the end, a checkpoint"))
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "settings": {"steps": args.steps, "faults": args.faults, "clusters": args.clusters, "seed": args.seed, "H": H},
        "soak": soak,
        "clean": clean,
        "by_kind": aggregate(soak["faults"]),
        "checkpoints_lost": checkpoints_lost,
        "orphans": sum(len(f["orphans"]) for f in soak["faults"]),
        "total_wall_s": round(time.monotonic() - start, 1),
    }
    write_results(args.out, args.work, result)
    print(f"soak: results in {args.out}", flush=True)
    if soak["problems"]:
        print(f"soak: {len(soak['problems'])} problem(s), each a bug or a missed goal:", file=sys.stderr)
        for problem in soak["problems"]:
            print(f"  - {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
