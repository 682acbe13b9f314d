"""Every rank's checkpoint state in one `torch.distributed.checkpoint` (DCP) checkpoint, and one rank's state back.

A rank's state is a nested dict (model, inner optimizer, sync, data position, RNG, ...). DCP stores tensors under
flat keys, so each tensor goes under a key of its path and the rest of the tree, with a placeholder per tensor, is
`torch.save`d into a uint8 tensor of its own (`rank{r}/skeleton`): everything in the checkpoint is a tensor, read
back with `weights_only=True`, and the nested dict comes back as it was (tuples, int keys, tied tensors).

The model, inner optimizer and outer state of a replicated stage are the same on every replica of it (`replicated`),
so they go under the stage's key (`shared`, e.g. `cluster0/stage1/model/...`), which DCP writes once for all replicas.
A sharded stage's tensors are each rank's own shards and go under its rank. On disk:

    .metadata          DCP's index: every key's shape, dtype and place (file, offset, length); written last
    __0_0.distcp       what rank 0 of the writing group wrote (its own keys and its share of the shared ones)
    __1_0.distcp       ...

    items = checkpoint_items(state, rank=3, shared="cluster0/stage1")   # {key: tensor}: pass to dcp.save
    state = load_state(path, rank=3, files=verify)                      # that rank's nested dict again
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

DCP_METADATA = ".metadata"
_FRAGMENT_SHARED = ("outer_params", "round_start", "outer_optimizer")


def replicated(path: tuple) -> bool:
    """Whether the tensor at `path` of a rank's state is the same on every replica of a replicated stage: the model and
    the inner optimizer (every replica applies the same mean gradient), and each fragment's phi, round start and outer
    optimizer (the outer step applies the cluster's mean on every replica alike; `reshape.py` takes replica 0's). The
    rest is each replica's own: its error feedback and share of a sync in flight, data position, RNG, counters."""
    if path[0] in ("model", "inner_optimizer"):
        return True
    return path[:2] == ("sync", "fragments") and len(path) > 3 and path[3] in _FRAGMENT_SHARED


_TENSOR = "\0tensor "
"""A skeleton's placeholder for a tensor: this prefix, then the tensor's key."""


def skeleton_key(rank: int) -> str:
    return f"rank{rank}/skeleton"


def checkpoint_items(state: dict[str, Any], *, rank: int, shared: str | None) -> dict[str, torch.Tensor]:
    """Rank `rank`'s `state` as DCP items: each tensor under `rank{r}/<path>` (or `shared/<path>` where `replicated`),
    and the tree without its tensors under `skeleton_key(rank)`. A tensor that appears twice (a tied
    embedding and head) is stored once and comes back as one tensor."""
    items: dict[str, torch.Tensor] = {}
    seen: dict[tuple, str] = {}

    def walk(value: Any, path: tuple) -> Any:
        if isinstance(value, torch.Tensor):
            # the same view of the same storage is the same tensor (empty tensors all share address 0: each its own)
            view = (
                value.untyped_storage().data_ptr(),
                value.storage_offset(),
                value.shape,
                value.stride(),
                value.dtype,
            )
            view = view if value.numel() else (id(value),)
            if view not in seen:
                owner = shared if shared is not None and replicated(path) else f"rank{rank}"
                seen[view] = "/".join((owner, *map(str, path)))
                items[seen[view]] = value
            return _TENSOR + seen[view]
        if isinstance(value, dict):
            return type(value)((key, walk(item, (*path, key))) for key, item in value.items())
        if isinstance(value, (list, tuple)):
            return type(value)(walk(item, (*path, index)) for index, item in enumerate(value))
        return value

    buffer = io.BytesIO()
    torch.save(walk(state, ()), buffer)
    items[skeleton_key(rank)] = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    return items


class _IndexUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle; this reads it with nothing but DCP's metadata classes, torch's dtypes, layouts
    and sizes, and paths (what torch 2.13 writes there), so a crafted file cannot run code."""

    _ALLOWED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.metadata" or (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")


class _Reader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with open(Path(self.path) / DCP_METADATA, "rb") as handle:
            return _IndexUnpickler(handle).load()


def read_index(path: Path) -> Metadata:
    """DCP's index of checkpoint `path` (verify `DCP_METADATA` first)."""
    return _Reader(path).read_metadata()


def files_of(index: Metadata, keys: Iterable[str]) -> set[str]:
    """The data files that hold `keys`."""
    wanted = set(keys)
    return {info.relative_path for where, info in index.storage_data.items() if where.fqn in wanted}


def load_tensors(path: Path, index: Metadata, keys: Iterable[str]) -> dict[str, torch.Tensor]:
    """Read `keys` from checkpoint `path` on this process alone (no collective), into host memory."""
    template = {}
    for key in keys:
        entry = index.state_dict_metadata.get(key)
        if not isinstance(entry, TensorStorageMetadata):
            raise KeyError(key)
        template[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
    with warnings.catch_warnings():  # that no process group is used is the intent here
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(template, storage_reader=_Reader(path), no_dist=True)
    return template


def load_state(
    path: Path,
    rank: int,
    *,
    verify: Callable[[Iterable[str]], None],
    wanted: Callable[[tuple], bool] = lambda path: True,
) -> dict[str, Any]:
    """Rank `rank`'s nested state from checkpoint `path`; `verify(files)` is called on the index first and on the
    data files before they are read. With `wanted`, a tensor whose path (a tuple of keys) it refuses is not read and
    is None in the result."""
    verify([DCP_METADATA])
    index = read_index(path)
    if skeleton_key(rank) not in index.state_dict_metadata:
        raise KeyError(skeleton_key(rank))
    verify(files_of(index, [skeleton_key(rank)]))
    raw = load_tensors(path, index, [skeleton_key(rank)])[skeleton_key(rank)]
    skeleton = torch.load(io.BytesIO(raw.numpy().tobytes()), weights_only=True)
    keys: dict[str, None] = {}

    def placeholders(value: Any, at: tuple) -> None:
        if isinstance(value, str) and value.startswith(_TENSOR) and wanted(at):
            keys[value.removeprefix(_TENSOR)] = None
        elif isinstance(value, dict):
            for key, item in value.items():
                placeholders(item, (*at, key))
        elif isinstance(value, (list, tuple)):
            for position, item in enumerate(value):
                placeholders(item, (*at, position))

    placeholders(skeleton, ())
    verify(files_of(index, keys))
    tensors = load_tensors(path, index, keys)

    def fill(value: Any) -> Any:
        if isinstance(value, str) and value.startswith(_TENSOR):
            return tensors.get(value.removeprefix(_TENSOR))
        if isinstance(value, dict):
            return type(value)((key, fill(item)) for key, item in value.items())
        if isinstance(value, (list, tuple)):
            return type(value)(fill(item) for item in value)
        return value

    return fill(skeleton)
