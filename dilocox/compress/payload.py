"""The bytes that cross the slow link: `Payload`, byte (de)serialization helpers and compression statistics.

Every multi-byte value is written in the machine's native byte order, which is little-endian on every platform
torch supports for training (x86-64, aarch64); the rank header of the low-rank codecs is written byte by byte as
little-endian explicitly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Payload:
    """Everything one sender puts on the wire for one tensor or one list of tensors, as one flat byte tensor.

    A payload carries no shapes and no codec name: the receiver decodes it with the same codec settings and the
    list of tensor shapes, which all clusters share (DiLoCoX, Qi et al. 2025, arXiv 2506.21263: every cluster
    trains the same model). Anything that varies per sender, such as an adaptive rank, is inside the bytes.

        payload = codec.encode_list(pseudo_grads)        # payload.data: (payload.nbytes,) uint8
        wire = Payload.concat([payload_a, payload_b])    # several payloads travel as one buffer
        tensors = codec.decode_list(payload_a, shapes)   # fp32 tensors of the given shapes
    """

    data: torch.Tensor
    """(nbytes,) uint8: every byte that goes on the wire (headers, scales, packed values, factors)."""

    def __post_init__(self) -> None:
        if self.data.dtype != torch.uint8 or self.data.dim() != 1:
            raise ValueError(
                f"Payload.data must be a 1-D torch.uint8 tensor, got dtype={self.data.dtype} and shape "
                f"{tuple(self.data.shape)}; build payloads with a Codec or Payload.concat"
            )

    @property
    def nbytes(self) -> int:
        """Exact number of bytes on the wire (== data.numel())."""
        return self.data.numel()

    @staticmethod
    def concat(payloads: Sequence[Payload]) -> Payload:
        """One payload holding `payloads` back to back (decode the parts with `Codec.decode_list_at`)."""
        if not payloads:
            return Payload(torch.empty(0, dtype=torch.uint8))
        return Payload(torch.cat([payload.data for payload in payloads]))

    def split(self, sizes: Sequence[int]) -> list[Payload]:
        """The inverse of `concat` when the part sizes are known (e.g. gathered alongside the bytes)."""
        if sum(sizes) != self.nbytes or any(size < 0 for size in sizes):
            raise ValueError(f"part sizes {list(sizes)} do not add up to the payload's {self.nbytes} bytes")
        return [Payload(part) for part in torch.split(self.data, list(sizes))]


def compression_ratio(payload_nbytes: int, numel: int) -> float:
    """How many times smaller than fp32 (4 bytes per value) a payload of `payload_nbytes` for `numel` values is."""
    if payload_nbytes <= 0:
        raise ValueError(f"payload_nbytes = {payload_nbytes} must be > 0 to compute a compression ratio")
    if numel < 0:
        raise ValueError(f"numel = {numel} must be >= 0")
    return 4.0 * numel / payload_nbytes


def numel_of(shape: Sequence[int]) -> int:
    """Number of elements of a tensor of `shape` (1 for a scalar)."""
    return math.prod(shape)


def uint16_bytes(values: torch.Tensor) -> torch.Tensor:
    """(k,) integers in [0, 65535] -> (2k,) uint8, little-endian, written byte by byte (no reliance on torch's
    partial uint16 support)."""
    return torch.stack([values & 0xFF, values >> 8], dim=1).to(torch.uint8).reshape(-1)


def read_uint16s(reader: ByteReader, count: int) -> torch.Tensor:
    """The inverse of `uint16_bytes`: the reader's next `2 count` bytes -> (count,) int64."""
    pairs = reader.take(2 * count).view(count, 2).to(torch.int64)  # (count, 2): low byte, high byte
    return pairs[:, 0] | (pairs[:, 1] << 8)


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of `tensor` in its own dtype: (numel * element_size,) uint8, a copy-free view when possible."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


class ByteReader:
    """Walks a payload's bytes front to back; every read checks that the bytes are there.

    Reads copy their bytes, so a decoded tensor never aliases the receive buffer (which the caller may reuse) and
    every reinterpretation as a wider dtype starts at an aligned offset.

        reader = ByteReader(payload.data)
        values = reader.read(torch.float16, 10)   # (10,) fp16
        reader.expect_end()
    """

    def __init__(self, data: torch.Tensor, offset: int = 0) -> None:
        self.data = data
        self.offset = offset

    @property
    def remaining(self) -> int:
        return self.data.numel() - self.offset

    def take(self, nbytes: int) -> torch.Tensor:
        """The next `nbytes` bytes, copied: (nbytes,) uint8."""
        if nbytes > self.remaining:
            raise ValueError(
                f"payload ended early: needed {nbytes} bytes at offset {self.offset} but only {self.remaining} "
                "remain; sender and receiver must use the same compression settings and tensor shapes"
            )
        chunk = self.data[self.offset : self.offset + nbytes].clone()
        self.offset += nbytes
        return chunk

    def read(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The next `numel` values of `dtype`: (numel,) dtype."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return self.take(numel * itemsize).view(dtype)

    def expect_end(self) -> None:
        if self.remaining:
            raise ValueError(
                f"payload has {self.remaining} bytes left over after decoding all tensors; sender and receiver "
                "must use the same compression settings and tensor shapes"
            )
