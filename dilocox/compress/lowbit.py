"""Values in 1 or 2 bits with a least-squares scale per group: the values of the sparse codecs below int4.

After SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706: top-k with 2-bit values and error feedback) and DeMo / DisTrO
(Peng et al. 2024, arXiv 2411.19870: signs of the kept coefficients). One run of `k` values with groups of `g` (as
int4: in flattened order, `ceil(k / g)` groups, the last one may be short), each group with one fp16 scale `s`:
- 1 bit: a value is its sign times `s`, and `s` is the group's mean |x| (the least-squares scale of sign codes); code
  1 is `+s` (a zero is sent as `+s`), code 0 is `-s`;
- 2 bits: a value is the nearest of `-3s, -s, s, 3s` (codes 0 to 3); `s` starts at the group's mean |x| / 2 and is
  fitted by least squares to the codes twice (assign, fit, assign, fit), so it is the best scale of the codes sent.
A zero group gets the scale 0 and decodes to zeros. Error feedback (`ErrorFeedback`) keeps what the two or four
levels miss.

Byte layout of a section of runs (the runs of one `encode_runs` call), with `K` their values in all and `G` their
groups: the `G` fp16 scales, run by run, then the `K` codes as one bit stream (each code's lowest bit first, bit j
of byte b is stream bit 8 b + j), padded once at the end to a whole byte: `2 G + ceil(bits K / 8)` bytes. One run
alone: `2 ceil(k / g) + ceil(bits k / 8)`.

    fmt = LowBitFormat(bits=1, group_size=64)
    data = fmt.encode_runs([a, b])                   # (fmt.section_nbytes([a.numel(), b.numel()]),) uint8
    a2, b2 = fmt.decode_runs(ByteReader(data), [a.numel(), b.numel()])   # flat fp32
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch

from dilocox.compress.codecs import ValueFormat
from dilocox.compress.elias_fano import pack_bits, unpack_bits
from dilocox.compress.payload import ByteReader, tensor_bytes

LEVELS = {1: (-1.0, 1.0), 2: (-3.0, -1.0, 1.0, 3.0)}
"""The values of the codes 0, 1, ... in units of the group's scale."""
_FP16_MAX = torch.finfo(torch.float16).max


@lru_cache(maxsize=32)
def _groups(lengths: tuple[int, ...], group_size: int) -> tuple[torch.Tensor, int]:
    """The group of every value of runs of `lengths` ((K,) int64) and the number of groups. Cached: a codec's
    lengths repeat every round."""
    ids: list[torch.Tensor] = []
    first = 0
    for length in lengths:
        ids.append(first + torch.arange(length, dtype=torch.int64) // group_size)
        first += -(-length // group_size)
    return (torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64)), first


class LowBitFormat(ValueFormat):
    """Values as 1-bit signs or 2-bit levels (`bits`), one fp16 least-squares scale per group of `group_size`.

    fmt = LowBitFormat(bits=2, group_size=64)
    data = fmt.encode_runs([values])                 # (2 ceil(k / 64) + ceil(2 k / 8),) uint8
    (values,) = fmt.decode_runs(ByteReader(data), [k])
    """

    def __init__(self, bits: int, group_size: int) -> None:
        assert bits in LEVELS and group_size >= 1, (bits, group_size)
        self.bits = bits
        self.group_size = group_size
        self.name = "sign" if bits == 1 else f"int{bits}"

    def nbytes(self, numel: int) -> int:
        return self.section_nbytes([numel])

    def section_nbytes(self, lengths: Sequence[int]) -> int:
        groups = sum(-(-length // self.group_size) for length in lengths)
        return 2 * groups + -(-self.bits * sum(lengths) // 8)

    def encode_runs(self, runs: Sequence[torch.Tensor]) -> torch.Tensor:
        flat = torch.cat([run.reshape(-1) for run in runs]) if runs else torch.zeros(0)  # (K,) fp32
        ids, num_groups = _groups(tuple(run.numel() for run in runs), self.group_size)
        ids = ids.to(flat.device)
        magnitude = flat.abs()
        counts = torch.zeros(num_groups, device=flat.device).index_add_(0, ids, torch.ones_like(flat))
        scale = torch.zeros(num_groups, device=flat.device).index_add_(0, ids, magnitude) / counts.clamp(min=1)
        level = torch.ones_like(flat)  # |level| of every value: 1, or 3 (2 bits)
        if self.bits == 2:
            scale /= 2  # the mean |x| falls between the levels s and 3s
            for _ in range(2):  # assign to the nearest level, then the least-squares scale of those levels
                level = torch.where(magnitude > 2 * scale[ids], 3.0, 1.0)
                fit = torch.zeros(num_groups, device=flat.device).index_add_(0, ids, magnitude * level)
                scale = fit / torch.zeros(num_groups, device=flat.device).index_add_(0, ids, level * level)
        negative = flat < 0
        if self.bits == 1:
            codes = (~negative).to(torch.int64)  # 0: -s, 1: +s
        else:
            outer = (level == 3).to(torch.int64)
            codes = torch.where(negative, 1 - outer, 2 + outer)  # 0: -3s, 1: -s, 2: s, 3: 3s
        shifts = torch.arange(self.bits, device=flat.device)
        bits = ((codes.unsqueeze(1) >> shifts) & 1).to(torch.uint8).reshape(-1)  # (bits K,)
        scales = tensor_bytes(scale.clamp(max=_FP16_MAX).to(torch.float16))
        return torch.cat([scales, pack_bits(bits)])

    def decode_runs(self, reader: ByteReader, lengths: Sequence[int]) -> list[torch.Tensor]:
        ids, num_groups = _groups(tuple(lengths), self.group_size)
        scale = reader.read(torch.float16, num_groups).to(torch.float32)
        total = sum(lengths)
        bits = unpack_bits(reader.take(-(-self.bits * total // 8)), self.bits * total).view(total, self.bits)
        codes = (bits.to(torch.int64) << torch.arange(self.bits, device=bits.device)).sum(1)  # (K,)
        levels = torch.tensor(LEVELS[self.bits], device=bits.device)
        values = levels[codes] * scale[ids.to(bits.device)]
        return list(torch.split(values, list(lengths)))
