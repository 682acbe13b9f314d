"""ElasticRounds, the settling of an elastic run's sync in flight (docs/design.md §10.1), between clusters that are
threads of this process: real gloo groups, one per quorum, and a stand-in for torchft's Lighthouse and Manager with
their rules (a quorum id changes with its members or after a commit failure; a member behind the others' step
heals from one that is not). No processes and no torchft, so each fault lands exactly where the test puts it.

Every cluster's round moves its parameters by a known `progress(cluster, round)`, so its pseudo-gradient is that
progress whatever the merge rule, and with plain averaging (outer lr 1, no momentum) the outer params after the
run are the start minus, round by round, the mean progress of the clusters whose update counted.
"""

from __future__ import annotations

import datetime
import gc
import threading
import weakref
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from dilocox import CompressionConfig, SyncConfig
from dilocox.elastic.membership import ElasticError, Quorum
from dilocox.elastic.vote import Branch, ClusterVote, RejoinRequired
from dilocox.net.auth import PayloadAuth
from dilocox.net.channel import PendingTransfer, WanChannel
from dilocox.sync import DiLoCoSync
from dilocox.sync.config import GuardConfig, OuterConfig

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]

NUMEL = 40
ROUNDS = 4
LONG = datetime.timedelta(seconds=300)  # a wait this long would fail the test by its timeout: nothing may wait it out
KEY = b"k" * 32  # network.auth_key_file's shared key


def progress(cluster: int, round_index: int) -> torch.Tensor:
    """What round `round_index` (1-based) of training moves cluster `cluster`'s parameters by: (NUMEL,)."""
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 * round_index + cluster)) / 8


def start_params() -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(7))


def sync_config() -> SyncConfig:
    """Every cluster's `[sync]`: the clusters' progress is independent noise, not one task's pseudo-gradients, so no
    peer check on it."""
    return SyncConfig(
        kind="dilocox",
        inner_steps=1,
        sync_delay=1,
        merge="eager",
        local_residual=False,
        drain_residual=False,
        outer=OuterConfig(lr=1.0, momentum=0.0),
        guard=GuardConfig(peers=False),
    )


def make_group(store: dist.Store, prefix: str, rank: int, size: int, timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A gloo group of `size` threads of this process (what torchft's reconfigurable group builds per quorum)."""
    prefixed = dist.PrefixStore(prefix, store)
    group = dist.ProcessGroup(prefixed, rank, size)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    backend = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
    backend._set_sequence_number_for_group()
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return group


class Lighthouse:
    """Forms a quorum once every cluster in `expected` has asked (clusters not expected that ask are taken too)."""

    def __init__(self, expected: set[int]) -> None:
        self.expected = set(expected)
        self.store = dist.HashStore()
        self._cond = threading.Condition()
        self._asking: dict[int, Member] = {}
        self._previous: tuple[int, ...] = ()
        self._results: dict[int, tuple] = {}
        self.quorum_id = 0
        self.formed: list[tuple[int, tuple[int, ...]]] = []
        """(quorum id, clusters) of every quorum formed, in order."""
        self.on_formed: Callable[[tuple[int, ...]], None] | None = None

    def set_expected(self, expected: set[int]) -> None:
        with self._cond:
            self.expected = set(expected)
            self._maybe_form()

    def ask(self, member: Member) -> tuple:
        with self._cond:
            generation = len(self.formed)
            self._asking[member.cluster] = member
            self._maybe_form()
            assert self._cond.wait_for(lambda: len(self.formed) > generation, timeout=60), "no quorum formed"
            return self._results.pop(id(member))

    def _maybe_form(self) -> None:
        if not self._asking or not self.expected <= set(self._asking):
            return
        members = sorted(self._asking.values(), key=lambda m: m.cluster)
        identity = tuple(id(m) for m in members)
        if identity != self._previous or any(m.commit_failures for m in members):
            self.quorum_id += 1
        self._previous = identity
        max_step = max(m.step for m in members)
        source = next(m for m in members if m.step == max_step)
        clusters = tuple(m.cluster for m in members)
        for m in members:
            heal = source.state_dict() if m.step < max_step else None
            self._results[id(m)] = (self.quorum_id, clusters, heal, max_step)
        self._asking = {}
        self.formed.append((self.quorum_id, clusters))
        self._cond.notify_all()
        if self.on_formed is not None:
            self.on_formed(clusters)


class Member:
    """The stand-in for `ElasticMembership`: what `ElasticRounds` calls, with torchft's step and heal rules."""

    def __init__(
        self,
        cluster: int,
        lighthouse: Lighthouse,
        *,
        control_timeout: datetime.timedelta = LONG,
        group_timeout: datetime.timedelta = LONG,
        cluster_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.cluster = cluster
        self.cluster_group = cluster_group
        self.rank_in_cluster = 0
        self.failures = 0
        self.group_timeout = group_timeout
        self.lighthouse = lighthouse
        self.timeout = LONG
        self.control_timeout = control_timeout
        self.step = 0
        self.commit_failures = 0
        self.heals = 0
        self.state_dict: Callable[[], dict] = dict
        self.load_state_dict: Callable[[dict], None] = lambda state: None

    def serve_heals(self, state_dict: Callable[[], dict], load_state_dict: Callable[[dict], None]) -> None:
        self.state_dict, self.load_state_dict = state_dict, load_state_dict
        self.restarts: Callable[[], dict[int, bool]] = dict
        self.config_fingerprint = 0
        self.shared_settings: dict = {"train.lr": 0.002}
        self.stall_watch = None
        self._group: dist.ProcessGroup | None = None
        self._control: dist.ProcessGroup | None = None
        self._group_id = -1

    def start_round(self, *, check: bool = True) -> Quorum:
        quorum_id, clusters, heal, max_step = self.lighthouse.ask(self)
        if quorum_id != self._group_id:
            rank = clusters.index(self.cluster)
            self._group = make_group(self.lighthouse.store, f"q{quorum_id}", rank, len(clusters), self.group_timeout)
            self._control = make_group(self.lighthouse.store, f"c{quorum_id}", rank, len(clusters), self.group_timeout)
            self._group_id = quorum_id
        if heal is not None:
            self.load_state_dict(heal)
            self.step, self.heals = max_step, self.heals + 1
        return Quorum(
            quorum_id=quorum_id, clusters=clusters, group=self._group, control=self._control, healed=heal is not None
        )

    def join(self) -> Quorum:
        quorum = self.start_round()
        if not quorum.healed:
            self.commit()
        return quorum

    def commit(self) -> None:
        self.step += 1
        self.commit_failures = 0

    def fail(self, error: Exception) -> None:
        self.failures += 1
        self.commit_failures += 1
        self._group, self._control, self._group_id = None, None, -1  # torchft's abort: its references go

    def restarts_in_progress(self) -> dict[int, bool]:
        return self.restarts()

    def returning(self) -> dict[int, bool]:  # no Lighthouse heartbeats here: the restarts the test marks
        return self.restarts()

    def wait_for_restarts(self) -> None:
        while not all(self.restarts().values()):
            threading.Event().wait(0.01)


class Cluster:
    """One cluster's outer loop: a DiLoCoSync over (NUMEL,) parameters, ending rounds as `Member` settles them."""

    def __init__(
        self,
        cluster: int,
        lighthouse: Lighthouse,
        *,
        compression: str = "fp16",
        reduction: str = "gather",
        key: bytes | None = None,
        **member,
    ) -> None:
        self.member = Member(cluster, lighthouse, **member)
        self.param = torch.nn.Parameter(start_params())
        cfg = sync_config()
        auth = None if key is None else PayloadAuth(key)
        channel = WanChannel(None, bandwidth=None, latency_s=0.0, auth=auth, stop_if_cut_off=False)  # as the trainer
        self.sync = DiLoCoSync(
            [self.param],
            cfg,
            CompressionConfig(kind=compression, reduction=reduction),
            channel=channel,
            dp_group=None,
            total_steps=ROUNDS,
            membership=self.member,
        )
        self.rounds = self.sync.elastic
        self.error: BaseException | None = None

    def train(self, first_round: int = 1, last_round: int = ROUNDS, *, flush: bool = True) -> None:
        """Rounds first_round..last_round (each moves theta by its progress, then ends the round), then the flush."""
        for round_index in range(first_round, last_round + 1):
            with torch.no_grad():
                self.param.sub_(progress(self.member.cluster, round_index))
            self.sync.after_inner_step(round_index)
        if flush:
            self.sync.flush()

    def rejoin_and_train(self) -> None:
        """A cluster that joins a run in progress: it heals, ends its peers' boundary abstaining, trains the rest."""
        joined = self.rounds.rejoin()
        assert joined is not None, "a late cluster heals from a peer"
        step, phase = joined
        with torch.no_grad():  # its own model starts from the healed outer params, like the trainer's
            self.param.copy_(self.sync.outer_params)
        if phase == "flush":
            self.sync.flush()
            return
        self.sync.after_inner_step(step)
        self.train(step + 1)

    def outer(self) -> torch.Tensor:
        return self.sync.outer_params.clone()

    def channel_bytes(self) -> int:
        return self.sync.channel.bytes_sent


def run_threads(*targets: Callable[[], None]) -> list[BaseException | None]:
    """Run each target in its own thread; their exceptions, in order (None: it returned)."""
    errors: list[BaseException | None] = [None] * len(targets)

    def wrap(index: int, target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as error:  # the test asserts on it
            errors[index] = error

    threads = [threading.Thread(target=wrap, args=(i, t), daemon=True) for i, t in enumerate(targets)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=100)
        assert not thread.is_alive(), "a cluster is still waiting"
    return errors


def expected_outer(counted: list[list[int]]) -> torch.Tensor:
    """phi after rounds 1..len(counted) under plain averaging: round r averages the progress of counted[r-1]."""
    phi = start_params()
    for round_index, clusters in enumerate(counted, start=1):
        phi = phi - torch.stack([progress(c, round_index) for c in clusters]).mean(0)
    return phi


def join_all(clusters: list[Cluster]) -> None:
    run_threads(*[lambda c=c: c.rounds.rejoin() for c in clusters])


def static_outer(compression: str, reduction: str = "gather") -> torch.Tensor:
    """The outer params of the same three clusters in a static run (one fixed group, no membership)."""
    store, outers = dist.HashStore(), [None] * 3

    def run(cluster: int) -> None:
        group = make_group(store, "static", cluster, 3, LONG)
        param = torch.nn.Parameter(start_params())
        cfg = sync_config()
        channel = WanChannel(None, bandwidth=None, latency_s=0.0)
        channel.rebind(group)  # the group is not in the default world (there is none here)
        sync = DiLoCoSync([param], cfg, CompressionConfig(kind=compression, reduction=reduction), channel=channel,
                          dp_group=None, total_steps=ROUNDS)  # fmt: skip
        for round_index in range(1, ROUNDS + 1):
            with torch.no_grad():
                param.sub_(progress(cluster, round_index))
            sync.after_inner_step(round_index)
        sync.flush()
        outers[cluster] = sync.outer_params.clone()
        channel.close()

    assert run_threads(*[lambda c=c: run(c) for c in range(3)]) == [None] * 3
    return outers[0]


# ------------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize(("compression", "reduction"), [("fp16", "gather"), ("none", "gather"), ("int4", "scalable")])
def test_without_faults_every_cluster_applies_every_average_as_a_static_run(compression, reduction):
    lighthouse = Lighthouse({0, 1, 2})
    clusters = [Cluster(c, lighthouse, compression=compression, reduction=reduction) for c in range(3)]
    join_all(clusters)
    assert run_threads(*[c.train for c in clusters]) == [None] * 3
    outers = [c.outer() for c in clusters]
    assert all(torch.equal(outers[0], o) for o in outers[1:])
    assert {quorum_id for quorum_id, _ in lighthouse.formed} == {1}  # one quorum all along: nothing sent twice
    assert [c.member.step for c in clusters] == [ROUNDS + 2] * 3  # the join, every round, the flush
    assert torch.equal(outers[0], static_outer(compression, reduction))


def test_clusters_with_other_settings_stop_at_their_first_boundary_before_sending_anything():
    lighthouse = Lighthouse({0, 1, 2})
    clusters = [Cluster(c, lighthouse, compression="none") for c in range(3)]
    clusters[2].member.config_fingerprint = 12345  # cluster 2's machine was started with another config
    clusters[2].member.shared_settings = {"train.lr": 0.001}
    join_all(clusters)
    errors = run_threads(*[c.train for c in clusters])
    assert all(isinstance(error, ElasticError) for error in errors), errors
    differences = "(train.lr: 0.002 on clusters 0-1, 0.001 on cluster 2)"
    assert str(errors[0]).startswith(f"clusters [2] run other settings than cluster 0 {differences}: every machine "
                                     "must give the same values to [model], [data]")  # fmt: skip
    assert str(errors[2]).startswith(f"clusters [0, 1] run other settings than cluster 2 {differences}")
    assert str(errors[0]).endswith("and hold the same key in network.auth_key_file")
    assert all(c.channel_bytes() == 0 for c in clusters)  # stopped before the first round's sync was launched
    assert all(torch.equal(c.outer(), start_params()) for c in clusters)


def test_authenticated_payloads_across_changing_quorums_give_the_static_run_bit_for_bit():
    lighthouse = Lighthouse({0, 1, 2})
    clusters = [Cluster(c, lighthouse, key=KEY) for c in range(3)]
    join_all(clusters)
    assert run_threads(*[c.train for c in clusters]) == [None] * 3
    assert all(torch.equal(c.outer(), static_outer("fp16")) for c in clusters)
    assert [c.sync.channel.payloads_rejected for c in clusters] == [0, 0, 0]


def test_a_cluster_with_another_key_is_rejected_left_out_and_the_others_average_their_own():
    lighthouse = Lighthouse({0, 1, 2})
    clusters = [Cluster(c, lighthouse, key=KEY if c < 2 else b"x" * 32) for c in range(3)]
    join_all(clusters)

    def forger() -> None:
        try:
            clusters[2].train()
        finally:  # its process ends: the Lighthouse stops waiting for it
            lighthouse.set_expected({0, 1})

    errors = run_threads(clusters[0].train, clusters[1].train, forger)
    assert errors[:2] == [None, None]
    # every other cluster rejected its payload (and it theirs): it cannot average what they do, so it stops to heal
    assert isinstance(errors[2], RejoinRequired), errors[2]
    assert str(errors[2]).startswith("cluster 2 is cut off: every other cluster rejected the slow-link payload of "
                                     "cluster 2 in exchange 0")  # fmt: skip
    assert all(c.sync.channel.payloads_rejected >= 1 for c in clusters)
    survivors = [clusters[0].outer(), clusters[1].outer()]
    assert torch.equal(survivors[0], survivors[1])
    # no round counted cluster 2's update (fp16 payloads: within their rounding)
    torch.testing.assert_close(survivors[0], expected_outer([[0, 1]] * ROUNDS), rtol=0, atol=1e-3)


@pytest.mark.parametrize(("compression", "reduction"), [("none", "gather"), ("fp16", "scalable")])
def test_a_cluster_gone_between_rounds_is_left_out_and_the_survivors_average_what_they_sent(compression, reduction):
    # scalable: the chunks of round 2 were cut for three clusters and are cut again for the two survivors
    lighthouse = Lighthouse({0, 1, 2})
    clusters = [Cluster(c, lighthouse, compression=compression, reduction=reduction) for c in range(3)]
    join_all(clusters)

    def victim() -> None:
        clusters[2].train(1, 2, flush=False)
        clusters[2].sync.fragments[0].pending.transfer.wait()  # its share of round 2 reached the others, then it dies
        lighthouse.set_expected({0, 1})

    assert run_threads(clusters[0].train, clusters[1].train, victim) == [None] * 3
    survivors = [clusters[0].outer(), clusters[1].outer()]
    assert torch.equal(survivors[0], survivors[1])
    # round 2's sync arrived whole, but over a quorum that has changed since: sent again among the survivors
    atol = 1e-5 if compression == "none" else 1e-3  # fp16 payloads: within their rounding
    torch.testing.assert_close(survivors[0], expected_outer([[0, 1, 2], [0, 1], [0, 1], [0, 1]]), rtol=0, atol=atol)


@pytest.mark.parametrize(
    ("key", "reduction"),
    [(None, "gather"), (KEY, "gather"), (None, "scalable")],
    ids=["plain", "authenticated", "scalable"],
)
def test_a_restarted_cluster_heals_from_a_peer_abstains_and_ends_bit_identical(key, reduction):
    # authenticated: fp16 payloads (summed ones carry no tag); the restart's channel numbers its exchanges from 0
    # while its peers' count on, so each new quorum's group must start its numbering afresh on every member.
    # scalable: fp16 chunks, the newcomer's counted as no sender (not as a zero update)
    compression = "none" if key is None and reduction == "gather" else "fp16"
    lighthouse = Lighthouse({0, 1, 2})
    clusters = [Cluster(c, lighthouse, compression=compression, reduction=reduction, key=key) for c in range(3)]
    join_all(clusters)
    restarted = Cluster(2, lighthouse, compression=compression, reduction=reduction, key=key)
    waits: list[bool] = []  # judge_link of every wait of the restarted cluster's outer loop
    wait_sync = restarted.sync.fragments[0].wait_sync
    restarted.sync.fragments[0].wait_sync = lambda *a, judge_link=True, **k: (
        waits.append(judge_link) or wait_sync(*a, judge_link=judge_link, **k)
    )

    def victim_then_restart() -> None:
        clusters[2].train(1, 1, flush=False)
        clusters[2].sync.fragments[0].pending.transfer.wait()
        survivors_met = threading.Event()  # cluster 2 died after round 1; its launcher starts it again
        lighthouse.on_formed = lambda members: members == (0, 1) and survivors_met.set()
        lighthouse.set_expected({0, 1})
        survivors_met.wait(60)
        lighthouse.on_formed = None
        lighthouse.set_expected({0, 1, 2})  # it asks to join at the survivors' next boundary (3)
        restarted.rejoin_and_train()

    assert run_threads(clusters[0].train, clusters[1].train, victim_then_restart) == [None] * 3
    outers = [clusters[0].outer(), clusters[1].outer(), restarted.outer()]
    assert torch.equal(outers[0], outers[1]) and torch.equal(outers[0], outers[2])
    assert restarted.member.heals == 1 and restarted.sync.guard_counts["healed_rounds"] == 0
    # round 1 sent again without cluster 2 (boundary 2), round 2 again with the newcomer abstaining (boundary 3),
    # round 3 without the newcomer's share (it did not train it), round 4 with it
    atol = 1e-5 if compression == "none" else 1e-3  # fp16 payloads: within their rounding
    torch.testing.assert_close(outers[0], expected_outer([[0, 1], [0, 1], [0, 1], [0, 1, 2]]), rtol=0, atol=atol)
    assert [c.sync.channel.payloads_rejected for c in [*clusters[:2], restarted]] == [0, 0, 0]
    # the restarted cluster's waits: the share sent again at boundary 3, the sync of round 3 at boundary 4, the
    # last one at the flush; only the one that had a round of compute to hide behind may judge the link
    assert waits == [False, True, False]


def test_a_cluster_that_dies_while_its_peers_settle_fails_them_at_once_and_they_settle_without_it():
    lighthouse = Lighthouse({0, 1, 2})
    clusters = [Cluster(c, lighthouse, compression="none") for c in range(3)]
    join_all(clusters)

    def victim() -> None:
        clusters[2].train(1, 2, flush=False)
        # in the quorum of boundary 3, then gone before the exchange: its group goes with it (its sockets close)
        lighthouse.on_formed = lambda members: lighthouse.set_expected({0, 1})
        clusters[2].rounds._next_quorum()
        lighthouse.on_formed = None
        clusters[2].rounds._fail(RuntimeError("killed"), 3, quietly=True)

    assert run_threads(clusters[0].train, clusters[1].train, victim) == [None] * 3
    survivors = [clusters[0].outer(), clusters[1].outer()]
    assert torch.equal(survivors[0], survivors[1])
    torch.testing.assert_close(survivors[0], expected_outer([[0, 1, 2], [0, 1], [0, 1], [0, 1]]), rtol=0, atol=1e-5)
    assert any("settling round 2 failed" in w for w in clusters[0].sync.warnings)


def test_a_member_whose_transfer_failed_keeps_no_reference_to_the_group():
    """What lets its sockets close: a peer blocked on this member then fails at once, not at its timeout."""
    lighthouse = Lighthouse({0, 1})
    a, b = Cluster(0, lighthouse), Cluster(1, lighthouse, group_timeout=datetime.timedelta(seconds=0.5))
    join_all([a, b])
    group = weakref.ref(b.member._group)
    b.rounds.quorum = Quorum(
        quorum_id=1, clusters=(0, 1), group=b.member._group, control=b.member._control, healed=False
    )
    transfer = b.sync.channel.launch_all_reduce(torch.zeros(3), op="sum", account=False)
    with pytest.raises(RuntimeError) as failed:  # a never takes part: b's transfer times out
        transfer.wait()
    b.rounds._fail(failed.value, 1)
    del failed
    gc.collect()
    assert group() is None
    with pytest.raises(RuntimeError, match="let go of its failed group"):
        b.sync.channel.launch_all_reduce(torch.zeros(3), op="sum")


def test_a_cluster_whose_outer_params_differ_from_its_peers_stops_to_heal_and_the_others_go_on():
    lighthouse = Lighthouse({0, 1, 2})
    clusters = [Cluster(c, lighthouse, compression="none") for c in range(3)]
    join_all(clusters)

    def diverged() -> None:
        clusters[2].train(1, 2, flush=False)
        # it applied another average than its peers (a member died inside a confirmation, docs/design.md §10.1)
        clusters[2].sync.outer_params.add_(1e-3)
        lighthouse.on_formed = lambda members: members == (0, 1, 2) and lighthouse.set_expected({0, 1})
        clusters[2].train(3, ROUNDS)

    errors = run_threads(clusters[0].train, clusters[1].train, diverged)
    assert errors[:2] == [None, None]
    assert isinstance(errors[2], RejoinRequired) and "outer params differ" in str(errors[2])
    survivors = [clusters[0].outer(), clusters[1].outer()]
    assert torch.equal(survivors[0], survivors[1])
    torch.testing.assert_close(survivors[0], expected_outer([[0, 1, 2], [0, 1], [0, 1], [0, 1]]), rtol=0, atol=1e-5)


def test_a_restart_that_asks_just_after_the_last_quorum_formed_is_met_in_a_new_one():
    lighthouse = Lighthouse({0, 1, 2})
    clusters = [Cluster(c, lighthouse, compression="none") for c in range(3)]
    join_all(clusters)
    restarted = Cluster(2, lighthouse, compression="none")
    joined = threading.Event()
    for c in clusters[:2]:  # the launcher marked the restart, which asked to join (ready) but is not in yet
        c.member.restarts = lambda: {} if joined.is_set() else {2: True}

    def victim_then_late_restart() -> None:
        clusters[2].train(1, ROUNDS, flush=False)
        clusters[2].sync.fragments[0].pending.transfer.wait()
        survivors_met = threading.Event()
        lighthouse.on_formed = lambda members: members == (0, 1) and survivors_met.set()
        lighthouse.set_expected({0, 1})
        survivors_met.wait(60)  # the survivors formed their last quorum without it: only now does it ask
        lighthouse.on_formed = None
        lighthouse.set_expected({0, 1, 2})
        assert restarted.rounds.rejoin() == (ROUNDS, "flush")
        joined.set()
        restarted.sync.flush()

    assert run_threads(clusters[0].train, clusters[1].train, victim_then_late_restart) == [None] * 3
    outers = [clusters[0].outer(), clusters[1].outer(), restarted.outer()]
    assert torch.equal(outers[0], outers[1]) and torch.equal(outers[0], outers[2])
    assert restarted.member.heals == 1
    torch.testing.assert_close(outers[0], expected_outer([[0, 1, 2]] * 3 + [[0, 1]]), rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------ clusters of several ranks
def cluster_groups(num_clusters: int, ranks: int, timeout: datetime.timedelta = LONG) -> list[list[dist.ProcessGroup]]:
    """Each cluster's own group of its `ranks` ranks (its world in an elastic run), built by threads at once; its
    collectives time out after `timeout` (the group itself forms within LONG, however loaded the machine)."""
    store, groups = dist.HashStore(), [[None] * ranks for _ in range(num_clusters)]

    def build(cluster: int, rank: int) -> None:
        group = make_group(store, f"cluster{cluster}", rank, ranks, LONG)
        group._get_backend(torch.device("cpu"))._set_default_timeout(timeout)
        groups[cluster][rank] = group

    assert run_threads(*[lambda c=c, r=r: build(c, r) for c in range(num_clusters) for r in range(ranks)]) == [None] * (
        num_clusters * ranks
    )
    return groups


def lose_launch(channel: WanChannel, number: int) -> None:
    """The `number`-th all-reduce launched on `channel` (1-based) is lost on the link: its wait raises."""
    launch, calls = channel.launch_all_reduce, []

    def launch_or_lose(tensor: torch.Tensor, **kwargs) -> PendingTransfer:
        calls.append(tensor)
        if len(calls) != number:
            return launch(tensor, **kwargs)
        lost = PendingTransfer("all_reduce", launch_time=channel.clock.now())
        lost._fail(ConnectionError("the stage's link dropped"))
        return lost

    channel.launch_all_reduce = launch_or_lose


def test_the_ranks_of_a_cluster_take_the_same_branch_when_one_stage_lost_its_share():
    # Clusters of two ranks (two pipeline stages): each stage settles its own share with the same stage of the other
    # clusters, and torchft meets every rank of a cluster at each quorum and commit. Stage 1's share of round 2 is
    # lost on every cluster while stage 0's arrives whole: stage 0 must not apply and commit while stage 1 asks for
    # a new quorum (its cluster's quorum would wait for stage 0 until network.timeout); both stages fail, meet in
    # the same new quorum and send their shares again.
    groups = cluster_groups(2, 2)
    lighthouses = [Lighthouse({0, 1}) for _ in range(2)]  # per stage: torchft's one decision, seen by each stage
    stages = [[Cluster(c, lighthouses[s], compression="none", cluster_group=groups[c][s]) for s in range(2)]
              for c in range(2)]  # fmt: skip
    for cluster in stages:
        lose_launch(cluster[1].sync.channel, 2)
    join_all([stage for cluster in stages for stage in cluster])
    assert run_threads(*[stage.train for cluster in stages for stage in cluster]) == [None] * 4
    assert lighthouses[0].formed == lighthouses[1].formed  # every rank of a cluster asked for the same quorums
    # the join, boundaries 1 and 2, then boundary 3 settled again in a new quorum, boundary 4 and the flush
    assert [quorum_id for quorum_id, _ in lighthouses[0].formed] == [1, 1, 1, 2, 2, 2]
    assert [[stage.member.failures for stage in cluster] for cluster in stages] == [[1, 1], [1, 1]]
    outers = [stage.outer() for cluster in stages for stage in cluster]
    assert all(torch.equal(outers[0], outer) for outer in outers[1:])
    # round 2 sent again by both stages over the new quorum: every round averages both clusters
    torch.testing.assert_close(outers[0], expected_outer([[0, 1]] * ROUNDS), rtol=0, atol=1e-5)


def test_a_cluster_vote_takes_the_most_severe_branch_and_a_rank_that_does_not_answer_stops_the_others():
    (groups,) = cluster_groups(1, 3)
    branches = [Branch.GO_ON, Branch.REDO, Branch.APPLY]
    votes: list[Branch | None] = [None] * 3

    def vote(rank: int) -> None:
        votes[rank] = ClusterVote(groups[rank], cluster=0).most_severe(branches[rank])

    assert run_threads(*[lambda r=r: vote(r) for r in range(3)]) == [None] * 3
    assert votes == [Branch.REDO] * 3
    assert ClusterVote(None, cluster=0).most_severe(Branch.FAILED) is Branch.FAILED  # one rank: no collective

    (silent,) = cluster_groups(1, 2, timeout=datetime.timedelta(seconds=0.5))
    with pytest.raises(RejoinRequired, match="a rank of cluster 4 did not answer its cluster's vote"):
        ClusterVote(silent[0], cluster=4).most_severe(Branch.GO_ON)  # rank 1 never votes
