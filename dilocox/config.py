"""The run configuration: a tree of dataclasses, loaded from TOML and overridden by dotted flags.

Precedence is defaults < `--config FILE` < `--section.key=value` flags. Every field has a working default and a
one-line docstring right under it; the docstrings are what `dilocox train --help` prints.

    cfg = load_config("configs/debug.toml", ["--sync.inner_steps=10"])
    cfg.validate(world_size=4)
    (run_dir / "config.toml").write_text(to_toml(cfg))
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SYNC_KINDS = ("allreduce", "cocktail", "diloco", "dilocox")
MERGE_RULES = ("reset", "keep_local")
COMPRESSION_KINDS = ("none", "fp16", "bf16", "int4", "lowrank", "lowrank_int4", "adaptive")
REDUCTIONS = ("gather", "scalable")
RANK_SCHEDULES = ("spectrum", "early_strong", "late_strong")
OPTIMIZERS = ("adamw", "sgd")
PIPELINE_SCHEDULES = ("gpipe", "1f1b")


@dataclass
class RunConfig:
    out_dir: str = "runs/dilocox"
    """Run directory: config.toml, metrics.jsonl, summary.json, tokenizer.json and checkpoints/ go here."""
    seed: int = 0
    """Seed of the model initialization, data order and dropout-free RNG state."""
    overwrite: bool = False
    """Replace an existing run directory instead of refusing to start (resuming never needs this)."""
    num_threads: int = 1
    """CPU threads per rank (torch.set_num_threads); keep ranks x threads <= cores."""


@dataclass
class ModelConfig:
    flavor: str = "tiny"
    """Model shape by name: debug, tiny, small, medium, qwen1.5-0.5b ... qwen1.5-107b (`dilocox flavors` lists them)."""


@dataclass
class DataConfig:
    path: str = ""
    """Training text: a .txt/.md/.jsonl/.parquet file, a directory or a glob; empty = the embedded Shakespeare."""
    tokenizer: str = ""
    """A tokenizer.json to use; empty = train a byte-level BPE of data.vocab_size on the corpus (cached)."""
    vocab_size: int = 2048
    """Vocabulary size of the locally trained BPE (ignored when data.tokenizer is given)."""
    val_fraction: float = 0.05
    """Share of the documents held out for validation (of the tokens, for a single document)."""
    text_field: str = "text"
    """Field that holds the text in .jsonl records and .parquet columns."""


@dataclass
class TrainConfig:
    steps: int = 400
    """Inner steps every rank runs (tokens per rank = steps x micro_batch_size x seq_len)."""
    seq_len: int = 256
    """Tokens per training sequence."""
    micro_batch_size: int = 8
    """Sequences per data-parallel rank (one pipeline) per step."""
    num_microbatches: int = 0
    """Pipeline microbatches per step (they split micro_batch_size); 0 = pp_degree."""
    pipeline_schedule: str = "1f1b"
    """Pipeline schedule when pp_degree > 1: 1f1b or gpipe."""
    lr: float = 2e-3
    """Peak learning rate of the inner optimizer."""
    warmup_steps: int = 20
    """Linear warm-up steps of the inner learning rate."""
    min_lr_ratio: float = 0.1
    """The cosine schedule decays the inner learning rate to lr x min_lr_ratio at the last step."""
    optimizer: str = "adamw"
    """Inner optimizer: adamw, or sgd (plain, for equivalence checks)."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the gradient norm to this value before every inner step; 0 disables clipping."""


@dataclass
class TopologyConfig:
    num_clusters: int = 2
    """Clusters joined by the slow link (C)."""
    dp_degree: int = 1
    """Data-parallel replicas inside each cluster (D), joined by a fast link."""
    pp_degree: int = 1
    """Pipeline stages inside each cluster (P); world size = C x D x P."""


@dataclass
class SyncConfig:
    kind: str = "diloco"
    """Strategy: allreduce, cocktail (compressed every step), diloco (H local steps + outer sync), dilocox."""
    inner_steps: int = 50
    """H: local inner steps between two outer syncs (diloco)."""
    outer_lr: float = 0.7
    """Learning rate of the outer SGD applied to the averaged pseudo-gradient (dilocox: 1.0 unless set)."""
    outer_momentum: float = 0.9
    """Momentum of the outer SGD (dilocox: 0, plain averaging, unless set)."""
    nesterov: bool = True
    """Use Nesterov momentum in the outer SGD."""
    sync_delay: int = 0
    """Rounds between launching an outer sync and applying it: 0 = blocking, 1 = overlapped (dilocox: 1 unless set)."""
    merge: str = "keep_local"
    """With sync_delay 1, where a round starts: keep_local (outer params plus own last progress) or reset."""


@dataclass
class CompressionConfig:
    kind: str = "none"
    """Pseudo-gradient codec: none (fp32), fp16, bf16, int4, lowrank, lowrank_int4, adaptive (dilocox: adaptive)."""
    rank: int = 8
    """Factors per matrix of lowrank and lowrank_int4."""
    group_size: int = 64
    """Values per fp16 scale in int4 encodings."""
    stochastic_rounding: bool = False
    """Round int4 values stochastically (unbiased) instead of to nearest."""
    error_feedback: bool = True
    """Add what the codec lost to the next round's pseudo-gradient."""
    rank_min: int = 2
    """adaptive: the smallest rank it may choose."""
    rank_max: int = 32
    """adaptive: the largest rank it may choose."""
    energy: float = 0.9
    """adaptive: share of the pseudo-gradient's spectral energy the chosen rank keeps."""
    window: int = 4
    """adaptive: rounds over which the chosen rank is smoothed."""
    schedule: str = "spectrum"
    """adaptive: spectrum (energy as set), early_strong or late_strong (energy target ramps up or down)."""
    ramp_rounds: int = 100
    """adaptive: rounds over which early_strong / late_strong ramp the energy target."""
    reduction: str = "gather"
    """Averaging of payloads: gather ((C-1) x payload per rank, any codec) or scalable (~2 x payload; not adaptive)."""
    fit_link: bool = False
    """With sync_delay 1: raise H each round so that one sync's measured link time fits in the next round's compute."""
    fit_link_max_steps: int = 0
    """fit_link: the largest H it may choose; 0 = 8 x sync.inner_steps."""
    sample_ratio: float = 0.1
    """cocktail: share of the gradient randomly sampled each step (the same sample on every cluster)."""
    topk_ratio: float = 0.01
    """cocktail: share of the gradient sent (the largest of the sample), as int4 values with positions."""


@dataclass
class NetworkConfig:
    bandwidth: str = "1Gbps"
    """Uplink bandwidth of one cluster, shared by its ranks that sync at once: e.g. 1Gbps, 100Mbps, unlimited."""
    latency: str = "10ms"
    """One-way latency added to every slow-link collective: e.g. 10ms, 0."""


@dataclass
class EvalConfig:
    interval: int = 50
    """Evaluate the validation loss every this many steps (and at the end); 0 = only at the end."""
    max_batches: int = 8
    """Validation batches (micro_batch_size x seq_len tokens each) per evaluation; 0 = the whole split."""


@dataclass
class CheckpointConfig:
    interval: int = 100
    """Save a checkpoint every this many steps (diloco: a multiple of H unless fit_link) and at the end; 0 = end."""
    keep: int = 2
    """Keep the newest this many checkpoints; older ones are deleted."""
    resume: str = ""
    """Resume from `latest` (the newest complete checkpoint of run.out_dir) or a checkpoint directory."""


@dataclass
class MetricsConfig:
    log_interval: int = 10
    """Write a metrics.jsonl line every this many steps."""
    progress: bool = True
    """Show a progress bar when the launching terminal is interactive (plain log lines otherwise)."""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    @property
    def microbatches(self) -> int:
        """Resolved `train.num_microbatches` (0 means one per pipeline stage)."""
        return self.train.num_microbatches or self.topology.pp_degree

    @property
    def world_size(self) -> int:
        t = self.topology
        return t.num_clusters * t.dp_degree * t.pp_degree

    def validate(self, world_size: int | None = None) -> None:
        """Raise ValueError naming the first impossible or contradictory setting and how to fix it."""
        from dilocox.net.link import parse_bandwidth, parse_duration

        _positive(self, "run.num_threads", "train.steps", "train.seq_len", "train.micro_batch_size")
        _positive(self, "topology.num_clusters", "topology.dp_degree", "topology.pp_degree", "sync.inner_steps")
        _positive(self, "data.vocab_size", "metrics.log_interval", "checkpoint.keep")
        _non_negative(self, "train.warmup_steps", "train.weight_decay", "train.grad_clip", "run.seed")
        _non_negative(self, "eval.interval", "eval.max_batches", "checkpoint.interval", "sync.outer_momentum")
        _finite(self)
        from dilocox.models import list_flavors

        _choice("model.flavor", self.model.flavor, tuple(list_flavors()))
        _choice("train.optimizer", self.train.optimizer, OPTIMIZERS)
        _choice("sync.kind", self.sync.kind, SYNC_KINDS)
        _choice("compression.kind", self.compression.kind, COMPRESSION_KINDS)
        _choice("compression.schedule", self.compression.schedule, RANK_SCHEDULES)
        _positive(self, "compression.rank", "compression.group_size", "compression.rank_min", "compression.window")
        _positive(self, "compression.ramp_rounds")
        if self.compression.rank_max < self.compression.rank_min:
            raise ValueError(
                f"compression.rank_max = {self.compression.rank_max} is below compression.rank_min = "
                f"{self.compression.rank_min}"
            )
        _choice("compression.reduction", self.compression.reduction, REDUCTIONS)
        _non_negative(self, "compression.fit_link_max_steps")
        if self.compression.reduction == "scalable" and self.compression.kind == "adaptive":
            raise ValueError(
                "compression.reduction = 'scalable' needs one rank that every cluster agrees on before a sync starts, "
                "but compression.kind = 'adaptive' picks it from each cluster's own spectrum; use "
                "compression.reduction = 'gather', or compression.kind = 'lowrank_int4' with a fixed compression.rank"
            )
        if self.compression.fit_link and self.sync.sync_delay != 1:
            raise ValueError(
                "compression.fit_link = true sizes H so that a sync travels during the next round, which needs "
                "sync.sync_delay = 1 (sync.kind = dilocox sets it); with a blocking sync raise sync.inner_steps instead"
            )
        if self.compression.fit_link and 0 < self.compression.fit_link_max_steps < self.sync.inner_steps:
            raise ValueError(
                f"compression.fit_link_max_steps = {self.compression.fit_link_max_steps} is below sync.inner_steps = "
                f"{self.sync.inner_steps}: fit_link only raises H; use 0 (8 x H) or a value >= {self.sync.inner_steps}"
            )
        if not 0.0 < self.compression.energy <= 1.0:
            raise ValueError(f"compression.energy = {self.compression.energy} must be in (0, 1]")
        if self.sync.kind in ("allreduce", "cocktail") and self.compression.kind != "none":
            raise ValueError(
                f"compression.kind = {self.compression.kind!r} compresses pseudo-gradients: use sync.kind = diloco or "
                f"dilocox ({self.sync.kind} has its own gradient format)"
            )
        if not 0.0 < self.compression.topk_ratio <= self.compression.sample_ratio <= 1.0:
            raise ValueError(
                f"compression.topk_ratio = {self.compression.topk_ratio} and sample_ratio = "
                f"{self.compression.sample_ratio} must satisfy 0 < topk_ratio <= sample_ratio <= 1"
            )
        if self.train.lr <= 0:
            raise ValueError(f"train.lr = {self.train.lr} must be > 0")
        if self.sync.outer_lr <= 0:
            raise ValueError(
                f"sync.outer_lr = {self.sync.outer_lr} must be > 0 (1.0 with momentum 0 = plain averaging)"
            )
        if not 0.0 <= self.train.min_lr_ratio <= 1.0:
            raise ValueError(f"train.min_lr_ratio = {self.train.min_lr_ratio} must be in [0, 1]")
        if not 0.0 <= self.train.beta1 < 1.0 or not 0.0 <= self.train.beta2 < 1.0:
            raise ValueError(f"train.beta1/beta2 = {self.train.beta1}/{self.train.beta2} must be in [0, 1)")
        if not 0.0 < self.data.val_fraction <= 0.5:
            raise ValueError(f"data.val_fraction = {self.data.val_fraction} must be in (0, 0.5]")
        if self.sync.outer_momentum >= 1.0:
            raise ValueError(f"sync.outer_momentum = {self.sync.outer_momentum} must be < 1")
        if self.sync.sync_delay not in (0, 1):
            raise ValueError(
                f"sync.sync_delay = {self.sync.sync_delay} must be 0 (blocking) or 1 (one-step-delay overlap)"
            )
        _choice("sync.merge", self.sync.merge, MERGE_RULES)
        if self.sync.kind in ("allreduce", "cocktail") and self.sync.sync_delay:
            raise ValueError("sync.sync_delay = 1 needs an outer loop: use sync.kind = diloco or dilocox")
        _choice("train.pipeline_schedule", self.train.pipeline_schedule, PIPELINE_SCHEDULES)
        if self.train.num_microbatches < 0:
            raise ValueError(f"train.num_microbatches = {self.train.num_microbatches} must be >= 0 (0 = pp_degree)")
        m, p = self.microbatches, self.topology.pp_degree
        if self.train.micro_batch_size % m:
            raise ValueError(
                f"train.num_microbatches = {m} does not divide train.micro_batch_size = {self.train.micro_batch_size}; "
                "choose a divisor of the batch"
            )
        if p > 1 and self.train.pipeline_schedule == "1f1b" and m < p:
            raise ValueError(
                f"train.num_microbatches = {m} is fewer than the {p} pipeline stages, which 1f1b needs; "
                f"use --train.num_microbatches={p} or more, or --train.pipeline_schedule=gpipe"
            )
        if self.train.warmup_steps >= self.train.steps and self.train.steps > 1:
            raise ValueError(
                f"train.warmup_steps = {self.train.warmup_steps} must be smaller than train.steps = {self.train.steps}"
            )
        if self.sync.kind not in ("allreduce", "cocktail") and not self.compression.fit_link:
            h = self.sync.inner_steps
            if self.checkpoint.interval % h:
                fix = _round_up(self.checkpoint.interval, h)
                raise ValueError(
                    f"checkpoint.interval = {self.checkpoint.interval} must be a multiple of sync.inner_steps = {h} "
                    f"(checkpoints are taken at round boundaries); e.g. --checkpoint.interval={fix}"
                )
        if self.checkpoint.resume and self.run.overwrite:
            raise ValueError(
                "checkpoint.resume and run.overwrite contradict each other: resuming keeps the run directory"
            )
        parse_bandwidth(self.network.bandwidth)
        parse_duration(self.network.latency)
        if world_size is not None and world_size != self.world_size:
            t = self.topology
            raise ValueError(
                f"the launcher started {world_size} ranks but topology.num_clusters x dp_degree x pp_degree = "
                f"{t.num_clusters} x {t.dp_degree} x {t.pp_degree} = {self.world_size}; start {self.world_size} ranks "
                "(torchrun --nnodes x --nproc-per-node) or change the topology"
            )


SECTIONS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Config))


def _round_up(value: int, multiple: int) -> int:
    return max(multiple, -(-value // multiple) * multiple)


def _get(cfg: Config, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def _positive(cfg: Config, *names: str) -> None:
    for name in names:
        if _get(cfg, name) <= 0:
            raise ValueError(f"{name} = {_get(cfg, name)} must be > 0")


def _non_negative(cfg: Config, *names: str) -> None:
    for name in names:
        if _get(cfg, name) < 0:
            raise ValueError(f"{name} = {_get(cfg, name)} must be >= 0")


def _finite(cfg: Config) -> None:
    for section in SECTIONS:
        for f in dataclasses.fields(getattr(cfg, section)):
            value = getattr(getattr(cfg, section), f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{section}.{f.name} = {value} must be a finite number")


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} = {value!r} is not one of: {', '.join(choices)}")


# --------------------------------------------------------------------------------------------------------------
# Field metadata: types and docstrings


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstrings written under each field of a config dataclass (read from its source)."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[node.target.id] = nxt.value.value.strip()
    return docs


def section_types() -> dict[str, type]:
    return {f.name: f.default_factory for f in dataclasses.fields(Config)}  # type: ignore[misc]


def options() -> list[tuple[str, type, Any, str]]:
    """Every option as (dotted name, type, default, docstring), in declaration order."""
    out = []
    for section, cls in section_types().items():
        docs = field_docs(cls)
        default = cls()
        for f in dataclasses.fields(cls):
            value = getattr(default, f.name)
            out.append((f"{section}.{f.name}", type(value), value, docs.get(f.name, "")))
    return out


def _coerce(name: str, value: Any, typ: type, *, from_text: bool) -> Any:
    """Convert a TOML value (or a CLI string when from_text) to the field's type, or raise a ValueError."""
    if from_text and isinstance(value, str):
        text = value.strip()
        try:
            if typ is bool:
                lowered = text.lower()
                if lowered in ("true", "1", "yes", "on"):
                    return True
                if lowered in ("false", "0", "no", "off"):
                    return False
                raise ValueError
            if typ is int:
                return int(text)
            if typ is float:
                return float(text)
        except ValueError:
            raise ValueError(f"{name} = {value!r} is not a valid {typ.__name__}") from None
        return value
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is bool and not isinstance(value, bool) or typ is not bool and isinstance(value, bool):
        raise ValueError(f"{name} = {value!r} must be a {typ.__name__}, got {type(value).__name__}")
    if not isinstance(value, typ):
        raise ValueError(f"{name} = {value!r} must be a {typ.__name__}, got {type(value).__name__}")
    return value


def _set(cfg: Config, name: str, value: Any, *, from_text: bool) -> None:
    parts = name.split(".")
    known = {opt[0]: opt[1] for opt in options()}
    if len(parts) != 2 or name not in known:
        hint = difflib.get_close_matches(name, known, n=1)
        fix = f"; did you mean {hint[0]}?" if hint else "; `dilocox train --help` lists the options"
        raise ValueError(f"unknown config key {name!r}{fix}")
    setattr(getattr(cfg, parts[0]), parts[1], _coerce(name, value, known[name], from_text=from_text))


def apply_toml(cfg: Config, data: dict[str, Any], *, source: str = "config") -> Config:
    unknown = [key for key in data if key not in SECTIONS or not isinstance(data[key], dict)]
    if unknown:
        raise ValueError(
            f"{source}: unknown section(s) {', '.join(repr(k) for k in unknown)}; sections are: {', '.join(SECTIONS)}"
        )
    bad: list[str] = []
    for section, values in data.items():
        for key, value in values.items():
            try:
                _set(cfg, f"{section}.{key}", value, from_text=False)
            except ValueError as exc:
                if "unknown config key" in str(exc):
                    bad.append(f"{section}.{key}")
                else:
                    raise ValueError(f"{source}: {exc}") from None
    if bad:
        raise ValueError(f"{source}: unknown key(s) {', '.join(bad)}; `dilocox train --help` lists the options")
    return cfg


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """`--a.b=1 --c.d 2` -> [("a.b", "1"), ("c.d", "2")]."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) < 3:
            raise ValueError(f"unexpected argument {arg!r}: options look like --section.key=value")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                if name in {opt[0] for opt in options() if opt[1] is bool}:
                    value = "true"  # a bare boolean flag switches it on
                else:
                    raise ValueError(f"option --{name} needs a value: --{name}=VALUE")
            else:
                i += 1
                value = args[i]
        pairs.append((name, value))
        i += 1
    return pairs


# Settings a strategy changes from the global defaults, unless the file or a flag sets them explicitly. dilocox
# averages plainly (outer lr 1, no momentum): Nesterov 0.9 on one-round-stale updates overshoots; on the default
# setting plain averaging gave 4.731 against 5.213 (benchmarks/results/outer/).
KIND_DEFAULTS: dict[str, dict[str, Any]] = {
    "dilocox": {
        "sync.sync_delay": 1,
        "compression.kind": "adaptive",
        "sync.outer_lr": 1.0,
        "sync.outer_momentum": 0.0,
    }
}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the TOML file at `path`, then `--section.key=value` overrides (not yet validated).

    The strategy's own defaults (`KIND_DEFAULTS`) fill the keys that neither the file nor a flag set."""
    cfg = Config()
    explicit: set[str] = set()
    if path:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"--config {path}: no such file")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"--config {path}: not valid TOML ({exc})") from None
        apply_toml(cfg, data, source=str(path))
        explicit |= {f"{section}.{key}" for section, values in data.items() for key in values}
    for name, value in parse_overrides(overrides or []):
        _set(cfg, name, value, from_text=True)
        explicit.add(name)
    for name, value in KIND_DEFAULTS.get(cfg.sync.kind, {}).items():
        if name not in explicit:
            _set(cfg, name, value, from_text=False)
    return cfg


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def from_dict(data: dict[str, Any]) -> Config:
    return apply_toml(Config(), data)


def to_toml(cfg: Config) -> str:
    """Serialize the resolved config as TOML (every field, with its docstring as a comment)."""
    lines = ["# Resolved dilocox configuration of this run; `dilocox train --config config.toml` repeats it.", ""]
    for section, cls in section_types().items():
        docs = field_docs(cls)
        lines.append(f"[{section}]")
        for f in dataclasses.fields(cls):
            value = getattr(getattr(cfg, section), f.name)
            if docs.get(f.name):
                lines.append(f"# {docs[f.name]}")
            lines.append(f"{f.name} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    return json.dumps(value)  # a TOML basic string uses the same escapes
