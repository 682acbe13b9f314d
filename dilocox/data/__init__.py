"""Corpora, tokenizers and token streams: text in, sharded ``(inputs, targets)`` batches out."""

from dilocox.data.corpus import SUPPORTED_SUFFIXES, corpus_fingerprint, load_documents, strip_play_markdown
from dilocox.data.dataset import (
    ShardedTokenStream,
    TokenData,
    cache_dir,
    iter_eval_batches,
    prepare_tokens,
    token_stream_for_rank,
    validation_document_indices,
)
from dilocox.data.tokenizer import EOS_TOKEN, MIN_VOCAB_SIZE, Tokenizer, check_vocab_size, train_bpe

__all__ = [
    "EOS_TOKEN",
    "MIN_VOCAB_SIZE",
    "SUPPORTED_SUFFIXES",
    "ShardedTokenStream",
    "TokenData",
    "Tokenizer",
    "cache_dir",
    "check_vocab_size",
    "corpus_fingerprint",
    "iter_eval_batches",
    "load_documents",
    "prepare_tokens",
    "strip_play_markdown",
    "token_stream_for_rank",
    "train_bpe",
    "validation_document_indices",
]
