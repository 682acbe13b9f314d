"""Start the ranks of a run: all `C x D x P` of them on this machine, or this one rank under `torchrun`.

    dilocox train ...                          # spawns C x D x P local processes (gloo over loopback)
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-endpoint HOST:29400 -m dilocox train ...   # one rank each

Everything a user can get wrong (config, data files, tokenizer, run directory, checkpoint to resume) is checked
before any rank starts, so a mistake ends with one line and exit code 2 and leaves no half-made run directory.
A crashed rank stops all ranks; Ctrl+C stops them too, and the newest complete checkpoint stays usable. A rank
that stops sending heartbeats (SIGSTOP, a frozen host, a cut link) is named within `network.stall_timeout` and
every rank exits with `EXIT_STALLED` (`net/watchdog.py`); every process group waits at most `network.timeout`.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing.connection
import os
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from dilocox import forkserver
from dilocox.agreement import check_same_settings
from dilocox.checkpoint import check_auto_resume, check_resume, check_resume_model, find_checkpoint, list_checkpoints
from dilocox.config import Config, from_dict, to_dict, to_toml
from dilocox.data import TokenData
from dilocox.device import resolve_device
from dilocox.fileio import write_atomic
from dilocox.metrics import check_sinks
from dilocox.net.json_gather import all_gather_json
from dilocox.net.listen import LOOPBACK, bind_string, listening_socket, serve_store
from dilocox.net.watchdog import EXIT_STALLED, JobStore, run_was_stopped
from dilocox.parallel import check_split
from dilocox.runlock import LOCK_FILE, RunLock

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130
EXIT_ORPHANED = 3
"""A rank whose launcher died exits with this code (no orphan keeps training)."""
EXIT_NO_PEER = 5
"""Elastic: a restarted cluster found no live cluster to heal from (the run ended without it); it is not restarted."""
# EXIT_STALLED = 4, imported from net/watchdog.py, whose thread exits with it: a rank stopped sending heartbeats or
# the job's store stopped answering; every rank exits with it and the launcher says so in one line.
_MAX_ERROR_CHARS = 8000
"""A start-up error longer than this is cut before the ranks exchange it (a user error is one line)."""
_MAX_ERROR_BYTES = 12 * _MAX_ERROR_CHARS + 16
"""The most bytes a rank may declare for its error as JSON (a character outside the BMP takes 12: two \\uXXXX)."""


def resolve_resume(cfg: Config) -> Path | None:
    """The checkpoint to resume, verified (`checkpoint.resume`): `auto` takes the newest one of run.out_dir when
    there is one (so `torchrun --max-restarts` recovers) and starts fresh otherwise; "" never resumes."""
    resume = cfg.checkpoint.resume
    if not resume or (resume == "auto" and (cfg.run.overwrite or not list_checkpoints(Path(cfg.run.out_dir)))):
        return None
    if cfg.topology.elastic:
        raise ValueError(
            f"{cfg.run.out_dir} holds checkpoints, but an elastic run heals from live peers and does not resume from "
            "disk yet; start it in a new --run.out_dir or with --run.overwrite=true"
        )
    path = find_checkpoint(Path(cfg.run.out_dir), "latest" if resume == "auto" else resume)
    if resume == "auto":  # found, not asked for: it may belong to another run
        check_auto_resume(cfg, path)
    check_resume(cfg, path)
    return path


def prepare_run_dir(cfg: Config, data: TokenData, resume: Path | None) -> RunLock:
    """Take the run directory's lock, then create (or reopen, when resuming) it and write config.toml and
    tokenizer.json into it; returns the lock, which the caller releases when the run ends. Nothing in the directory is
    written, replaced or removed before the lock is held, so a second run refused by a live one leaves it as it was."""
    run_dir = Path(cfg.run.out_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"run.out_dir = {run_dir} is a file; choose a directory path")
    replace = resume is None and run_dir.is_dir() and any(p.name != LOCK_FILE for p in run_dir.iterdir())
    # auto and a run that died before its first checkpoint (a finished run always has one): start it again
    restart = replace and cfg.checkpoint.resume == "auto" and (run_dir / "config.toml").is_file()
    if replace and not (cfg.run.overwrite or restart):
        RunLock.ensure_free(run_dir)  # a live run's directory: say so rather than that it holds files
        raise ValueError(
            f"run.out_dir = {run_dir} already holds files; continue a run there with --checkpoint.resume=latest, "
            "replace it with --run.overwrite=true, or choose another --run.out_dir"
        )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = RunLock.acquire(run_dir)
    except OSError as exc:
        raise ValueError(
            f"run.out_dir = {run_dir} is not writable ({exc.strerror}); choose another --run.out_dir"
        ) from None
    try:
        if replace:
            if restart and not cfg.run.overwrite:
                print(f"dilocox: {run_dir} has no checkpoint: starting its run again (checkpoint.resume = auto)")
            for entry in run_dir.iterdir():
                if entry.name == LOCK_FILE:
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
        write_atomic(run_dir / "config.toml", to_toml(cfg).encode())
        tokenizer = run_dir / "tokenizer.json"
        if Path(data.tokenizer_path).resolve() != tokenizer.resolve():
            write_atomic(tokenizer, Path(data.tokenizer_path).read_bytes())
    except BaseException as exc:
        lock.release()
        if isinstance(exc, OSError):
            raise ValueError(
                f"run.out_dir = {run_dir} is not writable ({exc.strerror}); choose another --run.out_dir"
            ) from None
        raise
    if resume is not None and cfg.checkpoint.resume == "auto":
        print(f"dilocox: resuming from {resume} (checkpoint.resume = auto; pass --checkpoint.resume= to refuse)")
    return lock


def preflight(cfg: Config, world_size: int | None = None) -> tuple[TokenData, Path | None]:
    """Every check that can fail on user input, before anything is written or any rank starts. `world_size` is
    torchrun's; without it this machine starts every rank (`check_local_ranks`)."""
    from dilocox.trainer import check_batches, data_warnings, model_shape, prepare_data

    if world_size is not None and cfg.topology.elastic:
        raise ValueError(
            "topology.elastic = true is started by `dilocox train` on each machine, not by torchrun (it starts that "
            "machine's clusters, topology.local_clusters, and starts dead ones again); under torchrun leave "
            "topology.elastic off"
        )
    cfg.validate(world_size)
    cores = os.cpu_count() or 1
    if cfg.run.num_threads > cores:  # torch cannot start that many (100,000 crashed every rank)
        raise ValueError(
            f"run.num_threads = {cfg.run.num_threads:,} is more than this machine's {cores} cores; use "
            f"--run.num_threads={cores} or less (ranks x threads <= cores is fastest)"
        )
    if world_size is None:
        check_local_ranks(cfg)
        if cfg.network.advertise_host:  # not an address of this machine: one line here, not a launcher's traceback
            listening_socket(cfg.network.advertise_host).close()
    check_sinks(tensorboard=cfg.metrics.tensorboard, wandb=cfg.metrics.wandb)  # a missing extra fails here
    resolve_device(cfg.run.device, local_rank=0)  # asking for a GPU where there is none fails here, not in a rank
    if world_size is None:  # under torchrun rank 0 checks it (the others would see rank 0's own lock)
        RunLock.ensure_free(Path(cfg.run.out_dir))  # a live run's directory: refused before its checkpoints are read
    resume = resolve_resume(cfg)
    data = prepare_data(cfg)
    args = model_shape(cfg, data.vocab_size)  # model.init_from: its config and weights' shapes too
    args.validate()
    if cfg.train.seq_len > args.max_seq_len:
        source = (
            f"max_position_embeddings of model.init_from = {cfg.model.init_from}"
            if cfg.model.init_from
            else f"model.flavor = {cfg.model.flavor}"
        )
        raise ValueError(
            f"train.seq_len = {cfg.train.seq_len} is beyond the model's context of {args.max_seq_len} positions "
            f"({source}); use --train.seq_len={args.max_seq_len} or less, or a model with a longer context"
        )
    check_split(args, cfg.topology.pp_degree)  # more stages than layers, or a tied embedding cut in two
    check_batches(cfg, data)  # every data shard holds a batch, the validation split one evaluation batch
    if resume is not None:  # another tokenizer or model shape than the checkpoint's: refused before any rank starts
        vocab = data.load_tokenizer().vocab_fingerprint()
        check_resume_model(resume, args, tokenizer_vocab=vocab, tokenizer_path=data.tokenizer_path)
    if os.environ.get("RANK", "0") == "0":  # once, not on every rank under torchrun
        for warning in data_warnings(cfg, data):
            print(warning, file=sys.stderr, flush=True)
    return data, resume


_RANK_START_BYTES = 200 << 20
"""Memory a local rank takes before it builds its model: the interpreter, torch and gloo (a debug-flavor rank
measured 340 MB resident, shared libraries included)."""


def _available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is no such file)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_local_ranks(cfg: Config) -> None:
    """Refuse a topology this machine cannot start as local processes: more than the user's process limit, or more
    ranks than the available memory holds at `_RANK_START_BYTES` each (before any model). torchrun spreads the
    ranks over machines and is not checked here."""
    import resource

    t, world = cfg.topology, cfg.world_size
    ranks = f"topology.num_clusters x dp_degree x pp_degree = {t.num_clusters} x {t.dp_degree} x {t.pp_degree}"
    fix = "use fewer clusters, replicas or stages, or start the ranks on several machines with torchrun"
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY and world > soft:
        raise ValueError(
            f"{ranks} = {world:,} local ranks, more than this user's {soft:,} processes (ulimit -u); {fix}"
        )
    available = _available_memory()
    if available is not None and world * _RANK_START_BYTES > available:
        raise ValueError(
            f"{ranks} = {world:,} local ranks would need about {world * _RANK_START_BYTES / 1e9:,.1f} GB just to start "
            f"({_RANK_START_BYTES >> 20} MB each before the model), but this machine has {available / 1e9:,.1f} GB "
            f"available; {fix}"
        )


# ------------------------------------------------------------------------------------------------ one rank
def run_rank(
    cfg: Config,
    rank: int,
    run_dir: Path,
    resume: Path | None,
    data: TokenData | None = None,
    *,
    job_store: JobStore | None = None,
) -> None:
    """Train as `rank` of an initialized default process group; `job_store` carries the heartbeat watchdog."""
    from dilocox.trainer import Trainer

    trainer = Trainer(cfg, rank=rank, run_dir=run_dir, data=data, job_store=job_store)
    try:
        if resume is not None:
            trainer.resume(resume)
        trainer.train()
    finally:
        trainer.close()


def _die_with(launcher: int) -> None:
    """Exit this rank as soon as its launcher dies (SIGKILL leaves the launcher no chance to stop us).

    The launcher is not this rank's parent (that is the fork server, which lives as long as its ranks do), so the
    rank watches the launcher itself: through a pidfd, readable when it exits, or by asking every half second where
    the system has no pidfd."""
    try:
        handle = os.pidfd_open(launcher)
    except (AttributeError, OSError):  # not Linux >= 5.3: poll
        handle = None

    def gone() -> bool:
        try:
            os.kill(launcher, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, someone else's: our launcher's pid was reused, so it is gone
            return True
        return False

    def watch() -> None:
        if handle is not None:
            select.select([handle], [], [])
        else:
            while not gone():
                time.sleep(0.5)
        os._exit(EXIT_ORPHANED)

    threading.Thread(target=watch, name="dilocox-launcher-watch", daemon=True).start()


def _enter_forked_rank(launcher: int, env: dict, cwd: str) -> None:
    """The start of every rank forked from the fork server: watch the launcher, take the launcher's environment and
    directory of now (not the fork server's from its start), put gloo on the loopback. Every group a rank builds
    itself joins ranks of this machine (a static run's world, an elastic cluster), whatever GLOO_SOCKET_IFNAME a
    user keeps for torchrun jobs; an elastic run's slow-link group binds its own address (`membership.py`)."""
    _die_with(launcher)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"


def _local_rank_main(
    rank: int,
    cfg_dict: dict,
    world_size: int,
    port: int,
    error_dir: str,
    resume: str,
    launcher: int,
    env: dict,
    cwd: str,
) -> None:
    # The launching terminal's Ctrl+C reaches every process; the launcher alone decides and stops the ranks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _enter_forked_rank(launcher, env, cwd)
    cfg = from_dict(cfg_dict)
    timeout = datetime.timedelta(seconds=cfg.network.timeout_s)
    store = dist.TCPStore(_LOCAL_HOST, port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    job_store = JobStore(store, f"the launcher's store at {_LOCAL_HOST}:{port}")
    try:
        check_same_settings(cfg, group=dist.group.WORLD)  # every rank reads the key file itself
        run_rank(cfg, rank, Path(cfg.run.out_dir), Path(resume) if resume else None, job_store=job_store)
    except Exception as exc:
        if run_was_stopped(job_store):  # a collective broken by the stall: the watchdog's line said it all
            os._exit(EXIT_STALLED)
        if not isinstance(exc, ValueError):
            raise
        Path(error_dir, f"rank{rank}").write_text(str(exc))
        sys.stdout.flush()
        os._exit(EXIT_USER_ERROR)  # peers blocked in collectives are stopped by the parent
    dist.destroy_process_group()


def launch_local(cfg: Config, data: TokenData, resume: Path | None) -> int:
    """Spawn the world on this machine and wait; returns the process exit code."""
    if cfg.topology.elastic:
        return launch_elastic(cfg)
    world_size = cfg.world_size
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # our own line says who was stopped
    # The job's store lives in this process, not in a rank: a stopped rank cannot take it down with it.
    timeout = datetime.timedelta(seconds=cfg.network.timeout_s)
    store = serve_store(_LOCAL_HOST, timeout)
    # Ranks are forked from a fork server that imports torch and dilocox once, instead of each rank importing them
    # again (about 2 s of CPU per rank). The server never touches CUDA or a process group, so a fork copies none.
    forkserver.start(forkserver.LOCAL_PRELOAD)  # unless `dilocox train` started it already (forkserver.start_early)
    with tempfile.TemporaryDirectory(prefix="dilocox-") as tmp:
        ctx = mp.start_processes(
            _local_rank_main,
            args=(
                to_dict(cfg),
                world_size,
                store.port,
                tmp,
                str(resume or ""),
                os.getpid(),
                dict(os.environ),
                os.getcwd(),
            ),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        try:
            with _signals_stop_the_run():
                # when a rank fails, the others get STOP_GRACE_S to exit by themselves, then SIGTERM, then after
                # as long again SIGKILL (a SIGSTOPped rank ignores SIGTERM until it is continued)
                while not ctx.join(timeout=0.5, grace_period=STOP_GRACE_S):
                    pass
        except (KeyboardInterrupt, _Stopped) as exc:
            _stop(ctx)
            hint = _resume_hint(cfg)
            what = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"stopped by {exc}"
            print(f"\ndilocox: {what}, all {world_size} ranks stopped{hint}", file=sys.stderr)
            return EXIT_INTERRUPTED if isinstance(exc, KeyboardInterrupt) else 128 + exc.signum
        except ProcessException as exc:
            _stop(ctx)
            if run_was_stopped(JobStore(store)):
                hint = _resume_hint(cfg)
                print(
                    f"dilocox: a rank stopped sending heartbeats (named above): all {world_size} ranks stopped, exit "
                    f"{EXIT_STALLED}{hint}",
                    file=sys.stderr,
                )
                return EXIT_STALLED
            errors = sorted(Path(tmp).glob("rank*"))
            if errors:
                print(f"dilocox: error: {errors[0].read_text()}", file=sys.stderr)
                return EXIT_USER_ERROR
            detail = getattr(exc, "msg", str(exc)).rstrip()
            print(
                f"{detail}\ndilocox: rank {exc.error_index} failed ({exc.__class__.__name__}); all ranks stopped",
                file=sys.stderr,
            )
            return 1
    return 0


def _resume_hint(cfg: Config) -> str:
    """How to go on after the run was stopped: '; resume from <newest checkpoint> ...', or '' without one."""
    newest = list_checkpoints(Path(cfg.run.out_dir))
    return f"; resume from {newest[-1]} with --checkpoint.resume=latest" if newest else ""


_LOCAL_HOST = LOOPBACK
STOP_GRACE_S = 2.0


# ------------------------------------------------------------------------------------------------ elastic
def lighthouse_timeouts(cfg: Config) -> dict[str, float]:
    """The Lighthouse's timeouts from `[network]`: a cluster silent for 2 x network.heartbeat is left out of the next
    round; the live ones wait up to network.stall_timeout (or network.timeout) for one that beats but does not come."""
    return {
        "heartbeat_timeout_s": 2 * cfg.network.heartbeat_s,
        "join_timeout_s": cfg.network.stall_timeout_s or cfg.network.timeout_s,
    }


def _elastic_rank_main(
    local_rank: int,
    cluster: int,
    cfg_dict: dict,
    port: int,
    error_dir: str,
    lighthouse: str,
    advertise_host: str,
    restarted: bool,
    launcher: int,
    env: dict,
    cwd: str,
) -> None:
    """One rank of one cluster of an elastic run: the cluster is its own world (its store in the launcher, which
    other machines reach at `advertise_host`)."""
    import faulthandler

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` prints where a cluster waits
    _enter_forked_rank(launcher, env, cwd)
    cfg = from_dict(cfg_dict)
    cfg.network.lighthouse = lighthouse
    t = cfg.topology
    ranks_per_cluster = t.dp_degree * t.pp_degree
    timeout = datetime.timedelta(seconds=cfg.network.timeout_s)
    store = dist.TCPStore(advertise_host, port, ranks_per_cluster, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=local_rank, world_size=ranks_per_cluster, timeout=timeout)
    rank = cluster * ranks_per_cluster + local_rank
    from dilocox.sync.membership import NoLivePeer
    from dilocox.trainer import Trainer

    try:
        trainer = Trainer(cfg, rank=rank, run_dir=Path(cfg.run.out_dir), cluster_store=(advertise_host, port))
        trainer.on_joining = lambda: Path(error_dir, f"ready{cluster}").touch()
        trainer.on_joined = lambda: Path(error_dir, f"joined{cluster}").touch()
        if trainer.membership is not None:
            trainer.membership.restarts = lambda: _restarts_in_progress(error_dir, cfg.topology.num_clusters)
            trainer.membership.restarted = restarted
        try:
            trainer.train()
        finally:
            trainer.close()
    except ValueError as exc:  # a user error, or fewer clusters than sync.min_clusters (ElasticError)
        Path(error_dir, f"rank{rank}").write_text(str(exc))
        sys.stdout.flush()
        os._exit(EXIT_USER_ERROR)
    except NoLivePeer as exc:  # a restart with nobody left to heal from: lost, not started again
        Path(error_dir, f"nopeer{cluster}").write_text(str(exc))
        sys.stdout.flush()
        os._exit(EXIT_NO_PEER)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # torchft's threads (its manager server, the checkpoint server) must not hold the exit


def _restarts_in_progress(error_dir: str, num_clusters: int) -> dict[int, bool]:
    """The clusters this launcher is starting again (`restarting{c}`) that have not joined the run yet (`joined{c}`),
    each with whether it has asked to join (`ready{c}`, just before it asks the Lighthouse for its first quorum)."""
    return {
        c: Path(error_dir, f"ready{c}").exists()
        for c in range(num_clusters)
        if Path(error_dir, f"restarting{c}").exists() and not Path(error_dir, f"joined{c}").exists()
    }


def _last_round_clusters(run_dir: Path, cluster: int) -> tuple[int, ...] | None:
    """The clusters that ended the run with `cluster`, from its `elastic/cluster{c}.json` (None if it wrote none)."""
    import json

    try:
        return tuple(json.loads((run_dir / "elastic" / f"cluster{cluster}.json").read_text())["last_round_clusters"])
    except (OSError, ValueError, KeyError):
        return None


def _answers(url: str, timeout_s: float = 3.0) -> bool:
    """Whether something accepts TCP connections at the host and port of `url` (a Lighthouse that died does not)."""
    import socket
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port or 80), timeout=timeout_s):
            return True
    except OSError:
        return False


def launch_elastic(cfg: Config) -> int:
    """Start this machine's clusters (`topology.local_clusters`, all of them by default), each as its own group of
    processes, with a torchft Lighthouse in this process unless network.lighthouse names one (several machines meet
    at one). A cluster whose processes die is started again, up to topology.max_cluster_restarts times, and heals
    from a live peer; the others go on meanwhile. This launcher ends when each of its clusters has finished or is
    lost; it exits 1 when none of them finished."""
    from dilocox.sync.membership import lighthouse_url, start_lighthouse

    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    t = cfg.topology
    clusters = t.launched_clusters()
    advertise_host = cfg.network.listen_host
    lighthouse = None
    address = cfg.network.lighthouse
    if not address:
        lighthouse = start_lighthouse(bind=bind_string(advertise_host), **lighthouse_timeouts(cfg))
        address = lighthouse_url(lighthouse, advertise_host)
    timeout = datetime.timedelta(seconds=cfg.network.timeout_s)
    restarts = dict.fromkeys(clusters, 0)
    running: dict[int, tuple[Any, dist.TCPStore]] = {}
    finished: set[int] = set()
    lost: set[int] = set()
    last_round: tuple[int, ...] | None = None  # the clusters that ended the run, from the first one that finished

    forkserver.start(forkserver.ELASTIC_PRELOAD)  # the time a restart takes is the time its peers train without it

    def start(cluster: int, tmp: str) -> None:
        Path(tmp, f"joined{cluster}").unlink(missing_ok=True)
        Path(tmp, f"ready{cluster}").unlink(missing_ok=True)
        if restarts[cluster]:  # the live clusters' end of training waits for it (ElasticMembership.wait_for_restarts)
            Path(tmp, f"restarting{cluster}").touch()
        # a fresh store for every start: a restarted cluster must not meet its dead processes' keys. It listens on
        # advertise_host, where the clusters of other machines reach it (torchft's group of a round)
        store = serve_store(advertise_host, timeout)
        args = (cluster, to_dict(cfg), store.port, tmp, address, advertise_host, restarts[cluster] > 0)
        ctx = mp.start_processes(
            _elastic_rank_main,
            args=(*args, os.getpid(), dict(os.environ), os.getcwd()),
            nprocs=t.dp_degree * t.pp_degree,
            join=False,
            start_method="forkserver",
        )
        running[cluster] = (ctx, store)
        pids = " ".join(str(pid) for pid in ctx.pids())
        print(f"dilocox: elastic: cluster {cluster} started (pid {pids}, start {restarts[cluster] + 1})", flush=True)

    def stop_all() -> None:
        for ctx, _ in running.values():
            _stop(ctx)
        running.clear()

    try:
        with tempfile.TemporaryDirectory(prefix="dilocox-") as tmp, _signals_stop_the_run():
            for cluster in clusters:
                start(cluster, tmp)
            while running:
                # woken by the first process that ends: a restart is marked at once, well before the Lighthouse
                # leaves the dead cluster out (2 x network.heartbeat), which the end of training relies on
                multiprocessing.connection.wait([s for ctx, _ in running.values() for s in ctx.sentinels], timeout=1)
                for cluster in list(running):
                    ctx, _ = running[cluster]
                    try:
                        done = ctx.join(timeout=0, grace_period=STOP_GRACE_S)
                    except ProcessException as exc:
                        _stop(ctx)
                        del running[cluster]
                        errors = sorted(Path(tmp).glob("rank*"))
                        if errors:
                            stop_all()
                            print(f"dilocox: error: {errors[0].read_text()}", file=sys.stderr)
                            return EXIT_USER_ERROR
                        no_peer = Path(tmp, f"nopeer{cluster}")
                        if no_peer.exists():  # a restart that came after the run ended: nothing to start again
                            lost.add(cluster)
                            Path(tmp, f"restarting{cluster}").unlink(missing_ok=True)
                            print(f"dilocox: elastic: {no_peer.read_text()}; it is stopped", flush=True)
                            no_peer.unlink()
                            continue
                        if lighthouse is None and not _answers(address):
                            # every cluster needs it at every boundary: a restart would only wait network.timeout
                            stop_all()
                            print(
                                f"dilocox: error: the Lighthouse at {address} does not answer, so no cluster can go "
                                f"on (cluster {cluster} failed first); every cluster of this machine is stopped. An "
                                "elastic run does not resume from disk yet: start it again once the Lighthouse runs",
                                file=sys.stderr,
                            )
                            return 1
                        why = f"exit code {exc.exit_code}" if hasattr(exc, "exit_code") else exc.__class__.__name__
                        detail = getattr(exc, "msg", "").strip().splitlines()
                        if detail and not hasattr(exc, "exit_code"):  # a Python error: its last line says what
                            why = f"{why}: {detail[-1]}"
                        if restarts[cluster] < t.max_cluster_restarts and not finished:
                            restarts[cluster] += 1
                            print(
                                f"dilocox: elastic: cluster {cluster} failed ({why}); starting it again (restart "
                                f"{restarts[cluster]} of topology.max_cluster_restarts = {t.max_cluster_restarts}), "
                                "it heals from a live peer",
                                flush=True,
                            )
                            start(cluster, tmp)
                        else:
                            lost.add(cluster)
                            Path(tmp, f"restarting{cluster}").unlink(missing_ok=True)
                            print(
                                f"dilocox: elastic: cluster {cluster} failed ({why}) and is not started again "
                                f"(topology.max_cluster_restarts = {t.max_cluster_restarts}); the others go on",
                                flush=True,
                            )
                        continue
                    if done:
                        del running[cluster]
                        finished.add(cluster)
                        last_round = last_round or _last_round_clusters(Path(cfg.run.out_dir), cluster)
                if finished:
                    # The run has ended: a restarted cluster that is not in it yet has no peer left to heal from
                    # (it would wait for one up to network.timeout), and one that was not in the last round (stopped
                    # or cut off while the others finished) would go on training alone.
                    stale = [c for c in running if not Path(tmp, f"joined{c}").exists() or c not in (last_round or [c])]
                    for cluster in stale:
                        _stop(running.pop(cluster)[0])
                        lost.add(cluster)
                        Path(tmp, f"restarting{cluster}").unlink(missing_ok=True)
                        why = (
                            f"the run ended before the restarted cluster {cluster} rejoined it"
                            if not Path(tmp, f"joined{cluster}").exists()
                            else f"cluster {cluster} was not in the run's last round (stopped or cut off meanwhile)"
                        )
                        print(f"dilocox: elastic: {why}; it is stopped", flush=True)
    except (KeyboardInterrupt, _Stopped) as exc:
        stop_all()
        what = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"stopped by {exc}"
        print(f"\ndilocox: {what}, every cluster stopped", file=sys.stderr)
        return EXIT_INTERRUPTED if isinstance(exc, KeyboardInterrupt) else 128 + exc.signum
    finally:
        if lighthouse is not None:
            lighthouse.shutdown()
    if lost:
        print(f"dilocox: elastic: the run finished without clusters {sorted(lost)}", file=sys.stderr)
    if len(clusters) < t.num_clusters and 0 not in clusters and finished:
        print(
            f"dilocox: elastic: clusters {sorted(finished)} of this machine finished; the run's metrics, summary and "
            "checkpoints are written by cluster 0's machine",
            flush=True,
        )
    return 0 if finished else 1


class _Stopped(Exception):
    """The launcher got SIGTERM or SIGHUP: it stops its ranks, like Ctrl+C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _signals_stop_the_run() -> Iterator[None]:
    def handler(signum: int, frame: object) -> None:
        raise _Stopped(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _stop(ctx) -> None:
    for process in ctx.processes:
        if process.is_alive():
            process.terminate()
    for process in ctx.processes:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()


# ------------------------------------------------------------------------------------------------ torchrun
def launch_torchrun(cfg: Config) -> int:
    """Run as the rank torchrun assigned; rank 0 sets up the run directory and tells the others if it failed."""
    timeout = datetime.timedelta(seconds=cfg.network.timeout_s)
    # the rendezvous init_process_group would do itself, kept so the watchdog can use the same store
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    job_store = _torchrun_job_store(store)
    lock = None
    try:
        try:  # each node was started with its own command line: compare before anything is written
            check_same_settings(cfg, group=dist.group.WORLD, node=os.environ.get("GROUP_RANK"))
        except ValueError as exc:  # the same on every rank: each node says it once
            if os.environ.get("LOCAL_RANK", "0") == "0":
                print(f"dilocox: error: {exc}", file=sys.stderr)
            return EXIT_USER_ERROR
        error = None
        data = resume = None
        try:
            if rank == 0:
                RunLock.ensure_free(Path(cfg.run.out_dir))
            data, resume = preflight(cfg, world_size)
            if rank == 0:
                lock = prepare_run_dir(cfg, data, resume)
        except ValueError as exc:
            error = str(exc)
        if error is not None and len(error) > _MAX_ERROR_CHARS:
            error = error[:_MAX_ERROR_CHARS] + " ..."
        errors = all_gather_json(error, group=dist.group.WORLD, max_bytes=_MAX_ERROR_BYTES)
        first = next((e for e in errors if e), None)
        if first:
            if rank == 0:
                print(f"dilocox: error: {first}", file=sys.stderr)
            return EXIT_USER_ERROR
        run_rank(cfg, rank, Path(cfg.run.out_dir), resume, data, job_store=job_store)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except ValueError as exc:  # what the ranks decided together (diverged, payloads rejected): one line, as locally
        if run_was_stopped(job_store):
            os._exit(EXIT_STALLED)
        print(f"dilocox: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except Exception:
        if run_was_stopped(job_store):  # a collective broken by the stall: the watchdog's line said it all
            os._exit(EXIT_STALLED)
        traceback.print_exc()
        print(f"dilocox: rank {rank} failed; torchrun stops the other ranks", file=sys.stderr)
        return 1
    finally:
        if lock is not None:
            lock.release()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _torchrun_job_store(store: dist.Store) -> JobStore:
    """torchrun's store as the watchdog names it: served by its agent on the first node (c10d rendezvous) or by
    rank 0 itself (static rendezvous); a restart inside the job gets keys of its own."""
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    host = "torchrun's agent on the first node" if agent else "rank 0"
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return JobStore(store, f"the job's store at {where} (served by {host})", namespace=f"dilocox/watchdog/{restart}")
