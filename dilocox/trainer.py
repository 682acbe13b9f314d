"""The Trainer: one rank's model, inner optimizer, sync strategy, data stream and slow-link channel.

    trainer = Trainer(cfg, rank=rank, run_dir=run_dir)
    summary = trainer.train()        # on rank 0: the RunSummary also written to summary.json
    trainer.close()

Every rank runs the same code; the topology decides what it talks to (docs/design.md §2-3).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dilocox.agreement import run_settings, settings_fingerprint
from dilocox.checkpoint import (
    PendingSave,
    check_resume,
    list_checkpoints,
    load_rank_state,
    meta_topology,
    read_meta,
    run_identity,
    save_checkpoint,
    saved_outer_params,
    start_checkpoint,
)
from dilocox.config import Config, to_dict
from dilocox.data import ShardedTokenStream, TokenData, is_prepared_dir, iter_eval_batches, prepare_tokens
from dilocox.device import describe, intra_cluster_backend, resolve_device
from dilocox.elastic.rounds import RESUMED, heal_state_bound
from dilocox.metrics import MetricsLogger, RunSummary, format_summary, truncate_metrics
from dilocox.models import Decoder, ModelArgs, count_parameters, model_args
from dilocox.net.channel import WanChannel
from dilocox.net.json_gather import all_gather_json
from dilocox.net.watchdog import JobStore, Watchdog
from dilocox.optim import MuonAdamW, build_inner_optimizer, inner_state_bytes
from dilocox.parallel import PipelineRunner, broadcast_from_last_stage, build_stage, clip_grad_norm_, format_split
from dilocox.parallel.fsdp import (
    load_local_optimizer_state_,
    load_local_state_,
    local_state,
    replicate_stage,
    shard_stage,
)
from dilocox.parallel.pipeline import mean_token_cross_entropy
from dilocox.reshape import reshaped_rank_state
from dilocox.sync import RoundStats, TokenWeights, allreduce_bytes_per_step, build_sync
from dilocox.sync.replica import FollowerSync, StageMirror
from dilocox.sync.robust import GuardError
from dilocox.topology import Topology, build_process_groups, group_size, local_shard

AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}
"""The autocast dtype of each `train.dtype` (fp32: no autocast)."""


def prepare_data(cfg: Config) -> TokenData:
    """Load (or build and cache) the tokenizer and the token arrays named by the `data` section.

    A corpus that is one document (a single text file, split by tokens: its tail is held out) so small that
    `data.val_fraction` of it is less than one evaluation batch (`train.micro_batch_size` windows of
    `train.seq_len + 1` tokens) gets a longer tail instead: the smallest fraction, up to 0.5, that holds one batch.
    The fraction used is written into `cfg` (and so into the run's config.toml, which `dilocox eval` reads) and said
    in one line. A corpus of several documents holds out whole documents, which another fraction would change rather
    than extend, and a prepared directory's split is fixed: `launch.preflight.check_batches` names the fraction
    to set instead."""
    data = _prepare_tokens(cfg)
    need = eval_batch_tokens(cfg)
    if len(data.val) >= need or data.num_val_documents > 0 or is_prepared_dir(cfg.data.path):
        return data
    asked, first = cfg.data.val_fraction, data
    fraction = asked
    for _ in range(_MAX_SPLIT_TRIES):
        total = len(data.train) + len(data.val)
        # the BPE is trained on the head only, so the token count moves a little with the fraction: aim just above
        wanted = max(fraction * 1.02, need / max(1, total) * 1.02)
        fraction = min(_MAX_VAL_FRACTION, math.ceil(wanted * 1000) / 1000)
        cfg.data.val_fraction = fraction
        data = _prepare_tokens(cfg)
        if len(data.val) >= need or fraction >= _MAX_VAL_FRACTION:
            break
    if len(data.val) < need:  # too little text even at half: check_batches says how much the settings need
        cfg.data.val_fraction = asked
        return first
    if os.environ.get("RANK", "0") == "0":  # once, not on every rank under torchrun
        print(
            f"dilocox: data.val_fraction = {asked:g} of this text is {len(first.val):,} tokens, less than one "
            f"evaluation batch (train.micro_batch_size x (train.seq_len + 1) = {cfg.train.micro_batch_size} x "
            f"{cfg.train.seq_len + 1} = {need:,} tokens): holding out data.val_fraction = {fraction:g} instead "
            f"({len(data.val):,} tokens; recorded in the run's config.toml)",
            flush=True,
        )
    return data


def eval_batch_tokens(cfg: Config) -> int:
    """Tokens of one evaluation batch: `train.micro_batch_size` windows of `train.seq_len + 1`."""
    return cfg.train.micro_batch_size * (cfg.train.seq_len + 1)


_MAX_VAL_FRACTION = 0.5
_MAX_SPLIT_TRIES = 8


def _prepare_tokens(cfg: Config) -> TokenData:
    d = cfg.data
    tokenizer = d.tokenizer
    if not tokenizer and cfg.model.init_from:
        from dilocox.models.hf import hf_tokenizer_path

        tokenizer = hf_tokenizer_path(cfg.model.init_from)  # a pretrained model keeps its own tokenizer
    return prepare_tokens(
        path=d.path,
        tokenizer=tokenizer,
        vocab_size=d.vocab_size,
        val_fraction=d.val_fraction,
        text_field=d.text_field,
        seed=cfg.split_seed,
    )


def model_shape(cfg: Config, vocab_size: int) -> ModelArgs:
    """The run's model at its full context: the shape of `model.flavor`, or of `model.init_from`'s config.json
    (checked against its weights' headers)."""
    if not cfg.model.init_from:
        return model_args(cfg.model.flavor, vocab_size=vocab_size)
    from dilocox.models.hf import check_hf_weights, hf_model_args, read_hf_config

    source = cfg.model.init_from
    args = hf_model_args(read_hf_config(source), vocab_size=vocab_size, source=source)
    check_hf_weights(source, args)
    return args


def build_model(
    cfg: Config, vocab_size: int, *, stage: int = 0, num_stages: int = 1, device: torch.device | str = "cpu"
) -> Decoder:
    """Pipeline stage `stage` of the run's model (the whole model for one stage), built on the meta device and
    materialized with seed-keyed weights, or with `model.init_from`'s weights for this stage, so every cluster
    starts from the same parameters without sending them over the slow link and no rank ever allocates more than
    its stage. The rotary table is sized to `train.seq_len`."""
    args = dataclasses.replace(model_shape(cfg, vocab_size), max_seq_len=cfg.train.seq_len)
    model = build_stage(args, stage, num_stages, seed=cfg.run.seed, device=device)
    if cfg.model.init_from:
        from dilocox.models.hf import load_hf_weights_

        load_hf_weights_(model, cfg.model.init_from)
    return model


def configure_compute(model: Decoder, cfg: Config) -> None:
    """`train.dtype`, `train.activation_checkpointing` and `train.compile` on a built stage (none changes its
    weights or their names: `Module.compile` compiles in place, so checkpoints and the pipeline see the same
    parameters)."""
    model.autocast_dtype = AUTOCAST_DTYPES[cfg.train.dtype]
    model.activation_checkpointing = cfg.train.activation_checkpointing
    if cfg.train.compile:
        for block in model.layers.values():
            block.compile()


def lr_at(cfg: Config, step: float, *, peak: float | None = None) -> float:
    """Inner learning rate of 0-based step `step`: linear warm-up to `peak` (train.lr unless given), then cosine
    decay to peak x min_lr_ratio. With time rounds `step` is the run's progress (`SyncStatus.progress`), which
    may fall between two steps."""
    t = cfg.train
    peak = t.lr if peak is None else peak
    if step < t.warmup_steps:
        return peak * (step + 1) / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps - 1)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return peak * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_inner_lr(optimizer: torch.optim.Optimizer, cfg: Config, step: float) -> None:
    """Put step `step`'s learning rate in every group of the inner optimizer: `lr_at`, and for `MuonAdamW`'s Muon
    group the same schedule from train.muon_lr."""
    lr = lr_at(cfg, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    if isinstance(optimizer, MuonAdamW):
        muon_lr = lr_at(cfg, step, peak=cfg.train.muon_lr)
        for group in optimizer.muon.param_groups:
            group["lr"] = muon_lr


@torch.no_grad()
def evaluate(eval_step, tokens, *, seq_len: int, batch_size: int, max_batches: int | None) -> tuple[float | None, int]:
    """(mean token loss, tokens scored) on the non-overlapping windows at the start of `tokens`.

    `eval_step(inputs, targets)` returns a batch's mean loss, or None on a pipeline stage that has no loss (every
    batch has the same number of tokens, so the mean of batch means is the token mean)."""
    losses, count = [], 0
    for inputs, targets in iter_eval_batches(tokens, seq_len=seq_len, batch_size=batch_size, max_batches=max_batches):
        losses.append(eval_step(inputs, targets))
        count += targets.numel()
    return (None if losses[0] is None else sum(losses) / len(losses)), count


def model_eval_step(model: torch.nn.Module):
    """`eval_step` of a whole (unsplit) model."""

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> float:
        model.eval()
        loss = mean_token_cross_entropy(model(inputs), targets).item()
        model.train()
        return loss

    return step


_MAX_CONTROL_BYTES = 16 << 10
"""The most bytes a rank may declare for its memory report or its summary counters (a few hundred as JSON)."""


class TrainingDiverged(ValueError):
    """The loss or the parameters became non-finite: the run stops with one line, before any checkpoint of it."""


class Trainer:
    """Runs `train.steps` inner steps on this rank and keeps it in step with the others through `sync`."""

    def __init__(
        self,
        cfg: Config,
        *,
        rank: int,
        run_dir: Path,
        data: TokenData | None = None,
        job_store: JobStore | None = None,
        cluster_store: tuple[str, int] | None = None,
    ) -> None:
        """`job_store`: the job's store, for the heartbeat watchdog (`network.stall_timeout`); None runs without.
        `cluster_store`: (host, port) of this cluster's own store, where an elastic run's torchft Manager meets."""
        self.cfg = cfg
        self.rank = rank
        self.run_dir = Path(run_dir)
        torch.set_num_threads(cfg.run.num_threads)
        torch.manual_seed(cfg.run.seed + rank)
        self.topology = cfg.topology.build()
        self.coords = self.topology.coords(rank)
        # torchrun says which rank of this machine we are; the local launcher runs every rank on one machine
        self.device = resolve_device(cfg.run.device, local_rank=int(os.environ.get("LOCAL_RANK", rank)))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.elastic = cfg.topology.elastic
        """Each cluster is its own world; the slow link is torchft's group of the round (docs/design.md §10.1)."""
        timeout = datetime.timedelta(seconds=cfg.network.timeout_s)
        self.groups = build_process_groups(
            Topology(1, self.ranks_per_cluster // cfg.topology.pp_degree, cfg.topology.pp_degree)
            if self.elastic
            else self.topology,
            self.checkpoint_rank,
            intra_backend=intra_cluster_backend(self.device),
            timeout=timeout,
        )
        # checkpoints' DCP collectives, which a background save runs beside training's (gloo: host tensors)
        self.checkpoint_group = dist.new_group(backend="gloo", timeout=timeout)
        self.watchdog: Watchdog | None = None
        if job_store is not None and cfg.network.stall_timeout_s > 0:
            dist.barrier()  # one start line: a rank that started watching earlier does not count the others' wait
            self.watchdog = Watchdog.from_config(job_store, cfg.network, rank=rank, topology=self.topology)
            self.watchdog.start()
        self.data = data if data is not None else prepare_data(cfg)
        self.model_shape = model_shape(cfg, self.data.vocab_size)  # recorded in checkpoints for eval and export
        self.model_args = dataclasses.replace(self.model_shape, max_seq_len=cfg.train.seq_len)
        self.num_stages = cfg.topology.pp_degree
        self.model = build_model(
            cfg, self.data.vocab_size, stage=self.coords.pp, num_stages=self.num_stages, device=self.device
        )
        configure_compute(self.model, cfg)
        self.sharded = cfg.topology.dp_mode == "shard"
        """The cluster's dp ranks hold this stage as FSDP2 shards (`dilocox.parallel.fsdp`), not as replicas."""
        stage = self.model  # what the pipeline runs: the stage, or its DDP wrapper (the same parameters and names)
        if self.sharded:
            shard_stage(self.model, self.groups.dp_group)
        elif group_size(self.groups.dp_group) > 1:
            stage = replicate_stage(self.model, self.groups.dp_group)
        self.dp_reduced = stage is not self.model
        """The replicas' gradients are averaged by DDP during the backward, not by the sync after it."""
        self.num_params = count_parameters(self.model_args)
        self.runner = PipelineRunner(
            stage,
            stage_index=self.coords.pp,
            num_stages=self.num_stages,
            pp_group=self.groups.pp_group,
            schedule=cfg.train.pipeline_schedule,
            num_microbatches=cfg.train.num_microbatches,
            microbatch_size=cfg.train.micro_batch_size // cfg.train.num_microbatches,
            seq_len=cfg.train.seq_len,
            dim=self.model_args.dim,
            vocab_size=self.model_args.vocab_size,
        )
        # the pipeline of cluster 0, replica 0 (it contains rank 0) evaluates; its last stage has the loss. A sharded
        # stage's forward all-gathers its parameters over the dp ranks, so all of cluster 0's run it.
        self.in_eval_pipeline = self.coords.cluster == 0 and (self.coords.dp == 0 or self.sharded)
        self.inner_optimizer = build_inner_optimizer(cfg, self.model)
        self.mirror = None
        """Clusters of different dp: replica 0 of each stage syncs it for the others, which follow
        (`dilocox.sync.replica`); over the stage's dp_group."""
        if self.weighs_clusters and group_size(self.groups.dp_group) > 1:
            self.mirror = StageMirror(self.model.parameters(), self.groups.dp_group)
        self.membership = None
        if self.elastic and (self.mirror is None or self.mirror.leads):
            if cluster_store is None:
                raise ValueError("an elastic run needs its cluster's store: start it with `dilocox train`")
            self.membership = self._join_membership(cluster_store)
        self.channel = WanChannel(
            None if self.elastic else self.groups.cluster_group,  # elastic: rebound to each round's group
            bandwidth=cfg.network.bandwidth_bytes_per_s,
            latency_s=cfg.network.latency_s,
            num_sharing=self.syncing_ranks,  # the ranks of this cluster that sync at once share its uplink
            auth=cfg.network.payload_auth(),
            stop_if_cut_off=not self.elastic,  # elastic: only a cut-off cluster stops, and heals from a live peer
        )
        replica_tokens = cfg.train.micro_batch_size * cfg.train.seq_len
        self.cluster_tokens_per_step = replica_tokens * self.topology.dp_degrees[self.coords.cluster]
        """Tokens this cluster trains on per inner step (all its data-parallel replicas)."""
        if self.mirror is not None and not self.mirror.leads:
            self.sync = FollowerSync(self.mirror, name=cfg.sync.kind, inner_optimizer=self.inner_optimizer)
        else:
            self.sync = build_sync(
                cfg,
                self.model.parameters(),
                channel=self.channel,
                dp_group=None if self.mirror is not None else self.groups.dp_group,
                pp_group=self.groups.pp_group,
                agree_group=self.groups.sync_group,
                inner_optimizer=self.inner_optimizer,
                membership=self.membership,
                # clusters of different dp: each weighs its tokens against a round of one replica's in every
                # round, sum_c dp_c in all when every cluster trains its H steps
                weights=TokenWeights(
                    self.cluster_tokens_per_step,
                    round_tokens=cfg.sync.inner_steps * replica_tokens if self.weighs_clusters else None,
                    first_sum=float(self.topology.num_shards) if self.weighs_clusters else None,
                ),
                sharded=self.sharded,
                dp_reduced=self.dp_reduced,
                mirror=self.mirror,
            )
        self.time_rounds = cfg.sync.has_outer_loop and cfg.sync.round.mode == "time"
        """Every cluster trains for the same time budget per round; the run is ceil(train.steps / H) rounds."""
        self.sleep_factor = cfg.faults.slow_factor(self.coords.cluster) if cfg.faults.slow_mode == "sleep" else 1.0
        """faults.slow_clusters, sleep mode: every inner step of this cluster takes this many times longer."""
        self.guarded = cfg.sync.has_outer_loop and cfg.sync.guard.enabled
        """A non-finite loss does not stop the run at once: the guard heals the cluster at the round's end."""
        self.stream = ShardedTokenStream(
            self.data.train,
            seq_len=cfg.train.seq_len,
            batch_size=cfg.train.micro_batch_size,
            shard_index=self.topology.shard_index(rank),
            num_shards=self.topology.num_shards,
            seed=cfg.run.seed,
            shard=cfg.data.shard,
        )
        self.tokens_per_step = cfg.train.micro_batch_size * cfg.train.seq_len * self.topology.num_shards
        self.step = 0
        self._last_checkpoint_step = 0  # the checkpoint position (`_checkpoint_position`) of the last one
        self.elapsed_before = 0.0  # training seconds of the run before a resume
        self._start: float | None = None  # perf_counter() when this process started training
        self.initial_eval_loss: float | None = None
        self.lowest_eval_loss: float | None = None  # of the agreed model, the initial one included
        self.last_eval_loss: float | None = None  # of the agreed model
        self.last_eval_local: float | None = None  # of cluster 0's own model (eval.local)
        self.eval_tokens = 0  # tokens scored by the last evaluation
        self.eval_s = 0.0  # rank 0's time spent evaluating during training (excluded from tokens_per_s)
        self.losses: list[float] = []
        self.lr_step: float = 0
        """The progress whose learning rate the last inner step used (its step; with time rounds the run's)."""
        self.train_s = 0.0
        """Seconds of this rank's inner steps across resumes (no evaluation, checkpoint or wait at a boundary)."""
        self.checkpoint_s = 0.0
        """Seconds training waited for checkpoints in this process (a copy and the previous one, with async_save)."""
        self.pending_save: PendingSave | None = None  # a checkpoint written in the background (async_save)
        self.round_stats: RoundStats | None = None  # what the sync waited for at the last step cost, if anything
        self._tokenizer_vocab: str | None = None  # Tokenizer.vocab_fingerprint, read at the first checkpoint
        self.resumed_from: Path | None = None  # the checkpoint this process loaded, if any
        self.on_joining: Callable[[], None] | None = None
        """Elastic: called just before this cluster asks to join (the end of training waits for a restart's)."""
        self.on_joined: Callable[[], None] | None = None
        """Elastic: called once this cluster is in the run (the launcher stops a restart that never got in)."""

    def _join_membership(self, cluster_store: tuple[str, int]):
        from dilocox.elastic.membership import ElasticMembership

        cfg, t = self.cfg, self.cfg.topology
        timeout = datetime.timedelta(seconds=cfg.network.timeout_s)
        settings = run_settings(cfg)  # compared with the other clusters' at every boundary, the payload key's too
        return ElasticMembership(
            cluster=self.coords.cluster,
            num_clusters=t.num_clusters,
            min_clusters=cfg.sync.min_clusters,
            lighthouse=cfg.network.lighthouse,
            store_addr=cluster_store[0],
            store_port=cluster_store[1],
            host=cfg.network.listen_host,  # this rank's machine: under torchrun, not always the store's
            # clusters of different dp: replica 0's stages alone meet, and its stage p is the cluster's rank p
            rank_in_cluster=self.checkpoint_rank,
            ranks_per_cluster=self.syncing_ranks,
            timeout=timeout,
            quorum_timeout=timeout,
            # half the Lighthouse's join timeout (elastic.lighthouse.lighthouse_timeouts)
            control_timeout=datetime.timedelta(seconds=(cfg.network.stall_timeout_s or cfg.network.timeout_s) / 2),
            heal_max_bytes=heal_state_bound(cfg.sync, sum(p.numel() for p in self.model.parameters())),
            config_fingerprint=settings_fingerprint(settings),
            shared_settings=settings,
            # each cluster is its own world: its stages x replicas, or replica 0's pipeline where the others follow
            cluster_group=self.groups.pp_group if self.weighs_clusters else dist.group.WORLD,
            stall_timeout_s=cfg.network.stall_timeout_s,
            heartbeat_s=cfg.network.heartbeat_s,
        )

    # ---------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        model, inner = self.model.state_dict(), self.inner_optimizer.state_dict()
        return {  # a sharded stage's tensors: this rank's shards
            "model": local_state(model) if self.sharded else model,
            "inner_optimizer": local_state(inner) if self.sharded else inner,
            "sync": self.sync.state_dict(),
            "data": self.stream.state_dict(),
            "channel": self.channel.state_dict(),
            "rng": torch.get_rng_state(),
            "trainer": {
                "step": self.step,
                "elapsed_s": self.elapsed_before + self._elapsed(),
                "eval_s": self.eval_s,
                "train_s": self.train_s,
                "initial_eval_loss": self.initial_eval_loss,
                "lowest_eval_loss": self.lowest_eval_loss,
                # elastic: torchft's step, which a resumed cluster presents so that the others heal from it
                **({"torchft": self.membership.progress()} if self.membership is not None else {}),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.sharded:
            load_local_state_(self.model.state_dict(), state["model"])
            load_local_optimizer_state_(self.inner_optimizer, state["inner_optimizer"])
        else:
            self.model.load_state_dict(state["model"])
            self.inner_optimizer.load_state_dict(state["inner_optimizer"])
        self.channel.load_state_dict(state["channel"])  # before the sync, which may send a saved transfer again
        self.sync.load_state_dict(state["sync"])
        self.stream.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"])
        self.step = int(state["trainer"]["step"])
        self._last_checkpoint_step = self._checkpoint_position()
        self.elapsed_before = float(state["trainer"]["elapsed_s"])
        self.eval_s = float(state["trainer"]["eval_s"])
        self.train_s = float(state["trainer"].get("train_s", 0.0))  # checkpoints written before it: from here on
        self.initial_eval_loss = state["trainer"]["initial_eval_loss"]
        # checkpoints written before it was kept: the initial loss
        self.lowest_eval_loss = state["trainer"].get("lowest_eval_loss", self.initial_eval_loss)

    def checkpoint_meta(self) -> dict[str, Any]:
        if self._tokenizer_vocab is None:
            self._tokenizer_vocab = self.data.load_tokenizer().vocab_fingerprint()
        meta = {
            **run_identity(self.cfg),
            "config": to_dict(self.cfg),
            "model_args": dataclasses.asdict(self.model_shape),
            "tokenizer_vocab": self._tokenizer_vocab,  # a resume with another tokenizer is refused (checkpoint.py)
        }
        if self.elastic:  # the cluster's own world wrote it: its dp x pp ranks (docs/design.md §10.1)
            meta.update(world_size=self.ranks_per_cluster, elastic_cluster=self.coords.cluster)
        return meta

    @property
    def ranks_per_cluster(self) -> int:
        """The ranks of this rank's cluster: its dp degree x pp."""
        return len(self.topology.ranks_of_cluster(self.coords.cluster))

    @property
    def checkpoint_rank(self) -> int:
        """This rank's file in a checkpoint: its global rank, or in an elastic run its rank inside its cluster."""
        return self.rank - self.topology.ranks_of_cluster(self.coords.cluster).start if self.elastic else self.rank

    @property
    def weighs_clusters(self) -> bool:
        """Clusters of different dp: replica 0 of each stage syncs it, each cluster's update weighted by its tokens."""
        return not self.topology.uniform

    @property
    def syncing_ranks(self) -> int:
        """The ranks of this cluster on the slow link: all of them, or replica 0's stages where the other replicas
        follow it (`weighs_clusters`)."""
        return self.num_stages if self.weighs_clusters else self.ranks_per_cluster

    def resume(self, path: Path) -> None:
        check_resume(self.cfg, path)
        saved = meta_topology(read_meta(path))
        if (saved.dp_degree, saved.pp_degree) != (self.topology.dp_degree, self.topology.pp_degree):  # allowed
            state = reshaped_rank_state(path, self)
        else:
            state = load_rank_state(path, self.checkpoint_rank)
        self.load_state_dict(state)
        if self.membership is not None:  # the others heal from this cluster's step, not the reverse
            self.membership.resume_progress(state["trainer"]["torchft"])
        self.resumed_from = path

    def save(self, *, last: bool = False) -> Path:
        """Checkpoint this rank (collective); a rank with non-finite parameters stops the run instead, so no
        checkpoint of a diverged model is ever written and the good ones stay. With `checkpoint.async_save` it is
        written in the background, after the previous one is complete, but for the `last` of the run."""
        started = time.perf_counter()
        bad = [name for name, p in self.model.named_parameters() if not torch.isfinite(local_shard(p)).all()]
        if bad:
            self._diverged(f"non-finite parameters ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})")
        if self.pending_save is not None:
            pending, self.pending_save = self.pending_save, None
            pending.wait()
        self._last_checkpoint_step = step = self._checkpoint_position()  # time rounds: the round's nominal step
        where = {
            "rank": self.checkpoint_rank,
            "meta": self.checkpoint_meta(),
            "keep": self.cfg.checkpoint.keep,
            "keep_every": self.cfg.checkpoint.keep_every,
            "cluster": self.coords.cluster if self.elastic else None,  # elastic: each cluster its own, §10.1
            "group": self.checkpoint_group,
            # what a replicated stage holds alike on every replica (rank_state.replicated): written once
            "shared": None if self.sharded else f"cluster{self.coords.cluster}/stage{self.coords.pp}",
        }
        if self.cfg.checkpoint.async_save and not last:
            self.pending_save = start_checkpoint(
                self.run_dir, step, self.state_dict(), timeout_s=self.cfg.network.timeout_s, **where
            )
            path = self.pending_save.path
        else:
            path = save_checkpoint(self.run_dir, step, self.state_dict(), **where)
        self.checkpoint_s += time.perf_counter() - started
        return path

    def _diverged(self, what: str, fix: str = "lower train.lr or set train.grad_clip > 0") -> None:
        newest = list_checkpoints(self.run_dir)
        then = (
            f"the last checkpoint, {newest[-1]}, is from before it: {fix} and resume it with --checkpoint.resume"
            if newest
            else f"no checkpoint was written: {fix} and start again"
        )
        raise TrainingDiverged(
            f"training diverged on rank {self.rank} (cluster {self.coords.cluster}) at step {self.step}: {what}; "
            + then
        )

    # ---------------------------------------------------------------------------------------------- steps
    def train_step(self) -> float:
        """One inner step; returns the training loss (the last stage's, on every stage of the pipeline)."""
        started = time.perf_counter()
        inputs, targets = self.stream.next_batch()  # (batch, seq) each; every stage of a pipeline reads the same
        loss = self.runner.train_step(inputs, targets)  # forward + backward over all microbatches
        self.sync.reduce_gradients()
        if self.cfg.train.grad_clip > 0:
            clip_grad_norm_(
                self.model.parameters(),
                self.cfg.train.grad_clip,
                pp_group=self.groups.pp_group,
                shard_group=self.groups.dp_group if self.sharded else None,
            )
        self.lr_step = self.sync.status().progress if self.time_rounds else self.step
        set_inner_lr(self.inner_optimizer, self.cfg, self.lr_step)
        self.inner_optimizer.step()
        self.inner_optimizer.zero_grad(set_to_none=True)
        if self.sleep_factor > 1.0:  # faults.slow_clusters: this cluster's step takes factor x its compute time
            time.sleep((self.sleep_factor - 1.0) * (time.perf_counter() - started))
        step_s = time.perf_counter() - started  # training time only: the boundary's wait below is not a step's
        self.train_s += step_s
        self.step += 1
        self.round_stats = self.sync.after_inner_step(self.step, step_s=step_s)
        return broadcast_from_last_stage(loss, self.groups.pp_group)

    def evaluate(self, *, final: bool = False, agreed: bool = True) -> float:
        """Validation loss of the evaluating pipeline's model (collective over its stages): the model every cluster
        agrees on (`sync.agreed_model`), or with `agreed=False` cluster 0's own parameters. `final`: on
        `eval.final_max_batches` batches instead of `eval.max_batches`; the tokens scored go to `eval_tokens`."""
        c = self.cfg
        max_batches = c.eval.final_max_batches if final else c.eval.max_batches
        with self.sync.agreed_model() if agreed else nullcontext():
            loss, self.eval_tokens = evaluate(
                self.runner.eval_step,
                self.data.val,
                seq_len=c.train.seq_len,
                batch_size=c.train.micro_batch_size,
                max_batches=max_batches or None,
            )
        return broadcast_from_last_stage(loss, self.groups.pp_group)

    def _evaluate_now(self, *, final: bool) -> float:
        """The evaluation of this step: the agreed model (eval_loss) and, with `eval.local`, cluster 0's own."""
        eval_start = time.perf_counter()
        self.last_eval_loss = self.evaluate(final=final)
        self.last_eval_local = self.evaluate(final=final, agreed=False) if self.cfg.eval.local else None
        self.eval_s += time.perf_counter() - eval_start
        return self.last_eval_loss

    def _check_eval_loss(self, eval_loss: float) -> None:
        """Stop the run (`TrainingDiverged`) when the agreed model's eval loss is not finite or exceeds
        eval.divergence_ratio x the lowest so far; a run whose loss climbs (an outer lr far too large) would otherwise
        finish with exit 0 and checkpoints of a model worse than its start."""
        ratio, lowest = self.cfg.eval.divergence_ratio, self.lowest_eval_loss
        if ratio and lowest is not None and not eval_loss <= ratio * lowest:
            self._diverged(
                f"the agreed model's eval loss is {eval_loss:.4g}, above eval.divergence_ratio = {ratio:g} x its "
                f"lowest so far ({lowest:.4g})",
                fix="lower sync.outer.lr or train.lr (or raise eval.divergence_ratio, 0 = never stop on it)",
            )
        self.lowest_eval_loss = eval_loss if lowest is None else min(lowest, eval_loss)

    def _elapsed(self) -> float:
        return time.perf_counter() - self._start if self._start is not None else 0.0

    def _due(self, interval: int) -> bool:
        return interval > 0 and self.step % interval == 0

    def _checkpoint_due(self, interval: int) -> bool:
        """At a round boundary: whether a multiple of `interval` was passed since the last checkpoint (the same as
        `_due` when rounds end on multiples of it; with sync.round.fit_link they may not). With time rounds the
        position is the run's, by round, so that every cluster checkpoints at the same boundary."""
        return interval > 0 and self._checkpoint_position() // interval > self._last_checkpoint_step // interval

    def _checkpoint_position(self) -> int:
        """Where the run is for checkpoints: this rank's step, or with time rounds the nominal step of the last
        round boundary (rounds completed x H, at most train.steps), the same on every cluster."""
        if not self.time_rounds:
            return self.step
        return min(self.sync.status().outer_step * self.cfg.sync.inner_steps, self.cfg.train.steps)

    def _finished(self) -> bool:
        """Whether training is over: train.steps steps, or with time rounds every round of the run."""
        return self.sync.status().done if self.time_rounds else self.step >= self.cfg.train.steps

    # ---------------------------------------------------------------------------------------------- loop
    def train(self) -> RunSummary | None:
        """Train to `train.steps`; rank 0 logs, every rank checkpoints; returns the summary on rank 0."""
        cfg = self.cfg
        joined = self._rejoin() if self.elastic or self.mirror is not None else None
        logger = None
        if self.rank == 0:
            truncate_metrics(self.run_dir, self.step)
            logger = MetricsLogger(
                self.run_dir,
                total_steps=cfg.train.steps,
                start_step=self.step,
                progress=cfg.metrics.progress,
                tensorboard=cfg.metrics.tensorboard,
                wandb=cfg.metrics.wandb,
                config=to_dict(cfg),
            )
            for note in cfg.notes():
                logger.print(note)
        if self.in_eval_pipeline and self.initial_eval_loss is None and joined is None:
            self.initial_eval_loss = self.lowest_eval_loss = self.evaluate()
        self.memory = self._memory_report(logger)
        self._start = time.perf_counter()
        window_start, window_step = self._start, self.step
        try:
            # end the boundary the peers are at, abstaining from what this cluster missed (peers resumed from disk
            # settled theirs before their checkpoint)
            if joined is not None and joined[1] != RESUMED:
                if joined[1] == "round":
                    self.round_stats = self.sync.after_inner_step(self.step)
                if self.step >= cfg.train.steps:  # joined at the last boundary: no step left, but the end is its own
                    self.round_stats = self.sync.flush() or self.round_stats
                    path = self.save(last=True)
                    if logger is not None:
                        logger.print(f"checkpoint saved: {path}")
            while not self._finished():
                try:
                    self.losses.append(self.train_step())
                except GuardError as error:  # the launcher stops the other ranks
                    self._diverged(str(error))
                if not math.isfinite(self.losses[-1]) and not self.guarded:  # the launcher stops the other ranks
                    self._diverged(f"the training loss is {self.losses[-1]}")
                boundary = self.sync.status().boundary
                last = self._finished()
                if last:  # the record of the last step carries the updates left out of every sync it waited for
                    flushed = self.sync.flush()
                    if flushed is not None:
                        self.round_stats = flushed.with_exclusions_of(self.round_stats)
                messages = self.sync.status().messages
                while messages and logger is not None:
                    logger.print(messages.pop(0))
                if self.membership is not None:  # membership changes: printed where seen, recorded by cluster 0
                    self._record_elastic_events(logger)
                if logger is None:
                    messages.clear()  # rank 0 prints them; the others' copies go
                    self.losses.clear()  # rank 0 averages them per logged line; the others keep none
                eval_loss = None
                if self.in_eval_pipeline and (self._due(cfg.eval.interval) or last):
                    eval_start = time.perf_counter()
                    eval_loss = self._evaluate_now(final=last)
                    window_start += time.perf_counter() - eval_start  # throughput counts training time only
                # every outer round's record is logged, also when the round does not end on a logged step (H not a
                # multiple of metrics.log_interval, or fit_link); cocktail's per-step stats only on logged steps
                outer_round = self.round_stats is not None and self.round_stats.inner_steps is not None
                due = self._due(cfg.metrics.log_interval) or last or eval_loss is not None or outer_round
                if logger is not None and due:
                    now = time.perf_counter()
                    tokens_per_s = (self.step - window_step) * self.tokens_per_step / (now - window_start)
                    if self.time_rounds:  # the clusters' steps differ: their landed tokens over the training time
                        trained_s = self.elapsed_before + self._elapsed() - self.eval_s
                        tokens_per_s = self.sync.status().landed_tokens / trained_s if trained_s > 0 else float("nan")
                    logger.log(self._record(eval_loss, tokens_per_s))
                    for landed in self.round_stats.also_landed if self.round_stats is not None else ():
                        logger.log_event(self._round_record(landed))  # sync.fragments: one record per sync
                    self.losses.clear()
                    window_start, window_step = now, self.step
                if eval_loss is not None:  # logged above; stopped before a checkpoint of it
                    self._check_eval_loss(eval_loss)
                if boundary and (self._checkpoint_due(cfg.checkpoint.interval) or last):
                    path = self.save(last=last)
                    if logger is not None:
                        logger.print(f"checkpoint {'being written' if self.pending_save else 'saved'}: {path}")
            wall_s = self.elapsed_before + self._elapsed()
            if self.elastic:
                self._write_membership_record(joined)
            return self._summary(wall_s, logger)
        finally:
            if logger is not None:
                logger.close()

    def _rejoin(self) -> tuple[int, str] | None:
        """Elastic: meet the other clusters. One that joins a run in progress heals from a live peer (outer params,
        outer optimizer, round counter), moves its step and data stream to the peers' boundary and says so."""
        if self.on_joining is not None:
            self.on_joining()
        joined = self.sync.rejoin()
        if self.on_joined is not None:
            self.on_joined()
        if joined is None:
            return None
        step, phase = joined
        self.stream.skip_batches(step - self.step)  # from step 0, or from an older checkpoint's step
        if self.resumed_from is not None:  # that checkpoint's inner optimizer state belongs to rounds gone by
            self.inner_optimizer.load_state_dict(build_inner_optimizer(self.cfg, self.model).state_dict())
        self.step = self._last_checkpoint_step = step
        how = "its peers resumed from disk" if phase == RESUMED else "a live peer"
        if self.coords.dp == 0 and self.coords.pp == 0:  # one line per cluster
            print(
                f"dilocox: elastic: cluster {self.coords.cluster} rejoined at step {step} (outer step "
                f"{self.sync.status().outer_step}), healed from {how}",
                flush=True,
            )
        return joined

    def _write_membership_record(self, joined: tuple[int, str] | None) -> None:
        """elastic/cluster{c}.json: how this process of the cluster ended (its outer params' digest, whether it healed
        from a peer or loaded a checkpoint), so a run's clusters can be compared bit for bit. Every rank of the
        cluster calls it (the stages' digests meet); its first rank writes it."""
        import hashlib
        import json

        from dilocox.fileio import write_atomic

        outer = saved_outer_params(self.sync.state_dict())  # None on a replica that follows replica 0's sync
        stage_sha256 = None
        if outer is not None:
            stage_sha256 = hashlib.sha256(outer.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
        if self.num_stages > 1 or self.sharded:  # the cluster's world is gloo whatever the fast groups' backend
            # every stage's digest, and of a sharded stage every dp rank's (its shard): in (stage, shard) order
            part = [self.coords.pp, self.coords.dp if self.sharded else 0]
            gathered = all_gather_json([part, stage_sha256], group=dist.group.WORLD, max_bytes=1024)
            parts = {tuple(key): sha for key, sha in gathered if sha is not None}
            stage_sha256 = hashlib.sha256(" ".join(parts[key] for key in sorted(parts)).encode()).hexdigest()
        if self.coords.dp != 0 or self.coords.pp != 0:  # one record per cluster
            return
        status = self.sync.status()
        record = {
            "cluster": self.coords.cluster,
            "step": self.step,
            "outer_step": status.outer_step,
            # one unsharded stage: its outer params' bytes; else the digest of the stages' (shards') digests, in order
            "outer_params_sha256": stage_sha256,
            "healed_from_peer": joined is not None,
            "rejoined_at_step": None if joined is None else joined[0],
            "last_round_clusters": list(status.last_clusters),
            "heals": self.membership.heals,
            "resumed_from_checkpoint": None if self.resumed_from is None else str(self.resumed_from),
            "last_eval_loss": self.last_eval_loss,
        }
        (self.run_dir / "elastic").mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "elastic" / f"cluster{self.coords.cluster}.json"
        write_atomic(path, json.dumps(record, indent=2).encode())

    def _record_elastic_events(self, logger: MetricsLogger | None) -> None:
        """The stalls, leaves and rejoins seen since the last step, as `elastic` records of metrics.jsonl."""
        events = self.sync.status().events
        while events:
            event = events.pop(0)
            if logger is not None:
                logger.log_event(event.record())

    def _record(self, eval_loss: float | None, tokens_per_s: float) -> dict[str, Any]:
        stats, status = self.channel.stats(), self.sync.status()
        record = {
            "step": self.step,
            "outer_step": status.outer_step,
            "loss": sum(self.losses) / len(self.losses) if self.losses else float("nan"),
            "lr": lr_at(self.cfg, self.lr_step),
            # time rounds: every cluster's tokens in the rounds whose sync landed (exact once the last one did)
            "tokens": status.landed_tokens if self.time_rounds else self.step * self.tokens_per_step,
            "tokens_per_s": tokens_per_s,
            "wan_bytes_sent": stats["bytes_sent"],
            "wan_bytes_recv": stats["bytes_recv"],
            "link_busy_s": stats["link_busy_s"],
            "exposed_comm_s": stats["exposed_s"],
            "peer_wait_s": stats["peer_wait_s"],
            "payloads_rejected": stats["payloads_rejected"],
            "elapsed_s": self.elapsed_before + self._elapsed(),
        }
        if eval_loss is not None:  # the model the clusters agree on (DiLoCo: the outer params), docs/design.md §3
            record.update(eval_loss=eval_loss, eval_model="agreed", eval_tokens=self.eval_tokens)
            if self.last_eval_local is not None:
                record["eval_loss_local"] = self.last_eval_local
        if self.round_stats is not None:  # link, exposed and hidden time of the sync waited for at this step
            record.update(self.round_stats.to_record())
        if self.membership is not None:  # the clusters of the last round settled (`dilocox plot`: membership)
            record["round_clusters"] = list(status.last_clusters)
        return record

    def _round_record(self, stats: RoundStats) -> dict[str, Any]:
        """The record of a fragment's sync landed at this step besides the one the step's record carries."""
        return {"event": "round", "step": self.step, "outer_step": self.sync.status().outer_step, **stats.to_record()}

    def _summary(self, wall_s: float, logger: MetricsLogger | None) -> RunSummary | None:
        """Gather every rank's link counters (a small control message, not counted as slow-link payload)."""
        stats = self.channel.stats()
        # a sharded stage: this rank's shard is its part; replica 0 syncing for its followers: the whole stage
        per_step = allreduce_bytes_per_step(
            0 if self.mirror is not None and not self.mirror.leads else self.sync.status().numel,
            dp_group=None if self.sharded or self.mirror is not None else self.groups.dp_group,
            clusters=self.topology.num_clusters,
            position=self.coords.cluster,
        )
        mine = {
            "bytes_sent": stats["bytes_sent"],
            "allreduce_equiv": per_step * self.step,
            "payloads_rejected": stats["payloads_rejected"],
            "peak_in_flight_bytes": stats["peak_in_flight_bytes"],
            # the first stage of each replica counts its batches (every stage of a pipeline reads the same)
            "tokens": self.step * self.cfg.train.micro_batch_size * self.cfg.train.seq_len * (self.coords.pp == 0),
            "train_s": self.train_s,
        }
        gathered = all_gather_json(mine, group=dist.group.WORLD, max_bytes=_MAX_CONTROL_BYTES)
        if self.in_eval_pipeline and self.last_eval_loss is None:
            eval_s = self.eval_s  # resumed at the last step: nothing was evaluated in the loop, nothing trained
            self._evaluate_now(final=True)
            self.eval_s = eval_s
        if self.rank != 0:
            return None

        def per_cluster(values: list, combine: Callable[[list], Any]) -> list:
            """`combine` of each cluster's ranks' values (gathered in rank order, cluster by cluster)."""
            clusters = range(self.topology.num_clusters)
            return [combine([values[r] for r in self.topology.ranks_of_cluster(c)]) for c in clusters]

        final_eval_loss = self.last_eval_loss
        # every cluster's own steps (they differ with time rounds); an elastic cluster gathers only its own ranks
        tokens = self.step * self.tokens_per_step if self.elastic else sum(g["tokens"] for g in gathered)
        c = self.cfg
        checkpoints = list_checkpoints(self.run_dir)
        status = self.sync.status()
        guard = status.guard_counts
        summary = RunSummary(
            final_eval_loss=final_eval_loss,
            initial_eval_loss=self.initial_eval_loss,
            tokens=tokens,
            wall_s=wall_s,
            tokens_per_s=tokens / (wall_s - self.eval_s) if wall_s > self.eval_s else float("nan"),
            eval_s=self.eval_s,
            wan_bytes_total=sum(g["bytes_sent"] for g in gathered),
            allreduce_equiv_bytes=sum(g["allreduce_equiv"] for g in gathered),
            payloads_rejected=sum(g["payloads_rejected"] for g in gathered),
            peak_in_flight_bytes=max(g["peak_in_flight_bytes"] for g in gathered),
            # an elastic cluster is its own world: `gathered` holds this cluster's ranks only
            wan_bytes_clusters=[self.coords.cluster] if self.elastic else None,
            link_busy_s=stats["link_busy_s"],
            exposed_comm_s=stats["exposed_s"],
            peer_wait_s=stats["peer_wait_s"],
            hidden_comm_fraction=(
                min(1.0, max(0.0, 1.0 - stats["exposed_s"] / stats["link_busy_s"])) if stats["link_busy_s"] else None
            ),
            steps=self.step,
            outer_steps=status.outer_step,
            sync_kind=c.sync.kind,
            sync_delay=c.sync.sync_delay,
            merge=c.sync.merge,
            inner_steps=c.sync.inner_steps,
            final_inner_steps=status.inner_steps,
            fragments=c.sync.fragments,
            flavor=c.model.flavor,
            num_params=self.num_params,
            rank_state_bytes=self.memory,
            num_clusters=c.topology.num_clusters,
            dp_degree=c.topology.dp_degree,
            pp_degree=c.topology.pp_degree,
            dp_degrees=None if self.topology.uniform else list(self.topology.dp_degrees),
            checkpoint_s=self.checkpoint_s,
            bandwidth=c.network.bandwidth,
            latency=c.network.latency,
            checkpoint=str(checkpoints[-1]) if checkpoints else None,
            run_dir=str(self.run_dir),
            final_eval_tokens=self.eval_tokens,
            run_seed=c.run.seed,
            split_seed=c.split_seed,
            guard_excluded_updates=guard["excluded_updates"],
            guard_skipped_rounds=guard["skipped_rounds"],
            cluster_tokens=None if self.elastic else per_cluster([g["tokens"] for g in gathered], sum),
            cluster_train_s=None if self.elastic else per_cluster([g["train_s"] for g in gathered], lambda v: v[0]),
        )
        summary.write(self.run_dir)
        if logger is not None:
            logger.print(format_summary(summary))
        return summary

    def state_bytes(self) -> dict[str, int]:
        """Bytes of this rank's training state: its stage's parameters, gradients, inner and outer optimizer state
        (optimizer states counted at their full size even before the first step allocates them; a sharded stage's,
        this rank's shards)."""
        params = sum(local_shard(p).numel() * p.element_size() for p in self.model.parameters())
        inner = inner_state_bytes(self.inner_optimizer)
        outer = self.sync.status().state_bytes
        outer_on_host = self.cfg.sync.outer.state_device == "cpu" and self.device.type != "cpu"
        return {
            "rank": self.rank,
            "stage": self.coords.pp,
            "params": params,
            "grads": params,
            "inner_state": inner,
            "outer_state": outer,
            "total": 2 * params + inner + outer,
            "device_bytes": 2 * params + inner + (0 if outer_on_host else outer),
            "host_bytes": outer if outer_on_host else 0,
        }

    def _memory_report(self, logger: MetricsLogger | None) -> list[dict[str, int]]:
        """Every rank's state bytes and device (a small control message), printed by rank 0 at the start."""
        mine = (self.state_bytes(), describe(self.device))
        gathered = all_gather_json(mine, group=dist.group.WORLD, max_bytes=_MAX_CONTROL_BYTES)
        report = [state for state, _ in gathered]
        if logger is not None:
            if self.num_stages > 1:
                logger.print(format_split(self.model_args, self.num_stages))
            worst = max(report, key=lambda r: r["total"])
            mb = 1e6
            devices = ", ".join(f"rank {rank} {device}" for rank, (_, device) in enumerate(gathered))
            logger.print(f"devices: {devices}; the slow link is gloo over TCP from host memory")
            model = self.cfg.model.init_from or self.cfg.model.flavor
            logger.print(
                f"model {model}: {self.num_params:,} parameters; largest rank state (rank "
                f"{worst['rank']}, stage {worst['stage']}): params {worst['params'] / mb:,.1f} MB, grads "
                f"{worst['grads'] / mb:,.1f} MB, inner {worst['inner_state'] / mb:,.1f} MB, outer "
                f"{worst['outer_state'] / mb:,.1f} MB, total {worst['total'] / mb:,.1f} MB (on the device "
                f"{worst['device_bytes'] / mb:,.1f} MB, on the host {worst['host_bytes'] / mb:,.1f} MB)"
            )
        return report

    def close(self) -> None:
        """Stop the channel's thread and the watchdog (this rank is done: the others stop watching it)."""
        self.channel.close()
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.membership is not None:
            self.membership.close()
