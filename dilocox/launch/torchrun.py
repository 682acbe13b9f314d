"""Run as the one rank torchrun started: rank 0 checks the run and prepares its directory, and every rank learns
whether that failed before any of them trains (docs/guides/multi-node.md).

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-endpoint HOST:29400 -m dilocox train ...   # one rank each
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import traceback
from pathlib import Path

import torch.distributed as dist

from dilocox.agreement import check_same_settings
from dilocox.checkpoint import elastic_resume_paths
from dilocox.config import Config
from dilocox.launch.elastic import run_cluster_rank
from dilocox.launch.preflight import preflight
from dilocox.launch.processes import EXIT_INTERRUPTED, EXIT_USER_ERROR, run_rank
from dilocox.launch.rundir import prepare_run_dir
from dilocox.net.json_gather import all_gather_json
from dilocox.net.listen import serve_store
from dilocox.net.watchdog import EXIT_STALLED, JobStore, run_was_stopped
from dilocox.runlock import RunLock

_MAX_ERROR_CHARS = 8000
"""A start-up error longer than this is cut before the ranks exchange it (a user error is one line)."""
_MAX_ERROR_BYTES = 12 * _MAX_ERROR_CHARS + 16
"""The most bytes a rank may declare for its error as JSON (a character outside the BMP takes 12: two \\uXXXX)."""


def launch_torchrun(cfg: Config) -> int:
    """Run as the rank torchrun assigned; rank 0 sets up the run directory and tells the others if it failed."""
    timeout = datetime.timedelta(seconds=cfg.network.timeout_s)
    # the rendezvous init_process_group would do itself, kept so the watchdog can use the same store
    agent_store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    start, start_store = _start_number(agent_store, rank, timeout)  # rank 0 serves it while the job runs
    store = dist.PrefixStore(f"dilocox/start_{start}", agent_store)  # keys of this start of the job alone
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    job_store = _torchrun_job_store(store)
    restarted = start > 1
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
        # an elastic cluster's job started again by torchrun: its directory stays as the first start left it (it
        # heals from a live peer; a cluster that writes the run's metrics goes on writing them)
        healing = cfg.topology.elastic and restarted and (Path(cfg.run.out_dir) / "config.toml").is_file()
        try:
            if rank == 0 and not healing:
                RunLock.ensure_free(Path(cfg.run.out_dir))
            data, resume = preflight(cfg, world_size)
            if rank == 0 and not healing:
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
        if cfg.topology.elastic:
            if lock is not None:  # held while the directory is made: torchrun starts the job again in it, on any node
                lock.release()
                lock = None
            try:
                code = _run_elastic_cluster(cfg, rank, resume, start_store, restarted=restarted)
            except BaseException:  # the exit below must not wait for torchft's threads either
                traceback.print_exc()
                print(f"dilocox: rank {rank} failed; torchrun starts its cluster again", file=sys.stderr)
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)  # torchft's threads (its manager server, the checkpoint server) must not hold the exit
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


def _run_elastic_cluster(
    cfg: Config, rank: int, resume: Path | None, start_store: dist.TCPStore, *, restarted: bool
) -> int:
    """This job is one cluster of an elastic run (`preflight.check_elastic_job`): its ranks, on any number of nodes,
    are the cluster's world. The cluster's torchft Managers meet at the store rank 0 serves for this start of the job
    (`_start_number`: fresh at every start, so a restart does not meet its dead processes' keys); each rank
    advertises its own node's address (network.advertise_host). The first start loads the cluster's checkpoint of
    the step the run resumes from, if it has one; a start after a failure (torchrun --max-restarts) heals from a
    live peer."""
    (cluster,) = cfg.topology.launched_clusters()
    own = None
    if resume is not None and not restarted:
        own = elastic_resume_paths(Path(cfg.run.out_dir), resume, [cluster]).get(cluster)
    where = (os.environ["MASTER_ADDR"], start_store.port)
    return run_cluster_rank(cfg, cluster, rank, where, restarted=restarted, resume="" if own is None else str(own))


_START_KEY = "dilocox/start"
"""In torchrun's store: how many times rank 0 started (more than once: torchrun started the job again), and where
rank 0 serves the store that tells the other ranks that number."""


def _start_number(agent_store: dist.Store, rank: int, timeout: datetime.timedelta) -> tuple[int, dist.TCPStore]:
    """Which start of the job this is (1, then 2 after torchrun starts it again), the same on every rank, and the
    store that told it, which only this start's ranks use (an elastic cluster's torchft Managers meet there).

    torchrun's agent keeps its store for its lifetime, so a start after a failure (--max-restarts) that used its keys
    would read the dead start's, and gloo would connect to the dead ranks (torch 2.13's own `init_process_group`
    fails so after a multi-node restart); TORCHELASTIC_RESTART_COUNT cannot name the start, since an agent whose
    workers were still healthy starts them again without counting. Rank 0 counts its starts in the agent's store and
    serves the number from a store of its own, whose port it leaves there. Every rank of a start has exited before
    torchrun starts the next, so a rank that reads the dead start's port finds nothing there and reads again."""
    host = os.environ["MASTER_ADDR"]
    if rank == 0:
        server = serve_store(host, timeout)
        number = agent_store.add(f"{_START_KEY}/count", 1)
        server.set("start", str(number))
        agent_store.set(f"{_START_KEY}/port", str(server.port))
        return number, server
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        port = int(agent_store.get(f"{_START_KEY}/port"))
        try:
            client = dist.TCPStore(host, port, None, is_master=False, timeout=datetime.timedelta(seconds=2))
            return int(client.get("start")), client
        except (RuntimeError, dist.DistError):  # the dead start's port: rank 0 of this one has not written its own
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _torchrun_job_store(store: dist.Store) -> JobStore:
    """torchrun's store (`store`: this start's keys of it) as the watchdog names it: served by its agent on the first
    node (c10d rendezvous) or by rank 0 itself (static rendezvous)."""
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    host = "torchrun's agent on the first node" if agent else "rank 0"
    return JobStore(store, f"the job's store at {where} (served by {host})")
