"""Group-wise absmax int4 quantization and nibble packing: pure tensor functions, no codec state.

One run of `k` values quantized with groups of `g`:
- the values are split, in flattened order, into `ceil(k / g)` groups (the last one may be short);
- each group gets one fp16 scale `s >= absmax / 7`, so every value maps to an integer `q` in [-7, 7]
  (symmetric: the code for -8 is never produced, which keeps a sign flip exact and stochastic rounding unbiased
  at both ends);
- `q` is stored as the 4-bit code `q + 8`; two codes per byte, the first of a pair in the low nibble; an odd `k`
  fills the high nibble of its last byte with 8, the code of 0.

Bytes of one run: `2 * ceil(k / g)` (scales) + `ceil(k / 2)` (codes). Several runs (the factors of every matrix of a
stage) are encoded together, with groups never spanning two runs: first the scales of every run, in order, then
the codes of every run, in order. The size is the sum of the runs' sizes; one batched pass replaces hundreds of
small per-run kernels, which dominate the cost on a CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch

QMAX = 7
"""Largest magnitude of a quantized value: codes cover [-7, 7]."""
ZERO_CODE = 8
"""The code of the value 0; also the padding nibble of an odd-length run."""
_FP16_MAX = torch.finfo(torch.float16).max


def int4_nbytes(numel: int, group_size: int) -> int:
    """Exact bytes of one run of `numel` values quantized with `group_size`: fp16 scales plus packed codes."""
    return 2 * (-(-numel // group_size)) + (numel + 1) // 2


# ----------------------------------------------------------------------------------------------- one run at a time


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (k,) uint8 in [0, 15] -> (ceil(k / 2),) uint8, low nibble first; an odd k pads with ZERO_CODE."""
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_full((1,), ZERO_CODE)])
    pairs = codes.view(-1, 2)  # (ceil(k / 2), 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_int4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The inverse of `pack_int4`: (ceil(numel / 2),) uint8 -> (numel,) uint8 codes in [0, 15]."""
    pairs = torch.stack([packed & 0x0F, packed >> 4], dim=1)  # (ceil(numel / 2), 2)
    return pairs.view(-1)[:numel]


def int4_scales(groups: torch.Tensor) -> torch.Tensor:
    """Scales of (G, g) fp32 groups: (G,) fp16, each >= the group's absmax / 7.

    Rounding the scale *up* to the next fp16 keeps |value / scale| <= 7, so deterministic rounding stays within
    scale / 2 of every value. Scales are capped at the largest fp16 (groups with absmax above 7 * 65504 saturate);
    below 2^-14 (absmax below ~4e-4) fp16 scales are subnormal and coarser, which error feedback absorbs.
    """
    wanted = (groups.abs().amax(dim=1) / QMAX).clamp(max=_FP16_MAX)  # (G,) fp32
    scales = wanted.to(torch.float16)
    rounded_down = scales.to(torch.float32) < wanted
    return torch.where(rounded_down, torch.nextafter(scales, torch.full_like(scales, torch.inf)), scales)


def quantize_groups(
    groups: torch.Tensor, *, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(G, g) fp32 -> codes (G * g,) uint8 in [1, 15] and scales (G,) fp16.

    With a `generator`, rounding is stochastic (floor(x / s + u), u ~ U[0, 1)): unbiased, and reproducible for a
    given generator state. The uniforms are drawn on the CPU so that the same seed gives the same codes on any
    device. Without one, rounding is to nearest (ties to even).
    """
    scales = int4_scales(groups)  # (G,) fp16
    divisor = scales.to(torch.float32)
    divisor = torch.where(divisor == 0, torch.ones_like(divisor), divisor)  # an all-zero group has scale 0
    scaled = groups / divisor[:, None]  # (G, g), within [-7, 7]; updated in place below to spare allocations
    if generator is None:
        scaled.round_()
    else:
        noise = torch.rand(scaled.shape, generator=generator, dtype=torch.float32).to(scaled.device)
        scaled.add_(noise).floor_()
    codes = scaled.clamp_(-QMAX, QMAX).add_(ZERO_CODE).to(torch.uint8)
    return codes.view(-1), scales


def quantize_int4(
    values: torch.Tensor, group_size: int, *, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(k,) fp32 -> codes (k,) uint8 in [1, 15] and scales (ceil(k / g),) fp16 (see `quantize_groups`)."""
    numel = values.numel()
    padded = torch.cat([values.reshape(-1), values.new_zeros(-numel % group_size)])  # zeros keep each absmax
    codes, scales = quantize_groups(padded.view(-1, group_size), generator=generator)
    return codes[:numel], scales


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """Codes (k,) uint8 and scales (ceil(k / g),) fp16 -> (k,) fp32 values."""
    scale_of_value = scales.to(torch.float32).repeat_interleave(group_size)[: codes.numel()]  # (k,)
    return (codes.to(torch.float32) - ZERO_CODE) * scale_of_value


def encode_int4(values: torch.Tensor, group_size: int, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """One run (k,) fp32 -> its bytes (int4_nbytes(k, g),) uint8: fp16 scales, then packed codes."""
    return encode_int4_runs([values], group_size, generator=generator)


def decode_int4(data: torch.Tensor, numel: int, group_size: int) -> torch.Tensor:
    """The inverse of `encode_int4`: (int4_nbytes(numel, g),) uint8 -> (numel,) fp32."""
    return decode_int4_runs(data, [numel], group_size)[0]


# ------------------------------------------------------------------------------------------------ many runs at once

WINDOW = 1 << 20
"""Values quantized per batched pass: large enough that per-kernel overhead vanishes, small enough that the
temporaries are recycled by the allocator instead of page-faulted in afresh (a 10M-value pass at once is 3x
slower on CPU)."""


def int4_runs_nbytes(lengths: Sequence[int], group_size: int) -> int:
    """Exact bytes of runs of `lengths` encoded together: the sum of their `int4_nbytes`."""
    return sum(int4_nbytes(length, group_size) for length in lengths)


def encode_int4_runs(
    runs: Sequence[torch.Tensor], group_size: int, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Runs of fp32 values (any shapes, flattened) -> (int4_runs_nbytes,) uint8: every run's scales, then codes.

    Runs are cut into pieces at multiples of the group size (kept even so that pieces start on a byte), which
    changes neither the groups nor the bytes; pieces are zero-padded to whole groups and quantized WINDOW values
    at a time, and only the scales and code bytes of real values are sent.
    """
    block = group_size if group_size % 2 == 0 else 2 * group_size
    piece_limit = max(block, WINDOW // block * block)
    sent_scales: list[torch.Tensor] = []
    sent_codes: list[torch.Tensor] = []
    window: list[torch.Tensor] = []
    window_size = 0
    for run in runs:
        flat = run.reshape(-1)
        for start in range(0, flat.numel(), piece_limit):
            piece = flat[start : start + piece_limit]
            window.append(piece)
            window_size += piece.numel() + -piece.numel() % block
            if window_size >= WINDOW:
                _encode_window(window, group_size, block, generator, sent_scales, sent_codes)
                window, window_size = [], 0
    if window:
        _encode_window(window, group_size, block, generator, sent_scales, sent_codes)
    if not sent_scales:
        return torch.empty(0, dtype=torch.uint8, device=runs[0].device if runs else None)
    return torch.cat([torch.cat(sent_scales).view(torch.uint8), *sent_codes])


def _encode_window(
    pieces: list[torch.Tensor],
    group_size: int,
    block: int,
    generator: torch.Generator | None,
    sent_scales: list[torch.Tensor],
    sent_codes: list[torch.Tensor],
) -> None:
    pads = [-piece.numel() % block for piece in pieces]
    zeros = pieces[0].new_zeros(max(pads))
    padded = torch.cat([part for piece, pad in zip(pieces, pads, strict=True) for part in (piece, zeros[:pad])])
    codes, scales = quantize_groups(padded.view(-1, group_size), generator=generator)  # (W,), (W / g,)
    packed = pack_int4(codes)  # (W / 2,)
    offset = 0
    for piece, pad in zip(pieces, pads, strict=True):
        length = piece.numel()
        sent_scales.append(scales[offset // group_size : offset // group_size + -(-length // group_size)])
        sent_codes.append(packed[offset // 2 : offset // 2 + (length + 1) // 2])
        offset += length + pad


@lru_cache(maxsize=32)
def _decode_plan(lengths: tuple[int, ...], group_size: int) -> tuple[torch.Tensor, list[tuple[int, int, int, int]]]:
    """Codes per sent scale (a run's pad nibble counts in its last group) and the decode windows.

    A window is (first scale, end scale, first code, end code), cut at group boundaries where the code count is
    even so that it starts on a byte. Cached: the lengths repeat every round for a fixed-rank codec.
    """
    counts: list[int] = []
    for length in lengths:
        full, rest = divmod(length, group_size)
        counts.extend([group_size] * full)
        if rest:
            counts.append(rest)
        if length % 2:
            counts[-1] += 1
    windows: list[tuple[int, int, int, int]] = []
    first_scale = first_code = code = 0
    for index, count in enumerate(counts):
        code += count
        if (code - first_code >= WINDOW and code % 2 == 0) or index + 1 == len(counts):
            windows.append((first_scale, index + 1, first_code, code))
            first_scale, first_code = index + 1, code
    return torch.tensor(counts, dtype=torch.int64), windows


def decode_int4_runs(data: torch.Tensor, lengths: Sequence[int], group_size: int) -> list[torch.Tensor]:
    """The inverse of `encode_int4_runs`: (int4_runs_nbytes,) uint8 -> one (k,) fp32 tensor per run length."""
    lengths = tuple(lengths)
    counts, windows = _decode_plan(lengths, group_size)
    counts = counts.to(data.device)
    num_scales = counts.numel()
    scales = data[: 2 * num_scales].clone().view(torch.float16).to(torch.float32)  # clone: an aligned fp16 view
    packed = data[2 * num_scales :]
    values = torch.empty(sum(length + length % 2 for length in lengths), device=data.device)  # pad nibbles too
    for first_scale, end_scale, first_code, end_code in windows:
        codes = unpack_int4(packed[first_code // 2 : end_code // 2], end_code - first_code).to(torch.float32)
        scale_of_code = scales[first_scale:end_scale].repeat_interleave(
            counts[first_scale:end_scale], output_size=end_code - first_code
        )
        torch.mul(codes.sub_(ZERO_CODE), scale_of_code, out=values[first_code:end_code])
    parts = torch.split(values, [length + length % 2 for length in lengths])
    return [part[:length] for part, length in zip(parts, lengths, strict=True)]
