"""Every check that can fail on user input, run by the launcher before anything is written or any rank starts, so
a mistake (config, data files, tokenizer, run directory, checkpoint to resume) ends with one line and exit code 2
and leaves no half-made run directory.

    data, resume = preflight(cfg)              # this machine starts every rank (`dilocox train`)
    data, resume = preflight(cfg, world_size)  # one rank of a torchrun job
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from dilocox.checkpoint import (
    check_auto_resume,
    check_resume,
    check_resume_model,
    checkpoint_step,
    find_checkpoint,
    list_checkpoints,
)
from dilocox.config import Config
from dilocox.data import ShardedTokenStream, TokenData, is_prepared_dir, iter_eval_batches
from dilocox.data.tokenizer import smaller_vocab_warning
from dilocox.device import resolve_device
from dilocox.elastic.lighthouse import probe_lighthouse
from dilocox.metrics import check_sinks
from dilocox.models import ModelArgs
from dilocox.net.listen import listening_socket
from dilocox.parallel import check_split, stage_tensor_counts
from dilocox.runlock import RunLock
from dilocox.trainer import eval_batch_tokens, model_shape, prepare_data


def preflight(cfg: Config, world_size: int | None = None) -> tuple[TokenData, Path | None]:
    """Every check that can fail on user input, before anything is written or any rank starts. `world_size` is
    torchrun's; without it this machine starts every rank (`check_local_ranks`)."""
    elastic_job = world_size is not None and cfg.topology.elastic
    cfg.validate(None if elastic_job else world_size)
    if elastic_job:
        check_elastic_job(cfg, world_size)
    cores = os.cpu_count() or 1
    if cfg.run.num_threads > cores:  # torch cannot start that many (100,000 crashed every rank)
        raise ValueError(
            f"run.num_threads = {cfg.run.num_threads:,} is more than this machine's {cores} cores; use "
            f"--run.num_threads={cores} or less (ranks x threads <= cores is fastest)"
        )
    if world_size is None:
        check_local_ranks(cfg)
        if cfg.network.advertise_host:  # not an address of this machine: one line here, not a launcher's traceback
            listening_socket(cfg.network.advertise_host).close()
        if cfg.topology.elastic and cfg.network.lighthouse:  # one that does not answer: one line, not 600 s of waits
            probe_lighthouse(cfg.network.lighthouse)
    check_sinks(tensorboard=cfg.metrics.tensorboard, wandb=cfg.metrics.wandb)  # a missing extra fails here
    resolve_device(cfg.run.device, local_rank=0)  # asking for a GPU where there is none fails here, not in a rank
    if world_size is None:  # under torchrun rank 0 checks it (the others would see rank 0's own lock)
        RunLock.ensure_free(Path(cfg.run.out_dir))  # a live run's directory: refused before its checkpoints are read
    resume = resolve_resume(cfg)
    data = prepare_data(cfg)
    args = model_shape(cfg, data.vocab_size)  # model.init_from: its config and weights' shapes too
    args.validate()
    if cfg.train.seq_len > args.max_seq_len:
        source = (
            f"max_position_embeddings of model.init_from = {cfg.model.init_from}"
            if cfg.model.init_from
            else f"model.flavor = {cfg.model.flavor}"
        )
        raise ValueError(
            f"train.seq_len = {cfg.train.seq_len} is beyond the model's context of {args.max_seq_len} positions "
            f"({source}); use --train.seq_len={args.max_seq_len} or less, or a model with a longer context"
        )
    check_split(args, cfg.topology.pp_degree)  # more stages than layers, or a tied embedding cut in two
    check_fragments(cfg, args)
    check_batches(cfg, data)  # every data shard holds a batch, the validation split one evaluation batch
    if resume is not None:  # another tokenizer or model shape than the checkpoint's: refused before any rank starts
        vocab = data.load_tokenizer().vocab_fingerprint()
        check_resume_model(resume, args, tokenizer_vocab=vocab, tokenizer_path=data.tokenizer_path)
    if os.environ.get("RANK", "0") == "0":  # once, not on every rank under torchrun
        for warning in data_warnings(cfg, data):
            print(warning, file=sys.stderr, flush=True)
    return data, resume


def check_elastic_job(cfg: Config, world_size: int) -> None:
    """An elastic run under torchrun: each torchrun job is one cluster (`topology.local_clusters` names it), of
    dp x pp ranks on any number of nodes, and torchrun starts it again when a rank dies (`--max-restarts`)."""
    t = cfg.topology
    example = "torchrun --nnodes N --nproc-per-node M ... -m dilocox train --topology.local_clusters=C"
    clusters = t.launched_clusters() if t.local_clusters.strip() else ()
    if len(clusters) != 1:
        raise ValueError(
            f"topology.local_clusters = {t.local_clusters!r}: under torchrun an elastic run's job is one cluster; "
            f"name it, e.g. `{example}` with C in 0..{t.num_clusters - 1} (docs/guides/elastic.md)"
        )
    ranks = len(t.build().ranks_of_cluster(clusters[0]))
    if world_size != ranks:
        raise ValueError(
            f"torchrun started {world_size} ranks for cluster {clusters[0]}, which has dp x pp = "
            f"{ranks // t.pp_degree} x {t.pp_degree} = {ranks}; start {ranks} ranks in its job "
            "(--nnodes x --nproc-per-node)"
        )


_RANK_START_BYTES = 200 << 20
"""Memory a local rank takes before it builds its model: the interpreter, torch and gloo (a debug-flavor rank
measured 340 MB resident, shared libraries included)."""


def _available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is no such file)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_local_ranks(cfg: Config) -> None:
    """Refuse a topology this machine cannot start as local processes: more than the user's process limit, or more
    ranks than the available memory holds at `_RANK_START_BYTES` each (before any model). torchrun spreads the
    ranks over machines and is not checked here."""
    import resource

    t, world = cfg.topology, cfg.world_size
    ranks = f"topology.num_clusters x dp_degree x pp_degree = {t.num_clusters} x {t.dp_degree} x {t.pp_degree}"
    if t.clusters:
        ranks = f"topology.clusters = {t.clusters}: {' + '.join(f'{dp} x {t.pp_degree}' for dp in t.shape()[0])}"
    fix = "use fewer clusters, replicas or stages, or start the ranks on several machines with torchrun"
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY and world > soft:
        raise ValueError(
            f"{ranks} = {world:,} local ranks, more than this user's {soft:,} processes (ulimit -u); {fix}"
        )
    available = _available_memory()
    if available is not None and world * _RANK_START_BYTES > available:
        raise ValueError(
            f"{ranks} = {world:,} local ranks would need about {world * _RANK_START_BYTES / 1e9:,.1f} GB just to start "
            f"({_RANK_START_BYTES >> 20} MB each before the model), but this machine has {available / 1e9:,.1f} GB "
            f"available; {fix}"
        )


def resolve_resume(cfg: Config) -> Path | None:
    """The checkpoint to resume, verified (`checkpoint.resume`): `auto` takes the newest one of run.out_dir when
    there is one (so `torchrun --max-restarts` recovers) and starts fresh otherwise; "" never resumes. In an elastic
    run it is the newest of any cluster's (the lowest cluster's at equal steps): the launcher starts each cluster from
    its own checkpoint of that step (`checkpoint.elastic_resume_paths`), and one without heals from those that have
    one. A static run's checkpoint resumed as elastic, or the reverse, is refused by `check_resume`
    (topology.elastic): their rank files and sync state are laid out for the other kind of run."""
    resume = cfg.checkpoint.resume
    if not resume or (resume == "auto" and (cfg.run.overwrite or not list_checkpoints(Path(cfg.run.out_dir)))):
        return None
    path = find_checkpoint(Path(cfg.run.out_dir), "latest" if resume == "auto" else resume)
    if resume == "auto":  # found, not asked for: it may belong to another run
        check_auto_resume(cfg, path)
    check_resume(cfg, path)
    if checkpoint_step(path) == cfg.train.steps:  # resumed, it would train nothing and rewrite the run's record
        raise ValueError(
            f"{path} is the end of its run (train.steps = {cfg.train.steps}): nothing is left to train; raise "
            "--train.steps to continue that run, or start a new one in another --run.out_dir"
        )
    return path


def check_fragments(cfg: Config, args: ModelArgs) -> None:
    """`sync.fragments` splits each stage's parameter tensors: no more fragments than the smallest stage has."""
    if cfg.sync.fragments == 1:
        return
    counts = stage_tensor_counts(args, cfg.topology.pp_degree)
    fewest = min(counts)
    if cfg.sync.fragments > fewest:
        where = f"pipeline stage {counts.index(fewest)} of {len(counts)}" if len(counts) > 1 else "the model"
        raise ValueError(
            f"sync.fragments = {cfg.sync.fragments} is more than the {fewest} parameter tensors of {where} "
            f"(model.flavor = {cfg.model.flavor}, topology.pp_degree = {cfg.topology.pp_degree}): each fragment syncs "
            f"whole tensors; use sync.fragments <= {fewest}"
        )


def check_batches(cfg: Config, data: TokenData) -> None:
    """Raise the data's own ValueError, before any rank starts, when a data shard holds fewer windows of
    `train.seq_len + 1` tokens than one batch, or the validation split fewer than one evaluation batch: the streams
    the ranks will build are built here (constructing one reads no tokens)."""
    topology = cfg.topology.build()  # one data shard per replica of every cluster
    for shard_index in range(topology.num_shards):
        ShardedTokenStream(
            data.train,
            seq_len=cfg.train.seq_len,
            batch_size=cfg.train.micro_batch_size,
            shard_index=shard_index,
            num_shards=topology.num_shards,
            seed=cfg.run.seed,
            shard=cfg.data.shard,
        )
    need, total = eval_batch_tokens(cfg), len(data.train) + len(data.val)
    if len(data.val) < need and not is_prepared_dir(cfg.data.path):
        windows = len(data.val) // (cfg.train.seq_len + 1)
        raise ValueError(
            f"the validation data has {len(data.val):,} tokens (data.val_fraction = {cfg.data.val_fraction:g} of "
            f"{total:,}), {windows} windows of train.seq_len + 1 = {cfg.train.seq_len + 1}, not enough for one "
            f"evaluation batch of train.micro_batch_size = {cfg.train.micro_batch_size} windows ({need:,} tokens); "
            + (
                f"hold out more with --data.val_fraction={min(0.5, math.ceil(need / total * 120) / 100):g} (about: "
                "whole documents are held out), "
                if need <= total / 2
                else f"use more text (these settings need about {need * (1 + topology.num_shards):,} tokens), "
            )
            + "or lower --train.micro_batch_size or --train.seq_len (docs/design.md §12, 'How much text a run needs')"
        )
    iter_eval_batches(data.val, seq_len=cfg.train.seq_len, batch_size=cfg.train.micro_batch_size)


def data_warnings(cfg: Config, data: TokenData) -> list[str]:
    """What the launcher says about the data once every check passed: a BPE trained here with fewer ids than
    `data.vocab_size` asked (the text ran out of merges)."""
    trained_here = not cfg.data.tokenizer and not cfg.model.init_from and not is_prepared_dir(cfg.data.path)
    warning = smaller_vocab_warning(data.vocab_size, cfg.data.vocab_size, option="--data.vocab_size")
    return [warning] if trained_here and warning else []
