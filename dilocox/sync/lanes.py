"""The outer average of clusters of different data-parallel degree: lanes exchanged over the stage group
(docs/design.md §2.1).

With clusters of dp degrees dp_c (`topology.clusters`), the replicas of a stage cannot pair up one per cluster as the
cluster groups of equal clusters do. Instead a stage's parameters are cut into L = lcm(dp_c) parameter-aligned lanes
(`param_aligned_bounds`), and replica j of a cluster of dp_c owns the L / dp_c consecutive lanes from j L / dp_c. Each
lane is encoded on its own (one codec and one error feedback per lane, low-rank warm starts seeded by the lane), and
one program on the channel of the stage group (every replica of the stage of every cluster) sends each peer exactly
the payloads of the lanes that peer owns, never to a rank of its own cluster. Each rank decodes what arrived and
averages each of its lanes over the clusters (the gather reduction: exact for any codec, a cluster that sent nothing
is left out), then the replicas of the cluster all-gather their lanes' means over the fast dp_group.

A stage sharded over its cluster's dp ranks (`topology.dp_mode = shard`, FSDP2's dim-0 shards) joins the same
exchange as a replicated one: the shards' pseudo-gradient is all-gathered over the fast dp_group into the whole stage
(`ShardCut`), its lanes go out as above, and each rank keeps its own rows of the mean.

Bytes, exactly as the channel counts them: a rank sends each of its lanes' payloads to the C - 1 other clusters and
receives the C - 1 other clusters' payloads of each of its lanes; the payloads' lengths go first, 8 bytes per lane
and peer, counted as control bytes.

    layout = LaneLayout(Topology.of_clusters((2, 1, 1)), cluster=0, dp=1)
    reducer = LaneReducer(CompressionConfig(kind="int4"), shapes, layout=layout, channel=stage_channel, dp_group=dp)
    avg_pseudo_grad = reducer.launch(pseudo_grad).wait()   # (numel,) the same on every replica of every cluster
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dilocox.compress import Codec, CompressionConfig, ErrorFeedback, LowRankCodec, Payload, build_codec
from dilocox.compress.payload import tensor_bytes
from dilocox.net.channel import WanChannel, Wire
from dilocox.net.link import ring_all_reduce_bytes
from dilocox.sync.base import CodecCost
from dilocox.sync.reducers import PendingMean, _offsets, gather_slices_, judge_updates, param_aligned_bounds
from dilocox.sync.robust import PeerCheck, UpdateGuard, aggregate, judges_state, load_judges_state
from dilocox.sync.scalable import (
    LowRankPlan,
    Section,
    _decode_chunks,
    _encode_chunks,
    _mean_chunk,
    chunk_nbytes,
)
from dilocox.topology import Topology, fsdp_rows, group_size

_LENGTH_BYTES = 8  # one int64 payload length per lane in the header step
_LANE_SEED_STRIDE = 7919  # lane l's codec is seeded run.seed + 7919 l on every cluster


@dataclass(frozen=True)
class LaneLayout:
    """Where this rank stands among clusters of different data-parallel degree: its cluster, replica and lanes, and
    which rank of the stage group owns which lane in every cluster."""

    topology: Topology
    cluster: int
    dp: int

    @property
    def num_clusters(self) -> int:
        return self.topology.num_clusters

    @property
    def num_lanes(self) -> int:
        return self.topology.num_lanes

    @property
    def lanes(self) -> range:
        """The lanes this rank owns."""
        return self.topology.lanes_of(self.cluster, self.dp)

    @property
    def cluster_weights(self) -> list[float]:
        """C x dp_c / sum(dp) of every cluster c: the factor that makes the plain mean of the clusters' pseudo-gradients
        their token-weighted mean, sum_c dp_c Delta_c / sum_c dp_c (a cluster of dp_c replicas trained dp_c shards
        per step)."""
        degrees = self.topology.dp_degrees
        return [self.num_clusters * degree / sum(degrees) for degree in degrees]

    @property
    def cluster_weight(self) -> float:
        """This cluster's of `cluster_weights`."""
        return self.cluster_weights[self.cluster]

    def replica_of(self, group_rank: int) -> tuple[int, int]:
        """(cluster, dp) of a rank of the stage group (ordered cluster-major, as the global ranks)."""
        coords = self.topology.coords(group_rank * self.topology.pp_degree)
        return coords.cluster, coords.dp

    def per_cluster(self, values: Sequence[Any]) -> list[Any]:
        """One of `values` per cluster, from values given per rank of the stage group (every replica of every
        cluster, which agree): its first replica's."""
        chosen: list[Any] = [None] * self.num_clusters
        for group_rank, value in enumerate(values):
            cluster, dp = self.replica_of(group_rank)
            if dp == 0:
                chosen[cluster] = value
        return chosen

    def shared_lanes(self, group_rank: int) -> list[int]:
        """The lanes whose payloads this rank exchanges with rank `group_rank` of the stage group: those both own,
        none with a rank of its own cluster."""
        cluster, dp = self.replica_of(group_rank)
        if cluster == self.cluster:
            return []
        theirs = self.topology.lanes_of(cluster, dp)
        return [lane for lane in self.lanes if lane in theirs]


def lane_allreduce_bytes_per_step(layout: LaneLayout, numels: Sequence[int]) -> int:
    """Bytes this rank would send on the slow link for one fp32 all-reduce over the clusters of its lanes of a stage
    of tensors of `numels` values (ring convention): the yardstick `allreduce_equiv_bytes` of clusters of different
    data-parallel degree."""
    bounds = param_aligned_bounds(numels, layout.num_lanes)
    owned = sum(bounds[lane][1] - bounds[lane][0] for lane in layout.lanes)
    return ring_all_reduce_bytes(owned, 4, layout.num_clusters, layout.cluster)[0]


@dataclass(frozen=True)
class ShardCut:
    """Where this rank's FSDP2 shards lie in its stage: the dim-0 rows `fsdp_rows` gives replica `index` of `size`
    of every tensor of `shapes` (whole, before sharding), over the cluster's dp ranks `group`."""

    shapes: tuple[torch.Size, ...]
    group: dist.ProcessGroup | None

    @property
    def size(self) -> int:
        return group_size(self.group)

    @property
    def index(self) -> int:
        return dist.get_rank(self.group) if self.size > 1 else 0

    @property
    def numel(self) -> int:
        """Values of this rank's shards."""
        return sum(end - start for start, end in self.spans(self.index))

    def spans(self, index: int) -> list[tuple[int, int]]:
        """(start, end) in the whole stage's flat vector of every tensor's rows that replica `index` holds."""
        spans, offset = [], 0
        for shape in self.shapes:
            row = shape[1:].numel()
            start, end = fsdp_rows(shape[0], self.size, index)
            spans.append((offset + start * row, offset + end * row))
            offset += shape.numel()
        return spans

    def mine(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's shards of the whole stage's flat vector, as one flat vector (a new tensor)."""
        return torch.cat([whole[start:end] for start, end in self.spans(self.index)])

    def whole(self, mine: torch.Tensor) -> torch.Tensor:
        """The whole stage's flat vector from every rank's `mine`, all-gathered over the fast dp ranks."""
        every = [self.spans(index) for index in range(self.size)]
        starts = list(itertools.accumulate((sum(end - start for start, end in s) for s in every), initial=0))
        by_rank = gather_slices_(mine.new_empty(starts[-1]), mine, list(itertools.pairwise(starts)), self.group)
        whole = torch.empty_like(by_rank)
        for spans, taken in zip(every, starts[:-1], strict=True):  # each rank's rows, tensor by tensor, to their places
            for start, end in spans:
                whole[start:end] = by_rank[taken : taken + end - start]
                taken += end - start
        return whole


class LaneReducer:
    """The gather reduction of a stage's pseudo-gradient among clusters of different data-parallel degree, lane by
    lane over the stage group (module docstring). Implements the `Reducer` protocol of `dilocox.sync.reducers`, so
    the one-step delay, checkpoints of a sync in flight, the guard and resume work as with the other reducers.

    `channel` is this rank's channel over the stage group; `dp_group` the cluster's replicas of this stage, over which
    the lanes' means are all-gathered; `pp_group` the cluster's pipeline, over which (with `dp_group`) the guard's
    verdicts are agreed. A cluster that abstains sends empty payloads and is left out of the mean, as is one the guard
    leaves out (`sync.guard`, docs/design.md §4.5). `shard`: the stage is sharded over `dp_group` (`shapes` are then
    its tensors' whole shapes): this rank takes and gives its shards' flat vector."""

    name = "lanes"
    judges_each = True

    def __init__(
        self,
        cfg: CompressionConfig,
        shapes: Sequence[torch.Size],
        *,
        layout: LaneLayout,
        channel: WanChannel,
        dp_group: dist.ProcessGroup | None,
        pp_group: dist.ProcessGroup | None = None,
        seed: int = 0,
        guard: UpdateGuard | None = None,
        peers: PeerCheck | None = None,
        aggregate: str = "mean",
        trim_fraction: float = 0.25,
        shard: ShardCut | None = None,
        scaled: bool = False,
    ) -> None:
        cfg.validate()
        if peers is not None and guard is None:
            raise ValueError(
                "the peer check (sync.guard.peers) is part of the guard: it needs sync.guard.enabled = true"
            )
        if channel.world_size != layout.topology.num_shards:
            raise ValueError(
                f"the lane exchange runs over the stage group of all {layout.topology.num_shards} replicas of a "
                f"stage, but the channel's group has {channel.world_size} ranks: pass the channel of "
                "ProcessGroups.cluster_group"
            )
        self.layout = layout
        self.shard = shard
        self.shapes = [torch.Size(shape) for shape in shapes]
        numels = [shape.numel() for shape in self.shapes]
        self.numel = sum(numels)
        offsets = _offsets(numels)
        self.lane_bounds = param_aligned_bounds(numels, layout.num_lanes)
        """(start, end) of every lane in the flat vector, on tensor borders."""
        self.lane_tensors = [
            [i for i in range(len(numels)) if a <= offsets[i] and offsets[i + 1] <= b and numels[i]]
            for a, b in self.lane_bounds
        ]
        """The tensors of every lane (an empty lane has none: a stage of fewer tensors than lanes)."""
        self.offsets = offsets
        degrees = layout.topology.dp_degrees
        width = layout.num_lanes // degrees[layout.cluster]
        self.bounds = [
            (self.lane_bounds[j * width][0], self.lane_bounds[(j + 1) * width - 1][1])
            for j in range(degrees[layout.cluster])
        ]
        """Every replica of this cluster's (start, end): the union of its lanes, which `PendingMean.wait` gathers."""
        self.channel = channel
        self.dp_group = dp_group
        self.pp_group = pp_group
        self.guard = guard
        self.peers = peers
        self.how = aggregate
        """How each lane's accepted updates are averaged (`sync.aggregate`; a robust one gives every cluster one vote,
        its payload not weighted by its replicas)."""
        self.trim_fraction = trim_fraction
        self.scaled = scaled
        """The payloads are the pseudo-gradients times `LaneLayout.cluster_weights` (the plain mean, not weighted by
        tokens): with some clusters left out, the mean of the others is taken over their own weights."""
        self.empty_reason = "it sent none: its own was non-finite"
        dense = cfg.kind == "none"  # the fp32 identity codec: nothing to hold back
        self.codecs = {lane: build_codec(cfg, seed=seed + _LANE_SEED_STRIDE * lane) for lane in layout.lanes}
        """One codec per lane this rank owns, seeded by the lane: the same seed on every cluster."""
        self.feedbacks = {
            lane: ErrorFeedback(enabled=cfg.error_feedback and not dense, decay=cfg.feedback_decay, undoable=True)
            for lane in layout.lanes
        }
        self.holds_back = False
        """Whether the residuals hold a round's loss (every replica of the cluster alike: set by each encoding, reset
        by `heal`)."""

    # ---------------------------------------------------------------------------------------------- lanes
    def _lane_shapes(self, lane: int) -> list[torch.Size]:
        return [self.shapes[i] for i in self.lane_tensors[lane]]

    def _lane_numel(self, lane: int) -> int:
        return self.lane_bounds[lane][1] - self.lane_bounds[lane][0]

    def _lane_views(self, flat: torch.Tensor, lane: int) -> list[torch.Tensor]:
        return [flat[self.offsets[i] : self.offsets[i + 1]].view(self.shapes[i]) for i in self.lane_tensors[lane]]

    @property
    def slice_numel(self) -> int:
        """Values of the lanes this rank owns."""
        start, end = self.bounds[self.layout.dp]
        return end - start

    # ---------------------------------------------------------------------------------------------- protocol
    def launch(self, pseudo_grad: torch.Tensor) -> PendingMean:
        if self.shard is not None:
            pseudo_grad = self.shard.whole(pseudo_grad)
        encode_from = time.perf_counter()
        payloads: dict[int, Payload] = {}
        decoded: dict[int, list[torch.Tensor]] = {}
        for lane in self.layout.lanes:
            if not self.lane_tensors[lane]:
                payloads[lane], decoded[lane] = _empty(pseudo_grad.device), []
                continue
            payloads[lane], decoded[lane] = self.feedbacks[lane].compress(
                self.codecs[lane], self._lane_views(pseudo_grad, lane)
            )
        self.holds_back = True
        return self._start(pseudo_grad, payloads, decoded, codec_s=time.perf_counter() - encode_from)

    def abstain(self, pseudo_grad: torch.Tensor) -> PendingMean:
        # Empty payloads: no real payload of a lane with tensors is empty, so the receivers leave this cluster out.
        # The residuals are kept: they hold what earlier (finite) rounds lost.
        payloads = {lane: _empty(pseudo_grad.device) for lane in self.layout.lanes}
        return self._start(torch.zeros(self.numel, device=pseudo_grad.device), payloads, None, codec_s=0.0)

    def relaunch(self, sent: torch.Tensor, *, account: bool) -> PendingMean:
        """Send again what `PendingMean.sent` saved: each lane's payload length (int64), then the payloads."""
        lanes = list(self.layout.lanes)
        header = _LENGTH_BYTES * len(lanes)
        sizes = sent[:header].clone().view(torch.int64).tolist()
        parts = torch.split(sent[header:], sizes)
        payloads = {lane: Payload(part.clone()) for lane, part in zip(lanes, parts, strict=True)}
        decoded = None
        if any(sizes) or not any(self.lane_tensors[lane] for lane in lanes):
            decoded = {lane: self._decode(payloads[lane], lane) for lane in lanes}
        flat = torch.zeros(self.numel, device=sent.device)
        return self._start(flat, payloads, decoded, codec_s=0.0, account=account)

    def _decode(self, payload: Payload, lane: int) -> list[torch.Tensor]:
        shapes = self._lane_shapes(lane)
        return self.codecs[lane].decode_list(payload, shapes) if shapes else []

    def _start(
        self,
        flat: torch.Tensor,
        payloads: dict[int, Payload],
        own_decoded: dict[int, list[torch.Tensor]] | None,
        *,
        codec_s: float,
        account: bool = True,
    ) -> PendingMean:
        layout, world = self.layout, self.channel.world_size
        lanes = list(layout.lanes)
        sizes = torch.tensor([payloads[lane].nbytes for lane in lanes], dtype=torch.int64)
        sent = torch.cat([sizes.view(torch.uint8).to(flat.device), *(payloads[lane].data for lane in lanes)])
        cost = CodecCost(
            payload_bytes=sum(p.nbytes for p in payloads.values()), dense_bytes=4 * self.slice_numel, codec_s=codec_s
        )
        # a lane without tensors (a stage of fewer tensors than lanes) is empty everywhere: nothing to exchange
        shared = [[lane for lane in layout.shared_lanes(peer) if self.lane_tensors[lane]] for peer in range(world)]
        device = flat.device

        def program(wire: Wire) -> dict[int, dict[int, torch.Tensor]]:
            # 1. the lengths of the payloads each peer gets from this rank, so that it can split what arrives
            lengths = [_lengths([payloads[lane].nbytes for lane in lanes_], device) for lanes_ in shared]
            # every rank joins both steps: one that owns only empty lanes, or abstains among abstainers, has nothing
            recv_lengths = [_LENGTH_BYTES * len(lanes_) for lanes_ in shared]
            header = wire.all_to_all(lengths, recv_lengths, header=True, skip_empty=False)
            # 2. each peer the payloads of the lanes it owns
            chunks = [_concat([payloads[lane].data for lane in lanes_], device) for lanes_ in shared]
            arrived_sizes = [part.clone().view(torch.int64).tolist() if part.numel() else [] for part in header]
            arrived = wire.all_to_all(chunks, [sum(s) for s in arrived_sizes], skip_empty=False)
            by_lane: dict[int, dict[int, torch.Tensor]] = {lane: {} for lane in lanes}  # lane -> cluster -> bytes
            for peer, (lanes_, part, part_sizes) in enumerate(zip(shared, arrived, arrived_sizes, strict=True)):
                cluster, _ = layout.replica_of(peer)
                if not part.numel() and sum(part_sizes):  # left out: its tag did not verify on some member
                    rejected.add(cluster)
                    part_sizes = [0] * len(part_sizes)
                for lane, data in zip(lanes_, torch.split(part, part_sizes), strict=True):
                    by_lane[lane][cluster] = data
            rejected.update(layout.replica_of(peer)[0] for peer in wire.left_out)  # this rank's own cluster too
            return by_lane

        rejected: set[int] = set()  # clusters whose payloads an authenticated channel left out
        transfer = self.channel.launch_program(program, kind="lanes", account=account, device=device, sealed=True)
        excluded: dict[int, str] = {}  # filled by finish(); shared with the PendingMean (see GatherReducer._start)

        def finish() -> torch.Tensor:
            by_lane = transfer.wait()
            decode_from = time.perf_counter()
            updates: list[torch.Tensor | None] = []  # every cluster's lanes of this rank, (slice,), None: unusable
            malformed: dict[int, str] = {}
            for cluster in range(layout.num_clusters):
                parts: list[torch.Tensor] | None = []
                for lane in lanes:
                    if not self.lane_tensors[lane]:
                        continue
                    if cluster in rejected:
                        tensors = None
                        malformed[cluster] = "its payload's HMAC-SHA256 tag does not verify (network.auth_key_file)"
                    elif cluster == layout.cluster:
                        tensors = None if own_decoded is None else own_decoded[lane]
                        if tensors is None:
                            malformed[cluster] = self.empty_reason
                    else:
                        data = by_lane[lane][cluster]
                        tensors = None
                        if not data.numel():
                            malformed[cluster] = self.empty_reason
                        else:
                            try:
                                tensors = self._decode(Payload(data), lane)
                            except ValueError as error:  # a corrupt payload must not stop the receivers
                                malformed[cluster] = f"malformed payload: {error}"
                    if tensors is None or parts is None:
                        parts = None
                        continue
                    parts.extend(t.reshape(-1).to(device) for t in tensors)
                if parts is None:
                    updates.append(None)
                else:
                    updates.append(torch.cat(parts) if parts else torch.zeros(0, device=device))
            excluded.clear()
            excluded.update(
                judge_updates(
                    updates, device, guard=self.guard, peers=self.peers, dp_group=self.dp_group, pp_group=self.pp_group
                )
            )
            excluded.update(malformed)
            accepted = [u for index, u in enumerate(updates) if u is not None and index not in excluded]
            if self.guard is not None:
                self.guard.accept(accepted)
            cost.codec_s += time.perf_counter() - decode_from
            if not accepted:  # nothing usable: the outer step gets a zero update (DiLoCoSync counts the round)
                return torch.zeros(self.slice_numel, dtype=torch.float32, device=device)
            mean = aggregate(accepted, self.how, trim_fraction=self.trim_fraction)
            if self.scaled and len(accepted) < layout.num_clusters:
                # the weights C dp_c / sum(dp) sum to C over all clusters: sum_kept dp_c d_c / sum_kept dp_c
                degrees = layout.topology.dp_degrees
                kept = sum(dp for c, dp in enumerate(degrees) if updates[c] is not None and c not in excluded)
                mean.mul_(len(accepted) * sum(degrees) / (layout.num_clusters * kept))
            return mean

        return self._pending(flat, finish, transfer, sent=sent, cost=cost, excluded=excluded)

    def _pending(self, flat: torch.Tensor, finish: Any, transfer: Any, **kept: Any) -> PendingMean:
        """The mean of this rank's lanes (`finish`), all-gathered over the cluster's replicas; a sharded rank keeps
        its rows of it."""
        pending = PendingMean(flat, self.bounds, finish, transfer, self.dp_group, **kept)
        if self.shard is None:
            return pending
        shard = self.shard  # the whole mean on every replica of the cluster, of which this rank keeps its rows
        mine = torch.empty(shard.numel, device=flat.device)
        return PendingMean(mine, [(0, mine.numel())], lambda: shard.mine(pending.wait()), transfer, None, **kept)

    def heal(self) -> None:
        for feedback in self.feedbacks.values():
            feedback.reset()
        self.holds_back = False

    def forget_last(self) -> None:
        for feedback in self.feedbacks.values():
            feedback.undo()
        self.holds_back = any(feedback.residuals is not None for feedback in self.feedbacks.values())

    def current_rank(self) -> int | None:
        return self._first_codec().current_rank()

    def current_matrix_ranks(self) -> tuple[int, ...] | None:
        return self._first_codec().current_matrix_ranks()

    def _first_codec(self) -> Codec:
        return self.codecs[self.layout.lanes[0]]

    def held_back(self, device: torch.device) -> torch.Tensor | None:
        """Every lane's residual of this cluster, all-gathered over the fast dp_group into one vector."""
        feedbacks = list(self.feedbacks.values())
        if not self.holds_back or not feedbacks[0].enabled:
            return None
        flat = torch.zeros(self.numel, device=device)
        for lane, feedback in self.feedbacks.items():
            if feedback.residuals is None:  # an empty lane
                continue
            for view, residual in zip(self._lane_views(flat, lane), feedback.residuals, strict=True):
                view.copy_(residual)
        start, end = self.bounds[self.layout.dp]
        held = gather_slices_(flat, flat[start:end].clone(), self.bounds, self.dp_group).mul_(feedbacks[0].decay)
        return held if self.shard is None else self.shard.mine(held)

    def state_bytes(self) -> int:
        total = 0
        for lane in self.layout.lanes:
            total += self.feedbacks[lane].state_bytes(self._lane_numel(lane)) + self.codecs[lane].state_bytes()
        return total

    def state_dict(self) -> dict[str, Any]:
        return {
            "lanes": {
                lane: {"codec": self.codecs[lane].state_dict(), "feedback": self.feedbacks[lane].state_dict()}
                for lane in self.layout.lanes
            },
            "num_lanes": self.layout.num_lanes,
            "holds_back": self.holds_back,
            **judges_state(self.guard, self.peers),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("num_lanes") != self.layout.num_lanes or set(state.get("lanes", {})) != set(self.layout.lanes):
            raise ValueError(
                f"this reducer state holds lanes {sorted(state.get('lanes', {}))} of {state.get('num_lanes')}, but "
                f"this rank owns lanes {list(self.layout.lanes)} of {self.layout.num_lanes}: resume with the "
                "topology.clusters the checkpoint was written with"
            )
        for lane, lane_state in state["lanes"].items():
            self.codecs[lane].load_state_dict(lane_state["codec"])
            self.feedbacks[lane].load_state_dict(lane_state["feedback"])
        self.holds_back = bool(state["holds_back"])
        load_judges_state(self.guard, self.peers, state)


class ScalableLaneReducer(LaneReducer):
    """The scalable reduction of the lanes (`compression.reduction = scalable`; docs/design.md §2.1): each lane's
    vector is cut into C chunks, chunk c of every cluster's goes to the lane's owner in cluster c, which averages the C
    versions and encodes the mean again, and the means go back to the lane's other owners (the two steps of
    `dilocox.sync.scalable`, for every lane at once: two exchanges over the stage group). An elementwise codec (fp16,
    bf16, int4) averages each lane so once; a low-rank one (lowrank, lowrank_int4) twice, each lane's P factors and
    then its Q factors with its own shared warm starts (`LowRankPlan`). A rank sends about 2 (C - 1) / C of its
    lanes' payload per average, against C - 1 payloads for the gather. The clusters' updates are summed in transit:
    no guard of its own (the guard judges the mean) and no robust aggregate."""

    name = "scalable_lanes"
    judges_each = False

    def __init__(self, cfg: CompressionConfig, shapes: Sequence[torch.Size], *, seed: int = 0, **options: Any) -> None:
        super().__init__(cfg, shapes, seed=seed, **options)
        self.seed = seed
        owned = [lane for lane in self.layout.lanes if self.lane_tensors[lane]]
        codecs: dict[int, Any] = self.codecs
        self.plans: dict[int, LowRankPlan] | None = None
        """Low-rank codecs: how each lane this rank owns that holds tensors is split into factors and parts sent whole
        (None: an elementwise codec)."""
        self.sections: dict[int, list[Section]]
        """The sections of the first (or only) average of each lane this rank owns that holds tensors."""
        if isinstance(self._first_codec(), LowRankCodec):
            self.plans = {lane: LowRankPlan.of(self._lane_shapes(lane), codecs[lane].rank) for lane in owned}
            self.sections = {lane: plan.sections_first(codecs[lane]) for lane, plan in self.plans.items()}
        else:
            self.sections = {lane: [Section(self._lane_numel(lane), codecs[lane].value_format)] for lane in owned}
        self.warm_starts: dict[int, dict[int, torch.Tensor]] = {lane: {} for lane in owned}
        """Low-rank codecs: each lane's shared right factors (n, r) by tensor index, the averaged Q of its last sync."""
        for feedback in self.feedbacks.values():
            feedback.undoable = False  # no cluster's update is left out of a sum: nothing to undo

    def _sent_sizes(self) -> list[int]:
        """Bytes of each lane's part of `sent`: its first chunks, after its input (fp32) with a low-rank codec."""
        front, clusters = 0 if self.plans is None else 4, self.layout.num_clusters
        return [front * self._lane_numel(lane) + sum(chunk_nbytes(s, clusters)) for lane, s in self.sections.items()]

    def launch(self, pseudo_grad: torch.Tensor) -> PendingMean:
        if self.shard is not None:
            pseudo_grad = self.shard.whole(pseudo_grad)
        encode_from, num_clusters = time.perf_counter(), self.layout.num_clusters
        parts = []
        for lane, sections in self.sections.items():
            feedback = self.feedbacks[lane]
            views = self._lane_views(pseudo_grad, lane)
            u = torch.cat([t.reshape(-1) for t in feedback.corrected(views)])
            if self.plans is None:
                encoded = _encode_chunks([u], sections, num_clusters)
                if feedback.enabled:
                    lost = torch.split(
                        u - _decode_chunks(encoded, sections, num_clusters)[0], [v.numel() for v in views]
                    )
                    feedback.keep([r.view(v.shape) for r, v in zip(lost, views, strict=True)])
                parts += encoded
                continue
            plan = self.plans[lane]  # the input rides in front: the second average needs it, and so does a resume
            values = plan.first_values(u, self.warm_starts[lane], self.seed + _LANE_SEED_STRIDE * lane)
            encoded = _encode_chunks(values, sections, num_clusters)
            if feedback.enabled:  # the parts sent whole; the factors' loss is known when the sync finishes
                feedback.keep(plan.whole_residuals(u, _decode_chunks(encoded, sections, num_clusters)))
            parts += [tensor_bytes(u), *encoded]
        self.holds_back = True
        sent = _concat(parts, pseudo_grad.device)
        return self._start_sums(
            torch.zeros(self.numel, device=sent.device), sent, codec_s=time.perf_counter() - encode_from
        )

    def abstain(self, pseudo_grad: torch.Tensor) -> PendingMean:
        return self.launch(torch.zeros_like(pseudo_grad))  # the (finite) residuals of earlier rounds, as the others

    def relaunch(self, sent: torch.Tensor, *, account: bool) -> PendingMean:
        return self._start_sums(torch.zeros(self.numel, device=sent.device), sent, codec_s=0.0, account=account)

    def _start_sums(
        self, flat: torch.Tensor, sent: torch.Tensor, *, codec_s: float, account: bool = True
    ) -> PendingMean:
        layout, world, device = self.layout, self.channel.world_size, sent.device
        num_clusters, me = layout.num_clusters, layout.cluster
        lanes, plans = list(self.sections), self.plans
        sent_sizes = self._sent_sizes()
        if sent.numel() != sum(sent_sizes):
            raise ValueError("a scalable lane sync in flight does not fit this rank's lanes: resume with its settings")
        inputs: dict[int, torch.Tensor] = {}
        first: dict[int, list[torch.Tensor]] = {}
        for lane, part in zip(lanes, torch.split(sent, sent_sizes), strict=True):
            if plans is not None:
                numel = self._lane_numel(lane)
                inputs[lane], part = part[: 4 * numel].view(torch.float32), part[4 * numel :]
            first[lane] = list(torch.split(part, chunk_nbytes(self.sections[lane], num_clusters)))
        shared = [[lane for lane in layout.shared_lanes(peer) if lane in first] for peer in range(world)]
        cluster_of = [layout.replica_of(peer)[0] for peer in range(world)]
        codecs: dict[int, Any] = self.codecs
        second = {lane: [plans[lane].section_second(codecs[lane])] for lane in lanes} if plans is not None else {}
        payload_bytes = sum(
            sum(chunk_nbytes(s, num_clusters)) for group in (self.sections, second) for s in group.values()
        )

        def exchange(wire: Wire, pick: Any, lengths: list[list[int]]) -> dict[int, dict[int, torch.Tensor]]:
            """One step over the stage group: each peer gets `pick(lane, peer)` of every lane both own, and sent
            `lengths[peer]` bytes of them; what arrived, by lane and by the sender's cluster."""
            send = [_concat([pick(lane, peer) for lane in shared[peer]], device) for peer in range(world)]
            arrived = wire.all_to_all(send, [sum(n) for n in lengths], skip_empty=False)
            by_cluster: dict[int, dict[int, torch.Tensor]] = {lane: {} for lane in lanes}
            for peer, part in enumerate(arrived):
                for lane, data in zip(shared[peer], torch.split(part, lengths[peer]), strict=True):
                    by_cluster[lane][cluster_of[peer]] = data
            return by_cluster

        def lanes_mean(
            wire: Wire, chunks: dict[int, list[torch.Tensor]], sections: dict[int, list[Section]]
        ) -> dict[int, list[torch.Tensor]]:
            """Every lane's mean over the clusters of the vectors (one per section) whose chunks are `chunks`."""
            sizes = {lane: chunk_nbytes(sections[lane], num_clusters) for lane in lanes}
            # 1. chunk c of each lane to the lane's owner in cluster c: here, chunk `me` of every cluster's
            mine = [[sizes[lane][me] for lane in shared[peer]] for peer in range(world)]
            versions = exchange(wire, lambda lane, peer: chunks[lane][cluster_of[peer]], mine)
            reduced, requant = {}, {}
            for lane in lanes:
                own = [chunks[lane][me] if c == me else versions[lane][c] for c in range(num_clusters)]
                reduced[lane], requant[lane] = _mean_chunk(own, sections[lane], num_clusters, me)
            # 2. the mean of chunk `me` back to the lane's owners in the other clusters, theirs here
            theirs = [[sizes[lane][cluster_of[peer]] for lane in shared[peer]] for peer in range(world)]
            means = exchange(wire, lambda lane, _: reduced[lane], theirs)
            return {
                lane: _decode_chunks(
                    [reduced[lane] if c == me else means[lane][c] for c in range(num_clusters)],
                    requant[lane],
                    num_clusters,
                )
                for lane in lanes
            }

        def program(wire: Wire) -> dict[int, Any]:
            means = lanes_mean(wire, first, self.sections)
            if plans is None:
                return {lane: mean[0] for lane, mean in means.items()}
            bases, q_chunks, own_q = {}, {}, {}
            for lane in lanes:
                bases[lane], q = plans[lane].own_q(inputs[lane], means[lane][0])
                q_chunks[lane] = _encode_chunks([q], second[lane], num_clusters)
                own_q[lane] = _decode_chunks(q_chunks[lane], second[lane], num_clusters)[0]
            mean_q = lanes_mean(wire, q_chunks, second)
            return {lane: (means[lane], bases[lane], mean_q[lane][0], own_q[lane]) for lane in lanes}

        transfer = self.channel.launch_program(program, kind="scalable_lanes", account=account, device=device)
        cost = CodecCost(payload_bytes=payload_bytes, dense_bytes=4 * self.slice_numel, codec_s=codec_s)

        def finish() -> torch.Tensor:
            out = transfer.wait()
            zero = torch.zeros(0, device=device)  # a lane without tensors
            if plans is not None:
                for lane in lanes:
                    out[lane], warm, lost = plans[lane].assemble(inputs[lane], *out[lane])
                    self.warm_starts[lane].update(warm)
                    for index, residual in lost.items():
                        self.feedbacks[lane].keep_one(index, residual)
            return torch.cat([out.get(lane, zero) for lane in layout.lanes])

        return self._pending(flat, finish, transfer, sent=sent, cost=cost)

    def state_bytes(self) -> int:
        return super().state_bytes() + sum(4 * q.numel() for warm in self.warm_starts.values() for q in warm.values())

    def state_dict(self) -> dict[str, Any]:
        warm = {lane: {str(i): q.clone() for i, q in each.items()} for lane, each in self.warm_starts.items()}
        return {**super().state_dict(), "warm_starts": warm}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        saved = state.get("warm_starts", {})
        self.warm_starts = {lane: {int(i): q.clone() for i, q in saved.get(lane, {}).items()} for lane in self.sections}


def build_lane_reducer(
    cfg: CompressionConfig,
    shapes: Sequence[torch.Size],
    *,
    layout: LaneLayout,
    channel: WanChannel,
    dp_group: dist.ProcessGroup | None,
    pp_group: dist.ProcessGroup | None = None,
    seed: int = 0,
    guard_max_ratio: float | None = None,
    peer_max_ratio: float | None = None,
    peer_sizes: bool = True,
    aggregate: str = "mean",
    trim_fraction: float = 0.25,
    shard_group: dist.ProcessGroup | None = None,
    scaled: bool = True,
) -> LaneReducer:
    """The lane reducer of `compression` with the guard and the aggregate of `[sync]`: the gather of any codec, or
    the scalable reduction of the codecs it can sum (`ScalableLaneReducer`: elementwise and low-rank). With the plain
    mean every cluster's payload is weighted by its replicas (`LaneLayout.cluster_weight`; `scaled` False:
    token-weighted syncs, scaled by tokens instead): the peer check compares the sizes per unit of weight.
    `shard_group`: the stage is sharded over it (`shapes` whole, `dp_group` None)."""
    common: dict[str, Any] = dict(
        layout=layout,
        channel=channel,
        dp_group=dp_group if shard_group is None else shard_group,
        pp_group=pp_group,
        seed=seed,
        shard=None if shard_group is None else ShardCut(tuple(shapes), shard_group),
    )
    if cfg.kind != "none" and cfg.reduction == "scalable":  # validate() allows only the kinds it averages
        return ScalableLaneReducer(dataclasses.replace(cfg), shapes, **common)
    return LaneReducer(
        dataclasses.replace(cfg),
        shapes,
        **common,
        guard=UpdateGuard(guard_max_ratio) if guard_max_ratio is not None else None,
        peers=PeerCheck(
            peer_max_ratio,
            scales=layout.cluster_weights if aggregate == "mean" else None,  # a robust aggregate: one vote, unweighted
            sizes=peer_sizes,
        )
        if guard_max_ratio is not None and peer_max_ratio is not None
        else None,
        aggregate=aggregate,
        trim_fraction=trim_fraction,
        scaled=scaled and aggregate == "mean",
    )


def _empty(device: torch.device) -> Payload:
    return Payload(torch.empty(0, dtype=torch.uint8, device=device))


def _lengths(sizes: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.int64).view(torch.uint8).to(device)


def _concat(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
