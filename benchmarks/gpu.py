"""How fast dilocox trains on the GPU of this machine, against a plain training loop of the same model.

    python benchmarks/gpu.py --quick         # few steps per run; the runs get 420 s (--budget-s): under 8 min
    python benchmarks/gpu.py                 # more steps per run, no time budget
    python benchmarks/gpu.py --cpu-smoke     # no GPU: the debug flavor on the CPU; its numbers are not reported

On the GPU it finds (cuda:0), for each flavor (`medium`, `qwen1.5-0.5b`):

1. the ceiling: a plain bf16 training loop of the same `Decoder` and batch, built by the trainer's own functions
   (`build_model`, `configure_compute`: bf16 autocast, sdpa; `build_inner_optimizer`: fused AdamW; gradient
   clipping), with `--compile` optional; random tokens of the run's vocabulary, no data loading, no sync;
2. `dilocox train --run.device=cuda --train.dtype=bf16`: two clusters of one rank each, both on this one GPU,
   for `sync.kind` dilocox (the dilocox-lowrank preset) and allreduce (the allreduce preset), with the slow link
   off (`network.bandwidth=unlimited`) and on (an emulated 1 Gbps / 10 ms link).

Reported per run: tokens/s per cluster (the steady state: the first logged window, which holds start-up, is left
out, and for dilocox the last one too, which holds the final flush of the delayed sync), MFU (6 N x the tokens/s of
both clusters, which share the GPU, against the device's dense bf16 peak from `PEAK_BF16_TFLOPS`; omitted, with the
reason, on an unknown device), peak memory (the plain loop: torch's peak allocated; a dilocox run: the device memory
NVML saw used, both ranks and their CUDA contexts together), GPU utilisation (NVML, or nvidia-smi, sampled during
the measured window), the share of the plain loop's tokens/s that both clusters reach together, and the hidden
share of the link time (1 - exposed / busy, from summary.json for the whole run and from the round records of the
measured window). Results go to `benchmarks/results/gpu/<device>/results.json` and `results.md` (`--out-dir`), and
are rewritten after every run, so a run cut short keeps what it measured.

Runs go in order of what they tell (plain loops, the slow-link runs, the rest; the qwen AllReduce over the slow
link, ~15 s of link per step, last); with `--budget-s` a run that would not fit in the time left is skipped and
listed, and a run that outlives its own limit is stopped and marked. Run directories (checkpoints included) go to
a scratch directory (`--scratch`; a tmpfs when one has room), removed at the end.

Without CUDA (or with `--cpu-smoke`) the same code runs on the CPU with the debug flavor and tiny sizes, into a
scratch directory: it proves the script works (tests/e2e/test_gpu_benchmark.py) and its numbers are not reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python benchmarks/gpu.py` from a checkout that is not installed
    sys.path.insert(0, str(ROOT))

FLAVORS = ("medium", "qwen1.5-0.5b")
KINDS = ("dilocox", "allreduce")
PRESET_OF = {"dilocox": "dilocox-lowrank", "allreduce": "allreduce"}
"""The preset each kind's runs start from."""
LINKS = {"off": ("unlimited", "0"), "on": ("1Gbps", "10ms")}
"""`network.bandwidth` and `network.latency` of each link setting."""

PEAK_BF16_TFLOPS: list[tuple[str, float, str]] = [
    (r"gh200", 989.4, "GH200 (H100 tensor cores)"),
    (r"h200.*nvl", 835.0, "H200 NVL"),
    (r"h200", 989.4, "H200 SXM"),
    (r"h100.*pcie", 756.0, "H100 PCIe"),
    (r"h100.*nvl", 835.0, "H100 NVL"),
    (r"h100", 989.4, "H100 SXM"),
    (r"h800.*pcie", 756.0, "H800 PCIe"),
    (r"h800", 989.4, "H800 SXM"),
    (r"b200", 2250.0, "B200"),
    (r"a100|a800", 312.0, "A100 / A800"),
    (r"l40s", 362.05, "L40S"),
    (r"l40\b", 181.05, "L40"),
    (r"\bl4\b", 121.0, "L4"),
    (r"\ba10\b", 125.0, "A10"),
]
"""Dense bf16 tensor-core peak (TFLOP/s, without sparsity) of NVIDIA data-center GPUs, from their data sheets, by a
pattern of `torch.cuda.get_device_name()` (lower case; the first match wins)."""

PLAIN_TOKENS_PER_S_H100 = {"medium": 421_695, "qwen1.5-0.5b": 66_878}
"""The plain loop measured on one H100 (bf16, batch 16 x 1,024 tokens): only to size the runs and their time limits
(`Sizes.estimate_s`), never reported."""


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The steps of one flavor's runs."""

    batch: int
    seq_len: int
    plain_steps: int
    plain_warmup: int
    inner_steps: int
    """H of the dilocox runs; their log interval, so that every logged window is one round."""
    dilocox_rounds: int
    """Rounds of a dilocox run: the first (start-up) and the last (final flush) are not measured."""
    allreduce_steps: dict[str, int]
    """Steps of an allreduce run per link setting."""
    allreduce_log: dict[str, int]
    """Its log interval per link setting (the first window is not measured)."""
    overhead_s: float
    """Start-up, evaluation, checkpoint and exit of one `dilocox train`, for the time budget."""

    def steps(self, kind: str, link: str) -> tuple[int, int]:
        """(train.steps, metrics.log_interval) of a run."""
        if kind == "dilocox":
            return self.inner_steps * self.dilocox_rounds, self.inner_steps
        return self.allreduce_steps[link], self.allreduce_log[link]

    def estimate_s(self, flavor: str, kind: str, link: str, num_params: int) -> float:
        """A generous guess of one run's seconds on an H100, from the plain loop's tokens/s there: two ranks share
        the GPU (each step costs two), plus the slow link's time of an AllReduce step (2 (C-1)/C x 4 N bytes at
        1 Gbps, C = 2)."""
        steps, _ = self.steps(kind, link)
        tokens_per_s = PLAIN_TOKENS_PER_S_H100.get(flavor, 50_000)
        step_s = 2 * self.batch * self.seq_len / tokens_per_s * 1.5
        if kind == "allreduce":
            step_s += 4 * num_params / 125e6 if link == "on" else 4 * num_params / 2e9
        return self.overhead_s + steps * step_s


SIZES: dict[str, dict[str, Sizes]] = {
    "quick": {
        "medium": Sizes(16, 1024, 30, 5, 10, 5, {"off": 20, "on": 6}, {"off": 5, "on": 2}, overhead_s=25),
        "qwen1.5-0.5b": Sizes(4, 1024, 20, 5, 5, 5, {"off": 6, "on": 2}, {"off": 2, "on": 1}, overhead_s=60),
    },
    "full": {
        "medium": Sizes(16, 1024, 200, 10, 20, 10, {"off": 100, "on": 20}, {"off": 10, "on": 5}, overhead_s=25),
        "qwen1.5-0.5b": Sizes(4, 1024, 60, 10, 10, 8, {"off": 20, "on": 6}, {"off": 5, "on": 2}, overhead_s=60),
    },
    "cpu-smoke": {
        "debug": Sizes(4, 64, 6, 2, 2, 3, {"off": 4, "on": 4}, {"off": 2, "on": 2}, overhead_s=10),
    },
}
"""Batches per flavor: qwen1.5-0.5b at 4 sequences, since two ranks (each with its fp32 weights, gradients, AdamW
and outer state, about 15 GB) must share the GPU; the plain loop uses the same batch."""


# ------------------------------------------------------------------------------------------------ the device
def peak_bf16_tflops(device_name: str) -> tuple[float | None, str]:
    """(dense bf16 peak TFLOP/s, the table row it came from) or (None, why there is none)."""
    name = device_name.lower()
    for pattern, tflops, label in PEAK_BF16_TFLOPS:
        if re.search(pattern, name):
            return tflops, label
    return None, f"no dense bf16 peak is known for {device_name!r} (add it to PEAK_BF16_TFLOPS or pass --peak-tflops)"


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


class Sampler:
    """Samples the GPU's utilisation (%) and used memory (bytes) every `interval_s` in a thread: NVML through
    nvidia-ml-py where it answers, else `nvidia-smi`, else nothing (`source` None and `reason` says why). It also
    notes when a watched metrics.jsonl gains lines, which marks a dilocox run's logged windows."""

    def __init__(self, enabled: bool, interval_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self.source: str | None = None
        self.reason = "no CUDA device"
        self._read: Callable[[], tuple[float, float]] | None = None
        self.driver: str | None = None
        self.device_name: str | None = None
        if enabled:
            self._connect()
        self.samples: list[tuple[float, float, float]] = []  # (unix time, util %, used bytes)
        self.line_times: list[float] = []  # unix time at which the watched file had 1, 2, ... lines
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: Path | None = None

    def _connect(self) -> None:
        index = _nvml_index()
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            pynvml.nvmlDeviceGetUtilizationRates(handle)
            self.driver = _text(pynvml.nvmlSystemGetDriverVersion())
            self.device_name = _text(pynvml.nvmlDeviceGetName(handle))

            def read_nvml() -> tuple[float, float]:
                util = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
                return float(util), float(pynvml.nvmlDeviceGetMemoryInfo(handle).used)

            self._read, self.source = read_nvml, "nvml"
            return
        except Exception as exc:  # not installed, or no NVML in this sandbox: try the command line tool
            nvml_problem = f"NVML: {exc.__class__.__name__}: {exc}"
        command = [
            "nvidia-smi",
            f"--id={index}",
            "--query-gpu=utilization.gpu,memory.used,driver_version,name",
            "--format=csv,noheader,nounits",
        ]

        def read_smi() -> tuple[float, float]:
            fields = subprocess.run(command, capture_output=True, text=True, timeout=10, check=True).stdout.split(",")
            return float(fields[0]), float(fields[1]) * 2**20

        try:
            read_smi()
            fields = subprocess.run(command, capture_output=True, text=True, timeout=10).stdout.split(",")
            self.driver, self.device_name = fields[2].strip(), fields[3].strip()
            self._read, self.source = read_smi, "nvidia-smi"
        except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
            self.reason = f"not available ({nvml_problem}; nvidia-smi: {exc.__class__.__name__})"

    def start(self, watch: Path | None = None) -> None:
        self.samples, self.line_times, self._watch = [], [], watch
        if self._read is None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="gpu-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            now = time.time()
            try:
                util, used = self._read()  # type: ignore[misc]
                self.samples.append((now, util, used))
            except Exception:  # a missed sample is not worth stopping the benchmark for
                pass
            if self._watch is not None and self._watch.exists():
                lines = self._watch.read_bytes().count(b"\n")
                while len(self.line_times) < lines:
                    self.line_times.append(now)
            self._stop.wait(self.interval_s)

    def utilisation(self, start: float | None, end: float | None) -> float | str:
        """Mean utilisation (%) of the samples in [start, end], or why there is none."""
        if self._read is None:
            return self.reason
        if start is None or end is None:
            return "not available (no measured window)"
        window = [util for t, util, _ in self.samples if start <= t <= end]
        return round(statistics.fmean(window), 1) if window else "not available (no sample in the measured window)"

    def peak_used_gib(self) -> float | str:
        if self._read is None:
            return self.reason
        return round(max(used for _, _, used in self.samples) / 2**30, 2) if self.samples else "not available"


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_index() -> int:
    """cuda:0's index among all GPUs, when CUDA_VISIBLE_DEVICES names it by number (else 0)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return int(visible) if visible.isdigit() else 0


# ------------------------------------------------------------------------------------------------ the plain loop
def plain_loop(spec: dict[str, Any]) -> dict[str, Any]:
    """The ceiling (runs in a child process, so the parent never holds a CUDA context): fwd + bwd + clip + fused
    AdamW of the run's model in bf16, timed after `warmup` steps; returns the numbers and the device's identity."""
    import torch

    from dilocox.config import Config
    from dilocox.trainer import build_inner_optimizer, build_model, configure_compute, prepare_data

    torch.set_num_threads(spec["num_threads"])
    device = torch.device(spec["device"])
    cfg = Config()
    cfg.run.device, cfg.run.seed = device.type, 0
    cfg.model.flavor = spec["flavor"]
    cfg.train.seq_len, cfg.train.micro_batch_size = spec["seq_len"], spec["batch"]
    cfg.train.dtype, cfg.train.compile = "bf16", spec["compile"]
    vocab_size = prepare_data(cfg).vocab_size  # the tokenizer of the dilocox runs: the same Decoder
    model = build_model(cfg, vocab_size, device=device)
    configure_compute(model, cfg)
    optimizer = build_inner_optimizer(cfg, model)
    generator = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, vocab_size, (spec["batch"], spec["seq_len"] + 1), device=device, generator=generator)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # (batch, seq) each, as batches are
    from dilocox.parallel.pipeline import mean_token_cross_entropy

    def step() -> torch.Tensor:
        loss = mean_token_cross_entropy(model(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    first = float(step())
    for _ in range(spec["warmup"] - 1):
        step()
    synchronize()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    window_start, start = time.time(), time.perf_counter()
    for _ in range(spec["steps"]):
        last = step()
    synchronize()
    elapsed = time.perf_counter() - start
    result = {
        "tokens_per_s": spec["steps"] * spec["batch"] * spec["seq_len"] / elapsed,
        "step_s": elapsed / spec["steps"],
        "num_params": sum(p.numel() for p in model.parameters()),
        "vocab_size": vocab_size,
        "first_loss": first,
        "last_loss": float(last),
        "window_start": window_start,
        "window_end": time.time(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        result.update(
            device_name=torch.cuda.get_device_name(device),
            capability=f"{props.major}.{props.minor}",
            total_memory_gib=round(props.total_memory / 2**30, 1),
            peak_memory_gib=round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
            peak_reserved_gib=round(torch.cuda.max_memory_reserved(device) / 2**30, 2),
        )
    else:
        result.update(device_name=f"CPU ({platform.processor() or platform.machine()})", peak_memory_gib=None)
    return result


# ------------------------------------------------------------------------------------------------ the runs
def metrics_windows(records: list[dict[str, Any]], *, drop_last: bool) -> list[dict[str, Any]]:
    """The logged windows that measure the steady state: all but the first (start-up), and with `drop_last` all
    but the last (the final flush). Each has its step, tokens and tokens/s (all clusters)."""
    windows = records[1:]
    if drop_last:
        windows = windows[:-1]
    return windows


def steady_tokens_per_s(records: list[dict[str, Any]], windows: list[dict[str, Any]]) -> float | None:
    """Tokens of the windows over their time (each window's tokens/s covers it alone, evaluation excluded)."""
    previous = {id(r): p for p, r in zip(records, records[1:], strict=False)}
    tokens = seconds = 0.0
    for record in windows:
        span = record["tokens"] - previous[id(record)]["tokens"]
        tokens += span
        seconds += span / record["tokens_per_s"]
    return tokens / seconds if seconds > 0 else None


def hidden_share_of_rounds(windows: list[dict[str, Any]]) -> float | None:
    """1 - exposed / link time of the syncs waited for in the measured windows (dilocox's round records)."""
    link = sum(r.get("round_link_s", 0.0) for r in windows)
    exposed = sum(r.get("round_exposed_s", 0.0) for r in windows)
    return round(min(1.0, max(0.0, 1.0 - exposed / link)), 3) if link > 0 else None


class Benchmark:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cpu = args.cpu_smoke
        self.mode = "cpu-smoke" if self.cpu else ("quick" if args.quick else "full")
        self.sizes = SIZES[self.mode]
        self.flavors = list(self.sizes) if self.cpu else args.flavors
        self.device = "cpu" if self.cpu else "cuda"
        self.started = time.monotonic()
        self.budget_s = args.budget_s if args.budget_s is not None else (420.0 if args.quick else None)
        self.sampler = Sampler(enabled=not self.cpu)
        self.scratch = Path(args.scratch) if args.scratch else scratch_dir(big=not self.cpu)
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": _python_path()}
        self.own_cache = "DILOCOX_CACHE" not in self.env  # the tokenizer cache of the runs, removed at the end
        self.env.setdefault("DILOCOX_CACHE", str(self.scratch / "cache"))
        if self.device == "cuda":
            self.env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        self.results: dict[str, Any] = {
            "mode": self.mode,
            "reported": not self.cpu,
            "note": (
                "CPU smoke run of the benchmark script with the debug flavor: its numbers are not reported"
                if self.cpu
                else "two clusters of one rank each share one GPU; see the header of benchmarks/gpu.py"
            ),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "commit": _git_commit(),
            "device": {"kind": self.device, "name": None, "slug": None},  # named by `name_device`
            "settings": {
                "num_clusters": 2,
                "dtype": "bf16",
                "compile": args.compile,
                "links": {k: {"bandwidth": b, "latency": lat} for k, (b, lat) in LINKS.items()},
                "sizes": {f: dataclasses.asdict(s) for f, s in self.sizes.items() if f in self.flavors},
                "budget_s": self.budget_s,
            },
            "gpu_sampling": self.sampler.source or self.sampler.reason,
            "plain": [],
            "runs": [],
        }
        self.out_dir: Path | None = Path(args.out_dir) if args.out_dir else None
        if self.cpu:
            self.name_device(f"CPU ({platform.processor() or platform.machine()})")
        elif self.sampler.device_name:
            self.name_device(self.sampler.device_name)

    # -------------------------------------------------------------------------------------------- time budget
    def left_s(self) -> float | None:
        return None if self.budget_s is None else self.budget_s - (time.monotonic() - self.started)

    def limit_s(self, estimate_s: float) -> float | None:
        """A run's time limit: three times its estimate, within what is left of the budget; None: the run does not
        fit and is skipped."""
        left = self.left_s()
        if left is None:
            return max(300.0, 3 * estimate_s)
        if left < estimate_s:
            return None
        return min(left, max(90.0, 3 * estimate_s))

    # -------------------------------------------------------------------------------------------- steps
    def run(self) -> Path:
        for flavor in self.flavors:
            self.measure_plain(flavor)
        order = [("on", "dilocox"), ("on", "allreduce"), ("off", "dilocox"), ("off", "allreduce")]
        plan = [
            (f, k, link) for f in self.flavors for link, k in order if k in self.args.kinds and link in self.args.links
        ]
        # the most expensive run, a big model's AllReduce over the slow link, goes last
        plan.sort(key=lambda r: (r[0] != self.flavors[0], r[1] == "allreduce" and r[2] == "on"))
        for flavor, kind, link in plan:
            self.measure_run(flavor, kind, link)
        if self.results["device"]["name"] is None:  # no NVML, no nvidia-smi, and no plain loop ran
            self.name_device("unknown CUDA device")
        path = self.write()
        if not self.args.keep_runs:
            shutil.rmtree(self.scratch / "runs", ignore_errors=True)
            if self.own_cache:
                shutil.rmtree(self.scratch / "cache", ignore_errors=True)
            if not any(self.scratch.iterdir()):
                self.scratch.rmdir()
        return path

    def measure_plain(self, flavor: str) -> None:
        s = self.sizes[flavor]
        entry: dict[str, Any] = {"flavor": flavor, "batch": s.batch, "seq_len": s.seq_len, "steps": s.plain_steps}
        spec = {
            "flavor": flavor,
            "batch": s.batch,
            "seq_len": s.seq_len,
            "steps": s.plain_steps,
            "warmup": s.plain_warmup,
            "device": self.device,
            "compile": self.args.compile,
            "num_threads": 1 if self.cpu else 4,
        }
        limit = self.limit_s(60.0 + (0 if self.cpu else 60.0 * self.args.compile))
        if limit is None:
            entry["status"] = "skipped: not enough of the time budget left"
            self.results["plain"].append(entry)
            return
        print(f"plain loop: {flavor}, batch {s.batch} x {s.seq_len}, {s.plain_steps} steps", flush=True)
        self.sampler.start()
        started = time.monotonic()
        try:
            proc = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--plain-child", json.dumps(spec)],
                capture_output=True,
                text=True,
                env=self.env,
                cwd=ROOT,
                timeout=limit,
            )
            ok = proc.returncode == 0
            error = None if ok else _tail(proc.stderr)
        except subprocess.TimeoutExpired:
            proc, ok, error = None, False, f"timed out after {limit:.0f} s"
        finally:
            self.sampler.stop()
        entry["wall_s"] = round(time.monotonic() - started, 1)
        if not ok or proc is None:
            entry.update(status="failed", error=error)
            self.results["plain"].append(entry)
            print(f"  failed: {error}", flush=True)
            return
        measured = json.loads(proc.stdout.strip().splitlines()[-1])
        self.note_device(measured)
        entry.update(
            status="ok",
            num_params=measured["num_params"],
            vocab_size=measured["vocab_size"],
            tokens_per_s=round(measured["tokens_per_s"], 1),
            step_s=round(measured["step_s"], 4),
            mfu=self.mfu(measured["num_params"], measured["tokens_per_s"]),
            peak_memory_gib=measured["peak_memory_gib"],
            peak_reserved_gib=measured.get("peak_reserved_gib"),
            gpu_util_pct=self.sampler.utilisation(measured["window_start"], measured["window_end"]),
            loss=[round(measured["first_loss"], 3), round(measured["last_loss"], 3)],
        )
        self.results["plain"].append(entry)
        print(f"  {entry['tokens_per_s']:,.0f} tokens/s, MFU {entry['mfu']}", flush=True)
        self.write()

    def measure_run(self, flavor: str, kind: str, link: str) -> None:
        s = self.sizes[flavor]
        steps, log_interval = s.steps(kind, link)
        bandwidth, latency = LINKS[link]
        entry: dict[str, Any] = {
            "flavor": flavor,
            "sync_kind": kind,
            "link": link,
            "bandwidth": bandwidth,
            "latency": latency,
            "batch": s.batch,
            "seq_len": s.seq_len,
            "steps": steps,
            "log_interval": log_interval,
        }
        if kind == "dilocox":
            entry["inner_steps"] = s.inner_steps
        plain = next((p for p in self.results["plain"] if p["flavor"] == flavor and p["status"] == "ok"), None)
        num_params = plain["num_params"] if plain else _flavor_params(flavor)
        estimate = s.estimate_s(flavor, kind, link, num_params)
        limit = self.limit_s(estimate)
        if limit is None:
            entry["status"] = (
                f"skipped: {self.left_s():.0f} s of the time budget left, the run needs about {estimate:.0f} s"
            )
            self.results["runs"].append(entry)
            print(f"{flavor} {kind} link {link}: {entry['status']}", flush=True)
            self.write()
            return
        run_dir = self.scratch / "runs" / f"{slug(flavor)}-{kind}-link-{link}"
        command = [
            sys.executable, "-m", "dilocox", "train",
            f"--run.out_dir={run_dir}", "--run.overwrite=true", f"--run.device={self.device}",
            f"--run.num_threads={1 if self.cpu else 2}", "--run.seed=0",
            f"--model.flavor={flavor}", "--train.dtype=bf16", f"--train.compile={str(self.args.compile).lower()}",
            f"--train.seq_len={s.seq_len}", f"--train.micro_batch_size={s.batch}", f"--train.steps={steps}",
            f"--train.warmup_steps={max(1, min(steps - 1, steps // 5))}",
            "--topology.num_clusters=2", f"--preset={PRESET_OF[kind]}", f"--sync.inner_steps={s.inner_steps}",
            f"--network.bandwidth={bandwidth}", f"--network.latency={latency}",
            "--eval.interval=0", "--eval.max_batches=1", "--eval.final_max_batches=1",
            "--checkpoint.interval=0", "--checkpoint.keep=1",
            f"--metrics.log_interval={log_interval}", "--metrics.progress=false",
        ]  # fmt: skip
        print(f"{flavor} {kind} link {link}: {steps} steps (limit {limit:.0f} s)", flush=True)
        self.sampler.start(watch=run_dir / "metrics.jsonl")
        started = time.monotonic()
        try:
            returncode, output = _run_in_session(command, env=self.env, timeout_s=limit)
        finally:
            self.sampler.stop()
        entry["wall_s"] = round(time.monotonic() - started, 1)
        if returncode != 0:
            why = "timed out" if returncode is None else f"exit {returncode}"
            entry.update(status=f"failed ({why})", error=_tail(output))
            print(f"  {entry['status']}: {_tail(output, 300)}", flush=True)
        else:
            try:
                entry.update(status="ok", **self.read_run(run_dir, kind, plain))
            except (OSError, ValueError, KeyError, IndexError) as exc:  # a run that ended without its records
                entry.update(status=f"failed (its records: {exc!r})", error=_tail(output))
        if entry["status"] == "ok":
            print(
                f"  {entry['tokens_per_s_per_cluster']} tokens/s per cluster, share of plain {entry['share_of_plain']}"
                f", hidden link {_pct(entry['hidden_share_run'])}",
                flush=True,
            )
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # gigabytes for the big flavor
        self.results["runs"].append(entry)
        self.write()

    def read_run(self, run_dir: Path, kind: str, plain: dict[str, Any] | None) -> dict[str, Any]:
        from dilocox.metrics import read_metrics

        summary = json.loads((run_dir / "summary.json").read_text())
        records = read_metrics(run_dir)
        windows = metrics_windows(records, drop_last=kind == "dilocox")
        total = steady_tokens_per_s(records, windows)
        clusters = summary["num_clusters"]
        # the measured windows run from the first record (line 1 of metrics.jsonl) to record len(windows)
        times = self.sampler.line_times
        window_start = times[0] if windows and times else None
        window_end = times[len(windows)] if windows and len(times) > len(windows) else None
        return {
            "num_params": summary["num_params"],
            "measured_steps": windows[-1]["step"] - records[0]["step"] if windows else 0,
            "tokens_per_s_per_cluster": None if total is None else round(total / clusters, 1),
            "tokens_per_s_total": None if total is None else round(total, 1),
            "mfu": None if total is None else self.mfu(summary["num_params"], total),
            "share_of_plain": round(total / plain["tokens_per_s"], 3) if plain and total else None,
            "hidden_share_run": summary["hidden_comm_fraction"],
            "hidden_share_measured": hidden_share_of_rounds(windows),
            "link_busy_s": round(summary["link_busy_s"], 3),
            "exposed_comm_s": round(summary["exposed_comm_s"], 3),
            "wan_bytes_total": summary["wan_bytes_total"],
            "allreduce_equiv_bytes": summary["allreduce_equiv_bytes"],
            "peak_memory_gib": self.sampler.peak_used_gib(),
            "gpu_util_pct": self.sampler.utilisation(window_start, window_end),
            "final_eval_loss": summary["final_eval_loss"],
            "summary_tokens_per_s": round(summary["tokens_per_s"], 1),
        }

    # -------------------------------------------------------------------------------------------- results
    def name_device(self, name: str) -> None:
        """Name the device (from NVML or nvidia-smi at the start, else from the first plain loop) and look up its
        bf16 peak; the results directory is named after it."""
        peak, source = peak_bf16_tflops(name) if not self.cpu else (None, "a CPU has no bf16 tensor-core peak here")
        if self.args.peak_tflops is not None:
            peak, source = self.args.peak_tflops, "--peak-tflops"
        self.results["device"].update(
            name=name,
            slug="cpu" if self.cpu else slug(name),
            driver=self.sampler.driver,
            python=platform.python_version(),
            bf16_peak_tflops=peak,
            peak_source=source if peak is not None else None,
            mfu_omitted=None if peak is not None else source,
        )

    def note_device(self, measured: dict[str, Any]) -> None:
        """What the plain loop's process saw of the device: its CUDA name, capability, memory, torch and CUDA."""
        if self.results["device"]["name"] is None:
            self.name_device(measured["device_name"])
        self.results["device"].update(
            {key: measured.get(key) for key in ("capability", "total_memory_gib", "torch", "cuda")}
        )
        if not self.cpu:
            self.results["device"]["cuda_name"] = measured["device_name"]

    def mfu(self, num_params: int, tokens_per_s: float) -> float | None:
        peak = self.results["device"].get("bf16_peak_tflops")
        return None if not peak else round(6 * num_params * tokens_per_s / (peak * 1e12), 4)

    def write(self) -> Path:
        device = self.results["device"]
        if self.out_dir is None:
            if device["slug"] is None:
                return self.scratch  # nothing measured yet to name the directory by
            self.out_dir = (
                self.scratch / "results" if self.cpu else ROOT / "benchmarks" / "results" / "gpu" / device["slug"]
            )
            print(f"results go to {self.out_dir}", flush=True)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.results["wall_s"] = round(time.monotonic() - self.started, 1)
        _write_atomic(self.out_dir / "results.json", json.dumps(self.results, indent=2) + "\n")
        _write_atomic(self.out_dir / "results.md", markdown(self.results))
        return self.out_dir


def markdown(results: dict[str, Any]) -> str:
    device = results["device"]
    title = device["name"] or "no device measured"
    lines = [f"# GPU benchmark: {title}", ""]
    if not results["reported"]:
        lines += [f"**{results['note']}.**", ""]
    peak = device.get("bf16_peak_tflops")
    peak_text = (
        f"bf16 peak {peak:g} TFLOP/s ({device['peak_source']})" if peak else f"MFU omitted: {device.get('mfu_omitted')}"
    )
    lines += [
        f"{results['mode']} mode, {results['date']}, commit {results['commit']}; torch {device.get('torch')} "
        f"(CUDA {device.get('cuda')}), driver {device.get('driver')}; {peak_text}. `{results['command']}`",
        "",
        f"Two clusters of one rank each share the device (`dilocox train --run.device={device['kind']} "
        "--train.dtype=bf16`); the plain loop's row gives its own tokens/s. "
        "Tokens/s are the steady state (first logged window left out; for dilocox the last too, the final flush). "
        "MFU = 6 N x the tokens/s of both clusters / the bf16 peak. Share = both clusters' tokens/s / the plain "
        "loop's. Hidden = 1 - exposed / busy link time (the run's summary.json; the measured rounds in brackets). "
        "Memory: the plain loop's torch peak allocated; a dilocox run's device memory used (both ranks, CUDA "
        f"contexts included). GPU util: mean over the measured window ({results['gpu_sampling']}).",
        "",
        "| flavor | params | run | link | batch x seq | tokens/s per cluster | MFU | share of plain | hidden link "
        "| peak memory GiB | GPU util % | steps | status |",
        "| --- | ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for entry in results["plain"]:
        lines.append(
            f"| {entry['flavor']} | {_millions(entry.get('num_params'))} | plain loop | - | "
            f"{entry['batch']} x {entry['seq_len']} | {_num(entry.get('tokens_per_s'))} | {_pct(entry.get('mfu'))} | "
            f"1 | - | {_num(entry.get('peak_memory_gib'), 2)} | {_num(entry.get('gpu_util_pct'), 1)} | "
            f"{entry['steps']} | {entry['status']} |"
        )
    for entry in results["runs"]:
        hidden = entry.get("hidden_share_run")
        hidden_text = "-" if hidden is None else f"{hidden:.0%}"
        if entry.get("hidden_share_measured") is not None:
            hidden_text += f" ({entry['hidden_share_measured']:.0%})"
        link = "off" if entry["link"] == "off" else f"{entry['bandwidth']} / {entry['latency']}"
        run = entry["sync_kind"] + (f" H={entry['inner_steps']}" if "inner_steps" in entry else "")
        lines.append(
            f"| {entry['flavor']} | {_millions(entry.get('num_params'))} | {run} | {link} | "
            f"{entry['batch']} x {entry['seq_len']} | {_num(entry.get('tokens_per_s_per_cluster'))} | "
            f"{_pct(entry.get('mfu'))} | {_num(entry.get('share_of_plain'), 3)} | {hidden_text} | "
            f"{_num(entry.get('peak_memory_gib'), 2)} | {_num(entry.get('gpu_util_pct'), 1)} | {entry['steps']} | "
            f"{entry['status']} |"
        )
    failures = [e for e in results["plain"] + results["runs"] if e.get("error")]
    if failures:
        lines += ["", "Errors (last lines):", ""]
        for entry in failures:
            name = f"{entry['flavor']} {entry.get('sync_kind', 'plain loop')} {entry.get('link', '')}".strip()
            lines += [f"- {name}:", "", "```", entry["error"].strip(), "```", ""]
    return "\n".join(lines).rstrip() + "\n"


# ------------------------------------------------------------------------------------------------ helpers
def _num(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value:,.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _millions(value: int | None) -> str:
    return "-" if value is None else f"{value / 1e6:.1f}M"


def _tail(text: str, limit: int = 3000) -> str:
    return text[-limit:] if text else ""


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _python_path() -> str:
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return os.pathsep.join(dict.fromkeys(paths))


def _flavor_params(flavor: str) -> int:
    from dilocox.models import count_parameters, model_args

    return count_parameters(model_args(flavor, vocab_size=2048))


def scratch_dir(*, big: bool) -> Path:
    """A new scratch directory: on /dev/shm when `big` and it has room for the big flavor's checkpoints (tmpfs:
    writing them costs seconds instead of tens), else in the temporary directory."""
    root = None
    if big and Path("/dev/shm").is_dir():
        try:
            if shutil.disk_usage("/dev/shm").free > 40 * 2**30:
                root = "/dev/shm"
        except OSError:
            pass
    return Path(tempfile.mkdtemp(prefix="dilocox-gpu-bench-", dir=root))


def _run_in_session(command: list[str], *, env: dict[str, str], timeout_s: float) -> tuple[int | None, str]:
    """Run `command` in its own process session; past `timeout_s` stop its whole session (the launcher and its
    ranks: SIGTERM, then SIGKILL) and return None as the exit code. Returns (code, output)."""
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
            for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
        log.seek(0)
        return code, log.read()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="few steps per run, within --budget-s (default 420 s)")
    parser.add_argument("--cpu-smoke", action="store_true", help="the debug flavor on the CPU (automatic without CUDA)")
    parser.add_argument("--flavors", type=_names(FLAVORS), default=list(FLAVORS), help="comma-separated flavors")
    parser.add_argument("--kinds", type=_names(KINDS), default=list(KINDS), help="comma-separated sync kinds")
    parser.add_argument("--links", type=_names(tuple(LINKS)), default=list(LINKS), help="off,on")
    parser.add_argument("--compile", action="store_true", help="torch.compile the blocks (plain loop and runs)")
    parser.add_argument("--budget-s", type=float, default=None, help="seconds for all runs; later runs are skipped")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak, TFLOP/s")
    parser.add_argument("--out-dir", default=None, help="where results.json and results.md go")
    parser.add_argument("--scratch", default=None, help="where the run directories go (default: a new temp dir)")
    parser.add_argument("--keep-runs", action="store_true", help="keep the run directories (checkpoints removed)")
    parser.add_argument("--plain-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plain_child is not None:
        print(json.dumps(plain_loop(json.loads(args.plain_child))))
        return 0
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("no CUDA device: running the CPU smoke run (debug flavor; its numbers are not reported)", flush=True)
        args.cpu_smoke = True
    benchmark = Benchmark(args)
    path = benchmark.run()
    results = benchmark.results
    failed = [e for e in results["plain"] + results["runs"] if e["status"].startswith("failed")]
    print(f"wrote {path / 'results.json'} and results.md ({len(failed)} failed)", flush=True)
    if results["reported"] is False:
        print("CPU smoke run: these numbers are not reported", flush=True)
    return 1 if failed else 0


def _names(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in names if name not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(choices)}")
        return names

    return parse


if __name__ == "__main__":
    sys.exit(main())
