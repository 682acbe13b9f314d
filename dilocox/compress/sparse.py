"""CocktailSGD's gradient codec: a shared random sample, top-k inside it, the k values in int4.

One flat fp32 vector of `n` values, with `m = sample_size(n)` and `k = num_selected(n)`:

1. random sampling: `m = min(n, max(1, round(sample_ratio * n)))` coordinates drawn from a generator seeded by
   `(seed, step)`. Every cluster draws the same sample for the same step, so it is never sent. The draw is
   stratified: the coordinates are cut into `m` strata of `n / m` consecutive ones (sizes differ by at most one)
   and one coordinate is drawn uniformly in each, so every coordinate is sampled with probability ~`m / n`, the
   sample comes out sorted and drawing it costs O(m) (a permutation of all `n` costs 120 ms per step at 1.3M
   values on one core, more than the rest of the codec);
2. top-k: the `k = min(m, max(1, round(topk_ratio * n)))` sampled values of largest magnitude (Python `round`,
   half to even), taken in order of decreasing magnitude so that each int4 group holds values of similar size;
3. quantization: the k values as one int4 run (`dilocox.compress.int4`: group-wise absmax, fp16 scales, round to
   nearest), the k indices as their positions inside the sample.

Byte layout (no header; the receiver knows `n`, `step` and the options, which all clusters share):

1. positions: the k positions inside the sample, `w` bytes each: little-endian uint16 (`w = 2`) when
   m <= 65536, else int32 (`w = 4`, native order: little-endian on every platform torch trains on);
2. values: the fp16 scales of the k values in groups of `g = group_size`, `2 * ceil(k / g)` bytes;
3. values: their packed 4-bit codes, two per byte, `ceil(k / 2)` bytes.

`expected_nbytes(n) = w * k + 2 * ceil(k / g) + ceil(k / 2)`, and 0 for `n = 0`. Positions are signed int32
rather than uint32 because torch has no arithmetic on uint32; a sample of 2^31 or more values is rejected.
"""

from __future__ import annotations

from typing import Any

import torch

from dilocox.compress.config import CocktailConfig
from dilocox.compress.int4 import decode_int4, encode_int4, int4_nbytes
from dilocox.compress.payload import ByteReader, Payload, read_uint16s, uint16_bytes

UINT16_POSITIONS = 1 << 16
"""The largest sample whose positions fit in uint16 (positions 0 .. 65535)."""
MAX_SAMPLE = (1 << 31) - 1
"""The largest sample whose positions fit in int32."""
_SEED_MULTIPLIER = 0x9E3779B9  # 2^32 / golden ratio: spreads the base seeds over the 32-bit seed space


def sample_seed(seed: int, step: int) -> int:
    """The generator seed of step `step`'s sample: `(seed * 0x9E3779B9 + step) mod 2^32`.

    torch's CPU generator (mt19937) keeps only the low 32 bits of a seed, so the pair is folded to 32 bits here,
    in a way that gives distinct seeds to 2^32 consecutive steps of one run.
    """
    return (seed * _SEED_MULTIPLIER + step) & 0xFFFFFFFF


def stratified_sample(numel: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """`count` of `numel` positions, one drawn uniformly in each of `count` strata of consecutive positions (sizes
    differ by at most one): (count,) int64, ascending; one float64 uniform per stratum from `generator`."""
    if count == 0:
        return torch.zeros(0, dtype=torch.int64)
    starts = torch.arange(count + 1, dtype=torch.int64) * numel // count  # (count + 1,) stratum bounds, sizes >= 1
    sizes = starts[1:] - starts[:-1]  # (count,)
    # float64 draws: u * size stays below size for any int32 size; the clamp guards the last ulp anyway.
    offsets = (torch.rand(count, generator=generator, dtype=torch.float64) * sizes).floor_().to(torch.int64)
    return starts[:-1] + torch.minimum(offsets, sizes - 1)


class SparseInt4Codec:
    """Random sampling, top-k and int4 of one flat gradient shard: the compressor of CocktailSGD.

    CocktailSGD (Wang et al. 2023, "CocktailSGD: Fine-tuning Foundation Models over 500Mbps Networks", ICML)
    combines a random subset shared by every worker, top-k inside it and 4-bit quantization, with error feedback
    (kept by the caller, `dilocox.sync.cocktail.CocktailSync`). The payload size is fixed by `n` (module docstring).

        codec = SparseInt4Codec(CocktailConfig(sample_ratio=0.1, topk_ratio=0.01, group_size=64), seed=0)
        payload = codec.encode(grad_shard, step=step)          # payload.nbytes == codec.expected_nbytes(n)
        dense = codec.decode(payload, grad_shard.numel(), step=step)   # (n,) fp32, zero off the top-k
    """

    name = "sparse_int4"

    def __init__(self, cfg: CocktailConfig, *, seed: int = 0) -> None:
        cfg.validate()
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"run.seed = {seed!r} must be an integer >= 0, the same on every cluster")
        self.sample_ratio = float(cfg.sample_ratio)
        self.topk_ratio = float(cfg.topk_ratio)
        self.group_size = cfg.group_size
        self.seed = seed

    # sizes --------------------------------------------------------------------------------------------------------

    def sample_size(self, numel: int) -> int:
        """`m`: how many coordinates of a vector of `numel` values are sampled each step."""
        return 0 if numel == 0 else min(numel, max(1, round(self.sample_ratio * numel)))

    def num_selected(self, numel: int) -> int:
        """`k`: how many sampled values are sent each step (capped at the sample size)."""
        return 0 if numel == 0 else min(self.sample_size(numel), max(1, round(self.topk_ratio * numel)))

    def position_nbytes(self, numel: int) -> int:
        """`w`: bytes of one position, 2 (uint16) when the sample has <= 65536 entries, else 4 (int32)."""
        return 2 if self.sample_size(numel) <= UINT16_POSITIONS else 4

    def expected_nbytes(self, numel: int) -> int:
        """Exact payload bytes for a vector of `numel` values: `w * k + 2 * ceil(k / g) + ceil(k / 2)`."""
        k = self.num_selected(numel)
        return self.position_nbytes(numel) * k + int4_nbytes(k, self.group_size)

    # sampling -----------------------------------------------------------------------------------------------------

    def sample_indices(self, numel: int, *, step: int) -> torch.Tensor:
        """The shared random sample of step `step`: (m,) int64 distinct coordinates in increasing order."""
        _check_step(step)
        m = self.sample_size(numel)
        if m > MAX_SAMPLE:
            raise ValueError(
                f"a sample of {m} coordinates does not fit the int32 positions of cocktail.sample_ratio = "
                f"{self.sample_ratio}; lower it or shard the gradient over more replicas (topology.dp_degree)"
            )
        return stratified_sample(numel, m, torch.Generator().manual_seed(sample_seed(self.seed, step)))

    # encoding -----------------------------------------------------------------------------------------------------

    def encode(self, flat: torch.Tensor, *, step: int) -> Payload:
        """(n,) values -> the payload of step `step`: top-k positions inside the sample, then their int4 values."""
        if flat.dim() != 1:
            raise ValueError(f"SparseInt4Codec.encode takes a flat (n,) tensor, got shape {tuple(flat.shape)}")
        numel = flat.numel()
        if numel == 0:
            _check_step(step)
            return Payload(torch.empty(0, dtype=torch.uint8))
        sample = self.sample_indices(numel, step=step)  # (m,)
        sampled = flat.detach()[sample].to(torch.float32)  # (m,)
        # sorted=True: decreasing magnitude, so each int4 group's absmax is close to all of its values.
        positions = torch.topk(sampled.abs(), self.num_selected(numel), sorted=True).indices  # (k,) int64
        values = sampled[positions]  # (k,)
        chunks = [_position_bytes(positions, self.position_nbytes(numel)), encode_int4(values, self.group_size)]
        return Payload(torch.cat(chunks))

    # decoding -----------------------------------------------------------------------------------------------------

    def decode_sparse(self, payload: Payload, numel: int, *, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A payload -> (k,) int64 coordinates (distinct) and (k,) fp32 values, the only nonzeros of `decode`."""
        expected = self.expected_nbytes(numel)
        if payload.nbytes != expected:
            raise ValueError(
                f"a sparse int4 payload for {numel} values must have {expected} bytes but has {payload.nbytes}; "
                "sender and receiver must use the same cocktail.sample_ratio, topk_ratio and group_size"
            )
        if numel == 0:
            _check_step(step)
            return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.float32)
        sample = self.sample_indices(numel, step=step)  # (m,)
        k = self.num_selected(numel)
        reader = ByteReader(payload.data)
        width = self.position_nbytes(numel)
        positions = _read_positions(reader, k, width)  # (k,) int64
        if positions.numel() and int(positions.max()) >= sample.numel():
            raise ValueError(
                f"a sparse int4 payload names sample position {int(positions.max())} but step {step}'s sample has "
                f"{sample.numel()} entries; every cluster must use the same seed and step counter"
            )
        values = decode_int4(reader.take(int4_nbytes(k, self.group_size)), k, self.group_size)  # (k,) fp32
        reader.expect_end()
        return sample.to(positions.device)[positions], values

    def decode(self, payload: Payload, numel: int, *, step: int) -> torch.Tensor:
        """A payload -> (numel,) fp32: the k decoded values at their coordinates, zeros elsewhere."""
        indices, values = self.decode_sparse(payload, numel, step=step)
        dense = torch.zeros(numel, dtype=torch.float32, device=values.device)
        dense[indices] = values
        return dense

    # state --------------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The options: encoding has no other state (the sample depends on the seed and the caller's step)."""
        return {
            "kind": self.name,
            "sample_ratio": self.sample_ratio,
            "topk_ratio": self.topk_ratio,
            "group_size": self.group_size,
            "seed": self.seed,
        }

    def __repr__(self) -> str:
        return (
            f"SparseInt4Codec(sample_ratio={self.sample_ratio}, topk_ratio={self.topk_ratio}, "
            f"group_size={self.group_size}, seed={self.seed})"
        )


def _check_step(step: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step = {step!r} must be an integer >= 0: the sync's step counter, the same on every cluster")


def _position_bytes(positions: torch.Tensor, width: int) -> torch.Tensor:
    """(k,) int64 positions -> (width * k,) uint8: little-endian uint16 (width 2) or native int32 (width 4)."""
    if width == 2:
        return uint16_bytes(positions)
    return positions.to(torch.int32).view(torch.uint8)


def _read_positions(reader: ByteReader, k: int, width: int) -> torch.Tensor:
    """The inverse of `_position_bytes`: the next `width * k` bytes -> (k,) int64."""
    if width == 2:
        return read_uint16s(reader, k)
    return reader.read(torch.int32, k).to(torch.int64)
