"""The run directory: which one a run writes to, its lock, then config.toml and tokenizer.json, written only once
every check has passed (`preflight`) and the lock is held (docs/reference/run-directory.md).

    note = choose_run_dir(cfg)                 # runs/dilocox holds a finished run: this one writes to runs/dilocox-2
    lock = prepare_run_dir(cfg, data, resume)
    try: ...                                   # train
    finally: lock.release()
"""

from __future__ import annotations

import itertools
import shlex
import shutil
import sys
import tomllib
from pathlib import Path
from typing import Any

from dilocox.checkpoint import checkpoint_step, list_checkpoints
from dilocox.config import Config, flat_settings, to_toml
from dilocox.data import TokenData
from dilocox.fileio import write_atomic
from dilocox.metrics import SUMMARY_FILE
from dilocox.runlock import LOCK_FILE, RunLock

RECORD_ONLY = ("run.out_dir", "run.overwrite", "checkpoint.interval", "checkpoint.resume", "checkpoint.keep",
               "checkpoint.keep_every", "checkpoint.async_save", "eval.interval", "eval.max_batches",
               "eval.final_max_batches", "eval.local", "network.advertise_host", "network.lighthouse",
               "metrics.progress", "metrics.log_interval", "metrics.tensorboard", "metrics.wandb",
               "sync.min_clusters")  # fmt: skip
"""Settings that change where a run is recorded, how often it is saved, how it is watched and how few clusters it
goes on with, never what it trains: a run started again with another value of these is the same run."""


def _settings(toml_text: str) -> dict[str, Any]:
    """The `section.key` settings of a config.toml, without the `RECORD_ONLY` ones."""
    flat = flat_settings(tomllib.loads(toml_text))  # a key of an earlier version under its new name
    return {key: value for key, value in flat.items() if key not in RECORD_ONLY}


def settings_changed(run_dir: Path, cfg: Config) -> list[str]:
    """The settings of `cfg` that differ from those in `run_dir`'s config.toml, as `key: old -> new` (every setting
    when the file is missing or unreadable)."""
    try:
        old = _settings((Path(run_dir) / "config.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return ["config.toml: missing or unreadable"]
    new = _settings(to_toml(cfg))
    return [f"{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in sorted(old.keys() | new.keys())
            if old.get(key) != new.get(key)]  # fmt: skip


def _holds_files(run_dir: Path) -> bool:
    return run_dir.is_dir() and any(p.name != LOCK_FILE for p in run_dir.iterdir())


def _why_not(run_dir: Path, cfg: Config) -> str | None:
    """Why this run, under `checkpoint.resume = auto`, cannot go on in `run_dir` (None: it can, as a new run or by
    resuming its own unfinished one). The directory of a finished run, of other settings, or of anything else is
    never written into."""
    if not _holds_files(run_dir):
        return None
    changed = settings_changed(run_dir, cfg)
    if changed:
        shown = "; ".join(changed[:3]) + (f"; and {len(changed) - 3} more" if len(changed) > 3 else "")
        return f"holds a run of other settings ({shown})"
    checkpoints = list_checkpoints(run_dir)
    done = checkpoint_step(checkpoints[-1]) if checkpoints else 0
    if (run_dir / SUMMARY_FILE).is_file() or done >= cfg.train.steps:
        return f"holds a finished run ({done} of {cfg.train.steps} steps)"
    if cfg.checkpoint.resume == "":
        return "holds a run and checkpoint.resume = '' never resumes one"
    return None


def choose_run_dir(cfg: Config) -> str | None:
    """Point `cfg.run.out_dir` at the directory this run writes to, and say why when it is not the one asked for.

    With `checkpoint.resume = auto` or "" (and no `run.overwrite`), a run goes on in `run.out_dir` only when the
    directory is new or empty, or holds this same run unfinished (equal settings but `RECORD_ONLY`: started again
    after a crash or Ctrl+C, it resumes). A finished run, a run of other settings or other files are never written
    into: the run goes to the first of `NAME-2`, `NAME-3`, ... that it may use, so the same command run twice makes
    two runs, and run again after an interruption resumes its own. A live run's directory is refused
    (`RunLock.ensure_free`), a file in the way too (`prepare_run_dir`); `checkpoint.resume = latest` or a
    checkpoint continues the run named, as asked."""
    base = Path(cfg.run.out_dir)
    if cfg.run.overwrite or cfg.checkpoint.resume not in ("", "auto") or (base.exists() and not base.is_dir()):
        return None
    RunLock.ensure_free(base)
    why = _why_not(base, cfg)
    if why is None:
        return None
    for n in itertools.count(2):
        candidate = base.with_name(f"{base.name}-{n}")
        if candidate.exists() and not candidate.is_dir():
            continue
        try:
            RunLock.ensure_free(candidate)
        except ValueError:
            continue
        if _why_not(candidate, cfg) is None:
            break
    cfg.run.out_dir = str(candidate)
    if _holds_files(candidate):
        return f"dilocox: {base} {why}, so this run goes on in {candidate}, where it stopped"
    more = ""
    if why.startswith("holds a finished run"):
        more = f"; to continue that run, raise --train.steps and add --checkpoint.resume=latest --run.out_dir={base}"
    return f"dilocox: {base} {why}, so this run is a new one in {candidate} (--run.out_dir names another{more})"


def resume_hint(cfg: Config, *, where: str = "") -> str:
    """How to go on from disk once a run has stopped (Ctrl+C, a stall, every elastic cluster lost): this command in
    this run directory, which resumes its newest checkpoint (`checkpoint.resume = auto`: the same settings,
    unfinished), said with that checkpoint; `where` is said after the command (e.g. on which machines)."""
    drop = ("--run.out_dir=", "--run.overwrite=", "--checkpoint.resume=")  # its own directory, resumed, not replaced
    argv = ["dilocox", *[arg for arg in sys.argv[1:] if not arg.startswith(drop)], f"--run.out_dir={cfg.run.out_dir}"]
    command = f"`{shlex.join(argv)}`{where}"
    newest = list_checkpoints(Path(cfg.run.out_dir))
    if not newest:
        return f"no checkpoint was written yet: {command} starts the run again"
    return f"resume it with {command} (from {newest[-1]}; checkpoint.resume = auto)"


def prepare_run_dir(cfg: Config, data: TokenData, resume: Path | None) -> RunLock:
    """Take the run directory's lock, then create (or reopen, when resuming) it and write config.toml and
    tokenizer.json into it; returns the lock, which the caller releases when the run ends. Nothing in the directory is
    written, replaced or removed before the lock is held, so a second run refused by a live one leaves it as it was."""
    run_dir = Path(cfg.run.out_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"run.out_dir = {run_dir} is a file; choose a directory path")
    replace = resume is None and _holds_files(run_dir)
    # auto and this run, died before its first checkpoint (a finished run always has one): start it again
    restart = replace and cfg.checkpoint.resume == "auto" and not settings_changed(run_dir, cfg)
    # resumed with other settings: config.toml says what the next steps run with, the file kept what ran before
    changed = settings_changed(run_dir, cfg) if resume is not None and (run_dir / "config.toml").is_file() else []
    before = run_dir / f"config.until_step_{checkpoint_step(resume):08d}.toml" if resume is not None else None
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
        if changed and before is not None:
            write_atomic(before, (run_dir / "config.toml").read_bytes())
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
    if resume is not None:
        refuse = "; pass --checkpoint.resume= to refuse" if cfg.checkpoint.resume == "auto" else ""
        print(f"dilocox: resuming from {resume} (checkpoint.resume = {cfg.checkpoint.resume or 'auto'}{refuse})")
    if changed and resume is not None and before is not None:
        print(
            f"dilocox: resuming at step {checkpoint_step(resume)} with other settings ({'; '.join(changed)}); the "
            f"steps before ran with {before.name}"
        )
    return lock
