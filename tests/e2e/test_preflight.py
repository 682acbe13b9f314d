"""What used to fail inside the ranks, after the run directory existed, or crash outright, is one line before anything
is written: data shorter than a batch, a sequence beyond the model's context, absurd sizes and rank counts."""

import pytest

from tests.e2e.helpers import DEBUG, train_refusal

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--data.path={tiny}"],
            "the training data is too small for 2 data shard(s) at this batch size: shard 0 gets 0",
        ),
        (["--train.micro_batch_size=1000000000"], "fewer than train.micro_batch_size=1000000000"),
        (
            ["--train.seq_len=1000", "--train.micro_batch_size=200"],
            "the validation data has",  # ~144k held-out tokens: 144 windows of 1,001, fewer than a batch of 200
        ),
        (["--train.seq_len=2048"], "train.seq_len = 2048 is beyond the model's context of 1024 positions"),
        (["--data.vocab_size=1000000000"], "data.vocab_size=1,000,000,000 is larger than the 1,048,576"),
        (["--train.steps=99999999999999999999"], "train.steps = 99999999999999999999 does not fit in a 64-bit integer"),
        (["--topology.num_clusters=100000000"], "= 100,000,000 local ranks"),
        (["--run.num_threads=100000"], "run.num_threads = 100,000 is more than this machine's"),
    ],
    ids=["data-short", "batch-huge", "val-short", "seq-beyond-model", "vocab-huge", "steps-int64", "ranks", "threads"],
)
def test_impossible_runs_are_one_line_before_anything_is_written(tmp_path, args, message):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("Hello there.\n")
    run_dir = tmp_path / "run"
    args = [a.format(tiny=tiny) for a in args]
    refusal = train_refusal("--config", DEBUG, f"--run.out_dir={run_dir}", *args)
    assert refusal is not None and "\n" not in refusal and message in refusal, refusal
    assert not run_dir.exists()
