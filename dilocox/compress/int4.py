"""Group-wise absmax int4 quantization and nibble packing: pure tensor functions, no codec state.

Layout of `k` values quantized with groups of `g`:
- the values are split, in flattened order, into `ceil(k / g)` groups (the last one may be short);
- each group gets one fp16 scale `s >= absmax / 7`, so every value maps to an integer `q` in [-7, 7]
  (symmetric: the code -8 is never produced, which keeps a sign flip exact and rounding unbiased at both ends);
- `q` is stored as the 4-bit code `q + 8` in [1, 15]; two codes per byte, the first value of a pair in the low
  nibble; an odd `k` leaves the high nibble of the last byte 0.

Bytes: `2 * ceil(k / g)` (scales) + `ceil(k / 2)` (codes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

QMAX = 7
"""Largest magnitude of a quantized value: codes cover [-7, 7]."""
_CODE_OFFSET = 8
_FP16_MAX = torch.finfo(torch.float16).max


def int4_nbytes(numel: int, group_size: int) -> int:
    """Exact bytes of `numel` values quantized with `group_size`: fp16 scales plus packed codes."""
    return 2 * (-(-numel // group_size)) + (numel + 1) // 2


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (k,) uint8 in [0, 15] -> (ceil(k / 2),) uint8, low nibble first; an odd k pads with 0."""
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    pairs = codes.view(-1, 2)  # (ceil(k / 2), 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_int4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The inverse of `pack_int4`: (ceil(numel / 2),) uint8 -> (numel,) uint8 codes in [0, 15]."""
    pairs = torch.stack([packed & 0x0F, packed >> 4], dim=1)  # (ceil(numel / 2), 2)
    return pairs.view(-1)[:numel]


def int4_scales(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per-group fp16 scales of (k,) fp32 `values`: (ceil(k / g),) fp16, each >= the group's absmax / 7.

    Rounding the scale *up* to the next fp16 keeps |value / scale| <= 7, so deterministic rounding stays within
    scale / 2 of every value. Scales are capped at the largest fp16 (groups with absmax above 7 * 65504 saturate).
    """
    groups = _grouped(values, group_size)  # (G, g)
    wanted = (groups.abs().amax(dim=1) / QMAX).clamp(max=_FP16_MAX)  # (G,) fp32
    scales = wanted.to(torch.float16)
    rounded_down = scales.to(torch.float32) < wanted
    return torch.where(rounded_down, torch.nextafter(scales, torch.full_like(scales, torch.inf)), scales)


def quantize_int4(
    values: torch.Tensor, group_size: int, *, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(k,) fp32 -> codes (k,) uint8 in [1, 15] and scales (ceil(k / g),) fp16.

    With a `generator`, rounding is stochastic (floor(x / s + u), u ~ U[0, 1)): unbiased, and reproducible for a
    given generator state. The uniforms are drawn on the CPU so that the same seed gives the same codes on any
    device. Without one, rounding is to nearest (ties to even).
    """
    numel = values.numel()
    scales = int4_scales(values, group_size)  # (G,) fp16
    groups = _grouped(values, group_size)  # (G, g)
    scales32 = scales.to(torch.float32)
    divisor = torch.where(scales32 == 0, torch.ones_like(scales32), scales32)  # an all-zero group has scale 0
    scaled = groups / divisor[:, None]  # (G, g), within [-7, 7]
    if generator is None:
        rounded = torch.round(scaled)
    else:
        noise = torch.rand(scaled.shape, generator=generator, dtype=torch.float32).to(scaled.device)
        rounded = torch.floor(scaled + noise)
    codes = (rounded.clamp(-QMAX, QMAX) + _CODE_OFFSET).to(torch.uint8)
    return codes.view(-1)[:numel], scales


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """Codes (k,) uint8 and scales (ceil(k / g),) fp16 -> (k,) fp32 values."""
    numel = codes.numel()
    values = _grouped(codes.to(torch.float32) - _CODE_OFFSET, group_size)  # (G, g)
    return (values * scales.to(torch.float32)[:, None]).view(-1)[:numel]


def encode_int4(values: torch.Tensor, group_size: int, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """(k,) fp32 -> the wire bytes (int4_nbytes(k, g),) uint8: fp16 scales, then packed codes."""
    codes, scales = quantize_int4(values, group_size, generator=generator)
    return torch.cat([scales.view(torch.uint8), pack_int4(codes)])


def decode_int4(data: torch.Tensor, numel: int, group_size: int) -> torch.Tensor:
    """The inverse of `encode_int4`: (int4_nbytes(numel, g),) uint8 -> (numel,) fp32."""
    num_scale_bytes = 2 * (-(-numel // group_size))
    scales = data[:num_scale_bytes].clone().view(torch.float16)  # clone: an aligned start for the fp16 view
    codes = unpack_int4(data[num_scale_bytes:], numel)
    return dequantize_int4(codes, scales, group_size)


def _grouped(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """(k,) -> (ceil(k / g), g), zero-padded at the end (zeros leave a group's absmax unchanged)."""
    padding = -values.numel() % group_size
    return F.pad(values, (0, padding)).view(-1, group_size)
