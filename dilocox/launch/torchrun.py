"""Run as the one rank torchrun started: rank 0 checks the run and prepares its directory, and every rank learns
whether that failed before any of them trains (docs/guides/multi-node.md).

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-endpoint HOST:29400 -m dilocox train ...   # one rank each
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback
from pathlib import Path

import torch.distributed as dist

from dilocox.agreement import check_same_settings
from dilocox.config import Config
from dilocox.launch.preflight import preflight
from dilocox.launch.processes import EXIT_INTERRUPTED, EXIT_USER_ERROR, run_rank
from dilocox.launch.rundir import prepare_run_dir
from dilocox.net.json_gather import all_gather_json
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
