"""Chunked top-k: the largest `density` of each chunk of a pseudo-gradient, with their positions, in 4, 2 or 1 bits.

An alternative to the low-rank codecs for the outer sync, after SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706),
which sends the top-k of every chunk of the error-feedback-corrected pseudo-gradient with a few bits per value. Unlike
low rank it needs no matrix structure: embeddings and other tensors with flat spectra keep their largest entries.
The kinds differ only in how the kept values are written (`compression.kind`):

| kind | a kept value | format |
| --- | --- | --- |
| topk_int4 | group absmax int4: 4 bits, an fp16 scale per group | `dilocox.compress.int4` |
| topk_int2 | the nearest of -3s, -s, s, 3s: 2 bits, an fp16 least-squares scale per group | `dilocox.compress.lowbit` |
| topk_sign | its sign times its group's mean magnitude: 1 bit, an fp16 scale per group | `dilocox.compress.lowbit` |

One tensor of `n` values (any shape, flattened row-major), with `c = chunk_size`, `d = density` and
`kept(L) = min(L, max(1, round(d * L)))` (Python `round`, half to even):
- the values are cut into `floor(n / c)` chunks of `c` and, if `n % c`, one last chunk of `n % c`;
- each chunk of length L keeps its `kept(L)` values of largest magnitude (ties broken by `torch.topk`), in order
  of position;
- `K` = the sum of `kept(L)` over the tensor's chunks. The tensor's kept values are one run of the value format, in
  order of position, so its groups of `g = group_size` values span chunks: a chunk of 64 that keeps one value costs
  no scale of its own.

Byte layout of a list (no header; the receiver knows the shapes and the options):
1. positions: for every tensor in order, the position codes (`dilocox.compress.elias_fano`: Elias-Fano, or plain
   positions where those are shorter) of its chunks, chunk by chunk, as one bit stream padded to a whole byte:
   `ceil(sum over chunks of nbits(L, kept(L)) / 8)` bytes per tensor;
2. values: every tensor's run, in order, as one section of the value format: for int4 `2 ceil(K / g) + ceil(K / 2)`
   bytes per tensor; for 1 or 2 bits (b) the fp16 scales of every group, then the codes of all the runs as one bit
   stream padded once, `2 sum ceil(K / g) + ceil(b sum K / 8)`.

The size is fixed by the shapes: the receiver knows every code's and run's length before reading a byte
(`expected_nbytes_list`; one tensor alone: `expected_nbytes`). On the `tiny` model (1,312,896 parameters, c = 4096,
g = 64) one round takes 0.53 bits a parameter for topk_int4 at density 0.05 (7.5 bits of position and 4.25 of value
per kept value), 0.11 for topk_int2 at 0.01 and 0.10 for topk_sign at 0.01 (8.6 of position; `bits_per_value`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dilocox.compress import elias_fano
from dilocox.compress.codecs import Codec, Shape, ValueFormat
from dilocox.compress.payload import ByteReader, numel_of


class TopKCodec(Codec):
    """The `density` largest values of every chunk of `chunk_size`, as position codes and `value_format` values.

    Error feedback (`ErrorFeedback`) keeps what a round did not send, so a value left out now is sent once it has
    grown among the largest of its chunk.

        codec = build_codec(CompressionConfig(kind="topk_sign", density=0.01, chunk_size=4096))
        payload = codec.encode_list(pseudo_grads)        # payload.nbytes == codec.expected_nbytes_list(shapes)
        decoded = codec.decode_list(payload, shapes)     # zeros except at the kept positions
    """

    def __init__(
        self,
        name: str,
        *,
        density: float,
        chunk_size: int,
        value_format: ValueFormat,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(generator=generator)
        # Validated by CompressionConfig.validate(); these guard the payload format itself.
        assert 0.0 < density <= 1.0 and chunk_size >= 1, (density, chunk_size)
        self.name = name
        self.density = float(density)
        self.chunk_size = int(chunk_size)
        self.value_format = value_format

    # sizes --------------------------------------------------------------------------------------------------------

    def kept(self, length: int) -> int:
        """How many values a chunk of `length` keeps: min(length, max(1, round(density * length))); 0 when empty."""
        return 0 if length == 0 else min(length, max(1, round(self.density * length)))

    def chunk_groups(self, numel: int) -> list[tuple[int, int]]:
        """The chunks of a tensor of `numel` values as (rows, L) groups of equal length: the full ones, the last."""
        full, last = divmod(numel, self.chunk_size)
        return ([(full, self.chunk_size)] if full else []) + ([(1, last)] if last else [])

    def num_kept(self, numel: int) -> int:
        """K: the values a tensor of `numel` values keeps, over all its chunks."""
        return sum(rows * self.kept(length) for rows, length in self.chunk_groups(numel))

    def _group_bits(self, groups: list[tuple[int, int]]) -> list[int]:
        """Bits of the position codes of each (rows, L) group of `chunk_groups`."""
        return [rows * elias_fano.nbits(length, self.kept(length)) for rows, length in groups]

    def position_nbytes(self, numel: int) -> int:
        """Bytes of the positions of a tensor of `numel` values: its chunks' codes, padded to a byte."""
        return -(-sum(self._group_bits(self.chunk_groups(numel))) // 8)

    def expected_nbytes(self, shape: Shape) -> int:
        return self.expected_nbytes_list([shape])

    def expected_nbytes_list(self, shapes: Sequence[Shape]) -> int:
        numels = [numel_of(shape) for shape in shapes]
        values = self.value_format.section_nbytes([self.num_kept(numel) for numel in numels])
        return sum(self.position_nbytes(numel) for numel in numels) + values

    def max_nbytes_list(self, shapes: Sequence[Shape]) -> int:
        return self.expected_nbytes_list(shapes)

    def bits_per_value(self, shapes: Sequence[Shape]) -> float:
        """Bits on the wire per value of tensors of `shapes` (a model's parameters: one round's bits a parameter)."""
        return 8 * self.expected_nbytes_list(shapes) / max(1, sum(numel_of(shape) for shape in shapes))

    # encoding -----------------------------------------------------------------------------------------------------

    def _encode_values(self, values: list[torch.Tensor], first_slot: int) -> list[torch.Tensor]:
        positions: list[torch.Tensor] = []
        runs: list[torch.Tensor] = []  # one per tensor: its kept values, chunk by chunk, in order of position
        for value in values:
            bits: list[torch.Tensor] = []
            kept: list[torch.Tensor] = [value.new_zeros(0)]
            groups = self.chunk_groups(value.numel())
            for chunks, (rows, length) in zip(value.reshape(-1).split([r * n for r, n in groups]), groups, strict=True):
                chunks = chunks.view(rows, length)
                index = torch.topk(chunks.abs(), self.kept(length), dim=1, sorted=False).indices.sort(dim=1).values
                bits.append(elias_fano.encode(index, universe=length))
                kept.append(chunks.gather(1, index).reshape(-1))
            if bits:
                positions.append(elias_fano.pack_bits(torch.cat(bits)))
            runs.append(torch.cat(kept))
        if not positions:  # every tensor is empty
            return []
        return [*positions, self.value_format.encode_runs(runs)]

    # decoding -----------------------------------------------------------------------------------------------------

    def _decode_values(self, reader: ByteReader, shapes: list[torch.Size]) -> list[torch.Tensor]:
        numels = [numel_of(shape) for shape in shapes]
        device = reader.data.device
        if not any(numels):
            return [torch.zeros(shape, dtype=torch.float32, device=device) for shape in shapes]
        positions = [self._read_positions(reader, numel) for numel in numels]  # (K,) int64 each, inside the tensor
        values = self.value_format.decode_runs(reader, [index.numel() for index in positions])
        tensors: list[torch.Tensor] = []
        for shape, numel, index, kept in zip(shapes, numels, positions, values, strict=True):
            dense = torch.zeros(numel, dtype=torch.float32, device=device)
            dense[index.to(device)] = kept.to(device)
            tensors.append(dense.view(shape))
        return tensors

    def _read_positions(self, reader: ByteReader, numel: int) -> torch.Tensor:
        """One tensor's positions in it, chunk by chunk: its next `position_nbytes(numel)` bytes -> (K,) int64."""
        groups = self.chunk_groups(numel)
        if not groups:
            return torch.zeros(0, dtype=torch.int64)
        sizes = self._group_bits(groups)
        bits = elias_fano.unpack_bits(reader.take(-(-sum(sizes) // 8)), sum(sizes))
        first = 0
        parts = []
        for part, (rows, length) in zip(bits.split(sizes), groups, strict=True):
            inside = elias_fano.decode(part, rows, universe=length, count=self.kept(length))  # (rows, kept)
            starts = first + length * torch.arange(rows, device=inside.device)  # (rows,) each chunk's first value
            parts.append((inside + starts[:, None]).reshape(-1))
            first += rows * length
        return torch.cat(parts)

    # state --------------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(density=self.density, chunk_size=self.chunk_size)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        saved = (state.get("density"), state.get("chunk_size"))
        if saved != (self.density, self.chunk_size):
            raise ValueError(
                f"codec state of {self.name} with density, chunk_size = {saved} cannot be loaded into one with "
                f"{(self.density, self.chunk_size)}; resume with the compression settings it was written with"
            )

    def __repr__(self) -> str:
        return (
            f"TopKCodec(name={self.name!r}, density={self.density}, chunk_size={self.chunk_size}, "
            f"values={self.value_format.name})"
        )
