"""DiLoCo (Douillard et al. 2023, arXiv 2311.08105) and its one-step-delay form from DiLoCoX (arXiv 2506.21263).

H local steps, then an outer step on the pseudo-gradient averaged over the clusters. One round reads top-down in
`DiLoCoSync.end_round`: `prepare_sync` launches the round's pseudo-gradient (its reducer encodes it and averages it
over the slow link, docs/design.md §4.4, on the channel's thread); `perform_sync` waits for the sync that is due,
lets the guard judge it and takes the outer optimizer's step; the next round starts at phi, or under the delay where
the merge rule says. With `sync_delay = 0` the round's own sync is due at once (blocking DiLoCo, the "OpenDiLoCo"
row of DiLoCoX's table); with `sync_delay = 1` the last round's is, and this round's travels during the next.

    sync = DiLoCoSync(model.parameters(), SyncConfig(inner_steps=50, sync_delay=1), channel=channel, dp_group=dp_group)
    ...inner step...; sync.after_inner_step(step)     # every H steps: end_round(step)
    sync.flush()                                      # end of training: apply the update still in flight
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from dilocox.compress import CompressionConfig
from dilocox.faults import FaultConfig, FaultyReducer
from dilocox.net.channel import WanChannel
from dilocox.sync.base import FlatParams, RoundStats, dp_mean_
from dilocox.sync.config import SyncConfig, check_held_back_options, check_robust_reduction
from dilocox.sync.elastic import ElasticRounds
from dilocox.sync.lanes import LaneLayout, LaneReducer, build_lane_reducer
from dilocox.sync.link_fit import fit_inner_steps, fit_link_warning, slow_link_advice
from dilocox.sync.membership import ElasticMembership
from dilocox.sync.merge import InFlight, build_merge_rule
from dilocox.sync.outer_optimizer import (
    OuterOptimizer,
    OuterOptimizerFactory,
    outer_lr_schedule,
    outer_optimizer_factory,
)
from dilocox.sync.reducer_factory import build_reducer
from dilocox.sync.reducers import GatherReducer, PendingMean, Reducer
from dilocox.sync.robust import RoundGuard
from dilocox.sync.rounds import RoundClock, RoundReport, token_weighted_factor

STATE_KEYS: tuple[str, ...] = (
    "outer_params",
    "outer_optimizer",
    "round_start",
    "pending_sent",
    "pending_seq",
    "outer_step",
    "inner_steps",
    "round_end",
    "last_boundary",
    "reduction",
    "reducer",
    "guard",
)
"""The keys of `DiLoCoSync.state_dict`, all of which `load_state_dict` needs."""
WEIGHTED_STATE_KEYS = (
    "round_clock",
    "reports",
    "weight_sum",
    "landed_tokens",
    "pending_report",
    "pending_report_seq",
)
"""The keys a token-weighted sync (`DiLoCoSync.weighted`) adds to its state."""


class Landed(NamedTuple):
    """A sync that `perform_sync` waited for and applied."""

    stats: RoundStats
    left_out: bool
    """The others left out the update this cluster sent (not one it abstained from): it heals."""


class DiLoCoSync:
    """Keeps `outer_params` (phi, fp32), the outer optimizer and the round of this rank's parameters.

    End of round t (docs/design.md §3), with `pseudo_grad = round start - theta`:
    - `sync_delay = 0`: launch round t's sync, wait for it, take the outer step, theta = phi.
    - `sync_delay = 1`: wait for round t-1's sync (it had all of round t to travel), take its outer step, launch
      round t's. The merge rule (`sync.merge`, `dilocox.sync.merge`) says where round t+1 starts meanwhile: at phi
      (`reset`), at phi minus this cluster's own progress (`keep_local`), or at the outer step phi would take on an
      estimate of round t's average (`eager`, `lookahead`, `own_payload`), taken by the outer optimizer on copies.
      phi itself only ever takes the true averages, so every cluster holds the same phi (`agreed_model`).

    The outer optimizer is any `torch.optim.Optimizer` over phi (`outer_optimizer`, a factory; by default
    `sync.outer_optimizer`'s), with the learning rate of each update set by `sync.outer_lr_schedule` over the run's
    ceil(total_steps / H) updates. The average is its `reducer`'s (`compression.kind` and `compression.reduction`,
    docs/design.md §4.4); with `faults` a lying cluster's reducer is wrapped (`FaultyReducer`).

    `sync.local_residual` (a codec with error feedback): wherever a round starts, or restarts when an average lands,
    it starts lower by this cluster's share (1/C) of what its codec holds back, so the cluster keeps that progress
    instead of losing it at every landing. `sync.drain_residual`: at the end of training `flush()` sends what every
    codec still holds back once more, densely in int4, and phi takes its mean times the outer learning rate (an SGD
    outer optimizer's plain step), so the model the run ends with holds all of every cluster's progress.

    With `sync.guard` (docs/design.md §4.5, `RoundGuard`) a cluster whose own pseudo-gradient is non-finite
    abstains from the round and heals: the next round starts from phi, its error-feedback residuals are dropped and
    `guard.healed` tells the owner of the inner optimizer to reset its state where non-finite. The gather reduction
    leaves out every non-finite or outsized update (and with `sync.guard_peers` one that stands out among three or
    more); a cluster left out heals too. The summing reductions check the mean and skip a round whose mean is
    unusable. `sync.guard_max_bad_rounds` bad rounds in a row raise `GuardError`.

    With a `membership` (elastic runs, docs/design.md §10.1) the same round runs over each boundary's torchft quorum:
    `ElasticRounds` meets the live clusters, launches over their group and settles the sync that is due among them.

    Token-weighted averaging (`weighted`: `sync.round = "time"`, or `weigh_tokens=True` for clusters whose tokens per
    step differ): the average of a round is sum_c n_c delta_c / sum_c n_c, n_c the tokens cluster c trained on in it.
    Just before its pseudo-gradient each cluster all-gathers a `RoundReport` (steps, tokens, step time) on the same
    channel (FIFO, bytes counted), sends n_c / n_ref x delta_c through the reducer (n_ref = `round_tokens`, the
    nominal tokens of a round, the same on every cluster), and the landed mean is scaled by kept x n_ref / sum n_c
    (`token_weighted_factor`), which works for every reducer and codec. Error feedback then holds what the cluster
    still owes the weighted sum, and `sync.local_residual` keeps the cluster's share of it by the weights (the last
    landed sum of weights instead of C). Unweighted, nothing of this runs: no report, no scaling.
    With `sync.round = "time"` a `RoundClock` decides each round's steps on this cluster (`dilocox.sync.rounds`).
    """

    state_keys = STATE_KEYS
    """The keys of `state_dict`."""

    def __init__(
        self,
        params,
        cfg: SyncConfig,
        compression: CompressionConfig | None = None,
        *,
        channel: WanChannel,
        dp_group: dist.ProcessGroup | None,
        pp_group: dist.ProcessGroup | None = None,
        seed: int = 0,
        total_steps: int | None = None,
        faults: FaultConfig | None = None,
        membership: ElasticMembership | None = None,
        outer_optimizer: OuterOptimizerFactory | None = None,
        first_round_end: int | None = None,
        lanes: LaneLayout | None = None,
        cluster_weight: float = 1.0,
        tokens_per_step: int = 1,
        round_tokens: int | None = None,
        weigh_tokens: bool = False,
    ) -> None:
        """`first_round_end`: the step at which the first round ends (default H; a streaming fragment's first round
        is shorter, `dilocox.sync.streaming`); every later round has H steps. `lanes` and `cluster_weight`: clusters
        of different data-parallel degree (docs/design.md §2.1). `tokens_per_step`: the tokens this cluster trains on
        per inner step; `round_tokens`: n_ref, the nominal tokens of one round, the same on every cluster (default H
        x tokens_per_step); `weigh_tokens`: weigh the clusters by their tokens also with `sync.round = "steps"`."""
        cfg.validate()
        compression = compression or CompressionConfig()
        check_robust_reduction(cfg, compression)
        check_held_back_options(cfg, compression, elastic=membership is not None)
        self.cfg = cfg
        self.name = cfg.kind  # diloco or dilocox: the same code, other defaults
        self.flat = FlatParams(params)
        self.numel = self.flat.numel
        self.channel = channel
        self.dp_group = dp_group
        self.pp_group = pp_group
        """The cluster's pipeline, over which the stages agree on what the guard leaves out (None: one stage)."""
        self.compression = compression
        self.seed = seed
        self.lanes = lanes
        """Clusters of different data-parallel degree (topology.clusters): this rank's lanes, averaged over the stage
        group by a `LaneReducer` (docs/design.md §2.1); None for clusters of one shape."""
        if not (isinstance(cluster_weight, int | float) and 0 < cluster_weight < math.inf):
            raise ValueError(f"cluster_weight = {cluster_weight!r} must be a finite number > 0")
        self.cluster_weight = float(cluster_weight)
        """The factor of this cluster's payload (`prepare_sync`): C x dp_c / sum(dp) makes the reducer's plain mean
        the token-weighted mean of clusters of different data-parallel degree (their weights sum to C); 1.0
        otherwise."""
        # where the run is: the round in progress ends at round_end (fit_link may change H between rounds)
        self.inner_steps = cfg.inner_steps
        if first_round_end is not None and not 1 <= first_round_end <= cfg.inner_steps:
            raise ValueError(f"first_round_end = {first_round_end} must be in 1 ... H = {cfg.inner_steps}")
        self.round_end = cfg.inner_steps if first_round_end is None else first_round_end
        self.short_first_round = first_round_end is not None and first_round_end < cfg.inner_steps
        self.last_boundary = 0
        self.outer_step = 0  # rounds completed
        self.total_steps = total_steps
        self.num_outer_updates = None
        """Outer updates in the run (one per round), the horizon of a cosine outer learning rate."""
        if total_steps and first_round_end is None:
            self.num_outer_updates = math.ceil(total_steps / cfg.inner_steps)
        elif total_steps:  # the first round, then one per H steps after it, the last one cut at total_steps
            self.num_outer_updates = 1 + math.ceil(max(0, total_steps - first_round_end) / cfg.inner_steps)
        self.time_rounds = cfg.round == "time"
        self.weighted = self.time_rounds or weigh_tokens
        """Whether the average weighs the clusters by their tokens (the class docstring)."""
        if self.weighted and membership is not None:
            raise ValueError("token-weighted rounds (sync.round = time) are not supported in elastic runs")
        if self.time_rounds and not total_steps:
            raise ValueError("sync.round = time makes the run ceil(total_steps / H) rounds: pass total_steps")
        self.tokens_per_step = tokens_per_step
        self.round_tokens = round_tokens if round_tokens is not None else cfg.inner_steps * tokens_per_step
        self.reports: list[RoundReport | None] | None = None
        """Every cluster's report of the last round whose sync landed (weighted syncs)."""
        self.weight_sum = float(self.num_clusters)
        """sum_c n_c / n_ref of the last landed round (weighted syncs; C before any): the local residual's divisor."""
        self.landed_tokens = 0
        """Tokens every cluster trained on in the rounds whose sync landed (weighted syncs)."""
        self._own_weight = 1.0  # n_c / n_ref of the round just launched
        self.clock: RoundClock | None = None
        """sync.round = time: the steps of each round on this cluster."""
        if self.time_rounds:
            slow = faults.slow_factor(self.cluster) if faults is not None else 1.0
            virtual = faults is not None and faults.slow_mode == "virtual"
            self.clock = RoundClock(
                cfg,
                total_steps=total_steps,
                virtual_factor=slow if virtual else None,
                dp_group=dp_group,
                pp_group=pp_group,
                device=self.flat.params[0].device if self.flat.params else None,
            )
            self.inner_steps = self.round_end = self.clock.first_steps()
        if cfg.outer_lr_schedule == "cosine" and self.num_outer_updates is None:
            raise ValueError(
                "sync.outer_lr_schedule = 'cosine' decays over the run's outer updates, so it needs the run's length: "
                "pass total_steps (the trainer passes train.steps), or use 'constant'"
            )
        params_device = self.flat.params[0].device if self.flat.params else torch.device("cpu")
        self.state_device = params_device if cfg.outer_state_device == "device" else torch.device("cpu")
        """Where the outer state, the pseudo-gradient and its reduction live (sync.outer_state_device)."""
        self.outer_params = self.flat.gather_data().to(self.state_device, copy=True)  # (numel,) fp32, phi
        self.round_start = self.outer_params.clone()  # theta at the start of the round
        self.outer = OuterOptimizer(
            self.outer_params,
            outer_optimizer if outer_optimizer is not None else outer_optimizer_factory(cfg),
            lr_at=outer_lr_schedule(cfg, self.num_outer_updates),
        )
        """The outer optimizer of phi (`sync.outer_optimizer`, or the factory passed in) and its lr schedule."""
        if cfg.drain_residual and not self.outer.takes_plain_steps:
            raise ValueError(
                f"sync.drain_residual = true adds the drained residual to phi at the outer SGD's learning rate, but "
                f"the outer optimizer is {self.outer.name}, whose steps have a length of their own; set "
                "sync.drain_residual = false (OuterSync: drain_residual=False), or use an SGD outer optimizer"
            )
        self.merge = build_merge_rule(cfg.merge)
        """Where a round starts while the last round's average is in flight (`sync.merge`, delayed syncs only)."""
        self.warnings: list[str] = []  # for the trainer to print once (the link cannot keep up, the guard's verdicts)
        self._warned = False
        reducer = self._build_reducer(compression, elastic=membership is not None)
        gathers = isinstance(reducer, GatherReducer | LaneReducer)  # judges every cluster's update on its own
        self._update_guard = reducer.guard if isinstance(reducer, GatherReducer | LaneReducer) else None
        """The gather reduction's own guard (its norm history), None for the summing reductions."""
        self.guard = RoundGuard(
            max_ratio=cfg.guard_max_ratio,
            max_bad_rounds=cfg.guard_max_bad_rounds,
            judges_mean=cfg.guard and not gathers,
            warnings=self.warnings,
        )
        self.faults = faults if faults is not None and faults.enabled else None
        self.reducer: Reducer = reducer
        if self.faults is not None and self.faults.lies:
            self.reducer = FaultyReducer(reducer, self.faults, channel=channel, round_index=lambda: self.outer_step + 1)
        self.pending: PendingMean | None = None
        """The sync in flight (launched by `prepare_sync`, landed by `perform_sync`)."""
        self.elastic = ElasticRounds(self, membership) if membership is not None else None
        """Elastic runs (topology.elastic, docs/design.md §10.1): each boundary's torchft quorum decides which clusters
        take part; it launches over their group and settles the sync that is due among them."""

    @property
    def scales_payload(self) -> bool:
        """Whether this cluster's payload is its pseudo-gradient times a weight (token-weighted syncs, or clusters of
        different dp): the merge rules then take its share in the average as weight x pseudo_grad / sum of weights."""
        return self.weighted or self.cluster_weight != 1.0

    @property
    def num_clusters(self) -> int:
        """C: the clusters the average is over (elastic: the live ones of the round)."""
        return self.lanes.num_clusters if self.lanes is not None else self.channel.world_size

    @property
    def cluster(self) -> int:
        """This cluster's index among them (its `RoundStats.excluded` key)."""
        return self.lanes.cluster if self.lanes is not None else self.channel.group_rank

    def _build_reducer(self, compression: CompressionConfig, *, elastic: bool = False) -> Reducer:
        """A reducer of `compression` over this rank's tensors, on its channel, with the guard and the aggregate of
        `[sync]`: the rounds' (`self.reducer`) and the drain's."""
        common: dict[str, Any] = dict(
            channel=self.channel,
            dp_group=self.dp_group,
            pp_group=self.pp_group,
            seed=self.seed,
            guard_max_ratio=self.cfg.guard_max_ratio if self.cfg.guard else None,
            peer_max_ratio=self.cfg.guard_peer_ratio if self.cfg.guard_peers else None,
        )
        if self.lanes is not None:
            return build_lane_reducer(compression, self.flat.shapes, layout=self.lanes, **common)
        return build_reducer(
            compression,
            self.flat.shapes,
            **common,
            aggregate=self.cfg.aggregate,
            trim_fraction=self.cfg.trim_fraction,
            elastic=elastic,
        )

    # ---------------------------------------------------------------------------------------------- protocol
    def reduce_gradients(self) -> None:
        self.flat.scatter_grads(dp_mean_(self.flat.gather_grads(), self.dp_group))

    def is_round_boundary(self, step: int) -> bool:
        return step in self._round_ends() or (step > 0 and step == self.last_boundary)

    def _round_ends(self) -> tuple[int | None, ...]:
        """The steps at which the round in progress ends: its end, and with step rounds the run's last step (time
        rounds end the run after its rounds, at whatever step each cluster is)."""
        return (self.round_end,) if self.time_rounds else (self.round_end, self.total_steps)

    @property
    def done(self) -> bool:
        """sync.round = time: whether every round of the run has ended."""
        return self.clock is not None and self.outer_step >= self.clock.num_rounds

    def progress_step(self, step: int) -> float:
        """The run's progress at this cluster's 0-based step `step` (of the round in progress), in steps of an
        unslowed cluster: `step` itself with step rounds; with time rounds the round index plus the fraction of the
        round done (`RoundClock.progress_step`), which the inner learning rate schedule follows."""
        if self.clock is None:
            return float(step)
        return self.clock.progress_step(
            self.outer_step + 1, step - self.last_boundary, max(1, self.round_end - self.last_boundary)
        )

    def add_step_time(self, seconds: float) -> None:
        """sync.round = time: count one inner step's training time (the round's step time is measured from it)."""
        if self.clock is not None:
            self.clock.add_step_time(seconds)

    @property
    def guard_counts(self) -> dict[str, int]:
        """sync.guard's totals: excluded_updates, skipped_rounds, healed_rounds."""
        return self.guard.counts

    def take_healed(self) -> bool:
        """Whether the guard reset this cluster's parameters to the agreed ones since the last call (the owner of
        the inner optimizer then resets its non-finite state)."""
        healed, self.guard.healed = self.guard.healed, False
        return healed

    def restart_round(self) -> None:
        """Start the round in progress again from its start: this cluster's parameters went bad mid-round (a
        streaming fragment whose neighbour's round ended non-finite; `dilocox.sync.streaming`)."""
        self.flat.scatter_data(self.round_start)

    def after_inner_step(self, step: int) -> RoundStats | None:
        """At a round's end (every H steps, and at `total_steps`) `end_round`; with `sync.overlap_steps`, that many
        steps into a round, the landing of the last round's sync (`land_in_round`)."""
        if self.faults is not None and step == self.last_boundary + 1:
            if self.faults.diverges(cluster=self.cluster, round_index=self.outer_step + 1):
                self.flat.scatter_data(torch.full((self.numel,), float("nan")))  # faults: this round diverges
        if step in self._round_ends():
            return self.end_round(step)
        if self.pending is not None and step == self.last_boundary + self.cfg.overlap_steps:
            return self.land_in_round(step)
        return None

    # ---------------------------------------------------------------------------------------------- the round
    def end_round(self, step: int) -> RoundStats | None:
        """End the round in progress at `step`: launch its sync (`prepare_sync`), land the one that is due
        (`perform_sync`: this one when blocking, the last one if delayed) and start the next round.

        Delayed: the last round's sync lands before this round's is launched. The link is FIFO, so this round's
        transfer could not start earlier anyway, and the launch then sees everything the last sync left behind
        (error-feedback residuals and shared warm starts of the scalable path). Returns what the sync that landed
        cost (None in the first round of a delayed sync: nothing was due)."""
        round_steps, round_index = step - self.last_boundary, self.outer_step + 1
        # elastic: a cluster that healed at this boundary did not train the round that ends here, so it abstains
        newcomer = self.elastic.open_boundary(step) if self.elastic is not None else False
        pseudo_grad = self.round_start - self.flat.gather_data().to(self.state_device)  # (numel,) round start - theta
        own_bad = self.cfg.guard and not newcomer and not bool(torch.isfinite(pseudo_grad).all())
        abstain = own_bad or newcomer
        step_s = self.clock.close_round() if self.clock is not None else 0.0  # measured: collective in the cluster
        report = RoundReport(round_steps, 0 if abstain else round_steps * self.tokens_per_step, step_s)
        if self.cfg.sync_delay == 0:
            if own_bad:  # before the encoding: what the bad round left in the residuals is not sent
                self.reducer.heal()
            with self._launch_scope(step):
                self.prepare_sync(pseudo_grad, abstain=abstain, report=report)
            landed = self.perform_sync(round_steps=round_steps, round_index=round_index)
            heal = abstain or (landed is not None and landed.left_out)
            theta = self.outer_params if heal else self._with_held_back(self.outer_params)
        else:
            landed = self.perform_sync(round_steps=round_steps, round_index=round_index - 1)
            if landed is not None and self.cfg.fit_link:
                self._fit_inner_steps(landed.stats, round_steps)
            heal = abstain or (landed is not None and landed.left_out)
            if heal:  # before this round's encoding: what the bad round left in the residuals is not sent again
                self.reducer.heal()
            # what the last encodings held back is read before this one takes it in
            held_before = self.reducer.held_back(self.state_device) if self._reads_held_back() else None
            with self._launch_scope(step):
                self.prepare_sync(pseudo_grad, abstain=abstain, report=report)  # pseudo_grad stays intact
            theta = self.outer_params if heal else self._delayed_start(pseudo_grad, held_before)
        if self.cfg.guard and not newcomer:
            self.guard.count_own(own_bad, round_index)
            if heal:
                why = "its own update is non-finite" if own_bad else "the others left its update out"
                self.guard.heal(cluster=self.cluster, round_index=round_index, why=why)
        if self.elastic is not None:
            self.elastic.commit()
        self.flat.scatter_data(theta)
        self.round_start = theta.clone()
        self.outer_step += 1
        if self.clock is not None and not self.done:
            self.inner_steps = self.clock.next_steps(
                self.outer_step + 1, last_step_s=step_s, reports=self.reports, own_index=self.cluster
            )
        self.last_boundary, self.round_end = step, step + self.inner_steps
        return None if landed is None else landed.stats

    def _launch_scope(self, step: int) -> AbstractContextManager[None]:
        """Where the round ending at `step` launches its sync: the last round's is part of the end of training
        (every streaming fragment's last round ends at train.steps, so those syncs go together, as the flush and the
        drain do, with no compute left to hide behind), which the link's peak in flight leaves out
        (`WanChannel.off_peak`); the peak is that of the rounds during training."""
        if self.clock is not None:  # time rounds: the run ends after its rounds, at whatever step
            last = self.outer_step + 1 >= self.clock.num_rounds
        else:
            last = step == self.total_steps
        return self.channel.off_peak() if last else nullcontext()

    def prepare_sync(
        self, pseudo_grad: torch.Tensor, *, abstain: bool = False, report: RoundReport | None = None
    ) -> None:
        """Launch the sync of this round's `pseudo_grad` (numel,) into `pending`: the reducer encodes it and starts
        averaging it on the channel's thread. A cluster that `abstain`s (its own update is non-finite, or it did not
        train the round) sends nothing usable, and the others leave it out. Elastic: over this boundary's quorum.
        Weighted syncs: the round's `report` goes first, then the pseudo-gradient times n_c / n_ref."""
        if self.elastic is not None:
            self.elastic.before_launch()
        sent_report = None
        if self.weighted:
            if report is None:
                raise ValueError("a token-weighted sync needs the round's report: pass report=RoundReport(...)")
            sent_report = report.to_tensor()
            report_transfer = self.channel.launch_all_gather(sent_report)  # FIFO: lands before the payload
            self._own_weight = report.tokens / self.round_tokens
            pseudo_grad = pseudo_grad * self._own_weight  # a new tensor: the caller's stays as it was
        elif self.cluster_weight != 1.0:  # clusters of different dp: the plain mean becomes the weighted one
            self._own_weight = self.cluster_weight
            pseudo_grad = pseudo_grad * self.cluster_weight
        if abstain:
            self.pending = self.reducer.abstain(pseudo_grad)
            self.pending.abstained = True
        else:
            self.pending = self.reducer.launch(pseudo_grad)
        if sent_report is not None:
            self.pending.report, self.pending.report_sent = report_transfer, sent_report

    def perform_sync(self, *, round_steps: int | None, round_index: int, judge_link: bool = True) -> Landed | None:
        """Land the sync in flight, launched by round `round_index` after `round_steps` steps of compute: wait for its
        average (elastic: settled among this boundary's live clusters), and unless the guard found it unusable take
        the outer step of update `round_index - 1` with it. None when no sync was due. `judge_link`: whether a link
        slower than the compute since the launch deserves the slow-link warning (not at the final flush)."""
        due, self.pending = self.pending, None
        if self.elastic is not None:
            arrived = self.elastic.settle(due, round_steps=round_steps, round_index=round_index, judge_link=judge_link)
        elif due is not None:
            arrived = self.wait_sync(due, round_steps=round_steps, round_index=round_index, judge_link=judge_link)
        else:
            arrived = None
        if arrived is None:
            return None
        avg, stats = arrived
        if round_index == 1 and self.short_first_round:
            self._forget_norms()
        self.outer.set_lr(round_index - 1)
        if not stats.skipped:  # the guard found no usable mean: phi and the optimizer's state stay
            self.outer.step(avg)
        # an update this cluster abstained from (its own was non-finite, or it is new to the quorum) is missing from
        # every gather by design: not a verdict against it
        left_out = due is not None and not due.abstained and self.cluster in (stats.excluded or {})
        return Landed(stats, left_out)

    def _forget_norms(self) -> None:
        """A short first round's pseudo-gradient covers a fraction of H steps (early in training, under the inner
        warm-up): its norm is no reference for the full rounds', which the guard would leave out as outsized. The
        guard's norm history starts afresh with the next round."""
        for update_guard in (self._update_guard, self.guard.mean_guard):
            if update_guard is not None:
                update_guard.history.clear()

    def land_in_round(self, step: int) -> RoundStats:
        """`sync.overlap_steps`: land the last round's sync `overlap_steps` into this round.

        The cluster keeps what it computed since the boundary: its parameters move by what phi moved past the round
        start (the true average replaces the estimate the merge rule started from, as at a boundary), and the round
        start becomes phi, so this round's pseudo-gradient is still all of its own progress."""
        landed = self.perform_sync(round_steps=step - self.last_boundary, round_index=self.outer_step)
        assert landed is not None, "a sync was in flight"
        if landed.left_out:
            self.reducer.heal()
            if self.cfg.guard:
                why = "the others left its update out"
                self.guard.heal(cluster=self.cluster, round_index=self.outer_step, why=why)
            start = self.outer_params.clone()
            theta = start
        else:
            start = self._with_held_back(self.outer_params)
            theta = self.flat.gather_data().to(self.state_device) + (start - self.round_start)
        self.flat.scatter_data(theta)
        self.round_start = start
        return dataclasses.replace(landed.stats, inner_steps=self.inner_steps)

    def flush(self) -> RoundStats | None:
        """Apply the sync still in flight (and with `sync.drain_residual` what the codecs still hold back); afterwards
        every cluster holds the same parameters (phi). Returns the stats of the sync it waited for, if any."""
        if self.elastic is not None:
            self.elastic.open_boundary(None)
        # launched by the last end_round: no round of compute to hide behind
        landed = self.perform_sync(round_steps=None, round_index=self.outer_step, judge_link=False)
        stats = None if landed is None else landed.stats
        if self.cfg.drain_residual:
            drained = self._drain()
            stats = stats.with_exclusions_of(drained) if stats is not None else None
        if self.elastic is not None:
            self.elastic.commit()
        if stats is not None or self.cfg.local_residual or self.cfg.drain_residual or self.elastic is not None:
            self.flat.scatter_data(self.outer_params)  # blocking: the clusters held phi minus their shares
            self.round_start = self.outer_params.clone()
        return stats

    def wait_sync(
        self,
        pending: PendingMean,
        *,
        round_steps: int | None = None,
        round_index: int | None = None,
        judge_link: bool = True,
        judge_mean: bool = True,
        blocked_from: float | None = None,
    ) -> tuple[torch.Tensor, RoundStats]:
        """The averaged pseudo-gradient of a launched sync, judged by the guard, with the link time it took and the
        part that was hidden. Takes no outer step.

        `round_steps`: inner steps computed since the sync was launched (this round's H), for the per-round log;
        `round_index`: the round that launched it (1-based), for the guard's messages; `judge_link`: whether a
        link slower than the compute since the launch deserves the slow-link warning; `judge_mean`: whether the
        summing reductions' guard judges the mean against recent rounds' (not for the drain, whose residual is no
        round's pseudo-gradient); `blocked_from`: when the wait began, on the channel's clock, if the caller already
        waited for the transfer itself (an elastic cluster's ranks vote on it before the fast collectives)."""
        round_steps = self.inner_steps if round_steps is None else round_steps
        round_index = self.outer_step if round_index is None else round_index
        clock = self.channel.clock  # the link's clock: real time, or a test's virtual seconds
        if blocked_from is None:
            blocked_from = clock.now()
        compute_s = blocked_from - pending.transfer.launch_time
        reports = None
        if pending.report is not None:
            reports = [None if r is None else RoundReport.from_tensor(r) for r in pending.report.wait()]
        avg = pending.wait()
        if reports is not None:  # the token-weighted mean of the pre-scaled pseudo-gradients
            factor, weight_sum = token_weighted_factor(
                reports, excluded=pending.excluded, round_tokens=self.round_tokens
            )
            avg.mul_(factor)
            self.reports = reports
            if weight_sum > 0:
                self.weight_sum = weight_sum
            self.landed_tokens += sum(r.tokens for r in reports if r is not None)
        skipped = False
        if self.cfg.guard:
            skipped = self.guard.judge_landing(
                avg,
                pending.excluded,
                num_clusters=self.num_clusters,
                where=f"round {round_index}" if judge_mean else "drain",
                judge_mean=judge_mean,
            )
            if skipped:
                self.reducer.heal()  # a non-finite mean may have reached every cluster's residuals
                avg = torch.zeros_like(avg)
        exposed_s, peer_wait_s = pending.transfer.split_wait(blocked_from, clock.now())
        stats = RoundStats(
            link_s=pending.transfer.link_s,
            exposed_s=exposed_s,
            peer_wait_s=peer_wait_s,
            bytes_sent=pending.transfer.nbytes_sent,
            compute_s=compute_s,
            inner_steps=round_steps,
            cost=pending.cost,
            rank=self.reducer.current_rank(),
            matrix_ranks=self.reducer.current_matrix_ranks(),
            excluded=dict(pending.excluded) if self.cfg.guard else None,
            skipped=skipped,
            round_index=round_index,
            cluster_steps=None if reports is None else tuple(r.steps if r else 0 for r in reports),
            cluster_tokens=None if reports is None else tuple(r.tokens if r else 0 for r in reports),
        )
        slower = judge_link and stats.link_s > compute_s > 0
        if self.cfg.sync_delay == 1 and slower and not self._warned and not self.cfg.fit_link:
            self._warned = True
            advice = slow_link_advice(
                stats, round_steps=round_steps, overlap_steps=self.cfg.overlap_steps, channel=self.channel
            )
            self.warnings.append(advice)
        return avg, stats

    # -------------------------------------------------------------------------------------- where a round starts
    def _delayed_start(self, pseudo_grad: torch.Tensor, held_before: torch.Tensor | None) -> torch.Tensor:
        """Where the next round starts under the one-step delay, round t's `pseudo_grad` just launched: the merge
        rule's start, lowered under `sync.local_residual` by this cluster's share of what its codec holds back and
        the start does not carry (`MergeRule.held_share`). `held_before`: what the codec held back before that launch
        (None: nothing, or not read)."""
        flight = InFlight(
            self.outer_params,
            pseudo_grad,
            num_clusters=self.num_clusters,
            predict=functools.partial(self.outer.predict, update=self.outer_step),
            held_before=held_before,
            read_held_after=functools.partial(self.reducer.held_back, self.state_device),
            feedback_decay=self.compression.feedback_decay,
            weight=self._own_weight if self.scales_payload else None,
            weight_sum=self.weight_sum if self.scales_payload else None,
        )
        start = self.merge.start(flight)
        if self.cfg.local_residual:
            share = self.merge.held_share(flight)
            if share is not None:
                start = start - share / flight.share_divisor
        return start

    def _with_held_back(self, phi: torch.Tensor) -> torch.Tensor:
        """Where a round (re)starts from the agreed `phi` once no average is in flight: phi itself, or under
        `sync.local_residual` phi minus this cluster's share (1/C) of what its codec holds back (a new tensor)."""
        held_back = self.reducer.held_back(self.state_device) if self.cfg.local_residual else None
        divisor = self.weight_sum if self.weighted else self.num_clusters  # weighted: the cluster's weight
        return phi.clone() if held_back is None else phi - held_back / divisor

    def _reads_held_back(self) -> bool:
        """Whether a delayed round's start depends on what the codec held back before the round's encoding."""
        return self.cfg.local_residual or self.merge.reads_held_back

    def _fit_inner_steps(self, stats: RoundStats, round_steps: int) -> None:
        """compression.fit_link: the next round's H, sized to the link by the sync just waited for (`link_fit`)."""
        self.inner_steps, needed = fit_inner_steps(
            stats, round_steps=round_steps, cfg=self.cfg, current=self.inner_steps
        )
        if needed > self.cfg.max_inner_steps and not self._warned:
            self._warned = True
            self.warnings.append(fit_link_warning(stats, round_steps=round_steps, needed=needed, cfg=self.cfg))

    def _drain(self) -> RoundStats | None:
        """`sync.drain_residual`: send every cluster's held-back residual (`Reducer.held_back`) dense in int4 and
        subtract its mean times the outer learning rate from phi, without a momentum step (the residual is progress
        already made, not a direction to keep going); the codec then holds nothing back. One payload of about
        4.25 bits per value per cluster, waited for at the end: nothing is left to compute behind it. Returns what it
        waited for (round None), or None before any round ended."""
        held_back = self.reducer.held_back(self.state_device)
        if held_back is None:  # no round has ended yet
            return None
        drain = self._build_reducer(
            CompressionConfig(kind="int4", error_feedback=False, group_size=self.compression.group_size)
        )
        with self.channel.off_peak():  # a one-off transfer at the end: the peak in flight is the rounds'
            pending = drain.launch(held_back)
        avg, stats = self.wait_sync(pending, judge_link=False, judge_mean=False)
        if self.weighted:  # the residuals are in weighted units: their sum over the last landed sum of weights
            avg.mul_((self.num_clusters - len(pending.excluded)) / self.weight_sum)
        if not stats.skipped:
            self.outer_params.sub_(avg, alpha=self.outer.lr)
        self.reducer.heal()  # sent: nothing is held back any more
        self.warnings.append(
            f"drain: sent the held-back residual (int4, {stats.bytes_sent:,} bytes from this rank, "
            f"{stats.link_s:.2f} s of link, {stats.exposed_s:.2f} s waited)"
            + (": no usable mean, phi kept as it was" if stats.skipped else "")
        )
        return dataclasses.replace(stats, round_index=None)

    @contextmanager
    def agreed_model(self) -> Iterator[bool]:
        """The model holds phi, the outer params with every landed update applied (docs/design.md §3), until exit.

        Between round boundaries, and with `sync_delay = 1` and `keep_local` always, a cluster's own parameters
        differ from phi; phi is the same on every cluster (each applied the same averages), so evaluating it
        scores the model the clusters agree on rather than one cluster's local model."""
        local = self.flat.gather_data()  # (numel,) fp32 on the parameters' device
        self.flat.scatter_data(self.outer_params)
        try:
            yield True
        finally:
            self.flat.scatter_data(local)

    # ---------------------------------------------------------------------------------------------- state
    def state_bytes(self) -> int:
        """Bytes of the outer state: outer params, the round start and the delayed sync (fp32), the outer optimizer's
        state tensors (momentum, moments) and the reducer's (error-feedback residuals, warm starts)."""
        vectors = 2 + (self.cfg.sync_delay == 1)
        return 4 * self.flat.numel * vectors + self.outer.state_bytes() + self.reducer.state_bytes()

    def state_dict(self) -> dict[str, Any]:
        """The outer state, including the delayed sync in flight: not waited for (a checkpoint must not stall the
        overlap) but saved as what this rank sent, which a resumed run sends again (`load_state_dict`), so it
        arrives and is applied at the same step as in an uninterrupted run."""
        return {
            "outer_params": self.outer_params.detach().clone(),
            "outer_optimizer": self.outer.state_dict(),
            "round_start": self.round_start.clone(),
            "pending_sent": None if self.pending is None else self.pending.sent.clone(),
            "pending_seq": -1 if self.pending is None else self.pending.transfer.seq,
            "outer_step": self.outer_step,
            "inner_steps": self.inner_steps,
            "round_end": self.round_end,
            "last_boundary": self.last_boundary,
            "reduction": self.reducer.name,
            "reducer": self.reducer.state_dict(),
            "guard": self.guard.state_dict(),
            **(self._weighted_state() if self.weighted else {}),
        }

    def _weighted_state(self) -> dict[str, Any]:
        """What a token-weighted sync adds (`WEIGHTED_STATE_KEYS`): the round clock, the last landed reports and the
        report of the sync in flight, which a resumed run sends again before its payload."""
        pending_report = None if self.pending is None else self.pending.report_sent
        return {
            "round_clock": None if self.clock is None else self.clock.state_dict(),
            "reports": None if self.reports is None else [None if r is None else r.to_tensor() for r in self.reports],
            "weight_sum": self.weight_sum,
            "landed_tokens": self.landed_tokens,
            "pending_report": None if pending_report is None else pending_report.clone(),
            "pending_report_seq": -1 if pending_report is None else self.pending.report.seq,  # type: ignore[union-attr]
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [key for key in STATE_KEYS if key not in state]
        if missing:
            raise ValueError(
                f"this outer-sync state lacks {', '.join(missing)}: load_state_dict takes what state_dict() of this "
                "version returned; start a new run (dilocox eval still reads its model)"
            )
        if self.weighted != all(key in state for key in WEIGHTED_STATE_KEYS):
            saved = "unweighted (sync.round = steps)" if self.weighted else "token-weighted (sync.round = time)"
            raise ValueError(
                f"this outer-sync state is {saved}, this run is not: resume with the sync.round it was written with"
            )
        if state["reduction"] != self.reducer.name:
            raise ValueError(
                f"this checkpoint averaged with the {state['reduction']!r} reducer but this run uses "
                f"{self.reducer.name!r}; resume with the compression.kind and compression.reduction it was written with"
            )
        with torch.no_grad():
            self.outer_params.copy_(state["outer_params"])
        self.outer.load_state_dict(state["outer_optimizer"])
        self.round_start = state["round_start"].to(self.outer_params.device, copy=True)
        self.outer_step = int(state["outer_step"])
        self.inner_steps = int(state["inner_steps"])
        self.round_end = int(state["round_end"])
        self.last_boundary = int(state["last_boundary"])
        self.reducer.load_state_dict(state["reducer"])
        self.guard.load_state_dict(state["guard"])
        report_flight = None
        if self.weighted:
            if self.clock is not None and state["round_clock"] is not None:
                self.clock.load_state_dict(state["round_clock"])
            saved = state["reports"]
            self.reports = None if saved is None else [None if r is None else RoundReport.from_tensor(r) for r in saved]
            self.weight_sum = float(state["weight_sum"])
            self.landed_tokens = int(state["landed_tokens"])
            if state["pending_report"] is not None:
                report_flight = state["pending_report"], not state["pending_report_seq"] < self.channel.num_transfers
        # Every rank resumes from the same step and loads in the same order, so the re-sends pair up across
        # clusters. The link counters (restored first) hold the transfer exactly when it had arrived on this rank.
        self.pending, flight = None, None
        if state["pending_sent"] is not None:
            counted = state["pending_seq"] < self.channel.num_transfers
            flight = state["pending_sent"].to(self.outer_params.device), not counted  # checkpoints load on the CPU
        if self.elastic is not None:  # sent again over the first quorum's group, once this cluster is in it
            self.elastic.resume(self.last_boundary, flight)
        elif flight is not None:
            report = None
            if report_flight is not None:  # sent again first, as it was first sent
                report = self.channel.launch_all_gather(report_flight[0], account=report_flight[1])
            self.pending = self.reducer.relaunch(flight[0], account=flight[1])
            if report is not None:
                self.pending.report, self.pending.report_sent = report, report_flight[0]

    def agreed_state(self) -> dict[str, Any]:
        """What every cluster holds alike at a boundary: phi, the outer optimizer's state and the round counters
        (what a cluster that joins an elastic run heals from, `ElasticRounds.heal_state`)."""
        return {
            "outer_params": self.outer_params.detach().clone(),
            "outer_optimizer": self.outer.state_dict(),
            "outer_step": self.outer_step,
            "inner_steps": self.inner_steps,
            "round_end": self.round_end,
            "last_boundary": self.last_boundary,
        }

    def load_agreed_state(self, state: dict[str, Any]) -> None:
        """Take a peer's `agreed_state`: this cluster's parameters and round start become phi, its error-feedback
        residuals (which belong to rounds its peers have moved past) are dropped and nothing is in flight."""
        with torch.no_grad():
            self.outer_params.copy_(state["outer_params"].to(self.outer_params.device))
        self.outer.load_state_dict(state["outer_optimizer"])
        self.outer_step = int(state["outer_step"])
        self.inner_steps = int(state["inner_steps"])
        self.round_end = int(state["round_end"])
        self.last_boundary = int(state["last_boundary"])
        self.reducer.heal()
        self.pending = None
        self.flat.scatter_data(self.outer_params)
        self.round_start = self.outer_params.clone()

    def guard_snapshot(self) -> dict[str, Any]:
        """The guard's history: this rank's `RoundGuard` and the gather reduction's norm history (what an elastic
        redo of a sync rolls back to before judging it again)."""
        reducer = None if self._update_guard is None else self._update_guard.state_dict()
        return {"sync": self.guard.state_dict(), "reducer": reducer}

    def restore_guard(self, snapshot: dict[str, Any]) -> None:
        self.guard.load_state_dict(snapshot["sync"])
        if self._update_guard is not None and snapshot["reducer"] is not None:
            self._update_guard.load_state_dict(snapshot["reducer"])
