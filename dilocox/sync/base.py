"""What every synchronization strategy shares: the protocol, the per-round record, flat buffers and shards.

A strategy is called by the trainer at two points of every inner step:

    loss.backward()
    sync.reduce_gradients()          # allreduce: mean over every rank; diloco: mean over dp_group only
    clip, inner_optimizer.step()
    sync.after_inner_step(step)      # diloco: at a round boundary, the outer sync and outer step
"""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dilocox.compress import compression_ratio
from dilocox.elastic.events import ElasticEvent
from dilocox.topology import group_size, local_shard


@dataclass
class CodecCost:
    """What encoding one pseudo-gradient slice cost: its payload against the fp32 slice, and the codec's time."""

    payload_bytes: int
    """Bytes of this rank's payload (for the scalable reduction: the sum over its link steps)."""
    dense_bytes: int
    """Bytes of the same slice in fp32."""
    codec_s: float
    """Seconds spent encoding and decoding (grows when the sync finishes and decodes what arrived)."""


@dataclass
class RoundStats:
    """What the sync waited for at a round boundary cost (or, for cocktail, one step's exchange): logged with that
    step in metrics.jsonl under the `round_*` keys of `to_record()`."""

    link_s: float
    """Link time of the transfer (emulated or measured)."""
    exposed_s: float
    """Time the trainer was blocked waiting for the link to deliver it."""
    bytes_sent: int
    """Bytes this rank put on the slow link for it."""
    peer_wait_s: float = 0.0
    """Time the trainer was blocked after the link had delivered, waiting for a cluster that sent late."""
    compute_s: float | None = None
    """Seconds from its launch to the wait (outer loops only): the compute it could hide behind."""
    inner_steps: int | None = None
    """Inner steps computed since its launch (outer loops only): this round's H."""
    cost: CodecCost | None = None
    """Payload size and codec time of a compressed sync."""
    rank: int | None = None
    """The low-rank codec's rank of the next encoding (adaptive: the rank it chose)."""
    matrix_ranks: tuple[int, ...] | None = None
    """The adaptive codec's rank of each matrix it measured (per_matrix, budget), in the order of the parameters."""
    excluded: dict[int, str] | None = None
    """With sync.guard: the clusters whose update was left out of this mean, and why (docs/design.md §4.5)."""
    skipped: bool = False
    """With sync.guard: no usable mean, so the outer step was skipped."""
    round_index: int | None = None
    """The outer round (1-based) whose average this is (outer loops; None for the residual drained at the end)."""
    cluster_steps: tuple[int, ...] | None = None
    """Token-weighted syncs: the inner steps of each cluster in the round of this average (0: its report was lost)."""
    cluster_tokens: tuple[int, ...] | None = None
    """Token-weighted syncs: the tokens of each cluster in that round (0 also for a cluster that abstained)."""
    also_excluded: tuple[tuple[int | None, int, str], ...] = ()
    """With sync.guard: (round, cluster, why) of the updates left out of other syncs waited for at the same step (at
    the last step: the round that ended there, before the final flush, and the drained residual, round None)."""
    fragment: int | None = None
    """sync.fragments > 1: the fragment (0-based) whose sync this is (`dilocox.sync.streaming`)."""
    also_landed: tuple[RoundStats, ...] = ()
    """sync.fragments > 1: the other fragments' syncs waited for at the same step, each its own round record."""
    also_rounds: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...] = ()
    """Token-weighted syncs: (round, cluster steps, cluster tokens) of other syncs waited for at the same step (at the
    last step of a delayed sync: the round before the last)."""

    def with_exclusions_of(self, *others: RoundStats | None) -> RoundStats:
        """These stats, also carrying what the guard left out of `others`, syncs waited for at the same step, and
        the clusters' steps and tokens of the rounds they averaged."""
        rounds = tuple(
            item
            for other in others
            if other is not None
            for item in (
                *other.also_rounds,
                *(
                    ((other.round_index, other.cluster_steps, other.cluster_tokens),)
                    if other.cluster_steps is not None and other.cluster_tokens is not None
                    else ()
                ),
            )
        )
        extra = tuple(
            item
            for other in others
            if other is not None
            for item in (
                *((other.round_index, cluster, why) for cluster, why in (other.excluded or {}).items()),
                *other.also_excluded,
            )
        )
        return dataclasses.replace(
            self, also_excluded=self.also_excluded + extra, also_rounds=self.also_rounds + rounds
        )

    @property
    def hidden_s(self) -> float:
        """Link time that overlapped compute."""
        return max(0.0, self.link_s - self.exposed_s)

    @property
    def hidden_fraction(self) -> float | None:
        """Share of the link time that overlapped compute (None when the transfer took no link time)."""
        return self.hidden_s / self.link_s if self.link_s > 0 else None

    def to_record(self) -> dict[str, Any]:
        record: dict[str, Any] = {
            "round_link_s": self.link_s,
            "round_exposed_s": self.exposed_s,
            "round_peer_wait_s": self.peer_wait_s,
            "round_hidden_s": self.hidden_s,
            "round_bytes_sent": self.bytes_sent,
        }
        if self.excluded is not None:
            exclusions = [(self.round_index, cluster, why) for cluster, why in self.excluded.items()]
            exclusions = sorted([*exclusions, *self.also_excluded], key=lambda e: (e[0] is None, e[0] or 0, e[1]))
            record["round_excluded"] = len(exclusions)
            record["round_skipped"] = int(self.skipped)
            if exclusions:  # every update left out, with its round and why (the plotting sinks skip non-numbers)
                record["round_exclusions"] = [{"round": r, "cluster": c, "why": why} for r, c, why in exclusions]
        if self.fragment is not None:
            record["round_fragment"] = self.fragment
        if self.cluster_steps is not None and self.cluster_tokens is not None:
            record["round_index"] = self.round_index
            record["round_cluster_steps"] = list(self.cluster_steps)
            record["round_cluster_tokens"] = list(self.cluster_tokens)
            # every round whose average landed at this step, oldest first (`dilocox plot`: steps per cluster)
            landed = sorted([*self.also_rounds, (self.round_index, self.cluster_steps, self.cluster_tokens)])
            record["rounds_landed"] = [
                {"round": r, "cluster_steps": list(steps), "cluster_tokens": list(tokens)}
                for r, steps, tokens in landed
            ]
        if self.compute_s is not None:
            record["round_compute_s"] = self.compute_s
        if self.inner_steps is not None:
            record["round_inner_steps"] = self.inner_steps
        if self.cost is not None and self.cost.payload_bytes:
            record["round_codec_s"] = self.cost.codec_s
            record["round_payload_bytes"] = self.cost.payload_bytes
            record["round_compression_ratio"] = compression_ratio(self.cost.payload_bytes, self.cost.dense_bytes // 4)
            # bits on the wire per pseudo-gradient value (32 for fp32, 4.25 for int4 in groups of 64)
            record["round_bits_per_value"] = 8 * self.cost.payload_bytes / (self.cost.dense_bytes / 4)
            if self.rank is not None:
                record["round_rank"] = self.rank
            if self.matrix_ranks is not None:
                record["round_matrix_ranks"] = list(self.matrix_ranks)
        return record


GUARD_COUNTS = ("excluded_updates", "skipped_rounds", "healed_rounds")
"""The guard's totals (`SyncStatus.guard_counts`); per-step strategies have no guard and report zeros."""


@dataclass(frozen=True)
class SyncStatus:
    """Where a strategy stands after the last inner step it was told of (`SyncStrategy.status`): what the trainer
    logs, checkpoints by and prints."""

    outer_step: int
    """Rounds ended (their syncs launched; per-step strategies: 0, they have no outer optimizer)."""
    inner_steps: int
    """H of the round in progress (1 for per-step strategies); fit_link may change it between rounds."""
    boundary: bool
    """The replicas agree after the last step: a checkpoint or an evaluation of record goes there."""
    done: bool
    """`sync.round.mode = time`: every round of the run has ended (the clusters' step counts differ, so the run ends by
    rounds). False otherwise: the trainer counts train.steps."""
    progress: float
    """The run's progress at the last step, in steps of an unslowed cluster, which the inner learning rate follows:
    that step, or with time rounds the round index plus the fraction of the round done."""
    landed_tokens: int
    """Token-weighted syncs: the tokens every cluster trained on in the rounds whose sync landed (else 0)."""
    guard_counts: dict[str, int]
    """sync.guard's totals over the run, by `GUARD_COUNTS`."""
    numel: int
    """Values of this rank's parameters that the strategy keeps in step."""
    state_bytes: int
    """Bytes of the strategy's own state on this rank (outer params, momentum, residuals), for the memory report."""
    messages: list[str]
    """Messages for the user (the link cannot keep up, the guard's verdicts): the strategy's own list, from which the
    trainer pops and prints them once."""
    events: list[ElasticEvent] = dataclasses.field(default_factory=list)
    """Elastic runs: the membership changes (stalls, leaves, rejoins) seen and not yet taken: the strategy's own list,
    from which the trainer pops and records them."""
    last_clusters: tuple[int, ...] = ()
    """Elastic runs: the clusters of the last boundary settled (after the flush: those that ended the run)."""


class SyncStrategy(Protocol):
    """One way of keeping the clusters' models together (docs/design.md §6): everything the trainer uses.

    loss.backward(); sync.reduce_gradients(); inner_optimizer.step()
    stats = sync.after_inner_step(step, step_s=seconds)    # a round's sync, when one landed
    status = sync.status()                                   # boundary, outer step, messages, ...
    """

    name: str

    def reduce_gradients(self) -> None:
        """Average this step's gradients over the ranks that must agree on them, before the inner step."""

    def after_inner_step(self, step: int, *, step_s: float = 0.0) -> RoundStats | None:
        """Called after inner step `step` (1-based) that trained for `step_s` seconds (time rounds measure each
        cluster's step time from it); returns what the sync waited for at this step cost, or None when nothing was
        waited for (no round ended, or a delayed sync's first round)."""

    def status(self) -> SyncStatus:
        """Where the strategy stands after the last step (`SyncStatus`)."""

    def flush(self) -> RoundStats | None:
        """Apply anything pending (the end of training); afterwards every cluster holds the same parameters.
        Returns what the sync it waited for cost, or None when nothing was pending."""

    def agreed_model(self) -> AbstractContextManager[bool]:
        """Inside it, this rank's parameters are the ones every cluster agrees on (outer loops: the outer params
        with every landed update applied); the local ones are restored on exit. It yields whether it swapped
        anything (False for per-step strategies, whose clusters agree after every step)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ElasticSync(SyncStrategy, Protocol):
    """An outer loop whose clusters may fail and rejoin (`topology.elastic`, docs/design.md §10.1), or whose stage
    replicas follow replica 0 (clusters of different dp, §2.1): what the trainer uses besides `SyncStrategy`."""

    def rejoin(self) -> tuple[int, str] | None:
        """Meet the other clusters before the first step; one that joins an elastic run in progress heals from a live
        peer and gets (step, phase). A following replica learns where its stage stands."""


class StepRounds:
    """`SyncStrategy.status` for strategies whose every cluster does every step (allreduce, cocktail): the run ends
    at train.steps, its progress is the step, the replicas agree after every step and no guard runs."""

    numel: int
    warnings: list[str]
    step = 0
    """The last step `after_inner_step` was told of."""

    def status(self) -> SyncStatus:
        return SyncStatus(
            outer_step=0,
            inner_steps=1,
            boundary=True,
            done=False,
            progress=float(self.step),
            landed_tokens=0,
            guard_counts=dict.fromkeys(GUARD_COUNTS, 0),
            numel=self.numel,
            state_bytes=self.state_bytes(),
            messages=self.warnings,
        )

    def state_bytes(self) -> int:
        return 0


def clear_non_finite_state(optimizer: torch.optim.Optimizer | None) -> None:
    """Clear `optimizer`'s state when any floating-point tensor of it is not finite (after the guard healed a cluster:
    a diverged round's AdamW moments); finite state is kept."""
    if optimizer is not None and not all(
        bool(torch.isfinite(value).all())
        for state in optimizer.state.values()
        for value in state.values()
        if torch.is_tensor(value) and value.is_floating_point()
    ):
        optimizer.state.clear()


class FlatParams:
    """A fixed list of parameters seen as one flat fp32 vector (one collective per step instead of one per tensor).
    A sharded stage's parameter (`topology.dp_mode = shard`) counts as this rank's shard of it (`local_shard`).

    flat = FlatParams(model.parameters())
    g = flat.gather_grads()        # (numel,)
    flat.scatter_grads(g)
    """

    def __init__(self, params) -> None:
        self.params: list[torch.nn.Parameter] = [p for p in params if p.requires_grad]
        self.numels = [local_shard(p).numel() for p in self.params]
        self.shapes = [local_shard(p).shape for p in self.params]
        self.full_shapes = [p.shape for p in self.params]
        """Every tensor's shape before it was sharded (`shapes` where nothing is)."""
        self.numel = sum(self.numels)

    def gather_data(self) -> torch.Tensor:
        return torch.cat([local_shard(p).detach().reshape(-1).float() for p in self.params])

    def scatter_data(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            for p, chunk in zip(self.params, flat.split(self.numels), strict=True):
                local_shard(p).copy_(chunk.view_as(local_shard(p)))

    def gather_grads(self) -> torch.Tensor:
        return torch.cat(
            [
                (local_shard(p.grad) if p.grad is not None else torch.zeros_like(local_shard(p))).reshape(-1).float()
                for p in self.params
            ]
        )

    def scatter_grads(self, flat: torch.Tensor) -> None:
        for p, chunk in zip(self.params, flat.split(self.numels), strict=True):
            if p.grad is None:
                p.grad = torch.empty_like(p)
            local_shard(p.grad).copy_(chunk.view_as(local_shard(p)))


def dp_mean_(flat: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """In-place mean over the fast data-parallel group; a no-op for a group of one."""
    size = group_size(group)
    if size > 1:
        dist.all_reduce(flat, group=group)
        flat.div_(size)
    return flat


def shard_bounds(numel: int, num_shards: int, index: int) -> tuple[int, int]:
    """Equal shards (the last ones one element shorter), like torch.tensor_split."""
    base, extra = divmod(numel, num_shards)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)
