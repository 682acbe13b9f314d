"""Elastic failure soak: one long elastic run of the real CLI, broken again and again; not in the default suite.

    python benchmarks/elastic_soak.py                    # 3 clusters x pp 2, 9,600 steps, >= 200 failures
    python benchmarks/elastic_soak.py --steps 480 --failures 8 --out /tmp/esoak --skip-clean   # a quicker look

One `dilocox train` launcher (configs/debug.toml, `topology.elastic = true`, the `dilocox` preset as users run it
with its syncs in 2 streaming fragments, 3 clusters of 2 pipeline stages each, the preset's H = 12, a checkpoint
every round, link off, `network.heartbeat = 0.5s`, `network.stall_timeout = 5s`) meets at a `dilocox lighthouse` that
this script runs on a fixed port. Cluster `--liar` (2) lies in a seeded tenth of the rounds (`--liar-kind`, sign:
it sends its update negated, `faults.rounds`): each such round is a failure of kind `liar`, which every cluster must
leave out of that round's sync of every fragment, and no honest update may be left out. While it trains, this script
injects the other failures at seeded random times, one at a time (the next one once the last victim is back in
training), the kinds in a seeded shuffled cycle so that each kind recurs:

- `kill_rank`: SIGKILL one rank of a cluster (its launcher stops the cluster's other ranks and restarts all);
- `kill_cluster`: SIGKILL every rank of a cluster;
- `stop`: SIGSTOP every rank of a cluster for stall_timeout + 3 s, then SIGCONT (the others must go on without it;
  it finds itself behind and restarts);
- `kill_in_heal`: SIGKILL a cluster, then SIGKILL its restart within a second of its start, while it joins or heals;
- `kill_in_checkpoint`: SIGKILL a rank of a cluster as soon as a checkpoint's partial directory appears in its
  `checkpoints/cluster{c}/` (every cluster checkpoints its own ranks; when a save is too quick to be seen, 60 s
  later);
- `disk_full`: the kernel lets the ranks of a cluster other than 0 grow a file to 64 KiB only (RLIMIT_FSIZE, as a
  disk that fills up; cluster 0 also appends the run's metrics, which would hit the limit before its checkpoint
  does): its next checkpoint cannot be written, the cluster alone stops and is started again without the limit,
  heals from a live peer and trains on (timed from the launcher's "could not be written" line);
- `lighthouse` (once, half way): SIGKILL the Lighthouse. Every launcher then stops its clusters with one line and
  the command that resumes the run; this script starts the Lighthouse again on the same address and runs that same
  command, which resumes every cluster from its newest checkpoint.

Measured per failure: the time from the failure to the victim's `rejoined` line (back in training), and the step it
rejoined at; for the Lighthouse, the time to the resumed run's first logged step and the step it resumed from; for a
lie, whether every fragment's sync of that round left it out (read from cluster 0's `round_exclusions`; a lie sent
while cluster 0 was down is not seen, one in a round the liar missed is not sent; a lie that passed is counted, not
a failed check: its cost shows in the final loss). At the end: every cluster's outer params (the digests of
`elastic/cluster{c}.json`) must be identical, no honest cluster's update may have been left out, every checkpoint
must verify, the run must finish, and its final eval loss is compared with the same run without failures (no liar
either; `--skip-clean` leaves that out): at its end, and at the step where that run has done as much counted work
(the share of cluster-rounds whose update counted: a failed cluster loses its round, a lie is left out, and a
restarted cluster abstains from the round it rejoins at), interpolated on its evaluations every 96 steps (each
on the same 32 held-out batches as the final one, so that the two compare). Writes
results.json (every failure, every check) and results.md to `--out` (default benchmarks/results/elastic_soak/); exits
1 when a check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import random
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("kill_rank", "kill_cluster", "stop", "kill_in_heal", "kill_in_checkpoint", "disk_full")
STALL_TIMEOUT_S = 5.0
H = 12  # the dilocox preset's (configs/debug.toml sets 10)
FILE_LIMIT = 64 << 10  # disk_full: bytes a file of the victim's ranks may grow to (a checkpoint is ~2 MB)


def flags(args: argparse.Namespace, out_dir: Path, lighthouse: str, *, liar: bool) -> list[str]:
    lies = ["--faults.kind=" + args.liar_kind, f"--faults.cluster={args.liar}", f"--faults.rounds={lie_list(args)}"]
    return [
        "--config", str(ROOT / "configs" / "debug.toml"), f"--run.out_dir={out_dir}",
        "--topology.elastic=true", "--preset=dilocox", "--sync.fragments=2", f"--sync.inner_steps={H}",
        f"--topology.num_clusters={args.clusters}", f"--topology.pp_degree={args.pp}", f"--train.steps={args.steps}",
        "--topology.max_cluster_restarts=100000", f"--checkpoint.interval={H}", "--checkpoint.keep=2",
        "--network.bandwidth=unlimited", "--network.latency=0", "--network.heartbeat=0.5s",
        f"--network.stall_timeout={STALL_TIMEOUT_S:g}s", "--network.timeout=120s", f"--eval.interval={8 * H}",
        "--eval.max_batches=32", "--eval.final_max_batches=32", "--metrics.log_interval=12", "--metrics.progress=false",
        f"--network.lighthouse={lighthouse}", *(lies if liar else []),
    ]  # fmt: skip


def lie_rounds(args: argparse.Namespace) -> list[int]:
    """The rounds in which cluster `args.liar` lies: a seeded tenth of them (none of the first 2, where the guard has
    no history yet, nor of the last 2)."""
    rounds = range(2, args.steps // H - 2)
    return sorted(random.Random(args.seed + 1).sample(rounds, len(rounds) // 10))


def lie_list(args: argparse.Namespace) -> str:
    return ",".join(str(r) for r in lie_rounds(args))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Lighthouse:
    """`dilocox lighthouse` on a fixed port: `kill`, then `start` again on the same address."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        from dilocox.elastic.lighthouse import run_lighthouse

        self.proc, _ = run_lighthouse(
            f"127.0.0.1:{self.port}", heartbeat="0.5s", stall_timeout=f"{STALL_TIMEOUT_S:g}s", cwd=ROOT
        )

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=20)


class Launcher:
    """The elastic launcher in a subprocess, its output timestamped as it comes."""

    def __init__(self, command: list[str], log: Path) -> None:
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        self.lines: list[tuple[float, str]] = []
        self.log = log.open("a")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
            self.log.write(line)
            self.log.flush()

    def starts(self, cluster: int) -> list[tuple[float, list[int]]]:
        """(time, rank pids) of every start of `cluster`."""
        found = []
        for at, line in list(self.lines):
            match = re.match(rf"dilocox: elastic: cluster {cluster} started \(pid ([\d ]+),", line)
            if match:
                found.append((at, [int(pid) for pid in match.group(1).split()]))
        return found

    def rejoined_after(self, cluster: int, since: float) -> tuple[float, int] | None:
        """(time, step) of the `rejoined` line of `cluster`'s first start after `since`: the process that replaced
        the failed one is back in training (a line the failed process printed as it died does not count)."""
        started = [at for at, _ in self.starts(cluster) if at > since]
        if not started:
            return None
        for at, line in list(self.lines):
            match = re.match(rf"dilocox: elastic: cluster {cluster} rejoined at step (\d+)", line)
            if match and at > started[0]:
                return at, int(match.group(1))
        return None

    def step(self) -> int:
        for _, line in reversed(list(self.lines)):
            match = re.match(r"step\s+(\d+)/", line)
            if match:
                return int(match.group(1))
        return 0

    def running(self) -> bool:
        return self.proc.poll() is None

    def finish(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        self.log.close()
        return code


def signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def wait_for(condition, timeout: float, launcher: Launcher) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and launcher.running():
        if condition():
            return True
        time.sleep(0.02)
    return bool(condition())


def inject(kind: str, cluster: int, launcher: Launcher, run_dir: Path, rng: random.Random) -> dict:
    """Inject one failure of `kind` into `cluster`; returns its record with the time it took effect (`at`)."""
    pids = launcher.starts(cluster)[-1][1]
    record: dict = {"kind": kind, "cluster": cluster, "step": launcher.step()}
    if kind == "kill_rank":
        signal_all([rng.choice(pids)], signal.SIGKILL)
    elif kind == "kill_cluster":
        signal_all(pids, signal.SIGKILL)
    elif kind == "stop":
        signal_all(pids, signal.SIGSTOP)
        record["at"] = time.monotonic()
        record["stopped_s"] = STALL_TIMEOUT_S + 3.0  # part of its recovery time: it is back only after SIGCONT
        time.sleep(STALL_TIMEOUT_S + 3.0)
        signal_all(pids, signal.SIGCONT)
        return record
    elif kind == "kill_in_heal":
        count = len(launcher.starts(cluster))
        signal_all(pids, signal.SIGKILL)
        if wait_for(lambda: len(launcher.starts(cluster)) > count, 60, launcher):
            started = launcher.starts(cluster)[-1][0]
            time.sleep(rng.uniform(0.0, 1.0))
            signal_all([rng.choice(launcher.starts(cluster)[-1][1])], signal.SIGKILL)
            # whether the restart was still joining or healing when it was killed again
            record["inside_heal"] = launcher.rejoined_after(cluster, started - 1e-3) is None
    elif kind == "kill_in_checkpoint":
        root = run_dir / "checkpoints" / f"cluster{cluster}"
        seen = wait_for(lambda: root.is_dir() and any(p.suffix == ".partial" for p in root.iterdir()), 60, launcher)
        signal_all([rng.choice(pids)], signal.SIGKILL)
        record["inside_save"] = seen
    elif kind == "disk_full":
        count = len(launcher.lines)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)[1]
                resource.prlimit(pid, resource.RLIMIT_FSIZE, (FILE_LIMIT, hard))
        said = f"dilocox: elastic: cluster {cluster}: checkpoint step "
        refused = lambda: next((at for at, line in launcher.lines[count:] if line.startswith(said)), None)  # noqa: E731
        record["refused"] = wait_for(lambda: refused() is not None, 120, launcher)
        record["at"] = refused() or time.monotonic()
        return record
    record["at"] = time.monotonic()
    return record


def lighthouse_failure(
    launcher: Launcher, lighthouse: Lighthouse, command: list[str], log: Path
) -> tuple[dict, Launcher]:
    """Kill the Lighthouse; once the launcher has stopped its clusters, start it again and resume the run with the
    same command. Returns the failure's record and the resumed run's launcher."""
    record: dict = {"kind": "lighthouse", "cluster": None, "step": launcher.step()}
    at = time.monotonic()
    lighthouse.kill()
    record["launcher_exit"] = launcher.finish(timeout=600)
    record["resume_command_printed"] = any("dilocox train" in line for _, line in launcher.lines[-20:])
    record["stopped_s"] = round(time.monotonic() - at, 3)
    lighthouse.start()
    resumed = Launcher(command, log)
    if wait_for(lambda: any("resuming from" in line for _, line in resumed.lines), 300, resumed):
        line = next(line for _, line in resumed.lines if "resuming from" in line)
        match = re.search(r"step_(\d+)", line)
        record["resumed_at_step"] = int(match.group(1)) if match else None
    if wait_for(lambda: resumed.step() > (record.get("resumed_at_step") or 0), 300, resumed):
        record["recovery_s"] = round(time.monotonic() - at, 3)
    record["recovered"] = "recovery_s" in record
    return record, resumed


def recovered(launcher: Launcher, cluster: int, since: float) -> tuple[float, int] | None:
    """(time, step) of `cluster`'s return to training after `since`, waiting up to 180 s; None if it did not."""
    wait_for(lambda: launcher.rejoined_after(cluster, since) is not None, 180, launcher)
    return launcher.rejoined_after(cluster, since)


def soak(args: argparse.Namespace, run_dir: Path, lighthouse: Lighthouse) -> tuple[list[dict], int]:
    command = [sys.executable, "-m", "dilocox", "train", *flags(args, run_dir, lighthouse.url, liar=True)]
    log = run_dir.parent / f"{run_dir.name}.log"
    launcher = Launcher(command, log)
    rng = random.Random(args.seed)
    failures: list[dict] = []
    cycle: list[str] = []
    lighthouse_at = args.failures // 2
    if not wait_for(lambda: launcher.step() >= 20, 300, launcher):
        raise RuntimeError(f"the soak run did not reach step 20: see {log}")
    while launcher.running() and len(failures) < args.failures and launcher.step() < args.steps - 5 * H:
        time.sleep(rng.uniform(args.min_gap, args.max_gap))
        if len(failures) == lighthouse_at and not args.keep_lighthouse:
            record, launcher = lighthouse_failure(launcher, lighthouse, command, log)
            failures.append(record)
            print(f"[{len(failures)}] {json.dumps(record)}", flush=True)
            continue
        if not cycle:
            cycle = list(KINDS)
            rng.shuffle(cycle)
        kind = cycle.pop()
        cluster = rng.randrange(1 if kind == "disk_full" else 0, args.clusters)
        record = inject(kind, cluster, launcher, run_dir, rng)
        since = record.pop("at")
        back = recovered(launcher, cluster, since)
        if back is not None:
            record["recovery_s"] = round(back[0] - since, 3)
            record["rejoined_at_step"] = back[1]
        record["recovered"] = back is not None
        failures.append(record)
        print(f"[{len(failures)}] {json.dumps(record)}", flush=True)
    return failures, launcher.finish(timeout=1800)


def lies(args: argparse.Namespace, run_dir: Path, failures: list[dict]) -> tuple[list[dict], list[dict]]:
    """A `liar` failure per lying round: how many of its fragment syncs left the liar out, as cluster 0's
    `round_exclusions` say, and `status`: "left out" (every fragment's), "not seen" (fewer, within 2 rounds of a
    failure of the liar or of cluster 0: the liar sent no lie, or abstained, or cluster 0 did not record the round)
    or "passed" (a lie that reached the model). Also every verdict against another update: an honest cluster's, or the
    liar's in a round it did not lie in (what a lie withheld goes out in its later payloads); a cluster that sent none
    (it just healed) is no verdict."""
    from dilocox.metrics import read_metrics

    lying = lie_rounds(args)
    fragments: dict[int, set[int]] = {}
    wrong = []
    for record in read_metrics(run_dir):
        for entry in record.get("round_exclusions", []):
            if entry["round"] is None or entry["why"].startswith("it sent none"):  # the drain; an abstention
                continue
            if entry["cluster"] == args.liar and entry["round"] in lying:
                fragments.setdefault(entry["round"], set()).add(record.get("round_fragment", 0))
            else:
                wrong.append({"step": record["step"], "round": entry["round"], "cluster": entry["cluster"]})
    # steps in which the liar or cluster 0 was down, rejoining, or resumed
    troubled = [
        (f["step"], f.get("rejoined_at_step") or f.get("resumed_at_step") or args.steps)
        for f in failures
        if f["cluster"] in (0, args.liar, None)
    ]
    found = []
    for r in lying:
        near = any(first - 2 * H <= r * H <= last + 2 * H for first, last in troubled)
        count = len(fragments.get(r, ()))
        status = "left out" if count == 2 else "not seen" if near else "passed"
        found.append({"kind": "liar", "cluster": args.liar, "round": r, "left_out_syncs": count, "status": status})
    return found, wrong


def checks(args: argparse.Namespace, run_dir: Path, failures: list[dict], code: int) -> dict[str, bool]:
    from dilocox.checkpoint import list_checkpoints, verify_checkpoint

    records = {
        int(p.stem.removeprefix("cluster")): json.loads(p.read_text()) for p in (run_dir / "elastic").glob("*.json")
    }
    verified = []
    for path in list_checkpoints(run_dir):
        try:
            verify_checkpoint(path)
            verified.append(True)
        except ValueError:
            verified.append(False)
    return {
        "the run finished (exit 0)": code == 0,
        "every cluster wrote its record": sorted(records) == list(range(args.clusters)),
        "every cluster ends with identical outer params": len({r["outer_params_sha256"] for r in records.values()})
        == 1,
        "every cluster ends at the last step": all(r["step"] == args.steps for r in records.values()),
        "every failure was recovered from": all(f.get("recovered", True) for f in failures),
        "every checkpoint verifies": bool(verified) and all(verified),
    }


def write_results(
    out: Path,
    args: argparse.Namespace,
    failures: list[dict],
    wrong: list[dict],
    checked: dict,
    losses: dict,
    events: dict[str, int],
) -> None:
    recoveries = [f["recovery_s"] for f in failures if "recovery_s" in f]
    by_kind = {}
    for kind in [*KINDS, "lighthouse", "liar"]:
        times = [f["recovery_s"] for f in failures if f["kind"] == kind and "recovery_s" in f]
        by_kind[kind] = {
            "count": sum(f["kind"] == kind for f in failures),
            "median_s": statistics.median(times) if times else None,
            "max_s": max(times) if times else None,
        }
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "command": " ".join(["python benchmarks/elastic_soak.py", *sys.argv[1:]]),
        "settings": vars(args) | {"out": str(args.out)},
        "failures": failures,
        "left_out_but_no_lie": wrong,
        "recovery_s": {
            "median": statistics.median(recoveries) if recoveries else None,
            "max": max(recoveries) if recoveries else None,
        },
        "by_kind": by_kind,
        "final_eval_loss": losses,
        "membership_records": events,
        "checks": checked,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# Elastic failure soak ({result['date']}, {result['machine']})",
        "",
        f"`{result['command']}`: the dilocox preset in 2 fragments, {args.clusters} clusters x pp {args.pp}, "
        f"{args.steps} steps, H = {H}, debug model, {len(failures)} failures (cluster {args.liar} lying by "
        f"`{args.liar_kind}` in {by_kind['liar']['count']} rounds; a lie has no recovery time: the cluster heals in "
        "place from the agreed parameters).",
        "",
        "| failure | count | recovery median (s) | max (s) |",
        "|---|---:|---:|---:|",
    ]
    for kind, row in by_kind.items():
        median = "-" if row["median_s"] is None else f"{row['median_s']:.1f}"
        most = "-" if row["max_s"] is None else f"{row['max_s']:.1f}"
        lines.append(f"| {kind} | {row['count']} | {median} | {most} |")
    overall = result["recovery_s"]
    if overall["median"] is not None:
        lines.append(f"| all | {len(failures)} | {overall['median']:.1f} | {overall['max']:.1f} |")
    statuses = [f["status"] for f in failures if f["kind"] == "liar"]
    lines += [
        "",
        "Lies: " + ", ".join(f"{statuses.count(s)} {s}" for s in ("left out", "not seen", "passed")) + " (a lie that "
        "passed went into the mean; what it cost is in the final loss below)",
    ]
    honest = sum(w["cluster"] != args.liar for w in wrong)
    lines += [
        f"Other updates left out: {honest} of honest clusters, {len(wrong) - honest} of the liar between its lies"
    ]
    lines += ["", "| final eval loss | value |", "|---|---:|"]
    lines += [
        f"| {name} | {value if isinstance(value, int) else f'{value:.4f}'} |"
        for name, value in losses.items()
        if value is not None
    ]
    lines += ["", f"`elastic` records in metrics.jsonl (written by cluster 0): {events or 'none'}"]
    lines += ["", "| check | passed |", "|---|---|"]
    lines += [f"| {name} | {'yes' if ok else '**no**'} |" for name, ok in checked.items()]
    (out / "results.md").write_text("\n".join(lines) + "\n")


def membership_records(run_dir: Path) -> dict[str, int]:
    """The `elastic` records of metrics.jsonl (written by cluster 0), counted by kind."""
    from dilocox.metrics import read_metrics

    counts: dict[str, int] = {}
    for record in read_metrics(run_dir):
        if record.get("event") == "elastic":
            counts[record["kind"]] = counts.get(record["kind"], 0) + 1
    return counts


def counted_work(run_dir: Path, clusters: int) -> tuple[float, int, int]:
    """The share of the run's cluster-rounds whose update counted, as cluster 0 saw its rounds (each fragment's sync
    of a round apart), with the cluster-rounds lost and in all: a round settled without a cluster (it was down) or
    with its update left out (a lie, or it had just healed and abstains) lost that cluster's round. Rounds cluster 0
    missed while it was down itself are not in its records."""
    from dilocox.metrics import read_metrics

    rounds = [r for r in read_metrics(run_dir) if r.get("round_clusters") is not None and "loss" in r]
    lost = sum(clusters - len(r["round_clusters"]) + r.get("round_excluded", 0) for r in rounds)
    total = clusters * len(rounds)
    return (1.0 - lost / total if rounds else 1.0), lost, total


def loss_at_step(run_dir: Path, step: float) -> float | None:
    """The run's eval loss at `step`, linear between its evaluations (eval.interval)."""
    from dilocox.metrics import read_metrics

    curve = [(r["step"], r["eval_loss"]) for r in read_metrics(run_dir) if r.get("eval_loss") is not None]
    for (s0, l0), (s1, l1) in zip(curve, curve[1:], strict=False):
        if s0 <= step <= s1:
            return l0 + (l1 - l0) * (step - s0) / (s1 - s0)
    return None


def final_loss(run_dir: Path) -> float | None:
    try:
        return json.loads((run_dir / "summary.json").read_text())["final_eval_loss"]
    except (OSError, ValueError, KeyError):
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=9600)
    parser.add_argument("--clusters", type=int, default=3)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--failures", type=int, default=140, help="failures injected (the lies come on top)")
    parser.add_argument("--liar", type=int, default=2, help="the cluster that lies in a tenth of the rounds")
    parser.add_argument("--liar-kind", default="sign", help="its faults.kind (sign, scale, random)")
    parser.add_argument("--min-gap", type=float, default=0.5, help="seconds between a recovery and the next failure")
    parser.add_argument("--max-gap", type=float, default=2.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-clean", action="store_true", help="no fault-free run to compare the final loss with")
    parser.add_argument("--keep-lighthouse", action="store_true", help="never kill the Lighthouse")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "elastic_soak")
    args = parser.parse_args()
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"dilocox-elastic-soak-{os.getpid()}"
    work.mkdir(parents=True)
    lighthouse = Lighthouse(free_port())
    try:
        losses: dict[str, float | None] = {}
        if not args.skip_clean:
            clean_flags = flags(args, work / "clean", lighthouse.url, liar=False)
            command = [sys.executable, "-m", "dilocox", "train", *clean_flags]
            clean = Launcher(command, work / "clean.log")
            if clean.finish(timeout=3600) != 0:
                raise RuntimeError(f"the fault-free run failed: see {work / 'clean.log'}")
            losses["without failures"] = final_loss(work / "clean")
        failures, code = soak(args, work / "soak", lighthouse)
        lied, wrong = lies(args, work / "soak", failures)
        failures += lied
        losses["with failures"] = final_loss(work / "soak")
        checked = checks(args, work / "soak", failures, code)
        checked["no honest cluster's update was left out"] = not [w for w in wrong if w["cluster"] != args.liar]
        share, lost, syncs = counted_work(work / "soak", args.clusters)
        losses["cluster-round syncs lost (failed, left out or abstained)"] = lost
        losses["cluster-round syncs in the run (as cluster 0 recorded them)"] = syncs
        if losses.get("without failures") and losses.get("with failures"):
            losses["counted work (share of cluster-rounds)"] = share
            losses["without failures, at the same counted work"] = loss_at_step(work / "clean", share * args.steps)
            gap = losses["with failures"] / losses["without failures"] - 1
            checked["final eval loss within 0.5% of the run without failures"] = abs(gap) <= 0.005
            equal = losses["without failures, at the same counted work"]
            if equal is not None:  # the failures cost no more than the work they lost
                checked["final eval loss at most 0.5% above the run without failures at equal counted work"] = (
                    losses["with failures"] / equal - 1 <= 0.005
                )
    finally:
        lighthouse.stop()
    write_results(args.out, args, failures, wrong, checked, losses, membership_records(work / "soak"))
    print((args.out / "results.md").read_text())
    if all(checked.values()):
        shutil.rmtree(work, ignore_errors=True)
        return 0
    print(f"a check failed: the runs' directories and logs are kept in {work}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
