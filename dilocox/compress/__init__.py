"""Pseudo-gradient compression for the slow link: codecs, error feedback and the adaptive rank.

Pure tensor functions and small stateful objects; nothing here touches torch.distributed or a process group.
The byte layout of every codec is documented in `dilocox.compress.codecs`.
"""

from dilocox.compress.adaptive import AdaptiveCodec, AdaptiveRank, RankDecision
from dilocox.compress.codecs import CastFormat, Codec, ElementwiseCodec, Int4Format, LowRankCodec, ValueFormat
from dilocox.compress.config import (
    CODEC_KINDS,
    FACTOR_DTYPES,
    RANK_RULES,
    REDUCTIONS,
    SCALABLE_KINDS,
    SCHEDULES,
    SMALL_TENSOR_MODES,
    CocktailConfig,
    CompressionConfig,
)
from dilocox.compress.factory import build_codec
from dilocox.compress.feedback import ErrorFeedback
from dilocox.compress.int4 import (
    decode_int4,
    decode_int4_runs,
    dequantize_int4,
    encode_int4,
    encode_int4_runs,
    int4_nbytes,
    int4_runs_nbytes,
    pack_int4,
    quantize_int4,
    unpack_int4,
)
from dilocox.compress.lowrank import Factors, factorize, randomized_factors
from dilocox.compress.payload import Payload, compression_ratio
from dilocox.compress.topk import TopKCodec

__all__ = [
    "RANK_RULES",
    "CODEC_KINDS",
    "FACTOR_DTYPES",
    "REDUCTIONS",
    "SCALABLE_KINDS",
    "SCHEDULES",
    "SMALL_TENSOR_MODES",
    "AdaptiveCodec",
    "AdaptiveRank",
    "CastFormat",
    "CocktailConfig",
    "Codec",
    "CompressionConfig",
    "ElementwiseCodec",
    "ErrorFeedback",
    "Factors",
    "Int4Format",
    "LowRankCodec",
    "Payload",
    "RankDecision",
    "TopKCodec",
    "ValueFormat",
    "build_codec",
    "compression_ratio",
    "decode_int4",
    "decode_int4_runs",
    "dequantize_int4",
    "encode_int4",
    "encode_int4_runs",
    "factorize",
    "int4_nbytes",
    "int4_runs_nbytes",
    "pack_int4",
    "quantize_int4",
    "randomized_factors",
    "unpack_int4",
]
