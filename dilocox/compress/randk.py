"""Random-k with shared positions: a `density` of every tensor's values at positions every cluster draws alike, so
no position is sent; the values in 1 or 2 bits (`compression.kind = randk_sign`, `randk_int2`).

Top-k spends most of its bytes on positions (8.6 bits a kept value at density 0.01, against 1 to 2 bits of value).
Here the positions are a stratified random sample drawn from the run's seed and a draw counter, as CocktailSGD draws
its sample (Wang et al. 2023; `dilocox.compress.sparse`), so a payload is values only and, at the same bytes, carries
about 8 times the values of top-k; every cluster draws the same positions in the same round, so the average is
exact there. Error feedback keeps every other value until it is drawn, on average every `1 / density` rounds: every
value of the model is synchronized that often, where top-k at a low density leaves most values unsent for longer
than a run (docs/results.md, "Codecs at the frontier").

One list of tensors, with `d = density`, encoded at the codec's `draws`-th encoding (a counter in its state, the same
on every cluster that encodes once a round):
- a generator seeded with `sample_seed(seed, draws)` (`dilocox.compress.sparse`) draws, tensor by tensor in order, a
  tensor of `n > 0` values' `m = min(n, max(1, round(d n)))` positions: the values are cut into `m` strata of `n / m`
  consecutive ones (sizes differ by at most one) and one position is drawn uniformly in each (one float64 uniform per
  stratum);
- the kept values of a tensor are one run of the value format, in order of position (`dilocox.compress.lowbit`).

Byte layout of a list: the draw counter as a little-endian uint32 (so decoding needs no state), then every tensor's
run as one section of the value format: `4 + 2 sum ceil(m / g) + ceil(b sum m / 8)` bytes for b = 1 or 2 bits and
groups of `g = group_size`. On the `tiny` model one round takes 0.10 bits a parameter at density 0.08 (`randk_sign`).

    codec = build_codec(CompressionConfig(kind="randk_sign", density=0.08), seed=run_seed)
    payload = codec.encode_list(pseudo_grads)        # payload.nbytes == codec.expected_nbytes_list(shapes)
    decoded = codec.decode_list(payload, shapes)     # zeros except at the drawn positions
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dilocox.compress.codecs import Codec, Shape, ValueFormat
from dilocox.compress.payload import ByteReader, Payload, numel_of
from dilocox.compress.sparse import sample_seed, stratified_sample

MAX_DRAWS = (1 << 32) - 1
"""The largest draw counter the uint32 header holds."""


class RandomKCodec(Codec):
    """`density` of every tensor's values at shared stratified random positions, written in `value_format`.

    codec = build_codec(CompressionConfig(kind="randk_sign", density=0.08), seed=0)
    payload = codec.encode_list(pseudo_grads)        # codec.draws counts the encodings
    decoded = build_codec(CompressionConfig(kind="randk_sign", density=0.08), seed=0).decode_list(payload, shapes)
    """

    def __init__(
        self, name: str, *, density: float, seed: int, value_format: ValueFormat, generator: torch.Generator
    ) -> None:
        super().__init__(generator=generator)
        assert 0.0 < density <= 1.0 and seed >= 0, (density, seed)
        self.name = name
        self.density = float(density)
        self.seed = seed
        self.value_format = value_format
        self.draws = 0
        """Encodings so far: the next one draws its positions with `sample_seed(seed, draws)`."""

    # sizes --------------------------------------------------------------------------------------------------------

    def num_kept(self, numel: int) -> int:
        """m: the values a tensor of `numel` values sends."""
        return 0 if numel == 0 else min(numel, max(1, round(self.density * numel)))

    def expected_nbytes(self, shape: Shape) -> int:
        return self.expected_nbytes_list([shape])

    def expected_nbytes_list(self, shapes: Sequence[Shape]) -> int:
        return 4 + self.value_format.section_nbytes([self.num_kept(numel_of(shape)) for shape in shapes])

    def max_nbytes_list(self, shapes: Sequence[Shape]) -> int:
        return self.expected_nbytes_list(shapes)

    # positions ----------------------------------------------------------------------------------------------------

    def positions(self, numels: Sequence[int], draws: int) -> list[torch.Tensor]:
        """The positions of the `draws`-th encoding, one (m,) int64 ascending tensor per tensor of `numels` values."""
        generator = torch.Generator().manual_seed(sample_seed(self.seed, draws))
        return [stratified_sample(numel, self.num_kept(numel), generator) for numel in numels]

    # encoding -----------------------------------------------------------------------------------------------------

    def encode_list(self, tensors: Sequence[torch.Tensor], *, first_slot: int = 0) -> Payload:
        payload = super().encode_list(tensors, first_slot=first_slot)
        self.draws = (self.draws + 1) & MAX_DRAWS
        return payload

    def _encode_values(self, values: list[torch.Tensor], first_slot: int) -> list[torch.Tensor]:
        device = values[0].device if values else None
        drawn = self.positions([value.numel() for value in values], self.draws)
        runs = [value.reshape(-1)[index.to(value.device)] for value, index in zip(values, drawn, strict=True)]
        header = torch.tensor([(self.draws >> shift) & 0xFF for shift in (0, 8, 16, 24)], dtype=torch.uint8)
        return [header.to(device), self.value_format.encode_runs(runs)]

    # decoding -----------------------------------------------------------------------------------------------------

    def _decode_values(self, reader: ByteReader, shapes: list[torch.Size]) -> list[torch.Tensor]:
        draws = sum(int(byte) << shift for byte, shift in zip(reader.take(4).tolist(), (0, 8, 16, 24), strict=True))
        numels = [numel_of(shape) for shape in shapes]
        drawn = self.positions(numels, draws)
        values = self.value_format.decode_runs(reader, [index.numel() for index in drawn])
        device = reader.data.device
        tensors = []
        for shape, numel, index, kept in zip(shapes, numels, drawn, values, strict=True):
            dense = torch.zeros(numel, dtype=torch.float32, device=device)
            dense[index.to(device)] = kept.to(device)
            tensors.append(dense.view(shape))
        return tensors

    # state --------------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(density=self.density, draws=self.draws)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if state.get("density") != self.density:
            raise ValueError(
                f"codec state of {self.name} with density {state.get('density')} cannot be loaded into one with "
                f"{self.density}; resume with the compression settings it was written with"
            )
        self.draws = int(state["draws"])

    def __repr__(self) -> str:
        return f"RandomKCodec(name={self.name!r}, density={self.density}, values={self.value_format.name})"
