"""Two codecs in sequence: the second sends the largest part of what the first missed (`lowrank_topk`: low-rank
factors, then the top-k signs of the remainder).

A rank-r approximation keeps most of a pseudo-gradient's energy (its spectrum is concentrated: stable ranks of 2 to
13 on the `tiny` model) but misses its largest single moves: what it leaves behind has heavy-tailed entries, whose
largest 1% hold 10 to 17% of the energy, twice a Gaussian's share (docs/results.md, "Why the paper's codec trails
top-k"). The second codec sends those from the remainder `x - first(x)`, the receiver adds the two decodings, and
error feedback keeps what both miss.

Byte layout of a list: the first codec's payload, then the second's (each its own layout, `dilocox.compress.codecs`
and `dilocox.compress.topk`); the size is the sum of the two.

    codec = build_codec(CompressionConfig(kind="lowrank_topk", rank=4, density=0.01))
    payload = codec.encode_list(pseudo_grads)        # payload.nbytes == codec.expected_nbytes_list(shapes)
    decoded = codec.decode_list(payload, shapes)     # low rank plus the remainder's top-k
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dilocox.compress.codecs import Codec, Shape
from dilocox.compress.payload import ByteReader, Payload


class HybridCodec(Codec):
    """`first`, then `second` on what `first` missed; the decoding is their sum.

    codec = HybridCodec("lowrank_topk", first=build_codec("lowrank_int4", rank=4),
                        second=build_codec("topk_sign", density=0.01))
    """

    def __init__(self, name: str, *, first: Codec, second: Codec) -> None:
        super().__init__(generator=first.generator)
        self.name = name
        self.first = first
        self.second = second

    def current_rank(self) -> int | None:
        return self.first.current_rank()

    def _encode_values(self, values: list[torch.Tensor], first_slot: int) -> list[torch.Tensor]:
        shapes = [value.shape for value in values]
        head = self.first.encode_list(values, first_slot=first_slot)
        remainder = [v - d for v, d in zip(values, self.first.decode_list(head, shapes), strict=True)]
        return [head.data, self.second.encode_list(remainder, first_slot=first_slot).data]

    def _decode_values(self, reader: ByteReader, shapes: list[torch.Size]) -> list[torch.Tensor]:
        data = Payload(reader.data)
        head, reader.offset = self.first.decode_list_at(data, shapes, reader.offset)
        tail, reader.offset = self.second.decode_list_at(data, shapes, reader.offset)
        return [a + b for a, b in zip(head, tail, strict=True)]

    def expected_nbytes(self, shape: Shape) -> int | None:
        return self.expected_nbytes_list([shape])

    def expected_nbytes_list(self, shapes: Sequence[Shape]) -> int | None:
        sizes = (self.first.expected_nbytes_list(shapes), self.second.expected_nbytes_list(shapes))
        return None if None in sizes else sum(sizes)  # type: ignore[arg-type]

    def max_nbytes(self, shape: Shape) -> int:
        return self.max_nbytes_list([shape])

    def max_nbytes_list(self, shapes: Sequence[Shape]) -> int:
        return self.first.max_nbytes_list(shapes) + self.second.max_nbytes_list(shapes)

    def state_bytes(self) -> int:
        return self.first.state_bytes() + self.second.state_bytes()

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.name, "generator": self.generator.get_state(), "first": self.first.state_dict(),
                "second": self.second.state_dict()}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.first.load_state_dict(state["first"])
        self.second.load_state_dict(state["second"])

    def __repr__(self) -> str:
        return f"HybridCodec(name={self.name!r}, first={self.first!r}, second={self.second!r})"
