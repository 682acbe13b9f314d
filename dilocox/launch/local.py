"""Start every rank of a run on this machine: `C x D x P` processes forked from the fork server, gloo over the
loopback, the job's TCPStore served by this launcher (docs/design.md §7).

    data, resume = preflight(cfg)
    lock = prepare_run_dir(cfg, data, resume)
    code = launch_local(cfg, data, resume)     # an elastic run: launch_elastic(cfg)

A crashed rank stops all ranks; Ctrl+C stops them too, and the newest complete checkpoint stays usable. A rank that
stops sending heartbeats (SIGSTOP, a frozen host, a cut link) is named within `network.stall_timeout` and every rank
exits with `EXIT_STALLED` (`net/watchdog.py`); every process group waits at most `network.timeout`.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import sys
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from dilocox import forkserver
from dilocox.agreement import check_same_settings
from dilocox.config import Config, from_dict, to_dict
from dilocox.data import TokenData
from dilocox.launch.elastic import launch_elastic
from dilocox.launch.processes import (
    EXIT_INTERRUPTED,
    EXIT_USER_ERROR,
    STOP_GRACE_S,
    Stopped,
    enter_forked_rank,
    first_user_error,
    report_user_error,
    run_rank,
    signals_stop_the_run,
    stop_processes,
)
from dilocox.launch.rundir import resume_hint
from dilocox.net.listen import LOOPBACK, serve_store
from dilocox.net.watchdog import EXIT_STALLED, JobStore, run_was_stopped

_LOCAL_HOST = LOOPBACK


def launch_local(cfg: Config, data: TokenData, resume: Path | None) -> int:
    """Spawn the world on this machine and wait; returns the process exit code."""
    if cfg.topology.elastic:
        return launch_elastic(cfg, resume)
    world_size = cfg.world_size
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # our own line says who was stopped
    # The job's store lives in this process, not in a rank: a stopped rank cannot take it down with it.
    timeout = datetime.timedelta(seconds=cfg.network.timeout_s)
    store = serve_store(_LOCAL_HOST, timeout)
    # Ranks are forked from a fork server that imports torch and dilocox once, instead of each rank importing them
    # again (about 2 s of CPU per rank). The server never touches CUDA or a process group, so a fork copies none.
    forkserver.start(forkserver.LOCAL_PRELOAD)  # unless `dilocox train` started it already (forkserver.start_early)
    ctx = mp.start_processes(
        _local_rank_main,
        args=(to_dict(cfg), world_size, store.port, str(resume or ""), os.getpid(), dict(os.environ), os.getcwd()),
        nprocs=world_size,
        join=False,
        start_method="forkserver",
    )
    try:
        with signals_stop_the_run():
            while not ctx.join(timeout=0.5, grace_period=STOP_GRACE_S):  # a failed rank: the others are stopped
                pass
    except (KeyboardInterrupt, Stopped) as exc:
        stop_processes(ctx)
        what = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"stopped by {exc}"
        print(f"\ndilocox: {what}, all {world_size} ranks stopped; {resume_hint(cfg)}", file=sys.stderr)
        return EXIT_INTERRUPTED if isinstance(exc, KeyboardInterrupt) else 128 + exc.signum
    except ProcessException as exc:
        stop_processes(ctx)
        return _report_failure(cfg, store, exc)
    return 0


def _report_failure(cfg: Config, store: dist.TCPStore, exc: ProcessException) -> int:
    """Say in one line why the ranks were stopped after `exc` (a stall, a rank's user error, or the failed rank's
    own traceback above the line) and return the launcher's exit code."""
    world_size = cfg.world_size
    if run_was_stopped(JobStore(store)):
        print(
            f"dilocox: a rank stopped sending heartbeats (named above): all {world_size} ranks stopped, exit "
            f"{EXIT_STALLED}; {resume_hint(cfg)}",
            file=sys.stderr,
        )
        return EXIT_STALLED
    error = first_user_error(store, range(world_size))
    if error is not None:
        print(f"dilocox: error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    detail = getattr(exc, "msg", str(exc)).rstrip()
    print(
        f"{detail}\ndilocox: rank {exc.error_index} failed ({exc.__class__.__name__}); all ranks stopped",
        file=sys.stderr,
    )
    return 1


def _local_rank_main(
    rank: int,
    cfg_dict: dict,
    world_size: int,
    port: int,
    resume: str,
    launcher: int,
    env: dict,
    cwd: str,
) -> None:
    # The launching terminal's Ctrl+C reaches every process; the launcher alone decides and stops the ranks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    enter_forked_rank(launcher, env, cwd)
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
        report_user_error(store, rank, str(exc))
        sys.stdout.flush()
        os._exit(EXIT_USER_ERROR)  # peers blocked in collectives are stopped by the parent
    dist.destroy_process_group()
