"""The run configuration: a tree of dataclasses, loaded from a preset and a TOML file and overridden by dotted flags.

Precedence is field defaults < preset < `--config FILE` < `--section.key=value` flags. Every field has a working
default and a one-line docstring right under it. A preset is a TOML file shipped in the package (`dilocox/presets/`):
the settings of DiLoCoX or of a baseline, named; every run starts from one (`choose_preset`: `--preset NAME`,
`preset = "NAME"` in a config file, the preset of a `sync.kind` that differs from it, else `dilocox`). An option that
follows from others is "auto" until `Config.resolve()` sets it after every layer, by the rule its docstring states;
`dilocox train --help` prints what the default preset resolves to. A choice is a `Literal[...]` field; its values are
defined once, by the type. Which options do not work together is one table, `dilocox.compat`.

    cfg = load_config("configs/debug.toml", ["--preset=dilocox-lowrank", "--sync.inner_steps=10"])   # resolved
    cfg.validate(world_size=4)
    (run_dir / "config.toml").write_text(to_toml(cfg))
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import importlib.resources
import inspect
import json
import tomllib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from dilocox.checks import (
    AUTO,
    Auto,
    auto_types,
    check_choice,
    check_non_negative,
    check_positive,
    check_types,
    field_choices,
    field_type,
)
from dilocox.compress.config import CocktailConfig, CompressionConfig
from dilocox.elastic.lighthouse import check_lighthouse_url
from dilocox.net.config import NetworkConfig
from dilocox.sync.config import CHECKPOINT_STEPS, OUTER_OPTIMIZER_SETTINGS, SYNC_KINDS, OuterConfig, SyncConfig
from dilocox.sync.faults import FaultConfig
from dilocox.topology import Topology, parse_cluster_shapes

Device = Literal["auto", "cpu", "cuda"]
"""`run.device`: where each rank computes (`dilocox.device.resolve_device`)."""
DEVICES: tuple[str, ...] = get_args(Device)
DpMode = Literal["replicate", "shard"]
"""`topology.dp_mode`: how a cluster's dp ranks hold a stage (`dilocox.parallel.fsdp`)."""
ShardMode = Literal["mixed", "contiguous"]
"""`data.shard`: how the training windows are dealt to the data shards (`dilocox.data.dataset`)."""
SHARD_MODES: tuple[str, ...] = get_args(ShardMode)
PipelineSchedule = Literal["gpipe", "1f1b"]
"""`train.pipeline_schedule`: the schedules `PipelineRunner` runs."""
PIPELINE_SCHEDULES: tuple[str, ...] = get_args(PipelineSchedule)
Optimizer = Literal["adamw", "sgd", "muon"]
"""`train.optimizer`: the inner optimizer."""
Dtype = Literal["fp32", "bf16"]
"""`train.dtype`: the autocast dtype of the forward pass (fp32: no autocast)."""
WandbMode = Literal["off", "offline", "online"]
"""`metrics.wandb`: no W&B run, a local run written without network, or a run streamed to the W&B server."""
PresetName = Literal["dilocox", "dilocox-lowrank", "paper", "diloco", "allreduce", "cocktail"]
"""The presets shipped in `dilocox/presets/NAME.toml`, in the order `dilocox train --help` lists them."""
PRESETS: tuple[str, ...] = get_args(PresetName)
DEFAULT_PRESET = "dilocox"
"""The preset a run starts from when neither its flags nor its config file name a preset or another kind."""
WARMUP_STEPS = 20
"""`train.warmup_steps = auto`: this many steps, or a tenth of the run if that is fewer."""


class ConfigWarning(UserWarning):
    """A setting that loads but may not mean what it says (a renamed key); the CLI prints it as one
    `dilocox: warning:` line."""


MOVED_KEYS = {
    "compression.fit_link": "sync.round.fit_link",
    "compression.fit_link_max_steps": "sync.round.fit_link_max_steps",
    "compression.sample_ratio": "cocktail.sample_ratio",
    "compression.topk_ratio": "cocktail.topk_ratio",
    "compression.aggregate": "compression.rank_rule",
    # [sync] in sub-sections: the outer optimizer, the guard, what makes a round
    "sync.outer_optimizer": "sync.outer.optimizer",
    "sync.outer_lr": "sync.outer.lr",
    "sync.outer_momentum": "sync.outer.momentum",
    "sync.nesterov": "sync.outer.nesterov",
    "sync.outer_beta1": "sync.outer.beta1",
    "sync.outer_beta2": "sync.outer.beta2",
    "sync.outer_weight_decay": "sync.outer.weight_decay",
    "sync.outer_lr_schedule": "sync.outer.lr_schedule",
    "sync.outer_warmup_rounds": "sync.outer.warmup_rounds",
    "sync.outer_min_lr_ratio": "sync.outer.min_lr_ratio",
    "sync.outer_state_device": "sync.outer.state_device",
    "sync.guard": "sync.guard.enabled",
    "sync.guard_max_ratio": "sync.guard.max_ratio",
    "sync.guard_peers": "sync.guard.peers",
    "sync.guard_peer_ratio": "sync.guard.peer_ratio",
    "sync.guard_max_bad_rounds": "sync.guard.max_bad_rounds",
    "sync.round": "sync.round.mode",
    "sync.round_seconds": "sync.round.seconds",
    "sync.fit_link": "sync.round.fit_link",
    "sync.fit_link_max_steps": "sync.round.fit_link_max_steps",
}
"""Keys of earlier versions and where they live now, the one table of them: a config file, a flag, a run directory's
config.toml or a checkpoint's saved config that spells one loads it into its new place, with one warning line per key
(`apply_toml`, `layered_config`), or silently where a saved config is only compared (`flat_settings`)."""
ZERO_WAS_AUTO = ("sync.round.fit_link_max_steps", "sync.min_clusters", "train.num_microbatches")
"""Options whose 0 meant what auto means now (read as auto with a warning, so older run directories still load)."""


@dataclass
class RunConfig:
    out_dir: str = "runs/dilocox"
    """Run directory: config.toml, metrics.jsonl, summary.json, tokenizer.json and checkpoints/ go here."""
    seed: int = 0
    """Seed of the initial weights, data order, codec draws and (data.split_seed = -1) the held-out split."""
    overwrite: bool = False
    """Replace an existing run directory instead of refusing to start (resuming never needs this)."""
    num_threads: int = 1
    """CPU threads per rank (torch.set_num_threads); keep ranks x threads <= cores."""
    device: Device = "cpu"
    """Where each rank computes: cpu, cuda (cuda:{local_rank % GPUs}; not yet run on a GPU) or auto (cuda if any)."""


@dataclass
class ModelConfig:
    flavor: str = "tiny"
    """Model shape by name: debug, tiny, small, medium, qwen1.5-0.5b ... qwen1.5-107b (`dilocox flavors` lists them)."""
    init_from: str = ""
    """Start from a local Hugging Face Qwen2/Llama directory (config.json + safetensors); its config replaces flavor."""


@dataclass
class DataConfig:
    path: str = ""
    """Training text: a .txt/.md/.jsonl/.parquet file, directory or glob, or a prepare-data dir; empty = Shakespeare."""
    tokenizer: str = ""
    """A tokenizer.json or local HF tokenizer dir; empty = model.init_from's, else a BPE trained on the corpus."""
    vocab_size: int = 2048
    """Vocabulary size of the locally trained BPE (ignored when data.tokenizer is given)."""
    val_fraction: float = 0.05
    """Share of the documents held out for validation (of the tokens, for a single document)."""
    text_field: str = "text"
    """Field that holds the text in .jsonl records and .parquet columns."""
    shard: ShardMode = "mixed"
    """Windows per data shard: mixed (a seed-keyed deal from the whole corpus) or contiguous (one stretch each)."""
    split_seed: int = -1
    """Seed of the held-out split (and so of the BPE trained on the rest); -1 = run.seed, >= 0 = one for all seeds."""


@dataclass
class TrainConfig:
    # the first run's length: 8 rounds of the dilocox preset, about a minute on 2 cores (README, "The first run")
    steps: int = 96
    """Inner steps every rank runs (tokens per rank = steps x micro_batch_size x seq_len)."""
    seq_len: int = 256
    """Tokens per training sequence."""
    micro_batch_size: int = 8
    """Sequences per data-parallel rank (one pipeline) per step."""
    num_microbatches: int | Auto = "auto"
    """Pipeline microbatches per step (they split micro_batch_size); auto: topology.pp_degree."""
    pipeline_schedule: PipelineSchedule = "1f1b"
    """Pipeline schedule when pp_degree > 1: 1f1b or gpipe."""
    lr: float = 2e-3
    """Peak learning rate of the inner optimizer."""
    warmup_steps: int | Auto = "auto"
    """Linear warm-up steps of the inner learning rate; auto: 20, or train.steps // 10 if that is fewer."""
    min_lr_ratio: float = 0.1
    """The cosine schedule decays the inner learning rate to lr x min_lr_ratio at the last step."""
    optimizer: Optimizer = "adamw"
    """Inner optimizer: adamw; muon (MuLoCo: Muon on the blocks' matrices, AdamW on the rest); sgd (plain)."""
    weight_decay: float = 0.1
    """Decoupled weight decay of AdamW (optimizer = muon: of Muon too, per step lr x weight_decay on each)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    # the best of 2e-3 / 4e-3 / 8e-3 with AllReduce on the gap protocol, seed 0 (docs/results.md, MuLoCo)
    muon_lr: float = 4e-3
    """optimizer = muon: Muon's peak learning rate, on train.lr's schedule; its steps have AdamW's RMS at equal lr."""
    muon_momentum: float = 0.95
    """optimizer = muon: Muon's (Nesterov) momentum."""
    grad_clip: float = 1.0
    """Clip the gradient norm to this value before every inner step; 0 disables clipping."""
    dtype: Dtype = "fp32"
    """Compute dtype of the forward pass: fp32, or bf16 (autocast; weights, grads and optimizer states stay fp32)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward pass: less activation memory, ~1 more forward of compute."""
    compile: bool = False
    """torch.compile each transformer block (the first step compiles them: tens of seconds, then faster steps)."""


@dataclass
class TopologyConfig:
    num_clusters: int = 2
    """Clusters joined by the slow link (C)."""
    dp_degree: int = 1
    """Data-parallel replicas inside each cluster (D), joined by a fast link."""
    pp_degree: int = 1
    """Pipeline stages inside each cluster (P); world size = C x D x P."""
    dp_mode: DpMode = "replicate"
    """How the D ranks hold a stage: replicate (each all of it) or shard (FSDP2: each 1/D, outer state and link too)."""
    clusters: list[str] = field(default_factory=list)
    """Each cluster's shape, e.g. ["pp2xdp2", "pp2xdp1"] (dp may differ); sets num_clusters, dp_degree (max), pp."""
    elastic: bool = False
    """Clusters may fail and rejoin: each is its own world, torchft's quorum decides every round's members (§10.1)."""
    max_cluster_restarts: int = 3
    """elastic: times this launcher starts a dead cluster again, to heal from a peer (torchrun: --max-restarts)."""
    local_clusters: str = ""
    """elastic, several machines: the clusters this machine starts, e.g. "0,1" or "2-3" (torchrun: the job's one)."""

    def shape(self) -> tuple[tuple[int, ...], int]:
        """(each cluster's data-parallel degree, the pipeline degree): from `clusters`, else C times dp_degree."""
        if self.clusters:
            return parse_cluster_shapes(self.clusters, pp_degree=self.pp_degree)
        return (self.dp_degree,) * self.num_clusters, self.pp_degree

    def build(self) -> Topology:
        """The `Topology` of these settings (rank order, groups, data shards)."""
        dp_degrees, pp_degree = self.shape()
        return Topology.of_clusters(dp_degrees, pp_degree)

    def launched_clusters(self) -> tuple[int, ...]:
        """The clusters this launcher starts (`local_clusters`, parsed and checked), in order."""
        if not self.local_clusters.strip():
            return tuple(range(self.num_clusters))
        clusters: list[int] = []
        for part in self.local_clusters.split(","):
            first, _, last = part.strip().partition("-")
            try:
                span = range(int(first), int(last or first) + 1)
            except ValueError:
                span = range(0)
            if not span or span.start < 0 or span.stop > self.num_clusters:
                raise ValueError(
                    f"topology.local_clusters = {self.local_clusters!r}: {part.strip()!r} is not a cluster or a range "
                    f'of clusters of 0..{self.num_clusters - 1}; write e.g. "0,1" or "2-3"'
                )
            clusters.extend(span)
        if len(set(clusters)) != len(clusters):
            raise ValueError(f"topology.local_clusters = {self.local_clusters!r} names a cluster twice")
        return tuple(sorted(clusters))


@dataclass
class EvalConfig:
    interval: int = 50
    """Evaluate the validation loss every this many steps (and at the end); 0 = only at the end."""
    max_batches: int = 8
    """Validation batches (micro_batch_size x seq_len tokens each) per evaluation during training; 0 = all."""
    final_max_batches: int = 0
    """Validation batches of the final evaluation (summary.json); 0 = the whole split, every held-out token."""
    local: bool = False
    """Also score cluster 0's own model (eval_loss_local); eval_loss is always the model the clusters agree on."""
    divergence_ratio: float = 1.5
    """Stop the run (one line, exit 2) when eval_loss exceeds this x its lowest so far, the initial one's; 0: never."""


@dataclass
class CheckpointConfig:
    interval: int | Auto = "auto"
    """Save a checkpoint every this many steps and at the end (0: only then); auto: H's largest multiple <= 100"""
    keep: int = 2
    """Keep the newest this many checkpoints; older ones are deleted (but those keep_every keeps)."""
    keep_every: int = 0
    """Also keep the first checkpoint at or after every multiple of this many steps, for good (0: none)."""
    resume: str = "auto"
    """auto: the newest verified checkpoint of run.out_dir if any, else start; latest; a checkpoint dir; "": never."""
    async_save: bool = False
    """Write checkpoints in a thread while training goes on (it waits for a host copy of the state); not the last."""


@dataclass
class MetricsConfig:
    log_interval: int = 10
    """Write a metrics.jsonl line every this many steps."""
    progress: bool = True
    """Show a progress bar when the launching terminal is interactive (plain log lines otherwise)."""
    tensorboard: bool = False
    """Also write every numeric metric as TensorBoard scalars to RUN_DIR/tensorboard (needs dilocox[tensorboard])."""
    wandb: WandbMode = "off"
    """Also log every numeric metric to W&B, files in RUN_DIR/wandb: off, offline or online (needs `wandb login`)."""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    cocktail: CocktailConfig = field(default_factory=CocktailConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)

    @property
    def split_seed(self) -> int:
        """The seed of the held-out split: `data.split_seed`, or run.seed where that is -1."""
        return self.run.seed if self.data.split_seed == -1 else self.data.split_seed

    @property
    def world_size(self) -> int:
        dp_degrees, pp_degree = self.topology.shape()
        return sum(dp_degrees) * pp_degree

    def resolve(self) -> Config:
        """Set every option still at auto by the rule its docstring states, from the options as they stand after the
        preset, the file and the flags; options set explicitly are kept. Returns the config (resolved in place;
        resolving again changes nothing)."""
        self.sync = self.sync.resolved(self.compression)
        if self.sync.min_clusters == AUTO:
            self.sync.min_clusters = 1 if self.topology.elastic else self.topology.num_clusters
        if self.checkpoint.interval == AUTO:
            h = self.sync.inner_steps
            outer = self.sync.has_outer_loop and isinstance(h, int) and h > 0
            self.checkpoint.interval = max(h, h * (CHECKPOINT_STEPS // h)) if outer else CHECKPOINT_STEPS
        if self.train.warmup_steps == AUTO and isinstance(self.train.steps, int):
            self.train.warmup_steps = min(WARMUP_STEPS, self.train.steps // 10)  # a short run gets its cosine decay
        if self.train.num_microbatches == AUTO:
            self.train.num_microbatches = self.topology.pp_degree
        return self

    def validate(self, world_size: int | None = None) -> None:
        """Raise ValueError naming the first impossible setting and how to fix it (resolving auto options first).

        Each component's section validates its own values (`SyncConfig`, `CompressionConfig`, `CocktailConfig`,
        `NetworkConfig`, `FaultConfig`); this checks the sections that only the trainer reads, then the pairs of
        options that do not work together (`dilocox.compat`, one table), then the world size."""
        for name in section_types():  # every type and choice first: the auto rules read these values
            check_types(name, section_of(self, name))
        self.resolve()
        for section in (self.sync, self.compression, self.cocktail, self.network):
            section.validate()
        self.faults.validate(self.topology.num_clusters if self.topology.num_clusters >= 1 else None)
        check_positive("run", self.run, "num_threads")
        check_non_negative("run", self.run, "seed")
        check_positive("train", self.train, "steps", "seq_len", "micro_batch_size")
        check_positive("train", self.train, "num_microbatches")
        check_non_negative("train", self.train, "warmup_steps", "weight_decay", "grad_clip")
        check_positive("topology", self.topology, "num_clusters", "dp_degree", "pp_degree")
        check_positive("data", self.data, "vocab_size")
        check_positive("metrics", self.metrics, "log_interval")
        check_positive("checkpoint", self.checkpoint, "keep")
        check_non_negative("checkpoint", self.checkpoint, "keep_every")
        check_non_negative("eval", self.eval, "interval", "max_batches", "final_max_batches")
        if self.eval.divergence_ratio != 0 and not self.eval.divergence_ratio > 1:
            raise ValueError(
                f"eval.divergence_ratio = {self.eval.divergence_ratio} must be above 1 (1.5: stop when the eval loss "
                "is half as high again as its lowest so far), or 0 to never stop on it"
            )
        check_non_negative("checkpoint", self.checkpoint, "interval")
        from dilocox.models import list_flavors

        check_choice("model.flavor", self.model.flavor, tuple(list_flavors()))
        if self.train.lr <= 0:
            raise ValueError(f"train.lr = {self.train.lr} must be > 0")
        if not 0.0 <= self.train.min_lr_ratio <= 1.0:
            raise ValueError(f"train.min_lr_ratio = {self.train.min_lr_ratio} must be in [0, 1]")
        if not 0.0 <= self.train.beta1 < 1.0 or not 0.0 <= self.train.beta2 < 1.0:
            raise ValueError(f"train.beta1/beta2 = {self.train.beta1}/{self.train.beta2} must be in [0, 1)")
        if self.train.muon_lr <= 0:
            raise ValueError(f"train.muon_lr = {self.train.muon_lr} must be > 0")
        if not 0.0 <= self.train.muon_momentum < 1.0:
            raise ValueError(f"train.muon_momentum = {self.train.muon_momentum} must be in [0, 1)")
        if not 0.0 < self.data.val_fraction <= 0.5:
            raise ValueError(f"data.val_fraction = {self.data.val_fraction} must be in (0, 0.5]")
        if self.data.split_seed < -1:
            raise ValueError(
                f"data.split_seed = {self.data.split_seed} must be >= 0, or -1 to hold out the split of run.seed"
            )
        m, p = self.train.num_microbatches, self.topology.pp_degree
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
                f"train.warmup_steps = {self.train.warmup_steps} must be smaller than train.steps = "
                f"{self.train.steps}; use e.g. --train.warmup_steps=auto ({min(WARMUP_STEPS, self.train.steps // 10)})"
            )
        self._validate_clusters()
        self._validate_membership()
        from dilocox.compat import check

        check(self)
        if world_size is not None and world_size != self.world_size:
            t = self.topology
            if t.clusters:
                sizes = " + ".join(f"{dp} x {t.pp_degree}" for dp in t.shape()[0])
                what = f"topology.clusters = {t.clusters} makes {sizes} (dp x pp per cluster) = {self.world_size}"
            else:
                what = (
                    f"topology.num_clusters x dp_degree x pp_degree = {t.num_clusters} x {t.dp_degree} x "
                    f"{t.pp_degree} = {self.world_size}"
                )
            raise ValueError(
                f"the launcher started {world_size} ranks but {what}; start {self.world_size} ranks "
                "(torchrun --nnodes x --nproc-per-node) or change the topology"
            )

    def _validate_clusters(self) -> None:
        """`topology.clusters` against the global degrees (docs/design.md §2.1)."""
        t = self.topology
        if not t.clusters:
            return
        if not all(isinstance(shape, str) for shape in t.clusters):
            raise ValueError(f'topology.clusters = {t.clusters!r} must be a list of strings such as "pp1xdp2"')
        dp_degrees, pp_degree = t.shape()
        listed = f"topology.clusters = {t.clusters}"
        if t.num_clusters != len(dp_degrees):
            raise ValueError(
                f"topology.num_clusters = {t.num_clusters} contradicts {listed}, which lists {len(dp_degrees)} "
                "clusters; leave topology.num_clusters out (topology.clusters sets it)"
            )
        if t.pp_degree != pp_degree:
            raise ValueError(
                f"topology.pp_degree = {t.pp_degree} contradicts {listed} (pp {pp_degree}); leave topology.pp_degree "
                "out (topology.clusters sets it)"
            )
        if t.dp_degree != max(dp_degrees):
            raise ValueError(
                f"topology.dp_degree = {t.dp_degree} contradicts {listed} (dp {', '.join(map(str, dp_degrees))}); "
                f"leave topology.dp_degree out (with topology.clusters it is the largest cluster's, {max(dp_degrees)})"
            )

    def shared_settings(self) -> dict[str, Any]:
        """The settings every cluster of a run must share, wherever it runs, by dotted name:
        `membership.SHARED_SECTIONS` and run.seed, without `membership.MACHINE_LOCAL_SETTINGS` (where files are, what
        one machine starts)."""
        from dilocox.elastic.membership import MACHINE_LOCAL_SETTINGS, SHARED_SECTIONS

        shared: dict[str, Any] = {"run.seed": self.run.seed}
        for name, value in flat_settings(to_dict(self)).items():
            if name.split(".")[0] in SHARED_SECTIONS and name not in MACHINE_LOCAL_SETTINGS:
                shared[name] = value
        return shared

    def _validate_membership(self) -> None:
        """`topology.elastic`'s own options (docs/design.md §10.1); what they do not work with: `dilocox.compat`."""
        t, c = self.topology, self.topology.num_clusters
        check_non_negative("topology", t, "max_cluster_restarts")
        check_positive("sync", self.sync, "min_clusters")
        if self.sync.min_clusters > c:
            raise ValueError(
                f"sync.min_clusters = {self.sync.min_clusters} is more than topology.num_clusters = {c}; use {c} or "
                "less, or auto"
            )
        if t.elastic:
            t.launched_clusters()  # a list it cannot parse is named here
            if self.network.lighthouse:
                check_lighthouse_url(self.network.lighthouse)

    def notes(self) -> list[str]:
        """One line for each setting that works, but not as its value alone says (printed once at the start)."""
        notes = []
        h, interval = self.sync.inner_steps, self.checkpoint.interval
        if self.sync.has_outer_loop and not self.sync.round.fit_link and interval % h:
            notes.append(
                f"note: checkpoint.interval = {interval} is not a multiple of sync.inner_steps = {h}: checkpoints are "
                f"taken at the first round boundary at or after each multiple of {interval} (and at the end)"
            )
        from dilocox.compat import sums_in_transit  # here: compat reads this module's Config

        guard = self.sync.guard
        if guard.enabled and guard.peers and self.topology.num_clusters >= 3 and sums_in_transit(self):
            notes.append(
                f"note: compression.kind = {self.compression.kind} with compression.reduction = "
                f"{self.compression.reduction} sums the clusters' updates in transit, so the peer check "
                "(sync.guard.peers) cannot compare them and a finite lie from one cluster passes; where clusters "
                "are not trusted use a codec with compression.reduction = gather, e.g. --compression.kind=int4"
            )
        return notes


SECTIONS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Config))


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


def _is_section(f: dataclasses.Field) -> bool:  # type: ignore[type-arg]
    """A field that holds a sub-section (a config dataclass, `sync.outer`), not an option."""
    return isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory)


@functools.cache
def section_types() -> dict[str, type]:
    """Every section by dotted name, in declaration order, a sub-section (`sync.outer`) right after its parent."""
    out: dict[str, type] = {}

    def walk(name: str, cls: type) -> None:
        out[name] = cls
        for f in dataclasses.fields(cls):
            if _is_section(f):
                walk(f"{name}.{f.name}", f.default_factory)  # type: ignore[arg-type]

    for f in dataclasses.fields(Config):
        walk(f.name, f.default_factory)  # type: ignore[arg-type]
    return out


def option_fields(cls: type) -> list[dataclasses.Field]:  # type: ignore[type-arg]
    """The fields of a section that are options (its sub-sections left out)."""
    return [f for f in dataclasses.fields(cls) if not _is_section(f)]


def section_of(cfg: Config, name: str) -> Any:
    """The section object of dotted `name` (`sync.outer` -> cfg.sync.outer)."""
    return functools.reduce(getattr, name.split("."), cfg)


def option_value(cfg: Config, name: str) -> Any:
    """The value of the option of dotted `name` (`sync.outer.lr`)."""
    section, _, key = name.rpartition(".")
    return getattr(section_of(cfg, section), key)


def flat_settings(data: dict[str, Any]) -> dict[str, Any]:
    """The options of a config as a dict (`to_dict`, a parsed config.toml or a checkpoint's saved config) by dotted
    name, a key of an earlier version under its new name (`MOVED_KEYS`, silently: comparing is not loading)."""
    return {MOVED_KEYS.get(name, name): value for name, value in _toml_items(data)}


def options() -> list[tuple[str, type, Any, str]]:
    """Every option as (dotted name, type, default, docstring), in declaration order; an auto option's type is the
    type of its resolved value, its default "auto"."""
    out = []
    for section, cls in section_types().items():
        docs = field_docs(cls)
        default = cls()
        for f in option_fields(cls):
            out.append((f"{section}.{f.name}", field_type(cls, f.name), getattr(default, f.name), docs.get(f.name, "")))
    return out


def auto_options() -> set[str]:
    """The options that may be "auto" (their docstring states the rule `Config.resolve` follows)."""
    return {f"{section}.{name}" for section, cls in section_types().items() for name in auto_types(cls)}


def allowed_values(name: str) -> tuple[str, ...] | None:
    """The values the option `section.key` accepts, from its `Literal[...]` type; None when it is not a choice."""
    section, _, key = name.rpartition(".")
    cls = section_types().get(section)
    return field_choices(cls).get(key) if cls is not None else None


def _coerce(name: str, value: Any, typ: type, *, from_text: bool) -> Any:
    """Convert a TOML value (or a CLI string when from_text) to the field's type, or raise a ValueError. A list of
    strings is written on the command line comma-separated (`--topology.clusters=dp2,dp1`) or as a TOML array."""
    if typ is list and from_text and isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = tomllib.loads(f"v = {text}")["v"]
            except tomllib.TOMLDecodeError:
                raise ValueError(f'{name} = {value!r} is not a list; write e.g. a,b or ["a", "b"]') from None
        else:
            value = [part.strip() for part in text.split(",")] if text else []
            if "" in value:  # `,,` is not "no clusters", nor `dp2,,dp1` two of them
                raise ValueError(
                    f"{name} = {text!r} has an empty entry; separate the entries by single commas (e.g. a,b), "
                    "or give nothing for none"
                )
    if typ is list:
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise ValueError(f"{name} = {value!r} must be a list of strings")
        return list(value)
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
        if typ is dict:
            return _parse_table(name, text)
        return value
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is bool and not isinstance(value, bool) or typ is not bool and isinstance(value, bool):
        raise ValueError(f"{name} = {value!r} must be a {typ.__name__}, got {type(value).__name__}")
    if not isinstance(value, typ):
        raise ValueError(f"{name} = {value!r} must be a {typ.__name__}, got {type(value).__name__}")
    return value


def _parse_table(name: str, text: str) -> dict[str, Any]:
    """A table option given on the command line: a TOML inline table (`{2 = 2.0}`) or `key:value` pairs separated by
    commas (`2:2.0,1:1.5`); the values are TOML values (numbers, booleans, quoted strings), "" is the empty table."""
    if not text or text == "{}":
        return {}
    inline = text if text.startswith("{") else "{" + ", ".join(_pair(name, part) for part in text.split(",")) + "}"
    try:
        return tomllib.loads(f"table = {inline}")["table"]
    except tomllib.TOMLDecodeError:
        raise ValueError(
            f"{name} = {text!r} is not a table: write key:value pairs, e.g. --{name}=2:2.0,1:1.5, or a TOML inline "
            "table, e.g. '--" + name + "={2 = 2.0}'"
        ) from None


def _pair(name: str, part: str) -> str:
    key, colon, value = part.partition(":")
    if not colon or not key.strip() or not value.strip():
        raise ValueError(f"{name}: {part!r} is not a key:value pair; write e.g. --{name}=2:2.0,1:1.5")
    return f"{json.dumps(key.strip())} = {value.strip()}"


def _set(cfg: Config, name: str, value: Any, *, from_text: bool, warned: set[str] | None = None) -> None:
    """Set option `name` (its key of an earlier version moved to its new one, with a warning unless `warned`, the
    keys already warned of while loading this config, holds it) to `value`, checked and converted to its type."""
    if name in MOVED_KEYS:
        if warned is None or name not in warned:
            warnings.warn(f"{name} is now {MOVED_KEYS[name]}; update the config or flag", ConfigWarning, stacklevel=2)
        if warned is not None:
            warned.add(name)
        name = MOVED_KEYS[name]
    known = {opt[0]: opt[1] for opt in options()}
    if name not in known:
        hint = difflib.get_close_matches(name, known, n=1)
        fix = f"; did you mean {hint[0]}?" if hint else "; `dilocox train --help` lists the options"
        raise ValueError(f"unknown config key {name!r}{fix}")
    if name in ZERO_WAS_AUTO and str(value).strip() == "0":
        warnings.warn(f"{name} = 0 is now {name} = auto; update the config or flag", ConfigWarning, stacklevel=2)
        value = AUTO
    if isinstance(value, str) and value.strip() == AUTO and name in auto_options():
        value = AUTO
    else:
        value = _coerce(name, value, known[name], from_text=from_text)
    section, _, key = name.rpartition(".")
    setattr(section_of(cfg, section), key, value)


def _toml_items(data: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """The (dotted name, value) pairs of a config's sections (a TOML file, `to_dict`), its sub-section tables
    (`[sync.outer]`) included, each name as written."""
    items: list[tuple[str, Any]] = []
    for key, value in data.items():
        name = f"{prefix}{key}"
        if name in section_types() and isinstance(value, dict):
            items += _toml_items(value, f"{name}.")
        else:
            items.append((name, value))
    return items


def _check_spellings(names: list[str], source: str) -> None:
    """Refuse a layer (a file, the flags) that sets an option under its new name and its old one (`MOVED_KEYS`)."""
    given = set(names)
    for name in names:
        new = MOVED_KEYS.get(name)
        if new in given:
            raise ValueError(
                f"{source}: {name} and {new} are the same option (the old name and the new); set {new} only"
            )


def apply_toml(cfg: Config, data: dict[str, Any], *, source: str = "config", warned: set[str] | None = None) -> Config:
    unknown = [key for key in data if key not in SECTIONS or not isinstance(data[key], dict)]
    if unknown:
        raise ValueError(
            f"{source}: unknown section(s) {', '.join(repr(k) for k in unknown)}; sections are: {', '.join(SECTIONS)}"
        )
    items = _toml_items(data)
    _check_spellings([name for name, _ in items], source)
    bad: list[str] = []
    for name, value in items:
        try:
            _set(cfg, name, value, from_text=False, warned=warned)
        except ValueError as exc:
            if "unknown config key" in str(exc):
                bad.append(name)
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
                if MOVED_KEYS.get(name, name) in {opt[0] for opt in options() if opt[1] is bool}:
                    value = "true"  # a bare boolean flag switches it on
                else:
                    raise ValueError(f"option --{name} needs a value: --{name}=VALUE")
            else:
                i += 1
                value = args[i]
        pairs.append((name, value))
        i += 1
    return pairs


def read_toml(path: Path, what: str, *, hint: str = "") -> dict[str, Any]:
    """The TOML file at `path`, or a ValueError saying `what` it was meant to be and why it cannot be read."""
    if not path.is_file():
        raise ValueError(f"{what} {path}: no such file{hint}")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{what} {path}: not valid TOML ({exc})") from None


def preset_text(name: str) -> str:
    """The shipped TOML file of preset `name` (`dilocox/presets/NAME.toml`, package data), or a ValueError listing
    the presets."""
    if name not in PRESETS:
        same = [preset for preset in PRESETS if preset.lower() == str(name).lower()]  # a case slip first
        hint = same or difflib.get_close_matches(str(name), PRESETS, n=1)
        fix = f"did you mean {hint[0]}? " if hint else ""
        raise ValueError(f"--preset {name!r} is not a preset; {fix}presets: {', '.join(PRESETS)}")
    return importlib.resources.files("dilocox").joinpath("presets", f"{name}.toml").read_text()


def read_preset(name: str) -> dict[str, dict[str, Any]]:
    """The settings of preset `name`, by section (checked by `load_config` like a config file's)."""
    return tomllib.loads(preset_text(name))


def preset_summary(name: str) -> str:
    """The first comment line of preset `name`'s file: what it is."""
    for line in preset_text(name).splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


def preset_kind(name: str) -> str:
    """The `sync.kind` of preset `name`: its identity (every preset sets one)."""
    return read_preset(name)["sync"]["kind"]


def choose_preset(said: list[tuple[str, str]], default: str = DEFAULT_PRESET) -> str:
    """The preset a run starts from: `default`, changed by what the config file then the flags say, in order, as
    ("preset", NAME) or ("sync.kind", KIND). A kind is its preset's identity: a preset replaces the one before; a kind
    that differs from the chosen preset's kind chooses that kind's own preset (allreduce, cocktail, diloco,
    dilocox), so `--sync.kind=diloco` runs what `--preset diloco` runs, and `--preset paper --sync.kind=dilocox`
    stays on paper (its kind)."""
    chosen = default
    for what, value in said:
        if what == "preset":
            preset_text(value)  # a preset that does not exist is named first
            chosen = value
        elif value in SYNC_KINDS and value != preset_kind(chosen):
            chosen = value
    return chosen


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, *, preset: str = DEFAULT_PRESET
) -> Config:
    """The config of `dilocox train [--config path] overrides`, resolved (`Config.resolve`), not yet validated:
    `layered_config`, then every auto option set by its rule."""
    return layered_config(path, overrides, preset=preset)[0].resolve()


def layered_config(
    path: str | Path | None = None, overrides: list[str] | None = None, *, preset: str = DEFAULT_PRESET
) -> tuple[Config, str, list[set[str]]]:
    """(the config before its auto options resolve, the preset it started from, the options each layer set: the
    preset, the file, the flags). Field defaults, then the preset (`choose_preset`: `--preset`, the file's
    `preset = "NAME"`, a kind that differs, else `preset`), then the TOML file at `path`, then the
    `--section.key=value` overrides. A preset's values of the outer optimizer's settings (`OUTER_OPTIMIZER_SETTINGS`)
    apply only while `sync.outer.optimizer` is the preset's: another outer optimizer starts from the field defaults
    (its own auto learning rate)."""
    flags = parse_overrides(overrides or [])
    data: dict[str, Any] = read_toml(Path(path), "--config") if path else {}
    file_preset = data.pop("preset", None)
    if file_preset is not None and not isinstance(file_preset, str):
        raise ValueError(f"{path}: preset = {file_preset!r} must be the name of a preset ({', '.join(PRESETS)})")
    file_kind = data.get("sync", {}).get("kind") if isinstance(data.get("sync"), dict) else None
    if file_preset is not None and isinstance(file_kind, str) and file_kind != preset_kind(file_preset):
        raise ValueError(
            f"{path}: preset = {file_preset!r} and sync.kind = {file_kind!r} contradict: a kind is its preset's "
            f"identity (preset {file_preset} is {preset_kind(file_preset)}); write preset = {file_kind!r}, or leave "
            "sync.kind out"
        )
    said = [("preset", file_preset)] if file_preset is not None else []
    said += [("sync.kind", file_kind)] if isinstance(file_kind, str) else []
    name = choose_preset(said + [(key, value) for key, value in flags if key in ("preset", "sync.kind")], preset)
    cfg = Config()
    values = read_preset(name)
    warned: set[str] = set()  # each key of an earlier version is warned of once, in the file or in the flags
    apply_toml(cfg, values, source=f"preset {name}", warned=warned)
    layers = [set(flat_settings(values))]  # preset, file, flags
    if path:
        apply_toml(cfg, data, source=str(path), warned=warned)
        layers.append(set(flat_settings(data)))
    layers.append(set())
    _check_spellings([key for key, _ in flags], "the flags")
    for key, value in flags:
        if key != "preset":
            _set(cfg, key, value, from_text=True, warned=warned)
            layers[-1].add(MOVED_KEYS.get(key, key))
    if cfg.sync.kind in SYNC_KINDS:  # a weaker layer's kind gave way to the preset a stronger one chose
        cfg.sync.kind = preset_kind(name)
    keep_preset_optimizer(cfg, values, layers[0] - set().union(*layers[1:]))
    _resolve_clusters(cfg.topology, layers)
    return cfg, name, layers


def keep_preset_optimizer(cfg: Config, preset: dict[str, dict[str, Any]], inherited: set[str]) -> None:
    """A preset's values of the outer optimizer's settings (`OUTER_OPTIMIZER_SETTINGS`) are its outer optimizer's:
    where `sync.outer.optimizer` is another, those of `inherited` (the preset's, not set over it) return to the field
    defaults, so `--sync.outer.optimizer=adamw` over the dilocox preset takes AdamW's auto learning rate, not the
    SGD's 1.0 of plain averaging."""
    if cfg.sync.outer.optimizer == flat_settings(preset).get("sync.outer.optimizer", OuterConfig.optimizer):
        return
    for option in OUTER_OPTIMIZER_SETTINGS:
        if f"sync.outer.{option}" in inherited:
            setattr(cfg.sync.outer, option, getattr(OuterConfig, option))


def _resolve_clusters(topology: TopologyConfig, layers: list[set[str]]) -> None:
    """`topology.clusters` sets num_clusters, dp_degree (the largest) and pp_degree, over what earlier layers
    (preset < file < flags) gave them; one given in the same layer or a later one and contradicting it is refused
    by `Config.validate`, as is a shape it cannot parse."""
    if not topology.clusters:
        return
    own = max((index for index, keys in enumerate(layers) if "topology.clusters" in keys), default=0)
    explicit = set().union(*layers[own:])
    try:
        dp_degrees, pp_degree = topology.shape()
    except ValueError:
        return
    derived = {"num_clusters": len(dp_degrees), "dp_degree": max(dp_degrees), "pp_degree": pp_degree}
    for name, value in derived.items():
        if f"topology.{name}" not in explicit:
            setattr(topology, name, value)


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def from_dict(data: dict[str, Any]) -> Config:
    return apply_toml(Config(), data)


def to_toml(cfg: Config) -> str:
    """Serialize the resolved config as TOML (every field, with its docstring as a comment)."""
    lines = ["# Resolved dilocox configuration (every option); `dilocox train --config FILE` runs exactly this.", ""]
    for section, cls in section_types().items():
        docs = field_docs(cls)
        parent, _, own = section.rpartition(".")
        if parent:  # a sub-section: what it holds, from its field's docstring in the parent
            lines.append(f"# {' '.join(field_docs(section_types()[parent]).get(own, '').split())}")
        lines.append(f"[{section}]")
        for f in option_fields(cls):
            value = getattr(section_of(cfg, section), f.name)
            if docs.get(f.name):
                lines.append(f"# {' '.join(docs[f.name].split())}")  # one comment line, however the doc wraps
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
    if isinstance(value, dict):  # an inline table, keys quoted (a cluster number is a TOML key only as text)
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)  # a TOML basic string uses the same escapes
