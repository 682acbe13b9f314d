"""One fragment of a stage and everything its outer rounds own (docs/design.md §3, §6c).

A stage's parameter tensors are split into `sync.fragments` contiguous fragments (`fragment_bounds`; one fragment is
the whole stage). Each fragment owns its slice of phi (`outer_params`), the start of its round in progress, its outer
optimizer, its reducer (codec, error feedback, a lying cluster's faults), its merge rule and its guard, and the sync it
has in flight. What the fragments of a stage share (the settings, the slow link, the cluster's groups, how the
clusters weigh and who takes part) is a `StageParts`; `DiLoCoSync` runs the fragments' rounds on the schedule.

A fragment's round ends at its boundary. What happens there depends on the timing of its sync:
- blocking (`sync_delay = 0`, `overlap_steps = 0`): launch its pseudo-gradient, land it, take the outer step, start
  the next round at phi (`end_round`);
- streamed (`sync_delay = 0`, `overlap_steps = tau`, Streaming DiLoCo, Douillard et al. 2025, arXiv 2501.18512):
  launch tau steps before the boundary (`launch`) and land it at the boundary (`land`); the live parameters become
  lerp(phi, live, alpha) (`sync.alpha`);
- delayed (`sync_delay = 1`, DiLoCoX, arXiv 2506.21263): land the last round's sync, launch this one and start the
  next round where the merge rule says (`end_round`); with `overlap_steps = k` the landing comes k steps into the next
  round instead (`land`).

    fragment = FragmentState(params[first:end], stage, index=0, first_round_end=H, total_steps=T)
    stats = fragment.end_round(step)        # at its boundary; `launch` / `land` for the streamed and overlapped ones
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from dilocox.compress import CompressionConfig
from dilocox.compress.config import drain_config
from dilocox.net.channel import WanChannel
from dilocox.sync.base import FlatParams, RoundStats
from dilocox.sync.config import SyncConfig
from dilocox.sync.faults import FaultConfig, FaultyReducer
from dilocox.sync.link_fit import fit_inner_steps, fit_link_warning, slow_link_advice
from dilocox.sync.merge import InFlight, build_merge_rule
from dilocox.sync.outer_optimizer import OuterOptimizer, OuterOptimizerFactory, outer_lr_schedule
from dilocox.sync.reducer_factory import build_reducer
from dilocox.sync.reducers import PendingMean, Reducer
from dilocox.sync.robust import RoundGuard, judges_state, load_judges_state
from dilocox.sync.rounds import RoundReport, report_weights, token_weighted_factor

if TYPE_CHECKING:
    from dilocox.elastic.rounds import ElasticRounds

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
"""The keys of `FragmentState.state_dict`, all of which `load_state_dict` needs."""
WEIGHTED_STATE_KEYS = ("reports", "weight_sum", "landed_tokens", "pending_report", "pending_report_seq")
"""The keys a token-weighted fragment (`StageParts.weighted`) adds to its state."""


def fragment_bounds(numels: Sequence[int], num_fragments: int) -> list[tuple[int, int]]:
    """(first, end) tensor indices of each of `num_fragments` contiguous fragments of tensors with `numels` values:
    every fragment holds at least one tensor, and each ends on the tensor border closest to an equal share of the
    values that still leaves a tensor for every later fragment."""
    if not 1 <= num_fragments <= len(numels):
        raise ValueError(
            f"sync.fragments = {num_fragments} is more than the {len(numels)} parameter tensors of this rank's stage: "
            f"each fragment syncs whole tensors; use sync.fragments <= {len(numels)}"
        )
    offsets = list(itertools.accumulate(numels, initial=0))
    bounds, start = [], 0
    for k in range(num_fragments):
        if k == num_fragments - 1:
            end = len(numels)
        else:
            target = offsets[-1] * (k + 1) / num_fragments
            last = len(numels) - (num_fragments - 1 - k)  # leave one tensor for every later fragment
            end = min(range(start + 1, last + 1), key=lambda e: (abs(offsets[e] - target), e))
        bounds.append((start, end))
        start = end
    return bounds


def fragment_offset(fragment: int, inner_steps: int, num_fragments: int) -> int:
    """The step of fragment `fragment`'s first boundary: (k + 1) x H // N, so fragment 0 syncs first and the last
    fragment at H, as Streaming DiLoCo and torchft's `DiLoCo` order them."""
    return max(1, ((fragment + 1) * inner_steps) // num_fragments)


@dataclass
class StageParts:
    """What the fragments of one stage share: the settings, the slow link, the cluster's groups, how the clusters'
    updates weigh in the average, the membership of elastic runs, and the messages for the user."""

    cfg: SyncConfig
    compression: CompressionConfig
    channel: WanChannel
    dp_group: dist.ProcessGroup | None
    pp_group: dist.ProcessGroup | None
    """The cluster's pipeline, over which the stages agree on what the guard leaves out (None: one stage)."""
    seed: int
    state_device: torch.device
    """Where the outer state, the pseudo-gradient and its reduction live (sync.outer.state_device)."""
    shard_group: dist.ProcessGroup | None = None
    """A sharded stage's dp ranks (topology.dp_mode = shard; `dp_group` is then None): they agree on it too."""
    agree_group: dist.ProcessGroup | None = None
    """The ranks that sync, which agree on fit_link's H (None: every rank of the run)."""
    weighted: bool = False
    """The average weighs the clusters by their tokens of the round (time rounds, clusters of different dp): each sync
    carries a `RoundReport`."""
    round_tokens: int = 1
    """n_ref, the nominal tokens of one round, the same on every cluster (weighted syncs)."""
    first_weight_sum: float | None = None
    """sum_c n_c / n_ref expected of a round before any landed (weighted syncs; None: C, every cluster n_ref)."""
    faults: FaultConfig | None = None
    elastic_run: bool = False
    """Whether the run is elastic (its reducers average over each round's quorum)."""
    cluster_id: int = 0
    """This cluster's index in the run (faults name clusters by it; `cluster` is its index among a round's)."""
    warnings: list[str] = dataclasses.field(default_factory=list)
    """Messages for the user (the link cannot keep up, the guard's verdicts), printed once by the trainer."""
    elastic: ElasticRounds | None = None
    """Elastic runs (docs/design.md §10.1): each boundary's torchft quorum decides which clusters take part."""
    warned: bool = False
    """Whether the slow-link advice was given (once per run)."""

    def build_reducer(self, compression: CompressionConfig, flat: FlatParams, *, sizes: bool = True) -> Reducer:
        """A reducer of `compression` over the tensors of `flat`, on the stage's channel, with the guard and the
        aggregate of `[sync]`: a fragment's rounds' and its drain's (`sizes`: whether the peer check may compare the
        updates' sizes, `PeerCheck.sizes`; never under time rounds, where clusters take different steps)."""
        common: dict[str, Any] = dict(
            channel=self.channel,
            dp_group=self.dp_group,
            pp_group=self.pp_group,
            seed=self.seed,
            guard_max_ratio=self.cfg.guard.max_ratio if self.cfg.guard.enabled else None,
            peer_max_ratio=self.cfg.guard.peer_ratio if self.cfg.guard.peers else None,
            peer_sizes=sizes and self.cfg.round.mode != "time",
        )
        common.update(aggregate=self.cfg.aggregate, trim_fraction=self.cfg.trim_fraction)
        return build_reducer(compression, flat.shapes, **common, shard_group=self.shard_group, elastic=self.elastic_run)


class Landed(NamedTuple):
    """A sync that `perform_sync` waited for and applied."""

    stats: RoundStats
    left_out: bool
    """The others left out the update this cluster sent (not one it abstained from): it heals."""


class FragmentState:
    """One fragment's outer state and the verbs of its rounds (module docstring).

    phi itself only ever takes the true averages, so every cluster holds the same phi whatever the merge rule
    (`agreed_model`). `sync.local_residual` (a codec with error feedback): wherever a round starts, or restarts when
    an average lands, it starts lower by this cluster's share (1/C) of what its codec holds back. With `sync.guard`
    (docs/design.md §4.5) a cluster whose own pseudo-gradient is non-finite abstains and heals; the gather reduction
    leaves out every non-finite or outsized update; a cluster left out takes phi and drops that round's update from its
    error feedback (`_drop_if_left_out`).
    """

    def __init__(
        self,
        params,
        stage: StageParts,
        *,
        index: int | None = None,
        first_round_end: int,
        short_first_round: bool = False,
        total_steps: int | None,
        num_outer_updates: int | None,
        outer_optimizer: OuterOptimizerFactory,
    ) -> None:
        cfg = stage.cfg
        self.stage = stage
        self.cfg = cfg
        self.index = index
        """Its place among the stage's fragments (None for a stage of one fragment: its records name none)."""
        self.flat = FlatParams(params)
        self.numel = self.flat.numel
        self.inner_steps = cfg.inner_steps
        """H of the round in progress (fit_link and time rounds change it between rounds)."""
        self.round_end = first_round_end
        """The step at which the round in progress ends (its boundary)."""
        self.short_first_round = short_first_round
        """Its first round has fewer than H steps (a fragment k < N - 1): its norm is no reference for the guard."""
        self.last_boundary = 0
        self.outer_step = 0
        """Rounds whose sync was launched."""
        self.total_steps = total_steps
        device = stage.state_device
        self.outer_params = self.flat.gather_data().to(device, copy=True)  # (numel,) fp32, phi
        self.round_start = self.outer_params.clone()  # theta at the start of the round
        self.outer = OuterOptimizer(self.outer_params, outer_optimizer, lr_at=outer_lr_schedule(cfg, num_outer_updates))
        """The outer optimizer of phi (`sync.outer.optimizer`, or the factory passed in) and its lr schedule."""
        self.merge = build_merge_rule(cfg.merge)
        """Where a round starts while the last round's average is in flight (`sync.merge`, delayed syncs only)."""
        reducer = stage.build_reducer(stage.compression, self.flat)
        gathers = reducer.judges_each
        self._update_guard = reducer.guard if gathers else None
        """The gather reduction's own guard (its norm history), None for the summing reductions."""
        self._peer_check = reducer.peers if gathers else None
        """The gather reduction's peer check (which clusters just healed, which it left out), None without one."""
        self.guard = RoundGuard(
            max_ratio=cfg.guard.max_ratio,
            max_bad_rounds=cfg.guard.max_bad_rounds,
            judges_mean=cfg.guard.enabled and not gathers,
            warnings=stage.warnings,
        )
        self.reducer: Reducer = reducer
        faults = stage.faults
        if faults is not None and faults.lies:
            self.reducer = FaultyReducer(
                reducer,
                faults,
                channel=stage.channel,
                cluster=stage.cluster_id,
                round_index=lambda: self.outer_step + 1,
            )
        self.pending: PendingMean | None = None
        """The sync in flight (launched by `prepare_sync`, landed by `perform_sync`)."""
        self.pending_quorum = -1
        """Elastic runs: the quorum over which the sync in flight was launched."""
        self.reports: list[RoundReport | None] | None = None
        """Every cluster's report of the last round whose sync landed (weighted syncs)."""
        self.weight_sum: float | None = None
        """sum_c n_c / n_ref of the last landed round (weighted syncs; None before any, `divisor`: C)."""
        self.landed_tokens = 0
        """Tokens every cluster trained on in the rounds whose sync landed (weighted syncs)."""
        self._own_weight = 1.0  # n_c / n_ref of the round just launched
        self._launched_at = 0  # the step the sync in flight was launched at
        self._launch_flags = (False, False)  # a streamed launch's (newcomer, own update non-finite)
        self._report_flight: tuple[torch.Tensor, bool] | None = None  # a resumed report to send again

    @property
    def num_clusters(self) -> int:
        """C: the clusters the average is over (elastic: the live ones of the round)."""
        return self.stage.channel.world_size

    @property
    def cluster(self) -> int:
        """This cluster's index among them (its `RoundStats.excluded` key)."""
        return self.stage.channel.group_rank

    @property
    def divisor(self) -> float:
        """What this cluster's part of a weighted sum is divided by: the last landed sum of weights, or before any
        landed the stage's expected sum, or C, the clusters of the round (elastic: of this round's quorum, not of the
        cluster's own world)."""
        if self.weight_sum is not None:
            return self.weight_sum
        first = self.stage.first_weight_sum
        return first if first is not None else float(self.num_clusters)

    # ---------------------------------------------------------------------------------------------- the verbs
    def pseudo_grad(self) -> torch.Tensor:
        """This round's pseudo-gradient so far: round start - theta, (numel,) on the state device."""
        return self.round_start - self.flat.gather_data().to(self.stage.state_device)

    def end_round(self, step: int, *, newcomer: bool = False, report: RoundReport | None = None) -> RoundStats | None:
        """The boundary of a blocking or delayed round at `step`: launch its sync (`prepare_sync`), land the one that
        is due (`perform_sync`: this one when blocking, the last one if delayed) and start the next round.

        Delayed: the last round's sync lands before this round's is launched. The link is FIFO, so this round's
        transfer could not start earlier anyway, and the launch then sees everything the last sync left behind
        (error-feedback residuals and shared warm starts of the scalable path). `newcomer`: this cluster healed at
        this boundary and did not train the round, so it abstains. Returns what the sync that landed cost (None in
        the first round of a delayed sync: nothing was due)."""
        cfg = self.cfg
        round_steps, round_index = step - self.last_boundary, self.outer_step + 1
        pseudo_grad = self.pseudo_grad()
        own_bad = cfg.guard.enabled and not newcomer and not bool(torch.isfinite(pseudo_grad).all())
        abstain = own_bad or newcomer
        if cfg.sync_delay == 0:
            if own_bad:  # before the encoding: what the bad round left in the residuals is not sent
                self.reducer.heal()
            self.prepare_sync(pseudo_grad, abstain=abstain, report=report, step=step)
            landed = self.perform_sync(round_steps=round_steps, round_index=round_index)
            heal = self._drop_if_left_out(landed) or abstain
            self._mix(heal)
        else:
            landed = self.perform_sync(round_steps=round_steps, round_index=round_index - 1)
            if landed is not None and cfg.round.fit_link:
                self._fit_inner_steps(landed.stats, round_steps)
            heal = self._drop_if_left_out(landed) or abstain
            if abstain:  # before this round's encoding: what the bad round left in the residuals is not sent again
                self.reducer.heal()
            # what the last encodings held back is read before this one takes it in
            held_before = self.reducer.held_back(self.stage.state_device) if self._reads_held_back() else None
            self.prepare_sync(pseudo_grad, abstain=abstain, report=report, step=step)  # pseudo_grad stays intact
            theta = self.outer_params if heal else self._delayed_start(pseudo_grad, held_before)
            self.flat.scatter_data(theta)
            self.round_start = theta.clone()
        self._count_heal(newcomer, own_bad, heal, round_index)
        self._boundary_passed(step)
        return None if landed is None else landed.stats

    def launch(self, step: int, *, newcomer: bool = False, report: RoundReport | None = None) -> None:
        """A streamed round's launch, `overlap_steps` before its boundary: its pseudo-gradient goes out while the
        round's last steps train; the parameters and the round start stay until it lands (`land`)."""
        pseudo_grad = self.pseudo_grad()
        own_bad = self.cfg.guard.enabled and not newcomer and not bool(torch.isfinite(pseudo_grad).all())
        if own_bad:  # before the encoding: what the bad round left in the residuals is not sent
            self.reducer.heal()
        self.prepare_sync(pseudo_grad, abstain=own_bad or newcomer, report=report, step=step)
        self._launch_flags = (newcomer, own_bad)

    def land(self, step: int) -> RoundStats | None:
        """Land the sync in flight inside a round: a streamed round's at its boundary, or with `sync_delay = 1` and
        `overlap_steps = k` the last round's, k steps into this one.

        Streamed: the parameters become lerp(phi, live, alpha) and the next round starts at phi (Streaming DiLoCo's
        mixing, `sync.alpha`; 0 takes phi). Delayed: the cluster keeps what it computed since the boundary: its
        parameters move by what phi moved past the round start (the true average replaces the estimate the merge
        rule started from), and the round start becomes phi, so this round's pseudo-gradient is still all of its own
        progress."""
        if self.cfg.sync_delay == 0:
            return self._land_streamed(step)
        landed = self.perform_sync(round_steps=step - self.last_boundary, round_index=self.outer_step)
        if landed is None:  # elastic: no member of the quorum holds a share of it
            return None
        if self._drop_if_left_out(landed):
            if self.cfg.guard.enabled:
                self.guard.heal(cluster=self.cluster, round_index=self.outer_step, why="the others left its update out")
            start = self.outer_params.clone()
            theta = start
        else:
            start = self._with_held_back(self.outer_params)
            theta = self._live() + (start - self.round_start)
        self.flat.scatter_data(theta)
        self.round_start = start
        return dataclasses.replace(landed.stats, inner_steps=self.inner_steps)

    def _land_streamed(self, step: int) -> RoundStats | None:
        newcomer, own_bad = self._launch_flags
        round_index = self.outer_step + 1
        landed = self.perform_sync(round_steps=step - self._launched_at, round_index=round_index)
        heal = self._drop_if_left_out(landed) or newcomer or own_bad
        if newcomer or own_bad:  # what the round left in the residuals is not sent again
            self.reducer.heal()
        self._mix(heal)
        self._count_heal(newcomer, own_bad, heal, round_index)
        self._boundary_passed(step)
        return None if landed is None else landed.stats

    def _drop_if_left_out(self, landed: Landed | None) -> bool:
        """Whether the others left out the update this cluster sent in the sync that just `landed`; if so its error
        feedback returns to what it held before that encoding (`Reducer.forget_last`): the round's update is
        dropped, as the others dropped it, and what earlier rounds held back is still owed. One bad round costs that
        round, and the cluster's next payloads carry long residual values as its peers' do (with none they would
        be a fraction of its peers' for rounds, and a scaling liar's would pass: docs/design.md §4.5)."""
        if landed is None or not landed.left_out:
            return False
        self.reducer.forget_last()
        return True

    def _mix(self, heal: bool) -> None:
        """Once an average landed in the round that launched it: the next round starts at phi (less this cluster's
        share of what its codec holds back), and the parameters become lerp(that, live, alpha) (`sync.alpha`,
        Streaming DiLoCo's mixing; a cluster that heals takes phi)."""
        start = self.outer_params if heal else self._with_held_back(self.outer_params)
        alpha = 0.0 if heal else self.cfg.alpha
        self.flat.scatter_data(torch.lerp(start, self._live(), alpha) if alpha else start)
        self.round_start = start.clone()

    def flush(self) -> RoundStats | None:
        """Land the sync still in flight (and with `sync.drain_residual` what the codec still holds back); afterwards
        this fragment holds phi. Returns the stats of the sync it waited for, if any."""
        # launched by the last end_round: no round of compute to hide behind
        landed = self.perform_sync(round_steps=None, round_index=self.outer_step, judge_link=False)
        stats = None if landed is None else landed.stats
        if self.cfg.drain_residual:
            drained = self._drain()
            stats = stats.with_exclusions_of(drained) if stats is not None else None
        return stats

    def hold_phi(self) -> None:
        """Set this fragment's parameters and round start to phi (the end of a flush)."""
        self.flat.scatter_data(self.outer_params)
        self.round_start = self.outer_params.clone()

    def restart_round(self) -> None:
        """Start the round in progress again from its start: this cluster's parameters went bad mid-round (a
        neighbouring fragment's round ended non-finite)."""
        self.flat.scatter_data(self.round_start)

    def _live(self) -> torch.Tensor:
        return self.flat.gather_data().to(self.stage.state_device)

    def _boundary_passed(self, step: int) -> None:
        self.outer_step += 1
        self.last_boundary = step

    def _count_heal(self, newcomer: bool, own_bad: bool, heal: bool, round_index: int) -> None:
        """The guard's count of this cluster's own rounds, and its heal (not for a round it did not train)."""
        if self.cfg.guard.enabled and not newcomer:
            self.guard.count_own(own_bad, round_index)
            if heal:
                why = "its own update is non-finite" if own_bad else "the others left its update out"
                self.guard.heal(cluster=self.cluster, round_index=round_index, why=why)

    # ---------------------------------------------------------------------------------------------- launch, land
    def prepare_sync(
        self,
        pseudo_grad: torch.Tensor,
        *,
        abstain: bool = False,
        report: RoundReport | None = None,
        step: int | None = None,
    ) -> None:
        """Launch the sync of this round's `pseudo_grad` (numel,) into `pending`: the reducer encodes it and starts
        averaging it on the channel's thread. A cluster that `abstain`s (its own update is non-finite, or it did not
        train the round) sends nothing usable, and the others leave it out. Elastic: over this boundary's quorum.
        Weighted syncs: the round's `report` goes first, then the pseudo-gradient times n_c / n_ref."""
        stage = self.stage
        if stage.elastic is not None:
            stage.elastic.before_launch(self)
        self._launched_at = step if step is not None else self.last_boundary
        sent_report = None
        if stage.weighted:
            if report is None:
                raise ValueError("a token-weighted sync needs the round's report: pass report=RoundReport(...)")
            if abstain:  # it sends no update: its tokens weigh nothing
                report = dataclasses.replace(report, tokens=0)
            sent_report = report.to_tensor()
            report_transfer = stage.channel.launch_all_gather(sent_report)  # FIFO: lands before the payload
            self._own_weight = report.tokens / stage.round_tokens
            pseudo_grad = pseudo_grad * self._own_weight  # a new tensor: the caller's stays as it was
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
        elastic = self.stage.elastic
        if elastic is not None:
            arrived = elastic.settle(self, due, round_steps=round_steps, round_index=round_index, judge_link=judge_link)
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
        return Landed(dataclasses.replace(stats, fragment=self.index), left_out)

    def _forget_norms(self) -> None:
        """A short first round's pseudo-gradient covers a fraction of H steps (early in training, under the inner
        warm-up): its norm is no reference for the full rounds', which the guard would leave out as outsized. The
        guard's norm history starts afresh with the next round."""
        for update_guard in (self._update_guard, self.guard.mean_guard):
            if update_guard is not None:
                update_guard.history.clear()

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
        cfg, stage = self.cfg, self.stage
        round_steps = self.inner_steps if round_steps is None else round_steps
        round_index = self.outer_step if round_index is None else round_index
        clock = stage.channel.clock  # the link's clock: real time, or a test's virtual seconds
        if blocked_from is None:
            blocked_from = clock.now()
        compute_s = blocked_from - pending.transfer.launch_time
        reports = None
        if pending.report is not None:
            reports = [None if r is None else RoundReport.from_tensor(r) for r in pending.report.wait()]
            pending.weights[:] = report_weights(reports, stage.round_tokens)
        avg = pending.wait()
        if reports is not None:  # the token-weighted mean of the pre-scaled pseudo-gradients
            factor, weight_sum = token_weighted_factor(
                reports, excluded=pending.excluded, round_tokens=stage.round_tokens, robust=cfg.aggregate != "mean"
            )
            avg.mul_(factor)
            self.reports = reports
            if weight_sum > 0:
                self.weight_sum = weight_sum
            self.landed_tokens += sum(r.tokens for r in reports if r is not None)
        skipped = False
        if cfg.guard.enabled:
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
            excluded=dict(pending.excluded) if cfg.guard.enabled else None,
            skipped=skipped,
            round_index=round_index,
            cluster_steps=None if reports is None else tuple(r.steps if r else 0 for r in reports),
            cluster_tokens=None if reports is None else tuple(r.tokens if r else 0 for r in reports),
        )
        slower = judge_link and stats.link_s > compute_s > 0
        if cfg.sync_delay == 1 and slower and not stage.warned and not cfg.round.fit_link:
            stage.warned = True
            advice = slow_link_advice(
                stats, round_steps=round_steps, overlap_steps=cfg.overlap_steps, channel=stage.channel
            )
            self.stage.warnings.append(advice)
        return avg, stats

    # -------------------------------------------------------------------------------------- where a round starts
    def _delayed_start(self, pseudo_grad: torch.Tensor, held_before: torch.Tensor | None) -> torch.Tensor:
        """Where the next round starts under the one-step delay, round t's `pseudo_grad` just launched: the merge
        rule's start, lowered under `sync.local_residual` by this cluster's share of what its codec holds back and
        the start does not carry (`MergeRule.held_share`). `held_before`: what the codec held back before that launch
        (None: nothing, or not read)."""
        stage = self.stage
        flight = InFlight(
            self.outer_params,
            pseudo_grad,
            num_clusters=self.num_clusters,
            predict=functools.partial(self.outer.predict, update=self.outer_step),
            held_before=held_before,
            read_held_after=functools.partial(self.reducer.held_back, stage.state_device),
            feedback_decay=stage.compression.feedback_decay,
            weight=self._own_weight if stage.weighted else None,
            weight_sum=self.divisor if stage.weighted else None,
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
        held_back = self.reducer.held_back(self.stage.state_device) if self.cfg.local_residual else None
        divisor = self.divisor if self.stage.weighted else self.num_clusters  # weighted: the cluster's weight
        return phi.clone() if held_back is None else phi - held_back / divisor

    def _reads_held_back(self) -> bool:
        """Whether a delayed round's start depends on what the codec held back before the round's encoding."""
        return self.cfg.local_residual or self.merge.reads_held_back

    def _fit_inner_steps(self, stats: RoundStats, round_steps: int) -> None:
        """sync.round.fit_link: the next round's H, sized to the link by the sync just waited for (`link_fit`)."""
        self.inner_steps, needed = fit_inner_steps(
            stats, round_steps=round_steps, cfg=self.cfg, current=self.inner_steps, group=self.stage.agree_group
        )
        if needed > self.cfg.round.fit_link_max_steps and not self.stage.warned:
            self.stage.warned = True
            self.stage.warnings.append(fit_link_warning(stats, round_steps=round_steps, needed=needed, cfg=self.cfg))

    def _drain(self) -> RoundStats | None:
        """`sync.drain_residual`: send every cluster's held-back residual (`Reducer.held_back`) dense, in int4 or in
        the 2 or 1 bits of a codec whose values are that narrow (`drain_config`), and subtract its mean times the outer
        learning rate, at most 1, from phi, without a momentum step: the residual is progress already made, not a
        direction to keep going, so it is averaged in but never extrapolated (at the `dilocox` preset's outer lr 1.4
        it cost short runs 0.27 to 0.37 nats: docs/results.md). A cluster the rounds' peer check left out is left out
        of the drain too (`PeerCheck.distrusts`). The codec then holds nothing back. One payload of 4.25 (2.25, 1.25)
        bits per value per cluster, waited for at the end: nothing is left to compute behind it. Returns what it
        waited for (round None), or None before any round ended."""
        stage = self.stage
        held_back = self.reducer.held_back(stage.state_device)
        elastic = stage.elastic
        if held_back is None and self.outer_step == 0:  # no round has ended yet
            return None
        if held_back is None:  # healed (left out of the first round, or at an elastic boundary): every member sends
            held_back = torch.zeros(self.numel, device=stage.state_device)
        width = drain_config(stage.compression)
        # weighted residuals are compared per unit of the last landed round's weights; an elastic drain's quorum may
        # not be that round's, so there only their direction is judged
        weights = report_weights(self.reports or [], stage.round_tokens)
        drain = stage.build_reducer(width, self.flat, sizes=not stage.weighted or (elastic is None and bool(weights)))
        if self._peer_check is not None:  # a cluster caught in a round sends its residual, and nobody takes it
            drain.peers.distrusts = frozenset(self._peer_check.left_out)
        if elastic is not None:
            elastic.before_launch(self)
        with stage.channel.off_peak():  # a one-off transfer at the end: the peak in flight is the rounds'
            pending = drain.launch(held_back)
        if stage.weighted and elastic is None:
            pending.weights[:] = weights
        if elastic is not None:  # settled among the live clusters like a round's sync, sent again if they changed
            arrived = elastic.settle(
                self, pending, round_steps=None, round_index=self.outer_step, judge_link=False, reducer=drain
            )
            if arrived is None:
                return None
            avg, stats = arrived
        else:
            avg, stats = self.wait_sync(pending, judge_link=False, judge_mean=False)
        if stage.weighted:  # the residuals are in weighted units: their sum over the last landed sum of weights
            avg.mul_((self.num_clusters - len(pending.excluded)) / self.divisor)
        if not stats.skipped:
            self.outer_params.sub_(avg, alpha=min(self.outer.lr, 1.0))
        self.reducer.heal()  # sent: nothing is held back any more
        self.stage.warnings.append(
            f"drain: sent the held-back residual ({width.kind}, {stats.bytes_sent:,} bytes from this rank, "
            f"{stats.link_s:.2f} s of link, {stats.exposed_s:.2f} s waited)"
            + (": no usable mean, phi kept as it was" if stats.skipped else "")
        )
        return dataclasses.replace(stats, round_index=None, fragment=self.index)

    # ---------------------------------------------------------------------------------------------- state
    def state_bytes(self) -> int:
        """Bytes of the outer state: outer params, the round start and the delayed sync (fp32), the outer optimizer's
        state tensors (momentum, moments) and the reducer's (error-feedback residuals, warm starts)."""
        vectors = 2 + (self.cfg.sync_delay == 1 or self.cfg.overlap_steps > 0)
        return 4 * self.flat.numel * vectors + self.outer.state_bytes() + self.reducer.state_bytes()

    def state_dict(self) -> dict[str, Any]:
        """The outer state, including the sync in flight: not waited for (a checkpoint must not stall the overlap)
        but saved as what this rank sent, which a resumed run sends again (`load_state_dict`), so it arrives and is
        applied at the same step as in an uninterrupted run."""
        state = {
            **self.agreed_state(),
            "round_start": self.round_start.clone(),
            "pending_sent": None if self.pending is None else self.pending.sent.clone(),
            "pending_seq": -1 if self.pending is None else self.pending.transfer.seq,
            "reduction": self.reducer.name,
            "reducer": self.reducer.state_dict(),
            "guard": self.guard.state_dict(),
        }
        if self.pending is not None and self.cfg.sync_delay == 0:  # a streamed sync in flight
            state["launched_at"] = self._launched_at
            state["launch_flags"] = list(self._launch_flags)
        if self.stage.weighted:
            pending_report = None if self.pending is None else self.pending.report_sent
            state.update(
                pending_report=None if pending_report is None else pending_report.clone(),
                pending_report_seq=-1 if pending_report is None else self.pending.report.seq,  # type: ignore[union-attr]
            )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> tuple[torch.Tensor, bool | None] | None:
        """Load `state_dict()`; returns the sync that was in flight (what this rank sent, and whether to count its
        bytes again; or, None, the decoded update to encode and send), which the caller sends again once every
        fragment is loaded (`relaunch`)."""
        missing = [key for key in STATE_KEYS if key not in state]
        if missing:
            raise ValueError(
                f"this outer-sync state lacks {', '.join(missing)}: load_state_dict takes what state_dict() of this "
                "version returned; start a new run (dilocox eval still reads its model)"
            )
        if self.stage.weighted != all(key in state for key in WEIGHTED_STATE_KEYS):
            saved = (
                "unweighted (sync.round.mode = steps)"
                if self.stage.weighted
                else "token-weighted (sync.round.mode = time)"
            )
            raise ValueError(
                f"this outer-sync state is {saved}, this run is not: resume with the sync.round.mode it was written "
                "with"
            )
        if state["reduction"] != self.reducer.name:
            raise ValueError(
                f"this checkpoint averaged with the {state['reduction']!r} reducer but this run uses "
                f"{self.reducer.name!r}; resume with the compression.kind and compression.reduction it was written with"
            )
        self._take_agreed(state)
        self.round_start = state["round_start"].to(self.outer_params.device, copy=True)
        self._launched_at = int(state.get("launched_at", self.last_boundary))
        self._launch_flags = tuple(state.get("launch_flags", (False, False)))
        self.reducer.load_state_dict(state["reducer"])
        self.guard.load_state_dict(state["guard"])
        self._report_flight = None
        if self.stage.weighted and state["pending_report"] is not None:
            counted = state["pending_report_seq"] < self.stage.channel.num_transfers
            self._report_flight = state["pending_report"], not counted
        # Every rank resumes from the same step and loads in the same order, so the re-sends pair up across
        # clusters. The link counters (restored first) hold the transfer exactly when it had arrived on this rank.
        self.pending = None
        if state.get("pending_decoded") is not None:  # resumed at another dp degree (`dilocox.reshape`): encoded anew
            return state["pending_decoded"].to(self.outer_params.device), None
        if state["pending_sent"] is None:
            return None
        counted = state["pending_seq"] < self.stage.channel.num_transfers
        return state["pending_sent"].to(self.outer_params.device), not counted  # checkpoints load on the CPU

    def send_again(self, due: PendingMean | None, reducer: Reducer) -> PendingMean:
        """An elastic redo: what this cluster sent of a sync (`due`, its report first for weighted syncs) sent again
        over a new quorum with `reducer` (the rounds', or the drain's), or an abstention when it has none of its own
        (new to the quorum, or it abstained from that round)."""
        sent_report = None
        if self.stage.weighted and reducer is self.reducer:
            sent_report = due.report_sent if due is not None else None
            if sent_report is None:
                sent_report = RoundReport(0, 0, 0.0).to_tensor()
            report = self.stage.channel.launch_all_gather(sent_report, account=True)
        if due is not None and not due.abstained:
            pending = reducer.relaunch(due.sent, account=True)
        else:
            pending = reducer.abstain(self.outer_params)
            pending.abstained = True
        if sent_report is not None:
            pending.report, pending.report_sent = report, sent_report
        return pending

    def relaunch(self, flight: tuple[torch.Tensor, bool | None]) -> None:
        """Send again the sync a checkpoint saved in flight (`load_state_dict`'s return), its report first."""
        report = None
        if self._report_flight is not None:  # sent again first, as it was first sent
            sent, account = self._report_flight
            report = self.stage.channel.launch_all_gather(sent, account=account)
        if flight[1] is None:
            self.pending = self.reducer.launch(flight[0])
        else:
            self.pending = self.reducer.relaunch(flight[0], account=flight[1])
        if report is not None:
            self.pending.report, self.pending.report_sent = report, self._report_flight[0]  # type: ignore[index]
        self._report_flight = None

    def agreed_state(self) -> dict[str, Any]:
        """What every cluster holds alike at a boundary: phi, the outer optimizer's state and the round counters,
        and for weighted syncs the clusters' last landed reports and the tokens landed (what a cluster that joins an
        elastic run heals from)."""
        state = {
            "outer_params": self.outer_params.detach().clone(),
            "outer_optimizer": self.outer.state_dict(),
            "outer_step": self.outer_step,
            "inner_steps": self.inner_steps,
            "round_end": self.round_end,
            "last_boundary": self.last_boundary,
        }
        if self.stage.weighted:
            reports = None if self.reports is None else [None if r is None else r.to_tensor() for r in self.reports]
            state.update(reports=reports, weight_sum=self.weight_sum, landed_tokens=self.landed_tokens)
        return state

    def load_agreed_state(self, state: dict[str, Any]) -> None:
        """Take a peer's `agreed_state`: this cluster's parameters and round start become phi, its error-feedback
        residuals (which belong to rounds its peers have moved past) are dropped and nothing is in flight."""
        self._take_agreed(state)
        self.reducer.heal()
        self.pending = None
        self.flat.scatter_data(self.outer_params)
        self.round_start = self.outer_params.clone()

    def _take_agreed(self, state: dict[str, Any]) -> None:
        """The part of `state` that `agreed_state` wrote."""
        with torch.no_grad():
            self.outer_params.copy_(state["outer_params"].to(self.outer_params.device))
        self.outer.load_state_dict(state["outer_optimizer"])
        self.outer_step = int(state["outer_step"])
        self.inner_steps = int(state["inner_steps"])
        self.round_end = int(state["round_end"])
        self.last_boundary = int(state["last_boundary"])
        if self.stage.weighted:
            saved = state["reports"]
            self.reports = None if saved is None else [None if r is None else RoundReport.from_tensor(r) for r in saved]
            self.weight_sum = None if state["weight_sum"] is None else float(state["weight_sum"])
            self.landed_tokens = int(state["landed_tokens"])

    def guard_snapshot(self) -> dict[str, Any]:
        """The guard's history: this rank's `RoundGuard` and the gather reduction's judges' (what an elastic redo of a
        sync rolls back to before judging it again)."""
        return {"sync": self.guard.state_dict(), **judges_state(self._update_guard, self._peer_check)}

    def restore_guard(self, snapshot: dict[str, Any]) -> None:
        self.guard.load_state_dict(snapshot["sync"])
        load_judges_state(self._update_guard, self._peer_check, snapshot)


def num_outer_updates(total_steps: int | None, first_round_end: int, inner_steps: int) -> int | None:
    """Outer updates of a fragment over the run (the horizon of a cosine outer learning rate): its first round, then
    one per H steps after it, the last one cut at total_steps."""
    if not total_steps:
        return None
    return 1 + math.ceil(max(0, total_steps - first_round_end) / inner_steps)
