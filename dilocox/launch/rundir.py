"""The run directory: its lock, then config.toml and tokenizer.json, written only once every check has passed
(`preflight`) and the lock is held (docs/design.md §7).

    lock = prepare_run_dir(cfg, data, resume)
    try: ...                                   # train
    finally: lock.release()
"""

from __future__ import annotations

import shutil
from pathlib import Path

from dilocox.config import Config, to_toml
from dilocox.data import TokenData
from dilocox.fileio import write_atomic
from dilocox.runlock import LOCK_FILE, RunLock


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
