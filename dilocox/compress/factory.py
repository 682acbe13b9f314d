"""The codec registry: `compression.kind` -> how to build its codec from a validated `CompressionConfig`.

codec = build_codec(CompressionConfig(kind="lowrank_int4", rank=8), seed=0)
codec = build_codec("lowrank_int4", rank=8)          # the same: keywords are CompressionConfig's fields
payload = codec.encode_list(pseudo_grads)

A new codec is a module and one line of `CODECS` (and its name in `config.CodecKind`, which lists the kinds for the
config's checks and `--help`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from dilocox.compress.adaptive import AdaptiveCodec, AdaptiveRank
from dilocox.compress.codecs import CastFormat, Codec, ElementwiseCodec, Int4Format, LowRankCodec, ValueFormat
from dilocox.compress.config import CompressionConfig
from dilocox.compress.hybrid import HybridCodec
from dilocox.compress.lowbit import LowBitFormat
from dilocox.compress.randk import RandomKCodec
from dilocox.compress.topk import TopKCodec
from dilocox.compress.transform import TransformCodec

_DTYPES = {"none": torch.float32, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _int4(cfg: CompressionConfig, generator: torch.Generator) -> Int4Format:
    return Int4Format(cfg.group_size, generator if cfg.stochastic_rounding else None)


def _small(cfg: CompressionConfig, generator: torch.Generator) -> ValueFormat:
    """How the low-rank codecs send 0-D and 1-D tensors (`compression.small_tensors`)."""
    return _int4(cfg, generator) if cfg.small_tensors == "int4" else CastFormat(torch.float32)


def _cast(cfg: CompressionConfig, generator: torch.Generator, seed: int) -> Codec:
    return ElementwiseCodec(cfg.kind, CastFormat(_DTYPES[cfg.kind]), generator=generator)


def _lowrank(cfg: CompressionConfig, generator: torch.Generator, seed: int) -> Codec:
    factor = _int4(cfg, generator) if cfg.kind == "lowrank_int4" else CastFormat(_DTYPES[cfg.factor_dtype])
    return LowRankCodec(
        cfg.kind,
        rank=cfg.rank,
        factor_format=factor,
        small_format=_small(cfg, generator),
        power_iterations=cfg.power_iterations,
        generator=generator,
    )


def _adaptive(cfg: CompressionConfig, generator: torch.Generator, seed: int) -> Codec:
    return AdaptiveCodec(
        AdaptiveRank(cfg, seed=seed),
        factor_format=_int4(cfg, generator),
        small_format=_small(cfg, generator),
        power_iterations=cfg.power_iterations,
        generator=generator,
    )


def _topk(value_format: Callable[[CompressionConfig, torch.Generator], ValueFormat]) -> Callable[..., Codec]:
    """The builder of a top-k kind whose kept values are written in `value_format`."""

    def build(cfg: CompressionConfig, generator: torch.Generator, seed: int) -> Codec:
        return TopKCodec(
            cfg.kind,
            density=cfg.density,
            chunk_size=cfg.chunk_size,
            value_format=value_format(cfg, generator),
            generator=generator,
        )

    return build


def _randk(bits: int) -> Callable[..., Codec]:
    """The builder of a random-k kind whose values are written in `bits` bits."""

    def build(cfg: CompressionConfig, generator: torch.Generator, seed: int) -> Codec:
        return RandomKCodec(
            cfg.kind,
            density=cfg.density,
            seed=seed,
            value_format=LowBitFormat(bits, cfg.group_size),
            generator=generator,
        )

    return build


CODECS: dict[str, Callable[[CompressionConfig, torch.Generator, int], Codec]] = {
    "none": _cast,
    "fp16": _cast,
    "bf16": _cast,
    "int4": lambda cfg, generator, seed: ElementwiseCodec("int4", _int4(cfg, generator), generator=generator),
    "int2": lambda cfg, generator, seed: ElementwiseCodec("int2", LowBitFormat(2, cfg.group_size), generator=generator),
    "sign": lambda cfg, generator, seed: ElementwiseCodec("sign", LowBitFormat(1, cfg.group_size), generator=generator),
    "lowrank": _lowrank,
    "lowrank_int4": _lowrank,
    "adaptive": _adaptive,
    "topk_int4": _topk(_int4),
    "topk_int2": _topk(lambda cfg, generator: LowBitFormat(2, cfg.group_size)),
    "topk_sign": _topk(lambda cfg, generator: LowBitFormat(1, cfg.group_size)),
    "dct_sign": lambda *args: TransformCodec("dct_sign", inner=CODECS["topk_sign"](*args)),
    "randk_sign": _randk(1),
    "randk_int2": _randk(2),
    "lowrank_topk": lambda cfg, *args: HybridCodec(
        "lowrank_topk",
        first=_lowrank(dataclasses.replace(cfg, kind="lowrank_int4"), *args),
        second=CODECS["topk_sign"](dataclasses.replace(cfg, kind="topk_sign"), *args),
    ),
}
"""Every `compression.kind` -> its builder, called with the validated config, the codec's generator and the run's
seed (the adaptive rank's own draws)."""


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
    return CODECS[cfg.kind](cfg, torch.Generator().manual_seed(seed), seed)
