"""Chunked top-k with int4 values: the largest `density` of each chunk of a pseudo-gradient, with their positions.

An alternative to the low-rank codecs for the outer sync (`compression.kind = "topk_int4"`), after SparseLoCo
(Sarfi et al. 2025, "Communication-Efficient LLM Pre-training with SparseLoCo"), which sends the top-k of every
chunk of the error-feedback-corrected pseudo-gradient with a few bits per value. Unlike low rank it needs no
matrix structure: embeddings and other tensors with flat spectra keep their largest entries.

One tensor of `n` values (any shape, flattened row-major), with `c = chunk_size`, `d = density` and
`kept(L) = min(L, max(1, round(d * L)))` (Python `round`, half to even):
- the values are cut into `floor(n / c)` chunks of `c` and, if `n % c`, one last chunk of `n % c`;
- each chunk of length L keeps its `kept(L)` values of largest magnitude, in order of decreasing magnitude (ties
  broken by `torch.topk`), so that each int4 group holds values of similar size;
- `K` = the sum of `kept(L)` over the tensor's chunks.

Byte layout of a list (no header; the receiver knows the shapes and the options):
1. positions: for every tensor in order, its kept values' positions inside their chunks, chunk by chunk. With
   `c <= 4096` each position takes 12 bits, two positions in 3 bytes (`a` and `b` as `a & 0xFF`,
   `(a >> 8) | (b & 0xF) << 4`, `b >> 4`; an odd `K` pads with a position 0): `3 ceil(K / 2)` bytes per tensor.
   With a larger `c` (at most 65536) each is a little-endian uint16: `2 K` bytes per tensor;
2. values: one int4 run per chunk (`dilocox.compress.int4`, groups never span two chunks), the fp16 scales of
   every run of the list, then the packed codes of every run.

`expected_nbytes(shape) = positions(K) + sum over chunks of int4(kept(L))`, with
`int4(k) = 2 ceil(k / g) + ceil(k / 2)`. Fixed by the shape: the receiver knows every run's length before
reading a byte. At the default density 0.075 and `c = 4096` that is 1.5 + 0.53 bytes per kept value, 0.152
bytes per value of the tensor: 1/26 of fp32.
"""

from __future__ import annotations

from typing import Any

import torch

from dilocox.compress.codecs import Codec, Int4Format, Shape
from dilocox.compress.config import MAX_CHUNK
from dilocox.compress.payload import ByteReader, numel_of, read_uint16s, uint16_bytes

PACKED_CHUNK = 1 << 12
"""The largest chunk whose positions are sent in 12 bits; larger chunks send uint16 positions."""


class TopKCodec(Codec):
    """The `density` largest values of every chunk of `chunk_size`, as 12-bit (or uint16) positions and int4 values.

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
        assert 0.0 < density <= 1.0 and 1 <= chunk_size <= MAX_CHUNK, (density, chunk_size)
        self.density = float(density)
        self.chunk_size = int(chunk_size)
        self.value_format = value_format

    # sizes --------------------------------------------------------------------------------------------------------

    def kept(self, length: int) -> int:
        """How many values a chunk of `length` keeps: min(length, max(1, round(density * length))); 0 when empty."""
        return 0 if length == 0 else min(length, max(1, round(self.density * length)))

    def chunk_lengths(self, numel: int) -> list[int]:
        """The lengths of the chunks of a tensor of `numel` values, in order."""
        full, last = divmod(numel, self.chunk_size)
        return [self.chunk_size] * full + ([last] if last else [])

    def position_nbytes(self, count: int) -> int:
        """Bytes of one tensor's `count` positions: 3 ceil(count / 2) (12 bits each) or 2 count (uint16)."""
        return 3 * (-(-count // 2)) if self.chunk_size <= PACKED_CHUNK else 2 * count

    def expected_nbytes(self, shape: Shape) -> int:
        counts = [self.kept(length) for length in self.chunk_lengths(numel_of(shape))]
        return self.position_nbytes(sum(counts)) + sum(self.value_format.nbytes(count) for count in counts)

    # encoding -----------------------------------------------------------------------------------------------------

    def _encode_values(self, values: list[torch.Tensor], first_slot: int) -> list[torch.Tensor]:
        positions: list[torch.Tensor] = []
        runs: list[torch.Tensor] = []
        for value in values:
            tensor_positions: list[torch.Tensor] = []
            flat = value.reshape(-1)
            full, last = divmod(flat.numel(), self.chunk_size)
            parts = []
            if full:
                parts.append(flat[: full * self.chunk_size].view(full, self.chunk_size))  # (full, c)
            if last:
                parts.append(flat[full * self.chunk_size :].view(1, last))  # (1, n % c)
            for chunks in parts:
                # sorted=True: decreasing magnitude inside each chunk (the int4 groups' order)
                index = torch.topk(chunks.abs(), self.kept(chunks.shape[1]), dim=1, sorted=True).indices  # (rows, k)
                tensor_positions.append(index.reshape(-1))
                runs.extend(chunks.gather(1, index).unbind(0))  # one (k,) run per chunk
            if tensor_positions:
                positions.append(self._position_bytes(torch.cat(tensor_positions)))
        if not runs:
            return []
        return [*positions, self.value_format.encode_runs(runs)]

    def _position_bytes(self, positions: torch.Tensor) -> torch.Tensor:
        """One tensor's (K,) int64 positions -> its `position_nbytes(K)` bytes."""
        if self.chunk_size > PACKED_CHUNK:
            return uint16_bytes(positions)
        if positions.numel() % 2:
            positions = torch.cat([positions, positions.new_zeros(1)])
        first, second = positions.view(-1, 2).unbind(1)  # (K / 2,) each
        packed = torch.stack([first & 0xFF, (first >> 8) | ((second & 0xF) << 4), second >> 4], dim=1)
        return packed.to(torch.uint8).reshape(-1)

    def _read_positions(self, reader: ByteReader, count: int) -> torch.Tensor:
        """The inverse of `_position_bytes`: one tensor's next bytes -> (count,) int64."""
        if self.chunk_size > PACKED_CHUNK:
            return read_uint16s(reader, count)
        triples = reader.take(self.position_nbytes(count)).to(torch.int64).view(-1, 3)  # (ceil(count / 2), 3)
        first = triples[:, 0] | ((triples[:, 1] & 0xF) << 8)
        second = (triples[:, 1] >> 4) | (triples[:, 2] << 4)
        return torch.stack([first, second], dim=1).reshape(-1)[:count]

    # decoding -----------------------------------------------------------------------------------------------------

    def _decode_values(self, reader: ByteReader, shapes: list[torch.Size]) -> list[torch.Tensor]:
        numels = [numel_of(shape) for shape in shapes]
        per_tensor = [self.chunk_lengths(numel) for numel in numels]  # each tensor's chunk lengths
        lengths = [length for chunk_lengths in per_tensor for length in chunk_lengths]  # every chunk, in order
        counts = [self.kept(length) for length in lengths]
        kept_per_tensor = [sum(self.kept(length) for length in chunk_lengths) for chunk_lengths in per_tensor]
        # (K_all,) int64, inside their chunks
        positions = torch.cat(
            [self._read_positions(reader, kept) for kept in kept_per_tensor] or [torch.zeros(0, dtype=torch.int64)]
        )
        values = self.value_format.decode_runs(reader, counts) if counts else []
        device = reader.data.device
        if not counts:
            return [torch.zeros(shape, dtype=torch.float32, device=device) for shape in shapes]
        # Each kept value's chunk: its length (to check the position) and its start inside the tensor.
        per_value = torch.tensor(counts)
        chunk_length = torch.repeat_interleave(torch.tensor(lengths), per_value)  # (K_all,)
        if bool((positions >= chunk_length).any()):
            bad = int((positions - chunk_length).argmax())
            raise ValueError(
                f"a topk_int4 payload names position {int(positions[bad])} in a chunk of {int(chunk_length[bad])} "
                "values; sender and receiver must use the same compression settings and tensor shapes"
            )
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
