"""One run per run directory: a lock file that names its holder, and tells a live holder from a dead one.

    lock = RunLock.acquire(run_dir)      # ValueError if a live process holds it; a dead holder's lock is taken over
    ...
    lock.release()

The file `RUN_DIR/.dilocox.lock` holds the holder's host, pid and start time as JSON. It is created with O_EXCL, so
two launchers cannot both take it. A lock left by a process that died (same host, pid gone or reused by a process
that started later) is stale and taken over with a note; a lock from another host cannot be checked from here and
is refused with the command that removes it. A launcher takes it before it writes, replaces or removes anything in
the run directory (`launch.rundir.prepare_run_dir`), so a run refused by a live one leaves that run's files as they
were.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

LOCK_FILE = ".dilocox.lock"


def _process_start(pid: int) -> float | None:
    """Seconds since boot at which `pid` started (Linux /proc), or None where that cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int, started: float | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    now_started = _process_start(pid)
    # a pid reused by a process that started after the holder wrote the lock is not the holder
    return started is None or now_started is None or abs(now_started - started) < 1.0


class RunLock:
    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def acquire(cls, run_dir: Path) -> RunLock:
        """Take the lock of `run_dir` for this process (the directory must exist)."""
        path = Path(run_dir) / LOCK_FILE
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": _process_start(os.getpid()),
              "time": time.time()}  # fmt: skip
        for _ in range(2):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = cls._holder(path)
                if holder is not None and cls._live(holder):
                    raise cls._in_use(run_dir, holder) from None
                if holder is not None and holder.get("host") != me["host"]:
                    raise ValueError(
                        f"run.out_dir = {run_dir} is locked by pid {holder.get('pid')} on {holder.get('host')}, which "
                        f"cannot be checked from {me['host']}; if no run is live there, remove {path}"
                    ) from None
                print(f"dilocox: taking over the stale lock of a run that ended ({path})", file=sys.stderr)
                path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            return cls(path)
        raise ValueError(f"could not take the lock {path}: another run keeps taking it; choose another --run.out_dir")

    @classmethod
    def ensure_free(cls, run_dir: Path) -> None:
        """Raise the error `acquire` would if a live run holds `run_dir` (before anything in it is replaced)."""
        holder = cls._holder(Path(run_dir) / LOCK_FILE)
        if holder is not None and cls._live(holder) and holder["pid"] != os.getpid():
            raise cls._in_use(run_dir, holder)

    @staticmethod
    def _in_use(run_dir: Path, holder: dict) -> ValueError:
        return ValueError(
            f"run.out_dir = {run_dir} is in use by a live run (pid {holder['pid']} on {holder['host']}); "
            "wait for it to end or stop it, or choose another --run.out_dir"
        )

    @staticmethod
    def _holder(path: Path) -> dict | None:
        try:
            holder = json.loads(path.read_text())
        except (OSError, ValueError):
            return None  # unreadable (half-written by a process that died): stale
        return holder if isinstance(holder, dict) and isinstance(holder.get("pid"), int) else None

    @staticmethod
    def _live(holder: dict) -> bool:
        return holder.get("host") == socket.gethostname() and _alive(holder["pid"], holder.get("started"))

    def release(self) -> None:
        """Remove the lock if this process still holds it."""
        holder = self._holder(self.path)
        if holder is not None and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            self.path.unlink(missing_ok=True)
