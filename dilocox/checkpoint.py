"""Checkpoints at round boundaries: one `torch.save` file per rank, made complete atomically.

Layout of `RUN_DIR/checkpoints/`:

    step_00000100/          a complete checkpoint (it has meta.json)
        rank_00000.pt       model, inner optimizer, sync state (outer params, outer optimizer, reducer),
        rank_00001.pt       data position, RNG states and channel counters of that rank
        meta.json           step, world size, topology, config; written last
    .step_00000200.partial  a checkpoint being written; never read, removed by the next save

Every rank writes its file into the `.partial` directory, all ranks meet at a barrier, and rank 0 writes
meta.json and renames the directory into place, so a checkpoint that looks complete always is. Multi-machine
runs need `run.out_dir` on storage that every node sees (as torchrun jobs usually have).

    save_checkpoint(run_dir, step, state, rank=rank, meta=meta, keep=2)
    path = find_checkpoint(run_dir, "latest")
    state = load_rank_state(path, rank)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dilocox.config import Config
from dilocox.fileio import write_atomic

CHECKPOINT_DIR = "checkpoints"
META = "meta.json"


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.barrier(group=group)


def save_checkpoint(
    run_dir: Path,
    step: int,
    state: dict[str, Any],
    *,
    rank: int,
    meta: dict[str, Any],
    keep: int,
    group: dist.ProcessGroup | None = None,
) -> Path:
    """Collectively save this rank's `state` as checkpoint `step`; rank 0 finalizes it and prunes old ones."""
    root = Path(run_dir) / CHECKPOINT_DIR
    final = _step_dir(root, step)
    partial = root / f".{final.name}.partial"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir()
    _barrier(group)
    tmp = partial / f".rank_{rank:05d}.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, partial / f"rank_{rank:05d}.pt")
    _barrier(group)
    if rank == 0:
        write_atomic(partial / META, json.dumps({"step": step, **meta}, indent=2).encode())
        if final.exists():  # the same step saved again after a resume: replace it whole
            shutil.rmtree(final)
        os.replace(partial, final)
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier(group)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and (p / META).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def find_checkpoint(run_dir: Path, resume: str) -> Path:
    """Resolve `checkpoint.resume` (`latest` or a checkpoint directory) to a complete checkpoint directory."""
    if resume == "latest":
        found = list_checkpoints(run_dir)
        if not found:
            raise ValueError(
                f"checkpoint.resume = latest: no complete checkpoint in {Path(run_dir) / CHECKPOINT_DIR}; "
                "check run.out_dir or start without --checkpoint.resume"
            )
        return found[-1]
    path = Path(resume)
    if not (path / META).is_file():
        raise ValueError(
            f"checkpoint.resume = {resume}: not a complete checkpoint directory (no {META}); "
            f"pass `latest` or a directory like {Path(run_dir) / CHECKPOINT_DIR / 'step_00000100'}"
        )
    return path


def read_meta(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / META).read_text())


def load_rank_state(path: Path, rank: int) -> dict[str, Any]:
    file = Path(path) / f"rank_{rank:05d}.pt"
    if not file.is_file():
        raise ValueError(f"checkpoint {path} has no state for rank {rank}: was it written by a different topology?")
    return torch.load(file, map_location="cpu", weights_only=True)


def run_identity(cfg: Config) -> dict[str, Any]:
    """What a checkpoint must share with the run that resumes it."""
    t = cfg.topology
    return {
        "world_size": cfg.world_size,
        "num_clusters": t.num_clusters,
        "dp_degree": t.dp_degree,
        "pp_degree": t.pp_degree,
        "sync_kind": cfg.sync.kind,
        "flavor": cfg.model.flavor,
    }


def check_resume(cfg: Config, path: Path) -> None:
    """Refuse to resume a checkpoint written by another topology, strategy or model, or past the last step."""
    meta = read_meta(path)
    for key, value in run_identity(cfg).items():
        if meta.get(key) != value:
            raise ValueError(
                f"checkpoint {path} was written with {key} = {meta.get(key)!r} but this run has {value!r}; "
                "resume with the same topology, sync.kind and model.flavor"
            )
    # The data position is an index into the deal of data.shard; checkpoints from before it existed were contiguous.
    saved_shard = meta.get("config", {}).get("data", {}).get("shard", "contiguous")
    if saved_shard != cfg.data.shard:
        raise ValueError(
            f"checkpoint {path} was written with data.shard={saved_shard} but this run has data.shard="
            f"{cfg.data.shard}; resume with --data.shard={saved_shard}"
        )
    if meta["step"] > cfg.train.steps:
        raise ValueError(
            f"checkpoint {path} is at step {meta['step']}, past train.steps = {cfg.train.steps}; "
            "raise train.steps to continue training"
        )
