"""Pseudo-gradient compression for the slow link: codecs, error feedback and the adaptive rank.

Pure tensor functions and small stateful objects; nothing here touches torch.distributed or a process group.
The byte layout of every codec is documented in `dilocox.compress.codecs`.
"""

from dilocox.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "dilocox.compress.adaptive": ("AdaptiveCodec", "AdaptiveRank", "RankDecision"),
        "dilocox.compress.codecs": (
            "CastFormat",
            "Codec",
            "ElementwiseCodec",
            "Int4Format",
            "LowRankCodec",
            "ValueFormat",
        ),
        "dilocox.compress.config": (
            "CODEC_KINDS",
            "FACTOR_DTYPES",
            "RANK_RULES",
            "REDUCTIONS",
            "SCALABLE_KINDS",
            "SCHEDULES",
            "SMALL_TENSOR_MODES",
            "CocktailConfig",
            "CompressionConfig",
        ),
        "dilocox.compress.factory": ("build_codec",),
        "dilocox.compress.feedback": ("ErrorFeedback",),
        "dilocox.compress.int4": (
            "decode_int4",
            "decode_int4_runs",
            "dequantize_int4",
            "encode_int4",
            "encode_int4_runs",
            "int4_nbytes",
            "int4_runs_nbytes",
            "pack_int4",
            "quantize_int4",
            "unpack_int4",
        ),
        "dilocox.compress.lowrank": ("Factors", "factorize", "randomized_factors"),
        "dilocox.compress.payload": ("Payload", "compression_ratio"),
        "dilocox.compress.topk": ("TopKCodec",),
    },
)
