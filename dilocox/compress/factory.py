"""The codec factory: a validated `CompressionConfig` -> the codec it names.

codec = build_codec(CompressionConfig(kind="lowrank_int4", rank=8), seed=0)
codec = build_codec("lowrank_int4", rank=8)          # the same: keywords are CompressionConfig's fields
payload = codec.encode_list(pseudo_grads)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from dilocox.compress.adaptive import AdaptiveCodec, AdaptiveRank
from dilocox.compress.codecs import CastFormat, Codec, ElementwiseCodec, Int4Format, LowRankCodec
from dilocox.compress.config import CompressionConfig
from dilocox.compress.topk import TopKCodec

_DTYPES = {"none": torch.float32, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def build_codec(cfg: CompressionConfig | str, *, seed: int = 0, **options: Any) -> Codec:
    """The codec of `cfg.kind` (validated here); options that do not apply to that kind are ignored.

    `cfg` may be a kind's name with `CompressionConfig` fields as keywords.

    `none` gives the fp32 identity codec (bit-exact), which the reducers use only when asked to compare against it:
    `compression.kind = "none"` averages uncompressed without a codec at all (`DenseReducer`)."""
    if isinstance(cfg, str):
        known = {f.name for f in dataclasses.fields(CompressionConfig)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"unknown compression option(s) {', '.join(unknown)}; options are: {', '.join(sorted(known))}"
            )
        cfg = CompressionConfig(kind=cfg, **options)
    elif options:
        raise ValueError("pass the options inside the CompressionConfig, not as keywords beside it")
    cfg.validate()
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"run.seed = {seed!r} must be an integer >= 0")
    # One CPU generator per codec, shared by its int4 rounding and its random warm starts: reproducible from the
    # seed, saved in state_dict, and never the global RNG that training's reproducibility depends on.
    generator = torch.Generator().manual_seed(seed)
    int4 = Int4Format(cfg.group_size, generator if cfg.stochastic_rounding else None)
    small = int4 if cfg.small_tensors == "int4" else CastFormat(torch.float32)
    if cfg.kind in ("none", "fp16", "bf16"):
        return ElementwiseCodec(cfg.kind, CastFormat(_DTYPES[cfg.kind]), generator=generator)
    if cfg.kind == "int4":
        return ElementwiseCodec(cfg.kind, int4, generator=generator)
    if cfg.kind == "topk_int4":
        return TopKCodec(density=cfg.density, chunk_size=cfg.chunk_size, value_format=int4, generator=generator)
    if cfg.kind == "adaptive":
        return AdaptiveCodec(
            AdaptiveRank(cfg, seed=seed),
            factor_format=int4,
            small_format=small,
            power_iterations=cfg.power_iterations,
            generator=generator,
        )
    factor = int4 if cfg.kind == "lowrank_int4" else CastFormat(_DTYPES[cfg.factor_dtype])
    return LowRankCodec(
        cfg.kind,
        rank=cfg.rank,
        factor_format=factor,
        small_format=small,
        power_iterations=cfg.power_iterations,
        generator=generator,
    )
