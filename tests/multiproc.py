"""Run a function on N real gloo ranks (separate processes) from inside a test.

    results = run_ranks(worker, world_size=2, args=(tmp_path,))
    assert results[0] == results[1]

`worker(rank, world_size, *args)` must be a module-level function of an importable module (a test module
is fine). Each rank joins the default process group with gloo over a file store, uses one thread, and its
return value (picklable) is sent back; an exception in any rank fails the call with that rank's traceback.
Ranks are forked from a fork server that has torch and dilocox imported already (`_PRELOAD`), with the test's
environment of the moment, so they behave as spawned ranks but start in a fraction of the time.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "dilocox.trainer",
    "dilocox.sync",
    "dilocox.compress",
    "tests.multiproc",
]
"""Imported once by the fork server that every rank is forked from, so a rank starts in a fraction of a second
instead of importing torch and dilocox again (about 2.5 s of CPU each, the largest cost of a short multi-rank test).
The server imports only: it has no threads, process groups or CUDA state that a fork could copy."""
mp.set_forkserver_preload(_PRELOAD)


def _entry(
    rank: int, fn: Callable, world_size: int, init_file: str, result_dir: str, args: tuple, env: dict[str, str]
) -> None:
    import torch

    os.environ.clear()
    os.environ.update(env)  # the test's environment now, not the fork server's from when it started
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    # Every rank finishes gloo's connection mesh before any goes on: a rank whose function returns at once would
    # otherwise tear down its group while a peer is still connecting, and that peer fails inside init instead of
    # reporting its own result ("Connection closed by peer", seen once in a .ci/run).
    dist.barrier()
    out = os.path.join(result_dir, f"rank{rank}.pkl")
    try:
        value = fn(rank, world_size, *args)
        payload = ("ok", value)
    except BaseException:
        payload = ("error", traceback.format_exc())
    with open(out + ".tmp", "wb") as f:
        pickle.dump(payload, f)
    os.replace(out + ".tmp", out)
    if payload[0] == "ok":
        dist.destroy_process_group()
    else:
        os._exit(1)  # peers blocked in a collective are terminated by the parent


def run_ranks(fn: Callable, world_size: int, args: tuple = (), timeout: float = 240.0) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return the per-rank results."""
    with tempfile.TemporaryDirectory(prefix="dilocox-ranks-") as tmp:
        init_file = os.path.join(tmp, "init")
        ctx = mp.start_processes(
            _entry,
            args=(fn, world_size, init_file, tmp, args, dict(os.environ)),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        errors: list[str] = []
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    for process in ctx.processes:
                        process.kill()
                    errors.append(f"ranks still running after {timeout:.0f} s: killed (a hang or deadlock)")
                    break
        except Exception as exc:  # a rank died: collect whatever tracebacks were written
            errors.append(str(exc))
        results: list[Any] = []
        for rank in range(world_size):
            path = os.path.join(tmp, f"rank{rank}.pkl")
            if not os.path.exists(path):
                results.append(None)
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            results.append(value)
        if errors:
            raise AssertionError("distributed test failed:\n" + "\n".join(errors))
        return results
