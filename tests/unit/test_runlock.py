"""One run per run directory: the lock refuses a live holder and takes over a dead one's."""

import json
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest

from dilocox.runlock import LOCK_FILE, RunLock


def test_a_live_holder_is_refused_and_release_frees_the_directory(tmp_path):
    lock = RunLock.acquire(tmp_path)
    holder = json.loads((tmp_path / LOCK_FILE).read_text())
    assert holder["host"] == socket.gethostname() and holder["pid"] > 0
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": holder["host"], "pid": 1}))  # pid 1: alive everywhere
    with pytest.raises(ValueError, match="in use by a live run \\(pid 1 "):
        RunLock.acquire(tmp_path)
    with pytest.raises(ValueError, match="in use by a live run"):
        RunLock.ensure_free(tmp_path)
    (tmp_path / LOCK_FILE).write_text(json.dumps(holder))
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()
    RunLock.acquire(tmp_path).release()


def test_a_dead_holders_lock_is_taken_over(tmp_path, capsys):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout)}))
    RunLock.ensure_free(tmp_path)  # no error: the holder is gone
    lock = RunLock.acquire(tmp_path)
    assert "stale lock" in capsys.readouterr().err
    lock.release()
    (tmp_path / LOCK_FILE).write_text("{half a json")  # a holder that died while writing it
    RunLock.acquire(tmp_path).release()


def test_a_lock_from_another_host_names_the_file_to_remove(tmp_path):
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "elsewhere.example", "pid": 1234}))
    with pytest.raises(ValueError, match=f"locked by pid 1234 on elsewhere.example.*remove {tmp_path / LOCK_FILE}"):
        RunLock.acquire(tmp_path)


def tree(directory):
    """Every file under `directory` with its bytes."""
    return {p.relative_to(directory): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "flags",
    [["--train.lr=0.05", "--train.steps=5000"], ["--run.overwrite=true"], []],
    ids=["resume", "overwrite", "restart"],
)
def test_a_run_directory_is_written_only_once_its_lock_is_held(tmp_path, capsys, flags):
    """prepare_run_dir into a live run's directory (resumed, replaced, or started again when it has no checkpoint)
    is refused by the lock before it writes, replaces or removes anything, and says nothing of resuming."""
    from dilocox.config import load_config
    from dilocox.launch.rundir import prepare_run_dir

    run_dir = tmp_path / "run"
    checkpoint = run_dir / "checkpoints" / "step_00000010"
    checkpoint.mkdir(parents=True)
    (checkpoint / "meta.json").write_text("{}")
    (run_dir / "config.toml").write_text("[train]\nlr = 0.003\nsteps = 3000\n")
    (run_dir / "tokenizer.json").write_text("{}")
    (run_dir / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": 1}))  # pid 1: alive
    before = tree(run_dir)
    cfg = load_config(None, [f"--run.out_dir={run_dir}", *flags])
    data = SimpleNamespace(tokenizer_path=str(tmp_path / "other-tokenizer.json"))
    (tmp_path / "other-tokenizer.json").write_text('{"other": 1}')
    resume = checkpoint if flags == ["--train.lr=0.05", "--train.steps=5000"] else None
    with pytest.raises(ValueError, match=f"run.out_dir = {run_dir} is in use by a live run \\(pid 1 "):
        prepare_run_dir(cfg, data, resume)
    assert tree(run_dir) == before
    out = capsys.readouterr()
    assert "resuming" not in out.out and "starting its run again" not in out.out
