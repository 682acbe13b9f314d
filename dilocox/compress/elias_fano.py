"""Position codes for the sorted positions a sparse codec keeps inside fixed-size chunks: Elias-Fano, or plain
fixed-width positions where those are shorter.

`count` distinct positions in `[0, universe)`, sorted ascending. Elias-Fano, with `l = floor(log2(universe /
count))` (0 when `count > universe / 2`):
- low part: each position's `l` lowest bits, position after position, lowest bit first;
- high part: a bitmap of `count + ((universe - 1) >> l) + 1` bits with bit `(p_i >> l) + i` set for the i-th
  position (a unary code of the gaps between the high parts);
`ef(universe, count) = count l + count + ((universe - 1) >> l) + 1` bits, about `2 + log2(universe / count)` a
position: 5.7 for 307 of 4096, against 12 for a plain 12-bit position (Elias 1974, Fano 1971; Vigna 2013,
"Quasi-succinct indices", for the bound). For a few positions in a chunk (one to three) the plain code is shorter:
`count w` bits with `w = bit_length(universe - 1)` bits per position, each lowest bit first (a chunk of one value
needs none). A chunk takes whichever is shorter, Elias-Fano on a tie:

`nbits(universe, count) = min(ef(universe, count), count w)`, fixed by the two numbers, so the receiver knows which
code a chunk uses and where it ends before reading it. One of 64 takes 6 bits (Elias-Fano: 8), 64 of 4096 take 8.

Chunks of one size and count are coded as rows of one tensor, every chunk's code after the other (Elias-Fano: its
low part then its high part); bit streams become bytes with `pack_bits` (bit j of byte b is stream bit 8 b + j):

    bits = encode(positions, universe=4096)          # positions: (rows, count) int64, ascending in each row
    data = pack_bits(bits)                           # (ceil(rows nbits / 8),) uint8
    positions = decode(unpack_bits(data, bits.numel()), rows, universe=4096, count=count)
"""

from __future__ import annotations

import torch


def low_width(universe: int, count: int) -> int:
    """`l`: the bits of each position sent as they are, floor(log2(universe / count)) (0 when count > universe/2)."""
    assert 1 <= count <= universe, (count, universe)
    return (universe // count).bit_length() - 1


def ef_nbits(universe: int, count: int) -> int:
    """Bits of one chunk's Elias-Fano code: count l + count + ((universe - 1) >> l) + 1."""
    width = low_width(universe, count)
    return count * width + count + ((universe - 1) >> width) + 1


def plain_width(universe: int) -> int:
    """Bits of one plain position in [0, universe): bit_length(universe - 1), 0 for a universe of one."""
    return (universe - 1).bit_length()


def is_plain(universe: int, count: int) -> bool:
    """Whether a chunk's positions go as plain fixed-width numbers, shorter than their Elias-Fano code."""
    return count * plain_width(universe) < ef_nbits(universe, count)


def nbits(universe: int, count: int) -> int:
    """Bits of one chunk's code: the shorter of Elias-Fano and plain positions (0 when count is 0)."""
    if count == 0:
        return 0
    return count * plain_width(universe) if is_plain(universe, count) else ef_nbits(universe, count)


def _bits_lsb_first(values: torch.Tensor, width: int) -> torch.Tensor:
    """(rows, k) int64 -> (rows, k width) uint8 bits, each value's lowest bit first."""
    shifts = torch.arange(width, device=values.device)
    return ((values.unsqueeze(-1) >> shifts) & 1).to(torch.uint8).flatten(1)


def encode(positions: torch.Tensor, *, universe: int) -> torch.Tensor:
    """(rows, count) int64 positions, strictly ascending in each row and in [0, universe) -> the rows' codes back
    to back: (rows nbits(universe, count),) uint8, one bit per element."""
    rows, count = positions.shape
    if count == 0:
        return torch.zeros(0, dtype=torch.uint8, device=positions.device)
    if is_plain(universe, count):
        return _bits_lsb_first(positions, plain_width(universe)).reshape(-1)
    width = low_width(universe, count)
    low = _bits_lsb_first(positions & ((1 << width) - 1), width)  # (rows, count width)
    high = torch.zeros(rows, count + ((universe - 1) >> width) + 1, dtype=torch.uint8, device=positions.device)
    high.scatter_(1, (positions >> width) + torch.arange(count, device=positions.device), 1)
    return torch.cat([low, high], dim=1).reshape(-1)


def decode(bits: torch.Tensor, rows: int, *, universe: int, count: int) -> torch.Tensor:
    """The inverse of `encode`: (rows nbits,) uint8 bits -> (rows, count) int64 positions. Raises ValueError for a
    code that no ascending positions in [0, universe) produce (a corrupt payload or other compression settings)."""
    if count == 0:
        return torch.zeros(rows, 0, dtype=torch.int64, device=bits.device)
    codes = bits.view(rows, nbits(universe, count))
    if is_plain(universe, count):
        return _check(_numbers(codes, count, plain_width(universe)), universe)
    width = low_width(universe, count)
    low = _numbers(codes[:, : count * width], count, width)  # (rows, count)
    high = codes[:, count * width :]  # (rows, count + (universe - 1 >> width) + 1)
    if bool((high.sum(1, dtype=torch.int64) != count).any()):
        raise ValueError(
            f"an Elias-Fano code does not hold {count} positions per chunk of {universe}; sender and receiver must "
            "use the same compression settings and tensor shapes"
        )
    set_bits = high.nonzero()[:, 1].view(rows, count)  # row-major: ascending inside each row
    return _check(((set_bits - torch.arange(count, device=bits.device)) << width) | low, universe)


def _numbers(codes: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """(rows, count width) bits, each number's lowest bit first -> (rows, count) int64."""
    weights = 1 << torch.arange(width, device=codes.device)
    return (codes.reshape(codes.shape[0], count, width).to(torch.int64) * weights).sum(-1)


def _check(positions: torch.Tensor, universe: int) -> torch.Tensor:
    """Decoded positions (rows, count), refused unless ascending in [0, universe) (a corrupt payload or other
    compression settings)."""
    if bool((positions >= universe).any()) or bool((positions.diff(dim=1) <= 0).any()):
        raise ValueError(
            f"a position code names positions outside [0, {universe}) or out of order; sender and receiver must "
            "use the same compression settings and tensor shapes"
        )
    return positions


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """(n,) uint8 bits -> (ceil(n / 8),) uint8 bytes, bit j of byte b = bit 8 b + j (zeros pad the last byte)."""
    padded = torch.cat([bits, bits.new_zeros(-bits.numel() % 8)]).view(-1, 8).to(torch.int32)
    return (padded << torch.arange(8, device=bits.device, dtype=torch.int32)).sum(1).to(torch.uint8)


def unpack_bits(data: torch.Tensor, count: int) -> torch.Tensor:
    """The inverse of `pack_bits`: (ceil(count / 8),) uint8 -> its first `count` bits, (count,) uint8."""
    shifts = torch.arange(8, device=data.device, dtype=torch.uint8)
    return ((data.unsqueeze(1) >> shifts) & 1).reshape(-1)[:count]
