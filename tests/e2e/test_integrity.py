"""A damaged checkpoint is never read as if it were whole, and a live run's directory is never written by another run:
`dilocox export` and `dilocox eval` refuse a checkpoint whose rank file or meta.json does not verify, in one line;
resuming skips it for the previous one; a second run into a live run's directory leaves every file as it was."""

import hashlib
import json
import os
import shutil
import subprocess

import pytest

from dilocox.checkpoint import list_checkpoints, verify_checkpoint
from dilocox.cli import main
from tests.e2e.helpers import DEBUG, REPO, TORCHRUN, dilocox, run_lock_held

pytestmark = pytest.mark.e2e

TRAIN = ["--config", DEBUG, "--train.steps=20", "--checkpoint.interval=10", "--eval.interval=0"]
"""Two rounds of the debug run, a checkpoint after each."""


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("integrity") / "run"
    result = dilocox("train", *TRAIN, f"--run.out_dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_00000010", "step_00000020"]
    return run_dir


def copy_of(run_dir, tmp_path):
    return shutil.copytree(run_dir, tmp_path / "run")


def file_hashes(directory):
    """The sha256 of every file under `directory`, by its path inside it."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def refused(capsys, *args) -> str:
    """The one line of stderr of the `dilocox` command `args`, which must exit 2."""
    assert main([str(a) for a in args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dilocox: error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("rank", [0, 1])
def test_a_flipped_bit_in_a_rank_file_is_refused_by_export_and_eval(finished_run, tmp_path, capsys, rank):
    run_dir = copy_of(finished_run, tmp_path)
    newest = run_dir / "checkpoints" / "step_00000020"
    file = newest / f"__{rank}_0.distcp"  # what rank `rank` wrote
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))
    out = tmp_path / "hf"
    err = refused(capsys, "export", run_dir, "--out", out)
    assert err == (
        f"dilocox: error: checkpoint {newest} is corrupt: __{rank}_0.distcp does not match its sha256 (bit rot or a "
        "partial overwrite); pass --step with another of its steps (10)\n"
    )
    assert not out.exists() and not list(tmp_path.glob(".hf.partial"))
    assert refused(capsys, "eval", run_dir, "--max-batches", 1) == err  # the newest, as export: never an older one
    assert refused(capsys, "eval", run_dir, "--step", 20, "--max-batches", 1) == err
    err = refused(capsys, "eval", run_dir, "--checkpoint", newest, "--max-batches", 1)
    assert f"checkpoint {newest} is corrupt: __{rank}_0.distcp does not match its sha256" in err
    assert main(["export", str(run_dir), "--out", str(out), "--step", "10"]) == 0  # the good one still exports
    assert (out / "model.safetensors").is_file()
    assert main(["eval", str(run_dir), "--step", "10", "--max-batches", "1", "--json"]) == 0  # and is scored
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["step"] == 10


def rename_files(meta):
    meta["checkpoint_files"] = meta.pop("files")


META_DAMAGE = {
    "files-renamed": (rename_files, "meta.json does not match its digest"),
    "files-renamed-no-digest": (lambda m: (rename_files(m), m.pop("digest", None)), "meta.json lists no rank files"),
    "digest-wrong": (lambda m: m.update(digest="0" * 64), "meta.json does not match its digest"),
}


@pytest.mark.parametrize("damage", META_DAMAGE.values(), ids=META_DAMAGE.keys())
def test_a_meta_json_that_does_not_verify_is_refused_by_eval_and_export_and_skipped_by_resume(
    finished_run, tmp_path, capsys, damage
):
    edit, why = damage
    run_dir = copy_of(finished_run, tmp_path)
    checkpoints = run_dir / "checkpoints"
    newest = checkpoints / "step_00000020"
    meta = json.loads((newest / "meta.json").read_text())
    edit(meta)
    (newest / "meta.json").write_text(json.dumps(meta, indent=2))
    assert why in refused(capsys, "export", run_dir, "--out", tmp_path / "hf")
    assert why in refused(capsys, "eval", run_dir, "--checkpoint", newest, "--max-batches", 1)
    # checkpoint.resume = latest: the newest is skipped in one warning, the run goes on from the previous one
    result = dilocox("train", *TRAIN, f"--run.out_dir={run_dir}", "--checkpoint.resume=latest")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"dilocox: warning: skipping corrupt checkpoint {newest}: {why}" in result.stderr
    assert f"resuming from {checkpoints / 'step_00000010'}" in result.stdout
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 20
    assert verify_checkpoint(newest)["step"] == 20  # saved again, whole


@pytest.mark.parametrize("launcher", ["local", "torchrun", "elastic"])
def test_a_second_run_into_a_live_runs_directory_changes_nothing(finished_run, tmp_path, launcher):
    """Another lr and length into the directory of a live run (a process holding its lock): refused before any file
    is written and before it says it resumes. The elastic launcher replaces a run directory (--run.overwrite)."""
    run_dir = copy_of(finished_run, tmp_path)
    args = ["train", *TRAIN, f"--run.out_dir={run_dir}", "--train.lr=0.05", "--train.steps=5000"]
    with run_lock_held(run_dir) as holder:
        before = file_hashes(run_dir)
        if launcher == "torchrun":
            env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
            command = [*TORCHRUN, "-m", "dilocox", *args]
            result = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=REPO, env=env)
        else:
            extra = ["--topology.elastic=true", "--run.overwrite=true"] if launcher == "elastic" else []
            result = dilocox(*args, *extra, timeout=240)
        after = file_hashes(run_dir)
    assert result.returncode != 0 and (launcher == "torchrun" or result.returncode == 2)
    assert f"in use by a live run (pid {holder.pid} " in result.stderr, result.stderr[-3000:]
    assert "resuming from" not in result.stdout
    assert after == before
