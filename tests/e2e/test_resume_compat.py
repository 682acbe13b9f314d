"""Resuming with a config the checkpoint cannot continue is one line naming the field, before anything is written."""

import pytest

from dilocox.config import load_config
from dilocox.launch.preflight import preflight
from tests.e2e.helpers import DEBUG, dilocox

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """10 steps (one round) of the debug run, checkpointed at its end."""
    root = tmp_path_factory.mktemp("compat")
    run_dir = root / "base"
    result = dilocox("train", "--config", DEBUG, f"--run.out_dir={run_dir}", "--train.steps=10", "--eval.interval=0")
    assert result.returncode == 0, result.stderr[-3000:]
    corpus = root / "other.txt"  # another corpus: the same vocabulary size gives another BPE
    corpus.write_text("".join(f"Line {i}: the quick brown fox {i * 7 % 13} jumps over a dog.\n" for i in range(4000)))
    return run_dir, corpus


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--data.vocab_size=600"],
            "data.vocab_size was 512 in the checkpoint, 600 now; resume with --data.vocab_size=512",
        ),
        (["--train.seq_len=32"], "train.seq_len was 64 in the checkpoint, 32 now; resume with --train.seq_len=64"),
        (
            ["--compression.kind=int4"],
            "compression.kind was 'none' in the checkpoint, 'int4' now; resume with --compression.kind=none",
        ),
        (
            ["--topology.num_clusters=3"],
            "topology.num_clusters was 2 in the checkpoint, 3 now; resume with --topology.num_clusters=2",
        ),
        (
            ["--topology.dp_degree=2", "--sync.round.mode=time"],
            "topology.dp_degree was 1 in it, 2 now: time rounds (sync.round.mode = time) resume at the dp degree they "
            "were saved with; resume with --topology.dp_degree=1",
        ),
        (
            ["--sync.inner_steps=5"],
            "sync.inner_steps was 10 in the checkpoint, 5 now; resume with --sync.inner_steps=10",
        ),
        (["--data.path={corpus}"], "its tokenizer maps ids to other tokens than this run's (512 ids in the checkpoint"),
    ],
    ids=["vocab", "seq_len", "codec", "topology", "time_rounds_dp", "inner_steps", "tokenizer"],
)
def test_an_incompatible_resume_is_one_line_naming_the_field(base_run, tmp_path, args, message):
    """The launcher's checks (`preflight`), in this process: what `dilocox train` prints after `dilocox: error:`
    (exit 2, nothing written: the in-place test below runs the command)."""
    run_dir, corpus = base_run
    checkpoint = run_dir / "checkpoints" / "step_00000010"
    target = tmp_path / "resumed"
    args = [a.format(corpus=corpus) for a in args]
    flags = [f"--run.out_dir={target}", "--train.steps=20", f"--checkpoint.resume={checkpoint}", *args]
    cfg = load_config(DEBUG, flags)
    with pytest.raises(ValueError) as refused:
        preflight(cfg)
    assert str(refused.value).startswith(f"cannot resume {checkpoint}: ") and "\n" not in str(refused.value)
    assert message in str(refused.value) and "or start a new run directory" in str(refused.value)
    assert not target.exists()


def test_an_incompatible_resume_in_place_leaves_the_run_untouched(base_run):
    """checkpoint.resume = latest in the run's own directory: refused, config.toml and the checkpoint as they were;
    the same tokenizer named by its path resumes, and the settings the first steps ran with are kept."""
    run_dir, _ = base_run
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    result = dilocox("train", "--config", DEBUG, f"--run.out_dir={run_dir}", "--train.steps=20",
                     "--train.seq_len=128", "--checkpoint.resume=latest", timeout=120)  # fmt: skip
    assert result.returncode == 2 and "train.seq_len was 64 in the checkpoint, 128 now" in result.stderr
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    tokenizer = run_dir / "tokenizer.json"
    resumed = dilocox("train", "--config", DEBUG, f"--run.out_dir={run_dir}", "--train.steps=20",
                      f"--data.tokenizer={tokenizer}", "--eval.interval=0", "--checkpoint.resume=latest",
                      timeout=240)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]  # the same tokenizer by path: compatible
    assert "resuming from" in resumed.stdout
    assert (run_dir / "config.until_step_00000010.toml").read_bytes() == before[run_dir / "config.toml"]
