"""One run per run directory: the lock refuses a live holder and takes over a dead one's."""

import json
import socket
import subprocess
import sys

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
