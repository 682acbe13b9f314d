"""A codec in a transformed domain: each block of 64 consecutive values through an orthonormal DCT-II, then another
codec (the top-k signs of DeMo, Peng et al. 2024, arXiv 2411.19870, which sends the signs of a few DCT coefficients).

A pseudo-gradient of AdamW has values of nearly equal size inside a chunk (its steps are normalized per value), so
the largest values of a chunk hold little more than their share of its energy: on the `tiny` model's pseudo-gradients
the largest 1 of every 64 holds 8% of the energy, against 12% of the largest DCT coefficient of every 64-value block
(docs/results.md, "Codecs at the frontier"). The DCT is orthonormal, so the coefficients hold the same energy as the
values, error feedback may run in either domain, and the payload is the inner codec's, byte for byte.

One tensor of `n` values (flattened row-major): its first `64 floor(n / 64)` values as rows of 64, each row `x`
replaced by `D x` with `D[k, i] = sqrt(2 / 64) cos(pi k (i + 1/2) / 64)` (row 0 scaled by 1 / sqrt(2)); the last
`n % 64` values as they are. The inner codec encodes the tensor so transformed, of the same shape; the receiver
decodes it and applies `D^T` to the same rows. The byte layout and sizes are the inner codec's
(`dilocox.compress.topk` for `dct_sign`).

    codec = build_codec(CompressionConfig(kind="dct_sign", density=0.01, chunk_size=4096))
    payload = codec.encode_list(pseudo_grads)        # payload.nbytes == codec.expected_nbytes_list(shapes)
    decoded = codec.decode_list(payload, shapes)     # dense: every block sums its kept cosines
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from dilocox.compress.codecs import Codec, Shape
from dilocox.compress.payload import ByteReader, Payload

BLOCK = 64
"""Values per DCT block (DeMo's chunk)."""


def dct_matrix(size: int = BLOCK) -> torch.Tensor:
    """The orthonormal DCT-II matrix (size, size), fp32: row k is the k-th cosine."""
    k = torch.arange(size, dtype=torch.float64)[:, None]
    i = torch.arange(size, dtype=torch.float64)[None, :]
    matrix = torch.cos(math.pi / size * (i + 0.5) * k) * math.sqrt(2 / size)
    matrix[0] /= math.sqrt(2)
    return matrix.to(torch.float32)


class TransformCodec(Codec):
    """`inner` applied to the DCT-II coefficients of every block of 64 values (the remainder as it is).

    codec = TransformCodec("dct_sign", inner=build_codec("topk_sign", density=0.01))
    decoded = codec.decode(codec.encode(pseudo_grad), pseudo_grad.shape)
    """

    def __init__(self, name: str, *, inner: Codec) -> None:
        super().__init__(generator=inner.generator)
        self.name = name
        self.inner = inner
        self._dct = dct_matrix()

    def _apply(self, tensor: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
        """`tensor` with its blocks multiplied by `matrix` (D to encode, D^T to decode), as a new fp32 tensor."""
        flat = tensor.reshape(-1).to(torch.float32, copy=True)
        whole = flat.numel() // BLOCK * BLOCK
        blocks = flat[:whole].view(-1, BLOCK)  # (blocks, 64)
        flat[:whole] = (blocks @ matrix.T.to(blocks)).reshape(-1)
        return flat.view(tensor.shape)

    def _encode_values(self, values: list[torch.Tensor], first_slot: int) -> list[torch.Tensor]:
        coefficients = [self._apply(value, self._dct) for value in values]
        payload = self.inner.encode_list(coefficients, first_slot=first_slot)
        return [payload.data]

    def _decode_values(self, reader: ByteReader, shapes: list[torch.Size]) -> list[torch.Tensor]:
        coefficients, reader.offset = self.inner.decode_list_at(Payload(reader.data), shapes, reader.offset)
        return [self._apply(c, self._dct.T) for c in coefficients]

    def expected_nbytes(self, shape: Shape) -> int | None:
        return self.inner.expected_nbytes(shape)

    def expected_nbytes_list(self, shapes: Sequence[Shape]) -> int | None:
        return self.inner.expected_nbytes_list(shapes)

    def max_nbytes_list(self, shapes: Sequence[Shape]) -> int:
        return self.inner.max_nbytes_list(shapes)

    def state_dict(self) -> dict[str, Any]:
        return {**self.inner.state_dict(), "kind": self.name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.inner.load_state_dict({**state, "kind": self.inner.name})

    def __repr__(self) -> str:
        return f"TransformCodec(name={self.name!r}, dct={BLOCK}, inner={self.inner!r})"
