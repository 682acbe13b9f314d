"""`[compression]`: how pseudo-gradients are encoded for the slow link, owned and validated here.

The allowed values of every option live in this module and nowhere else; the codec factory (`factory.py`), the
adaptive rank (`adaptive.py`) and the reducers (`dilocox/sync/reducers.py`) read a validated `CompressionConfig`.

    cfg = CompressionConfig(kind="lowrank_int4", rank=8)
    cfg.validate()                                   # ValueError naming compression.<field> and the fix
    codec = build_codec(cfg, seed=0)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from dilocox.checks import check_fraction, check_positive, check_types

CodecKind = Literal[
    "none",
    "fp16",
    "bf16",
    "int4",
    "int2",
    "sign",
    "lowrank",
    "lowrank_int4",
    "adaptive",
    "topk_int4",
    "topk_int2",
    "topk_sign",
    "dct_sign",
    "randk_sign",
    "randk_int2",
    "lowrank_topk",
]
"""Every `compression.kind` (built by `factory.CODECS`); `none` sends fp32 (the uncompressed outer sync)."""
CODEC_KINDS: tuple[str, ...] = get_args(CodecKind)
SPARSE_KINDS = ("topk_int4", "topk_int2", "topk_sign", "dct_sign", "randk_sign", "randk_int2", "lowrank_topk")
"""The kinds that send a share of the values (`compression.density`; the top-k ones per chunk of `chunk_size`)."""
DRAIN_KINDS = {"topk_int2": "int2", "randk_int2": "int2", "topk_sign": "sign", "dct_sign": "sign", "randk_sign": "sign"}
"""The dense codec that drains the residual at the end (`sync.drain_residual`) for a codec whose values are 1 or 2
bits: their own width; int4 for every other codec."""


FactorDtype = Literal["fp32", "fp16", "bf16"]
"""Encodings of the `lowrank` codec's factors (`lowrank_int4` and `adaptive` always use int4)."""
FACTOR_DTYPES: tuple[str, ...] = get_args(FactorDtype)
SmallTensorMode = Literal["raw", "int4"]
"""How the low-rank codecs send 0-D and 1-D tensors."""
SMALL_TENSOR_MODES: tuple[str, ...] = get_args(SmallTensorMode)
RankSchedule = Literal["spectrum", "early_strong", "late_strong"]
"""How the adaptive rank's energy target moves over rounds (see `AdaptiveRank.target_energy`)."""
SCHEDULES: tuple[str, ...] = get_args(RankSchedule)
RankRule = Literal["per_matrix", "budget", "pooled", "mean", "max"]
"""How the adaptive rank turns the spectra of several matrices into ranks: each its own (from its own energy, or
together from the pooled energy at the fewest values sent), or one for all."""
RANK_RULES: tuple[str, ...] = get_args(RankRule)
SpectrumSource = Literal["pseudo_grad", "codec_input"]
"""Whose spectrum the adaptive rank measures: the raw pseudo-gradient, or it plus the error-feedback residual."""
Reduction = Literal["gather", "scalable"]
"""Averaging of payloads over clusters: gather ((C-1) x payload per rank, any codec) or scalable (~2 x payload)."""
REDUCTIONS: tuple[str, ...] = get_args(Reduction)
SCALABLE_KINDS = ("fp16", "bf16", "int4", "lowrank", "lowrank_int4")
"""The codecs the scalable reduction can average (one rank that every cluster agrees on beforehand)."""
MAX_RANK = (1 << 16) - 1
"""The largest rank the low-rank payload's 2-byte (uint16) rank header can carry."""


@dataclass
class CompressionConfig:
    kind: CodecKind = "none"
    """Pseudo-gradient codec; none sends fp32 (the bytes of every kind: docs/design.md §4.1)."""
    rank: int = 8
    """Factors per matrix of lowrank, lowrank_int4 and lowrank_topk."""
    group_size: int = 64
    """Values per fp16 scale in int4 encodings and of the 1- and 2-bit values (topk_int2/_sign, dct_sign, randk)."""
    stochastic_rounding: bool = False
    """Round int4 values stochastically (unbiased) instead of to nearest (no effect on 1- and 2-bit values)."""
    error_feedback: bool = True
    """Add what the codec lost to the next round's pseudo-gradient."""
    feedback_decay: float = 1.0
    """Scale the error-feedback residual by this before adding it (1 keeps it whole: best with sync.local_residual)."""
    factor_dtype: FactorDtype = "fp32"
    """lowrank: encoding of the factors, fp32, fp16 or bf16 (lowrank_int4 and adaptive use int4)."""
    small_tensors: SmallTensorMode = "raw"
    """Low-rank kinds: how 0-D/1-D tensors (norms, biases) are sent, raw (fp32) or int4."""
    power_iterations: int = 2
    """Low-rank kinds: subspace iterations per round, warm-started (compute only; docs/design.md §4.1)."""
    rank_min: int = 2
    """adaptive: the smallest rank it may choose."""
    rank_max: int = 32
    """adaptive: the largest rank it may choose."""
    # 0.95: with the eager merge, over 3 seeds of 30 rounds, +7.55% to AllReduce at 1/570 of its bytes, against
    # +8.13% at 1/708 for 0.9 (benchmarks/results/eager_adaptive/, docs/design.md §4.2)
    energy: float = 0.95
    """adaptive: share of the pseudo-gradient's spectral energy the chosen rank keeps."""
    energy_floor: float = 0.5
    """adaptive: the energy target at the strongest compression of early_strong / late_strong."""
    window: int = 4
    """adaptive: rounds over which the chosen rank is smoothed."""
    schedule: RankSchedule = "spectrum"
    """adaptive: spectrum (energy as set), early_strong or late_strong (energy target ramps up or down)."""
    ramp_rounds: int = 100
    """adaptive: rounds over which early_strong / late_strong ramp the energy target."""
    rank_rule: RankRule = "per_matrix"
    """adaptive: per_matrix (own energy each), budget (pooled energy, fewest values) or one rank: pooled, mean, max."""
    spectrum_of: SpectrumSource = "pseudo_grad"
    """adaptive: the rank keeps energy of the pseudo_grad's own spectrum, or of codec_input (plus the residual)."""
    # 0.075 with compression.feedback_decay = 0.9: 1/43 of fp32 per round; at H = 12 on the gap protocol 1/515 of
    # AllReduce's bytes and +4.32 +- 0.10% from its loss (benchmarks/results/eager_adaptive/, docs/design.md §4.1)
    density: float = 0.075
    """Sparse kinds: share of the values sent (topk, dct: each chunk's largest, with positions; randk: drawn alike)."""
    chunk_size: int = 4096
    """topk kinds: values per chunk, each keeping its own top share (positions: about 2 + log2(1 / density) bits)."""
    reduction: Reduction = "gather"
    """Averaging of payloads: gather ((C-1) x payload per rank, any codec) or scalable (~2 x payload; not adaptive)."""

    def validate(self) -> None:
        """Raise ValueError naming the first impossible setting of `[compression]` and how to fix it."""
        check_types("compression", self)  # also every choice: kind, factor_dtype, ..., reduction
        check_positive("compression", self, "rank", "group_size", "power_iterations", "rank_min", "window")
        check_positive("compression", self, "ramp_rounds", "chunk_size")
        check_fraction("compression.feedback_decay", self.feedback_decay, low=0.0, high=1.0, fix="1 keeps it whole")
        check_fraction("compression.density", self.density, low=0.0, high=1.0, fix="e.g. 0.075 of every chunk's values")
        for name in ("rank", "rank_max"):
            if getattr(self, name) > MAX_RANK:
                raise ValueError(
                    f"compression.{name} = {getattr(self, name)} must be <= {MAX_RANK} (the rank header is 16 bits)"
                )
        if self.rank_max < self.rank_min:
            raise ValueError(
                f"compression.rank_max = {self.rank_max} is below compression.rank_min = {self.rank_min}; "
                "raise rank_max or lower rank_min"
            )
        check_fraction("compression.energy", self.energy, low=0.0, high=1.0, fix="e.g. 0.9 of the spectral energy")
        check_fraction(
            "compression.energy_floor",
            self.energy_floor,
            low=0.0,
            high=self.energy,
            fix=f"it is the target at the strongest compression, at most compression.energy = {self.energy}",
        )


def drain_config(cfg: CompressionConfig) -> CompressionConfig:
    """The codec of the drained residual: every value, dense, at the width of `cfg`'s values, without error feedback."""
    return CompressionConfig(kind=DRAIN_KINDS.get(cfg.kind, "int4"), error_feedback=False, group_size=cfg.group_size)


@dataclass
class CocktailConfig:
    sample_ratio: float = 0.1
    """Share of the gradient randomly sampled each step (the same sample on every cluster)."""
    topk_ratio: float = 0.01
    """Share of the gradient sent each step (the largest of the sample), as int4 values with positions."""
    group_size: int = 64
    """Values per fp16 scale of the int4 values."""
    error_feedback: bool = True
    """Add what a step did not send to the next step's gradient."""

    def validate(self) -> None:
        """Raise ValueError naming the first impossible setting of `[cocktail]` and how to fix it."""
        check_types("cocktail", self)
        check_fraction("cocktail.sample_ratio", self.sample_ratio, low=0.0, high=1.0, fix="e.g. 0.1")
        check_fraction("cocktail.topk_ratio", self.topk_ratio, low=0.0, high=1.0, fix="e.g. 0.01")
        if self.topk_ratio > self.sample_ratio:
            raise ValueError(
                f"cocktail.topk_ratio = {self.topk_ratio!r} must be <= cocktail.sample_ratio = {self.sample_ratio!r}: "
                "the top-k values are chosen inside the random sample; lower topk_ratio or raise sample_ratio"
            )
        check_positive("cocktail", self, "group_size")
