"""Corpora, tokenizers, prepared token files and token streams: text in, sharded ``(inputs, targets)`` batches out."""

from dilocox.data.corpus import (
    SUPPORTED_SUFFIXES,
    corpus_fingerprint,
    iter_document_pieces,
    load_documents,
    strip_play_markdown,
)
from dilocox.data.dataset import (
    SHARD_MODES,
    IndexPermutation,
    ShardedTokenStream,
    TokenData,
    cache_dir,
    data_fingerprint,
    iter_eval_batches,
    load_prepared_tokens,
    prepare_tokens,
    token_stream_for_rank,
    validation_document_indices,
)
from dilocox.data.prepare import prepare_dataset
from dilocox.data.tokenfiles import TokenFiles, is_prepared_dir
from dilocox.data.tokenizer import EOS_TOKEN, MIN_VOCAB_SIZE, Tokenizer, check_vocab_size, train_bpe

__all__ = [
    "EOS_TOKEN",
    "MIN_VOCAB_SIZE",
    "SHARD_MODES",
    "SUPPORTED_SUFFIXES",
    "IndexPermutation",
    "ShardedTokenStream",
    "TokenData",
    "TokenFiles",
    "Tokenizer",
    "cache_dir",
    "check_vocab_size",
    "corpus_fingerprint",
    "data_fingerprint",
    "is_prepared_dir",
    "iter_document_pieces",
    "iter_eval_batches",
    "load_documents",
    "load_prepared_tokens",
    "prepare_dataset",
    "prepare_tokens",
    "strip_play_markdown",
    "token_stream_for_rank",
    "train_bpe",
    "validation_document_indices",
]
