"""DiLoCo (Douillard et al. 2023, arXiv 2311.08105) and its one-step-delay form from DiLoCoX (arXiv 2506.21263).

H local steps, then an outer step on the pseudo-gradient averaged over the clusters. With `sync_delay = 0` the
trainer waits for the average (blocking DiLoCo, the "OpenDiLoCo" row of DiLoCoX's table). With `sync_delay = 1`
the sync of round t travels while round t+1 trains and is applied at the end of round t+1, one round stale.

    sync = DiLoCoSync(model.parameters(), SyncConfig(inner_steps=50, sync_delay=1), channel=channel, dp_group=dp_group)
    ...inner step...; sync.after_inner_step(step)     # every H steps: launch this round's sync, apply the last one
    sync.flush()                                      # end of training: apply the update still in flight
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from dilocox.compress import CompressionConfig
from dilocox.faults import FaultConfig
from dilocox.net.channel import WanChannel
from dilocox.sync.base import FlatParams, RoundStats, dp_mean_
from dilocox.sync.config import FIT_HEADROOM, SyncConfig, check_held_back_options, check_robust_reduction
from dilocox.sync.elastic import ElasticRounds
from dilocox.sync.membership import ElasticMembership
from dilocox.sync.outer_optimizer import (
    OuterOptimizer,
    OuterOptimizerFactory,
    outer_lr_schedule,
    outer_optimizer_factory,
)
from dilocox.sync.reducers import GatherReducer, PendingMean, Reducer, build_reducer
from dilocox.sync.robust import GuardError, UpdateGuard


class DiLoCoSync:
    """Keeps `outer_params` (phi, fp32) and the outer SGD with Nesterov momentum for this rank's parameters.

    End of round t (docs/design.md §3), with `pseudo_grad = round start - theta`:
    - `sync_delay = 0`: wait for `avg_pseudo_grad` of round t, `phi = outer_step(phi, avg)`, theta = phi.
    - `sync_delay = 1`: launch round t's sync, wait for round t-1's (it had all of round t to travel), apply it.
      The merge rule says where round t+1 starts:
      - `reset`: at phi, like every cluster (round t's own progress returns, averaged, one round later);
      - `keep_local`: at phi minus this cluster's round-t pseudo-gradient, so local progress is not thrown away
        while its average is in flight (the idea of eager updates, arXiv 2502.12996, and Streaming DiLoCo,
        arXiv 2501.18512). Clusters then differ by their last round's progress until `flush()`.
      - `eager` (Kale et al. 2025, arXiv 2502.12996): at the outer step phi would take if round t's average were
        this cluster's own share of it, pseudo_grad / C (the others' part is in phi already, one round stale),
        taken on a scratch copy of the momentum (`predicted_outer_params`). With momentum 0 this is exactly the
        paper's eager update, phi - lr pseudo_grad / C.
      - `lookahead`: at the outer step phi would take if round t's average were this cluster's whole
        pseudo-gradient, momentum included: a delay-corrected momentum by weight prediction (SpecTrain, Chen et al.
        2018): the next round computes its pseudo-gradient near where phi will be when that is applied, and the
        momentum's part of the next step, already known, is not left one round behind. Plain averaging: keep_local.
      - `own_payload` (a codec with error feedback): at the outer step phi would take if round t's average were
        what this cluster's codec sent of it (its decoded payload), less its share of what the codec still holds
        back; as `eager` in a round whose encoding found nothing held back (the first). Not a better guess of the
        average (the clusters' payloads are nearly uncorrelated, docs/design.md §3): the round's first steps run
        from the cluster's own point on the values it sent.
      Under every rule phi itself only ever takes the true averages, so every cluster holds the same phi
      (`agreed_model`); the next pseudo-gradient is measured from the round start, so when the true average lands
      it replaces the predicted part instead of adding to it.

    `sync.local_residual` (a codec with error feedback): a codec sends part of each pseudo-gradient and holds the
    rest back in its residual, for later rounds. Without it the cluster's parameters lose that part at every landing
    (they restart from phi, which has only what was sent). With it they keep this cluster's share of it: wherever a
    round starts, or restarts when an average lands, it starts lower by held_back / C, held_back being the residual
    times `compression.feedback_decay` (what the next encoding adds); under the delay the in-flight round's own share
    is then `pseudo_grad + held_back` of the last rounds, as the merge rule takes it. The clusters' parameters differ
    by their residuals; phi, the agreed model, is unchanged, and `flush()` still sets every cluster to phi.
    `sync.drain_residual` (a codec with error feedback): at the end of training `flush()` sends what every codec still
    holds back once more, densely in int4, and phi takes its mean (times the outer learning rate, no momentum), so
    the model the run ends with holds all of every cluster's progress rather than what the codec had sent so far.

    The outer learning rate of each update follows `sync.outer_lr_schedule` (`SyncConfig.outer_lr_at`), over the
    run's ceil(total_steps / H) updates. The average itself is its `reducer`'s (`compression.kind` and
    `compression.reduction`, docs/design.md §4.4).

    With `sync.guard` (docs/design.md §4.5) a cluster whose own pseudo-gradient is non-finite abstains from the
    round and heals: the next round starts from phi, its error-feedback residuals are dropped and `healed` tells
    the owner of the inner optimizer to reset its state where non-finite. The gather reduction leaves out every
    non-finite or outsized update and, of three or more, one that stands out among the others (`sync.guard_peers`);
    each cluster judges the same bytes, so all leave out the same ones, and a cluster left out heals too. The
    summing reductions check the mean instead and skip a round whose mean is non-finite or outsized.
    `sync.guard_max_bad_rounds` bad rounds in a row, of this cluster or of every cluster, raise `GuardError`.
    """

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
    ) -> None:
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
        self.inner_steps = cfg.inner_steps  # H of the round in progress (fit_link may change it between rounds)
        self.round_end = cfg.inner_steps  # the step at which the round in progress ends
        self.last_boundary = 0  # the step at which the last round ended
        self.total_steps = total_steps
        self.reducer: Reducer = self._build_reducer(compression, elastic=membership is not None)
        self.faults = faults if faults is not None and faults.enabled else None
        self.mean_guard = (
            UpdateGuard(cfg.guard_max_ratio) if cfg.guard and not isinstance(self.reducer, GatherReducer) else None
        )
        """The summing reductions' guard: it judges the mean (the gather reduction judges every update itself)."""
        self.healed = False
        """Set when this cluster's parameters were reset to phi; the inner optimizer's owner resets its state."""
        self.guard_counts = {"excluded_updates": 0, "skipped_rounds": 0, "healed_rounds": 0}
        """Totals over the run: updates the guard left out, rounds without a usable mean, rounds this cluster healed."""
        self._bad_in_row = {"own": 0, "all": 0}
        params_device = self.flat.params[0].device if self.flat.params else torch.device("cpu")
        self.state_device = params_device if cfg.outer_state_device == "device" else torch.device("cpu")
        """Where the outer state, the pseudo-gradient and its reduction live (sync.outer_state_device)."""
        self.outer_params = self.flat.gather_data().to(self.state_device, copy=True)  # (numel,) fp32, phi
        self.num_clusters = channel.world_size  # C, for the eager merge's own share of the average
        self.num_outer_updates = math.ceil(total_steps / cfg.inner_steps) if total_steps else None
        """Outer updates in the run (one per round), the horizon of a cosine outer learning rate."""
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
        if cfg.outer_lr_schedule == "cosine" and self.num_outer_updates is None:
            raise ValueError(
                "sync.outer_lr_schedule = 'cosine' decays over the run's outer updates, so it needs the run's length: "
                "pass total_steps (the trainer passes train.steps), or use 'constant'"
            )
        self.round_start = self.outer_params.clone()  # theta at the start of the round (phi under reset)
        self.pending: PendingMean | None = None  # the delayed sync, in flight
        self.outer_step = 0  # rounds completed
        self.warnings: list[str] = []  # for the trainer to print once (the link cannot keep up)
        self._warned = False
        self.elastic = ElasticRounds(self, membership) if membership is not None else None
        """Elastic runs (topology.elastic, docs/design.md §10.1): torchft's quorum decides which clusters take part in
        each round, and this ends the rounds and the training instead."""

    def _build_reducer(self, compression: CompressionConfig, *, elastic: bool = False) -> Reducer:
        """A reducer of `compression` over this rank's tensors, on its channel, with the guard and the aggregate of
        `[sync]`: the rounds' (`self.reducer`) and the drain's."""
        return build_reducer(
            compression,
            self.flat.shapes,
            channel=self.channel,
            dp_group=self.dp_group,
            pp_group=self.pp_group,
            seed=self.seed,
            guard_max_ratio=self.cfg.guard_max_ratio if self.cfg.guard else None,
            peer_max_ratio=self.cfg.guard_peer_ratio if self.cfg.guard_peers else None,
            aggregate=self.cfg.aggregate,
            trim_fraction=self.cfg.trim_fraction,
            elastic=elastic,
        )

    # ---------------------------------------------------------------------------------------------- protocol
    def reduce_gradients(self) -> None:
        self.flat.scatter_grads(dp_mean_(self.flat.gather_grads(), self.dp_group))

    def is_round_boundary(self, step: int) -> bool:
        return step in (self.round_end, self.total_steps) or (step > 0 and step == self.last_boundary)

    def after_inner_step(self, step: int) -> RoundStats | None:
        if self.faults is not None and self.faults.kind == "diverge" and step == self.last_boundary + 1:
            if self.faults.active(cluster=self.channel.group_rank, round_index=self.outer_step + 1):
                self.flat.scatter_data(torch.full((self.numel,), float("nan")))  # faults: this round diverges
        if step not in (self.round_end, self.total_steps):
            if self.pending is not None and step == self.last_boundary + self.cfg.overlap_steps:
                return self._apply_in_round(step)
            return None
        return self.end_round(step)

    def _apply_in_round(self, step: int) -> RoundStats:
        """`sync.overlap_steps`: wait for the last round's sync `overlap_steps` into this round and apply it now.

        The cluster keeps what it computed since the boundary: its parameters move by what phi moved past the round
        start (the true average replaces the estimate the merge rule started from, as at a boundary), and the round
        start becomes phi, so this round's pseudo-gradient is still all of its own progress."""
        due, self.pending = self.pending, None
        stats, left_out = self._apply_due(due, step - self.last_boundary)
        if left_out:
            self.reducer.heal()
            if self.cfg.guard:
                self._heal(self.outer_step, "the others left its update out")
            start = self.outer_params.clone()
            theta = start
        else:
            start = self._with_held_back(self.outer_params)
            theta = self.flat.gather_data().to(self.state_device) + (start - self.round_start)
        self.flat.scatter_data(theta)
        self.round_start = start
        return dataclasses.replace(stats, inner_steps=self.inner_steps)

    def end_round(self, step: int) -> RoundStats | None:
        """Launch this round's sync and apply the one that is due (this one when blocking, the last one if delayed).

        Delayed: the last round's sync is waited for before this round's is launched. The link is FIFO, so this
        round's transfer could not start earlier anyway, and the launch then sees everything the last sync left
        behind (error-feedback residuals and shared warm starts of the scalable path).

        Returns what the sync waited for cost (None in the first round of a delayed sync: nothing was due)."""
        if self.elastic is not None:
            return self.elastic.end_round(step)
        round_steps = step - self.last_boundary
        pseudo_grad = self.round_start - self.flat.gather_data().to(self.state_device)  # (numel,) round start - theta
        round_index = self.outer_step + 1
        own_bad = self.cfg.guard and not bool(torch.isfinite(pseudo_grad).all())
        stats = None
        if self.cfg.sync_delay == 0:
            if own_bad:
                self.reducer.heal()
            avg, stats = self.wait_sync(
                self._launch(pseudo_grad, own_bad, round_index), round_steps=round_steps, round_index=round_index
            )
            self._set_outer_lr(self.outer_step)
            if not stats.skipped:
                self.apply(avg)
            heal = own_bad or self._left_out(stats)
            theta = self.outer_params if heal else self._with_held_back(self.outer_params)
        else:
            due, self.pending = self.pending, None
            own_left_out = False
            if due is not None:
                stats, own_left_out = self._apply_due(due, round_steps)
                if self.cfg.fit_link:
                    self._fit_inner_steps(stats, round_steps)
            heal = own_bad or own_left_out
            if heal:  # before this round's encoding: what the bad round left in the residuals is not sent again
                self.reducer.heal()
            # pseudo_grad stays intact until the sync is waited for; what the last encodings held back is read
            # before this one takes it in
            held_before = self.reducer.held_back(self.state_device) if self._reads_held_back() else None
            self.pending = self._launch(pseudo_grad, own_bad, round_index)
            theta = self.outer_params if heal else self._delayed_round_start(pseudo_grad, held_before)
        if self.cfg.guard:
            # Only this cluster's own non-finite updates can stop the run; one the others leave out (an outlier,
            # or a lying cluster) heals and goes on: a cluster that is out of step must not stop the others.
            self._count_bad("own", own_bad, f"this cluster's own update was non-finite (round {round_index})")
            if heal:
                self._heal(round_index, "its own update is non-finite" if own_bad else "the others left its update out")
        self.flat.scatter_data(theta)
        self.round_start = theta.clone()
        self.outer_step += 1
        self.last_boundary, self.round_end = step, step + self.inner_steps
        return stats

    def _apply_due(self, due: PendingMean, round_steps: int) -> tuple[RoundStats, bool]:
        """Wait for the delayed sync of round `outer_step` (the one that ended at the last boundary) and take its
        outer step; returns its stats and whether the others left this cluster's update out."""
        avg, stats = self.wait_sync(due, round_steps=round_steps, round_index=self.outer_step)
        self._set_outer_lr(self.outer_step - 1)  # the average of the round before this one
        if not stats.skipped:  # the guard found no usable mean: phi and its momentum stay
            self.apply(avg)
        return stats, self._left_out(stats, due)

    def _launch(self, pseudo_grad: torch.Tensor, own_bad: bool, round_index: int) -> PendingMean:
        """Launch this round's sync: abstain if the guard found the update non-finite; `faults` may lie."""
        if own_bad:
            pending = self.reducer.abstain(pseudo_grad)
            pending.abstained = True
            return pending
        if self.faults is not None and self.faults.kind != "diverge":
            if self.faults.active(cluster=self.channel.group_rank, round_index=round_index):
                if self.faults.kind == "forge":  # the values are honest, their tag is not
                    self.channel.forge_next_payload()
                    return self.reducer.launch(pseudo_grad)
                return self.reducer.launch(self.faults.corrupt(pseudo_grad, round_index=round_index))
        return self.reducer.launch(pseudo_grad)

    def _left_out(self, stats: RoundStats, pending: PendingMean | None = None) -> bool:
        """Whether the others left out an update this cluster did send (not one it abstained from)."""
        return self.channel.group_rank in (stats.excluded or {}) and not (pending is not None and pending.abstained)

    def _heal(self, round_index: int, why: str) -> None:
        self.healed = True
        self.guard_counts["healed_rounds"] += 1
        self.warnings.append(
            f"guard: cluster {self.channel.group_rank} restarts round {round_index + 1} from the agreed parameters "
            f"with a fresh inner optimizer state: {why}"
        )

    def _count_bad(self, which: str, bad: bool, what: str) -> None:
        """Consecutive bad rounds of `which` (own: this cluster's update; all: every cluster's); too many stop."""
        self._bad_in_row[which] = self._bad_in_row[which] + 1 if bad else 0
        if self._bad_in_row[which] >= self.cfg.guard_max_bad_rounds:
            raise GuardError(
                f"{what}, {self._bad_in_row[which]} rounds in a row (sync.guard_max_bad_rounds = "
                f"{self.cfg.guard_max_bad_rounds}): training cannot recover by itself"
            )

    def flush(self) -> RoundStats | None:
        """Apply the sync still in flight (and with `sync.drain_residual` what the codecs still hold back); afterwards
        every cluster holds the same parameters (phi). Returns the stats of the sync it waited for, if any."""
        if self.elastic is not None:
            return self.elastic.flush()
        stats = None
        if self.pending is not None:
            due, self.pending = self.pending, None
            avg, stats = self.wait_sync(due, judge_link=False)  # launched just now: no round of compute to hide behind
            self._set_outer_lr(self.outer_step - 1)  # launched by the last end_round
            if not stats.skipped:
                self.apply(avg)
        if self.cfg.drain_residual:
            drained = self._drain()
            stats = stats.with_exclusions_of(drained) if stats is not None else None
        if stats is not None or self.cfg.local_residual or self.cfg.drain_residual:
            self.flat.scatter_data(self.outer_params)  # blocking: the clusters held phi minus their shares
            self.round_start = self.outer_params.clone()
        return stats

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
        avg, stats = self.wait_sync(drain.launch(held_back), judge_link=False, judge_mean=False)
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

    # ---------------------------------------------------------------------------------------------- steps
    def wait_sync(
        self,
        pending: PendingMean,
        *,
        round_steps: int | None = None,
        round_index: int | None = None,
        judge_link: bool = True,
        judge_mean: bool = True,
    ) -> tuple[torch.Tensor, RoundStats]:
        """The averaged pseudo-gradient of a launched sync, with the link time it took and the part that was hidden.

        `round_steps`: inner steps computed since the sync was launched (this round's H), for the per-round log;
        `round_index`: the round that launched it (1-based), for the guard's messages; `judge_link`: whether a
        link slower than the compute since the launch deserves the slow-link warning (not at the final flush,
        which waits right after the last launch); `judge_mean`: whether the summing reductions' guard judges the mean
        against recent rounds' (not for the drain, whose residual is no round's pseudo-gradient)."""
        round_steps = self.inner_steps if round_steps is None else round_steps
        round_index = self.outer_step if round_index is None else round_index
        clock = self.channel.clock  # the link's clock: real time, or a test's virtual seconds
        compute_s = clock.now() - pending.transfer.launch_time
        blocked_from = clock.now()
        avg = pending.wait()
        skipped = self._guard_mean(avg, pending, round_index, judge_mean) if self.cfg.guard else False
        if skipped:
            avg = torch.zeros_like(avg)
        stats = RoundStats(
            link_s=pending.transfer.link_s,
            exposed_s=clock.now() - blocked_from,
            bytes_sent=pending.transfer.nbytes_sent,
            compute_s=compute_s,
            inner_steps=round_steps,
            cost=pending.cost,
            rank=self.reducer.current_rank(),
            matrix_ranks=self.reducer.current_matrix_ranks(),
            excluded=dict(pending.excluded) if self.cfg.guard else None,
            skipped=skipped,
            round_index=round_index,
        )
        slower = judge_link and stats.link_s > compute_s > 0
        if self.cfg.sync_delay == 1 and slower and not self._warned and not self.cfg.fit_link:
            self._warned = True
            self.warnings.append(self._slow_link_advice(stats, round_steps=round_steps))
        return avg, stats

    def _guard_mean(self, avg: torch.Tensor, pending: PendingMean, round_index: int, judge_mean: bool) -> bool:
        """Log what the gather reduction left out; judge the mean of the summing ones. True: skip this round."""
        where = f"round {round_index}" if judge_mean else "drain"  # only the drained residual is not judged so
        for cluster, why in sorted(pending.excluded.items()):
            self.warnings.append(f"guard: {where}: cluster {cluster}'s update left out ({why})")
        self.guard_counts["excluded_updates"] += len(pending.excluded)
        if self.mean_guard is not None and judge_mean:
            verdict = self.mean_guard.judge([avg])[0]
            if verdict is None:
                self.mean_guard.accept([avg])
            skip = verdict is not None
            why = f"the mean has {verdict}"
        else:
            skip = len(pending.excluded) >= self.channel.world_size
            why = "every cluster's update was left out"
        if skip:
            self.reducer.heal()  # a non-finite mean may have reached every cluster's residuals
            self.guard_counts["skipped_rounds"] += 1
            self.warnings.append(f"guard: round {round_index}: no outer step ({why})")
        self._count_bad("all", skip, "no usable mean of the clusters' updates")
        return skip

    def _fit_inner_steps(self, stats: RoundStats, round_steps: int) -> None:
        """compression.fit_link: choose the next round's H so that the sync launched now, which travels during
        it, fits in its compute with `FIT_HEADROOM`, judged by the sync just waited for (same size, same link).

        Never below the configured H (the user's choice when the link is fast) nor above `max_inner_steps`. Every
        rank measures its own link and step time, so they agree on the largest wish with one 8-byte all-reduce
        over every rank (a control message, not counted as slow-link payload): all clusters and stages must end
        their rounds at the same steps."""
        link_s, compute_s = stats.link_s, stats.compute_s or 0.0
        step_s = compute_s / max(1, round_steps)
        needed = math.ceil(FIT_HEADROOM * link_s / step_s) if step_s > 0 else self.inner_steps
        wish = torch.tensor([min(max(needed, self.cfg.inner_steps), self.cfg.max_inner_steps)], dtype=torch.int64)
        if dist.is_initialized():
            dist.all_reduce(wish, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
        self.inner_steps = int(wish.item())
        if needed > self.cfg.max_inner_steps and not self._warned:
            self._warned = True
            self.warnings.append(
                f"warning: sync.fit_link wants H = {needed} to hide a {link_s:.2f} s sync behind "
                f"{step_s:.3f} s steps, above sync.fit_link_max_steps = {self.cfg.max_inner_steps}; training waits "
                "for the link: raise fit_link_max_steps, compress harder or use a faster link"
            )

    def apply(self, avg_pseudo_grad: torch.Tensor) -> None:
        """One outer step: the averaged pseudo-gradient is the gradient of phi."""
        self.outer.step(avg_pseudo_grad)

    def _set_outer_lr(self, update: int) -> None:
        """Set the outer optimizer's learning rate to that of the 0-based outer update `update`."""
        self.outer.set_lr(update)

    def _held_back_share(self) -> torch.Tensor | None:
        """`sync.local_residual`: this cluster's share (1/C) of what its codec still holds back, None when off."""
        if not self.cfg.local_residual:
            return None
        held_back = self.reducer.held_back(self.state_device)
        return None if held_back is None else held_back / self.num_clusters

    def _reads_held_back(self) -> bool:
        """Whether a delayed round's start depends on what the codec held back before the round's encoding."""
        return self.cfg.local_residual or self.cfg.merge == "own_payload"

    def _with_held_back(self, phi: torch.Tensor) -> torch.Tensor:
        """Where a round (re)starts from the agreed `phi` once no average is in flight: phi itself, or under
        `sync.local_residual` phi minus this cluster's share of what its codec holds back (a new tensor)."""
        held_back = self._held_back_share()
        return phi.clone() if held_back is None else phi - held_back

    def _delayed_round_start(self, pseudo_grad: torch.Tensor, held_before: torch.Tensor | None = None) -> torch.Tensor:
        """Where the next round starts under the one-step delay, with round t's average in flight (`sync.merge`),
        `pseudo_grad` having just been launched. `held_before`: what the codec held back before that launch (None:
        nothing, or not read). Under `sync.local_residual` the start is lowered by this cluster's share of what the
        codec holds back and round t's own share does not carry: `held_before` (its encoding added that to
        pseudo_grad), or for `own_payload`, which counts all that was sent, what it still holds back after.
        `own_payload` trusts the payload only once it carries more than one round: where the codec held nothing back
        before (the first round, or the round after a heal) it starts where `eager` does."""
        if self.cfg.merge == "own_payload" and held_before is not None:
            held_after = self.reducer.held_back(self.state_device)  # d r_new, d = compression.feedback_decay
            sent = pseudo_grad + held_before - held_after / self.compression.feedback_decay  # input - new residual
            start = self.predicted_outer_params(sent, update=self.outer_step)
            return start - held_after / self.num_clusters if self.cfg.local_residual else start
        if self.cfg.merge == "reset":
            start = self.outer_params
        elif self.cfg.merge == "keep_local":
            start = self.outer_params - pseudo_grad
        else:
            own_share = pseudo_grad if self.cfg.merge == "lookahead" else pseudo_grad / self.num_clusters
            start = self.predicted_outer_params(own_share, update=self.outer_step)
        if self.cfg.local_residual and held_before is not None:
            return start - held_before / self.num_clusters
        return start

    def predicted_outer_params(self, estimate: torch.Tensor, *, update: int) -> torch.Tensor:
        """phi after outer update `update` if its averaged pseudo-gradient were `estimate`: the outer optimizer's
        own step on scratch copies (`OuterOptimizer.predict`), so phi and its state are left unchanged."""
        return self.outer.predict(estimate, update=update)

    def _slow_link_advice(self, stats: RoundStats, *, round_steps: int) -> str:
        link_s, compute_s, nbytes = stats.link_s, stats.compute_s or 0.0, stats.bytes_sent
        need_h = math.ceil(round_steps * link_s / compute_s)
        fit = self._bandwidth_advice(nbytes, compute_s)
        if self.cfg.overlap_steps:
            return (
                f"warning: the slow link cannot keep up: one outer sync takes {link_s:.2f} s on the link but the "
                f"{round_steps} steps it may travel during (sync.overlap_steps) compute in {compute_s:.2f} s, so "
                f"training waits for it; use sync.overlap_steps >= {need_h} (below sync.inner_steps), or 0{fit}"
            )
        return (
            f"warning: the slow link cannot keep up: one outer sync takes {link_s:.2f} s on the link but a round "
            f"computes in {compute_s:.2f} s, so training waits for it; use sync.inner_steps >= {need_h}{fit} "
            "(or sync.fit_link = true to size H to the link as it goes)"
        )

    def _bandwidth_advice(self, nbytes: int, compute_s: float) -> str:
        """`or network.bandwidth >= X`: the emulated uplink under which a sync of `nbytes` from this rank would fit
        in `compute_s` after the latency. Empty where no bandwidth setting helps: the bandwidth is unlimited (the
        link time is then the real collective's own), the latency alone is as long as the compute, or the uplink is
        already that fast (the real collective was slower than the emulated link)."""
        latency, uplink = self.channel.latency_s, self.channel.uplink_bytes_per_s
        if uplink is None:
            return " (network.bandwidth is unlimited: this is the real collective's time, not an emulated link's)"
        if compute_s <= latency:
            return ""
        needed = nbytes * self.channel.num_sharing / (compute_s - latency)  # bytes/s of the cluster's uplink
        return f" or network.bandwidth >= {_format_rate(8 * needed)}" if needed > uplink else ""

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
            "guard": self.guard_state(),
        }

    def guard_state(self) -> dict[str, Any]:
        """The guard's totals, its bad rounds in a row and the summing reductions' norm history (the gather
        reduction's own history is its reducer's)."""
        return {
            "counts": dict(self.guard_counts),
            "bad_in_row": dict(self._bad_in_row),
            "mean": self.mean_guard.state_dict() if self.mean_guard is not None else None,
        }

    def load_guard_state(self, state: dict[str, Any]) -> None:
        self.guard_counts.update(state["counts"])
        self._bad_in_row.update(state["bad_in_row"])
        if self.mean_guard is not None and state["mean"] is not None:
            self.mean_guard.load_state_dict(state["mean"])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "reducer" not in state:
            raise ValueError(
                "this checkpoint was written by a dilocox older than the reducer layout (2026-11-23) and cannot be "
                "resumed by this version; start a new run (dilocox eval still reads its model)"
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
        guard = state.get("guard")  # checkpoints from before the guard (2026-11-23) have none: fresh counts
        if guard is not None:
            self.load_guard_state(guard)
        # Every rank resumes from the same step and loads in the same order, so the re-sends pair up across
        # clusters. The link counters (restored first) hold the transfer exactly when it had arrived on this rank.
        if state["pending_sent"] is not None:
            counted = state["pending_seq"] < self.channel.num_transfers
            sent = state["pending_sent"].to(self.outer_params.device)  # checkpoints load on the CPU
            self.pending = self.reducer.relaunch(sent, account=not counted)
        else:
            self.pending = None


def _format_rate(bits_per_s: float) -> str:
    """A bandwidth as `network.bandwidth` takes it, rounded up to 3 significant digits: 1.24Gbps, 457Mbps, 7.5Kbps."""
    prefix, scale = next(((p, s) for p, s in (("G", 1e9), ("M", 1e6)) if bits_per_s >= s), ("K", 1e3))
    value = bits_per_s / scale
    digits = max(0, 2 - math.floor(math.log10(value))) if value > 0 else 0
    return f"{math.ceil(value * 10**digits) / 10**digits:g}{prefix}bps"
