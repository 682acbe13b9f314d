"""Atomic file writes (readers in other processes see the old file or the whole new one, never a part) and a cheap
fingerprint of what large files hold.

write_atomic(run_dir / "summary.json", json.dumps(summary).encode())
sampled_digest([Path("corpus.jsonl")])       # size + sampled blocks: the same for a copy at another path
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path


def write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` to `path` through a temporary file in the same directory, fsync'd, then `os.replace`."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        # mkstemp makes the file private (0600); run files and caches are meant to be shared like any other file.
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp_name, target)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise


SAMPLE_BLOCKS = 4
SAMPLE_BLOCK_BYTES = 1 << 16


def sampled_digest(files: list[Path]) -> str:
    """16 hex digits of sha256 over each file's size and `SAMPLE_BLOCKS` blocks of `SAMPLE_BLOCK_BYTES` at fixed
    fractions of it (its start, a third, two thirds, its end), in the order given: what the files hold, whatever
    their paths, at most 256 KiB read per file (a 100 GB corpus is compared in well under a second)."""
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            digest.update(f"{size}\n".encode())
            last = max(0, size - SAMPLE_BLOCK_BYTES)
            for block in range(SAMPLE_BLOCKS):
                handle.seek(last * block // (SAMPLE_BLOCKS - 1))
                digest.update(handle.read(SAMPLE_BLOCK_BYTES))
    return digest.hexdigest()[:16]
