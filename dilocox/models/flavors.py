"""Named model shapes, from a CPU debug model to the DiLoCoX paper's Qwen1.5-107B.

The small flavors (`debug`, `tiny`, `small`, `medium`) take their vocabulary size from the tokenizer; the entry in
`FLAVORS` holds a reference vocab of 2048 only so that each entry is a complete, countable `ModelArgs`. The
real-shape Qwen1.5 flavors have a fixed vocabulary: a tokenizer with fewer ids fits in their embedding, a larger
one does not.
"""

from dataclasses import replace

from dilocox.models.decoder import ModelArgs

REFERENCE_VOCAB_SIZE = 2048
"""Vocabulary of the small flavors' registry entries (the size of the default BPE); replaced by `model_args`."""

_QWEN_MAX_SEQ_LEN = 32768  # every Qwen1.5 model supports a 32k context

FLAVORS: dict[str, ModelArgs] = {
    # 0.36M parameters at vocab 2048: fast enough for unit and end-to-end tests.
    "debug": ModelArgs(dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=192, vocab_size=REFERENCE_VOCAB_SIZE),
    # 1.31M parameters at vocab 2048: the default of `dilocox train`; fwd + bwd + AdamW at batch 16 x 256 measured
    # 5-6k tokens/s on one thread of the 2-core CI machine.
    "tiny": ModelArgs(dim=128, num_layers=4, num_heads=4, num_kv_heads=2, ffn_dim=384, vocab_size=REFERENCE_VOCAB_SIZE),
    # 10.5M parameters at vocab 2048; 12 layers split evenly into 2, 3, 4 or 6 pipeline stages.
    "small": ModelArgs(
        dim=256, num_layers=12, num_heads=8, num_kv_heads=4, ffn_dim=768, vocab_size=REFERENCE_VOCAB_SIZE
    ),
    # 29.1M parameters at vocab 2048; 16 layers split evenly into 2, 4 or 8 pipeline stages.
    "medium": ModelArgs(
        dim=384, num_layers=16, num_heads=6, num_kv_heads=2, ffn_dim=1152, vocab_size=REFERENCE_VOCAB_SIZE
    ),
    # 0.18M parameters at vocab 257 (one id per byte: a character model): GPT-2's block (LayerNorm, learned
    # positions, GELU), the second workload of the gap protocol (docs/results.md).
    "gpt2-char": ModelArgs(
        dim=64, num_layers=3, num_heads=4, num_kv_heads=4, ffn_dim=256, vocab_size=REFERENCE_VOCAB_SIZE,
        max_seq_len=256, norm_eps=1e-5, tie_embeddings=True, style="gpt2",
    ),
    # The shapes of the released Qwen1.5 checkpoints (Hugging Face config.json of Qwen/Qwen1.5-*).
    "qwen1.5-0.5b": ModelArgs(
        dim=1024,
        num_layers=24,
        num_heads=16,
        num_kv_heads=16,
        ffn_dim=2816,
        vocab_size=151936,
        max_seq_len=_QWEN_MAX_SEQ_LEN,
        rope_theta=1e6,
        qkv_bias=True,
        tie_embeddings=True,
    ),
    "qwen1.5-1.8b": ModelArgs(
        dim=2048,
        num_layers=24,
        num_heads=16,
        num_kv_heads=16,
        ffn_dim=5504,
        vocab_size=151936,
        max_seq_len=_QWEN_MAX_SEQ_LEN,
        rope_theta=1e6,
        qkv_bias=True,
    ),
    "qwen1.5-7b": ModelArgs(
        dim=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        ffn_dim=11008,
        vocab_size=151936,
        max_seq_len=_QWEN_MAX_SEQ_LEN,
        rope_theta=1e6,
        qkv_bias=True,
    ),
    # The DiLoCoX paper's "Qwen1.5-107B" (Qi et al. 2025, arXiv 2506.21263), which gives no exact shape. We take
    # Qwen1.5-110B's block (hidden 8192, 64 heads, 8 kv heads, ffn 49152, vocab 152064, untied, qkv bias) and cut
    # the depth: one block holds 1,358,981,120 parameters and embedding + head + final norm 2,491,424,768, so
    # 80 layers (the 110B) give 111.21B, 78 give 108.49B (+1.4%), 76 give 105.77B (-1.1%) and 77 give
    # 107,132,971,008 (+0.12%): 77 layers is the only depth within 1% of 107B.
    "qwen1.5-107b": ModelArgs(
        dim=8192,
        num_layers=77,
        num_heads=64,
        num_kv_heads=8,
        ffn_dim=49152,
        vocab_size=152064,
        max_seq_len=_QWEN_MAX_SEQ_LEN,
        rope_theta=1e6,
        qkv_bias=True,
    ),
}
"""Every named flavor. Use `model_args` rather than these entries: it fills in the vocab and returns a copy."""

FIXED_VOCAB_FLAVORS: frozenset[str] = frozenset({"qwen1.5-0.5b", "qwen1.5-1.8b", "qwen1.5-7b", "qwen1.5-107b"})
"""Flavors whose vocabulary size is part of the shape instead of coming from the tokenizer."""


def list_flavors() -> list[str]:
    """Names of all flavors: the small Qwen-style ones smallest first, the GPT-2-style one, the Qwen1.5 shapes."""
    return list(FLAVORS)


def model_args(flavor: str, vocab_size: int | None = None, max_seq_len: int | None = None) -> ModelArgs:
    """A fresh, validated `ModelArgs` for `flavor`.

    `vocab_size` is the tokenizer's: required for the small flavors; for a fixed-vocab Qwen flavor it must not exceed
    the flavor's vocab (which is kept, so that the shape stays the checkpoint's). `max_seq_len`, when given,
    replaces the flavor's (it only sizes the rotary table).
    """
    if flavor not in FLAVORS:
        raise ValueError(f"model.flavor = {flavor!r} is not a known flavor; available: {', '.join(list_flavors())}")
    args = replace(FLAVORS[flavor])
    if flavor in FIXED_VOCAB_FLAVORS:
        if vocab_size is not None and vocab_size > args.vocab_size:
            raise ValueError(
                f"tokenizer vocab_size={vocab_size} does not fit model flavor {flavor!r}, whose embedding has "
                f"{args.vocab_size} rows; use a tokenizer with at most {args.vocab_size} ids or a small flavor "
                f"({', '.join(name for name in FLAVORS if name not in FIXED_VOCAB_FLAVORS)})"
            )
    else:
        if vocab_size is None:
            raise ValueError(
                f"model flavor {flavor!r} takes its vocab size from the tokenizer; pass vocab_size (the "
                "tokenizer's number of ids)"
            )
        args = replace(args, vocab_size=vocab_size)
    if max_seq_len is not None:
        args = replace(args, max_seq_len=max_seq_len)
    args.validate()
    return args
