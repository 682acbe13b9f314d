"""What every launcher shares about the processes it starts: exit codes, a rank's training, a forked rank's first
steps (watch the launcher, take its environment), the one line a rank stops with, and stopping them all.

    ctx = mp.start_processes(rank_main, ..., join=False, start_method="forkserver")
    with signals_stop_the_run():      # SIGTERM and SIGHUP raise Stopped, like Ctrl+C raises KeyboardInterrupt
        ...                            # wait for ctx; on a failure: first_user_error(store, ranks)
    stop_processes(ctx)
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch.distributed as dist

from dilocox.config import Config
from dilocox.data import TokenData
from dilocox.net.watchdog import JobStore

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130
EXIT_ORPHANED = 3
"""A rank whose launcher died exits with this code (no orphan keeps training)."""
# EXIT_STALLED = 4, in net/watchdog.py, whose thread exits with it: a rank stopped sending heartbeats or the job's
# store stopped answering; every rank exits with it and the launcher says so in one line.
STOP_GRACE_S = 2.0
"""When a rank fails, the others get this long to exit by themselves, then SIGTERM, then as long again SIGKILL (a
SIGSTOPped rank ignores SIGTERM until it is continued)."""

_USER_ERROR_KEY = "dilocox/launcher/user_error/{rank}"
"""Where a rank leaves the line it stops with, in the store its launcher serves."""


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


def report_user_error(store: dist.Store, rank: int, message: str) -> None:
    """Leave `message`, the one line `rank` stops with (it exits with `EXIT_USER_ERROR` next), in the store its
    launcher serves; the launcher prints it once the rank has exited (`first_user_error`)."""
    store.set(_USER_ERROR_KEY.format(rank=rank), message)


def first_user_error(store: dist.Store, ranks: Iterable[int]) -> str | None:
    """The line the lowest of `ranks` that stopped on a user error left in `store`, or None when none did."""
    for rank in ranks:
        key = _USER_ERROR_KEY.format(rank=rank)
        if store.check([key]):
            return store.get(key).decode()
    return None


def enter_forked_rank(launcher: int, env: dict, cwd: str) -> None:
    """The start of every rank forked from the fork server: watch the launcher, take the launcher's environment and
    directory of now (not the fork server's from its start), put gloo on the loopback. Every group a rank builds
    itself joins ranks of this machine (a static run's world, an elastic cluster), whatever GLOO_SOCKET_IFNAME a
    user keeps for torchrun jobs; an elastic run's slow-link group binds its own address (`elastic/membership.py`)."""
    _die_with(launcher)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"


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


class Stopped(Exception):
    """The launcher got SIGTERM or SIGHUP: it stops its ranks, like Ctrl+C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def signals_stop_the_run() -> Iterator[None]:
    """Inside the block, SIGTERM and SIGHUP raise `Stopped` in the launcher (then restored as they were)."""

    def handler(signum: int, frame: object) -> None:
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def stop_processes(ctx) -> None:
    """Stop every live process of a `torch.multiprocessing` context: SIGTERM, then SIGKILL after 10 s."""
    for process in ctx.processes:
        if process.is_alive():
            process.terminate()
    for process in ctx.processes:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
