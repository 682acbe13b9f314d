"""Elastic membership: which clusters take part in an outer round, from torchft's Lighthouse and Manager.

With `topology.elastic = true` every cluster is its own torch.distributed world and the slow `cluster_group` of
docs/design.md §2 becomes a group that torchft (pytorch/torchft) reconfigures at every round boundary: one quorum
per outer round, asked of a Lighthouse, holds the clusters that are alive; a cluster that fails or stalls is left
out of the next quorum, and a restarted one joins it and heals from a live peer through torchft's checkpoint
transport instead of from disk (docs/design.md §10.1).

    membership = ElasticMembership(cluster=1, num_clusters=3, min_clusters=2, lighthouse="http://host:29510", ...)
    quorum = membership.start_round()     # blocks until the live clusters meet at this boundary
    channel.rebind(quorum.group)          # the slow link of this round
    ...the round's collectives...; membership.commit()

What a round's clusters do with a sync launched in one quorum and resolved in the next is `dilocox.elastic.rounds`'s.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dilocox.elastic.lighthouse import PROBE_TIMEOUT_S, heartbeat_ages
from dilocox.elastic.stall import StallWatch
from dilocox.net.listen import bind_address, url_host


class ElasticError(ValueError):
    """The elastic run cannot go on (fewer clusters than `sync.min_clusters`): one line, a non-zero exit."""


SHARED_SECTIONS = ("model", "data", "train", "topology", "sync", "compression", "cocktail")
"""The config sections every cluster of an elastic run must share (with run.seed), on whichever machine it runs."""
MACHINE_LOCAL_SETTINGS = (
    "data.path",
    "data.tokenizer",
    "model.init_from",
    "topology.local_clusters",
    "topology.max_cluster_restarts",
)
"""The settings of SHARED_SECTIONS that may differ between machines (where files are, what this machine starts)."""


def shared_settings() -> str:
    """The settings every machine of an elastic run must give the same values, in words."""
    sections = ", ".join(f"[{name}]" for name in SHARED_SECTIONS)
    return f"{sections} and run.seed, except {', '.join(MACHINE_LOCAL_SETTINGS)}"


def returning_by_heartbeat(
    ages: Mapping[int, float], *, skip: Collection[int], beating_s: float, window_s: float
) -> dict[int, bool]:
    """The clusters a live one waits for at the end of training that no launcher of its machine starts again (a
    torchrun job's, or another machine's launcher's): each cluster of `ages` (seconds since its last Lighthouse
    heartbeat) outside `skip` that beat less than `window_s` ago (network.timeout: one that died shortly before the
    end may be on its way back), with whether it beats now (within `beating_s`, the Lighthouse's 2 x
    network.heartbeat: it is back and asks to join, or it is still in the run)."""
    return {cluster: age < beating_s for cluster, age in ages.items() if cluster not in skip and age < window_s}


class NoLivePeer(RuntimeError):
    """A restarted cluster found no other cluster alive to heal from: the run ended, or every other cluster is gone.
    Its launcher counts it as lost (one line), not as a user error."""


def _heal_transport(timeout: datetime.timedelta, host: str, max_bytes: int):
    """torchft's HTTP checkpoint transport, made fit for a network between machines: it listens on `host` only and
    advertises it (torchft listens on every interface and advertises `socket.gethostname()`, which other machines
    may not resolve), and it loads what a peer sends with `weights_only=True` and at most `max_bytes` (torchft
    unpickles it whole: a peer could run code in this process)."""
    import urllib.request

    from torch.distributed._serialization import _streaming_load
    from torchft.checkpointing.http_transport import HTTPTransport

    class HealTransport(HTTPTransport):
        def __init__(self, timeout: datetime.timedelta) -> None:
            with _torchft_servers_on(host):
                super().__init__(timeout=timeout, num_chunks=0)

        @classmethod
        def _load_from_address(cls, address: str, timeout: datetime.timedelta) -> object:
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as response:
                data = response.read(max_bytes + 1)
            if len(data) > max_bytes:
                raise ValueError(f"the heal state from {address} is larger than {max_bytes:,} bytes: refused")
            return _streaming_load(_WritableReader(data), weights_only=True)

        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            return f"http://{url_host(host)}:{port}/checkpoint/"

    return HealTransport(timeout)


@contextlib.contextmanager
def _torchft_servers_on(host: str) -> Iterator[None]:
    """While torchft builds a Manager or a checkpoint transport, its servers listen on `host` only.

    torchft 0.2 gives no argument for it: `Manager.__init__` binds its ManagerServer (gRPC, whose `Kill` call ends the
    process) to `[::]:port`, and `HTTPTransport.__init__` its checkpoint server (which serves the heal state, the
    model's outer params) to `("", 0)`, both every interface. Both look their server class up in their module when
    they build it, so the two names are swapped here for classes that keep torchft's port and bind `host`; nothing
    else of torchft changes. The process builds one Manager, on its main thread."""
    from torchft import manager
    from torchft.checkpointing import http_transport

    family, address = bind_address(host)
    manager_server = manager.ManagerServer
    http_server = http_transport._IPv6HTTPServer

    def bound_manager_server(*, bind: str, **kwargs: Any):
        return manager_server(bind=f"{url_host(address)}:{bind.rsplit(':', 1)[1]}", **kwargs)

    class BoundHTTPServer(http_server):
        address_family = family

        def __init__(self, server_address: tuple[str, int], handler: type) -> None:
            class QuietHandler(handler):  # a served heal is one line of the rank that healed, not one per request
                def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
                    pass

            super().__init__((address, server_address[1]), QuietHandler)

    manager.ManagerServer, http_transport._IPv6HTTPServer = bound_manager_server, BoundHTTPServer
    try:
        yield
    finally:
        manager.ManagerServer, http_transport._IPv6HTTPServer = manager_server, http_server


class _WritableReader(io.BytesIO):
    """Reads return bytearrays: torch builds the loaded tensors on the buffers read, and a tensor built on `bytes`
    would let an in-place update (the outer optimizer's momentum) write into an immutable object."""

    def read(self, size: int | None = -1) -> bytearray:  # type: ignore[override]
        return bytearray(super().read(size))


@dataclass(frozen=True)
class Quorum:
    """The clusters of one round, as torchft's Manager configured them."""

    quorum_id: int
    """torchft's quorum id: it changes exactly when the membership changes."""
    clusters: tuple[int, ...]
    """The member clusters, in group rank order."""
    group: dist.ProcessGroup
    """This round's slow-link group (gloo), one rank per member cluster: the payloads, on the channel's thread."""
    control: dist.ProcessGroup
    """The same members' group for the small agreements of a boundary (reports, confirmations), on the trainer's
    thread. gloo pairs the collectives of a group in the order each member calls them, so two threads calling on one
    group could pair a report with a payload still in flight (another fragment's) on one member and not another."""
    healed: bool
    """This cluster's state was just replaced by a live peer's (it joined late or restarted)."""

    @property
    def size(self) -> int:
        return len(self.clusters)


def _reconfigurable_gloo(timeout: datetime.timedelta, host: str, *, connect_timeout: datetime.timedelta | None = None):
    """torchft's reconfigurable gloo group, remembering the members of its last configuration; its gloo sockets are
    on `host` (torchft's group takes the interface of GLOO_SOCKET_IFNAME, or of this machine's hostname).

    Its collectives are bounded by `timeout` (network.timeout: a legitimate slow-link transfer may take long), but
    forming the group of a new quorum by `connect_timeout` (network.stall_timeout): every member builds it as soon as
    the quorum forms, so a member that does not connect in that time died or froze between the quorum and its group
    (a restart killed while it joins), and waiting network.timeout for it would hold every cluster of the round. The
    members then fail that quorum and ask for the next one without it. torchft gives one timeout for both."""
    from torchft import ProcessGroupGloo

    connect = connect_timeout or timeout

    class SlowLinkGroup(ProcessGroupGloo):
        members: tuple[int, ...] = ()
        quorum_id: int = -1

        control: dist.ProcessGroup | None = None
        """`Quorum.control`, built with the payloads' group of each quorum and dropped with it."""

        def _create_pg(self, store: dist.Store, rank: int, world_size: int) -> dist.ProcessGroup:
            self.control = self._gloo(dist.PrefixStore("control", store), rank, world_size)
            return self._gloo(store, rank, world_size)

        def abort(self, errored: bool = True) -> None:
            self.control = None  # its sockets close with the last reference, as the payloads' group's
            super().abort(errored)

        def shutdown(self) -> None:
            self.control = None
            super().shutdown()

        def _gloo(self, store: dist.Store, rank: int, world_size: int) -> dist.ProcessGroup:
            # torchft's ProcessGroupGloo._create_pg with the gloo device given: listening on `host`
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_address(host)[1])]
            options._timeout = connect  # the rendezvous of its members
            backend = dist.ProcessGroupGloo(store, rank, world_size, options)
            backend._set_default_timeout(timeout)  # its collectives
            backend._set_sequence_number_for_group()
            if self._global_ranks:
                backend.options.global_ranks_in_group = self._global_ranks
            if self._group_rank and self._group_world_size:
                backend.options.group_name = (
                    f"torchft_quorum_{self._quorum_id}_rank_{self._group_rank % self._group_world_size}"
                )
            pg = dist.ProcessGroup(store, rank, world_size)
            pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
            for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
                pg._register_backend(torch.device(device), dist.ProcessGroup.BackendType.GLOO, backend)
            return pg

        def configure(self, store_addr, replica_id, rank, world_size, quorum_id=None, group_rank=None,
                      group_world_size=None, global_ranks=None) -> None:  # fmt: skip
            self._timeout = connect  # torchft's store client of the rendezvous waits this long for a member's keys
            try:
                super().configure(
                    store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size, global_ranks
                )
            finally:
                self._timeout = timeout
            # torchft numbers a replica by the digits that end its id ("cluster7" -> 7) times the replica's size
            self.members = tuple(r // (group_world_size or 1) for r in (global_ranks or []))
            self.quorum_id = -1 if quorum_id is None else int(quorum_id)

    return SlowLinkGroup(timeout=timeout)


_NO_FLIGHT_RECORDER = "Unable to reset NCCL flight recorder"


class _NoFlightRecorderWarning(logging.Filter):
    """Drops torchft's "Unable to reset NCCL flight recorder recording so traces will be incorrect." and nothing
    else. torchft's Manager resets NCCL's flight recorder after every reconfiguration of its group and warns, on every
    cluster at every new quorum, when torch has no NCCL support (a CPU build). The group it reconfigures here is gloo
    (the slow link, `_reconfigurable_gloo`), which records no NCCL traces, so the warning never concerns this run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _NO_FLIGHT_RECORDER not in record.getMessage()


def quiet_torchft_logs() -> None:
    """torchft's loggers at WARNING (its Rust side is set by RUST_LOG), without the flight-recorder warning that does
    not apply to a gloo group; every other warning and error still shows."""
    for name in ("torchft", "torchft.manager", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.WARNING)
    manager_logger = logging.getLogger("torchft.manager")
    if not any(isinstance(f, _NoFlightRecorderWarning) for f in manager_logger.filters):
        manager_logger.addFilter(_NoFlightRecorderWarning())


class ElasticMembership:
    """One torchft `Manager` for this rank's position (dp, pp) in its cluster: replica id = the cluster.

    `state_dict` / `load_state_dict` are what a live peer sends a joining cluster (outer params, outer optimizer,
    round counter: `ElasticRounds.heal_state`); they are called by torchft during `start_round`. Left out, the
    `ElasticRounds` built over this membership serves them (`serve_heals`)."""

    def __init__(
        self,
        *,
        cluster: int,
        num_clusters: int,
        min_clusters: int,
        lighthouse: str,
        store_addr: str,
        store_port: int,
        host: str | None = None,
        rank_in_cluster: int,
        ranks_per_cluster: int,
        timeout: datetime.timedelta,
        quorum_timeout: datetime.timedelta,
        control_timeout: datetime.timedelta,
        heal_max_bytes: int,
        state_dict: Callable[[], Any] | None = None,
        load_state_dict: Callable[[Any], None] | None = None,
        config_fingerprint: int,
        shared_settings: dict[str, Any] | None = None,
        cluster_group: dist.ProcessGroup | None = None,
        stall_timeout_s: float = 0.0,
        heartbeat_s: float = 5.0,
    ) -> None:
        from torchft import Manager

        quiet_torchft_logs()
        self.cluster = cluster
        self.num_clusters = num_clusters
        self.min_clusters = min_clusters
        self.timeout = timeout
        self.control_timeout = control_timeout
        """Bound on the small all-reduces by which a round's members agree (`ElasticRounds._settle_in_quorum`): shorter
        than the Lighthouse's join timeout, so a member whose peer failed them gets its own error and asks for the
        next quorum before the Lighthouse would form it without this member."""
        self.rank_in_cluster = rank_in_cluster
        """This rank's place in its cluster (its torchft group rank): the first rank speaks for the cluster."""
        self.cluster_group = cluster_group
        """This cluster's own ranks (its world: pipeline stages x data-parallel replicas, on the fast link), over which
        they take the same branch at every step of a boundary (`ClusterVote`); None for a cluster of one rank."""
        self._healed = False
        self._state_dict = state_dict
        self._load_state_dict = load_state_dict
        connect = datetime.timedelta(seconds=stall_timeout_s) if stall_timeout_s else None
        host = host or store_addr  # this rank's address, which may be another machine's than its cluster's store
        self.group = _reconfigurable_gloo(timeout, host, connect_timeout=connect)
        heal_transport = _heal_transport(timeout, host, heal_max_bytes)
        with _torchft_servers_on(host):  # the address other machines reach this one at (or the loopback)
            self.manager = Manager(
                pg=self.group,
                load_state_dict=self._heal,
                state_dict=lambda: self._state_dict(),  # type: ignore[misc]
                min_replica_size=1,  # sync.min_clusters is checked here, with a message that names it
                use_async_quorum=False,  # the quorum, and a heal, complete at the round boundary
                timeout=timeout,
                quorum_timeout=quorum_timeout,
                connect_timeout=timeout,
                rank=rank_in_cluster,
                world_size=ranks_per_cluster,
                store_addr=store_addr,
                store_port=store_port,
                lighthouse_addr=lighthouse,
                replica_id=f"cluster{cluster}",
                hostname=url_host(host),  # where other machines reach it (network.advertise_host), in a URL
                init_sync=False,  # every cluster builds the same initial model from run.seed
                checkpoint_transport=heal_transport,
            )
        self.heals = 0
        """Times this cluster's state came from a live peer."""
        self.restarts: Callable[[], dict[int, bool]] | None = None
        """The clusters its launcher is starting again and that have not joined the run yet, each with whether it
        has asked to join (set by the launcher; None: nobody restarts clusters). The end of training waits for
        them (`wait_for_restarts`, `restarts_in_progress`)."""
        self.launched_here: Collection[int] = (cluster,)
        """This cluster and the others its machine's launcher starts (set by the launcher), whose restarts `restarts`
        reports; every other cluster's return is judged from its Lighthouse heartbeats (`returning`)."""
        self.heartbeat_s = heartbeat_s
        self.config_fingerprint = config_fingerprint
        """`agreement.settings_fingerprint` of `shared_settings`, compared at every boundary."""
        self.shared_settings = shared_settings or {}
        """`agreement.run_settings` of this cluster's run: what the members compare by name when fingerprints differ."""
        self.restarted = False
        """This process is a restart of its cluster (set by the launcher): it joins a run in progress, so a first
        quorum of itself alone means no other cluster is alive (`join`)."""
        self.stall_watch = StallWatch(
            ages=lambda: heartbeat_ages(lighthouse, timeout_s=min(PROBE_TIMEOUT_S, heartbeat_s)),
            stall_timeout_s=stall_timeout_s,
            poll_s=heartbeat_s,
        )
        """The Lighthouse's heartbeats of the clusters: a member silent for network.stall_timeout while this cluster
        waits on a transfer of its round is named and left out (`dilocox.elastic.stall`; 0: not watched)."""

    def serve_heals(self, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None]) -> None:
        """What a live peer sends a joining cluster, and how this cluster takes it (`ElasticRounds` calls it)."""
        self._state_dict, self._load_state_dict = state_dict, load_state_dict

    def _heal(self, state: Any) -> None:
        self._healed = True
        self.heals += 1
        self._load_state_dict(state)

    def join(self) -> Quorum:
        """The first quorum of this process. At the start of a run, and of a run resumed from disk, it waits until
        every cluster is there (so a run without faults has every cluster in every round); a cluster that joins a run
        in progress heals from a peer. It commits, so a later round's quorum finds this cluster at the step of its
        peers."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        start_step = self.manager.current_step()  # a resumed cluster's is its checkpoint's (`resume_progress`)
        while True:
            quorum = self.start_round(check=False)  # at the start, clusters still starting are not missing
            if self.restarted and not quorum.healed:
                self._check_live_peer(quorum)
            if quorum.healed or self.manager.current_step() > start_step or quorum.size == self.num_clusters:
                break
            if time.monotonic() > deadline:
                raise self._too_few_joined(quorum)
            time.sleep(0.1)
        self._check(quorum.clusters)
        if not quorum.healed:
            if start_step > 0:  # resumed from disk: the clusters behind it heal from its state in this quorum
                self.await_heals(quorum)
            self.commit()
        return quorum

    def meet_every_cluster(self, quorum: Quorum) -> Quorum:
        """Meet again until every cluster is in the quorum (as `join` does at the start of a run and of a resumed
        one), up to network.timeout; `quorum` when it holds every cluster already."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        while quorum.size < self.num_clusters:
            if time.monotonic() > deadline:
                raise self._too_few_joined(quorum)
            time.sleep(0.1)
            quorum = self.start_round(check=False)
        return quorum

    def _too_few_joined(self, quorum: Quorum) -> ElasticError:
        """Why a start (or resume) gave up waiting for every cluster: the ones that came, and what to do."""
        return ElasticError(
            f"only clusters {list(quorum.clusters)} of {self.num_clusters} joined within network.timeout = "
            f"{self.timeout.total_seconds():.0f}s; start every cluster, or raise network.timeout"
        )

    def _check_live_peer(self, quorum: Quorum) -> None:
        """A restart that did not heal in its quorum: refuse to go on when no member holds the run's state, rather than
        train the run again from step 0. Alone, this restart is the only live cluster (the Lighthouse never forms a
        quorum of half or less of the clusters that heartbeat: the others finished, or died and were not started
        again); in a round of every cluster, all of them restarts of this launcher, every cluster died (a round of
        some of them may form while a live cluster trains a long round: they wait for it). Its launcher gives up on
        it and, with no cluster left, prints the command that resumes the run from disk."""
        others = [cluster for cluster in quorum.clusters if cluster != self.cluster]
        restarts = self.restarts_in_progress()
        # every cluster died: the others of its round, or all the others, restarts too (the first restart to ask may
        # meet the Lighthouse alone, the others' heartbeats gone, whichever restart a loaded machine starts first)
        restarted = others if quorum.size == self.num_clusters else range(self.num_clusters)
        if all(cluster in restarts for cluster in restarted if cluster != self.cluster):
            named = [cluster for cluster in range(self.num_clusters) if cluster != self.cluster]
            raise NoLivePeer(
                f"cluster {self.cluster} was started again, and so were clusters {named}: no live cluster holds the "
                "run's state to heal from (every cluster died)"
            )
        if not others:
            raise NoLivePeer(
                f"cluster {self.cluster} was started again, but no other cluster is alive to heal from (the run "
                "ended, or every other cluster is gone)"
            )

    def await_heals(self, quorum: Quorum) -> None:
        """Return once every member of `quorum` has its state (one 1-element all-reduce over its group, bounded by
        network.timeout): torchft stops serving a cluster's state when it commits, so a cluster that members heal
        from in its first quorum commits only after they have read it."""
        confirm(group=quorum.control, timeout=self.timeout)

    def progress(self) -> dict[str, int]:
        """torchft's step (boundaries committed) and batches committed: what a checkpoint records of the membership."""
        return dict(self.manager.state_dict())

    def resume_progress(self, progress: dict[str, int]) -> None:
        """Before the first quorum of a cluster resumed from disk: present its checkpoint's step to torchft, so that a
        cluster that starts afresh (step 0) or from an older checkpoint is behind it and heals from it, and not the
        reverse."""
        step, batches = int(progress["step"]), int(progress["batches_committed"])
        self.manager.load_state_dict({"step": step, "batches_committed": batches})

    def restarts_in_progress(self) -> dict[int, bool]:
        """The clusters being started again that have not joined yet: {cluster: whether it asked to join}."""
        return {} if self.restarts is None else self.restarts()

    def returning(self) -> dict[int, bool]:
        """The clusters the end of training waits for, each with whether it is back (asked to join, or beats): this
        launcher's restarts in progress (`restarts_in_progress`), and every other cluster whose Lighthouse heartbeat
        stopped less than network.timeout ago (`returning_by_heartbeat`): its torchrun job, or its machine's
        launcher, may be starting it again, and nothing else tells this machine. A cluster still in the run beats
        and is back."""
        back = returning_by_heartbeat(
            self.stall_watch.heartbeat_ages(),
            skip=self.launched_here,
            beating_s=2 * self.heartbeat_s,
            window_s=self.timeout.total_seconds(),
        )
        return back | self.restarts_in_progress()

    def wait_for_restarts(self) -> None:
        """At the end of training, before the last quorum: wait, up to network.timeout, until every cluster that may
        come back (`returning`: started again by a launcher or torchrun) has asked to join, so that it heals in
        that quorum and every cluster ends with the same outer params. Mid-run a restarted cluster simply joins at
        the next boundary; at the end there is no next boundary, and whether it got in would depend on how long
        its start took. The condition only ever becomes true (a cluster that asked stays asked; one the launcher
        gives up on leaves the list, and so does one silent for network.timeout), so every live cluster leaves the
        wait for the same quorum; past the bound the run ends without it (its launcher stops it with one line, a
        torchrun job's restart finds no live peer). A restart that asks just after that quorum formed is met in a
        new one (`ElasticRounds`: every member reports a restart missing from its quorum)."""
        starting = [cluster for cluster, back in sorted(self.returning().items()) if not back]
        if not starting:
            return
        print(
            f"dilocox: elastic: cluster {self.cluster} waits for clusters {starting}, started again or silent for "
            f"less than network.timeout = {self.timeout.total_seconds():.0f}s, before the last sync",
            flush=True,
        )
        deadline = time.monotonic() + self.timeout.total_seconds()
        while starting := [cluster for cluster, back in sorted(self.returning().items()) if not back]:
            if time.monotonic() > deadline:
                print(
                    f"dilocox: elastic: clusters {starting} did not come back within network.timeout = "
                    f"{self.timeout.total_seconds():.0f}s; cluster {self.cluster} ends the run without them",
                    flush=True,
                )
                return
            time.sleep(0.1)

    def start_round(self, *, check: bool = True) -> Quorum:
        """Meet the live clusters at this round boundary (a late one heals here); refuse to go on below
        `min_clusters`."""
        self._healed = False
        self.manager.start_quorum()
        if self.manager.errored() is not None:
            raise RuntimeError(f"torchft could not form the round's quorum: {self.manager.errored()}")
        members = self.group.members
        if check:
            self._check(members)
        assert self.group.control is not None
        return Quorum(
            quorum_id=self.group.quorum_id,
            clusters=members,
            group=self.group.parent,
            control=self.group.control,
            healed=self._healed,
        )

    def _check(self, members: tuple[int, ...]) -> None:
        if len(members) < self.min_clusters:
            raise ElasticError(
                f"only {len(members)} of {self.num_clusters} clusters (clusters {list(members)}) are left in the "
                f"round, fewer than sync.min_clusters = {self.min_clusters}: the run stops"
            )

    def fail(self, error: Exception) -> None:
        """A collective of this round failed here: end the round without committing, so that the next quorum is new.

        The error is reported to torchft (without its traceback, which would keep the broken group alive) and the
        round is not committed: torchft counts a commit failure, the next quorum request carries it, and the
        Lighthouse gives that quorum a new id, so torchft builds a fresh group even when the members are the same
        (a gloo group that saw a failure or a timeout is not used again)."""
        self.manager.report_error(RuntimeError(str(error)))
        self.group.abort()  # drops torchft's reference to the broken group
        if self.manager.should_commit():  # false after report_error; this is what counts the commit failure
            raise AssertionError("torchft committed a round whose collective failed")

    def commit(self) -> None:
        """End the round in torchft's step count (a cluster behind its peers heals at the next quorum)."""
        if not self.manager.should_commit():
            raise RuntimeError(
                f"cluster {self.cluster} could not commit its round: {self.manager.errored() or 'peers disagreed'}"
            )

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def confirm(*, group: dist.ProcessGroup, timeout: datetime.timedelta) -> None:
    """Return only once every member of `group` got here (one 1-element all-reduce, bounded by `timeout`)."""
    if group.size() > 1:
        summed(torch.zeros(1), group=group, timeout=timeout)


def summed(tensor: torch.Tensor, *, group: dist.ProcessGroup, timeout: datetime.timedelta) -> torch.Tensor:
    """`tensor` summed in place over `group`, bounded by `timeout` (gloo honours a per-collective timeout given in the
    options): control traffic between the members of a round, neither counted nor delayed by the link model."""
    options = dist.AllreduceOptions()
    options.reduceOp, options.timeout = dist.ReduceOp.SUM, timeout
    group.allreduce([tensor], options).wait()
    return tensor
