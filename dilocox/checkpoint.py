"""Checkpoints at round boundaries: one `torch.distributed.checkpoint` (DCP) checkpoint of every rank's state, made
complete atomically, and verified on read.

Layout of `RUN_DIR/checkpoints/`:

    step_00000100/          a complete checkpoint (it has meta.json)
        .metadata           DCP's index of the tensors below (`dilocox/rank_state.py`)
        __0_0.distcp        what rank 0 wrote: its model, inner optimizer, sync state (outer params, outer optimizer,
        __1_0.distcp        reducer), data position, RNG states and channel counters; a replicated stage's model,
                            inner optimizer and outer state once for all its replicas (DCP spreads those over them)
        meta.json           step, world size, topology, config, every file's size and sha256 (`files`), and its
                            own `digest`: the sha256 of the canonical JSON of everything else in it; written last
    .step_00000200.partial  a checkpoint being written; never read, removed by the next save

Every rank writes its file into the `.partial` directory with `dcp.save` (fsync'd, over the checkpoint's own gloo
group) and a small digest file beside it (rank 0 one for DCP's index too), all ranks meet at a barrier, and rank 0
moves the digests into meta.json, renames the directory into place and fsyncs the directories, so a checkpoint that
looks complete always is. `start_checkpoint` (checkpoint.async_save) does the same in a thread per rank, from a host
copy of the state, while training goes on: rank 0's thread finalizes once every rank's digest files are there (a rank
whose write failed leaves its line instead), and `PendingSave.wait`, before the next save, makes every rank report a
failed write as a foreground save does. Every read goes through `verify_checkpoint`: meta.json must match its digest
and list the files, and each file read must have the size and sha256 listed. A checkpoint written before DCP (one
`rank_XXXXX.pt` per rank, meta.json without `format`) is still read. `latest` skips a corrupt checkpoint (one line
says which and why) for the newest one that verifies; a named one that fails is a one-line error. Multi-machine runs
need `run.out_dir` on storage that every node sees (as torchrun jobs usually have).

An elastic run (docs/design.md §10.1) has one torch.distributed world per cluster, so each cluster writes a checkpoint
of its own ranks (files named by the rank inside the cluster, `world_size` = its dp x pp ranks, `elastic_cluster` in
meta.json) into `checkpoints/cluster{c}/`, pruned to `checkpoint.keep` there; `list_checkpoints` lists every cluster's,
and at equal steps the lowest cluster's counts as the newest (`latest`, `dilocox eval`, `dilocox export`).

    save_checkpoint(run_dir, step, state, rank=rank, meta=meta, keep=2, keep_every=1000)  # + one per 1000 steps
    pending = start_checkpoint(run_dir, step, state, rank=rank, meta=meta, keep=2)  # returns at once
    pending.wait()                                 # before the next save: raises a write that failed on any rank
    path = find_checkpoint(run_dir, "latest")      # verified: meta.json and every rank file
    state = load_rank_state(path, rank)            # verifies meta.json and the files it reads, then loads them
    model = consolidated_model_state(path, agreed=True)   # the whole model, from every stage's file
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import hashlib
import json
import os
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem

from dilocox.compress.config import SPARSE_KINDS
from dilocox.config import Config, flat_settings, option_value
from dilocox.data.corpus import describe_corpus, same_corpus
from dilocox.fileio import write_atomic
from dilocox.models import ModelArgs, model_args
from dilocox.net.json_gather import all_gather_json
from dilocox.rank_state import DCP_METADATA, checkpoint_items, load_state
from dilocox.topology import Topology

CHECKPOINT_DIR = "checkpoints"
META = "meta.json"
DIGEST_SUFFIX = ".digest.json"
"""A file's size and sha256, written beside it in the `.partial` directory and moved into meta.json."""
FORMAT = "dcp"
"""meta.json's `format`: the files are one DCP checkpoint (absent: one `torch.save` file per rank, read only)."""


META_DIGEST = "digest"
"""The meta.json entry that holds its own digest: sha256 of the canonical JSON (`_canonical`) of the other entries."""
RESUME_FIX = "use the previous checkpoint (`latest`, the default, skips a corrupt one)"
"""What to do about a corrupt checkpoint, unless the reader says otherwise."""


class CorruptCheckpoint(ValueError):
    """A checkpoint whose meta.json does not match its digest or lists no rank files, or whose rank files do not match
    the sizes and sha256 digests it lists. `problem` says which file and what is wrong."""

    def __init__(self, message: str, problem: str = "") -> None:
        super().__init__(message)
        self.problem = problem or message


def _corrupt(path: Path, problem: str, fix: str = RESUME_FIX) -> CorruptCheckpoint:
    return CorruptCheckpoint(f"checkpoint {path} is corrupt: {problem}; {fix}", problem)


def _rank_file(rank: int) -> str:
    """A rank's file in a checkpoint written before DCP."""
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


def checkpoint_root(run_dir: Path, cluster: int | None = None) -> Path:
    """Where a run's checkpoints are: `checkpoints/`, or in an elastic run cluster `cluster`'s `checkpoints/cluster{c}/`
    (each cluster is its own world and writes its own ranks' state)."""
    root = Path(run_dir) / CHECKPOINT_DIR
    return root if cluster is None else root / f"cluster{cluster}"


def checkpoint_step(path: Path) -> int:
    """The step of checkpoint directory `path` (`step_00000100` -> 100)."""
    return int(Path(path).name.split("_")[1])


def _cluster_of(path: Path) -> int:
    """The elastic cluster whose checkpoint `path` is, from its parent directory (-1 for a static run's)."""
    parent = Path(path).parent.name
    return int(parent.removeprefix("cluster")) if parent.startswith("cluster") else -1


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
    keep_every: int = 0,
    group: dist.ProcessGroup | None = None,
    cluster: int | None = None,
    shared: str | None = None,
) -> Path:
    """Collectively save this rank's `state` as checkpoint `step`; rank 0 finalizes it and prunes old ones (`prune`).
    `cluster`: an elastic run's cluster, whose ranks (`rank` counted inside it, `group` its world) write into
    `checkpoint_root(run_dir, cluster)`. `shared`: the key under which what a replicated stage holds alike on every
    replica is written once (`rank_state.replicated`: model, inner optimizer, outer state). A write that fails on any
    rank (a full disk, checked first against the last checkpoint's size) raises `CheckpointNotWritten` on every rank
    after the partial directory is removed: the checkpoints before it stay as they were."""
    root = checkpoint_root(run_dir, cluster)
    final, partial = _begin(root, step, rank, group)
    _stop_if_any_failed(_write_rank(partial, rank, state, step, group, shared), partial, rank, group)
    error = _finalize(partial, final, step, meta, keep, keep_every) if rank == 0 else None
    _stop_if_any_failed(error, partial, rank, group)
    _barrier(group)
    return final


class PendingSave:
    """A checkpoint this rank writes in a thread of its own (`start_checkpoint`): training goes on meanwhile."""

    def __init__(self, final: Path, partial: Path, rank: int, group: dist.ProcessGroup | None, work) -> None:
        self.path, self._partial, self._rank, self._group = final, partial, rank, group
        self._error: str | None = None
        self._thread = threading.Thread(target=self._run, args=(work,), name="dilocox-checkpoint", daemon=True)
        self._thread.start()

    def _run(self, work) -> None:
        try:
            self._error = work()
        except BaseException as exc:  # noqa: BLE001 - reported by `wait` on the training thread
            self._error = f"checkpoint {self.path} could not be written ({exc.__class__.__name__}: {exc})"

    def wait(self) -> Path:
        """Collectively: wait until every rank's thread is done and the checkpoint is complete; a write that failed
        on any rank raises `CheckpointNotWritten` on every rank (its partial directory removed)."""
        self._thread.join()
        _stop_if_any_failed(self._error, self._partial, self._rank, self._group)
        _barrier(group=self._group)
        return self.path


def start_checkpoint(
    run_dir: Path,
    step: int,
    state: dict[str, Any],
    *,
    rank: int,
    meta: dict[str, Any],
    keep: int,
    keep_every: int = 0,
    group: dist.ProcessGroup | None = None,
    cluster: int | None = None,
    shared: str | None = None,
    timeout_s: float = 600.0,
) -> PendingSave:
    """`save_checkpoint` in the background: collectively make the partial directory, copy `state` to host memory
    (what training changes next is not in it), and hand the writing to a thread; rank 0's thread finalizes the
    checkpoint once every rank's file and digest are there (it watches the directory, which every rank of a run
    shares), or gives up after `timeout_s`. The thread's `dcp.save` is collective over `group`, which must be a group
    of its own (no other collective on it until `PendingSave.wait`). The checkpoint counts from then on,
    as a `save_checkpoint`'s does; `PendingSave.wait`, before the next save, reports a write that failed."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world > 1 and group in (None, dist.group.WORLD):
        raise ValueError("start_checkpoint needs a process group of its own (dist.new_group(backend='gloo'))")
    root = checkpoint_root(run_dir, cluster)
    final, partial = _begin(root, step, rank, group)
    snapshot = _host_copy(state)

    def work() -> str | None:
        error = _write_rank(partial, rank, snapshot, step, group, shared)
        if error is not None:
            write_atomic(partial / f".rank{rank}{FAILED_SUFFIX}", error.encode())
            return error
        if rank != 0:
            return None
        error = _await_ranks(partial, world, step, timeout_s)
        return error if error is not None else _finalize(partial, final, step, meta, keep, keep_every)

    return PendingSave(final, partial, rank, group, work)


def _begin(root: Path, step: int, rank: int, group: dist.ProcessGroup | None) -> tuple[Path, Path]:
    """Collectively: rank 0 makes checkpoint `step`'s empty partial directory in `root` (after checking for space);
    returns (the checkpoint's final path, its partial path)."""
    final = _step_dir(root, step)
    partial = root / f".{final.name}.partial"
    error = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if partial.exists():
                shutil.rmtree(partial)
            _check_free_space(root)
            partial.mkdir()
        except OSError as exc:
            error = _not_written(step, root, exc)
    _stop_if_any_failed(error, partial, rank, group)
    return final, partial


def _write_rank(
    partial: Path, rank: int, state: dict[str, Any], step: int, group: dist.ProcessGroup | None, shared: str | None
) -> str | None:
    """Collectively over `group`: write this rank's share of the DCP checkpoint (fsync'd) and a digest beside each file
    it wrote (rank 0: DCP's index too); the line to stop with if that failed on any rank."""
    alone = not dist.is_initialized()
    try:
        items = checkpoint_items(state, rank=rank, shared=shared)
    except Exception as exc:  # noqa: BLE001 - still take part in the collective save below, then stop with this
        items, local = {}, f"checkpoint step {step} could not be written ({exc.__class__.__name__}: {exc})"
    else:
        local = None
    writer = FileSystemWriter(partial, sync_files=True)
    writer.fs = files = _Files()
    try:
        with warnings.catch_warnings():  # a single process without a process group saves alone, as intended
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.save(items, storage_writer=writer, process_group=group, no_dist=alone)
        mine = sorted(partial.glob(f"__{0 if alone else dist.get_rank(group)}_*.distcp"))
        if local is not None:
            return local
        for file in mine + ([partial / DCP_METADATA] if rank == 0 else []):
            write_atomic(file.with_name(file.name + DIGEST_SUFFIX), json.dumps(_digest(file)).encode())
    except OSError as exc:
        return _not_written(step, partial.parent, exc)
    except CheckpointException as exc:  # every rank gets every rank's failure: each reports its own
        failure = exc.failures.get(0 if alone else dist.get_rank(group))
        if failure is None:  # another rank's: its line stops every rank (`_stop_if_any_failed`, `_await_ranks`)
            return local
        cause = files.error or failure[0]  # torch's zip writer reports a failed write as "unexpected pos"
        if isinstance(cause, OSError):
            return _not_written(step, partial.parent, cause)
        return f"checkpoint step {step} could not be written ({cause.__class__.__name__}: {_first_line(cause)})"
    return local


class _Files(FileSystem):
    """The file system DCP writes a checkpoint through, keeping the OSError of a write that failed (a full disk, a
    file-size limit), which torch's zip writer would report as RuntimeError("unexpected pos ...")."""

    error: OSError | None = None

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            yield _Writes(stream, self)


class _Writes:
    """A file as DCP's writer uses it, reporting a write's OSError to its `_Files`."""

    def __init__(self, handle, files: _Files) -> None:
        self._handle, self._files = handle, files

    def write(self, data) -> int:
        try:
            return self._handle.write(data)
        except OSError as exc:
            self._files.error = self._files.error or exc
            raise

    def __getattr__(self, name: str):
        return getattr(self._handle, name)


def _finalize(partial: Path, final: Path, step: int, meta: dict[str, Any], keep: int, keep_every: int) -> str | None:
    """Rank 0, once every rank's file is written: move the digests into meta.json, put the checkpoint in place
    (replacing one of the same step, saved again after a resume) and prune; the line to stop with if that failed."""
    root = partial.parent
    try:
        digests = sorted(partial.glob("*" + DIGEST_SUFFIX))
        files = {d.name.removesuffix(DIGEST_SUFFIX): json.loads(d.read_text()) for d in digests}
        write_meta(partial, {"step": step, **meta, "format": FORMAT, "files": files})
        for d in digests:
            d.unlink()
        _fsync(partial)
    except OSError as exc:
        return _not_written(step, root, exc)
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
    _fsync(root)
    prune(root, keep=keep, keep_every=keep_every, saved=final)
    return None


FAILED_SUFFIX = ".failed"
"""A background write that failed leaves its line in `.rankR.failed` in the partial directory: rank 0's thread,
waiting for every rank's digest, stops at it."""


def _await_ranks(partial: Path, world: int, step: int, timeout_s: float) -> str | None:
    """Rank 0's thread: wait until the digests of `world` rank files (and DCP's index) are in `partial`; the line to
    stop with if a rank's write failed (its `.failed` line) or not all were there within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        failed = sorted(partial.glob("*" + FAILED_SUFFIX))
        if failed:
            return failed[0].read_text()
        written = len(list(partial.glob("*.distcp" + DIGEST_SUFFIX)))
        if written == world and (partial / (DCP_METADATA + DIGEST_SUFFIX)).is_file():
            return None
        if time.monotonic() > deadline:
            return (
                f"checkpoint step {step} was not written: {world - written} of {world} ranks had not written their "
                f"file to {partial} after {timeout_s:.0f} s (a rank stopped, or the directory is not on storage every "
                "rank shares); the earlier checkpoints are intact"
            )
        time.sleep(0.02)


def _host_copy(state: Any) -> Any:
    """`state` with every tensor copied to host memory and every container copied: what a save in the background
    writes, whatever training does to the originals meanwhile."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {key: _host_copy(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_host_copy(value) for value in state)
    return copy.deepcopy(state)


def prune(root: Path, *, keep: int, keep_every: int = 0, saved: Path | None = None) -> None:
    """Delete the checkpoints of `root` but the newest `keep` and, with `keep_every`, the first one at or after each
    multiple of that many steps (the long-term tier: it stays the first of its span, so it is kept for good). Only
    checkpoints that verify count, so pruning never deletes the last good one (`saved`, just written, counts as
    verified). Called by the one rank that saves into `root`, after its save: any other hidden `.step_*` directory
    there is what a killed save or pruning left, and goes too."""
    good = [c for c in _complete_in(root) if c == saved or _verifies(c, full=False)]
    tier: dict[int, Path] = {}
    for checkpoint in good if keep_every else ():
        tier.setdefault(checkpoint_step(checkpoint) // keep_every, checkpoint)
    for old in good[:-keep]:
        if old not in tier.values():
            # hidden first: a kill midway through deleting it leaves no checkpoint that looks complete
            os.replace(old, old.with_name(f".{old.name}.deleting"))
    for stale in root.glob(".step_*"):  # what a kill left of a save (`.partial`) or of this pruning (`.deleting`)
        shutil.rmtree(stale, ignore_errors=True)


class CheckpointNotWritten(ValueError):
    """A checkpoint could not be written (a full disk, say): one line naming where and why, the same on every rank;
    its partial directory is removed and the earlier checkpoints are untouched."""


_MAX_ERROR_BYTES = 16 << 10


def _check_free_space(root: Path) -> None:
    """Raise ENOSPC before writing when the file system of `root` has less free space than the newest checkpoint
    there took (the next one is as large: the same model and optimizer states)."""
    newest = _complete_in(root)
    if not newest:
        return
    try:
        need = sum(int(entry["bytes"]) for entry in read_meta(newest[-1])["files"].values())
    except (OSError, ValueError, KeyError, TypeError):  # an unreadable last checkpoint: no estimate
        return
    if shutil.disk_usage(root).free < need:
        raise OSError(errno.ENOSPC, f"less free space than the last checkpoint's {_size(need)}")


def _not_written(step: int, root: Path, exc: OSError) -> str:
    """The line every rank stops with when this rank could not write checkpoint `step`."""
    try:
        free = f"{_size(shutil.disk_usage(root).free)} free there"
    except OSError:
        free = "its free space unknown"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return (
            f"the disk is full: checkpoint step {step} could not be written to {root} ({free}); the partial "
            "checkpoint was removed and the earlier ones are intact: free some space, or lower checkpoint.keep, "
            "then resume the run (checkpoint.resume = latest)"
        )
    return (
        f"checkpoint step {step} could not be written to {root} ({exc.strerror or exc}; {free}); the partial "
        "checkpoint was removed and the earlier ones are intact: fix the cause, then resume the run"
    )


def _stop_if_any_failed(error: str | None, partial: Path, rank: int, group: dist.ProcessGroup | None) -> None:
    """A barrier that also carries each rank's write error: if any rank failed, rank 0 removes the partial directory
    and every rank raises the lowest failed rank's line."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        error = next((e for e in all_gather_json(error, group=group, max_bytes=_MAX_ERROR_BYTES) if e), None)
    if error is None:
        return
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
    _barrier(group)  # the partial directory is gone before any rank reports
    raise CheckpointNotWritten(error)


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:.2f} GB" if num_bytes >= 1e8 else f"{num_bytes / 1e6:.1f} MB"


def _complete_in(root: Path) -> list[Path]:
    """The complete checkpoints directly in `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and (p / META).is_file()]
    return sorted(found, key=checkpoint_step)


def list_checkpoints(run_dir: Path, *, cluster: int | None = None) -> list[Path]:
    """Complete checkpoints of a run, oldest first: a static run's and every elastic cluster's (at equal steps the
    lowest cluster's last, so it is the one `latest` takes); with `cluster`, that elastic cluster's only."""
    if cluster is not None:
        return _complete_in(checkpoint_root(run_dir, cluster))
    root = checkpoint_root(run_dir)
    roots = [root]
    if root.is_dir():
        roots += [p for p in root.iterdir() if p.is_dir() and p.name.removeprefix("cluster").isdigit()]
    found = [path for r in roots for path in _complete_in(r)]
    return sorted(found, key=lambda p: (checkpoint_step(p), -_cluster_of(p)))


def find_checkpoint(run_dir: Path, resume: str) -> Path:
    """Resolve `checkpoint.resume` (`latest` or a checkpoint directory) to a complete checkpoint directory whose
    files verify (`verify_checkpoint`); `latest` falls back to older checkpoints past corrupt ones, saying so."""
    if resume == "latest":
        found = list_checkpoints(run_dir)
        if not found:
            raise ValueError(
                f"checkpoint.resume = latest: no complete checkpoint in {checkpoint_root(run_dir)}; "
                "check run.out_dir or start without --checkpoint.resume"
            )
        for path in reversed(found):
            try:
                verify_checkpoint(path)
                return path
            except CorruptCheckpoint as exc:
                print(f"dilocox: warning: skipping corrupt checkpoint {path}: {exc.problem}", file=sys.stderr)
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


def _canonical(meta: dict[str, Any]) -> bytes:
    """The bytes meta.json's digest is taken of: its entries but the digest, as JSON with sorted keys, no spaces and
    ASCII only, so that re-indenting the file does not change it and changing any value does."""
    body = {key: value for key, value in meta.items() if key != META_DIGEST}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def write_meta(path: Path, meta: dict[str, Any]) -> None:
    """Write the meta.json of checkpoint directory `path` (atomically), with its own digest."""
    body = {key: value for key, value in meta.items() if key != META_DIGEST}
    body[META_DIGEST] = hashlib.sha256(_canonical(body)).hexdigest()
    write_atomic(Path(path) / META, json.dumps(body, indent=2).encode())


_warned_no_digest: set[Path] = set()
"""Checkpoints whose meta.json without a digest was already reported by this process."""


def verify_checkpoint(
    path: Path, files: Iterable[str] | None = None, *, full: bool = True, fix: str = RESUME_FIX
) -> dict[str, Any]:
    """The meta.json of checkpoint `path`, once it verifies: every reader of a checkpoint goes through here.

    meta.json must be a JSON object that matches its own digest (`write_meta`) and lists the checkpoint's files
    (`files`: name -> size and sha256, one per rank of `world_size` and DCP's index); then each file named in `files`
    (every one listed when None, none for `()`) must have the listed size and, with `full`, the listed sha256
    (`full=False` reads no file). Raises `CorruptCheckpoint`, one line naming the file, what is wrong and `fix`.

    A meta.json without a digest (written before meta.json had one) is accepted with its rank files verified; a full
    verification (`files=None`, `full`) says once per process that meta.json itself could not be checked."""
    path = Path(path)
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise _corrupt(path, f"{META} is unreadable ({exc.__class__.__name__})", fix) from None
    if not isinstance(meta, dict):
        raise _corrupt(path, f"{META} is not a JSON object", fix)
    if META_DIGEST in meta:
        if meta[META_DIGEST] != hashlib.sha256(_canonical(meta)).hexdigest():
            raise _corrupt(path, f"{META} does not match its digest (edited or damaged since saved)", fix)
    listed = meta.get("files")
    if not isinstance(listed, dict) or not listed:
        raise _corrupt(path, f"{META} lists no rank files (its `files` entry is missing or empty)", fix)
    world_size = meta.get("world_size")
    index = int(meta.get("format") == FORMAT)  # DCP's `.metadata` beside the rank files
    if isinstance(world_size, int) and len(listed) != world_size + index:
        raise _corrupt(path, f"{META} lists {len(listed) - index} rank files for a world of {world_size}", fix)
    for name in sorted(listed if files is None else files):
        want = listed.get(name)
        if not isinstance(want, dict) or Path(name).name != name:
            raise _corrupt(path, f"{META} does not list {name} as a rank file of this checkpoint", fix)
        file = path / name
        if not file.is_file():
            raise _corrupt(path, f"{name} is missing", fix)
        size, written = file.stat().st_size, want.get("bytes")
        if size != written:
            shown = f"{written:,}" if isinstance(written, int) else repr(written)
            raise _corrupt(path, f"{name} has {size:,} bytes, {shown} were written", fix)
        if full and _digest(file)["sha256"] != want.get("sha256"):
            raise _corrupt(path, f"{name} does not match its sha256 (bit rot or a partial overwrite)", fix)
    if META_DIGEST not in meta and files is None and full and path.resolve() not in _warned_no_digest:
        _warned_no_digest.add(path.resolve())
        print(
            f"dilocox: warning: {path / META} has no digest (saved by an older dilocox): its rank files verify, "
            "meta.json itself cannot be checked; checkpoints saved from now on carry one",
            file=sys.stderr,
        )
    return meta


def _verifies(path: Path, *, full: bool = True) -> bool:
    try:
        verify_checkpoint(path, full=full)
    except CorruptCheckpoint:
        return False
    return True


def read_meta(path: Path) -> dict[str, Any]:
    """The meta.json of checkpoint `path`, verified against its digest (no rank file is read)."""
    return verify_checkpoint(path, ())


def load_rank_state(path: Path, rank: int, *, wanted=lambda at: True) -> dict[str, Any]:
    """The state of `rank` in checkpoint `path`, after verifying meta.json and the files it reads. With `wanted`
    (DCP checkpoints), a tensor whose path in the state (a tuple of keys) it refuses is not read: None."""
    path = Path(path)
    if read_meta(path).get("format") != FORMAT:
        return _load_rank_file(path, rank)
    checked: set[str] = set()

    def verify(files: Iterable[str]) -> None:  # each file once: the skeleton and the tensors are mostly in one
        verify_checkpoint(path, set(files) - checked)
        checked.update(files)

    try:
        return load_state(path, rank, verify=verify, wanted=wanted)
    except KeyError:
        raise ValueError(
            f"checkpoint {path} has no state for rank {rank}: was it written by a different topology?"
        ) from None
    except (CorruptCheckpoint, ValueError):
        raise
    except (Exception, CheckpointException) as exc:  # files that verified but do not read: written by hand
        raise _corrupt(path, f"its files cannot be read ({exc.__class__.__name__}: {_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0][:120]


def _load_rank_file(path: Path, rank: int, *, mmap: bool = False) -> dict[str, Any]:
    """A rank's state in a checkpoint written before DCP: its `torch.save` file."""
    name = _rank_file(rank)
    if not (path / name).is_file():
        raise ValueError(f"checkpoint {path} has no state for rank {rank}: was it written by a different topology?")
    verify_checkpoint(path, [name])
    try:
        return torch.load(path / name, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # a file that verified but does not unpickle: another torch, or written by hand
        raise _corrupt(path, f"{name} cannot be read ({exc.__class__.__name__}: {_first_line(exc)})") from None


def run_identity(cfg: Config) -> dict[str, Any]:
    """What a checkpoint must share with the run that resumes it (meta.json's top level; the whole config is
    recorded beside it and compared field by field, `resume_fields`)."""
    t = cfg.topology
    dp_degrees, _ = t.shape()
    identity = {
        "world_size": cfg.world_size,
        "num_clusters": t.num_clusters,
        "dp_degree": t.dp_degree,
        "pp_degree": t.pp_degree,
        "sync_kind": cfg.sync.kind,
        "flavor": cfg.model.flavor,
    }
    if len(set(dp_degrees)) > 1:  # clusters of different data-parallel degree: each one's (dp_degree is the largest)
        identity["dp_degrees"] = list(dp_degrees)
    return identity


def meta_topology(meta: dict[str, Any]) -> Topology:
    """The topology a checkpoint was written by (its rank files are numbered by it), from its meta.json."""
    if "dp_degrees" in meta:
        return Topology.of_clusters(meta["dp_degrees"], meta["pp_degree"])
    return Topology(meta["num_clusters"], meta["dp_degree"], meta["pp_degree"])


_IDENTITY_FIELDS = {
    "num_clusters": "topology.num_clusters",
    "dp_degree": "topology.dp_degree",
    "pp_degree": "topology.pp_degree",
    "sync_kind": "sync.kind",
    "flavor": "model.flavor",
}
"""`run_identity` keys as config fields (checkpoints written before meta.json held the config carry only these)."""
_LEGACY_VALUES = {
    "data.shard": "contiguous",
    "data.split_seed": -1,
    "topology.elastic": False,
    "topology.dp_mode": "replicate",
    "sync.fragments": 1,
    "sync.round.mode": "steps",
}
"""What a config written before a field existed meant by its absence."""


def resume_fields(cfg: Config, saved: dict[str, Any]) -> list[str]:
    """The config fields, in the order they are compared, that a run must share with the checkpoint it resumes:
    what the saved tensors' shapes and meanings depend on. Topology: the rank files, data shards and slices. The
    model and, when the BPE is trained here, its vocabulary: every tensor's shape (the tokenizer itself and the
    model's dimensions are compared after the data is loaded, `check_resume_model`). `data.shard`,
    `data.split_seed` and `train.seq_len`: the saved data position counts windows of `seq_len + 1` tokens of that
    training split in that deal. The inner optimizer: its state. The outer loop's settings (`sync.RESUME_SETTINGS`)
    and the codec's format: the saved outer optimizer, round and a sync in flight, whose payload is sent again as it
    was encoded."""
    fields = ["topology.elastic", "topology.num_clusters", "topology.dp_degree", "topology.pp_degree"]
    fields.append("topology.dp_mode")  # a sharded rank's files hold its shards
    fields += ["model.flavor", "sync.kind"]
    saved_trains_bpe = not saved.get("data", {}).get("tokenizer") and not saved.get("model", {}).get("init_from")
    if saved_trains_bpe and not cfg.data.tokenizer and not cfg.model.init_from:
        fields.append("data.vocab_size")  # both train their BPE here: its size is the model's vocabulary
    fields += ["data.shard", "data.split_seed", "train.seq_len", "train.optimizer"]
    if cfg.sync.has_outer_loop:
        # sync.round.mode: a time-round state carries the round clock and the reports, and its ranks' steps differ
        fields += [f"sync.{name}" for name in ("inner_steps", "sync_delay", "fragments", "round.mode")]
        fields += [f"sync.outer.{name}" for name in ("optimizer", "lr", "momentum", "nesterov")]
        if cfg.sync.outer.optimizer == "adamw":
            fields += [f"sync.outer.{name}" for name in ("beta1", "beta2", "weight_decay")]
        fields.append("compression.kind")
        if cfg.compression.kind != "none":
            formats = ("reduction", "rank", "group_size", "factor_dtype", "small_tensors", "rank_max")
            if cfg.compression.kind in SPARSE_KINDS:
                formats += ("density", "chunk_size")
            fields += [f"compression.{name}" for name in formats]
    return fields


def _incompatible(path: Path, name: str, old: Any, new: Any) -> ValueError:
    def show(value: Any) -> str:
        return repr(value) if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)

    flag = str(old).lower() if isinstance(old, bool) else old
    return ValueError(
        f"cannot resume {path}: {name} was {show(old)} in the checkpoint, {show(new)} now; resume with "
        f"--{name}={flag} or start a new run directory"
    )


def reshape_refusal(cfg: Config, saved: dict[str, Any], name: str = "topology.dp_degree") -> str | None:
    """Why a checkpoint whose config is `saved` (a flat dict of settings) cannot resume at this run's `name`
    (topology.dp_degree or topology.pp_degree), in words; None when it can (the other fields are compared as for any
    resume)."""
    t = cfg.topology
    degree = "dp degree" if name == "topology.dp_degree" else "pp degree"
    fix = f"resume with --{name}={saved.get(name)} or start a new run directory"
    if t.clusters or saved.get("topology.clusters"):
        return f"clusters of different dp degrees (topology.clusters) resume at the degrees they were saved with; {fix}"
    if cfg.sync.has_outer_loop and cfg.sync.round.mode != "steps":
        return f"time rounds (sync.round.mode = time) resume at the {degree} they were saved with; {fix}"
    if cfg.sync.kind == "cocktail":
        return f"sync.kind = cocktail resumes at the {degree} it was saved with; {fix}"
    if cfg.sync.has_outer_loop and cfg.compression.kind != "none" and cfg.compression.reduction != "gather":
        return (
            f"compression.reduction = {cfg.compression.reduction} keeps state shared over a stage's replicas, which "
            f"does not follow a new {degree}; {fix}"
        )
    if name == "topology.pp_degree" and cfg.sync.has_outer_loop and cfg.sync.fragments > 1:
        return (
            f"sync.fragments = {cfg.sync.fragments} cuts each stage's tensors into fragments whose rounds are "
            f"staggered, which other stages cannot be put together from; {fix}"
        )
    return None


def check_resume(cfg: Config, path: Path) -> None:
    """Refuse, in one line naming the field, to resume a checkpoint whose config differs from this run's in a field
    the saved state depends on (`resume_fields`), or that is past the last step. Reads meta.json only."""
    meta = read_meta(path)
    saved = meta.get("config")
    saved_degrees = meta_topology(meta).dp_degrees if "num_clusters" in meta else None
    degrees, _ = cfg.topology.shape()
    # clusters of one shape on both sides: the topology fields below name what differs
    mixed = saved_degrees is not None and (len(set(saved_degrees)) > 1 or len(set(degrees)) > 1)
    if mixed and saved_degrees != degrees:  # the rank files and data shards differ
        show = ", ".join(f'"dp{d}"' for d in saved_degrees)
        raise ValueError(
            f"cannot resume {path}: its clusters had data-parallel degrees {', '.join(map(str, saved_degrees))}, this "
            f"run's {', '.join(map(str, degrees))}; resume with --topology.clusters=[{show}] (and its pp) or start a "
            "new run directory"
        )
    if isinstance(saved, dict):
        saved_settings = flat_settings(saved)  # a key of an earlier version under its new name
        for name in resume_fields(cfg, saved):
            new = option_value(cfg, name)
            old = saved_settings.get(name, _LEGACY_VALUES.get(name, new))  # a field newer than the file
            if old != new and name in ("topology.dp_degree", "topology.pp_degree"):  # rebuilt from the saved ranks
                problem = reshape_refusal(cfg, saved_settings, name)
                if problem is None:
                    continue
                raise ValueError(f"cannot resume {path}: {name} was {old} in it, {new} now: {problem}")
            if old != new:
                raise _incompatible(path, name, old, new)
    else:  # written before meta.json held the config
        identity = run_identity(cfg)
        for key, name in _IDENTITY_FIELDS.items():
            if meta.get(key) != identity[key]:
                raise _incompatible(path, name, meta.get(key), identity[key])
    if meta["step"] > cfg.train.steps:
        raise ValueError(
            f"checkpoint {path} is at step {meta['step']}, past train.steps = {cfg.train.steps}; "
            "raise train.steps to continue training"
        )


def elastic_resume_paths(run_dir: Path, chosen: Path, clusters: Iterable[int]) -> dict[int, Path]:
    """An elastic run resumed from checkpoint `chosen` (step S): each of `clusters` that holds a checkpoint of step S
    that verifies loads its own (its ranks' inner optimizer, data position, residuals and sync in flight), so a run
    whose clusters all resume continues exactly; a cluster without one starts afresh and heals from a cluster that
    loaded one at the first quorum (docs/design.md §10.1). A corrupt one is skipped with a warning."""
    step, paths = checkpoint_step(chosen), {}
    for cluster in clusters:
        path = _step_dir(checkpoint_root(run_dir, cluster), step)
        if not (path / META).is_file():
            continue
        try:
            verify_checkpoint(path)
        except CorruptCheckpoint as exc:
            print(
                f"dilocox: warning: cluster {cluster} heals from a peer, not from {path}: {exc.problem}",
                file=sys.stderr,
            )
            continue
        paths[cluster] = path
    return paths


def check_auto_resume(cfg: Config, path: Path) -> None:
    """`checkpoint.resume = auto` found `path` in run.out_dir: refuse, in one line, to take it for this run when it
    belongs to another one: a run on another corpus (`data.path`), or one already past `train.steps` (a run
    directory reused for a new, shorter run). Reads meta.json only; `check_resume` compares the rest."""
    meta = read_meta(path)
    saved = meta.get("config")
    saved_path = saved.get("data", {}).get("path") if isinstance(saved, dict) else None
    new_start = "start the new run with another --run.out_dir, or replace that one with --run.overwrite=true"
    if saved_path is not None and not same_corpus(saved_path, cfg.data.path):
        raise ValueError(
            f"run.out_dir = {cfg.run.out_dir} holds another run, trained on data.path = {describe_corpus(saved_path)} "
            f"(checkpoint {Path(path).name}), not on {describe_corpus(cfg.data.path)}: {new_start} "
            "(--checkpoint.resume=latest continues that run on this data)"
        )
    if meta["step"] > cfg.train.steps:
        raise ValueError(
            f"run.out_dir = {cfg.run.out_dir} holds a run at step {meta['step']} (checkpoint {Path(path).name}), past "
            f"train.steps = {cfg.train.steps}: to continue that run raise --train.steps; otherwise {new_start}"
        )


def check_resume_model(path: Path, args: ModelArgs, *, tokenizer_vocab: str, tokenizer_path: str) -> None:
    """After the data is loaded: refuse a checkpoint whose tokenizer maps ids to other tokens (`tokenizer_vocab`:
    `Tokenizer.vocab_fingerprint` of this run's, recorded in meta.json; for older checkpoints taken from the
    tokenizer.json of the checkpoint's run directory, when it is there) or whose model has other dimensions."""
    from dilocox.data.tokenizer import Tokenizer

    meta = read_meta(path)
    saved_vocab = meta.get("tokenizer_vocab")
    run_tokenizer = Path(path).resolve().parent.parent / "tokenizer.json"
    if saved_vocab is None and run_tokenizer.is_file():
        saved_vocab = Tokenizer.from_file(run_tokenizer).vocab_fingerprint()
    saved_args = meta.get("model_args") or {}
    if saved_vocab is not None and saved_vocab != tokenizer_vocab:
        ids = f"{saved_args['vocab_size']:,} ids in the checkpoint, " if "vocab_size" in saved_args else ""
        fix = f"--data.tokenizer={run_tokenizer}" if run_tokenizer.is_file() else "the tokenizer it was trained with"
        raise ValueError(
            f"cannot resume {path}: its tokenizer maps ids to other tokens than this run's ({ids}{args.vocab_size:,} "
            f"now, from {tokenizer_path}); resume with {fix} or start a new run directory"
        )
    now = dataclasses.asdict(args)
    for key, old in saved_args.items():
        if key in now and now[key] != old:
            raise ValueError(
                f"cannot resume {path}: the model's {key} was {old} in the checkpoint, {now[key]} now (from "
                "model.flavor, model.init_from and the tokenizer); resume with the model it was trained with or start "
                "a new run directory"
            )


def find_step(run_dir: Path, step: int | None) -> Path:
    """The complete checkpoint of `step` in `run_dir`, or its newest one when `step` is None, verified: meta.json and
    every rank file (`verify_checkpoint`); a corrupt one is refused in one line that names the other steps."""
    found = list_checkpoints(run_dir)
    if not found:
        raise ValueError(
            f"{run_dir} has no complete checkpoint (nothing in {Path(run_dir) / CHECKPOINT_DIR}); train it first "
            "(checkpoints are saved every checkpoint.interval steps and at the end)"
        )
    at_step = [p for p in found if step is None or checkpoint_step(p) == step]
    if not at_step:
        steps = ", ".join(str(other) for other in sorted({checkpoint_step(p) for p in found}))
        raise ValueError(f"{run_dir} has no checkpoint of step {step}; its checkpoints are at steps {steps}")
    path = at_step[-1]  # an elastic run's: the lowest cluster's of that step
    other_steps = {checkpoint_step(p) for p in found} - {checkpoint_step(path)}
    others = ", ".join(str(other) for other in sorted(other_steps))
    fix = f"pass --step with another of its steps ({others})" if others else "the run has no other checkpoint"
    verify_checkpoint(path, fix=fix)
    return path


def checkpoint_model_args(meta: dict[str, Any], vocab_size: int) -> ModelArgs:
    """The shape of a checkpoint's model at its full context: recorded in meta.json by this version (which also
    covers model.init_from), else the flavor's with the run's tokenizer."""
    if "model_args" in meta:
        return ModelArgs(**meta["model_args"])
    return model_args(meta["flavor"], vocab_size=vocab_size)


def consolidated_model_state(path: Path, *, agreed: bool) -> tuple[dict[str, torch.Tensor], bool]:
    """The whole model of checkpoint `path` as one state dict under the full model's names, and whether it is the
    agreed model.

    Stage parameter names are the full model's (`parallel/split.py`), so the whole model is the union of the
    stages of one pipeline: cluster 0, replica 0. With `agreed` each stage's outer parameters replace its local
    weights when the sync keeps them (diloco, dilocox): they are the model every cluster agreed on at the last
    outer step, while the local weights of a checkpoint inside training may be one cluster's (a delayed sync with
    merge = keep_local). After the last step both are the same. Returns (state, True when outer params were used).
    """
    path = Path(path)
    meta = read_meta(path)
    topology = meta_topology(meta)
    # a sharded stage (topology.dp_mode = shard): every dp rank of cluster 0 holds a dim-0 shard of each tensor
    sharded = meta.get("config", {}).get("topology", {}).get("dp_mode") == "shard"
    replicas = range(topology.dp_degrees[0] if sharded else 1)
    stages = [[topology.rank_of(0, dp, stage) for dp in replicas] for stage in range(topology.pp_degree)]
    state: dict[str, torch.Tensor] = {}
    used_outer = False
    for ranks in stages:
        shards = []
        for rank in ranks:
            if meta.get("format") == FORMAT:  # the model and the outer params only, not the optimizer states
                rank_state = load_rank_state(path, rank, wanted=_model_or_outer)
            else:  # mmap: the optimizer states next to the model and outer params are not copied into memory
                rank_state = _load_rank_file(path, rank, mmap=True)
            stage_state = dict(rank_state["model"])
            outer = saved_outer_params(rank_state["sync"]) if agreed else None
            if outer is not None:
                _scatter_flat_(stage_state, outer)
                used_outer = True
            shards.append(stage_state)
        state.update({key: torch.cat([shard[key] for shard in shards]) for key in shards[0]})
    return state, used_outer


def _model_or_outer(at: tuple) -> bool:
    return at[0] == "model" or (at[0] == "sync" and at[-1] == "outer_params")


def _scatter_flat_(stage_state: dict[str, torch.Tensor], flat: torch.Tensor) -> None:
    """Replace the tensors of a stage state dict by consecutive slices of `flat` (the sync's `FlatParams` vector).

    `FlatParams` follows `module.parameters()`, which visits parameters in state-dict order and yields a tied
    parameter once: a state-dict entry that shares its storage with an earlier one (a tied head) is that same
    parameter and takes the same slice."""
    offset, seen = 0, {}
    for name, tensor in stage_state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:
            stage_state[name] = stage_state[seen[key]]
            continue
        seen[key] = name
        stage_state[name] = flat[offset : offset + tensor.numel()].view_as(tensor).clone()
        offset += tensor.numel()
    if offset != flat.numel():
        raise ValueError(
            f"the checkpoint's outer parameters hold {flat.numel()} values but its model {offset}; it is damaged"
        )


def saved_outer_params(sync_state: dict[str, Any]) -> torch.Tensor | None:
    """phi of a stage as a checkpoint's outer-sync state holds it: its fragments' outer params in parameter order (a
    state saved before fragments holds them itself); None for a strategy without an outer loop."""
    fragments = sync_state.get("fragments")
    if fragments is None:
        return sync_state.get("outer_params")
    return torch.cat([fragment["outer_params"] for fragment in fragments])
