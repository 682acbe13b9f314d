"""Start this machine's clusters of an elastic run, each as its own group of processes (its own world, its store
served here), and start a cluster whose processes die again; it heals from a live peer (docs/design.md §10.1).

    code = launch_elastic(cfg)      # `dilocox train` with topology.elastic = true, on each machine

The launcher and the ranks of its clusters share a `ClusterBoard` (`status.py`): the launcher marks each start
(STARTING, RESTARTING), a cluster's ranks mark their way into the run (REJOINING, JOINED) or why they stop
(NO_LIVE_PEER), and every rank reads which restarts are still on their way (`ElasticMembership.restarts`). A rank's
user error travels through its cluster's store (`processes.report_user_error`).
"""

from __future__ import annotations

import datetime
import json
import logging
import multiprocessing.connection
import os
import signal
import socket
import sys
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from dilocox import forkserver
from dilocox.checkpoint import CheckpointNotWritten, elastic_resume_paths
from dilocox.config import Config, from_dict, to_dict
from dilocox.elastic.lighthouse import lighthouse_timeouts, lighthouse_url, start_lighthouse
from dilocox.launch.processes import (
    EXIT_INTERRUPTED,
    EXIT_USER_ERROR,
    STOP_GRACE_S,
    Stopped,
    enter_forked_rank,
    first_user_error,
    report_user_error,
    signals_stop_the_run,
    stop_processes,
)
from dilocox.launch.rundir import resume_hint
from dilocox.launch.status import ClusterBoard, ClusterStatus
from dilocox.net.listen import bind_string, serve_store

EXIT_NO_PEER = 5
"""A restarted cluster found no live cluster to heal from (the run ended without it); it is not restarted."""


def launch_elastic(cfg: Config, resume: Path | None = None) -> int:
    """Start this machine's clusters (`topology.local_clusters`, all of them by default), each as its own group of
    processes, with a torchft Lighthouse in this process unless network.lighthouse names one (several machines meet
    at one). A cluster whose processes die is started again, up to topology.max_cluster_restarts times, and heals
    from a live peer; the others go on meanwhile. This launcher ends when each of its clusters has finished or is
    lost; it exits 1 when none of them finished. `resume`: the checkpoint the run resumes from (`preflight`); each
    cluster first starts from its own checkpoint of that step, or heals from those that have one."""
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    launcher = ElasticLauncher(cfg, resume)
    forkserver.start(forkserver.ELASTIC_PRELOAD)  # the time a restart takes is the time its peers train without it
    try:
        with signals_stop_the_run():
            stopped_with = launcher.run()
    except (KeyboardInterrupt, Stopped) as exc:
        launcher.stop_all()
        what = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"stopped by {exc}"
        print(f"\ndilocox: {what}, every cluster stopped; {launcher.resume_hint()}", file=sys.stderr)
        return EXIT_INTERRUPTED if isinstance(exc, KeyboardInterrupt) else 128 + exc.signum
    finally:
        launcher.close()
    return stopped_with if stopped_with is not None else launcher.end()


@dataclass
class _Cluster:
    """One cluster this launcher runs: the processes and store of its current start (None between starts), and how
    many times it was started again."""

    index: int
    restarts: int = 0
    processes: Any = None  # torch.multiprocessing's ProcessContext
    store: dist.TCPStore | None = None

    def retire(self) -> None:
        """The start is over: its processes have exited; its store stops listening once nothing holds it."""
        self.processes = self.store = None


class ElasticLauncher:
    """This machine's clusters of one elastic run: starts them, starts a failed one again or gives up on it, and
    stops, once the run has ended, the ones it ended without.

        launcher = ElasticLauncher(cfg)   # a Lighthouse here unless network.lighthouse names one
        code = launcher.run()             # None once every cluster finished or is lost: launcher.end() says how
        launcher.close()
    """

    def __init__(self, cfg: Config, resume: Path | None = None) -> None:
        self.cfg = cfg
        self.topology = cfg.topology
        self.advertise_host = cfg.network.listen_host
        self.timeout = datetime.timedelta(seconds=cfg.network.timeout_s)
        self.clusters = {cluster: _Cluster(cluster) for cluster in self.topology.launched_clusters()}
        self.resume_paths = {} if resume is None else elastic_resume_paths(Path(cfg.run.out_dir), resume, self.clusters)
        """The checkpoint each cluster loads at its first start (a restart heals from a live peer instead)."""
        self.board = ClusterBoard(self.topology.num_clusters)
        self.running: dict[int, _Cluster] = {}
        self.finished: set[int] = set()
        self.lost: set[int] = set()
        self.last_round: tuple[int, ...] | None = None
        """The clusters that ended the run, from the record of the first cluster that finished."""
        self.stall_timeout_s = cfg.network.stall_timeout_s
        self._lighthouse_checked = 0.0
        self._lighthouse_silent_since: float | None = None
        self.lighthouse = None
        self.address = cfg.network.lighthouse
        if not self.address:
            self.lighthouse = start_lighthouse(
                bind=bind_string(self.advertise_host), **lighthouse_timeouts(cfg.network)
            )
            self.address = lighthouse_url(self.lighthouse, self.advertise_host)

    def run(self) -> int | None:
        """Start every cluster and follow them until each has finished or is lost. An exit code when the launcher
        had to stop them all first: a rank's user error, or a Lighthouse that no longer answers."""
        for cluster in self.clusters:
            self._start(cluster)
        while self.running:
            # woken by the first process that ends: a restart is marked at once, well before the Lighthouse leaves
            # the dead cluster out (2 x network.heartbeat), which the end of training relies on
            sentinels = [s for state in self.running.values() for s in state.processes.sentinels]
            multiprocessing.connection.wait(sentinels, timeout=1)
            for cluster in list(self.running):
                code = self._follow(cluster)
                if code is not None:
                    return code
            if self.finished:
                self._stop_stale()
            elif self._lighthouse_gone():
                return 1
        return None

    def _lighthouse_gone(self) -> bool:
        """A Lighthouse of another process (network.lighthouse) that has not answered for network.stall_timeout: every
        cluster of this machine is stopped with the command that resumes the run. Its clusters would otherwise wait
        network.timeout in their next quorum (torchft retries the Lighthouse that long) before failing."""
        if self.lighthouse is not None or not self.stall_timeout_s:
            return False
        now = time.monotonic()
        if now - self._lighthouse_checked < 1.0:
            return False
        self._lighthouse_checked = now
        if _answers(self.address, timeout_s=1.0):
            self._lighthouse_silent_since = None
            return False
        if self._lighthouse_silent_since is None:
            self._lighthouse_silent_since = now
        silent = now - self._lighthouse_silent_since
        if silent < self.stall_timeout_s:
            return False
        self.stop_all()
        print(
            f"dilocox: error: the Lighthouse at {self.address} has not answered for {silent:.0f}s "
            f"(network.stall_timeout = {self.stall_timeout_s:g}s), so no cluster can go on; every cluster of this "
            f"machine is stopped; {self.resume_hint()}",
            file=sys.stderr,
        )
        return True

    def stop_all(self) -> None:
        for state in self.running.values():
            stop_processes(state.processes)
            state.retire()
        self.running.clear()

    def close(self) -> None:
        if self.lighthouse is not None:
            self.lighthouse.shutdown()

    def resume_hint(self) -> str:
        """How to go on from disk once the run has stopped: the same command on every machine (checkpoint.resume =
        auto takes each cluster's newest checkpoint), and the checkpoint it resumes from."""
        lighthouse = self.cfg.network.lighthouse
        where = f" on every machine of the run, once the Lighthouse at {lighthouse} runs" if lighthouse else ""
        return resume_hint(self.cfg, where=where)

    def end(self) -> int:
        """Say which clusters the run finished without; 0 when at least one of this machine's clusters finished."""
        if self.lost and not self.finished:
            print(f"dilocox: elastic: every cluster of this machine is lost; {self.resume_hint()}", file=sys.stderr)
        elif self.lost:
            print(f"dilocox: elastic: the run finished without clusters {sorted(self.lost)}", file=sys.stderr)
        if len(self.clusters) < self.topology.num_clusters and 0 not in self.clusters and self.finished:
            print(
                f"dilocox: elastic: clusters {sorted(self.finished)} of this machine finished; the run's metrics and "
                "summary are written by cluster 0's machine, each cluster's checkpoints by its own",
                flush=True,
            )
        return 0 if self.finished else 1

    def _start(self, cluster: int) -> None:
        """Start `cluster`'s processes with a fresh store: a restarted cluster must not meet its dead processes'
        keys. The store listens on advertise_host, where the clusters of other machines reach it (torchft's group
        of a round)."""
        state = self.clusters[cluster]
        # a restart is on the board before its processes exist: the live clusters' end of training waits for it
        self.board.set(cluster, ClusterStatus.RESTARTING if state.restarts else ClusterStatus.STARTING)
        state.store = serve_store(self.advertise_host, self.timeout)
        args = (cluster, to_dict(self.cfg), state.store.port, self.board, self.address, self.advertise_host)
        resume = "" if state.restarts else str(self.resume_paths.get(cluster, ""))
        state.processes = mp.start_processes(
            _elastic_rank_main,
            args=(*args, state.restarts > 0, resume, os.getpid(), dict(os.environ), os.getcwd()),
            nprocs=len(self.topology.build().ranks_of_cluster(cluster)),
            join=False,
            start_method="forkserver",
        )
        self.running[cluster] = state
        pids = " ".join(str(pid) for pid in state.processes.pids())
        print(f"dilocox: elastic: cluster {cluster} started (pid {pids}, start {state.restarts + 1})", flush=True)

    def _follow(self, cluster: int) -> int | None:
        """One look at a running cluster: it goes on, finished, or failed (`_failed`)."""
        state = self.running[cluster]
        try:
            done = state.processes.join(timeout=0, grace_period=STOP_GRACE_S)
        except ProcessException as exc:
            return self._failed(cluster, exc)
        if done:
            del self.running[cluster]
            state.retire()
            self.finished.add(cluster)
            self.last_round = self.last_round or _last_round_clusters(Path(self.cfg.run.out_dir), cluster)
        return None

    def _failed(self, cluster: int, exc: ProcessException) -> int | None:
        """A process of `cluster` failed. A rank's user error, or a Lighthouse that does not answer, stops the run;
        a restart that found no live peer is given up on; otherwise the cluster is started again, or given up on
        once it has used topology.max_cluster_restarts or the run has ended."""
        state = self.running.pop(cluster)
        stop_processes(state.processes)
        error = self._first_user_error(state)
        no_peer = self.board.get(cluster) is ClusterStatus.NO_LIVE_PEER
        message = self.board.message(state.store) if no_peer else ""
        state.retire()
        if error is not None:
            self.stop_all()
            print(f"dilocox: error: {error}", file=sys.stderr)
            return EXIT_USER_ERROR
        if no_peer:  # a restart that came after the run ended: nothing to start again
            self._give_up(cluster)
            print(f"dilocox: elastic: {message}; it is stopped", flush=True)
            return None
        if self.lighthouse is None and not _answers(self.address):
            # every cluster needs it at every boundary: a restart would only wait network.timeout
            self.stop_all()
            print(
                f"dilocox: error: the Lighthouse at {self.address} does not answer, so no cluster can go on (cluster "
                f"{cluster} failed first); every cluster of this machine is stopped; {self.resume_hint()}",
                file=sys.stderr,
            )
            return 1
        self._restart_or_give_up(cluster, _failure(exc))
        return None

    def _restart_or_give_up(self, cluster: int, why: str) -> None:
        limit = self.topology.max_cluster_restarts
        state = self.clusters[cluster]
        if state.restarts < limit and not self.finished:
            state.restarts += 1
            print(
                f"dilocox: elastic: cluster {cluster} failed ({why}); starting it again (restart {state.restarts} of "
                f"topology.max_cluster_restarts = {limit}), it heals from a live peer",
                flush=True,
            )
            self._start(cluster)
        else:
            self._give_up(cluster)
            print(
                f"dilocox: elastic: cluster {cluster} failed ({why}) and is not started again "
                f"(topology.max_cluster_restarts = {limit}); the others go on",
                flush=True,
            )

    def _stop_stale(self) -> None:
        """The run has ended: a restarted cluster that is not in it yet has no peer left to heal from (it would wait
        for one up to network.timeout), and one that was not in the last round (stopped or cut off while the others
        finished) would go on training alone. Both are stopped."""
        stale = [
            cluster
            for cluster in self.running
            if self.board.get(cluster) is not ClusterStatus.JOINED or not self._in_last_round(cluster)
        ]
        for cluster in stale:
            state = self.running.pop(cluster)
            stop_processes(state.processes)
            state.retire()
            joined = self.board.get(cluster) is ClusterStatus.JOINED
            self._give_up(cluster)
            why = (
                f"cluster {cluster} was not in the run's last round (stopped or cut off meanwhile)"
                if joined
                else f"the run ended before the restarted cluster {cluster} rejoined it"
            )
            print(f"dilocox: elastic: {why}; it is stopped", flush=True)

    def _in_last_round(self, cluster: int) -> bool:
        """Whether `cluster` ended the run with the first cluster that finished (True when that one wrote no record)."""
        return not self.last_round or cluster in self.last_round

    def _give_up(self, cluster: int) -> None:
        """`cluster` is not started again; its processes have exited. The other clusters stop waiting for it."""
        self.lost.add(cluster)
        self.board.set(cluster, ClusterStatus.LOST)

    def _first_user_error(self, failed: _Cluster) -> str | None:
        """The line of the lowest rank, of the failed cluster or of one still running, that stopped on a user
        error."""
        for state in sorted([failed, *self.running.values()], key=lambda state: state.index):
            error = first_user_error(state.store, self.topology.build().ranks_of_cluster(state.index))
            if error is not None:
                return error
        return None


def _failure(exc: ProcessException) -> str:
    """Why a cluster's process failed, in a few words: its exit code, or a Python error's last line."""
    if hasattr(exc, "exit_code"):
        return f"exit code {exc.exit_code}"
    detail = getattr(exc, "msg", "").strip().splitlines()
    return f"{exc.__class__.__name__}: {detail[-1]}" if detail else exc.__class__.__name__


def _last_round_clusters(run_dir: Path, cluster: int) -> tuple[int, ...] | None:
    """The clusters that ended the run with `cluster`, from its `elastic/cluster{c}.json` (None if it wrote none)."""
    try:
        return tuple(json.loads((run_dir / "elastic" / f"cluster{cluster}.json").read_text())["last_round_clusters"])
    except (OSError, ValueError, KeyError):
        return None


def _answers(url: str, timeout_s: float = 3.0) -> bool:
    """Whether something accepts TCP connections at the host and port of `url` (a Lighthouse that died does not)."""
    parts = urllib.parse.urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port or 80), timeout=timeout_s):
            return True
    except OSError:
        return False


def _elastic_rank_main(
    local_rank: int,
    cluster: int,
    cfg_dict: dict,
    port: int,
    board: ClusterBoard,
    lighthouse: str,
    advertise_host: str,
    restarted: bool,
    resume: str,
    launcher: int,
    env: dict,
    cwd: str,
) -> None:
    """One rank of one cluster of an elastic run: the cluster is its own world (its store in the launcher, which
    other machines reach at `advertise_host`)."""
    import faulthandler

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` prints where a cluster waits
    enter_forked_rank(launcher, env, cwd)
    cfg = from_dict(cfg_dict)
    cfg.network.lighthouse = lighthouse
    ranks_per_cluster = len(cfg.topology.build().ranks_of_cluster(cluster))
    timeout = datetime.timedelta(seconds=cfg.network.timeout_s)
    store = dist.TCPStore(advertise_host, port, ranks_per_cluster, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=local_rank, world_size=ranks_per_cluster, timeout=timeout)
    code = run_cluster_rank(
        cfg, cluster, local_rank, (advertise_host, port), restarted=restarted, resume=resume, board=board, store=store
    )
    if code == 0:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(code)  # torchft's threads (its manager server, the checkpoint server) must not hold the exit


def run_cluster_rank(
    cfg: Config,
    cluster: int,
    local_rank: int,
    cluster_store: tuple[str, int],
    *,
    restarted: bool,
    resume: str,
    board: ClusterBoard | None = None,
    store: dist.Store | None = None,
) -> int:
    """Train as rank `local_rank` of `cluster` of an elastic run, in a default group of that cluster's ranks, and
    return the exit code: 0, `EXIT_USER_ERROR` (a user error, or fewer clusters than sync.min_clusters), 1 (this
    machine could not write its checkpoint: the cluster is started again and heals from a live peer) or
    `EXIT_NO_PEER`. `cluster_store`: where the cluster's torchft Manager meets. Under this machine's launcher,
    `board` tells it how the cluster is doing and a user error is left in its `store`; under torchrun (neither)
    the rank prints its line, and torchrun starts the cluster's job again."""
    from dilocox.elastic.membership import NoLivePeer
    from dilocox.trainer import Trainer

    rank = cfg.topology.build().ranks_of_cluster(cluster).start + local_rank
    try:
        trainer = Trainer(cfg, rank=rank, run_dir=Path(cfg.run.out_dir), cluster_store=cluster_store)
        if resume:  # this cluster's own checkpoint: it presents that step, and clusters without one heal from it
            trainer.resume(Path(resume))
        if board is not None:
            if restarted:
                trainer.on_joining = lambda: board.set(cluster, ClusterStatus.REJOINING)
            trainer.on_joined = lambda: board.set(cluster, ClusterStatus.JOINED)
        if trainer.membership is not None:
            if board is not None:
                trainer.membership.restarts = board.restarts_in_progress
                trainer.membership.launched_here = cfg.topology.launched_clusters()
            trainer.membership.restarted = restarted
        try:
            trainer.train()
        finally:
            trainer.close()
    except CheckpointNotWritten as exc:  # this machine's disk, not the run's settings: the cluster alone fails
        if local_rank == 0:  # and is started again; it heals from a live peer and its next checkpoint tries again
            print(f"dilocox: elastic: cluster {cluster}: {exc}", flush=True)
        return 1
    except ValueError as exc:  # a user error, or fewer clusters than sync.min_clusters (ElasticError)
        if store is not None:
            report_user_error(store, rank, str(exc))
        else:
            print(f"dilocox: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except NoLivePeer as exc:  # a restart with nobody left to heal from: lost, not started again
        if board is not None:
            board.report(cluster, ClusterStatus.NO_LIVE_PEER, str(exc), store=store)
        else:
            print(f"dilocox: elastic: {exc}; it is stopped", file=sys.stderr, flush=True)
        return EXIT_NO_PEER
    return 0
