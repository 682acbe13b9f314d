"""Qwen/Llama-style decoder-only transformer, its named flavors, and parameter counting (no torch.distributed)."""

from dilocox.models.decoder import (
    Attention,
    Decoder,
    FeedForward,
    ModelArgs,
    RMSNorm,
    TransformerBlock,
    apply_rope,
    count_parameters,
    rope_tables,
)
from dilocox.models.flavors import FIXED_VOCAB_FLAVORS, FLAVORS, REFERENCE_VOCAB_SIZE, list_flavors, model_args

__all__ = [
    "FIXED_VOCAB_FLAVORS",
    "FLAVORS",
    "REFERENCE_VOCAB_SIZE",
    "Attention",
    "Decoder",
    "FeedForward",
    "ModelArgs",
    "RMSNorm",
    "TransformerBlock",
    "apply_rope",
    "count_parameters",
    "list_flavors",
    "model_args",
    "rope_tables",
]
