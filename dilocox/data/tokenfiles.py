"""Prepared token directories: token ids in raw ``.bin`` files read through ``np.memmap``, described by one index.

A directory written by ``dilocox prepare-data`` holds ``tokenizer.json``, the train and validation ids in numbered
files (``train-00000.bin``, ...: raw little-endian uint16 when the vocabulary fits in 16 bits, else uint32) and
``dilocox-index.json`` (dtype, every file's tokens, largest id and sampled digest, the tokenizer's fingerprint, the
split), written last. Every load checks each file's size and sampled digest (`fileio.sampled_digest`: a damaged or
replaced file is refused without reading the corpus) and the largest id against the vocabulary.

    index = read_index("data/prepared")                 # checks the files against the index
    train = TokenFiles.from_index("data/prepared", index, "train")
    rows = train.windows(np.array([0, 5_000]), 257)     # (2, 257), read from the files without loading them
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from dilocox.fileio import sampled_digest

INDEX_FILE = "dilocox-index.json"
INDEX_FORMAT = "dilocox-tokens"
INDEX_VERSION = 1
SPLITS = ("train", "val")
_MAX_UINT16_VOCAB = 1 << 16


def token_file_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id (``< vocab_size``) fits in 16 bits, else uint32; little-endian whatever the machine."""
    return np.dtype("<u2") if vocab_size <= _MAX_UINT16_VOCAB else np.dtype("<u4")


def tokenizer_fingerprint(serialized: bytes) -> str:
    """The fingerprint an index records for its tokenizer: sha256 of the tokenizer.json bytes, 16 hex digits."""
    return hashlib.sha256(serialized).hexdigest()[:16]


def is_prepared_dir(path: str | Path) -> bool:
    """Whether ``path`` is a directory written by ``dilocox prepare-data`` (it holds the index file)."""
    return bool(str(path)) and (Path(path).expanduser() / INDEX_FILE).is_file()


def read_index(directory: str | Path) -> dict[str, Any]:
    """The index of a prepared directory, after checking that every file it lists has exactly its tokens."""
    directory = Path(directory).expanduser()
    fix = f"prepare it again with `dilocox prepare-data SRC --out {directory} --overwrite`"
    try:
        index = json.loads((directory / INDEX_FILE).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"data.path={str(directory)!r}: cannot read {INDEX_FILE} ({error}); {fix}") from None
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT or index.get("version") != INDEX_VERSION:
        found = (index.get("format"), index.get("version")) if isinstance(index, dict) else type(index).__name__
        raise ValueError(
            f"data.path={str(directory)!r}: {INDEX_FILE} is not a version-{INDEX_VERSION} {INDEX_FORMAT} index "
            f"(found {found}); {fix}"
        )
    itemsize = np.dtype(index["dtype"]).itemsize
    for split in SPLITS:
        for entry in index["files"][split]:
            file = directory / entry["file"]
            size = file.stat().st_size if file.is_file() else None
            if size != entry["tokens"] * itemsize:
                raise ValueError(
                    f"data.path={str(directory)!r}: {entry['file']} should hold {entry['tokens']} tokens "
                    f"({entry['tokens'] * itemsize} bytes) but has {'no file' if size is None else f'{size} bytes'}; "
                    f"{fix}"
                )
            if "sampled_sha256" not in entry or "max_id" not in entry:
                raise ValueError(
                    f"data.path={str(directory)!r}: {INDEX_FILE} records no digest or largest id of {entry['file']} "
                    f"(an older dilocox prepared it), so damage cannot be told apart; {fix}"
                )
            if sampled_digest([file]) != entry["sampled_sha256"]:
                raise ValueError(
                    f"data.path={str(directory)!r}: {entry['file']} does not match its digest in {INDEX_FILE} "
                    f"(damaged or replaced); {fix}"
                )
            if not 0 <= entry["max_id"] < index["vocab_size"]:
                raise ValueError(
                    f"data.path={str(directory)!r}: {entry['file']} holds token id {entry['max_id']}, but the "
                    f"tokenizer has {index['vocab_size']} ids (0-{index['vocab_size'] - 1}): the ids are not from "
                    f"this tokenizer; {fix}"
                )
    return index


def describe_token_file(file: Path, dtype: np.dtype, chunk_tokens: int = 1 << 24) -> dict[str, Any]:
    """What the index records of a finished token file besides its tokens: its largest id (one read of the file, at
    prepare time) and its `fileio.sampled_digest`."""
    tokens = np.memmap(file, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")
    max_id = max((int(tokens[i : i + chunk_tokens].max()) for i in range(0, len(tokens), chunk_tokens)), default=0)
    del tokens
    return {"max_id": max_id, "sampled_sha256": sampled_digest([file])}


class TokenFiles:
    """One split of a prepared directory as a read-only 1-D token array spread over several files.

    Reads map the files they need with ``np.memmap`` and release them at once: pages of a long-lived mapping count
    in the process's resident memory as they are touched, so a rank that kept its mappings would look as large as
    the part of the corpus it has read (nanoGPT re-creates its memmap every batch for the same reason).

        files = TokenFiles([Path("train-00000.bin"), Path("train-00001.bin")], [1_000, 400], np.uint16)
        len(files), files[990:1_010]                          # 1400 tokens; 20 ids across the two files
        files.windows(np.array([0, 995]), 10)                 # (2, 10): rows gathered by start
    """

    ndim = 1

    def __init__(self, paths: list[Path], counts: list[int], dtype: np.dtype | type) -> None:
        if len(paths) != len(counts) or any(count < 1 for count in counts):
            raise ValueError(f"token files need one positive count per file, got {len(paths)} files, {counts}")
        self.paths = [Path(path) for path in paths]
        self.counts = [int(count) for count in counts]
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self._offsets = np.concatenate([[0], np.cumsum(self.counts, dtype=np.int64)])  # (num_files + 1,)

    @classmethod
    def from_index(cls, directory: str | Path, index: dict[str, Any], split: str) -> TokenFiles:
        entries = index["files"][split]
        directory = Path(directory).expanduser()
        return cls([directory / e["file"] for e in entries], [e["tokens"] for e in entries], index["dtype"])

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def __getitem__(self, key: slice) -> np.ndarray:
        """The tokens of a contiguous range, copied out of the files (``key`` is a slice with step 1)."""
        if not isinstance(key, slice):
            raise TypeError(f"TokenFiles supports contiguous slices only, got {type(key).__name__}")
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise TypeError(f"TokenFiles supports contiguous slices only, got step {step}")
        out = np.empty(max(0, stop - start), dtype=self.dtype)
        position = start
        while position < stop:
            file_index = int(np.searchsorted(self._offsets, position, side="right")) - 1
            take = min(stop, int(self._offsets[file_index + 1])) - position
            local = position - int(self._offsets[file_index])
            out[position - start : position - start + take] = self._map(file_index)[local : local + take]
            position += take
        return out

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """``(len(starts), length)``: row ``r`` holds the tokens ``[starts[r], starts[r] + length)``."""
        starts = np.asarray(starts, dtype=np.int64)
        if len(starts) and (int(starts.min()) < 0 or int(starts.max()) + length > len(self)):
            raise IndexError(f"windows of {length} tokens at {starts.min()}..{starts.max()} leave [0, {len(self)})")
        out = np.empty((len(starts), length), dtype=self.dtype)
        first_file = np.searchsorted(self._offsets, starts, side="right") - 1
        last_file = np.searchsorted(self._offsets, starts + length - 1, side="right") - 1
        within = first_file == last_file
        for file_index in np.unique(first_file[within]):
            rows = np.flatnonzero(within & (first_file == file_index))
            local = starts[rows] - self._offsets[file_index]
            out[rows] = self._map(int(file_index))[local[:, None] + np.arange(length)]
        for row in np.flatnonzero(~within):  # a window across a file boundary: rare, read piece by piece
            out[row] = self[int(starts[row]) : int(starts[row]) + length]
        return out

    def _map(self, file_index: int) -> np.memmap:
        return np.memmap(self.paths[file_index], dtype=self.dtype, mode="r", shape=(self.counts[file_index],))


def gather_windows(tokens: np.ndarray | TokenFiles, starts: np.ndarray, length: int) -> np.ndarray:
    """``(len(starts), length)`` windows of an in-memory array or of `TokenFiles`, the same values either way."""
    if isinstance(tokens, TokenFiles):
        return tokens.windows(starts, length)
    return tokens[starts[:, None] + np.arange(length)]


class TokenFileWriter:
    """Appends token ids to numbered files ``{prefix}-00000.bin``, ... of at most ``tokens_per_file`` tokens each.

    Documents are joined by one ``eos_id`` between consecutive ones, as the in-memory token arrays are.

        writer = TokenFileWriter(directory, "train", np.uint16, eos_id=0, tokens_per_file=1 << 28)
        writer.write(np.array([5, 6]), starts_document=True); writer.close()
        writer.entries                                        # [{"file": "train-00000.bin", "tokens": 2}]
    """

    def __init__(self, directory: Path, prefix: str, dtype: np.dtype, *, eos_id: int, tokens_per_file: int) -> None:
        if tokens_per_file < 1:
            raise ValueError(f"--tokens-per-file={tokens_per_file} must be >= 1")
        self.directory = Path(directory)
        self.prefix = prefix
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.eos_id = eos_id
        self.tokens_per_file = tokens_per_file
        self.entries: list[dict[str, Any]] = []
        self.num_documents = 0
        self._handle = None

    @property
    def num_tokens(self) -> int:
        return sum(entry["tokens"] for entry in self.entries)

    def write(self, ids: np.ndarray, *, starts_document: bool) -> None:
        """Append ``ids``; a new document after the first is preceded by ``eos_id``."""
        if starts_document:
            if self.num_documents:
                self._append(np.array([self.eos_id], dtype=self.dtype))
            self.num_documents += 1
        self._append(np.asarray(ids).astype(self.dtype, copy=False))

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def truncate(self, num_tokens: int) -> None:
        """Keep only the first ``num_tokens`` tokens (the writer must be closed)."""
        kept: list[dict[str, Any]] = []
        remaining = num_tokens
        for entry in self.entries:
            file = self.directory / entry["file"]
            if remaining <= 0:
                file.unlink()
                continue
            if entry["tokens"] > remaining:
                with open(file, "r+b") as handle:
                    handle.truncate(remaining * self.dtype.itemsize)
                entry = {**entry, "tokens": remaining}
            kept.append(entry)
            remaining -= entry["tokens"]
        self.entries = kept

    def _append(self, ids: np.ndarray) -> None:
        position = 0
        while position < len(ids):
            if self._handle is None or self.entries[-1]["tokens"] == self.tokens_per_file:
                self.close()
                name = f"{self.prefix}-{len(self.entries):05d}.bin"
                self._handle = open(self.directory / name, "wb")  # stays open across calls until the file is full
                self.entries.append({"file": name, "tokens": 0})
            take = min(len(ids) - position, self.tokens_per_file - self.entries[-1]["tokens"])
            self._handle.write(ids[position : position + take].tobytes())
            self.entries[-1]["tokens"] += take
            position += take
