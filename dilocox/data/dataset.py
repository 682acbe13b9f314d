"""Token arrays for training and validation, cached on disk, and the per-rank streams of batches drawn from them."""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dilocox.checks import check_choice
from dilocox.config import SHARD_MODES  # `data.shard`: how the training windows are dealt (`ShardedTokenStream`)
from dilocox.data.corpus import corpus_content_fingerprint, corpus_fingerprint, load_documents
from dilocox.data.tokenfiles import (
    INDEX_FILE,
    SPLITS,
    TokenFiles,
    gather_windows,
    is_prepared_dir,
    read_index,
    tokenizer_fingerprint,
)
from dilocox.data.tokenizer import Tokenizer, check_vocab_size, train_bpe
from dilocox.fileio import write_atomic

# Bumped whenever the split or the layout of the cached arrays changes, so old caches are not reused.
_TOKENS_FORMAT_VERSION = 2
_MAX_UINT16_VOCAB = 1 << 16


def cache_dir() -> Path:
    """Where tokenizers and token arrays are cached: ``$DILOCOX_CACHE`` if set, else ``~/.cache/dilocox``."""
    return Path(os.environ.get("DILOCOX_CACHE") or "~/.cache/dilocox").expanduser()


@dataclass
class TokenData:
    """A tokenized corpus: one train and one validation stream, documents separated by ``eos_id``.

    data = prepare_tokens(vocab_size=2048)        # the Shakespeare plays, 2 held out for validation
    stream = token_stream_for_rank(data, seq_len=256, batch_size=16, shard_index=0, num_shards=2, seed=0)
    inputs, targets = stream.next_batch()         # (16, 256) int64 each
    """

    train: np.ndarray | TokenFiles
    """1-D token ids, uint16 when the vocabulary fits in 16 bits, else int32 (uint32 in a prepared directory)."""
    val: np.ndarray | TokenFiles
    """1-D token ids of the held-out documents (or of the corpus's last tokens when it has one document)."""
    tokenizer_path: str
    """The tokenizer.json that produced the ids; ``Tokenizer.from_file`` loads it."""
    vocab_size: int
    eos_id: int
    num_train_documents: int
    num_val_documents: int
    """0 when the corpus has one document and the split is by tokens."""

    def load_tokenizer(self) -> Tokenizer:
        return Tokenizer.from_file(self.tokenizer_path)


def validation_document_indices(num_documents: int, val_fraction: float, seed: int = 0) -> list[int]:
    """The documents held out for validation: about ``val_fraction`` of them, spread evenly over the corpus.

    One document in the middle of each of ``num_val`` equal stretches of the (sorted) corpus, so the held-out set is
    not all from one genre or one source file; ``seed`` rotates the choice. At least one document is held out and at
    least one kept for training; a corpus of one document gives ``[]`` (split by tokens instead).
    """
    if num_documents < 2:
        return []
    num_val = min(num_documents - 1, max(1, math.floor(num_documents * val_fraction + 0.5)))
    stride = num_documents / num_val
    return sorted((int((i + 0.5) * stride) + seed) % num_documents for i in range(num_val))


def prepare_tokens(
    *,
    path: str = "",
    tokenizer: str = "",
    vocab_size: int = 2048,
    val_fraction: float = 0.05,
    text_field: str = "text",
    seed: int = 0,
) -> TokenData:
    """Load, split and tokenize a corpus, or return the cached result of an earlier identical call.

    ``tokenizer`` is a user tokenizer.json; empty trains a byte-level BPE of ``vocab_size`` on the training
    documents only (so validation text never shapes the vocabulary) and caches it. The split is by document (see
    `validation_document_indices`) when there are at least two, else the last ``val_fraction`` of the tokens. Safe to
    call from several processes at once: every cache file is written atomically.

    A ``path`` written by ``dilocox prepare-data`` is opened as it is (`load_prepared_tokens`): its tokenizer, split
    and ids were fixed when it was prepared, so ``vocab_size``, ``val_fraction``, ``text_field`` and ``seed`` do not
    apply to it.
    """
    if is_prepared_dir(path):
        return load_prepared_tokens(path, tokenizer=tokenizer)
    if not (isinstance(val_fraction, int | float) and 0.0 < val_fraction <= 0.5):
        raise ValueError(
            f"data.val_fraction={val_fraction!r} must be in (0, 0.5]; 0.05 holds out 2 of the 38 default plays"
        )
    fingerprint = corpus_fingerprint(path, text_field)
    split_key = f"val_fraction={val_fraction!r},seed={seed}"
    documents: list[str] | None = None

    if tokenizer:
        tok = Tokenizer.from_file(tokenizer)
        tokenizer_file = _tokenizer_file(tokenizer)
    else:
        check_vocab_size(vocab_size)
        tokenizer_file = cache_dir() / "tokenizers" / f"bpe{vocab_size}-{_short_hash(fingerprint, split_key)}.json"
        tok = _load_cached_tokenizer(tokenizer_file)
        if tok is None:
            documents = load_documents(path, text_field=text_field)
            tok = train_bpe(_training_texts(documents, val_fraction, seed), vocab_size)
            tok.save(tokenizer_file)
            write_atomic(_digest_file(tokenizer_file), hashlib.sha256(tokenizer_file.read_bytes()).hexdigest().encode())

    tokenizer_hash = hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()
    entry = cache_dir() / "tokens" / _short_hash(str(_TOKENS_FORMAT_VERSION), fingerprint, tokenizer_hash, split_key)
    cached = _load_cached_tokens(entry, tokenizer_file)
    if cached is not None:
        return cached

    if documents is None:
        documents = load_documents(path, text_field=text_field)
    data = _tokenize_and_split(documents, tok, val_fraction, seed, tokenizer_file)
    _save_cached_tokens(entry, data)
    return data


def load_prepared_tokens(directory: str | Path, *, tokenizer: str = "") -> TokenData:
    """A directory written by ``dilocox prepare-data``, its splits opened as `TokenFiles` (nothing read yet).

    ``tokenizer``, if given, must be the tokenizer the directory was prepared with (the run directory's copy of it,
    say): ids from one tokenizer mean nothing to another.
    """
    directory = Path(directory).expanduser()
    index = read_index(directory)
    tokenizer_file = directory / index["tokenizer"]
    recorded = index["tokenizer_fingerprint"]
    if not tokenizer_file.is_file() or tokenizer_fingerprint(tokenizer_file.read_bytes()) != recorded:
        raise ValueError(
            f"data.path={str(directory)!r}: {index['tokenizer']} is missing or is not the tokenizer recorded in "
            f"{INDEX_FILE}; prepare the directory again with `dilocox prepare-data SRC --out {directory} --overwrite`"
        )
    if tokenizer:
        serialized = Tokenizer.from_file(tokenizer).backend.to_str(pretty=False).encode("utf-8")
        if tokenizer_fingerprint(serialized) != recorded:
            raise ValueError(
                f"data.tokenizer={tokenizer!r} is not the tokenizer data.path={str(directory)!r} was prepared with; "
                f"leave data.tokenizer empty (the prepared directory brings its own tokenizer.json)"
            )
    documents = index["num_documents"]
    return TokenData(
        train=TokenFiles.from_index(directory, index, "train"),
        val=TokenFiles.from_index(directory, index, "val"),
        tokenizer_path=str(tokenizer_file),
        vocab_size=int(index["vocab_size"]),
        eos_id=int(index["eos_id"]),
        num_train_documents=int(documents["train"]),
        num_val_documents=int(documents["val"]),
    )


def data_fingerprint(path: str = "", text_field: str = "text") -> str:
    """What ``data.path`` holds, wherever it is: for a prepared directory, its tokenizer's fingerprint and its token
    files' sampled digests (`read_index` checks them against the files); for a corpus, `corpus_content_fingerprint`.
    Ranks compare it before training (`dilocox.agreement`)."""
    if is_prepared_dir(path):
        index = read_index(path)
        digests = [entry["sampled_sha256"] for split in SPLITS for entry in index["files"][split]]
        return _short_hash(index["tokenizer_fingerprint"], *digests)
    return corpus_content_fingerprint(path, text_field)


class IndexPermutation:
    """A seed-keyed random permutation of ``range(size)``, evaluated at any indices without materializing it.

    A 4-round Feistel network (splitmix64 round function, halves of ``a`` and ``b`` bits taking turns) on the
    ``a + b`` bits that cover ``size``, applied again while a value falls outside ``range(size)`` (cycle walking; the
    domain is under twice ``size``, so under two applications on average): a bijection of ``range(size)`` for every
    size and key, at memory proportional to the indices asked for rather than to ``size`` (Black and Rogaway,
    "Ciphers with Arbitrary Finite Domains", CT-RSA 2002).

        permutation = IndexPermutation(10, key=7)
        permutation(np.arange(10))               # the numbers 0..9 in a shuffled order, the same every time
    """

    def __init__(self, size: int, key: int) -> None:
        if size < 1:
            raise ValueError(f"a permutation needs size >= 1, got {size}")
        self.size = size
        bits = max(2, (size - 1).bit_length())
        self._widths = (bits // 2, bits - bits // 2)  # (left, right) at the start; each round swaps them
        digest = hashlib.sha256(f"dilocox-permutation:{key}".encode()).digest()
        self._round_keys = [np.uint64(int.from_bytes(digest[8 * r : 8 * r + 8], "little")) for r in range(4)]

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        """The images of ``indices`` (each in ``range(size)``) as int64."""
        values = np.atleast_1d(np.asarray(indices, dtype=np.int64))
        if len(values) and (int(values.min()) < 0 or int(values.max()) >= self.size):
            raise IndexError(f"indices {values.min()}..{values.max()} leave range({self.size})")
        out = self._encrypt(values.astype(np.uint64))
        outside = out >= self.size
        while outside.any():
            out[outside] = self._encrypt(out[outside])
            outside = out >= self.size
        return out.astype(np.int64)

    def _encrypt(self, values: np.ndarray) -> np.ndarray:
        left_bits, right_bits = self._widths
        left, right = values >> np.uint64(right_bits), values & np.uint64((1 << right_bits) - 1)
        for round_key in self._round_keys:
            # (L, R) -> (R, L ^ F(R)): invertible whatever F is; the halves swap widths
            mixed = _splitmix64(right ^ round_key) & np.uint64((1 << left_bits) - 1)
            left, right = right, left ^ mixed
            left_bits, right_bits = right_bits, left_bits
        return (left << np.uint64(right_bits)) | right


class ShardedTokenStream:
    """Endless shuffled batches from one rank's shard of a token array (in memory, or `TokenFiles` on disk).

    ``shard="mixed"`` (the default): the ``L // (seq_len + 1)`` non-overlapping windows of ``seq_len + 1`` tokens of
    the whole array are dealt to the ``N`` shards by a permutation keyed by ``seed`` (`IndexPermutation`): shard ``i``
    gets the windows at positions ``i, i + N, i + 2N, ...`` of the permuted order, a mix of the whole corpus, disjoint
    from the other shards, at most one window more than any other. ``shard="contiguous"``: shard ``i`` is
    ``tokens[i*L//N : (i+1)*L//N]`` cut into windows, so each shard sees one stretch of the corpus (before the
    mixed deal existed, the only rule). Every epoch visits each window of the shard once, in an order drawn from
    (seed, shard_index, epoch) alone, so a stream restored with `load_state_dict` continues with exactly the batches
    the original would have produced. Memory does not grow with the corpus in mixed mode (both permutations are
    evaluated, never stored); contiguous mode keeps one int64 per window of its shard for the epoch's order.

        stream = ShardedTokenStream(data.train, seq_len=256, batch_size=16, shard_index=rank, num_shards=2, seed=0)
        inputs, targets = stream.next_batch()      # (16, 256) int64; targets[:, t] == inputs[:, t + 1]
        state = stream.state_dict()                # {"epoch": 0, "index": 16, "shard": "mixed"}: into the checkpoint
    """

    def __init__(
        self,
        tokens: np.ndarray | TokenFiles,
        *,
        seq_len: int,
        batch_size: int,
        shard_index: int,
        num_shards: int,
        seed: int,
        shard: str = "mixed",
    ):
        if not isinstance(tokens, TokenFiles):
            tokens = np.asarray(tokens)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            shape = tokens.shape if isinstance(tokens, np.ndarray) else (len(tokens),)
            raise ValueError(f"tokens must be a 1-D integer array, got shape {shape} of {tokens.dtype}")
        check_choice("data.shard", shard, SHARD_MODES)
        if seq_len < 1:
            raise ValueError(f"train.seq_len={seq_len} must be >= 1")
        if batch_size < 1:
            raise ValueError(f"train.micro_batch_size={batch_size} must be >= 1")
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index={shard_index} must be in [0, num_shards={num_shards})")
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.shard_index = shard_index
        self.num_shards = num_shards
        self.seed = seed
        self.shard = shard
        self._window_len = seq_len + 1
        if shard == "contiguous":
            self.shard_start = shard_index * len(tokens) // num_shards
            self.shard_end = (shard_index + 1) * len(tokens) // num_shards
            self._num_windows = (self.shard_end - self.shard_start) // self._window_len
        else:
            # The shard's windows lie anywhere in the first num_total_windows * window_len tokens.
            num_total_windows = len(tokens) // self._window_len
            self.shard_start, self.shard_end = 0, num_total_windows * self._window_len
            self._num_windows = len(range(shard_index, num_total_windows, num_shards))
            self._deal = IndexPermutation(max(1, num_total_windows), _hash_key("deal", seed))
        if self._num_windows < batch_size:
            raise ValueError(
                f"the training data is too small for {num_shards} data shard(s) at this batch size: shard "
                f"{shard_index} gets {self._num_windows} windows of train.seq_len + 1 = {self._window_len} tokens "
                f"({len(tokens)} training tokens in all, data.shard={shard}), fewer than "
                f"train.micro_batch_size={batch_size}; reduce train.micro_batch_size or train.seq_len, use fewer "
                f"data-parallel ranks, or add data (data.path)"
            )
        self._epoch = 0
        self._index = 0
        self._order_epoch = -1
        self._order = np.empty(0, dtype=np.int64)
        self._mixed_order: IndexPermutation | None = None

    @property
    def num_windows(self) -> int:
        """Windows of ``seq_len + 1`` tokens in this shard, i.e. samples per epoch."""
        return self._num_windows

    @property
    def epoch(self) -> int:
        return self._epoch

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``(inputs, targets)``, each ``(batch_size, seq_len)`` int64; a batch may straddle two epochs."""
        picked = []
        needed = self.batch_size
        while needed:
            take = min(needed, self._num_windows - self._index)
            picked.append(self._window_starts(self._epoch, self._index, self._index + take))
            self._index += take
            needed -= take
            if self._index == self._num_windows:
                self._epoch += 1
                self._index = 0
        rows = gather_windows(self.tokens, np.concatenate(picked), self._window_len)  # (batch, seq_len + 1)
        rows = torch.from_numpy(rows.astype(np.int64))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def skip_batches(self, num_batches: int) -> None:
        """Move on by `num_batches` batches without reading them (a cluster that rejoins an elastic run)."""
        position = self._epoch * self._num_windows + self._index + num_batches * self.batch_size
        self._epoch, self._index = divmod(position, self._num_windows)

    def state_dict(self) -> dict[str, int | str]:
        return {"epoch": self._epoch, "index": self._index, "shard": self.shard}

    def load_state_dict(self, state: dict[str, int | str]) -> None:
        # Checkpoints from before data.shard existed hold no "shard" and were dealt contiguously.
        saved_shard = state.get("shard", "contiguous")
        if saved_shard != self.shard:
            raise ValueError(
                f"the checkpoint's data position is for data.shard={saved_shard} but this run has "
                f"data.shard={self.shard}; resume with --data.shard={saved_shard}"
            )
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index <= self._num_windows:
            raise ValueError(
                f"data stream state {state} does not fit this shard of {self._num_windows} windows; the checkpoint "
                f"was written with other data, train.seq_len or number of data shards"
            )
        self._epoch, self._index = epoch, index
        if self._index == self._num_windows:
            self._epoch, self._index = epoch + 1, 0

    def _window_starts(self, epoch: int, begin: int, end: int) -> np.ndarray:
        """Token offsets of the windows at positions ``[begin, end)`` of this shard's order in ``epoch``."""
        if self.shard == "contiguous":
            return self.shard_start + self._epoch_order(epoch)[begin:end] * self._window_len
        if epoch != self._order_epoch:
            key = _hash_key("order", self.seed, self.shard_index, epoch)
            self._mixed_order = IndexPermutation(self._num_windows, key)
            self._order_epoch = epoch
        local = self._mixed_order(np.arange(begin, end))  # the shard's k-th window is the deal's (i + k N)-th
        return self._deal(self.shard_index + local * self.num_shards) * self._window_len

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            generator = torch.Generator().manual_seed(_derive_seed(self.seed, self.shard_index, epoch))
            self._order = torch.randperm(self._num_windows, generator=generator).numpy()
            self._order_epoch = epoch
        return self._order


def token_stream_for_rank(
    data: TokenData,
    *,
    seq_len: int,
    batch_size: int,
    shard_index: int,
    num_shards: int,
    seed: int,
    shard: str = "mixed",
) -> ShardedTokenStream:
    """The training stream of one data-parallel rank (or replica): its shard of ``data.train``."""
    return ShardedTokenStream(
        data.train,
        seq_len=seq_len,
        batch_size=batch_size,
        shard_index=shard_index,
        num_shards=num_shards,
        seed=seed,
        shard=shard,
    )


def iter_eval_batches(
    tokens: np.ndarray | TokenFiles, *, seq_len: int, batch_size: int, max_batches: int | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic ``(inputs, targets)`` batches of non-overlapping windows from the start of ``tokens``.

    Every batch is ``(batch_size, seq_len)`` int64 (the last partial batch is dropped), so every rank and every
    evaluation sees the same samples. At most ``max_batches`` batches; ``None`` for all of them.
    """
    if not isinstance(tokens, TokenFiles):
        tokens = np.asarray(tokens)
    window_len = seq_len + 1
    num_windows = len(tokens) // window_len if seq_len >= 1 else 0
    if seq_len < 1 or batch_size < 1 or num_windows < batch_size:
        raise ValueError(
            f"the validation data has {len(tokens):,} tokens, {num_windows} windows of train.seq_len + 1 = "
            f"{window_len}, not enough for one evaluation batch of train.micro_batch_size = {batch_size} windows "
            f"({batch_size * window_len:,} tokens); lower --train.micro_batch_size or --train.seq_len, raise "
            "--data.val_fraction (up to 0.5), or use more text (docs/design.md, 'How much text a run needs')"
        )
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"max_batches={max_batches} must be >= 1, or None for the whole validation set")
    num_batches = num_windows // batch_size
    if max_batches is not None:
        num_batches = min(num_batches, max_batches)
    return _eval_batches(tokens, window_len, batch_size, num_batches)


def _eval_batches(
    tokens: np.ndarray | TokenFiles, window_len: int, batch_size: int, num_batches: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    # Split from iter_eval_batches so bad arguments raise at the call, not at the first next(). One batch is read at a
    # time, so a validation split on disk is never loaded whole.
    batch_tokens = batch_size * window_len
    for b in range(num_batches):
        batch = tokens[b * batch_tokens : (b + 1) * batch_tokens].reshape(batch_size, window_len)
        rows = torch.from_numpy(batch.astype(np.int64))  # (batch, seq_len + 1)
        yield rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def _derive_seed(seed: int, shard_index: int, epoch: int) -> int:
    # A hash rather than arithmetic on the three numbers: (seed, shard 1) and (seed + 1, shard 0) must not collide.
    digest = hashlib.sha256(f"dilocox-stream:{seed}:{shard_index}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _hash_key(*parts: object) -> int:
    """A 63-bit key of the mixed deal and orders; a hash, so (seed, shard 1) and (seed + 1, shard 0) differ."""
    digest = hashlib.sha256(":".join(["dilocox-mixed", *map(str, parts)]).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


_U27, _U30, _U31 = np.uint64(27), np.uint64(30), np.uint64(31)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer on uint64 arrays (multiplication wraps): each output bit depends on every input bit."""
    values = (values ^ (values >> _U30)) * _MIX1
    values = (values ^ (values >> _U27)) * _MIX2
    return values ^ (values >> _U31)


def _short_hash(*parts: str) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _tokenizer_file(path: str) -> Path:
    file = Path(path).expanduser()
    return file / "tokenizer.json" if file.is_dir() else file


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= _MAX_UINT16_VOCAB else np.dtype(np.int32)


def _training_texts(documents: list[str], val_fraction: float, seed: int) -> list[str]:
    """The text the BPE may learn from: the training documents, or the head of a lone document."""
    if len(documents) == 1:
        # The token split is only known after tokenizing; the same fraction of characters is close enough to keep
        # the validation tail out of the vocabulary.
        text = documents[0]
        return [text[: max(1, int(len(text) * (1.0 - val_fraction)))]]
    held_out = set(validation_document_indices(len(documents), val_fraction, seed))
    return [doc for i, doc in enumerate(documents) if i not in held_out]


def _tokenize_and_split(
    documents: list[str], tok: Tokenizer, val_fraction: float, seed: int, tokenizer_file: Path
) -> TokenData:
    dtype = _token_dtype(tok.vocab_size)
    encoded = tok.encode_batch(documents)
    if len(documents) == 1:
        tokens = _join(encoded, tok.eos_id, dtype)
        if len(tokens) < 2:
            raise ValueError(
                f"data.path: the corpus is a single document of {len(tokens)} token(s), too short to split into "
                f"train and validation; add more text"
            )
        num_val = min(len(tokens) - 1, max(1, math.floor(len(tokens) * val_fraction + 0.5)))
        train, val = tokens[:-num_val], tokens[-num_val:]
        num_train_documents, num_val_documents = 1, 0
    else:
        held_out = set(validation_document_indices(len(documents), val_fraction, seed))
        train = _join([ids for i, ids in enumerate(encoded) if i not in held_out], tok.eos_id, dtype)
        val = _join([ids for i, ids in enumerate(encoded) if i in held_out], tok.eos_id, dtype)
        num_train_documents, num_val_documents = len(documents) - len(held_out), len(held_out)
    return TokenData(
        train=train,
        val=val,
        tokenizer_path=str(tokenizer_file),
        vocab_size=tok.vocab_size,
        eos_id=tok.eos_id,
        num_train_documents=num_train_documents,
        num_val_documents=num_val_documents,
    )


def _join(encoded: list[list[int]], eos_id: int, dtype: np.dtype) -> np.ndarray:
    """Concatenate documents with one ``eos_id`` between consecutive ones."""
    total = sum(len(ids) for ids in encoded) + max(0, len(encoded) - 1)
    out = np.empty(total, dtype=dtype)
    position = 0
    for i, ids in enumerate(encoded):
        if i:
            out[position] = eos_id
            position += 1
        out[position : position + len(ids)] = ids
        position += len(ids)
    return out


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def _digest_file(cached: Path) -> Path:
    return cached.with_name(cached.name + ".sha256")


def _load_cached_tokenizer(file: Path) -> Tokenizer | None:
    """The cached BPE at `file`, or None when there is none yet or it is damaged (it does not match the sha256 saved
    beside it, or does not parse: one warning line), to be trained again."""
    if not (file.is_file() and _digest_file(file).is_file()):  # none yet, or cached before digests were saved
        return None
    try:
        if hashlib.sha256(file.read_bytes()).hexdigest() != _digest_file(file).read_text().strip():
            raise ValueError(f"{file.name} does not match its sha256")
        return Tokenizer.from_file(file)
    except (OSError, ValueError) as exc:
        print(f"dilocox: warning: the cached tokenizer {file} is damaged ({exc}); training it again", file=sys.stderr)
        return None


def _save_cached_tokens(entry: Path, data: TokenData) -> None:
    arrays = {"train.npy": _npy_bytes(data.train), "val.npy": _npy_bytes(data.val)}
    for name, raw in arrays.items():
        write_atomic(entry / name, raw)
    # meta.json goes last: its presence is what tells a reader that both arrays are complete.
    meta = {
        "vocab_size": data.vocab_size,
        "eos_id": data.eos_id,
        "num_train_documents": data.num_train_documents,
        "num_val_documents": data.num_val_documents,
        "sha256": {name: hashlib.sha256(raw).hexdigest() for name, raw in arrays.items()},
    }
    write_atomic(entry / "meta.json", json.dumps(meta, indent=1).encode())


def _load_cached_tokens(entry: Path, tokenizer_file: Path) -> TokenData | None:
    """The cached token arrays of `entry`, or None when there are none yet or they are damaged (a meta.json or an
    array that does not read, or an array whose sha256 is not the one recorded: one warning line), to be rebuilt."""
    meta_file = entry / "meta.json"
    if not meta_file.is_file():
        return None
    try:
        meta = json.loads(meta_file.read_text())
        arrays = {}
        for name in ("train.npy", "val.npy"):
            raw = (entry / name).read_bytes()
            if hashlib.sha256(raw).hexdigest() != meta["sha256"][name]:
                raise ValueError(f"{name} does not match its sha256")
            arrays[name] = np.load(io.BytesIO(raw), allow_pickle=False)
        return TokenData(
            train=arrays["train.npy"],
            val=arrays["val.npy"],
            tokenizer_path=str(tokenizer_file),
            vocab_size=int(meta["vocab_size"]),
            eos_id=int(meta["eos_id"]),
            num_train_documents=int(meta["num_train_documents"]),
            num_val_documents=int(meta["num_val_documents"]),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        # rebuilt rather than trusted; the rewrite replaces it atomically
        print(f"dilocox: warning: the token cache {entry} is damaged ({exc}); rebuilding it", file=sys.stderr)
        return None
