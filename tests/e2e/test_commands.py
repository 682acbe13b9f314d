"""The small promises of the `dilocox` command: every command has help, a reader that stops early is not an error,
and a topology that cannot work is refused before anything is written."""

import subprocess
import sys
from pathlib import Path

import pytest

from dilocox.cli import main
from tests.e2e.helpers import DEBUG, REPO, dilocox

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("command", ["flavors", "env"])
def test_commands_without_options_show_help_and_refuse_arguments(command, capsys):
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: dilocox {command}\n")
    assert "params" not in out and "torch" not in out.splitlines()[0]  # the help, not the command's output
    assert main([command, "--bogus"]) == 2
    assert capsys.readouterr().err.startswith("dilocox: error: unexpected argument(s): --bogus\n")


def test_the_token_cache_is_named_by_env_and_train_help(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("DILOCOX_CACHE", str(tmp_path / "cache"))
    assert main(["env"]) == 0
    assert f"token cache: {tmp_path / 'cache'} ($DILOCOX_CACHE)" in capsys.readouterr().out
    monkeypatch.delenv("DILOCOX_CACHE")
    assert main(["env"]) == 0
    default = Path("~/.cache/dilocox").expanduser()
    assert f"token cache: {default} (default; set DILOCOX_CACHE to move it)" in capsys.readouterr().out
    assert main(["train", "--help"]) == 0
    help_text = capsys.readouterr().out
    assert "DILOCOX_CACHE" in help_text and "~/.cache/dilocox" in help_text


@pytest.mark.parametrize("args", [["env"], ["train", "--help"], ["eval", "--help"]])
def test_a_reader_that_closes_the_pipe_ends_the_command_quietly(args):
    # The reader goes away before the command writes anything, so every write hits the closed pipe, as in
    # `dilocox env | head -1` once head has exited (`flavors` is checked with head itself below).
    process = subprocess.Popen(
        [sys.executable, "-m", "dilocox", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
    )
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == 141  # 128 + SIGPIPE, as a tool killed by the signal
    assert stderr == ""


def test_flavors_piped_into_head(tmp_path):
    done = subprocess.run(
        f"{sys.executable} -m dilocox flavors | head -1", shell=True, capture_output=True, text=True, cwd=REPO
    )
    assert done.stdout.split() == ["flavor", "layers", "dim", "heads", "kv", "ffn", "vocab", "params"]
    assert done.stderr == ""


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--topology.pp_degree=3", "--train.micro_batch_size=6"],
            "topology.pp_degree = 3 exceeds the model's 2 layers",
        ),
        (
            ["--model.flavor=qwen1.5-0.5b", "--topology.pp_degree=2"],
            "model.flavor has tie_embeddings=True, which cannot be split",
        ),
    ],
)
def test_a_pipeline_that_cannot_be_cut_is_refused_before_anything_is_written(tmp_path, args, message):
    run_dir = tmp_path / "run"
    result = dilocox("train", "--config", DEBUG, f"--run.out_dir={run_dir}", *args, timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith(f"dilocox: error: {message}") and result.stderr.count("\n") == 1
    assert not run_dir.exists()  # so the corrected command is not told the directory "already holds a run"
