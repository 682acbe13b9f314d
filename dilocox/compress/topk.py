"""Chunked top-k with int4 values: the largest `density` of each chunk of a pseudo-gradient, with their positions.

An alternative to the low-rank codecs for the outer sync (`compression.kind = "topk_int4"`), after SparseLoCo
(Sarfi et al. 2025, "Communication-Efficient LLM Pre-training with SparseLoCo"), which sends the top-k of every
chunk of the error-feedback-corrected pseudo-gradient with a few bits per value. Unlike low rank it needs no
matrix structure: embeddings and other tensors with flat spectra keep their largest entries.

One tensor of `n` values (any shape, flattened row-major), with `c = chunk_size`, `d = density` and
`kept(L) = min(L, max(1, round(d * L)))` (Python `round`, half to even):
- the values are cut into `floor(n / c)` chunks of `c` and, if `n % c`, one last chunk of `n % c`;
- each chunk of length L keeps its `kept(L)` values of largest magnitude (ties broken by `torch.topk`), in order
  of position;
- `K` = the sum of `kept(L)` over the tensor's chunks.

Byte layout of a list (no header; the receiver knows the shapes and the options):
1. positions: for every tensor in order, the Elias-Fano codes (`dilocox.compress.elias_fano`) of its chunks' kept
   positions, chunk by chunk, as one bit stream padded to a whole byte: `ceil(sum over chunks of
   ef(L, kept(L)) / 8)` bytes per tensor, with `ef(L, k) = k l + k + ((L - 1) >> l) + 1` and
   `l = floor(log2(L / k))`;
2. values: one int4 run per chunk, in order of position (`dilocox.compress.int4`, groups never span two chunks),
   the fp16 scales of every run of the list, then the packed codes of every run.

`expected_nbytes(shape) = positions + sum over chunks of int4(kept(L))`, with `int4(k) = 2 ceil(k / g) +
ceil(k / 2)`. Fixed by the shape: the receiver knows every code's and run's length before reading a byte. At the
default density 0.075 and `c = 4096` a kept value takes 5.7 bits of position and 4.25 of value (0.093 bytes per
value of the tensor: 1/43 of fp32); 12-bit positions, as in SparseLoCo, would take 1.6x the bytes.
"""

from __future__ import annotations

from typing import Any

import torch

from dilocox.compress import elias_fano
from dilocox.compress.codecs import Codec, Int4Format, Shape
from dilocox.compress.payload import ByteReader, numel_of


class TopKCodec(Codec):
    """The `density` largest values of every chunk of `chunk_size`, as Elias-Fano positions and int4 values.

    Error feedback (`ErrorFeedback`) keeps what a round did not send, so a value left out now is sent once it has
    grown among the largest of its chunk.

        codec = build_codec(CompressionConfig(kind="topk_int4", density=0.075, chunk_size=4096))
        payload = codec.encode_list(pseudo_grads)        # payload.nbytes == codec.expected_nbytes_list(shapes)
        decoded = codec.decode_list(payload, shapes)     # zeros except at the kept positions
    """

    name = "topk_int4"

    def __init__(
        self, *, density: float, chunk_size: int, value_format: Int4Format, generator: torch.Generator | None = None
    ) -> None:
        super().__init__(generator=generator)
        # Validated by CompressionConfig.validate(); these guard the payload format itself.
        assert 0.0 < density <= 1.0 and chunk_size >= 1, (density, chunk_size)
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

    def chunk_lengths(self, numel: int) -> list[int]:
        """The lengths of the chunks of a tensor of `numel` values, in order."""
        return [length for rows, length in self.chunk_groups(numel) for _ in range(rows)]

    def _group_bits(self, groups: list[tuple[int, int]]) -> list[int]:
        """Bits of the Elias-Fano codes of each (rows, L) group of `chunk_groups`."""
        return [rows * elias_fano.nbits(length, self.kept(length)) for rows, length in groups]

    def position_nbytes(self, numel: int) -> int:
        """Bytes of the positions of a tensor of `numel` values: its chunks' Elias-Fano codes, padded to a byte."""
        return -(-sum(self._group_bits(self.chunk_groups(numel))) // 8)

    def expected_nbytes(self, shape: Shape) -> int:
        numel = numel_of(shape)
        counts = [self.kept(length) for length in self.chunk_lengths(numel)]
        return self.position_nbytes(numel) + sum(self.value_format.nbytes(count) for count in counts)

    # encoding -----------------------------------------------------------------------------------------------------

    def _encode_values(self, values: list[torch.Tensor], first_slot: int) -> list[torch.Tensor]:
        positions: list[torch.Tensor] = []
        runs: list[torch.Tensor] = []
        for value in values:
            bits: list[torch.Tensor] = []
            groups = self.chunk_groups(value.numel())
            for chunks, (rows, length) in zip(value.reshape(-1).split([r * n for r, n in groups]), groups, strict=True):
                chunks = chunks.view(rows, length)
                index = torch.topk(chunks.abs(), self.kept(length), dim=1, sorted=False).indices.sort(dim=1).values
                bits.append(elias_fano.encode(index, universe=length))
                runs.extend(chunks.gather(1, index).unbind(0))  # one (k,) run per chunk, in order of position
            if bits:
                positions.append(elias_fano.pack_bits(torch.cat(bits)))
        if not runs:
            return []
        return [*positions, self.value_format.encode_runs(runs)]

    # decoding -----------------------------------------------------------------------------------------------------

    def _decode_values(self, reader: ByteReader, shapes: list[torch.Size]) -> list[torch.Tensor]:
        numels = [numel_of(shape) for shape in shapes]
        per_tensor = [self.chunk_lengths(numel) for numel in numels]  # each tensor's chunk lengths
        lengths = [length for chunk_lengths in per_tensor for length in chunk_lengths]  # every chunk, in order
        counts = [self.kept(length) for length in lengths]
        kept_per_tensor = [sum(self.kept(length) for length in chunk_lengths) for chunk_lengths in per_tensor]
        # (K_all,) int64, inside their chunks (decode checks each against its chunk's length)
        positions = torch.cat(
            [self._read_positions(reader, numel) for numel in numels if numel] or [torch.zeros(0, dtype=torch.int64)]
        )
        values = self.value_format.decode_runs(reader, counts) if counts else []
        device = reader.data.device
        if not counts:
            return [torch.zeros(shape, dtype=torch.float32, device=device) for shape in shapes]
        per_value = torch.tensor(counts)
        starts = [start for numel in numels for start in range(0, numel, self.chunk_size)]  # inside the tensor
        flat_index = torch.repeat_interleave(torch.tensor(starts, dtype=torch.int64), per_value) + positions
        flat_values = torch.cat(values)  # (K_all,) fp32
        tensors: list[torch.Tensor] = []
        for shape, numel, index, kept in zip(
            shapes, numels, flat_index.split(kept_per_tensor), flat_values.split(kept_per_tensor), strict=True
        ):
            dense = torch.zeros(numel, dtype=torch.float32, device=device)
            dense[index.to(device)] = kept.to(device)
            tensors.append(dense.view(shape))
        return tensors

    def _read_positions(self, reader: ByteReader, numel: int) -> torch.Tensor:
        """One tensor's positions, chunk by chunk: its next `position_nbytes(numel)` bytes -> (K,) int64."""
        groups = self.chunk_groups(numel)
        sizes = self._group_bits(groups)
        bits = elias_fano.unpack_bits(reader.take(-(-sum(sizes) // 8)), sum(sizes))
        return torch.cat(
            [
                elias_fano.decode(part, rows, universe=length, count=self.kept(length)).reshape(-1)
                for part, (rows, length) in zip(bits.split(sizes), groups, strict=True)
            ]
        )

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
                f"codec state of topk_int4 with density, chunk_size = {saved} cannot be loaded into one with "
                f"{(self.density, self.chunk_size)}; resume with the compression settings it was written with"
            )

    def __repr__(self) -> str:
        return f"TopKCodec(density={self.density}, chunk_size={self.chunk_size}, values=int4)"
