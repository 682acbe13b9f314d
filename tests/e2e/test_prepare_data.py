"""`dilocox prepare-data` then `dilocox train --data.path=DIR` as a user runs them: subprocesses, real ranks, files."""

import json
from pathlib import Path

import numpy as np
import pytest

from dilocox.data.tokenfiles import describe_token_file
from tests.e2e.helpers import DEBUG, dilocox, metrics

pytestmark = pytest.mark.e2e
WORDS = "the king queen sword crown night day love death river stone fire hope fear bright dark".split()
# The tiny model for two DiLoCo rounds: 2 clusters, H = 5, a checkpoint after the first, evaluations at 0 and 10.
TRAIN = [
    "--config",
    DEBUG,
    "--model.flavor=tiny",
    "--data.vocab_size=512",
    "--train.steps=10",
    "--train.seq_len=32",
    "--train.micro_batch_size=4",
    "--sync.inner_steps=5",
    "--checkpoint.interval=5",
    "--eval.interval=10",
    "--eval.final_max_batches=0",  # the whole split, as `dilocox eval` scores it below
    "--metrics.log_interval=5",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """40 .jsonl documents and 3 .txt ones of random words, ~60k characters."""
    directory = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)

    def text(num_words: int) -> str:
        words = rng.choice(WORDS, size=num_words)
        return "\n".join(" ".join(words[i : i + 12]) for i in range(0, num_words, 12)) + "\n"

    lines = [json.dumps({"text": text(200)}) for _ in range(40)]
    (directory / "docs.jsonl").write_text("\n".join(lines) + "\n")
    for i in range(3):
        (directory / f"extra{i}.txt").write_text(text(300))
    return directory


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory) -> tuple[Path, Path]:
    """The corpus prepared through the CLI, and a training run from it."""
    out = tmp_path_factory.mktemp("prepared") / "data"
    result = dilocox("prepare-data", corpus, "--out", out, "--vocab-size", "512", "--tokens-per-file", "3000")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"train with --data.path={out}" in result.stdout and "validation tokens" in result.stdout
    run_dir = out.parent / "run"
    result = dilocox("train", *TRAIN, f"--data.path={out}", f"--run.out_dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    return out, run_dir


def test_training_from_a_prepared_directory_equals_the_in_memory_path(corpus, prepared, tmp_path):
    out, run_dir = prepared
    index = json.loads((out / "dilocox-index.json").read_text())
    assert len(index["files"]["train"]) > 3  # windows straddle the 3,000-token files
    in_memory = tmp_path / "in_memory"
    result = dilocox("train", *TRAIN, f"--data.path={corpus}", f"--run.out_dir={in_memory}")
    assert result.returncode == 0, result.stderr[-3000:]
    # Same tokens, same mixed deal, same batches: every logged loss and both evaluations are equal, bit for bit.
    on_disk, in_ram = metrics(run_dir), metrics(in_memory)
    assert [r["step"] for r in on_disk] == [5, 10]
    assert [(r["loss"], r.get("eval_loss")) for r in on_disk] == [(r["loss"], r.get("eval_loss")) for r in in_ram]
    assert on_disk[-1]["eval_loss"] < json.loads((run_dir / "summary.json").read_text())["initial_eval_loss"]
    assert (run_dir / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()

    # `dilocox eval` of that run reads the prepared validation split through the run's copy of the tokenizer.
    result = dilocox("eval", run_dir, "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["loss"] == pytest.approx(on_disk[-1]["eval_loss"], abs=1e-6)


def test_a_run_from_a_prepared_directory_resumes_bit_for_bit(prepared, tmp_path):
    out, run_dir = prepared
    resumed = tmp_path / "resumed"
    result = dilocox(
        "train",
        *TRAIN,
        f"--data.path={out}",
        f"--run.out_dir={resumed}",
        f"--checkpoint.resume={run_dir / 'checkpoints' / 'step_00000005'}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    straight = {r["step"]: r for r in metrics(run_dir)}
    again = metrics(resumed)
    assert [r["step"] for r in again] == [10]
    assert again[0]["loss"] == straight[10]["loss"] and again[0]["eval_loss"] == straight[10]["eval_loss"]

    # The data position of a mixed deal does not resume a contiguous run.
    result = dilocox(
        "train",
        *TRAIN,
        f"--data.path={out}",
        f"--run.out_dir={tmp_path / 'other'}",
        "--data.shard=contiguous",
        f"--checkpoint.resume={run_dir / 'checkpoints' / 'step_00000005'}",
    )
    assert result.returncode == 2 and result.stderr.startswith("dilocox: error: cannot resume")
    assert "data.shard was 'mixed' in the checkpoint, 'contiguous' now; resume with --data.shard=mixed" in result.stderr
    assert not (tmp_path / "other").exists()  # refused before anything was written


def test_prepare_data_refuses_bad_input_with_one_line(corpus, prepared, tmp_path):
    out, _ = prepared
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "empty.txt").write_text("\n\n")
    cases = [
        (["prepare-data", tmp_path / "missing", "--out", tmp_path / "a"], "does not exist"),
        (["prepare-data", tmp_path / "blank", "--out", tmp_path / "a"], "contains no text"),
        (["prepare-data", corpus, "--out", out], "already holds prepared data; pass --overwrite"),
        (["prepare-data", corpus], "needs SRC and --out DIR"),
        (["prepare-data", corpus, "--out", tmp_path / "a", "--vocab-size", "many"], "invalid int value"),
    ]
    for args, message in cases:
        result = dilocox(*args, timeout=60)
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("dilocox: error:") and message in result.stderr.splitlines()[0]
        assert "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blank"]


@pytest.mark.parametrize("damage", ["ids beyond the vocabulary", "damaged file"])
def test_prepared_data_that_does_not_fit_its_tokenizer_is_refused_before_the_run_directory(corpus, tmp_path, damage):
    out = tmp_path / "data"
    assert dilocox("prepare-data", corpus, "--out", out, "--vocab-size", "512").returncode == 0
    index = json.loads((out / "dilocox-index.json").read_text())
    file = out / index["files"]["train"][0]["file"]
    ids = np.fromfile(file, dtype="<u2")
    if damage == "ids beyond the vocabulary":  # shards written by another tool, with an index that describes them
        ids[len(ids) // 2] = index["vocab_size"]
        ids.tofile(file)
        index["files"]["train"][0].update(describe_token_file(file, np.dtype("<u2")))
        (out / "dilocox-index.json").write_text(json.dumps(index))
        want = f"{file.name} holds token id {index['vocab_size']}, but the tokenizer has {index['vocab_size']} ids"
    else:  # a bit flipped on disk
        ids[3] ^= 1
        ids.tofile(file)
        want = f"{file.name} does not match its digest in dilocox-index.json (damaged or replaced)"
    run_dir = tmp_path / "run"
    result = dilocox("train", *TRAIN, f"--data.path={out}", f"--run.out_dir={run_dir}", timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith("dilocox: error: data.path=") and len(result.stderr.splitlines()) == 1
    assert want in result.stderr and "prepare-data" in result.stderr
    assert not run_dir.exists()
