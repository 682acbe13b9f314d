"""The round boundary of an elastic run: settle the sync in flight among the clusters that are alive.

With `topology.elastic = true` (docs/design.md §10.1) the clusters of a round are the members of that round's
torchft quorum (`ElasticMembership`), and the one-step-delay sync launched over one quorum is resolved at the next
boundary, whose quorum may differ: a cluster died, or a restarted one joined and healed from a live peer.
`ElasticRounds` owns everything elastic about the outer loop; the rounds themselves (`FragmentState`: launch,
landing, guard, merge rule) are the static run's. Around every step with a boundary (`DiLoCoSync.after_inner_step`)
it opens the boundary and commits it, and each fragment's launch and landing pass through it:

    rounds = ElasticRounds(sync, membership)     # DiLoCoSync builds it when given a membership
    joined = rounds.rejoin()                     # the first quorum; a late cluster heals here
    newcomer = rounds.open_boundary(step)        # then per fragment: before_launch(f), settle(f, due, ...); commit()

What the members of a boundary's quorum do with the sync in flight is `delayed_update_verdict` (`dilocox.elastic.vote`).
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Any, Protocol

import torch

from dilocox.agreement import describe_differences
from dilocox.elastic.events import ElasticEvent, MembershipLog
from dilocox.elastic.membership import ElasticError, ElasticMembership, Quorum, confirm, shared_settings
from dilocox.elastic.stall import MemberStalled
from dilocox.elastic.vote import (
    VERDICT_BRANCH,
    Branch,
    ClusterVote,
    MemberReport,
    RejoinRequired,
    delayed_update_verdict,
    diverged_members,
    exchange_reports,
    exchange_settings,
    outer_digest,
)
from dilocox.net.channel import PayloadsRejected, WanChannel
from dilocox.sync.base import RoundStats
from dilocox.sync.config import SyncConfig
from dilocox.sync.outer_optimizer import outer_optimizer_factory, outer_state_bytes
from dilocox.sync.reducers import PendingMean, Reducer

RESUMED = "resumed"
"""The phase of a cluster resumed from disk until its first boundary: the boundary of its checkpoint was settled
before the checkpoint was written, so a cluster that heals from it joins after that boundary, not at it."""

HEAL_STATE_SLACK = 16 << 20
"""Bytes a heal state may hold beyond phi and the outer optimizer's state: counters, the guard's history, pickling."""

SETTLE_ATTEMPTS = 3
"""Quorums an elastic round may take to settle its sync when clusters keep failing during the settling itself."""


def heal_state_bound(cfg: SyncConfig, numel: int) -> int:
    """The most bytes a live peer's `heal_state` may take for a stage of `numel` values under `cfg`'s outer optimizer:
    phi (fp32), that optimizer's state at full size (`outer_state_bytes`) and `HEAL_STATE_SLACK`; a joining
    cluster refuses a larger one before loading it."""
    return 4 * numel + outer_state_bytes(outer_optimizer_factory(cfg), numel) + HEAL_STATE_SLACK


class FragmentState(Protocol):
    """What `ElasticRounds` uses of a fragment whose syncs it settles (`dilocox.sync.fragment.FragmentState`)."""

    outer_params: torch.Tensor
    pending: PendingMean | None
    pending_quorum: int
    reducer: Reducer

    def wait_sync(
        self,
        pending: PendingMean,
        *,
        round_steps: int | None,
        round_index: int | None,
        judge_link: bool,
        judge_mean: bool = True,
        blocked_from: float | None = None,
    ) -> tuple[torch.Tensor, RoundStats]: ...

    def relaunch(self, flight: tuple[torch.Tensor, bool]) -> None: ...

    def send_again(self, due: PendingMean | None, reducer: Reducer) -> PendingMean: ...

    def guard_snapshot(self) -> dict[str, Any]: ...

    def restore_guard(self, snapshot: dict[str, Any]) -> None: ...

    def agreed_state(self) -> dict[str, Any]: ...

    def load_agreed_state(self, state: dict[str, Any]) -> None: ...


class ElasticStage(Protocol):
    """What `ElasticRounds` uses of the stage whose boundaries it settles (`DiLoCoSync`): its fragments, phi of the
    whole stage (whose digest every member compares), the link and the messages for the user."""

    fragments: list[FragmentState]
    channel: WanChannel
    warnings: list[str]

    @property
    def outer_params(self) -> torch.Tensor: ...


def _forget_traceback(error: BaseException | None) -> None:
    """Drop the frames an exception keeps alive (a failed collective's frames hold its process group)."""
    while error is not None:
        error.__traceback__ = None
        error = error.__cause__ or error.__context__


class ElasticRounds:
    """The boundaries of an elastic run, for one round (`DiLoCoSync`, docs/design.md §10.1).

    At each boundary: one quorum (`ElasticMembership.start_round`), the sync in flight settled over it (applied as it
    arrived when nothing changed, sent again among the live clusters otherwise), this round's sync launched over
    it, a commit. A cluster that healed at the boundary (it joined late or restarted) abstains from the round it did
    not train (`open_boundary` says so). A member whose collective fails during the settling reports it and tries a
    new quorum, up to `SETTLE_ATTEMPTS`; one that finds itself behind its peers stops, so that its launcher restarts
    it.
    """

    def __init__(self, sync: ElasticStage, membership: ElasticMembership) -> None:
        self.sync = sync
        self.membership = membership
        membership.serve_heals(self.heal_state, self.load_heal_state)  # what torchft sends and takes in a heal
        self.joined_quorum: Quorum | None = None
        """A quorum already formed for the next settling (the one `rejoin` healed in)."""
        self.newcomer = False
        """This cluster healed at this boundary: it did not train the round that ends here, so it abstains from it."""
        self.healed_here = False
        """This cluster healed at the boundary being settled (reported to its peers: `MemberReport.healed`)."""
        self.others_hold: set[int] = set()
        """Healed: the fragments (by position) whose sync in flight the peers hold shares of, this cluster none."""
        self.boundary_step = 0
        """The inner step of the boundary being settled (sent to a cluster that heals there)."""
        self.phase = "round"
        """What the boundary being settled is: an outer round's end (round) or the end of training (flush)."""
        self.settling: Reducer | None = None
        """The reducer of the sync being settled when it is not its fragment's rounds' (the drain's)."""
        self.guard_snapshot: tuple[int, dict[str, Any]] | None = None
        """(fragment position, its guard's state) before the sync being settled was judged: a redo judges it again
        from there."""
        self.quorum: Quorum | None = None
        """The quorum of the boundary being settled (its group carries this round's sync)."""
        self.boundary_quorum: Quorum | None = None
        """The quorum this boundary met in so far: a blocking sync's launch meets first, a delayed sync's settling."""
        self.vote = ClusterVote(membership.cluster_group, cluster=membership.cluster)
        """The ranks of this cluster (pp x dp) take the same branch at every step of the settling."""
        self.resumed_flights: dict[int, tuple[torch.Tensor, bool]] = {}
        """Resumed from disk: the syncs in flight this cluster had sent, by fragment position in launch order (and
        whether to count their bytes again), sent again over the first quorum's group once it is in it (`rejoin`)."""
        watch = membership.stall_watch
        self.membership_log = MembershipLog(
            cluster=membership.cluster, heartbeat_timeout_s=2 * watch.poll_s if watch is not None else 0.0
        )
        self.events: list[ElasticEvent] = []
        """The membership changes this cluster saw (stalls, leaves, rejoins), each already printed by one cluster;
        the trainer of cluster 0 writes them to metrics.jsonl."""

    # ---------------------------------------------------------------------------------------------- boundaries
    def open_boundary(self, step: int | None) -> bool:
        """A boundary begins: the end of the round at `step`, or of training (None). Returns whether this cluster
        healed at it (it joined late or restarted): it did not train the round that ends here, so it abstains."""
        self.boundary_quorum = None
        self.healed_here = self.newcomer
        if step is None:
            self.phase, self.newcomer = "flush", False
            return False
        self.boundary_step, self.phase = step, "round"
        newcomer, self.newcomer = self.newcomer, False
        return newcomer

    def before_launch(self, fragment: FragmentState) -> None:
        """`fragment`'s sync is launched over this boundary's quorum (the one its settling met in, or a new one, to
        which the channel moves)."""
        if self.boundary_quorum is None:
            self.boundary_quorum = self._next_quorum()
        fragment.pending_quorum = self.boundary_quorum.quorum_id

    def settle(
        self,
        fragment: FragmentState,
        due: PendingMean | None,
        *,
        round_steps: int | None,
        round_index: int,
        judge_link: bool,
        reducer: Reducer | None = None,
    ) -> tuple[torch.Tensor, RoundStats] | None:
        """The average of `fragment`'s sync in flight (`due`, this cluster's share, None if it has none) that every
        cluster of this boundary's quorum agrees on, and what it cost; None when no cluster holds one
        (`delayed_update_verdict`). `judge_link` as `FragmentState.wait_sync`'s, for a wait that is not a redo.
        `reducer`: the one that launched `due`, if not the fragment's rounds' (the drain of the held-back residual,
        which the guard does not judge against the rounds' norms)."""
        position = self.sync.fragments.index(fragment)
        self.settling = reducer
        if due is not None:
            self.guard_snapshot = position, fragment.guard_snapshot()
        try:
            return self._settle_in_quorum(
                fragment,
                due,
                round_steps=round_steps,
                round_index=round_index,
                quorum=self.boundary_quorum,
                judge_link=judge_link,
            )
        finally:
            self.settling = None
            self.guard_snapshot = None
            self.others_hold.discard(position)
            self.boundary_quorum = self.quorum

    def commit(self) -> None:
        """The boundary is done: torchft's commit (the next quorum finds this cluster at its peers' step)."""
        self.membership.commit()

    @property
    def last_clusters(self) -> tuple[int, ...]:
        """The clusters of the last boundary settled (after the flush: those that ended the run together)."""
        return () if self.quorum is None else self.quorum.clusters

    def rejoin(self) -> tuple[int, str] | None:
        """Join the elastic run (the first quorum of this process). A cluster that joins a run in progress heals
        from a live peer and returns (the boundary step, "round" or "flush"); its caller sets its step there and
        ends that boundary with its peers (`end_round` or `flush`), abstaining from what it did not train."""
        quorum = self.membership.join()
        healed = quorum.healed
        if healed and self.phase != RESUMED:  # a run in progress: it heals at the boundary its peers are at
            self.joined_quorum, self.newcomer = quorum, True
            return self.boundary_step, self.phase
        if healed:
            # Its peers resumed from disk wait in `join` until every cluster is in their first quorum: one that
            # healed in a quorum of some of them (the others were slower to start than the Lighthouse's join
            # timeout) meets again with them until it is whole, instead of going on without the peers it healed from.
            quorum = self.membership.meet_every_cluster(quorum)
        self._bind(quorum)
        s = self.sync
        if healed:
            # Its peers resumed from disk after their checkpoint's boundary: it trains the next round with them and
            # abstains from the sync they send again now (it holds no share of it).
            self.membership.await_heals(quorum)
            self.membership.commit()
            self.resumed_flights = {}
            for position in sorted(self.others_hold):
                fragment = s.fragments[position]
                fragment.pending = fragment.reducer.abstain(fragment.outer_params)
                fragment.pending.abstained = True
                fragment.pending_quorum = quorum.quorum_id
            self.others_hold = set()
            return self.boundary_step, self.phase
        # every member that resumed sends its shares again, in the same order
        flights, self.resumed_flights = self.resumed_flights, {}
        for position, flight in flights.items():
            s.fragments[position].relaunch(flight)
            s.fragments[position].pending_quorum = quorum.quorum_id
        return None

    def resume(self, step: int, flights: dict[int, tuple[torch.Tensor, bool]]) -> None:
        """This cluster loaded a checkpoint of the boundary at `step` (`DiLoCoSync.load_state_dict`): its syncs in
        flight (by fragment position, in launch order: what it sent, and whether to count the bytes again) go out
        once it is in the first quorum, and a cluster that heals from it joins after that boundary (`RESUMED`)."""
        self.boundary_step, self.phase, self.resumed_flights = step, RESUMED, dict(flights)

    # ---------------------------------------------------------------------------------------------- quorum
    def _next_quorum(self) -> Quorum:
        """This boundary's quorum: the one the join healed in, or a new one; the channel moves to its group."""
        quorum, self.joined_quorum = self.joined_quorum, None
        if quorum is None:
            if self.phase == "flush":  # there is no later boundary for a restarted cluster to join at
                self.membership.wait_for_restarts()
            quorum = self.membership.start_round()
            if quorum.healed:  # only a cluster that joins heals; one behind its peers mid-run starts again
                raise RejoinRequired(
                    f"cluster {self.membership.cluster} fell behind its peers (it missed a commit) and was healed at "
                    f"step {self.boundary_step}: it stops so that its launcher restarts it, and it rejoins"
                )
        self._bind(quorum)
        self.quorum = quorum
        return quorum

    def _bind(self, quorum: Quorum) -> None:
        """The channel moves to the quorum's group: the merge rules' C is the clusters of this round."""
        self.sync.channel.rebind(quorum.group, identity=(quorum.quorum_id, *quorum.clusters), clusters=quorum.clusters)
        self._note_members(quorum.clusters)

    # ---------------------------------------------------------------------------------------------- settling
    def _settle_in_quorum(
        self,
        fragment: FragmentState,
        due: PendingMean | None,
        *,
        round_steps: int | None,
        round_index: int,
        quorum: Quorum | None,
        judge_link: bool,
    ) -> tuple[torch.Tensor, RoundStats] | None:
        """Every step that can go another way on another rank passes through `self.vote`, so that the ranks of this
        cluster (each settling its own stage and slice) fail, meet again, redo or apply together."""
        s = self.sync
        position = s.fragments.index(fragment)
        try:
            arrived = self._wait(fragment, due, round_steps=round_steps, round_index=round_index, judge_link=judge_link)
        except RejoinRequired:
            raise
        except RuntimeError as error:  # a peer died during it: that group is broken here, the settling needs a new one
            self._fail(error, round_index, quietly=True)
            arrived, quorum = None, None
        control = self.membership.control_timeout
        # at the end of training, how long a restart that got into no quorum yet is waited for (wait_for_restarts)
        deadline = time.monotonic() + self.membership.timeout.total_seconds()
        attempts = 0
        while attempts < SETTLE_ATTEMPTS:
            failure: BaseException | None = None
            if quorum is None:
                try:
                    quorum = self._next_quorum()
                except RejoinRequired:
                    raise
                except RuntimeError as error:  # torchft could not build its group (a member died as it formed)
                    failure = error
                if self.vote.any_failed(failure):
                    attempts += 1
                    self._fail(failure or self._failed_elsewhere("the round's quorum", round_index), round_index)
                    arrived, quorum = None, None
                    continue
            assert quorum is not None
            ok = arrived is not None and fragment.pending_quorum == quorum.quorum_id
            mine = MemberReport(
                holding=due is not None or position in self.others_hold,
                ok=ok,
                restart_missing=self.phase == "flush" and time.monotonic() < deadline and self._restart_missing(quorum),
                digest=outer_digest(s.outer_params),
                config=self.membership.config_fingerprint,
                healed=self.healed_here,
            )
            branch, diverged = Branch.FAILED, []
            try:
                reports = exchange_reports(mine, group=quorum.control, timeout=control)
            except RuntimeError as error:
                failure = error
            else:
                self._check_configs(quorum, reports, mine)
                self._note_heals(quorum, reports)
                diverged = diverged_members([report.digest for report in reports])
                branch = self._branch(reports, diverged, quorum)
            branch = self.vote.most_severe(branch)
            if branch is Branch.MEET_AGAIN:
                # A cluster died so close to the end that its restart was marked after this quorum formed, or the
                # restart asked to join just after it: meet again with it (not a failure, nothing was sent).
                quorum = None
                time.sleep(0.1)  # a restart that beats may take seconds to ask: no busy loop of quorums meanwhile
                continue
            if branch is Branch.REJOIN:
                raise RejoinRequired(
                    f"cluster {self.membership.cluster}'s outer params differ from those of its peers at step "
                    f"{self.boundary_step} (a cluster died while a settling was confirmed): it stops so that its "
                    "launcher restarts it, and it heals from a live peer"
                )
            if branch is Branch.FAILED:
                if failure is None and diverged:
                    clusters = [quorum.clusters[rank] for rank in diverged]
                    failure = RuntimeError(f"clusters {clusters} hold other outer params and leave the run")
                attempts += 1
                self._fail(failure or self._failed_elsewhere("the members' reports", round_index), round_index)
                arrived, quorum = None, None
                continue
            if branch is Branch.NOTHING:
                return None
            if branch is Branch.APPLY:
                return arrived
            try:
                return self._redo(fragment, due, quorum, round_steps=round_steps, round_index=round_index)
            except RejoinRequired:
                raise
            except RuntimeError as error:
                attempts += 1
                self._fail(error, round_index)
                arrived, quorum = None, None
        raise RuntimeError(f"round {round_index} could not be settled in {SETTLE_ATTEMPTS} quorums")

    def _branch(self, reports: list[MemberReport], diverged: list[int], quorum: Quorum) -> Branch:
        """This rank's way on from the members' reports: meet again with a restart that is missing; stop (this
        member's outer params are not the agreed ones) or settle without the members whose are not; otherwise the
        verdict on the sync in flight (`delayed_update_verdict`). Every rank of a position's group reads the same
        reports and so takes the same branch."""
        if any(report.restart_missing for report in reports):
            return Branch.MEET_AGAIN
        if diverged:
            return Branch.REJOIN if quorum.control.rank() in diverged else Branch.FAILED
        verdict = delayed_update_verdict(
            num_holding=sum(report.holding for report in reports),
            num_not_ok=sum(not report.ok for report in reports),
        )
        return VERDICT_BRANCH[verdict]

    def _failed_elsewhere(self, what: str, round_index: int) -> RuntimeError:
        """Why this rank leaves a quorum in which nothing failed on its own stage: another rank of its cluster saw
        `what` fail."""
        cluster = self.membership.cluster
        return RuntimeError(f"{what} of round {round_index} failed on another rank of cluster {cluster}")

    def _redo(
        self,
        fragment: FragmentState,
        due: PendingMean | None,
        quorum: Quorum,
        *,
        round_steps: int | None,
        round_index: int,
    ) -> tuple[torch.Tensor, RoundStats] | None:
        """Send this member's share of `fragment`'s sync in flight again over `quorum` (or abstain: it has none of its
        own), and return the average once every member has it."""
        if self.guard_snapshot is not None:
            fragment.restore_guard(self.guard_snapshot[1])
        fragment.pending_quorum = quorum.quorum_id
        due = fragment.send_again(due, self.settling if self.settling is not None else fragment.reducer)
        # sent again just now: waited for at once, with no compute to hide behind
        arrived = self._wait(fragment, due, round_steps=round_steps, round_index=round_index, judge_link=False)
        # Confirm before applying: an all-reduce completes nowhere unless every member took part, so a redo that
        # failed on one member (it never gets here) fails the confirmation on every member alike, and they all try
        # again. A member that dies inside the confirmation itself can leave one member applying and another trying
        # again: the next boundary's digests tell them apart (`_branch`).
        failure: RuntimeError | None = None
        try:
            confirm(group=quorum.control, timeout=self.membership.control_timeout)
        except RuntimeError as error:
            failure = error
        if self.vote.any_failed(failure):
            raise failure or self._failed_elsewhere("the confirmation of the redo", round_index)
        return arrived

    def _fail(self, error: BaseException, round_index: int, *, quietly: bool = False) -> None:
        """A collective of this boundary failed here: report it (the next quorum gets a new group) and let go of
        every reference to the broken group, so that its sockets close and a peer blocked on this member fails at
        once instead of at its timeout (gloo's abort does not close them; dropping the group does)."""
        if not quietly:
            self.sync.warnings.append(f"elastic: settling round {round_index} failed ({error}); trying a new quorum")
        _forget_traceback(error)
        self.membership.fail(error)
        self.quorum = self.joined_quorum = self.boundary_quorum = None
        self.sync.channel.release()
        gc.collect()  # frames and works that held the group may sit in reference cycles

    def _check_configs(self, quorum: Quorum, reports: list[MemberReport], mine: MemberReport) -> None:
        """Every member of a round runs the settings this cluster runs, or the run stops here (a user error: one
        line, exit 2 on every machine), before anything of this round is sent."""
        others = [quorum.clusters[rank] for rank, report in enumerate(reports) if report.config != mine.config]
        if others:
            described = exchange_settings(
                self.membership.shared_settings, group=quorum.control, timeout=self.membership.control_timeout
            )
            differences = describe_differences(described, noun="cluster", numbers=quorum.clusters)
            raise ElasticError(
                f"clusters {others} run other settings than cluster {self.membership.cluster}"
                + (f" ({differences})" if differences else "")
                + f": every machine must give the same values to {shared_settings()}, and hold the same key in "
                "network.auth_key_file"
            )

    def _restart_missing(self, quorum: Quorum) -> bool:
        return any(cluster not in quorum.clusters for cluster in self.membership.returning())

    def _wait(
        self,
        fragment: FragmentState,
        due: PendingMean | None,
        *,
        round_steps: int | None,
        round_index: int,
        judge_link: bool,
    ) -> tuple[torch.Tensor, RoundStats] | None:
        """`FragmentState.wait_sync` of `due`, or None when there is none. The slow-link transfer is waited for first
        and the cluster's ranks vote on it before the fast collectives that follow it (the slices' all-gather over the
        replicas, the guard's agreement over the stages): a failed transfer on any rank raises RuntimeError on every
        rank of the cluster, and RejoinRequired where every other member rejected a payload of this cluster (the
        channel's `PayloadsRejected`): it cannot average what the others do, so it stops and heals from a live peer
        while they go on without it."""
        if due is None:
            return None
        blocked_from = self.sync.channel.clock.now()
        branch, failure = Branch.GO_ON, None
        try:
            with self._watching_stalls():
                due.transfer.wait()
        except PayloadsRejected as error:
            branch, failure = Branch.REJOIN, error
        except RuntimeError as error:
            branch, failure = Branch.FAILED, error
        branch = self.vote.most_severe(branch)
        if branch is Branch.REJOIN:
            raise RejoinRequired(
                f"cluster {self.membership.cluster} is cut off: {failure or 'another rank of it was cut off'}; it "
                "stops so that its launcher restarts it and it heals from a live peer, while the others go on "
                "without it"
            ) from None
        if branch is Branch.FAILED:
            raise failure or self._failed_elsewhere("the transfer", round_index)
        return fragment.wait_sync(
            due,
            round_steps=round_steps,
            round_index=round_index,
            judge_link=judge_link,
            judge_mean=self.settling is None,
            blocked_from=blocked_from,
        )

    # ---------------------------------------------------------------------------------------------- stalls, events
    def _watching_stalls(self):
        """While this cluster waits on a transfer of the quorum it was launched in: a member silent at the Lighthouse
        for network.stall_timeout is named (one line, one record) and the wait fails, so that the live members settle
        the round without it (`dilocox.elastic.stall`)."""
        watch = self.membership.stall_watch
        quorum = self.quorum
        if watch is None or quorum is None:
            return contextlib.nullcontext()
        others = [cluster for cluster in quorum.clusters if cluster != self.membership.cluster]

        def on_stall(stalled: MemberStalled) -> None:
            events = self.membership_log.stalled(
                stalled.silent, quorum.clusters, step=self.boundary_step, stall_timeout_s=watch.stall_timeout_s
            )
            self._tell(events, self.membership_log.printer(quorum.clusters, set(stalled.silent)))
            self.sync.channel.abandon(stalled)

        return watch.watching(others, on_stall)

    def _note_members(self, clusters: tuple[int, ...]) -> None:
        """The clusters of a new quorum against the last one: who left, who is back (one line and record each)."""
        previous = self.membership_log.members
        watch = self.membership.stall_watch
        ages = {}
        if watch is not None and set(previous) - set(clusters):
            ages = watch.heartbeat_ages()
        events = self.membership_log.quorum(clusters, step=self.boundary_step, ages=ages)
        self._tell(events, self.membership_log.printer(tuple(c for c in previous if c in clusters), set()))

    def _note_heals(self, quorum: Quorum, reports: list[MemberReport]) -> None:
        """The members that healed at this boundary, each a `rejoined` line and record unless the quorum's change
        already said so (a restart back before any quorum went without it changes no quorum)."""
        healed = [quorum.clusters[rank] for rank, report in enumerate(reports) if report.healed]
        if healed:
            events = self.membership_log.healed(healed, step=self.boundary_step)
            self._tell(events, self.membership_log.printer(quorum.clusters, set(healed)))

    def _tell(self, events: list[ElasticEvent], printer: bool) -> None:
        """Record `events`; print them when this cluster is the one that speaks (`printer`), from its first rank."""
        if printer and self.membership.rank_in_cluster == 0:
            for event in events:
                print(event.line(), flush=True)
        self.events.extend(events)

    # ---------------------------------------------------------------------------------------------- state
    def heal_state(self) -> dict[str, Any]:
        """What a live peer sends a cluster that joins at this boundary (torchft's checkpoint transport): every
        fragment's agreed outer state and round counters (`FragmentState.agreed_state`) and guard; not the
        error-feedback residuals or codec warm starts, which are each cluster's own (the joiner starts them afresh),
        nor the syncs in flight (it abstains from them)."""
        s = self.sync
        snapshot = self.guard_snapshot
        guards = [
            snapshot[1] if snapshot is not None and snapshot[0] == k else fragment.guard_snapshot()
            for k, fragment in enumerate(s.fragments)
        ]
        holding = [
            k
            for k, fragment in enumerate(s.fragments)
            if fragment.pending is not None or (snapshot is not None and snapshot[0] == k) or k in self.resumed_flights
        ]
        return {
            "fragments": [fragment.agreed_state() for fragment in s.fragments],
            "guards": guards,
            "others_hold": holding,
            "boundary_step": self.boundary_step,
            "phase": self.phase,
        }

    def load_heal_state(self, state: dict[str, Any]) -> None:
        """Take a live peer's `heal_state` (called by torchft inside a quorum); the next settlings abstain."""
        for fragment, agreed, guard in zip(self.sync.fragments, state["fragments"], state["guards"], strict=True):
            fragment.load_agreed_state(agreed)
            fragment.restore_guard(guard)
        self.others_hold = {int(k) for k in state["others_hold"]}
        self.guard_snapshot = None
        self.boundary_step, self.phase = int(state["boundary_step"]), state["phase"]
