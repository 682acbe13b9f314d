"""Token arrays for training and validation, cached on disk, and the per-rank streams of batches drawn from them."""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dilocox.data.corpus import corpus_fingerprint, load_documents
from dilocox.data.tokenizer import Tokenizer, check_vocab_size, train_bpe
from dilocox.fileio import write_atomic

# Bumped whenever the split or the layout of the cached arrays changes, so old caches are not reused.
_TOKENS_FORMAT_VERSION = 1
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

    train: np.ndarray
    """1-D token ids, uint16 when the vocabulary fits in 16 bits, else int32."""
    val: np.ndarray
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
    """
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
        if tokenizer_file.is_file():
            tok = Tokenizer.from_file(tokenizer_file)
        else:
            documents = load_documents(path, text_field=text_field)
            tok = train_bpe(_training_texts(documents, val_fraction, seed), vocab_size)
            tok.save(tokenizer_file)

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


class ShardedTokenStream:
    """Endless shuffled batches from one rank's contiguous shard of a token array.

    Shard ``i`` of ``N`` is ``tokens[i*L//N : (i+1)*L//N]``, cut into non-overlapping windows of ``seq_len + 1``
    tokens; every epoch visits each window once, in an order drawn from (seed, shard_index, epoch) alone, so a
    stream restored with `load_state_dict` continues with exactly the batches the original would have produced.

        stream = ShardedTokenStream(data.train, seq_len=256, batch_size=16, shard_index=rank, num_shards=2, seed=0)
        inputs, targets = stream.next_batch()      # (16, 256) int64; targets[:, t] == inputs[:, t + 1]
        state = stream.state_dict()                # {"epoch": 0, "index": 16}, goes into the checkpoint
    """

    def __init__(
        self, tokens: np.ndarray, *, seq_len: int, batch_size: int, shard_index: int, num_shards: int, seed: int
    ):
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be a 1-D integer array, got shape {tokens.shape} of {tokens.dtype}")
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
        self.shard_start = shard_index * len(tokens) // num_shards
        self.shard_end = (shard_index + 1) * len(tokens) // num_shards
        self._window_len = seq_len + 1
        self._num_windows = (self.shard_end - self.shard_start) // self._window_len
        if self._num_windows < batch_size:
            raise ValueError(
                f"the training data is too small for {num_shards} data shard(s) at this batch size: shard "
                f"{shard_index} has {self.shard_end - self.shard_start} tokens, {self._num_windows} windows of "
                f"train.seq_len + 1 = {self._window_len} tokens, fewer than train.micro_batch_size={batch_size}; "
                f"reduce train.micro_batch_size or train.seq_len, use fewer data-parallel ranks, or add data "
                f"(data.path)"
            )
        self._epoch = 0
        self._index = 0
        self._order_epoch = -1
        self._order = np.empty(0, dtype=np.int64)

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
            order = self._epoch_order(self._epoch)
            take = min(needed, self._num_windows - self._index)
            picked.append(order[self._index : self._index + take])
            self._index += take
            needed -= take
            if self._index == self._num_windows:
                self._epoch += 1
                self._index = 0
        starts = self.shard_start + np.concatenate(picked) * self._window_len
        rows = self.tokens[starts[:, None] + np.arange(self._window_len)]  # (batch, seq_len + 1)
        rows = torch.from_numpy(rows.astype(np.int64))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "index": self._index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index <= self._num_windows:
            raise ValueError(
                f"data stream state {state} does not fit this shard of {self._num_windows} windows; the checkpoint "
                f"was written with other data, train.seq_len or number of data shards"
            )
        self._epoch, self._index = epoch, index
        if self._index == self._num_windows:
            self._epoch, self._index = epoch + 1, 0

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            generator = torch.Generator().manual_seed(_derive_seed(self.seed, self.shard_index, epoch))
            self._order = torch.randperm(self._num_windows, generator=generator).numpy()
            self._order_epoch = epoch
        return self._order


def token_stream_for_rank(
    data: TokenData, *, seq_len: int, batch_size: int, shard_index: int, num_shards: int, seed: int
) -> ShardedTokenStream:
    """The training stream of one data-parallel rank (or replica): its shard of ``data.train``."""
    return ShardedTokenStream(
        data.train, seq_len=seq_len, batch_size=batch_size, shard_index=shard_index, num_shards=num_shards, seed=seed
    )


def iter_eval_batches(
    tokens: np.ndarray, *, seq_len: int, batch_size: int, max_batches: int | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic ``(inputs, targets)`` batches of non-overlapping windows from the start of ``tokens``.

    Every batch is ``(batch_size, seq_len)`` int64 (the last partial batch is dropped), so every rank and every
    evaluation sees the same samples. At most ``max_batches`` batches; ``None`` for all of them.
    """
    tokens = np.asarray(tokens)
    window_len = seq_len + 1
    num_windows = len(tokens) // window_len if seq_len >= 1 else 0
    if seq_len < 1 or batch_size < 1 or num_windows < batch_size:
        raise ValueError(
            f"the validation data has {len(tokens)} tokens, {num_windows} windows of seq_len + 1 = {window_len}, "
            f"not enough for one batch of {batch_size}; reduce the evaluation batch size or train.seq_len, or raise "
            f"data.val_fraction"
        )
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"max_batches={max_batches} must be >= 1, or None for the whole validation set")
    num_batches = num_windows // batch_size
    if max_batches is not None:
        num_batches = min(num_batches, max_batches)
    return _eval_batches(tokens, window_len, batch_size, num_batches)


def _eval_batches(
    tokens: np.ndarray, window_len: int, batch_size: int, num_batches: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    # Split from iter_eval_batches so bad arguments raise at the call, not at the first next().
    windows = tokens[: num_batches * batch_size * window_len].reshape(num_batches, batch_size, window_len)
    for batch in windows:
        rows = torch.from_numpy(batch.astype(np.int64))  # (batch, seq_len + 1)
        yield rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def _derive_seed(seed: int, shard_index: int, epoch: int) -> int:
    # A hash rather than arithmetic on the three numbers: (seed, shard 1) and (seed + 1, shard 0) must not collide.
    digest = hashlib.sha256(f"dilocox-stream:{seed}:{shard_index}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


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


def _save_cached_tokens(entry: Path, data: TokenData) -> None:
    write_atomic(entry / "train.npy", _npy_bytes(data.train))
    write_atomic(entry / "val.npy", _npy_bytes(data.val))
    # meta.json goes last: its presence is what tells a reader that both arrays are complete.
    meta = {
        "vocab_size": data.vocab_size,
        "eos_id": data.eos_id,
        "num_train_documents": data.num_train_documents,
        "num_val_documents": data.num_val_documents,
    }
    write_atomic(entry / "meta.json", json.dumps(meta, indent=1).encode())


def _load_cached_tokens(entry: Path, tokenizer_file: Path) -> TokenData | None:
    meta_file = entry / "meta.json"
    if not meta_file.is_file():
        return None
    try:
        meta = json.loads(meta_file.read_text())
        train = np.load(entry / "train.npy", allow_pickle=False)
        val = np.load(entry / "val.npy", allow_pickle=False)
        return TokenData(
            train=train,
            val=val,
            tokenizer_path=str(tokenizer_file),
            vocab_size=int(meta["vocab_size"]),
            eos_id=int(meta["eos_id"]),
            num_train_documents=int(meta["num_train_documents"]),
            num_val_documents=int(meta["num_val_documents"]),
        )
    except (OSError, ValueError, KeyError):
        # A damaged or foreign cache entry is rebuilt rather than trusted; the rewrite replaces it atomically.
        return None
