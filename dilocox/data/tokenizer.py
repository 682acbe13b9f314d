"""A byte-level BPE tokenizer trained locally with the `tokenizers` library, and loading of a user's tokenizer.json."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from dilocox.fileio import write_atomic

EOS_TOKEN = "<|endoftext|>"
MIN_VOCAB_SIZE = 256 + 1
"""The 256 byte tokens of a byte-level BPE plus ``<|endoftext|>``."""
MAX_VOCAB_SIZE = 1 << 20
"""The largest BPE trained here: 4x the largest vocabulary in common use (262,144); the trainer allocates tables per
id up front (1e9 aborted the process), and the model's embedding grows with it."""


class Tokenizer:
    """Text <-> token ids, with ``<|endoftext|>`` as the document separator (``eos_id``).

    A thin wrapper around a ``tokenizers.Tokenizer`` that never adds or skips special tokens, so
    ``decode(encode(s)) == s`` for any text when the tokenizer is byte-level (as ``train_bpe`` makes it).

        tokenizer = train_bpe(load_documents(), vocab_size=2048)
        ids = tokenizer.encode("To be, or not to be") + [tokenizer.eos_id]
        tokenizer.save("/tmp/tokenizer.json"); same = Tokenizer.from_file("/tmp/tokenizer.json")
    """

    def __init__(self, backend: tokenizers.Tokenizer):
        eos_id = backend.token_to_id(EOS_TOKEN)
        if eos_id is None:
            # Every stream this package builds separates documents with <|endoftext|>; a tokenizer without it (many
            # user files) gets it appended as a special token rather than being refused.
            backend.add_special_tokens([tokenizers.AddedToken(EOS_TOKEN, special=True, normalized=False)])
            eos_id = backend.token_to_id(EOS_TOKEN)
        self.backend = backend
        self.eos_id: int = eos_id

    @property
    def vocab_size(self) -> int:
        """Number of ids the model's embedding must cover, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # The Rust side encodes the texts in parallel across cores.
        return [encoding.ids for encoding in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        # Keeping special tokens in the text is what makes decode the exact inverse of encode.
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def vocab_fingerprint(self) -> str:
        """sha256 of the token -> id mapping (added tokens included): equal exactly when every id means the same
        token, however the file was written. A checkpoint records it, so a resume with another tokenizer is
        refused."""
        vocab = sorted(self.backend.get_vocab(with_added_tokens=True).items())
        return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write tokenizer.json atomically, so a concurrent reader never sees a half-written file."""
        write_atomic(path, self.backend.to_str(pretty=False).encode("utf-8"))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a tokenizer.json, or a local directory that holds one (what Hugging Face's `save_pretrained` of a
        fast tokenizer writes). Nothing is downloaded: a hub name is refused with how to fetch it first."""
        file = Path(path).expanduser()
        if file.is_dir():
            if not (file / "tokenizer.json").is_file():
                raise ValueError(
                    f"data.tokenizer={str(path)!r} is a directory without tokenizer.json; save a fast tokenizer into "
                    "it (AutoTokenizer.from_pretrained(NAME).save_pretrained(DIR) writes one) or pass a tokenizer.json"
                )
            file = file / "tokenizer.json"
        if not file.is_file():
            raise ValueError(
                f"data.tokenizer={str(path)!r} is not a local file or directory, and dilocox never downloads: fetch "
                "a Hugging Face tokenizer first (AutoTokenizer.from_pretrained(NAME).save_pretrained(DIR), or `hf "
                "download NAME tokenizer.json --local-dir DIR`) and pass DIR, or leave data.tokenizer empty to train "
                "a BPE of data.vocab_size on the corpus"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as error:  # the Rust side raises a bare Exception for every parse failure
            raise ValueError(
                f"data.tokenizer={str(path)!r} is not a tokenizer.json readable by the `tokenizers` library "
                f"({str(error)[:200]}); give a Hugging Face tokenizer.json, or leave data.tokenizer empty to "
                f"train one"
            ) from None
        return cls(backend)


def train_bpe(documents: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer (GPT-2 style pre-tokenization) with ``vocab_size`` ids on ``documents``.

    The alphabet always holds all 256 bytes, so every string encodes and decodes back exactly, even characters that
    never occur in ``documents``. Training is deterministic: the same documents give the same file.
    """
    check_vocab_size(vocab_size)
    backend = tokenizers.Tokenizer(models.BPE())
    # No normalizer: NFC/NFKC or lowercasing would make decode(encode(s)) differ from s.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(documents, trainer=trainer)
    return Tokenizer(backend)


def smaller_vocab_warning(vocab_size: int, asked: int, *, option: str) -> str | None:
    """The warning line for a BPE trained with `vocab_size` ids, fewer than `asked` (None when it has them all).

    BPE adds an id per merge of two adjacent tokens inside a word; on a small text every word becomes a single token
    before the vocabulary fills, and training stops there. The model's vocabulary is then the tokenizer's."""
    if vocab_size >= asked:
        return None
    return (
        f"dilocox: warning: the BPE has {vocab_size:,} ids, fewer than the {asked:,} asked ({option}={asked}): "
        "every word of this text is already a single token, so nothing is left to merge; the model's vocabulary is "
        f"{vocab_size:,} ids. Use more text for more ids, or {option}={vocab_size} to ask for what it has"
    )


def check_vocab_size(vocab_size: int) -> None:
    """Raise the user-facing error for a BPE vocabulary too small to hold every byte and ``<|endoftext|>``."""
    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"data.vocab_size={vocab_size!r} is too small: a byte-level BPE needs the 256 byte tokens plus "
            f"{EOS_TOKEN}; set data.vocab_size >= {MIN_VOCAB_SIZE} (2048 suits the default corpus)"
        )
    if vocab_size > MAX_VOCAB_SIZE:
        raise ValueError(
            f"data.vocab_size={vocab_size:,} is larger than the {MAX_VOCAB_SIZE:,} a BPE is trained with here; set "
            f"data.vocab_size <= {MAX_VOCAB_SIZE} (2048 suits the default corpus) or give data.tokenizer"
        )
