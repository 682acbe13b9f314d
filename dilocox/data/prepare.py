"""``dilocox prepare-data``: tokenize a corpus once, streaming, into a prepared token directory (`tokenfiles`).

Three passes over the corpus, none holding more than a bounded piece of it: count the documents (the
train/validation split is by document, as `prepare_tokens` splits), train a byte-level BPE on a bounded sample of
the training documents (unless a tokenizer is given), then encode batch by batch into ``train-*.bin`` and
``val-*.bin``. Everything is written into a hidden temporary directory next to ``out`` that is renamed into place at
the end, so a failed or interrupted run leaves nothing behind.

    index = prepare_dataset("corpus/", "data/prepared", vocab_size=8192)
    data = prepare_tokens(path="data/prepared")      # TokenData whose splits are TokenFiles
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from dilocox.data.corpus import empty_corpus_error, iter_document_pieces
from dilocox.data.dataset import validation_document_indices
from dilocox.data.hf_datasets import is_saved_dataset, iter_dataset_documents
from dilocox.data.tokenfiles import (
    INDEX_FILE,
    INDEX_FORMAT,
    INDEX_VERSION,
    SPLITS,
    TokenFiles,
    TokenFileWriter,
    describe_token_file,
    token_file_dtype,
    tokenizer_fingerprint,
)
from dilocox.data.tokenizer import MIN_VOCAB_SIZE, Tokenizer, smaller_vocab_warning, train_bpe
from dilocox.fileio import write_atomic

READERS = ("auto", "files", "datasets")
"""``--reader``: auto reads a ``save_to_disk`` directory through ``datasets`` and anything else with `corpus`."""
TOKENS_PER_FILE = 1 << 28
"""Tokens per ``.bin`` file (512 MiB of uint16)."""
SAMPLE_CHARS = 1 << 25
"""Characters of training text the BPE learns from at most (32 Mi): every k-th piece, spread over the corpus."""
_BATCH_CHARS = 1 << 21  # text handed to one encode_batch call, which the tokenizers library spreads over the cores
_BATCH_PIECES = 4096
_COPY_TOKENS = 1 << 24  # tokens moved at once when a single document's tail becomes the validation split
_PROGRESS_EVERY_S = 10.0


def prepare_dataset(
    source: str,
    out: str | os.PathLike[str],
    *,
    tokenizer: str = "",
    vocab_size: int = 2048,
    val_fraction: float = 0.05,
    text_field: str = "text",
    seed: int = 0,
    overwrite: bool = False,
    reader: str = "auto",
    tokens_per_file: int = TOKENS_PER_FILE,
    sample_chars: int = SAMPLE_CHARS,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Tokenize ``source`` (what ``data.path`` accepts) into the directory ``out``; returns the index written there.

    The split and the tokenizer follow `prepare_tokens`: documents chosen by `validation_document_indices` (the
    last ``val_fraction`` of the tokens for a single document) and, without ``tokenizer``, a byte-level BPE of
    ``vocab_size`` trained on training text only. On a corpus smaller than ``sample_chars`` the ids equal
    `prepare_tokens`'s for the same arguments. ``out`` must not exist, be empty, or (with ``overwrite``) be an
    earlier prepared directory.
    """
    if reader not in READERS:
        raise ValueError(f"--reader={reader!r} is not one of: {', '.join(READERS)}")
    if not (isinstance(val_fraction, int | float) and 0.0 < val_fraction <= 0.5):
        raise ValueError(f"--val-fraction={val_fraction!r} must be in (0, 0.5]; 0.05 holds out one document in 20")
    if not tokenizer and vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"--vocab-size={vocab_size} is too small: a byte-level BPE needs the 256 byte tokens plus "
            f"<|endoftext|>; give --vocab-size >= {MIN_VOCAB_SIZE}"
        )
    if tokens_per_file < 1 or sample_chars < 1:
        raise ValueError(f"--tokens-per-file={tokens_per_file} and the BPE sample {sample_chars} must be >= 1")
    out = Path(out).expanduser()
    _check_out(out, overwrite)
    use_datasets = reader == "datasets" or (reader == "auto" and is_saved_dataset(source))
    say = progress or (lambda message: None)

    def pieces() -> Iterator[tuple[bool, str]]:
        if use_datasets:
            return ((True, text) for text in iter_dataset_documents(source, text_field=text_field) if text.strip())
        return iter_document_pieces(source, text_field=text_field)

    start = time.perf_counter()
    num_documents, num_chars = 0, 0
    for starts_document, piece in pieces():
        num_documents += starts_document
        num_chars += len(piece)
    if num_documents == 0:
        raise empty_corpus_error(source)
    held_out = np.asarray(validation_document_indices(num_documents, val_fraction, seed), dtype=np.int64)
    say(f"pass 1/3: {num_documents:,} documents, {num_chars:,} characters ({time.perf_counter() - start:.0f} s)")

    if tokenizer:
        tok = Tokenizer.from_file(tokenizer)
    else:
        sample = _bpe_sample(pieces(), held_out, num_documents, num_chars, val_fraction, sample_chars)
        tok = train_bpe(sample, vocab_size)
        del sample
        say(f"pass 2/3: trained a BPE of {tok.vocab_size} ids ({time.perf_counter() - start:.0f} s)")
        if warning := smaller_vocab_warning(tok.vocab_size, vocab_size, option="--vocab-size"):
            print(warning, file=sys.stderr, flush=True)

    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        index = _write_tokens(
            partial, pieces(), tok, held_out, num_documents, num_chars, val_fraction, tokens_per_file, say, start
        )
        for entry in (entry for split in SPLITS for entry in index["files"][split]):
            entry.update(describe_token_file(partial / entry["file"], np.dtype(index["dtype"])))
        index.update(
            source=str(source), reader="datasets" if use_datasets else "files", text_field=text_field, seed=seed
        )
        tok.save(partial / index["tokenizer"])
        index["tokenizer_fingerprint"] = tokenizer_fingerprint((partial / index["tokenizer"]).read_bytes())
        write_atomic(partial / INDEX_FILE, json.dumps(index, indent=1).encode())  # last: it marks the directory done
        _move_into_place(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    say(f"done: {out} ({time.perf_counter() - start:.0f} s)")
    return index


def _check_out(out: Path, overwrite: bool) -> None:
    """Refuse an ``out`` that would lose data: a file, a non-empty directory (unless an overwritten prepared one)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a directory path to create")
    if not any(out.iterdir()):
        return
    if not (out / INDEX_FILE).is_file():
        raise ValueError(
            f"--out {out} exists and is not empty (and is not a prepared directory, which --overwrite would "
            f"replace); choose a new directory for --out"
        )
    if not overwrite:
        raise ValueError(f"--out {out} already holds prepared data; pass --overwrite to replace it or choose another")


def _move_into_place(partial: Path, out: Path) -> None:
    if out.exists() and any(out.iterdir()):
        previous = out.with_name(f".{out.name}.replaced-{os.getpid()}")
        os.rename(out, previous)
        os.rename(partial, out)
        shutil.rmtree(previous)
    else:
        os.replace(partial, out)  # an empty directory is replaced, a missing one created
    out.chmod(0o755)  # mkdtemp made it private; prepared data is shared like any other data


def _bpe_sample(
    pieces: Iterator[tuple[bool, str]],
    held_out: np.ndarray,
    num_documents: int,
    num_chars: int,
    val_fraction: float,
    sample_chars: int,
) -> list[str]:
    """The training text the BPE learns from: every k-th training piece, at most ``sample_chars`` characters.

    As `prepare_tokens`: the training documents only, or the first ``1 - val_fraction`` of a lone document's
    characters; below ``sample_chars`` all of it, so a small corpus gets the same tokenizer either way."""
    if num_documents == 1:
        train_chars = max(1, int(num_chars * (1.0 - val_fraction)))
    else:
        train_chars = num_chars  # held-out sizes are unknown yet; over-counting only makes the sample smaller
    stride = max(1, math.ceil(train_chars / sample_chars))
    sample: list[str] = []
    sampled, seen_chars, position, document = 0, 0, 0, -1
    for starts_document, piece in pieces:
        document += starts_document
        if num_documents == 1:
            piece = piece[: max(0, train_chars - seen_chars)]
            seen_chars += len(piece)
            if not piece:
                break
        elif _is_held_out(held_out, document):
            continue
        if position % stride == 0 and sampled < sample_chars:
            sample.append(piece)
            sampled += len(piece)
        position += 1
    return sample


def _write_tokens(
    directory: Path,
    pieces: Iterator[tuple[bool, str]],
    tok: Tokenizer,
    held_out: np.ndarray,
    num_documents: int,
    num_chars: int,
    val_fraction: float,
    tokens_per_file: int,
    say: Callable[[str], None],
    start: float,
) -> dict[str, Any]:
    dtype = token_file_dtype(tok.vocab_size)
    writers = {
        split: TokenFileWriter(directory, split, dtype, eos_id=tok.eos_id, tokens_per_file=tokens_per_file)
        for split in ("train", "val")
    }
    batch: list[tuple[TokenFileWriter, bool, str]] = []
    batch_chars, done_chars, document, last_report = 0, 0, -1, time.perf_counter()

    def encode_batch() -> None:
        for (writer, starts_document, _), ids in zip(batch, tok.encode_batch([p for _, _, p in batch]), strict=True):
            writer.write(np.asarray(ids, dtype=np.int64), starts_document=starts_document)
        batch.clear()

    for starts_document, piece in pieces:
        document += starts_document
        split = "val" if num_documents > 1 and _is_held_out(held_out, document) else "train"
        batch.append((writers[split], starts_document, piece))
        batch_chars += len(piece)
        if batch_chars >= _BATCH_CHARS or len(batch) >= _BATCH_PIECES:
            encode_batch()
            done_chars += batch_chars
            batch_chars = 0
            if time.perf_counter() - last_report >= _PROGRESS_EVERY_S:
                last_report = time.perf_counter()
                say(f"pass 3/3: encoded {done_chars / num_chars:.0%} ({last_report - start:.0f} s)")
    encode_batch()
    for writer in writers.values():
        writer.close()
    if num_documents == 1:
        _split_tail(writers["train"], writers["val"], val_fraction)
    return {
        "format": INDEX_FORMAT,
        "version": INDEX_VERSION,
        "dtype": dtype.name,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "tokenizer": "tokenizer.json",
        "split": "tokens" if num_documents == 1 else "documents",
        "val_fraction": val_fraction,
        "num_documents": {"train": num_documents - len(held_out), "val": len(held_out)},
        "num_tokens": {split: writer.num_tokens for split, writer in writers.items()},
        "files": {split: writer.entries for split, writer in writers.items()},
    }


def _split_tail(train: TokenFileWriter, val: TokenFileWriter, val_fraction: float) -> None:
    """A lone document: its last ``val_fraction`` of tokens move from the train files to the validation files."""
    total = train.num_tokens
    if total < 2:
        raise ValueError(
            f"the corpus is a single document of {total} token(s), too short to split into train and "
            f"validation; add more text"
        )
    num_val = min(total - 1, max(1, math.floor(total * val_fraction + 0.5)))
    tokens = TokenFiles(
        [train.directory / e["file"] for e in train.entries], [e["tokens"] for e in train.entries], train.dtype
    )
    for begin in range(total - num_val, total, _COPY_TOKENS):
        val.write(tokens[begin : min(total, begin + _COPY_TOKENS)], starts_document=False)
    val.close()
    train.truncate(total - num_val)


def _is_held_out(held_out: np.ndarray, document: int) -> bool:
    position = int(np.searchsorted(held_out, document))
    return position < len(held_out) and int(held_out[position]) == document
