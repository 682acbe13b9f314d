"""The scalable reducers of a compressed pseudo-gradient: about 2 x payload per rank for any number of clusters,
where `GatherReducer` (`sync/reducers.py`) costs (C-1) x payload (`compression.reduction`).

Both ways below average with the same step, `_average_sections`: the vector is cut into C chunks, chunk j of every
cluster goes to cluster j (all-to-all, (C-1)/C of the payload out), cluster j decodes the C versions, averages
them, encodes the mean again (re-quantization, always round-to-nearest) and the means are all-gathered ((C-1)/C
out). Every cluster decodes the same bytes, so all end with the same mean.

- Elementwise codecs (fp16, bf16, int4), `ScalableElementwiseReducer`: the dp slice of the pseudo-gradient is
  averaged that way.
- Low-rank codecs (lowrank, lowrank_int4), `ScalableLowRankReducer`: PowerSGD's linear factors (Vogels et al.
  2019, arXiv 1905.13727). Low-rank payloads cannot be summed (P1 Q1^T + P2 Q2^T is not a rank-r product),
  but with a right factor Q (n, r) that every cluster shares, P_i = M_i Q is linear in M_i: the mean of the P_i
  is (mean M) Q. So P is averaged,
  orthonormalized the same way on every cluster into P^, then Q_i = M_i^T P^ is averaged, and
  mean M ~= P^ mean(Q_i)^T. Small tensors and matrices sent dense ride with P. The averaged Q is the next round's
  shared warm start. Two averages one after the other: four link steps, four latencies.
- `adaptive` is not offered: its rank comes from each cluster's own spectrum, and this path needs one rank that
  every cluster agrees on before it starts (config validation says so).

Error feedback (per rank, `compression.error_feedback`): what this rank's encoding lost is added to its next
pseudo-gradient; for a low-rank matrix that is `u_i - P^ Q_i^T`, the part of the input outside the shared subspace
(plus Q_i's own quantization error). Re-quantizing a mean loses a little more, which is not fed back: it is bounded
by half an int4 step of the mean and does not accumulate (an fp32 or fp16 factor format re-encodes exactly or near).

Bytes per rank r for one average of chunks of s_j bytes: all-to-all sends sum(s) - s_r and receives (C-1) s_r;
the ring all-gather sends sum(s) - s_(r+1) and receives sum(s) - s_r (`chunk_nbytes` gives s).

Elastic runs (`counted`): every chunk of the all-to-all ends with one fp32 count of its sender (1, or 0 for a cluster
that abstains: new to the round), and chunk j's owner divides by the senders it counted instead of C, so an abstaining
cluster is left out of the mean as the gather reduction leaves it out (4 bytes more per chunk). The chunks are cut
for the world of the launch; `sent` starts with that world, and a sync sent again over a quorum of another size (an
elastic redo, a resume) is encoded again from its input for the new one.

    reducer = ScalableLowRankReducer(codec, flat.shapes, error_feedback=True, channel=channel, dp_group=dp_group)
    pending = reducer.launch(pseudo_grad)
    avg_pseudo_grad = pending.wait()
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dilocox.compress import Int4Format, LowRankCodec, ValueFormat
from dilocox.compress.codecs import CastFormat, Codec, as_matrix, sent_dense
from dilocox.compress.lowrank import orthonormalize
from dilocox.compress.payload import ByteReader, tensor_bytes
from dilocox.net.channel import Wire
from dilocox.sync.base import CodecCost, shard_bounds
from dilocox.sync.reducers import CodecReducer, PendingMean

_HEADER_BYTES = 16  # `sent` opens with (world, sender) as two int64


def _header(world: int, sender: bool, device: torch.device) -> torch.Tensor:
    return tensor_bytes(torch.tensor([world, int(sender)], dtype=torch.int64, device=device))


def _read_header(sent: torch.Tensor) -> tuple[int, bool]:
    world, sender = (int(v) for v in sent[:_HEADER_BYTES].view(torch.int64))
    return world, bool(sender)


@dataclass(frozen=True)
class Section:
    """A vector averaged in one format: chunk j of it travels as `fmt.nbytes(len_j)` bytes."""

    numel: int
    fmt: ValueFormat


def chunk_lengths(numel: int, world: int) -> list[int]:
    """Values of each of the `world` chunks of a vector (equal, the first ones one longer)."""
    return [end - start for start, end in (shard_bounds(numel, world, j) for j in range(world))]


def chunk_nbytes(sections: Sequence[Section], world: int) -> list[int]:
    """Exact bytes of chunk j (every section's chunk j, back to back) for j in range(world)."""
    sizes = [0] * world
    for section in sections:
        for j, length in enumerate(chunk_lengths(section.numel, world)):
            sizes[j] += section.fmt.nbytes(length)
    return sizes


def _encode_chunks(values: Sequence[torch.Tensor], sections: Sequence[Section], world: int) -> list[torch.Tensor]:
    """One uint8 payload per chunk index: every section's chunk j encoded in its format."""
    pieces: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for vector, section in zip(values, sections, strict=True):
        for j in range(world):
            start, end = shard_bounds(section.numel, world, j)
            if end > start:
                pieces[j].append(section.fmt.encode_runs([vector[start:end]]))
    device = values[0].device if values else None
    return [torch.cat(p) if p else torch.empty(0, dtype=torch.uint8, device=device) for p in pieces]


def _decode_chunk(data: torch.Tensor, sections: Sequence[Section], world: int, index: int) -> list[torch.Tensor]:
    """The payload of chunk `index` -> that chunk of every section (fp32)."""
    reader = ByteReader(data)
    out = []
    for section in sections:
        start, end = shard_bounds(section.numel, world, index)
        out.append(
            section.fmt.decode_runs(reader, [end - start])[0] if end > start else data.new_zeros(0, dtype=torch.float32)
        )
    reader.expect_end()
    return out


def _decode_chunks(chunks: Sequence[torch.Tensor], sections: Sequence[Section], world: int) -> list[torch.Tensor]:
    """Chunk j of every section from `chunks[j]`, for j in range(world) -> every section's whole vector (fp32)."""
    parts = [_decode_chunk(data, sections, world, j) for j, data in enumerate(chunks)]
    return [torch.cat([part[k] for part in parts]) for k in range(len(sections))]


def _nearest(fmt: ValueFormat) -> ValueFormat:
    """The format without stochastic rounding: re-quantization on the communicator thread must not draw from the
    codec's generator, which the trainer's thread uses (and must be the same bytes on a resumed run)."""
    if isinstance(fmt, Int4Format) and fmt.generator is not None:
        return Int4Format(fmt.group_size)
    return fmt


def _count_section(world: int) -> Section:
    """One fp32 value in every chunk: 1 from a cluster that sends its update, 0 from one that abstains."""
    return Section(world, CastFormat(torch.float32))


def _average_sections(
    wire: Wire, chunks: list[torch.Tensor], sections: Sequence[Section], *, counted: bool = False
) -> list[torch.Tensor]:
    """Average over the clusters the vectors whose encoded chunks are `chunks`; every cluster gets the same result.
    `counted`: the last section is `_count_section`, and the mean is over the clusters it counts (the others'
    sections are returned)."""
    world, rank = wire.world_size, wire.rank
    sizes = chunk_nbytes(sections, world)
    mine = wire.all_to_all(chunks, [sizes[rank]] * world)  # chunk `rank` of every cluster
    reduced, requant = _mean_chunk(mine, sections, world, rank, counted=counted)
    gathered = wire.all_gather(reduced, chunk_nbytes(requant, world))
    return _decode_chunks(gathered, requant, world)


def _mean_chunk(
    arrived: Sequence[torch.Tensor], sections: Sequence[Section], world: int, index: int, *, counted: bool = False
) -> tuple[torch.Tensor, list[Section]]:
    """Chunk `index` of every cluster's vectors (`arrived`, one payload each) -> their mean, encoded again rounded to
    nearest (the same bytes on every cluster), and the sections it is written in. `counted`: the last section is
    `_count_section`, the mean is over the clusters it counts, and the count is not written again."""
    decoded = [_decode_chunk(data, sections, world, index) for data in arrived]
    senders = float(sum(float(d[-1].sum()) for d in decoded)) if counted else world
    sections = sections[:-1] if counted else sections
    means = [torch.stack([d[k] for d in decoded]).sum(0).div_(max(senders, 1)) for k in range(len(sections))]
    requant = [Section(s.numel, _nearest(s.fmt)) for s in sections]
    reduced = torch.cat(
        [s.fmt.encode_runs([mean]) for s, mean in zip(requant, means, strict=True) if mean.numel()]
        or [torch.empty(0, dtype=torch.uint8, device=arrived[0].device if arrived else None)]
    )
    return reduced, requant


@dataclass
class LowRankPlan:
    """How a vector of tensors is split for the low-rank path: which tensors go low-rank, dense, or small; and the
    steps of PowerSGD's shared factors over it (module docstring)."""

    shapes: list[torch.Size]
    lowrank: list[int]  # tensor indices sent as factors
    dense: list[int]  # matrices sent whole in the factor format
    small: list[int]  # 0-D / 1-D tensors in the small format
    ranks: dict[int, int]

    @classmethod
    def of(cls, shapes: Sequence[torch.Size], rank: int) -> LowRankPlan:
        plan = cls(list(shapes), [], [], [], {})
        for index, shape in enumerate(plan.shapes):
            if len(shape) <= 1:
                plan.small.append(index)
                continue
            rows, cols = shape[0], shape.numel() // shape[0]
            matrix_rank = min(rank, rows, cols)
            if sent_dense(matrix_rank, rows, cols):
                plan.dense.append(index)
            else:
                plan.lowrank.append(index)
                plan.ranks[index] = matrix_rank
        return plan

    def cols(self, index: int) -> int:
        """n of tensor `index` seen as the matrix (shape[0], numel / shape[0])."""
        return self.shapes[index].numel() // self.shapes[index][0]

    def numels(self, indices: list[int]) -> list[int]:
        return [self.shapes[i].numel() for i in indices]

    @property
    def p_numel(self) -> int:
        """Values of all left factors P (m, r), which open the first step's factor section."""
        return sum(self.shapes[i][0] * self.ranks[i] for i in self.lowrank)

    @property
    def q_numel(self) -> int:
        """Values of all right factors Q (n, r): the second step's section."""
        return sum(self.cols(i) * self.ranks[i] for i in self.lowrank)

    def sections_first(self, codec: LowRankCodec) -> list[Section]:
        """[P factors + dense matrices] in the factor format, [small tensors] in the small format."""
        return [
            Section(self.p_numel + sum(self.numels(self.dense)), codec.factor_format),
            Section(sum(self.numels(self.small)), codec.small_format),
        ]

    def section_second(self, codec: LowRankCodec) -> Section:
        """[Q factors], re-encoded as a mean is (rounded to nearest)."""
        return Section(self.q_numel, _nearest(codec.factor_format))

    def split(self, u: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.split(u, [shape.numel() for shape in self.shapes]))

    def warm_start(self, warm_starts: dict[int, torch.Tensor], seed: int, index: int) -> torch.Tensor:
        """The shared right factor of tensor `index`: seeded the same on every cluster, then the averaged Q
        (`warm_starts`). A cluster that joins an elastic run starts without it, and needs none: it abstains (its
        factors are zeros) until its first landing, which sets the same averaged Q on every member."""
        q, shape = warm_starts.get(index), (self.cols(index), self.ranks[index])
        if q is None or q.shape != shape or not bool(torch.isfinite(q).all()) or float(q.norm()) == 0.0:
            generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
            q = torch.randn(*shape, generator=generator)  # drawn on the CPU: the same on every cluster and device
        return q

    def first_values(self, u: torch.Tensor, warm_starts: dict[int, torch.Tensor], seed: int) -> list[torch.Tensor]:
        """The values of the first step's two sections for the input `u`: P = M Q of every low-rank tensor (Q its
        shared warm start) and the dense matrices, then the small tensors."""
        tensors = self.split(u)
        factors = [
            as_matrix(tensors[i].view(self.shapes[i])) @ self.warm_start(warm_starts, seed, i).to(u)
            for i in self.lowrank
        ]
        dense = [tensors[i] for i in self.dense]
        small = [tensors[i] for i in self.small]
        return [
            torch.cat([f.reshape(-1) for f in factors] + dense) if factors or dense else u.new_zeros(0),
            torch.cat(small) if small else u.new_zeros(0),
        ]

    def sent_whole(self, first: list[torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
        """(index, values) of the dense matrices and small tensors in the first step's two sections."""
        factor, small = first
        parts = list(zip(self.dense, factor[self.p_numel :].split(self.numels(self.dense)), strict=True))
        return parts + list(zip(self.small, small.split(self.numels(self.small)), strict=True))

    def whole_residuals(self, u: torch.Tensor, first: list[torch.Tensor]) -> list[torch.Tensor]:
        """What the encoding of the parts sent whole lost (zeros for the low-rank tensors, known at the end)."""
        tensors = self.split(u)
        residuals = [torch.zeros_like(t) for t in tensors]
        for index, decoded in self.sent_whole(first):
            residuals[index] = tensors[index] - decoded
        return [r.view(s) for r, s in zip(residuals, self.shapes, strict=True)]

    def own_q(self, u: torch.Tensor, mean_p: torch.Tensor) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """The averaged P orthonormalized into each tensor's basis P^ (the same on every cluster), and this input's
        Q = M^T P^ of every low-rank tensor, as one vector."""
        tensors = self.split(u)
        offset, bases = 0, {}
        for i in self.lowrank:
            rows = self.shapes[i][0]
            length = rows * self.ranks[i]
            bases[i] = orthonormalize(mean_p[offset : offset + length].view(rows, self.ranks[i]))
            offset += length
        own = [(bases[i].T @ as_matrix(tensors[i].view(self.shapes[i]))).T for i in self.lowrank]  # (n, r)
        return bases, torch.cat([q.reshape(-1) for q in own]) if own else u.new_zeros(0)

    def assemble(
        self,
        u: torch.Tensor,
        first: list[torch.Tensor],
        bases: dict[int, torch.Tensor],
        mean_q: torch.Tensor,
        own_q: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """(the mean, P^ mean(Q)^T of every low-rank tensor and the parts sent whole; the next warm starts, the
        averaged Q; what this input's factors lost, u - P^ Q^T, per low-rank tensor)."""
        tensors = self.split(u)
        result = [u.new_zeros(s.numel()) for s in self.shapes]
        for index, values in self.sent_whole(first):
            result[index] = values
        offset, warm, lost = 0, {}, {}
        for i in self.lowrank:
            cols = self.cols(i)
            length = cols * self.ranks[i]
            mean = mean_q[offset : offset + length].view(cols, self.ranks[i])
            own = own_q[offset : offset + length].view(cols, self.ranks[i])
            offset += length
            result[i] = (bases[i] @ mean.T).reshape(-1)
            warm[i] = mean.clone()
            lost[i] = (tensors[i] - (bases[i] @ own.T).reshape(-1)).view(self.shapes[i])
        return (torch.cat(result) if result else u.new_zeros(0)), warm, lost


class _ScalableReducer(CodecReducer):
    """What both scalable reducers share: launch/relaunch around a program of link steps."""

    name = "scalable"
    judges_each = False

    def __init__(self, codec: Codec, shapes: Sequence[torch.Size], *, counted: bool = False, **options: Any) -> None:
        super().__init__(codec, shapes, **options)
        self.counted = counted
        """Elastic runs: the chunks carry their senders' count, so an abstaining cluster is left out of the mean
        (module docstring)."""

    def launch(self, pseudo_grad: torch.Tensor) -> PendingMean:
        """Add the residuals to this replica's slice, encode what goes first (on the trainer's thread: the codec's
        RNG may round stochastically) and start the program on the communicator thread."""
        encode_from = time.perf_counter()
        corrected = self.feedback.corrected(self.slice.tensors(pseudo_grad))
        u = torch.cat([t.reshape(-1) for t in corrected]) if corrected else pseudo_grad.new_zeros(0)  # (slice,)
        sent = self._encode(u)
        return self._start(pseudo_grad, sent, codec_s=time.perf_counter() - encode_from, account=True)

    def relaunch(self, sent: torch.Tensor, *, account: bool) -> PendingMean:
        world, sender = _read_header(sent)
        zeros = torch.zeros(self.numel, device=sent.device)
        if not sender:  # an abstention (counted): abstains again
            sent = self._encode(zeros[: self.slice.numel], sender=False)
        elif world != self.channel.world_size:  # another quorum's size: its chunks are cut again, from the same input
            sent = self._encode(self._input_of(sent[_HEADER_BYTES:], world))
        return self._start(zeros, sent, codec_s=0.0, account=account)

    def abstain(self, pseudo_grad: torch.Tensor) -> PendingMean:
        if not self.counted:  # sends only the (finite) residuals of earlier rounds, counted as this cluster's update
            return self.launch(torch.zeros_like(pseudo_grad))
        zeros = pseudo_grad.new_zeros(self.slice.numel)  # counted 0: left out; the residuals wait for its next round
        return self._start(torch.zeros_like(pseudo_grad), self._encode(zeros, sender=False), codec_s=0.0, account=True)

    def _split(self, u: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.split(u, [shape.numel() for shape in self.slice.shapes]))

    def _counts(self, world: int, sender: bool, like: torch.Tensor) -> list[torch.Tensor]:
        """The values of `_count_section` when counted (none otherwise)."""
        return [torch.full((world,), float(sender), device=like.device)] if self.counted else []

    def _with_count(self, sections: list[Section], world: int) -> list[Section]:
        return [*sections, _count_section(world)] if self.counted else sections

    def _encode(self, u: torch.Tensor, *, sender: bool = True) -> torch.Tensor:
        """What this rank sends for the slice's input `u` (saved by a checkpoint in flight): the header, then the
        chunks for the channel's world; a sender keeps the residuals known at launch, an abstention (`sender`
        False, `u` zeros) keeps its residuals as they are."""
        raise NotImplementedError

    def _input_of(self, body: torch.Tensor, world: int) -> torch.Tensor:
        """The input `u` that `body` (`sent` after its header) was encoded from for `world` clusters."""
        raise NotImplementedError

    def _program(
        self, body: torch.Tensor, world: int, sender: bool
    ) -> tuple[Callable[[Wire], dict[str, Any]], Callable[[dict[str, Any]], torch.Tensor], int]:
        """(the program run on the communicator thread, the finishing step on the trainer's, payload bytes)."""
        raise NotImplementedError

    def _start(self, flat: torch.Tensor, sent: torch.Tensor, *, codec_s: float, account: bool) -> PendingMean:
        world, sender = _read_header(sent)
        if world != self.channel.world_size:
            raise ValueError(
                f"a scalable sync in flight was encoded for {world} clusters and is sent over {self.channel.world_size}"
            )
        program, assemble, payload_bytes = self._program(sent[_HEADER_BYTES:], world, sender)
        cost = CodecCost(payload_bytes=payload_bytes, dense_bytes=4 * self.slice.numel, codec_s=codec_s)
        transfer = self.channel.launch_program(program, kind="scalable_mean", account=account, device=sent.device)

        def finish() -> torch.Tensor:
            out = transfer.wait()
            finish_from = time.perf_counter()
            mean = assemble(out)
            cost.codec_s += out["compute_s"] + time.perf_counter() - finish_from
            return mean

        return PendingMean(flat, self.slice.bounds, finish, transfer, self.dp_group, sent=sent, cost=cost)

    def _chunks(self, body: torch.Tensor, sections: Sequence[Section], world: int) -> list[torch.Tensor]:
        """`body`'s chunks, checked against their sizes (a checkpoint of other settings does not fit)."""
        sizes = chunk_nbytes(sections, world)
        if body.numel() != sum(sizes):
            raise ValueError(
                f"a scalable sync in flight of {body.numel()} bytes does not fit chunks of {sum(sizes)} bytes for "
                f"{world} clusters: it was saved with other settings or by another version of dilocox"
            )
        return list(torch.split(body, sizes))


class ScalableElementwiseReducer(_ScalableReducer):
    """fp16, bf16 or int4: the slice is averaged in one `_average_sections` (module docstring)."""

    def _sections(self, world: int) -> list[Section]:
        return self._with_count([Section(self.slice.numel, self.codec.value_format)], world)  # type: ignore[attr-defined]

    def _encode(self, u: torch.Tensor, *, sender: bool = True) -> torch.Tensor:
        world = self.channel.world_size
        sections = self._sections(world)
        chunks = _encode_chunks([u, *self._counts(world, sender, u)], sections, world)
        if self.feedback.enabled and sender:
            local = _decode_chunks(chunks, sections, world)[0]
            residuals = self._split(u - local)
            self.feedback.keep([r.view(s) for r, s in zip(residuals, self.slice.shapes, strict=True)])
        return torch.cat([_header(world, sender, u.device), *chunks])

    def _input_of(self, body: torch.Tensor, world: int) -> torch.Tensor:
        """What was sent, plus what its encoding lost (the residuals it kept): the input itself."""
        sections = self._sections(world)
        local = _decode_chunks(self._chunks(body, sections, world), sections, world)[0]
        residuals = self.feedback.residuals if self.feedback.enabled else None
        return local if residuals is None else local + torch.cat([r.reshape(-1) for r in residuals]).to(local)

    def _program(self, body: torch.Tensor, world: int, sender: bool):
        sections = self._sections(world)
        chunks = self._chunks(body, sections, world)

        def program(wire: Wire) -> dict[str, Any]:
            (mean,) = _average_sections(wire, chunks, sections, counted=self.counted)
            return {"mean": mean, "compute_s": 0.0}  # decoding is part of the link steps

        return program, lambda out: out["mean"], body.numel()


class ScalableLowRankReducer(_ScalableReducer):
    """lowrank or lowrank_int4: PowerSGD's shared right factors, two averages (module docstring)."""

    def __init__(self, codec: Codec, shapes: Sequence[torch.Size], **options: Any) -> None:
        super().__init__(codec, shapes, **options)
        self.plan = LowRankPlan.of(self.slice.shapes, self.codec.rank)  # type: ignore[attr-defined]
        self.warm_starts: dict[int, torch.Tensor] = {}  # shared (n, r) per low-rank tensor index

    def _sections_first(self, world: int) -> list[Section]:
        return self._with_count(self.plan.sections_first(self.codec), world)  # type: ignore[arg-type]

    def _sections_second(self, world: int) -> list[Section]:
        return self._with_count([self.plan.section_second(self.codec)], world)  # type: ignore[arg-type]

    def _encode(self, u: torch.Tensor, *, sender: bool = True) -> torch.Tensor:
        """The input u itself rides in front of the first step's chunks (the second step needs it, and a resumed
        run must be able to run both steps again). Residuals: the parts sent as they are (dense matrices, small
        tensors) get theirs now, low-rank tensors when the sync finishes (`_assemble`)."""
        world = self.channel.world_size
        sections = self._sections_first(world)
        values = self.plan.first_values(u, self.warm_starts, self.seed)
        chunks = _encode_chunks([*values, *self._counts(world, sender, u)], sections, world)
        if self.feedback.enabled and sender:
            self.feedback.keep(self.plan.whole_residuals(u, _decode_chunks(chunks, sections, world)[:2]))
        return torch.cat([_header(world, sender, u.device), tensor_bytes(u), *chunks])

    def _input_of(self, body: torch.Tensor, world: int) -> torch.Tensor:
        return body[: 4 * self.slice.numel].view(torch.float32)

    def _program(self, body: torch.Tensor, world: int, sender: bool):
        plan = self.plan
        first_sections, second_sections = self._sections_first(world), self._sections_second(world)
        u = self._input_of(body, world)
        chunks = self._chunks(body[4 * self.slice.numel :], first_sections, world)
        counted = self.counted

        def program(wire: Wire) -> dict[str, Any]:
            compute_from = time.perf_counter()
            t0 = time.perf_counter()
            first_mean = _average_sections(wire, chunks, first_sections, counted=counted)
            wire_s = time.perf_counter() - t0
            bases, q_vector = plan.own_q(u, first_mean[0])
            q_chunks = _encode_chunks([q_vector, *self._counts(world, sender, u)], second_sections, world)
            own_q_decoded = _decode_chunks(q_chunks, second_sections, world)[0]
            t0 = time.perf_counter()
            (mean_q,) = _average_sections(wire, q_chunks, second_sections, counted=counted)
            wire_s += time.perf_counter() - t0
            return {
                "first": first_mean,
                "bases": bases,
                "mean_q": mean_q,
                "own_q": own_q_decoded,
                "compute_s": time.perf_counter() - compute_from - wire_s,
            }

        payload_bytes = sum(c.numel() for c in chunks) + sum(chunk_nbytes(second_sections, world))
        return program, lambda out: self._assemble(out, u, sender), payload_bytes

    def _assemble(self, out: dict[str, Any], u: torch.Tensor, sender: bool) -> torch.Tensor:
        """The averaged slice, the new warm starts, and the low-rank residuals (a cluster that abstained keeps its
        own)."""
        mean, warm, lost = self.plan.assemble(u, out["first"], out["bases"], out["mean_q"], out["own_q"])
        self.warm_starts.update(warm)
        if sender:
            for index, residual in lost.items():
                self.feedback.keep_one(index, residual)
        return mean

    def state_bytes(self) -> int:
        return super().state_bytes() + sum(q.numel() * 4 for q in self.warm_starts.values())

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["warm_starts"] = {str(i): q.clone() for i, q in self.warm_starts.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.warm_starts = {int(i): q.clone() for i, q in state["warm_starts"].items()}
