"""Reducers: the ways one flat pseudo-gradient is averaged over the clusters (docs/design.md §4.4).

Every reducer has the same two-phase protocol, `launch` now and `PendingMean.wait()` later, so the one-step delay
can overlap any of them with the next round, and each owns the state its averaging needs between rounds (error
feedback, codec warm starts, shared factors):

| reducer | codecs | slow-link bytes per rank |
| --- | --- | --- |
| `DenseReducer` | none (fp32) | ring all-reduce of its shard: 2 (C-1)/C x 4 x shard sent |
| `GatherReducer` | any, adaptive ranks that differ per cluster too | all-gather: (C-1) x payload received |
| `ScalableElementwiseReducer` (`scalable.py`) | fp16, bf16, int4 | ~2 x payload for any C |
| `ScalableLowRankReducer` (`scalable.py`) | lowrank, lowrank_int4 | ~2 x payload for any C, four link steps |

The vector to average must be identical on every dp replica of the cluster; each replica averages its own slice
over `cluster_group` (docs/design.md §2) and `PendingMean.wait()` all-gathers the slices over the fast dp_group.
`build_reducer` (`reducer_factory.py`) picks the reducer of a `CompressionConfig`.

    reducer = build_reducer(CompressionConfig(kind="lowrank_int4"), flat.shapes, channel=channel, dp_group=dp_group)
    pending = reducer.launch(pseudo_grad)             # encodes now, the transfer runs on the communicator thread
    avg_pseudo_grad = pending.wait()                  # (numel,) fp32, the same on every cluster
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dilocox.compress import Codec, ErrorFeedback, Payload
from dilocox.net.channel import PendingTransfer, WanChannel
from dilocox.sync.base import CodecCost, shard_bounds
from dilocox.sync.robust import (
    PEER_MIN_UPDATES,
    PeerCheck,
    UpdateGuard,
    aggregate,
    judges_state,
    load_judges_state,
    peer_statistics,
)
from dilocox.topology import group_size


@dataclass
class PendingMean:
    """An in-flight cross-cluster mean of one flat vector.

    `finish()` waits for the slow-link part and returns this dp replica's averaged slice; `wait()` then
    all-gathers the slices over the fast dp_group into `flat`. `sent` is what this rank put on the link, kept
    until `wait()` so that a checkpoint taken while the sync is in flight can save it and a resumed run can send
    it again (`Reducer.relaunch`) instead of stalling the checkpoint until the transfer arrives. `cost` is what
    compressing it cost (None for the uncompressed mean)."""

    flat: torch.Tensor
    bounds: list[tuple[int, int]]  # every dp replica's slice of `flat`
    finish: Callable[[], torch.Tensor]
    transfer: PendingTransfer
    dp_group: dist.ProcessGroup | None
    sent: torch.Tensor
    cost: CodecCost | None = None
    excluded: dict[int, str] = field(default_factory=dict)
    """Clusters whose update the guard left out of this mean, with the reason (gather reduction; set by finish)."""
    abstained: bool = False
    """This cluster sent no update (`Reducer.abstain`)."""
    report: PendingTransfer | None = None
    """Token-weighted syncs: the all-gather of every cluster's `RoundReport`, launched just before the payload."""
    report_sent: torch.Tensor | None = None
    """What this rank put in that all-gather (a checkpoint saves it beside `sent`)."""
    weights: list[float] = field(default_factory=list)
    """Token-weighted syncs: each sender's weight n_c / n_ref, from the reports, set before `wait()` (the peer check
    compares the updates' sizes per unit of weight); empty: every weight 1."""

    def wait(self) -> torch.Tensor:
        """Block until the slow-link part is done, then all-gather the slices over the fast dp_group."""
        return gather_slices_(self.flat, self.finish(), self.bounds, self.dp_group)


class Reducer(Protocol):
    """Averages a flat pseudo-gradient over the clusters, in a launch phase and a wait phase."""

    name: str
    """dense, gather or scalable: a checkpoint resumes only into the reducer that wrote it."""
    judges_each: bool
    """Whether every cluster's update arrives on its own, so that the reducer's guard judges each one (the gather
    reductions); a reduction that sums them in transit leaves the guard the mean."""

    def launch(self, pseudo_grad: torch.Tensor) -> PendingMean:
        """Start averaging `pseudo_grad` (numel,), identical on the cluster's dp replicas; it is not modified."""

    def abstain(self, pseudo_grad: torch.Tensor) -> PendingMean:
        """This cluster has no usable update this round (its own training went non-finite). The gather reduction
        sends nothing and the others leave it out; the summing reductions send zeros (they cannot leave a sender
        out without another message), which shrinks that round's mean by this cluster's share."""

    def relaunch(self, sent: torch.Tensor, *, account: bool) -> PendingMean:
        """Send again what a checkpoint saved of a sync in flight (`PendingMean.sent`): the same bytes, the same
        result; `account=False` when the restored link counters already hold the transfer."""

    def heal(self) -> None:
        """This cluster's update went bad and its parameters were reset to the agreed ones: forget what its bad
        rounds left in the reducer's own state (error-feedback residuals)."""

    def forget_last(self) -> None:
        """The others left out the update this cluster launched last: its error feedback returns to what it held
        before that encoding (`ErrorFeedback.undo`)."""

    def current_rank(self) -> int | None:
        """The low-rank codec's rank of the next encoding (adaptive: the last chosen), None for other codecs."""

    def current_matrix_ranks(self) -> tuple[int, ...] | None:
        """The adaptive codec's last chosen rank of each matrix (per_matrix, budget), None for other codecs."""

    def held_back(self, device: torch.device) -> torch.Tensor | None:
        """What of this cluster's past pseudo-gradients its next encoding will add (the error-feedback residual,
        times `compression.feedback_decay`), as one flat (numel,) vector on `device`, identical on the cluster's dp
        replicas (every replica calls it); None when the reducer keeps no residual (fp32, error feedback off, before
        the first round)."""

    def state_bytes(self) -> int:
        """Bytes of the reducer's own state on this rank (residuals, warm starts)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def gather_slices_(
    flat: torch.Tensor, shard: torch.Tensor, bounds: list[tuple[int, int]], dp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Write every dp replica's `shard` (replica i owns `flat[bounds[i]]`) into `flat` on all replicas."""
    size = group_size(dp_group)
    if size == 1:
        flat.copy_(shard)
        return flat
    width = max(end - start for start, end in bounds)  # gloo all-gathers equal sizes only: pad to the longest
    padded = torch.zeros(width, dtype=shard.dtype, device=shard.device)
    padded[: shard.numel()] = shard
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded, group=dp_group)
    for (start, end), part in zip(bounds, parts, strict=True):
        flat[start:end] = part[: end - start]
    return flat


def _dp_rank(dp_group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(dp_group) if group_size(dp_group) > 1 else 0


# ------------------------------------------------------------------------------------------------------ dense


class DenseReducer:
    """The uncompressed mean: each dp replica all-reduces its equal 1/dp shard of the fp32 vector (AVG).

    Also the gradient mean of the AllReduce baseline, every step. No state between rounds."""

    name = "dense"
    judges_each = False

    def __init__(
        self, numel: int, *, channel: WanChannel, dp_group: dist.ProcessGroup | None, counted: bool = False
    ) -> None:
        self.numel = numel
        self.channel = channel
        self.dp_group = dp_group
        self.counted = counted
        """Elastic runs: one more value carries the number of senders, so an abstaining cluster (new to the round)
        is left out of the mean instead of counting as a zero update."""
        size = group_size(dp_group)
        self.bounds = [shard_bounds(numel, size, index) for index in range(size)]
        self.start, self.end = self.bounds[_dp_rank(dp_group)]

    def launch(self, pseudo_grad: torch.Tensor, *, account: bool = True) -> PendingMean:
        # The all-reduce works on a copy of the shard, so `pseudo_grad` stays intact until wait() (what a resumed
        # run sends again).
        if self.counted:
            return self._launch_counted(pseudo_grad, sender=1.0, account=account)
        shard = pseudo_grad[self.start : self.end].clone()
        transfer = self.channel.launch_all_reduce(shard, op="avg", account=account)
        return PendingMean(pseudo_grad, self.bounds, transfer.wait, transfer, self.dp_group, sent=pseudo_grad)

    def _launch_counted(self, pseudo_grad: torch.Tensor, *, sender: float, account: bool) -> PendingMean:
        one = torch.full((1,), sender, dtype=pseudo_grad.dtype, device=pseudo_grad.device)
        shard = torch.cat([pseudo_grad[self.start : self.end], one])  # (shard + 1,): the values and the sender count
        transfer = self.channel.launch_all_reduce(shard, op="sum", account=account)

        def finish() -> torch.Tensor:
            total = transfer.wait()
            senders = float(total[-1])
            return total[:-1] / senders if senders > 0 else torch.zeros_like(total[:-1])

        # The mean goes to a buffer of its own: an elastic run may send `sent` again after it arrived (the quorum
        # changed), and the mean written over it would send the old average, the lost cluster's share included.
        mean = torch.empty_like(pseudo_grad)
        return PendingMean(mean, self.bounds, finish, transfer, self.dp_group, sent=pseudo_grad)

    def relaunch(self, sent: torch.Tensor, *, account: bool) -> PendingMean:
        return self.launch(sent.clone(), account=account)

    def abstain(self, pseudo_grad: torch.Tensor) -> PendingMean:
        if self.counted:
            return self._launch_counted(torch.zeros_like(pseudo_grad), sender=0.0, account=True)
        return self.launch(torch.zeros_like(pseudo_grad))

    def heal(self) -> None:
        pass

    def forget_last(self) -> None:
        pass

    def current_rank(self) -> int | None:
        return None

    def current_matrix_ranks(self) -> tuple[int, ...] | None:
        return None

    def held_back(self, device: torch.device) -> torch.Tensor | None:
        return None

    def state_bytes(self) -> int:
        return 0

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


# ------------------------------------------------------------------------------------------------------ gather


def param_aligned_bounds(numels: Sequence[int], num_shards: int) -> list[tuple[int, int]]:
    """Split a flat vector of consecutive tensors into `num_shards` slices that start and end on tensor borders
    (a low-rank codec needs whole matrices), each close to an equal share of the elements."""
    offsets = _offsets(numels)
    total = offsets[-1]
    bounds, start, index = [], 0, 0
    for shard in range(num_shards):
        target = total * (shard + 1) / num_shards
        end_index = index
        # take whole tensors while the slice is closer to its target with the next tensor than without it
        while end_index < len(numels) and abs(offsets[end_index + 1] - target) <= abs(offsets[end_index] - target):
            end_index += 1
        if shard == num_shards - 1:
            end_index = len(numels)
        bounds.append((start, offsets[end_index]))
        start, index = offsets[end_index], end_index
    return bounds


def _offsets(numels: Sequence[int]) -> list[int]:
    """Where each of consecutive tensors of `numels` values starts in their flat vector, and the total last."""
    return list(itertools.accumulate(numels, initial=0))


@dataclass(frozen=True)
class ReplicaSlice:
    """This dp replica's part of a flat vector of whole tensors: the compressed reducers encode whole matrices."""

    bounds: list[tuple[int, int]]
    """Every replica's (start, end), parameter-aligned."""
    spans: list[tuple[int, int]]
    """(start, end) in the flat vector of each tensor of this replica."""
    shapes: list[torch.Size]
    """Their shapes."""
    indices: list[int]
    """Their positions among all the tensors."""

    @classmethod
    def of(cls, shapes: Sequence[torch.Size], dp_group: dist.ProcessGroup | None) -> ReplicaSlice:
        return cls.at(shapes, group_size(dp_group), _dp_rank(dp_group))

    @classmethod
    def at(cls, shapes: Sequence[torch.Size], num_replicas: int, index: int) -> ReplicaSlice:
        """Replica `index`'s slice among `num_replicas` (a checkpoint resumed at another dp degree cuts its own)."""
        numels = [shape.numel() for shape in shapes]
        bounds = param_aligned_bounds(numels, num_replicas)
        start, end = bounds[index]
        offsets = _offsets(numels)
        mine = [i for i in range(len(shapes)) if start <= offsets[i] and offsets[i + 1] <= end]
        return cls(bounds, [(offsets[i], offsets[i + 1]) for i in mine], [shapes[i] for i in mine], mine)

    @property
    def numel(self) -> int:
        """Values of this replica's slice."""
        return sum(shape.numel() for shape in self.shapes)

    def tensors(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of this replica's tensors in `flat`."""
        return [flat[a:b].view(shape) for (a, b), shape in zip(self.spans, self.shapes, strict=True)]


class CodecReducer:
    """What every compressed reducer owns: its codec, this replica's whole-tensor slice and its error feedback."""

    name: str
    undoable = False
    """Whether its error feedback keeps what it held before each encoding (a reduction that can leave this cluster's
    update out: `forget_last` returns to it instead of forgetting every residual)."""

    def __init__(
        self,
        codec: Codec,
        shapes: Sequence[torch.Size],
        *,
        error_feedback: bool,
        channel: WanChannel,
        dp_group: dist.ProcessGroup | None,
        seed: int = 0,
        feedback_decay: float = 1.0,
    ) -> None:
        self.codec = codec
        self.numel = sum(shape.numel() for shape in shapes)
        self.slice = ReplicaSlice.of(shapes, dp_group)
        self.feedback = ErrorFeedback(enabled=error_feedback, decay=feedback_decay, undoable=self.undoable)
        self.channel = channel
        self.dp_group = dp_group
        self.seed = seed  # shared by every cluster (the scalable path's common warm starts)

    def current_rank(self) -> int | None:
        return self.codec.current_rank()

    def current_matrix_ranks(self) -> tuple[int, ...] | None:
        return self.codec.current_matrix_ranks()

    def heal(self) -> None:
        self.feedback.reset()

    def forget_last(self) -> None:
        self.feedback.undo()

    def held_back(self, device: torch.device) -> torch.Tensor | None:
        """The replicas' residuals, all-gathered over the fast dp_group into one vector (a no-op at dp 1)."""
        residuals = self.feedback.residuals if self.feedback.enabled else None
        if residuals is None:
            return None
        flat = torch.zeros(self.numel, device=device)  # a replica whose slice holds no tensor sends zeros
        for view, residual in zip(self.slice.tensors(flat), residuals, strict=True):
            view.copy_(residual)
        start, end = self.slice.bounds[_dp_rank(self.dp_group)]
        return gather_slices_(flat, flat[start:end].clone(), self.slice.bounds, self.dp_group).mul_(self.feedback.decay)

    def state_bytes(self) -> int:
        """Residuals (at full size from the start) and the codec's warm starts (those grow in the first round)."""
        return self.feedback.state_bytes(self.slice.numel) + self.codec.state_bytes()

    def state_dict(self) -> dict[str, Any]:
        return {"codec": self.codec.state_dict(), "feedback": self.feedback.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.codec.load_state_dict(state["codec"])
        self.feedback.load_state_dict(state["feedback"])


class GatherReducer(CodecReducer):
    """Any codec: encode this replica's slice (with error feedback), all-gather the payloads over the slow
    cluster_group (their sizes may differ per cluster, e.g. adaptive ranks), decode every cluster's and average.
    Exact for any codec; costs (C-1) x payload received per rank, exact in the channel's counters.

    Every receiver holds every cluster's update, so this is the reduction that can judge them one by one: with a
    `guard` (docs/design.md §4.5) an update that is missing (an abstaining sender's empty payload), non-finite or
    outsized is left out, and with `peers` also one that stands out among three or more (`PeerCheck`); the ranks of
    a cluster, each judging its own slice of its own stage, agree on what is left out over `dp_group` and
    `pp_group`, and the rest is averaged by `aggregate` (mean, or a robust statistic against lying clusters)."""

    name = "gather"
    judges_each = True
    undoable = True

    def __init__(
        self,
        codec: Codec,
        shapes: Sequence[torch.Size],
        *,
        error_feedback: bool,
        channel: WanChannel,
        dp_group: dist.ProcessGroup | None,
        seed: int = 0,
        guard: UpdateGuard | None = None,
        peers: PeerCheck | None = None,
        pp_group: dist.ProcessGroup | None = None,
        shard_group: dist.ProcessGroup | None = None,
        how: str = "mean",
        trim_fraction: float = 0.25,
        feedback_decay: float = 1.0,
    ) -> None:
        if peers is not None and guard is None:
            raise ValueError(
                "the peer check (sync.guard.peers) is part of the guard: it needs sync.guard.enabled = true"
            )
        super().__init__(
            codec,
            shapes,
            error_feedback=error_feedback,
            channel=channel,
            dp_group=dp_group,
            seed=seed,
            feedback_decay=feedback_decay,
        )
        self.empty_reason = "it sent none: its own was non-finite"
        """Why a cluster sends an empty payload (elastic runs: also a cluster new to the round)."""
        self.guard = guard
        self.peers = peers
        self.pp_group = pp_group
        """The cluster's pipeline: the stages agree on what the guard leaves out of every stage's mean."""
        self.shard_group = shard_group
        """A sharded stage's dp ranks (topology.dp_mode = shard), each judging its own shard: they agree as a replicated
        stage's replicas agree over dp_group."""
        self.how = how
        self.trim_fraction = trim_fraction

    def launch(self, pseudo_grad: torch.Tensor) -> PendingMean:
        encode_from = time.perf_counter()
        payload, own_decoded = self.feedback.compress(self.codec, self.slice.tensors(pseudo_grad))
        return self._start(pseudo_grad, payload, own_decoded, codec_s=time.perf_counter() - encode_from)

    def abstain(self, pseudo_grad: torch.Tensor) -> PendingMean:
        # Zero bytes: no real payload of a non-empty slice is empty, so receivers know it is not an update. The
        # residuals are kept: they hold what earlier (finite) rounds lost.
        empty = Payload(torch.empty(0, dtype=torch.uint8, device=pseudo_grad.device))
        return self._start(torch.zeros_like(pseudo_grad), empty, None, codec_s=0.0)

    def relaunch(self, sent: torch.Tensor, *, account: bool) -> PendingMean:
        # The codec and error feedback already ran for it, so they are not run again: the same bytes go out.
        payload = Payload(sent)
        own_decoded = self.codec.decode_list(payload, self.slice.shapes) if payload.nbytes else None
        return self._start(
            torch.zeros(self.numel, device=sent.device), payload, own_decoded, codec_s=0.0, account=account
        )

    def _start(
        self,
        flat: torch.Tensor,
        payload: Payload,
        own_decoded: list[torch.Tensor] | None,
        *,
        codec_s: float,
        account: bool = True,
    ) -> PendingMean:
        cost = CodecCost(payload_bytes=payload.nbytes, dense_bytes=4 * self.slice.numel, codec_s=codec_s)
        max_numel = self.codec.max_nbytes_list(self.slice.shapes)  # every cluster encodes a slice of these shapes
        transfer = self.channel.launch_all_gather(payload.data, max_numel=max_numel, account=account)
        own_index = self.channel.group_rank
        senders = self.channel.clusters  # of the group it was launched over: an elastic channel may move on first
        # Filled by finish() and shared with the PendingMean rather than reached through it: a closure over the
        # PendingMean that holds it would be a reference cycle, which keeps the round's tensors alive until the
        # cyclic garbage collector runs, and their memory fragments the heap meanwhile.
        excluded: dict[int, str] = {}
        weights: list[float] = []

        def finish() -> torch.Tensor:
            # None in place of a payload whose tag did not verify on some cluster (network.auth_key_file), this
            # cluster's own included: every cluster leaves out the same ones
            payloads = transfer.wait()
            decode_from = time.perf_counter()
            updates: list[torch.Tensor | None] = []  # every cluster's decoded slice (slice,), None: nothing usable
            malformed: dict[int, str] = {}
            for index, data in enumerate(payloads):
                decoded = own_decoded if index == own_index else None
                if data is None:
                    decoded = None
                    malformed[index] = "its payload's tag did not verify on every cluster (network.auth_key_file)"
                elif not data.numel():
                    malformed[index] = self.empty_reason
                elif index != own_index:
                    try:
                        decoded = self.codec.decode_list(Payload(data), self.slice.shapes)
                    except ValueError as error:  # a corrupt or forged payload must not stop the receivers
                        malformed[index] = f"malformed payload: {error}"
                updates.append(self._flat(decoded, flat.device))
            excluded.clear()
            excluded.update(self._judge(updates, flat.device, senders, weights))
            excluded.update(malformed)  # the precise reason where the guard only saw nothing usable
            accepted = [u for index, u in enumerate(updates) if u is not None and index not in excluded]
            if self.guard is not None:
                self.guard.accept(accepted)
            cost.codec_s += time.perf_counter() - decode_from
            if not accepted:  # nothing usable: the outer step gets a zero update (DiLoCoSync counts the round)
                return torch.zeros(self.slice.numel, dtype=torch.float32, device=flat.device)
            return aggregate(accepted, self.how, trim_fraction=self.trim_fraction)

        return PendingMean(
            flat,
            self.slice.bounds,
            finish,
            transfer,
            self.dp_group,
            sent=payload.data,
            cost=cost,
            excluded=excluded,
            weights=weights,
        )

    def _flat(self, decoded: list[torch.Tensor] | None, device: torch.device) -> torch.Tensor | None:
        if decoded is None:
            return None
        if not decoded:  # this replica's slice holds no tensor
            return torch.zeros(0, dtype=torch.float32, device=device)
        return torch.cat([d.reshape(-1) for d in decoded]).to(device)

    def _judge(
        self, updates: list[torch.Tensor | None], device: torch.device, clusters: Sequence[int], weights: list[float]
    ) -> dict[int, str]:
        """The clusters left out of the mean and why, from this rank's slice of every cluster's update (None: nothing
        usable arrived): missing updates always; with the guard also non-finite and outsized ones, and with the peer
        check those that stand out among the rest. What is left out is the same on every rank of the cluster
        (`agree_in_cluster`): a cluster one rank's slice finds bad is left out of every slice of every stage, and the
        peer check judges the whole updates. `clusters` and `weights`: the cluster of each update and the weight its
        payload was multiplied by (`PeerCheck.judge`; empty: 1 each)."""
        guard, peers = self.guard, self.peers
        groups = (self.dp_group if self.shard_group is None else self.shard_group, self.pp_group)
        if guard is None:
            return {index: "no usable update arrived" for index, u in enumerate(updates) if u is None}
        verdicts = guard.judge(updates)
        stats = None
        if peers is not None and len(updates) >= PEER_MIN_UPDATES:  # this rank's part of the whole updates' statistics
            stats = peer_statistics([u if v is None else None for u, v in zip(updates, verdicts, strict=True)])
        flags, stats = agree_in_cluster([v is not None for v in verdicts], stats, device, groups=groups)
        verdicts = [
            v if v is not None or not flag else "left out by the guard of another rank of this cluster (its slice)"
            for v, flag in zip(verdicts, flags, strict=True)
        ]
        excluded = {index: v for index, v in enumerate(verdicts) if v is not None}
        if peers is not None:
            candidates = [i for i in range(len(updates)) if i not in excluded]
            excluded.update(peers.judge(stats, candidates, clusters=clusters, weights=weights or None))
        return excluded

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), **judges_state(self.guard, self.peers)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        load_judges_state(self.guard, self.peers, state)


def agree_in_cluster(
    flags: list[bool],
    stats: torch.Tensor | None,
    device: torch.device,
    *,
    groups: Sequence[dist.ProcessGroup | None],
) -> tuple[list[bool], torch.Tensor | None]:
    """Combine every rank's `flags` (any rank's flag counts) and partial peer statistics (`peer_statistics`, summed:
    the whole updates' inner products and magnitude counts) over the cluster: its dp replicas, then its pipeline stages
    (`groups`). Gathered and summed in rank order, so every rank of the cluster gets the same bits, as does every
    cluster's rank that holds the same bytes: the decision is one on every rank. The collectives run on `device` (the
    fast groups' backend may be NCCL); a no-op on one rank."""
    count = len(flags)
    packed = torch.tensor(flags, dtype=torch.float64)
    if stats is not None:
        packed = torch.cat([packed, stats.flatten()])
    for group in groups:
        size = group_size(group)
        if size == 1:
            continue
        parts = [torch.empty_like(packed, device=device) for _ in range(size)]
        dist.all_gather(parts, packed.to(device), group=group)
        parts = [part.cpu() for part in parts]
        total = parts[0].clone()
        for part in parts[1:]:
            total[count:] += part[count:]
            total[:count] = torch.maximum(total[:count], part[:count])
        packed = total
    combined = [bool(flag) for flag in packed[:count].tolist()]
    return combined, None if stats is None else packed[count:].view(count, -1)
