"""DiLoCo (Douillard et al. 2023, arXiv 2311.08105), its one-step-delay form from DiLoCoX (arXiv 2506.21263) and its
streamed form (Streaming DiLoCo, Douillard et al. 2025, arXiv 2501.18512): one stage's outer rounds.

H local steps, then an outer step on the pseudo-gradient averaged over the clusters. The stage's tensors are
`sync.fragments` fragments (`FragmentState`, one by default), fragment k's round ending at (k + 1) H // N and every
H steps after, so the slow link carries N bursts of ~1/N of the stage per round instead of one. At every step
`after_inner_step` runs what the schedule says for each fragment (docs/design.md §6c):

| timing | at boundary - overlap_steps | at the boundary | at boundary + overlap_steps |
| --- | --- | --- | --- |
| blocking (`sync_delay = 0`) | | launch, land, start at phi | |
| streamed (`sync_delay = 0`, `overlap_steps = tau`) | launch | land, mix by `alpha` | |
| delayed (`sync_delay = 1`) | | land the last, launch, merge rule | land (`overlap_steps = k`) |

Around every step with something to do, an elastic run meets the live clusters (`ElasticRounds`: a torchft quorum,
then a commit). With `sync.round.mode = "time"` a `RoundClock` decides how many steps each round has on this cluster,
and the clusters' updates weigh by their tokens (`StageParts.weighted`).

    sync = DiLoCoSync(model.parameters(), SyncConfig(inner_steps=50, sync_delay=1), channel=channel, dp_group=dp_group)
    ...inner step...; sync.after_inner_step(step)     # at its boundaries: a fragment's round ends
    sync.flush()                                      # end of training: apply the update still in flight
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist

from dilocox.compress import CompressionConfig
from dilocox.elastic.membership import ElasticMembership
from dilocox.elastic.rounds import ElasticRounds
from dilocox.net.channel import WanChannel
from dilocox.sync.base import FlatParams, RoundStats, SyncStatus, dp_mean_
from dilocox.sync.config import SyncConfig
from dilocox.sync.faults import FaultConfig
from dilocox.sync.fragment import (
    FragmentState,
    StageParts,
    fragment_bounds,
    fragment_offset,
    num_outer_updates,
)
from dilocox.sync.outer_optimizer import OuterOptimizerFactory, outer_optimizer_factory
from dilocox.sync.rounds import RoundClock, RoundReport, TokenWeights

STATE_KEYS: tuple[str, ...] = ("fragments",)
"""The keys of `DiLoCoSync.state_dict`."""


class DiLoCoSync:
    """The outer rounds of one stage's fragments (module docstring), behind the protocol the trainer and `OuterSync`
    drive: `reduce_gradients`, `after_inner_step`, `flush`, `agreed_model`, `state_dict` / `load_state_dict`.

    The outer optimizer is any `torch.optim.Optimizer` over phi (`outer_optimizer`, a factory; by default
    `sync.outer.optimizer`'s), one per fragment, with the learning rate of each update set by `sync.outer.lr_schedule`.
    The average is its reducer's (`compression.kind` and `compression.reduction`, docs/design.md §4.4); with `faults`
    a lying cluster's reducers are wrapped (`FaultyReducer`). With a `membership` (elastic runs, docs/design.md §10.1)
    each step with a boundary meets that boundary's torchft quorum. `weights`: clusters of different data-parallel
    degree (docs/design.md §2.1) and time rounds (§3.1) weigh each cluster by its tokens.
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
        agree_group: dist.ProcessGroup | None = None,
        seed: int = 0,
        total_steps: int | None = None,
        faults: FaultConfig | None = None,
        membership: ElasticMembership | None = None,
        outer_optimizer: OuterOptimizerFactory | None = None,
        weights: TokenWeights | None = None,
        sharded: bool = False,
        dp_reduced: bool = False,
    ) -> None:
        """`sharded`: `params` are FSDP shards over `dp_group` (topology.dp_mode = shard): FSDP's reduce-scatter
        already averaged the gradients over it, and this rank's shard is all it sends over the slow link (a replicated
        stage's rank sends its slice of the stage and all-gathers the others'). `dp_reduced`: the replicated stage's
        gradients arrive averaged over `dp_group` already (the trainer's DDP stage): `reduce_gradients` does nothing.
        `weights`: how this cluster's tokens weigh its updates (`TokenWeights`). `agree_group`: the ranks that sync, which
        agree on fit_link's H (None: every rank)."""
        compression = compression or CompressionConfig()
        cfg = cfg.resolved(compression)  # its auto options, by their rules
        cfg.validate()
        self.cfg = cfg
        self.name = cfg.kind  # diloco or dilocox: the same code, other defaults
        self.flat = FlatParams(params)
        self.numel = self.flat.numel
        self.dp_group = None if sharded else dp_group
        """The replicas over which the reducers slice the stage."""
        self.averages_dp = self.dp_group is not None and not dp_reduced
        """Whether `reduce_gradients` averages the gradients over `dp_group` (no one did before it)."""
        self.total_steps = total_steps
        self.time_rounds = cfg.round.mode == "time"
        if self.time_rounds and not total_steps:
            raise ValueError("sync.round.mode = time makes the run ceil(total_steps / H) rounds: pass total_steps")
        weights = weights or TokenWeights()
        weighted = self.time_rounds or weights.round_tokens is not None
        params_device = self.flat.params[0].device if self.flat.params else torch.device("cpu")
        round_tokens = weights.round_tokens
        if round_tokens is None:  # n_ref: a round of H steps of the cluster's tokens, the same on every cluster
            round_tokens = cfg.inner_steps * weights.per_step
        self.stage = StageParts(
            cfg=cfg,
            compression=compression,
            channel=channel,
            dp_group=self.dp_group,
            pp_group=pp_group,
            shard_group=dp_group if sharded else None,
            agree_group=agree_group,
            seed=seed,
            state_device=params_device if cfg.outer.state_device == "device" else torch.device("cpu"),
            weighted=weighted,
            round_tokens=round_tokens,
            first_weight_sum=weights.first_sum,
            faults=faults if faults is not None and faults.enabled else None,
            elastic_run=membership is not None,
            cluster_id=membership.cluster if membership is not None else channel.group_rank,
        )
        self.tokens_per_step = weights.per_step
        self.wrote_params = False
        """The last `after_inner_step` wrote the parameters (an event ran, or a fault made the round diverge)."""
        self.clock: RoundClock | None = None
        """sync.round.mode = time: the steps of each round on this cluster."""
        first_steps = cfg.inner_steps
        if self.time_rounds:
            slow = faults.slow_factor(self.stage.cluster_id) if faults is not None else 1.0
            virtual = faults is not None and faults.slow_mode == "virtual"
            self.clock = RoundClock(
                cfg,
                total_steps=total_steps,
                virtual_factor=slow if virtual else None,
                dp_group=dp_group,
                pp_group=pp_group,
                device=params_device,
            )
            first_steps = self.clock.first_steps()
        self.clock_round = (0, first_steps)
        """Time rounds: (first step, steps) of the clock's round in progress on this cluster."""
        if cfg.outer.lr_schedule == "cosine" and not total_steps:
            raise ValueError(
                "sync.outer.lr_schedule = 'cosine' decays over the run's outer updates, so it needs the run's length: "
                "pass total_steps (the trainer passes train.steps), or use 'constant'"
            )
        factory = outer_optimizer if outer_optimizer is not None else outer_optimizer_factory(cfg)
        bounds = fragment_bounds([shape.numel() for shape in self.flat.full_shapes], cfg.fragments)  # shard or not
        self.bounds = bounds
        """(first, end) parameter indices of every fragment."""
        self.fragments: list[FragmentState] = []
        """The fragments, in parameter order (one: the whole stage)."""
        for k, (first, end) in enumerate(bounds):
            first_end = self._fragment_end(k, 0, first_steps) if self.time_rounds else None
            if first_end is None:
                first_end = fragment_offset(k, cfg.inner_steps, len(bounds))
            updates = (
                self.clock.num_rounds
                if self.clock is not None
                else num_outer_updates(total_steps, first_end, cfg.inner_steps)
            )
            self.fragments.append(
                FragmentState(
                    self.flat.params[first:end],
                    self.stage,
                    index=k if len(bounds) > 1 else None,
                    first_round_end=first_end,
                    short_first_round=first_end < first_steps,  # time rounds: of the first clock round
                    total_steps=total_steps,
                    num_outer_updates=updates,
                    outer_optimizer=factory,
                )
            )
        if self.time_rounds:
            for fragment in self.fragments:
                fragment.inner_steps = first_steps
        if cfg.drain_residual and not self.fragments[0].outer.takes_plain_steps:
            raise ValueError(
                f"sync.drain_residual = true adds the drained residual to phi at the outer SGD's learning rate, but "
                f"the outer optimizer is {self.fragments[0].outer.name}, whose steps have a length of their own; set "
                "sync.drain_residual = false (OuterSync: drain_residual=False), or use an SGD outer optimizer"
            )
        self.elastic = ElasticRounds(self, membership) if membership is not None else None
        """Elastic runs (topology.elastic, docs/design.md §10.1): each boundary's torchft quorum decides which clusters
        take part; it launches over their group and settles the syncs that are due among them."""
        self.stage.elastic = self.elastic
        self.step = 0
        """The last inner step this sync was told of (`after_inner_step`, a resumed or healed run's step)."""
        self._last_step: list[RoundStats] = []
        """Several fragments: the syncs landed by the rounds that ended at `total_steps`, returned by `flush`."""

    # ---------------------------------------------------------------------------------------------- the schedule
    def _fragment_end(self, k: int, round_first: int, round_steps: int) -> int:
        """Time rounds: the step at which fragment k's round ends in the clock round of `round_steps` steps from
        `round_first` (the last fragment's at the round's end)."""
        num_fragments = self.cfg.fragments
        if k == num_fragments - 1:
            return round_first + round_steps
        return round_first + max(1, ((k + 1) * round_steps) // num_fragments)

    def _ends_here(self, fragment: FragmentState, step: int) -> bool:
        """Whether `fragment`'s round ends at `step`: its boundary (once: a cluster that heals between two meetings of
        one step takes a state in which the first one's fragment ended there), or with step rounds the run's last step
        (time rounds end the run after their rounds, at whatever step each cluster is)."""
        if step == fragment.round_end:
            return fragment.last_boundary < step
        return not self.time_rounds and step == self.total_steps and fragment.last_boundary < step

    def _events(self, fragment: FragmentState, step: int) -> list[str]:
        """Rounds of steps: what `fragment` does at `step`, in order: "end" (its boundary), "launch" (a streamed sync,
        overlap_steps before the boundary), "land" (a delayed sync, overlap_steps into the round)."""
        cfg, k = self.cfg, self.cfg.overlap_steps
        if self._ends_here(fragment, step):
            return ["end"]
        if not k:
            return []
        if cfg.sync_delay == 0:
            return ["launch"] if step == fragment.round_end - k and step > fragment.last_boundary else []
        return ["land"] if fragment.outer_step > 0 and step == fragment.last_boundary + k else []

    def _planned_events(self, step: int) -> list[tuple[FragmentState, str]]:
        """Time rounds with an overlap: what the fragments do at `step`, in the order of their shares of the clock's
        round, which is the same on every cluster (every cluster lands, or launches, the same share of the round's
        time in, as its steps of the round take the same time).

        Fragment k's boundary is (k + 1) H / N into the round (`_fragment_end` put it at max(1, floor((k + 1) steps /
        N)) of this cluster's steps), its streamed launch overlap_steps before it, its delayed landing overlap_steps
        after it (in the next round where that passes H); each of those shares p of H is placed at max(1, floor(p x
        steps / H)) of this cluster's steps of the round, the boundaries' rounding. One rounding keeps the events in
        the order of their shares on a cluster of any speed (events that fall on one step run in that order), so an
        elastic run's clusters meet at them in one order; rounded from each fragment's own boundary, a landing could
        come before a boundary on one cluster and after it on another. A time round of one step has no step inside
        it: its events fall on that step, before its end. A cluster healed between two meetings of a step skips what
        its peer's state says is done."""
        cfg, last = self.cfg, self.last_fragment
        H, N, tau = cfg.inner_steps, len(self.fragments), cfg.overlap_steps  # streamed tau < H // N, delayed < H
        first, steps = last.last_boundary, last.inner_steps  # the clock's round in progress
        planned = []
        for k in range(N):
            end = Fraction((k + 1) * H, N)
            planned.append((end, k, "end"))
            if cfg.sync_delay == 0:
                planned.append((end - tau, k, "launch"))
            else:
                planned.append((end + tau if end + tau <= H else end + tau - H, k, "land"))
        others_hold = self.elastic.others_hold if self.elastic is not None else set()
        events: list[tuple[FragmentState, str]] = []
        for share, k, what in sorted(planned):
            fragment = self.fragments[k]
            if what == "end":
                due = self._ends_here(fragment, step)
            elif first + max(1, math.floor(share * steps / H)) != step:
                continue
            elif what == "launch":
                due = fragment.pending is None
            else:  # the sync in flight: launched at this step's boundary, or held here or by the peers
                ended = (fragment, "end") in events
                due = ended or (fragment.outer_step > 0 and (fragment.pending is not None or k in others_hold))
            if due:
                events.append((fragment, what))
        return events

    # ---------------------------------------------------------------------------------------------- protocol
    def reduce_gradients(self) -> None:
        if self.averages_dp:
            self.flat.scatter_grads(dp_mean_(self.flat.gather_grads(), self.dp_group))

    def is_round_boundary(self, step: int) -> bool:
        """Whether some fragment's round ends at `step` (a checkpoint there holds every fragment's state)."""
        return any(step == f.round_end or (step > 0 and step == f.last_boundary) for f in self.fragments)

    @property
    def last_fragment(self) -> FragmentState:
        """The fragment whose boundaries are the rounds' ends (time rounds count rounds by it)."""
        return self.fragments[-1]

    @property
    def done(self) -> bool:
        """sync.round.mode = time: whether every round of the run has ended."""
        return self.clock is not None and self.last_fragment.outer_step >= self.clock.num_rounds

    @property
    def outer_step(self) -> int:
        """Rounds launched: the most of any fragment (time rounds: the rounds ended, the last fragment's)."""
        if self.clock is not None:
            return self.last_fragment.outer_step
        return max(fragment.outer_step for fragment in self.fragments)

    @property
    def last_boundary(self) -> int:
        """The earliest step at which a fragment's round in progress began."""
        return min(fragment.last_boundary for fragment in self.fragments)

    @property
    def inner_steps(self) -> int:
        """H of the round in progress."""
        return self.last_fragment.inner_steps

    @property
    def landed_tokens(self) -> int:
        """Token-weighted syncs: the tokens every cluster trained on in the rounds whose sync landed."""
        return self.last_fragment.landed_tokens

    @property
    def warnings(self) -> list[str]:
        return self.stage.warnings

    @property
    def channel(self) -> WanChannel:
        return self.stage.channel

    @property
    def outer_params(self) -> torch.Tensor:
        """phi of the whole stage (numel,) fp32, the fragments' in parameter order."""
        if len(self.fragments) == 1:
            return self.fragments[0].outer_params
        return torch.cat([fragment.outer_params for fragment in self.fragments])

    def progress_step(self, step: int) -> float:
        """The run's progress at this cluster's 0-based step `step` (of the round in progress), in steps of an
        unslowed cluster: `step` itself with step rounds; with time rounds the round index plus the fraction of the
        round done (`RoundClock.progress_step`), which the inner learning rate schedule follows."""
        if self.clock is None:
            return float(step)
        first, steps = self.clock_round
        return self.clock.progress_step(self.last_fragment.outer_step + 1, step - first, max(1, steps))

    def add_step_time(self, seconds: float) -> None:
        """sync.round.mode = time: count one inner step's training time (the round's step time is measured from it)."""
        if self.clock is not None:
            self.clock.add_step_time(seconds)

    @property
    def guard_counts(self) -> dict[str, int]:
        """sync.guard's totals over every fragment's rounds: excluded_updates, skipped_rounds, healed_rounds."""
        counts = [fragment.guard.counts for fragment in self.fragments]
        return {key: sum(c[key] for c in counts) for key in counts[0]}

    def status(self) -> SyncStatus:
        """Where the outer loop stands after the last step it was told of (`SyncStatus`)."""
        elastic = self.elastic
        return SyncStatus(
            outer_step=self.outer_step,
            inner_steps=self.inner_steps,
            boundary=self.is_round_boundary(self.step),
            done=self.done,
            progress=self.progress_step(self.step),
            landed_tokens=self.landed_tokens,
            guard_counts=self.guard_counts,
            numel=self.numel,
            state_bytes=self.state_bytes(),
            messages=self.warnings,
            events=[] if elastic is None else elastic.events,
            last_clusters=() if elastic is None else elastic.last_clusters,
        )

    def take_healed(self) -> bool:
        """Whether the guard reset this cluster's parameters to the agreed ones since the last call (the owner of
        the inner optimizer then resets its non-finite state)."""
        healed = [fragment.guard.healed for fragment in self.fragments]
        for fragment in self.fragments:
            fragment.guard.healed = False
        return any(healed)

    # ---------------------------------------------------------------------------------------------- the rounds
    def after_inner_step(self, step: int) -> RoundStats | None:
        """Run what the schedule says at `step` (the module's table) for every fragment, in fragment order; around
        it, an elastic run's quorum and commit. Returns what the syncs that landed cost (the first one's stats, the
        others in `also_landed`), or None."""
        self.step = step
        faults = self.stage.faults
        self.wrote_params = False
        for fragment in self.fragments:
            if faults is not None and step == fragment.last_boundary + 1:
                if faults.diverges(cluster=self.stage.cluster_id, round_index=fragment.outer_step + 1):
                    fragment.flat.scatter_data(torch.full((fragment.numel,), float("nan")))  # this round diverges
                    self.wrote_params = True
        if self.clock is not None and self.cfg.overlap_steps:
            events = self._planned_events(step)
        else:
            events = [(fragment, what) for fragment in self.fragments for what in self._events(fragment, step)]
        if not events:
            return None
        self.wrote_params = True
        # An elastic run's clusters meet once per step with events, and with time rounds once per event: a cluster
        # whose round has fewer steps than fragments ends several at one step, which its peers end at several.
        meetings = [[event] for event in events] if self.elastic is not None and self.time_rounds else [events]
        landed: list[RoundStats] = []
        ended = [False] * len(self.fragments)
        newcomer = False
        for meeting in meetings:
            if self.elastic is not None:
                newcomer = self.elastic.open_boundary(step) or newcomer  # healed here: it trained none of them
            for fragment, what in meeting:
                stats = self._run(fragment, what, step, newcomer=newcomer)
                if stats is not None:
                    landed.append(stats)
                ended[self.fragments.index(fragment)] = what == "end" or (what == "land" and self.cfg.sync_delay == 0)
            if self.elastic is not None:
                self.elastic.commit()
        if self.cfg.guard.enabled and any(ended) and len(self.fragments) > 1:
            self._restart_non_finite(ended)
        if len(self.fragments) > 1 and (self.done if self.clock is not None else step == self.total_steps):
            self._last_step = landed  # every fragment's last round ended here: the flush returns them all
            return None
        return _combined(landed)

    def _run(self, fragment: FragmentState, what: str, step: int, *, newcomer: bool) -> RoundStats | None:
        """One fragment's event at `step`; returns what landed, if anything."""
        streamed = self.cfg.sync_delay == 0 and self.cfg.overlap_steps > 0
        if what == "land":
            return fragment.land(step)
        with self._launch_scope(fragment, step):
            if what == "launch":
                fragment.launch(step, newcomer=newcomer, report=self._report(fragment, step))
                return None
            if streamed and fragment.pending is not None:  # launched overlap_steps ago: it lands at the boundary
                stats = fragment.land(step)
            else:
                stats = fragment.end_round(step, newcomer=newcomer, report=self._report(fragment, step))
        self._next_round(fragment, step)
        return stats

    def _report(self, fragment: FragmentState, step: int) -> RoundReport | None:
        """Weighted syncs: what this cluster trained in `fragment`'s round up to `step` (time rounds: the step time
        measured over the clock's round, at its end)."""
        if not self.stage.weighted:
            return None
        steps = step - fragment.last_boundary
        step_s = 0.0
        if self.clock is not None and fragment is self.last_fragment:
            step_s = self.clock.close_round()  # measured: collective in the cluster
            self._closed_step_s = step_s
        return RoundReport(steps, steps * self.tokens_per_step, step_s)

    def _next_round(self, fragment: FragmentState, step: int) -> None:
        """Where `fragment`'s next round ends: H steps on (fit_link: the H it chose), or with time rounds where the
        clock's next round puts it."""
        if self.clock is None:
            fragment.round_end = step + fragment.inner_steps
            return
        if fragment is not self.last_fragment:
            return  # placed with the clock's next round, at the last fragment's boundary
        if self.done:
            return
        steps = self.clock.next_steps(
            fragment.outer_step + 1,
            last_step_s=getattr(self, "_closed_step_s", 0.0),
            reports=fragment.reports,
            own_index=self.stage.channel.group_rank,
        )
        self.clock_round = (step, steps)
        for k, each in enumerate(self.fragments):
            each.inner_steps = steps
            each.round_end = self._fragment_end(k, step, steps)

    def _restart_non_finite(self, ended: list[bool]) -> None:
        """The guard healed the fragments whose round just ended non-finite; the others that are non-finite went bad
        in the same steps and start their round in progress again from its start."""
        for fragment, just_ended in zip(self.fragments, ended, strict=True):
            if not just_ended and not bool(torch.isfinite(fragment.flat.gather_data()).all()):
                fragment.restart_round()

    def in_progress(self, fragment: FragmentState, step: int) -> bool:
        """Whether `fragment` has a round in progress at `step` that a flush ends (`end_round`): one with steps since
        its boundary, and with time rounds once every round ended, each fragment but the last, whose round the clock
        began mid-round. A cluster whose last round had fewer steps than fragments ended some of them at its last
        step: their rounds in progress have no steps, and it still ends them with its peers (weighing 0 tokens), so
        that every cluster sends the same syncs."""
        return fragment.last_boundary < step or (self.done and fragment is not self.last_fragment)

    def end_round(self, step: int) -> RoundStats | None:
        """End the round in progress of every fragment that has one (`in_progress`: a flush before `total_steps`,
        or the end of time rounds)."""
        if self.elastic is not None:
            newcomer = self.elastic.open_boundary(step)
        else:
            newcomer = False
        landed = []
        for fragment in self.fragments:
            if self.in_progress(fragment, step):
                stats = self._run(fragment, "end", step, newcomer=newcomer)
                if stats is not None:
                    landed.append(stats)
        if self.elastic is not None:
            self.elastic.commit()
        return _combined(landed)

    def flush(self) -> RoundStats | None:
        """Apply the syncs still in flight (and with `sync.drain_residual` what the codecs still hold back); afterwards
        every cluster holds the same parameters (phi). Returns the stats of the syncs it waited for, if any (with
        several fragments, also those landed by the rounds that ended at `total_steps`)."""
        if self.elastic is not None:
            self.elastic.open_boundary(None)
        stats = [each for each in (fragment.flush() for fragment in self.fragments) if each is not None]
        if self.elastic is not None:
            self.elastic.commit()
        for fragment in self.fragments:
            fragment.hold_phi()
        stats, self._last_step = self._last_step + stats, []
        return _combined(stats)

    def _launch_scope(self, fragment: FragmentState, step: int) -> AbstractContextManager[None]:
        """Where `fragment`'s round ending at `step` launches its sync: the last round's is part of the end of
        training (every fragment's last round ends at train.steps, so those syncs go together, as the flush and the
        drain do, with no compute left to hide behind), which the link's peak in flight leaves out
        (`WanChannel.off_peak`); the peak is that of the rounds during training."""
        if self.clock is not None:  # time rounds: the run ends after its rounds, at whatever step
            last = fragment.outer_step + 1 >= self.clock.num_rounds
        else:
            last = step == self.total_steps
        return self.channel.off_peak() if last else nullcontext()

    @contextmanager
    def agreed_model(self) -> Iterator[bool]:
        """The model holds phi, the outer params with every landed update applied (docs/design.md §3), until exit.

        Between round boundaries, and with `sync_delay = 1` always, a cluster's own parameters differ from phi; phi
        is the same on every cluster (each applied the same averages), so evaluating it scores the model the
        clusters agree on rather than one cluster's local model."""
        with ExitStack() as stack:
            for fragment in self.fragments:
                local = fragment.flat.gather_data()  # (numel,) fp32 on the parameters' device
                fragment.flat.scatter_data(fragment.outer_params)
                stack.callback(fragment.flat.scatter_data, local)
            yield True

    # ---------------------------------------------------------------------------------------------- state
    def state_bytes(self) -> int:
        return sum(fragment.state_bytes() for fragment in self.fragments)

    def state_dict(self) -> dict[str, Any]:
        """Every fragment's state (`FragmentState.state_dict`, its sync in flight included) and the round clock."""
        state: dict[str, Any] = {"fragments": [fragment.state_dict() for fragment in self.fragments]}
        if self.clock is not None:
            state["round_clock"] = self.clock.state_dict()
            state["clock_round"] = list(self.clock_round)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Every fragment's state, in fragment order on every cluster, then their syncs in flight sent again in the
        order they were launched, so that the re-sends pair up across the clusters."""
        if "fragments" not in state and "outer_params" in state:  # a stage of one fragment, as saved before fragments
            state = {"fragments": [state], **{k: state[k] for k in ("round_clock",) if k in state}}
        saved = state.get("fragments")
        if not isinstance(saved, list) or len(saved) != len(self.fragments):
            have = len(saved) if isinstance(saved, list) else "no"
            raise ValueError(
                f"this outer-sync state holds {have} fragments, this run syncs sync.fragments = {len(self.fragments)}: "
                "resume with the sync.fragments it was saved with"
            )
        flights = [fragment.load_state_dict(each) for fragment, each in zip(self.fragments, saved, strict=True)]
        if self.clock is not None:
            if state.get("round_clock") is not None:
                self.clock.load_state_dict(state["round_clock"])
            last = self.last_fragment
            first, steps = state.get("clock_round", (last.last_boundary, last.round_end - last.last_boundary))
            self.clock_round = (int(first), int(steps))
        order = sorted(
            (k for k, flight in enumerate(flights) if flight is not None),
            key=lambda k: saved[k]["pending_seq"],
        )
        if self.elastic is not None:  # sent again over the first quorum's group, once this cluster is in it
            self.elastic.resume(self.last_boundary, {k: flights[k] for k in order})
            return
        for k in order:
            self.fragments[k].relaunch(flights[k])  # type: ignore[arg-type]


def _combined(stats: list[RoundStats]) -> RoundStats | None:
    """The first sync's stats carrying the others (`RoundStats.also_landed`); None when none landed."""
    return dataclasses.replace(stats[0], also_landed=tuple(stats[1:])) if stats else None
