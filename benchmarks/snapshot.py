"""Behaviour snapshot: short real `dilocox train` runs whose results must stay bit-identical across a refactor.

    python benchmarks/snapshot.py record --out benchmarks/results/snapshot/snapshot.json
    python benchmarks/snapshot.py compare --against benchmarks/results/snapshot/snapshot.json
    python benchmarks/snapshot.py compare --against benchmarks/results/snapshot/snapshot.json --only dilocox --only pp2
    python benchmarks/snapshot.py list                      # the runs and what each covers

`record` runs every case of `CASES` (or those named by `--only`, merged into an existing `--out`): each is the real
CLI in a subprocess, in its own temporary run directory, on `configs/debug.toml` with 12 steps of H = 3, one thread
per rank, the slow link not emulated (`network.bandwidth = unlimited`, latency 0), so that nothing depends on timing.
From the run's files it keeps, per run:

- `final_loss`, `final_eval_loss`, `initial_eval_loss` (metrics.jsonl, summary.json), `losses` (every step's train
  loss) and `eval_losses` (step, loss): JSON numbers, written with Python's `repr`, so they read back exactly;
- `metrics.<key>`: for every other key of metrics.jsonl, a sha256 of its (step, value) series and its last value
  (learning rate, outer step, the round records: bytes sent, clusters left out, H); the cumulative slow-link counters
  by their last value only (`LAST_ONLY_KEYS`);
- `summary.<key>`: every key of summary.json (steps, outer steps, slow-link bytes of all ranks, guard counts, ...);
- `rankN.channel` (the slow-link counters of rank N's last checkpoint: bytes sent, received, control bytes,
  transfers), `rankN.model`, `rankN.outer_params` (sha256 of the local model and of the agreed outer params) and
  `rankN.state` (sha256 of every tensor and setting of the rank's checkpoint: optimizer states, residuals, a sync in
  flight, RNG, data position), `checkpoints` (the step directories left) and, for elastic runs (whose ranks are
  cluster 0's, from `checkpoints/cluster0/`), `rankN.torchft` (torchft's step counters, apart from `rankN.state` so
  that the static twin's state compares) and `elastic.clusterK` (each cluster's record, with the sha256 of its outer
  params).

Left out because they measure time, not behaviour: every key that ends in `_s` (tokens_per_s, elapsed_s, link busy
and exposed time, round compute time, wall time: `is_timing`) and `hidden_comm_fraction`; also the paths `run_dir`
and `checkpoint` of summary.json (a temporary directory; the checkpoint's step is in `checkpoints`), and the series of
the cumulative slow-link counters under a delayed sync (`LAST_ONLY_KEYS`). Recording twice (2 and 3 runs at a time)
gave identical fields for every run (docs/design.md §8, "Checking a refactor").

`compare` re-runs the exact commands stored in the snapshot with the code of this tree and prints, per run,
`identical`, `DIFFERENT` with every differing field (old -> new; for a series, the first element that differs) or
`ERROR` with the CLI's message (a config the code now refuses, a crash, a timeout), and exits 1 unless every run is
identical. `--jobs N` (default 2) runs N cases at a time: each run has its own processes and store port, and a CPU
run at one thread per rank gives the same bits whatever else the machine does. On a shared 2-core machine `record`
took 385 s with `--jobs 2` and `compare` 213 s with `--jobs 3` (each run is mostly process start-up, 9-54 s).

The `preset_*` cases run every shipped preset as `--preset NAME` over the base flags (the dilocox preset at its own
H = 12, 36 steps, so that its every option resolves as in `dilocox train`): a change in how options resolve shows
there first.

Not covered, because their results depend on timing: `sync.round.fit_link` (H follows the measured link time) and an
elastic run with a killed cluster: where the restarted cluster rejoins (which round, or at the end) depends on how
fast it restarts, so the elastic case is fault-free. An emulated link is left off too: it only makes the runs wait.
The elastic case's results are bit-identical to `elastic_static_twin`, the same settings without
`topology.elastic` (the same losses, and rank 0's slow-link counters and final state, `TWIN_KEYS`), which `record`
checks and prints.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dilocox.checkpoint import load_rank_state

ROOT = Path(__file__).resolve().parent.parent
FORMAT = 1
"""Version of the snapshot file's layout."""
BASE_FLAGS = (
    "--config=configs/debug.toml",
    "--network.bandwidth=unlimited",
    "--network.latency=0",
    "--run.num_threads=1",
    "--metrics.progress=false",
    "--metrics.log_interval=1",
    "--train.steps=12",
    "--sync.inner_steps=3",
    "--eval.interval=6",
    "--eval.max_batches=2",
    "--eval.final_max_batches=4",
    "--checkpoint.interval=0",
)
"""What every run shares: the debug model, 12 steps of H = 3 (4 outer rounds), the link off, an evaluation at step 6
and at the end, one checkpoint at the end."""
RUN_DIR = "{run_dir}"
KEY_FILE = "{key_file}"
"""Placeholders in a stored command: the run's temporary directory and a payload key file written next to it."""
AUTH_KEY = bytes(range(32))
"""The payload key of the authenticated case (any 32 bytes: the tags are part of the bytes counted)."""
ELASTIC_PAIR = ("elastic", "elastic_static_twin")
"""An elastic run and the static run with its settings: `record` checks that they agree on `TWIN_KEYS`."""
TWIN_KEYS = (
    "losses",
    "eval_losses",
    "final_eval_loss",
    "rank0.channel",
    "rank0.model",
    "rank0.outer_params",
    "rank0.state",
)
"""What an elastic run without faults shares with its static twin. Not the rest: an elastic run's summary counts
cluster 0's slow-link bytes only (`summary.wan_bytes_total`, `summary.allreduce_equiv_bytes`) and its checkpoint holds
cluster 0's rank only."""
TIMING_KEYS = frozenset({"hidden_comm_fraction"})
"""Keys that measure time without ending in `_s` (see `is_timing`)."""
PATH_KEYS = frozenset({"run_dir", "checkpoint"})
"""summary.json keys that hold the run's temporary paths."""
LAST_ONLY_KEYS = frozenset({"wan_bytes_sent", "wan_bytes_recv", "payloads_rejected"})
"""Cumulative slow-link counters of metrics.jsonl whose last value only is compared: a step's row reads them while a
delayed sync may still be on the wire, so the step at which a transfer's bytes first show depends on when the
communicator thread sent it (two recordings differed there for every `sync_delay = 1` run). The last row comes after
the final flush and equals the checkpoint's counters (`rankN.channel`); each round's bytes are in
`metrics.round_bytes_sent`."""


@dataclass(frozen=True)
class Case:
    name: str
    what: str
    flags: tuple[str, ...] = ()
    resume_at: int = 0
    """> 0: first train to this step (the run ends and checkpoints there), then again to train.steps in place."""

    def invocations(self) -> list[list[str]]:
        """The arguments of each `dilocox train` call of this case, with the `RUN_DIR` / `KEY_FILE` placeholders."""
        full = [*BASE_FLAGS, f"--run.out_dir={RUN_DIR}", *self.flags]
        if not self.resume_at:
            return [full]
        # a finished run goes on to more steps only when asked: otherwise the second call gets a directory of its own
        return [[*full, f"--train.steps={self.resume_at}"], [*full, "--checkpoint.resume=latest"]]


THREE = ("--topology.num_clusters=3",)
DELAY = ("--sync.sync_delay=1",)
DILOCOX = ("--preset=dilocox-lowrank",)
"""The dilocox-lowrank preset: delay 1, the adaptive codec, plain averaging, own_payload, local + drained residual."""
PLAIN = ("--sync.merge=eager", "--sync.local_residual=false", "--sync.drain_residual=false")
"""The preset's options that need a codec's residual and a static run, turned off."""
CASES: tuple[Case, ...] = (
    Case("allreduce", "per-step AllReduce baseline", ("--sync.kind=allreduce",)),
    Case("cocktail", "CocktailSGD: compressed gradients every step", ("--sync.kind=cocktail",)),
    Case("diloco", "blocking DiLoCo, fp32 dense all-reduce, outer Nesterov 0.7 / 0.9", ("--sync.kind=diloco",)),
    Case("dilocox", "dilocox-lowrank: delay 1, adaptive codec, own_payload, local + drained residual", DILOCOX),
    Case(
        "dilocox_none",
        "the dilocox-lowrank preset without a codec: merge eager, no residual options",
        (*DILOCOX, "--compression.kind=none", *PLAIN),
    ),  # fmt: skip
    Case("delay1_reset", "delayed DiLoCo, merge reset", (*DELAY, "--sync.merge=reset")),
    Case("delay1_keep_local", "delayed DiLoCo, merge keep_local", (*DELAY, "--sync.merge=keep_local")),
    Case("delay1_eager", "delayed DiLoCo, merge eager", (*DELAY, "--sync.merge=eager")),
    Case("delay1_lookahead", "delayed DiLoCo, merge lookahead", (*DELAY, "--sync.merge=lookahead")),
    Case(
        "delay1_own_payload",
        "delayed DiLoCo, merge own_payload (int4 with error feedback)",
        (*DELAY, "--sync.merge=own_payload", "--compression.kind=int4"),
    ),  # fmt: skip
    *(
        Case(f"codec_{kind}", f"blocking DiLoCo, codec {kind}, gather reduction", (f"--compression.kind={kind}",))
        for kind in ("fp16", "bf16", "int4", "lowrank", "lowrank_int4", "adaptive", "topk_int4")
    ),
    Case(
        "scalable_int4",
        "scalable reduction of int4, 3 clusters, delay 1",
        (*THREE, *DELAY, "--compression.kind=int4", "--compression.reduction=scalable"),
    ),  # fmt: skip
    Case(
        "scalable_lowrank_int4",
        "scalable reduction of lowrank_int4, 3 clusters, blocking",
        (*THREE, "--compression.kind=lowrank_int4", "--compression.reduction=scalable"),
    ),  # fmt: skip
    Case("dp2", "dilocox, 2 clusters x dp 2 (sharded outer sync)", (*DILOCOX, "--topology.dp_degree=2")),
    Case("pp2", "dilocox, 2 clusters x pp 2 (1f1b)", (*DILOCOX, "--topology.pp_degree=2")),
    Case(
        "overlap_steps",
        "dilocox, the delayed average applied 1 step into the next round",
        (*DILOCOX, "--sync.overlap_steps=1"),
    ),  # fmt: skip
    Case(
        "residual_blocking",
        "blocking DiLoCo, topk_int4, local_residual + drain_residual, plain averaging",
        (
            "--compression.kind=topk_int4",
            "--sync.local_residual=true",
            "--sync.drain_residual=true",
            "--sync.outer.lr=1.0",
            "--sync.outer.momentum=0",
        ),
    ),  # fmt: skip
    Case(
        "outer_cosine",
        "blocking DiLoCo, cosine outer lr with 1 warm-up round",
        ("--sync.outer.lr_schedule=cosine", "--sync.outer.warmup_rounds=1"),
    ),  # fmt: skip
    Case(
        "resume",
        "dilocox: 6 steps, then on to 12 in the same directory (checkpoint.resume = latest)",
        DILOCOX,
        resume_at=6,
    ),  # fmt: skip
    Case(
        "fault_nan",
        "3 clusters, cluster 2 sends NaN in rounds 2-3, the guard leaves it out",
        (*THREE, "--faults.kind=nan", "--faults.cluster=2", "--faults.rounds=2-3"),
    ),  # fmt: skip
    Case(
        "fault_scale",
        "dilocox, 3 clusters, cluster 1 sends x1000 in round 4, the guard leaves it out",
        (*THREE, *DILOCOX, "--faults.kind=scale", "--faults.cluster=1", "--faults.rounds=4"),
    ),  # fmt: skip
    Case(
        "fault_diverge",
        "3 clusters, cluster 0 diverges in round 2 and heals",
        (*THREE, "--faults.kind=diverge", "--faults.cluster=0", "--faults.rounds=2"),
    ),  # fmt: skip
    Case(
        "robust_median",
        "3 clusters, fp16 gather, median aggregate, cluster 1 sends noise from round 2",
        (*THREE, "--compression.kind=fp16", "--sync.aggregate=median", "--faults.kind=random", "--faults.cluster=1"),
    ),  # fmt: skip
    Case(
        "auth_int4",
        "dilocox, int4 gather, HMAC-tagged payloads",
        (*DILOCOX, "--compression.kind=int4", f"--network.auth_key_file={KEY_FILE}"),
    ),  # fmt: skip
    Case(
        "elastic",
        "dilocox, 3 elastic clusters (torchft quorum every round), fault-free",
        (*THREE, *DILOCOX, *PLAIN, "--topology.elastic=true"),
    ),  # fmt: skip
    Case(
        "elastic_static_twin",
        "the elastic case's settings in a static run (merge eager, no residual options)",
        (*THREE, *DILOCOX, *PLAIN),
    ),  # fmt: skip
    Case(
        "preset_dilocox",
        "the dilocox preset (top-k int4, delay 1, overlap 7) at its own H = 12, 36 steps",
        ("--preset=dilocox", "--sync.inner_steps=12", "--train.steps=36"),
    ),  # fmt: skip
    Case("preset_paper", "the paper preset (adaptive, outer SGD 0.7 / 0.9, keep_local)", ("--preset=paper",)),
    Case("preset_diloco", "the diloco preset (blocking fp32, outer SGD 0.7 / 0.9)", ("--preset=diloco",)),
    Case("preset_allreduce", "the allreduce preset", ("--preset=allreduce",)),
    Case("preset_cocktail", "the cocktail preset", ("--preset=cocktail",)),
)


# --------------------------------------------------------------------------------------------------------------
# Reading a finished run


def is_timing(key: str) -> bool:
    """Whether a metrics / summary / checkpoint key measures time (it changes from run to run of the same code)."""
    return key.endswith("_s") or key in TIMING_KEYS


def state_digest(obj: Any) -> str:
    """sha256 of a checkpoint's nested state: every tensor (dtype, shape, bytes) and every setting, by sorted key
    path, leaving out the floats that measure time (`is_timing`), so two runs of the same code agree."""
    digest = hashlib.sha256()
    _feed(digest, "", obj)
    return digest.hexdigest()


def _feed(digest: Any, path: str, obj: Any) -> None:
    if isinstance(obj, dict):
        for key in sorted(obj, key=str):
            _feed(digest, f"{path}/{key}", obj[key])
    elif isinstance(obj, list | tuple):
        for i, item in enumerate(obj):
            _feed(digest, f"{path}/{i}", item)
    elif isinstance(obj, torch.Tensor):
        tensor = obj.detach().cpu().contiguous()
        digest.update(f"{path}:{tensor.dtype}:{tuple(tensor.shape)}\n".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, float) and is_timing(path.rsplit("/", 1)[-1]):
        return
    else:
        digest.update(f"{path}={obj!r}\n".encode())


def series_digest(values: list[Any]) -> str:
    return hashlib.sha256(json.dumps(values).encode()).hexdigest()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows


def observe(run_dir: Path) -> dict[str, Any]:
    """The compared fields of a finished run directory (see the module docstring)."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    fields: dict[str, Any] = {
        "final_loss": rows[-1]["loss"],
        "final_eval_loss": summary.get("final_eval_loss"),
        "initial_eval_loss": summary.get("initial_eval_loss"),
        "losses": [row["loss"] for row in rows],
        "eval_losses": [[row["step"], row["eval_loss"]] for row in rows if "eval_loss" in row],
        "metrics.steps": [row["step"] for row in rows],
    }
    keys = sorted({key for row in rows for key in row} - {"step", "loss", "eval_loss"})
    for key in keys:
        if is_timing(key):
            continue
        series = [[row["step"], row[key]] for row in rows if key in row]
        if key in LAST_ONLY_KEYS:
            fields[f"metrics.{key}"] = {"last": series[-1]}
        else:
            fields[f"metrics.{key}"] = {"sha256": series_digest(series), "last": series[-1]}
    for key, value in sorted(summary.items()):
        if not is_timing(key) and key not in PATH_KEYS:
            fields[f"summary.{key}"] = value
    root = run_dir / "checkpoints"
    root = root / "cluster0" if (root / "cluster0").is_dir() else root  # an elastic run: cluster 0's world's ranks
    checkpoints = sorted(p for p in root.glob("step_*") if (p / "meta.json").is_file())
    fields["checkpoints"] = [p.name for p in checkpoints]
    if checkpoints:
        last = checkpoints[-1]
        meta = json.loads((last / "meta.json").read_text())
        fields["checkpoint.step"] = meta.get("step")
        fields["checkpoint.tokenizer_vocab"] = meta.get("tokenizer_vocab")
        for rank in range(meta.get("world_size", 1)):
            state = load_rank_state(last, rank)
            torchft = (state.get("trainer") or {}).pop("torchft", None)  # an elastic run's own: apart, for the twin
            if torchft is not None:
                fields[f"rank{rank}.torchft"] = torchft
            channel = state.get("channel") or {}
            fields[f"rank{rank}.channel"] = {k: v for k, v in sorted(channel.items()) if not is_timing(k)}
            fields[f"rank{rank}.model"] = state_digest(state.get("model"))
            sync = state.get("sync") or {}
            fragments = sync.get("fragments") if isinstance(sync, dict) else None
            if isinstance(fragments, list) and len(fragments) == 1:  # one fragment: the flat state it always was
                sync = {**fragments[0], **{k: v for k, v in sync.items() if k != "fragments"}}
                state["sync"] = sync
            if isinstance(sync, dict) and sync.get("outer_params") is not None:
                fields[f"rank{rank}.outer_params"] = state_digest(sync["outer_params"])
            fields[f"rank{rank}.state"] = state_digest(state)
    for path in sorted((run_dir / "elastic").glob("*.json")):
        record = json.loads(path.read_text())
        fields[f"elastic.{path.stem}"] = {k: v for k, v in sorted(record.items()) if not is_timing(k)}
    return fields


# --------------------------------------------------------------------------------------------------------------
# Running a case


@dataclass
class Outcome:
    name: str
    fields: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    wall_s: float = 0.0


def run_case(name: str, invocations: list[list[str]], *, timeout_s: float, keep: Path | None) -> Outcome:
    """Every `dilocox train` call of a case in one fresh directory, then the fields of the run directory it left."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"dilocox-snapshot-{name}-") as tmp:
        run_dir = Path(tmp) / "run"
        key_file = Path(tmp) / "wan.key"
        key_file.write_bytes(AUTH_KEY)
        key_file.chmod(0o600)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        log = []
        for args in invocations:
            args = [a.replace(RUN_DIR, str(run_dir)).replace(KEY_FILE, str(key_file)) for a in args]
            try:
                done = subprocess.run(
                    [sys.executable, "-m", "dilocox", "train", *args],
                    capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, env=env,
                )  # fmt: skip
            except subprocess.TimeoutExpired:
                return Outcome(name, error=f"timed out after {timeout_s:.0f} s", wall_s=time.perf_counter() - start)
            log.append(done.stdout + done.stderr)
            if done.returncode != 0:
                return Outcome(name, error=cli_error(done), wall_s=time.perf_counter() - start)
        if keep is not None:
            import shutil

            shutil.copytree(run_dir, keep / name, dirs_exist_ok=True)
            (keep / name / "snapshot.log").write_text("\n".join(log))
        if len(invocations) > 1 and "dilocox: resuming from" not in log[-1]:
            return Outcome(name, error="the second call did not resume", wall_s=time.perf_counter() - start)
        try:
            fields = observe(run_dir)
        except (OSError, KeyError, IndexError, ValueError, RuntimeError) as exc:
            return Outcome(name, error=f"unreadable run directory: {exc!r}", wall_s=time.perf_counter() - start)
    return Outcome(name, fields=fields, wall_s=time.perf_counter() - start)


def cli_error(done: subprocess.CompletedProcess) -> str:
    """The CLI's one-line message (`dilocox: ...`), else the last line it printed, with the exit code."""
    lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
    said = [line for line in lines if line.startswith("dilocox:")]
    return f"exit {done.returncode}: {(said or lines or ['(no output)'])[-1]}"


def run_all(cases: dict[str, list[list[str]]], *, jobs: int, timeout_s: float, keep: Path | None) -> list[Outcome]:
    """Run the cases, `jobs` at a time, printing a line as each ends; outcomes in the order of `cases`."""
    outcomes: dict[str, Outcome] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {
            pool.submit(run_case, name, invocations, timeout_s=timeout_s, keep=keep): name
            for name, invocations in cases.items()
        }
        for future in concurrent.futures.as_completed(futures):
            outcome = future.result()
            outcomes[outcome.name] = outcome
            status = f"error: {outcome.error}" if outcome.error else "done"
            print(f"  {outcome.name:<24} {outcome.wall_s:6.1f} s  {status}", flush=True)
    return [outcomes[name] for name in cases]


# --------------------------------------------------------------------------------------------------------------
# Comparing


def canonical(value: Any) -> str:
    """The exact text of a JSON value (floats by `repr`, NaN included), for equality."""
    return json.dumps(value, sort_keys=True)


def describe(old: Any, new: Any) -> str:
    """old -> new, short; for two series of the same length, the first element that differs and how many do; for a
    digested metrics series, its last value or that it differs before it."""
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        differing = [i for i, (a, b) in enumerate(zip(old, new, strict=True)) if canonical(a) != canonical(b)]
        if differing:
            i = differing[0]
            return f"[{i}] {_short(old[i])} -> {_short(new[i])} ({len(differing)} of {len(old)} differ)"
    if isinstance(old, dict) and isinstance(new, dict) and {"sha256", "last"} <= old.keys() & new.keys():
        if canonical(old["last"]) != canonical(new["last"]):
            return f"last (step, value) {_short(old['last'])} -> {_short(new['last'])}"
        return f"the series differs before its last (step, value) {_short(old['last'])}"
    return f"{_short(old)} -> {_short(new)}"


def _short(value: Any, limit: int = 100) -> str:
    text = "(absent)" if value is _ABSENT else canonical(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_ABSENT = object()


def diff_fields(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """One line per field whose value differs between two recordings of a run (a field only one has included)."""
    lines = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, _ABSENT), new.get(key, _ABSENT)
        if a is _ABSENT or b is _ABSENT or canonical(a) != canonical(b):
            lines.append(f"{key}: {describe(a, b)}")
    return lines


def compare_outcome(recorded: dict[str, Any], outcome: Outcome) -> tuple[str, list[str]]:
    """("identical" | "DIFFERENT" | "ERROR", detail lines) for one run against its recorded entry."""
    if outcome.error or recorded.get("error"):
        if outcome.error and outcome.error == recorded.get("error"):
            return "identical", [f"(the same error as recorded: {outcome.error})"]
        if outcome.error:
            return "ERROR", [outcome.error]
        return "DIFFERENT", [f"recorded an error ({recorded['error']}); now it runs"]
    lines = diff_fields(recorded["fields"], outcome.fields)
    return ("DIFFERENT" if lines else "identical"), lines


# --------------------------------------------------------------------------------------------------------------
# Commands


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip()


def record(args: argparse.Namespace) -> int:
    known = {case.name: case for case in CASES}
    chosen = _chosen(args.only, known)
    if chosen is None:
        return 2
    cases = {name: known[name].invocations() for name in chosen}
    print(f"recording {len(cases)} runs, {args.jobs} at a time, code of {ROOT}")
    start = time.perf_counter()
    outcomes = run_all(cases, jobs=args.jobs, timeout_s=args.timeout, keep=args.keep)
    wall_s = time.perf_counter() - start
    out = Path(args.out)
    snapshot: dict[str, Any] = {"format": FORMAT, "runs": {}}
    if args.only and out.is_file():
        snapshot = json.loads(out.read_text())
    snapshot["recorded_with"] = {
        "commit": _git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "jobs": args.jobs,
        "runs": len(cases),
        "record_s": round(wall_s, 1),
    }
    for outcome in outcomes:
        entry: dict[str, Any] = {"what": known[outcome.name].what, "invocations": cases[outcome.name]}
        entry.update({"error": outcome.error} if outcome.error else {"fields": outcome.fields})
        snapshot["runs"][outcome.name] = entry
    runs = {case.name: snapshot["runs"][case.name] for case in CASES if case.name in snapshot["runs"]}
    snapshot = {"format": FORMAT, "recorded_with": snapshot["recorded_with"], "runs": runs}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dump_snapshot(snapshot) + "\n")
    failed = [o.name for o in outcomes if o.error]
    print(f"wrote {out}: {len(outcomes)} runs in {wall_s:.0f} s" + (f"; failed: {', '.join(failed)}" if failed else ""))
    twin = _elastic_twin_check(snapshot["runs"])
    if twin:
        print(twin)
    return 1 if failed else 0


def dump_snapshot(value: Any, depth: int = 0) -> str:
    """JSON with one line per run field (and per stored command), so a re-recording diffs field by field."""
    if depth >= 4 or not isinstance(value, dict | list) or not value:
        return json.dumps(value)
    pad = " " * (depth + 1)
    if isinstance(value, dict):
        items = [f"{pad}{json.dumps(key)}: {dump_snapshot(item, depth + 1)}" for key, item in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * depth + "}"
    items = [f"{pad}{dump_snapshot(item, depth + 1)}" for item in value]
    return "[\n" + ",\n".join(items) + "\n" + " " * depth + "]"


def _elastic_twin_check(runs: dict[str, Any]) -> str:
    """Whether the fault-free elastic run ended like its static twin (`TWIN_KEYS`)."""
    if not all("fields" in runs.get(name, {}) for name in ELASTIC_PAIR):
        return ""
    elastic, static = (runs[name]["fields"] for name in ELASTIC_PAIR)
    differing = [key for key in TWIN_KEYS if canonical(elastic.get(key)) != canonical(static.get(key))]
    if differing:
        return f"elastic vs {ELASTIC_PAIR[1]}: differ in {', '.join(differing)}"
    return f"elastic vs {ELASTIC_PAIR[1]}: identical ({', '.join(TWIN_KEYS)})"


def compare(args: argparse.Namespace) -> int:
    snapshot = json.loads(Path(args.against).read_text())
    if snapshot.get("format") != FORMAT:
        print(f"snapshot: {args.against} has format {snapshot.get('format')!r}, this script reads {FORMAT}")
        return 2
    recorded = snapshot["runs"]
    chosen = _chosen(args.only, recorded)
    if chosen is None:
        return 2
    cases = {name: recorded[name]["invocations"] for name in chosen}
    print(f"comparing {len(cases)} runs against {args.against}, {args.jobs} at a time, code of {ROOT}")
    outcomes = run_all(cases, jobs=args.jobs, timeout_s=args.timeout, keep=args.keep)
    counts: dict[str, int] = {}
    print()
    for outcome in outcomes:
        verdict, lines = compare_outcome(recorded[outcome.name], outcome)
        counts[verdict] = counts.get(verdict, 0) + 1
        print(f"{outcome.name:<24} {verdict}")
        for line in lines:
            print(f"    {line}")
    print("\n" + ", ".join(f"{n} {verdict}" for verdict, n in sorted(counts.items())))
    return 0 if counts.get("identical", 0) == len(outcomes) else 1


def _chosen(only: list[str] | None, known: dict[str, Any]) -> list[str] | None:
    if not only:
        return list(known)
    unknown = [name for name in only if name not in known]
    if unknown:
        print(f"snapshot: unknown run(s) {', '.join(unknown)}; runs: {', '.join(known)}")
        return None
    return [name for name in known if name in only]


def list_cases(args: argparse.Namespace) -> int:
    for case in CASES:
        print(f"{case.name:<24} {case.what}")
        for invocation in case.invocations():
            print(f"{'':<26}dilocox train {' '.join(a for a in invocation if a not in BASE_FLAGS)}")
    print(f"\n{len(CASES)} runs; every one also gets: {' '.join(BASE_FLAGS)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="run the cases and write the snapshot")
    rec.add_argument("--out", default="benchmarks/results/snapshot/snapshot.json")
    cmp_ = commands.add_parser("compare", help="run the recorded commands again and compare")
    cmp_.add_argument("--against", default="benchmarks/results/snapshot/snapshot.json")
    for sub in (rec, cmp_):
        sub.add_argument("--only", action="append", metavar="NAME", help="this run only (repeatable)")
        sub.add_argument("--jobs", type=int, default=2, help="runs at a time (results do not depend on it)")
        sub.add_argument("--timeout", type=float, default=900.0, help="seconds one `dilocox train` call may take")
        sub.add_argument("--keep", type=Path, default=None, help="copy each run directory and its output here")
    commands.add_parser("list", help="print the cases and their flags")
    args = parser.parse_args(argv)
    if getattr(args, "jobs", 1) < 1:
        parser.error("--jobs must be >= 1")
    return {"record": record, "compare": compare, "list": list_cases}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
