"""Checkpoints at round boundaries: one `torch.save` file per rank, made complete atomically.

Layout of `RUN_DIR/checkpoints/`:

    step_00000100/          a complete checkpoint (it has meta.json)
        rank_00000.pt       model, inner optimizer, sync state (outer params, outer optimizer, reducer),
        rank_00001.pt       data position, RNG states and channel counters of that rank
        meta.json           step, world size, topology, config, and every rank file's size and sha256; last
    .step_00000200.partial  a checkpoint being written; never read, removed by the next save

Every rank writes its file into the `.partial` directory (fsync'd) with a small digest file beside it, all ranks
meet at a barrier, and rank 0 moves the digests into meta.json, renames the directory into place and fsyncs the
directories, so a checkpoint that looks complete always is. Resuming verifies every file's size and sha256:
`latest` skips a corrupt checkpoint (one line says which and why) for the newest one that verifies; a named one
that fails is a one-line error. Multi-machine runs need `run.out_dir` on storage that every node sees (as
torchrun jobs usually have).

    save_checkpoint(run_dir, step, state, rank=rank, meta=meta, keep=2)
    path = find_checkpoint(run_dir, "latest")      # verified
    state = load_rank_state(path, rank)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dilocox.config import Config
from dilocox.fileio import write_atomic

CHECKPOINT_DIR = "checkpoints"
META = "meta.json"
DIGEST_SUFFIX = ".digest.json"
"""A rank file's size and sha256, written beside it in the `.partial` directory and moved into meta.json."""


class CorruptCheckpoint(ValueError):
    """A checkpoint whose files do not match the sizes and sha256 digests its meta.json recorded."""


def _rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def _digest(path: Path) -> dict[str, Any]:
    """{"bytes": size, "sha256": hex digest} of a file, read in 1 MiB blocks."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return {"bytes": path.stat().st_size, "sha256": sha.hexdigest()}


def _fsync(path: Path) -> None:
    """Flush a file or a directory (its entries: renames and new files) to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    name = _rank_file(rank)
    tmp = partial / f".{name}.tmp"
    torch.save(state, tmp)
    _fsync(tmp)
    os.replace(tmp, partial / name)
    write_atomic(partial / (name + DIGEST_SUFFIX), json.dumps(_digest(partial / name)).encode())
    _barrier(group)
    if rank == 0:
        digests = sorted(partial.glob("*" + DIGEST_SUFFIX))
        files = {d.name.removesuffix(DIGEST_SUFFIX): json.loads(d.read_text()) for d in digests}
        write_atomic(partial / META, json.dumps({"step": step, **meta, "files": files}, indent=2).encode())
        for d in digests:
            d.unlink()
        _fsync(partial)
        if final.exists():  # the same step saved again after a resume: replace it whole
            shutil.rmtree(final)
        os.replace(partial, final)
        _fsync(root)
        # Only checkpoints that verify count towards `keep`, so pruning never deletes the last good one.
        good = [c for c in list_checkpoints(run_dir) if c == final or _problem(c, full=False) is None]
        for old in good[:-keep]:
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
    """Resolve `checkpoint.resume` (`latest` or a checkpoint directory) to a complete checkpoint directory whose
    files verify (`verify_checkpoint`); `latest` falls back to older checkpoints past corrupt ones, saying so."""
    if resume == "latest":
        found = list_checkpoints(run_dir)
        if not found:
            raise ValueError(
                f"checkpoint.resume = latest: no complete checkpoint in {Path(run_dir) / CHECKPOINT_DIR}; "
                "check run.out_dir or start without --checkpoint.resume"
            )
        for path in reversed(found):
            problem = _problem(path)
            if problem is None:
                return path
            print(f"dilocox: warning: skipping corrupt checkpoint {path}: {problem}", file=sys.stderr)
        raise CorruptCheckpoint(
            f"checkpoint.resume = latest: every checkpoint in {Path(run_dir) / CHECKPOINT_DIR} is corrupt (see the "
            "warnings above); start a new run"
        )
    path = Path(resume)
    if not (path / META).is_file():
        raise ValueError(
            f"checkpoint.resume = {resume}: not a complete checkpoint directory (no {META}); "
            f"pass `latest` or a directory like {Path(run_dir) / CHECKPOINT_DIR / 'step_00000100'}"
        )
    verify_checkpoint(path)
    return path


def verify_checkpoint(path: Path) -> None:
    """Raise `CorruptCheckpoint` (one line: which file, what is wrong) unless every rank file of the checkpoint
    has the size and sha256 its meta.json recorded."""
    problem = _problem(Path(path))
    if problem is not None:
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt: {problem}; resume from an older one or `latest`")


def _problem(path: Path, *, full: bool = True) -> str | None:
    """What is wrong with a checkpoint's files, or None. `full=False` checks sizes only (no reading)."""
    try:
        meta = read_meta(path)
    except (OSError, ValueError) as exc:
        return f"{META} is unreadable ({exc.__class__.__name__})"
    if "files" not in meta:
        return None  # written before checkpoints recorded digests: complete (it has meta.json), not verifiable
    files = meta["files"]
    if not isinstance(files, dict) or not files:
        return f"{META} lists no rank files"
    world_size = meta.get("world_size")
    if isinstance(world_size, int) and len(files) != world_size:
        return f"{META} lists {len(files)} rank files for a world of {world_size}"
    for name, want in sorted(files.items()):
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != want.get("bytes"):
            return f"{name} has {size:,} bytes, {want.get('bytes'):,} were written"
        if full and _digest(file)["sha256"] != want.get("sha256"):
            return f"{name} does not match its sha256 (bit rot or a partial overwrite)"
    return None


def read_meta(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / META).read_text())


def load_rank_state(path: Path, rank: int) -> dict[str, Any]:
    file = Path(path) / _rank_file(rank)
    if not file.is_file():
        raise ValueError(f"checkpoint {path} has no state for rank {rank}: was it written by a different topology?")
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # a file that verified but does not unpickle: another torch, or written by hand
        raise CorruptCheckpoint(
            f"checkpoint file {file} cannot be read ({exc.__class__.__name__}: {str(exc).splitlines()[0][:120]}); "
            "resume from an older checkpoint"
        ) from None


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
    if meta["step"] > cfg.train.steps:
        raise ValueError(
            f"checkpoint {path} is at step {meta['step']}, past train.steps = {cfg.train.steps}; "
            "raise train.steps to continue training"
        )
