"""Codecs for pseudo-gradients on the slow link: none, fp16, bf16, int4, lowrank, lowrank_int4 (and adaptive).

A codec turns a list of tensors into one `Payload` whose size is exact and, for every kind but `adaptive`, fixed
by the shapes: the sum over the tensors of the sizes below, with `k` a tensor's number of values,
`g = group_size` and `int4(k) = 2 * ceil(k / g) + ceil(k / 2)`:

| kind | tensor of k values | matrix (m, n), r = min(rank, m, n), low-rank | ... sent dense |
| --- | --- | --- | --- |
| none | 4k | | |
| fp16, bf16 | 2k | | |
| int4 | int4(k) | | |
| lowrank | 0-D/1-D: 4k (raw) or int4(k) | 2 + 4 r (m + n) | 2 + 4 m n |
| lowrank, factor_dtype fp16/bf16 | 0-D/1-D: as above | 2 + 2 r (m + n) | 2 + 2 m n |
| lowrank_int4, adaptive | 0-D/1-D: as above | 2 + int4(r m) + int4(r n) | 2 + int4(m n) |

The low-rank kinds treat a tensor of 2 or more dims as the matrix (shape[0], numel / shape[0]) and a 0-D or 1-D
tensor (norms, biases) as a small tensor sent raw fp32 or int4 (`small_tensors`). A matrix is sent dense (in the
factors' encoding: raw fp32 for `lowrank`) when r (m + n) >= m n, i.e. when its factors would not hold fewer
values than the matrix itself.

Byte layout of a list (no list header; the receiver knows the shapes):
1. low-rank kinds only: one little-endian uint16 per matrix, in order: its rank, 0 meaning dense;
2. low-rank kinds only: the small tensors, in order, as one run each (`small_tensors` encoding);
3. the value runs, in order: for an elementwise kind every tensor flattened; for a low-rank kind, per matrix,
   either the dense matrix (row-major) or P^T (r, m) then Q^T (r, n) row-major, with matrix ~= P Q^T.
A section of fp32/fp16/bf16 runs is their values back to back; a section of int4 runs is the fp16 scales of
every run, then the packed codes of every run (`dilocox.compress.int4`). All headers come first so that a
receiver learns every run's length before the values, and a section is encoded and decoded in one batched pass.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from dilocox.compress.config import MAX_RANK
from dilocox.compress.int4 import decode_int4_runs, encode_int4_runs, int4_nbytes
from dilocox.compress.lowrank import Factors, factorize
from dilocox.compress.payload import ByteReader, Payload, numel_of, read_uint16s, tensor_bytes, uint16_bytes

Shape = Sequence[int]


# --------------------------------------------------------------------------------------------------- value formats


class ValueFormat(ABC):
    """How runs of fp32 values are written to bytes, many runs at once; the building block of every codec.

    fmt = Int4Format(group_size=64)
    data = fmt.encode_runs([a, b])                   # (fmt.section_nbytes([a.numel(), b.numel()]),) uint8
    a2, b2 = fmt.decode_runs(ByteReader(data), [a.numel(), b.numel()])   # flat fp32
    """

    name: str

    @abstractmethod
    def nbytes(self, numel: int) -> int:
        """Exact bytes of one run of `numel` values."""

    def section_nbytes(self, lengths: Sequence[int]) -> int:
        """Exact bytes of runs of `lengths` encoded together (one `encode_runs` call): the sum over the runs, unless
        a format packs its runs tighter together than alone (`LowBitFormat` pads its bit stream once)."""
        return sum(self.nbytes(length) for length in lengths)

    @abstractmethod
    def encode_runs(self, runs: Sequence[torch.Tensor]) -> torch.Tensor:
        """fp32 tensors (flattened) -> (sum of nbytes,) uint8."""

    @abstractmethod
    def decode_runs(self, reader: ByteReader, lengths: Sequence[int]) -> list[torch.Tensor]:
        """Reads the section of runs of `lengths` -> one (k,) fp32 tensor per run."""


class CastFormat(ValueFormat):
    """Values cast to a float dtype and sent as its raw bytes (fp32: exact; fp16/bf16: rounded to nearest).

    fp16 turns values above 65504 into inf; bf16 keeps fp32's range with 8 bits of mantissa.

        fmt = CastFormat(torch.float16)
        data = fmt.encode_runs([values])                 # (2k,) uint8
        (values,) = fmt.decode_runs(ByteReader(data), [k])
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.name = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
        self._itemsize = torch.empty(0, dtype=dtype).element_size()

    def nbytes(self, numel: int) -> int:
        return self._itemsize * numel

    def encode_runs(self, runs: Sequence[torch.Tensor]) -> torch.Tensor:
        flat = torch.cat([run.reshape(-1) for run in runs])  # (sum k,) fp32
        return tensor_bytes(flat.to(self.dtype))

    def decode_runs(self, reader: ByteReader, lengths: Sequence[int]) -> list[torch.Tensor]:
        values = reader.read(self.dtype, sum(lengths)).to(torch.float32)
        return list(torch.split(values, list(lengths)))


class Int4Format(ValueFormat):
    """Group-wise absmax int4 (see `dilocox.compress.int4`): every run's fp16 scales, then every run's codes.

    fmt = Int4Format(group_size=64, generator=torch.Generator().manual_seed(0))   # stochastic rounding
    data = fmt.encode_runs([values])                 # (int4_nbytes(k, 64),) uint8
    (values,) = fmt.decode_runs(ByteReader(data), [k])
    """

    name = "int4"

    def __init__(self, group_size: int, generator: torch.Generator | None = None) -> None:
        self.group_size = group_size
        self.generator = generator

    def nbytes(self, numel: int) -> int:
        return int4_nbytes(numel, self.group_size)

    def encode_runs(self, runs: Sequence[torch.Tensor]) -> torch.Tensor:
        return encode_int4_runs(runs, self.group_size, generator=self.generator)

    def decode_runs(self, reader: ByteReader, lengths: Sequence[int]) -> list[torch.Tensor]:
        data = reader.take(self.section_nbytes(lengths))
        return decode_int4_runs(data, lengths, self.group_size)


# ---------------------------------------------------------------------------------------------------------- codecs


class Codec(ABC):
    """Encodes tensors into one exact-size `Payload` and decodes it back to fp32 from the shapes alone.

    The interface of DiLoCoX's pseudo-gradient compression (Qi et al. 2025, arXiv 2506.21263;
    docs/design.md §4). Encoding may update per-instance state (warm starts, the RNG of stochastic rounding, an adaptive
    rank), which `state_dict()` captures for checkpoints; decoding is stateless.

        codec = build_codec(CompressionConfig(kind="lowrank_int4", rank=8))
        payload = codec.encode_list(pseudo_grads)        # one uint8 payload for the whole list
        decoded = codec.decode_list(payload, [g.shape for g in pseudo_grads])
    """

    name: str

    def __init__(self, *, generator: torch.Generator | None = None) -> None:
        # The codec's RNG (stochastic rounding, random warm starts); its formats hold the same object.
        self.generator = generator if generator is not None else torch.Generator().manual_seed(0)

    # encoding -----------------------------------------------------------------------------------------------------

    def current_rank(self) -> int | None:
        """The rank the next matrix is encoded at, for low-rank codecs (before the min(m, n) cap); else None."""
        return None

    def current_matrix_ranks(self) -> tuple[int, ...] | None:
        """The adaptive codec's rank of each matrix it measured in the last round (`compression.rank_rule` per_matrix
        or budget); None for every other codec and rank rule."""
        return None

    def observe(self, pseudo_grads: Sequence[torch.Tensor]) -> None:
        """See this round's pseudo-gradient before error feedback adds its residual (`ErrorFeedback.compress`): the
        adaptive codec measures its spectrum there; every other codec ignores it."""
        return None

    def encode(self, tensor: torch.Tensor, *, slot: int = 0) -> Payload:
        """One tensor -> its payload. `slot` names the tensor for per-tensor state (warm starts)."""
        return self.encode_list([tensor], first_slot=slot)

    def encode_list(self, tensors: Sequence[torch.Tensor], *, first_slot: int = 0) -> Payload:
        """Many tensors (e.g. one per parameter of a stage) -> one payload (layout in the module docstring).

        Tensor i uses state slot `first_slot + i`; give distinct ranges to lists encoded by the same codec.
        """
        values = [tensor.detach().to(torch.float32) for tensor in tensors]
        chunks = [chunk for chunk in self._encode_values(values, first_slot) if chunk.numel()]
        if not chunks:
            return Payload(torch.empty(0, dtype=torch.uint8, device=tensors[0].device if tensors else None))
        return Payload(torch.cat(chunks))

    @abstractmethod
    def _encode_values(self, values: list[torch.Tensor], first_slot: int) -> list[torch.Tensor]:
        """fp32 tensors -> the payload's byte chunks, (x,) uint8 each, in wire order."""

    # decoding -----------------------------------------------------------------------------------------------------

    def decode(self, payload: Payload, shape: Shape) -> torch.Tensor:
        """The payload of one tensor -> fp32 tensor of `shape`."""
        return self.decode_list(payload, [shape])[0]

    def decode_list(self, payload: Payload, shapes: Sequence[Shape]) -> list[torch.Tensor]:
        """The payload of `encode_list` -> fp32 tensors of `shapes`; every byte must be used."""
        reader = ByteReader(payload.data)
        tensors = self._decode_values(reader, [torch.Size(shape) for shape in shapes])
        reader.expect_end()
        return tensors

    def decode_list_at(
        self, payload: Payload, shapes: Sequence[Shape], offset: int = 0
    ) -> tuple[list[torch.Tensor], int]:
        """Decode one sender's tensors starting at byte `offset`; returns them and the offset just past them.

        Lets a receiver walk a concatenation of payloads of different sizes (adaptive ranks) without their sizes.
        """
        reader = ByteReader(payload.data, offset)
        tensors = self._decode_values(reader, [torch.Size(shape) for shape in shapes])
        return tensors, reader.offset

    @abstractmethod
    def _decode_values(self, reader: ByteReader, shapes: list[torch.Size]) -> list[torch.Tensor]:
        """Reads one list's bytes -> fp32 tensors of `shapes`."""

    # sizes --------------------------------------------------------------------------------------------------------

    @abstractmethod
    def expected_nbytes(self, shape: Shape) -> int | None:
        """Exact payload bytes of one tensor of `shape`, or None when the size varies (adaptive rank)."""

    def max_nbytes(self, shape: Shape) -> int:
        """An upper bound on the payload bytes of one tensor of `shape` (== expected_nbytes when fixed)."""
        expected = self.expected_nbytes(shape)
        assert expected is not None, f"{type(self).__name__} must override max_nbytes"
        return expected

    def expected_nbytes_list(self, shapes: Sequence[Shape]) -> int | None:
        """Exact payload bytes of `encode_list` over tensors of `shapes` (the sum per shape), or None if it varies."""
        sizes = [self.expected_nbytes(shape) for shape in shapes]
        return None if any(size is None for size in sizes) else sum(sizes)  # type: ignore[arg-type]

    def max_nbytes_list(self, shapes: Sequence[Shape]) -> int:
        """An upper bound on the payload bytes of `encode_list` over tensors of `shapes`."""
        return sum(self.max_nbytes(shape) for shape in shapes)

    # state --------------------------------------------------------------------------------------------------------

    def state_bytes(self) -> int:
        """Bytes of the state kept between rounds (warm starts), for the memory report."""
        return 0

    def state_dict(self) -> dict[str, Any]:
        """Everything encoding depends on besides the inputs: the RNG and, in subclasses, warm starts."""
        return {"kind": self.name, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != self.name:
            raise ValueError(
                f"codec state of kind {state.get('kind')!r} cannot be loaded into a {self.name!r} codec; resume "
                "with the compression.kind the checkpoint was written with"
            )
        self.generator.set_state(state["generator"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class ElementwiseCodec(Codec):
    """Every value encoded on its own: `none` (raw fp32, bit-exact), `fp16`, `bf16`, `int4` (group absmax), `int2` and
    `sign` (`dilocox.compress.lowbit`; a list packs its codes in one bit stream, `expected_nbytes_list`).

    The fixed-size codecs around DiLoCoX's scheme (Qi et al. 2025, arXiv 2506.21263): `none` is its "without
    compression" ablation, `int4` its quantizer applied to the whole pseudo-gradient.

        codec = build_codec(CompressionConfig(kind="int4", group_size=64))
        payload = codec.encode(pseudo_grad)              # payload.nbytes == codec.expected_nbytes(shape)
        approx = codec.decode(payload, pseudo_grad.shape)
    """

    def __init__(self, name: str, value_format: ValueFormat, *, generator: torch.Generator | None = None) -> None:
        super().__init__(generator=generator)
        self.name = name
        self.value_format = value_format

    def _encode_values(self, values: list[torch.Tensor], first_slot: int) -> list[torch.Tensor]:
        return [self.value_format.encode_runs(values)] if values else []

    def _decode_values(self, reader: ByteReader, shapes: list[torch.Size]) -> list[torch.Tensor]:
        runs = self.value_format.decode_runs(reader, [numel_of(shape) for shape in shapes]) if shapes else []
        return [run.view(shape) for run, shape in zip(runs, shapes, strict=True)]

    def expected_nbytes(self, shape: Shape) -> int:
        return self.value_format.nbytes(numel_of(shape))

    def expected_nbytes_list(self, shapes: Sequence[Shape]) -> int:
        return self.value_format.section_nbytes([numel_of(shape) for shape in shapes])

    def max_nbytes_list(self, shapes: Sequence[Shape]) -> int:
        return self.expected_nbytes_list(shapes)

    def __repr__(self) -> str:
        return f"ElementwiseCodec(name={self.name!r}, values={self.value_format.name})"


class LowRankCodec(Codec):
    """Rank-r factors P (m, r), Q (n, r) of each matrix, matrix ~= P Q^T, from warm-started power iteration.

    DiLoCoX (Qi et al. 2025, arXiv 2506.21263) compresses pseudo-gradients with low-rank factors quantized to
    int4 (`lowrank_int4`). One subspace iteration per round starts from the previous round's right singular
    vectors of the same slot (PowerSGD's warm start), so the factors sharpen over rounds while error feedback
    carries what they miss. Tensors of 3+ dims are matrices (shape[0], numel / shape[0]); 0-D/1-D tensors use
    `small_format`; a matrix whose factors would not be smaller is sent dense.

        codec = build_codec(CompressionConfig(kind="lowrank_int4", rank=8, group_size=64))
        payload = codec.encode_list(pseudo_grads)        # state: codec.warm_starts, one (n, r) per slot
        decoded = codec.decode_list(payload, shapes)     # a fresh codec with the same settings decodes it
    """

    def __init__(
        self,
        name: str,
        *,
        rank: int,
        factor_format: ValueFormat,
        small_format: ValueFormat,
        power_iterations: int = 1,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(generator=generator)
        # The options were validated by CompressionConfig.validate(); these guard the payload format itself.
        assert 1 <= rank <= MAX_RANK and power_iterations >= 1, (rank, power_iterations)
        self.name = name
        self.rank = rank
        self.factor_format = factor_format
        self.small_format = small_format
        self.power_iterations = power_iterations
        self.sorted_factors = False
        """Rayleigh-Ritz sorting of the factors: only needed to truncate them (the adaptive rank)."""
        self.warm_starts: dict[str, torch.Tensor] = {}
        """Right factors (n, r), unit columns, of the last round per slot and matrix shape: the next round's start."""

    # encoding -----------------------------------------------------------------------------------------------------

    def current_rank(self) -> int:
        return self.rank

    def _encode_values(self, values: list[torch.Tensor], first_slot: int) -> list[torch.Tensor]:
        ranks: list[int] = []
        small_runs: list[torch.Tensor] = []
        matrix_runs: list[torch.Tensor] = []
        for index, value in enumerate(values):
            if value.dim() <= 1:
                small_runs.append(value.reshape(-1))
                continue
            matrix = as_matrix(value)  # (m, n)
            num_rows, num_cols = matrix.shape
            rank = min(self._matrix_rank(first_slot + index), num_rows, num_cols)
            if sent_dense(rank, num_rows, num_cols):
                ranks.append(0)
                matrix_runs.append(matrix.reshape(-1))
                continue
            left, right = self._matrix_factors(matrix, rank, first_slot + index).balanced()  # (r, m), (r, n)
            ranks.append(rank)
            matrix_runs.extend([left.reshape(-1), right.reshape(-1)])
        device = values[0].device if values else None
        chunks = [uint16_bytes(torch.tensor(ranks, dtype=torch.int64, device=device))]
        if small_runs:
            chunks.append(self.small_format.encode_runs(small_runs))
        if matrix_runs:
            chunks.append(self.factor_format.encode_runs(matrix_runs))
        return chunks

    def _matrix_rank(self, slot: int) -> int:
        """The rank of the matrix in `slot` this round, before the min(m, n) cap (the adaptive codec's differ)."""
        return self.current_rank()

    def _matrix_factors(self, matrix: torch.Tensor, rank: int, slot: int) -> Factors:
        return self._factorize(matrix, rank, slot)

    def _factorize(self, matrix: torch.Tensor, rank: int, slot: int) -> Factors:
        """Rank-`rank` factors of `matrix` (m, n) warm-started from the slot's previous right vectors."""
        num_rows, num_cols = matrix.shape
        key = f"{slot}:{num_rows}x{num_cols}"
        previous = self.warm_starts.get(key)  # (n, r_prev) or None
        have = 0 if previous is None else previous.shape[1]
        if previous is not None and have >= rank:
            start = previous[:, :rank].to(matrix)
        else:
            # New directions start random: a generic start recovers an exactly rank-r matrix in one iteration.
            fresh = torch.randn(num_cols, rank - have, generator=self.generator, dtype=torch.float32).to(matrix)
            start = fresh if previous is None else torch.cat([previous.to(matrix), fresh], dim=1)  # (n, rank)
        factors = factorize(matrix, start, iterations=self.power_iterations, sort=self.sorted_factors)
        if bool(torch.isfinite(factors.right).all()):  # a non-finite matrix must not poison the next round's start
            self.warm_starts[key] = factors.right
        return factors

    # decoding -----------------------------------------------------------------------------------------------------

    def _decode_values(self, reader: ByteReader, shapes: list[torch.Size]) -> list[torch.Tensor]:
        matrix_dims = [(shape[0], numel_of(shape[1:])) for shape in shapes if len(shape) > 1]  # (m, n) each
        ranks = read_uint16s(reader, len(matrix_dims)).tolist()
        lengths: list[int] = []
        for rank, (num_rows, num_cols) in zip(ranks, matrix_dims, strict=True):
            if rank > min(num_rows, num_cols) or (rank and sent_dense(rank, num_rows, num_cols)):
                raise ValueError(
                    f"payload header says rank {rank} for a ({num_rows}, {num_cols}) matrix; sender and receiver "
                    "must use the same compression settings and tensor shapes"
                )
            lengths.extend([rank * num_rows, rank * num_cols] if rank else [num_rows * num_cols])
        small_shapes = [shape for shape in shapes if len(shape) <= 1]
        small_runs = iter(
            self.small_format.decode_runs(reader, [numel_of(s) for s in small_shapes]) if small_shapes else []
        )
        matrix_runs = iter(self.factor_format.decode_runs(reader, lengths) if lengths else [])
        matrix_ranks = iter(ranks)
        tensors: list[torch.Tensor] = []
        for shape in shapes:
            if len(shape) <= 1:
                tensors.append(next(small_runs).view(shape))
                continue
            num_rows, num_cols = shape[0], numel_of(shape[1:])
            rank = next(matrix_ranks)
            if rank == 0:
                tensors.append(next(matrix_runs).view(shape))
                continue
            left = next(matrix_runs).view(rank, num_rows)
            right = next(matrix_runs).view(rank, num_cols)
            tensors.append((left.T @ right).view(shape))  # (m, r) @ (r, n)
        return tensors

    # sizes --------------------------------------------------------------------------------------------------------

    def nbytes_at_rank(self, shape: Shape, rank: int) -> int:
        """Exact payload bytes of one tensor of `shape` encoded at `rank` (see the module's table)."""
        if len(shape) <= 1:
            return self.small_format.nbytes(numel_of(shape))
        num_rows, num_cols = shape[0], numel_of(shape[1:])
        rank = min(rank, num_rows, num_cols)
        if sent_dense(rank, num_rows, num_cols):
            return 2 + self.factor_format.nbytes(num_rows * num_cols)
        return 2 + self.factor_format.nbytes(rank * num_rows) + self.factor_format.nbytes(rank * num_cols)

    def expected_nbytes(self, shape: Shape) -> int | None:
        return self.nbytes_at_rank(shape, self.rank)

    # state --------------------------------------------------------------------------------------------------------

    def state_bytes(self) -> int:
        return sum(start.numel() * start.element_size() for start in self.warm_starts.values())

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["warm_starts"] = dict(self.warm_starts)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.warm_starts = {key: value.clone() for key, value in state["warm_starts"].items()}

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, rank={self.rank}, factors={self.factor_format.name}, "
            f"small_tensors={self.small_format.name}, power_iterations={self.power_iterations})"
        )


def as_matrix(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor of 2+ dims as the matrix (shape[0], numel / shape[0]) that the low-rank codecs factorize."""
    return tensor.reshape(tensor.shape[0], numel_of(tensor.shape[1:]))


def sent_dense(rank: int, num_rows: int, num_cols: int) -> bool:
    """Whether the low-rank codecs send an (m, n) matrix dense at `rank` (already capped at min(m, n))."""
    # The factors hold r (m + n) values against m n for the matrix: send whichever has fewer.
    return rank * (num_rows + num_cols) >= num_rows * num_cols
