"""`dilocox train` and `dilocox eval` as a user runs them: a subprocess, real ranks, real files."""

import json
import os
import shutil

import pytest
import torch

from dilocox.checkpoint import list_checkpoints, load_rank_state, read_meta, verify_checkpoint
from dilocox.models import Decoder, model_args
from dilocox.optim import split_muon_parameters
from tests.e2e.helpers import (
    DEBUG,
    dilocox,
    metrics,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def debug_run(tmp_path_factory):
    """One DiLoCo debug run shared by the tests that only read its outputs. Its checkpoint of step 20 is written in the
    background while steps 21-40 train (the last one in the foreground): resuming it equals the straight run."""
    run_dir = tmp_path_factory.mktemp("e2e") / "debug"
    result = dilocox("train", "--config", DEBUG, f"--run.out_dir={run_dir}", "--checkpoint.keep=5",
                     "--checkpoint.async_save=true")  # fmt: skip
    return run_dir, result


def test_train_debug_writes_everything_and_learns(debug_run):
    run_dir, result = debug_run
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("config.toml", "metrics.jsonl", "summary.json", "tokenizer.json"):
        assert (run_dir / name).is_file(), name
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.5
    assert summary["steps"] == 40 and summary["outer_steps"] == 4
    assert summary["tokens"] == 40 * 8 * 64 * 2
    # H = 10: DiLoCo sends one model-sized all-reduce per round where AllReduce sends one per step
    assert summary["wan_bytes_total"] > 0
    assert summary["allreduce_equiv_bytes"] == 10 * summary["wan_bytes_total"]
    assert summary["link_busy_s"] > 0
    assert "checkpoint being written: " in result.stdout + result.stderr and summary["checkpoint_s"] > 0
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(5, 41, 5))
    for key in (
        "step",
        "outer_step",
        "loss",
        "tokens",
        "tokens_per_s",
        "wan_bytes_sent",
        "wan_bytes_recv",
        "exposed_comm_s",
        "peer_wait_s",
        "elapsed_s",
    ):
        assert key in rows[-1], key
    assert [r["step"] for r in rows if "eval_loss" in r] == [20, 40]
    assert rows[-1]["eval_loss"] == pytest.approx(summary["final_eval_loss"])
    # every evaluation scores the model the clusters agree on; the final one eval.final_max_batches (16 here)
    evals = [r for r in rows if "eval_loss" in r]
    assert {r["eval_model"] for r in evals} == {"agreed"}
    assert evals[0]["eval_tokens"] == 4 * 8 * 64  # eval.max_batches = 4 of 8 x 64 tokens during training
    assert summary["final_eval_tokens"] == rows[-1]["eval_tokens"] == 16 * 8 * 64
    assert [p.name for p in sorted((run_dir / "checkpoints").iterdir())] == ["step_00000020", "step_00000040"]
    assert "eval loss" in result.stdout and "AllReduce would send" in result.stdout
    assert f"waited {summary['exposed_comm_s']:.2f} s for the link" in result.stdout
    assert f"and {summary['peer_wait_s']:.2f} s for other clusters" in result.stdout


def test_eval_command_matches_training_eval(debug_run):
    run_dir, _ = debug_run
    # the final evaluation's batches (debug.toml: eval.final_max_batches = 16); tests/e2e/test_prepare_data.py
    # compares the whole split
    result = dilocox("eval", run_dir, "--json", "--max-batches", "16")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert out["step"] == 40
    assert out["loss"] == pytest.approx(summary["final_eval_loss"], abs=1e-6)
    text = run_dir / "some.txt"
    text.write_text("To be, or not to be, that is the question:\n" * 200)
    result = dilocox("eval", run_dir, "--data.path", text)
    assert result.returncode == 0, result.stderr
    assert "perplexity" in result.stdout and str(text) in result.stdout


def test_eval_scores_the_agreed_model_of_a_checkpoint_inside_training_as_the_log_did(tmp_path):
    """Inside a dilocox run (delayed sync) cluster 0's own weights differ from the agreed model the log scores:
    `dilocox eval` of the step-20 checkpoint on the log's batches gives the log's eval_loss, and --local its
    eval_loss_local; it runs on the run's run.num_threads."""
    run_dir = tmp_path / "dilocox"
    result = dilocox("train", "--config", DEBUG, f"--run.out_dir={run_dir}", "--preset=dilocox-lowrank",
                     "--train.steps=30", "--eval.local=true", "--checkpoint.keep=5")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    logged = {r["step"]: r for r in metrics(run_dir) if "eval_loss" in r}[20]
    checkpoint = run_dir / "checkpoints" / "step_00000020"
    # eval.max_batches = 4 during training
    agreed = json.loads(dilocox("eval", run_dir, "--checkpoint", checkpoint, "--max-batches", "4", "--json").stdout)
    local = json.loads(
        dilocox("eval", run_dir, "--checkpoint", checkpoint, "--max-batches", "4", "--local", "--json").stdout
    )
    assert (agreed["step"], agreed["model"], local["model"]) == (20, "agreed", "local")
    assert agreed["tokens"] == local["tokens"] == logged["eval_tokens"]
    assert agreed["loss"] == pytest.approx(logged["eval_loss"], abs=1e-6)
    assert local["loss"] == pytest.approx(logged["eval_loss_local"], abs=1e-6)
    assert abs(agreed["loss"] - local["loss"]) > 1e-3  # the two models differ here: the choice matters

    threads = (os.cpu_count() or 1) + 1  # not torch's default of one per core
    config = run_dir / "config.toml"
    config.write_text(config.read_text().replace("num_threads = 1\n", f"num_threads = {threads}\n", 1))
    result = dilocox("eval", run_dir, "--max-batches", "1", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["num_threads"] == threads


def test_resume_equals_uninterrupted_run(debug_run, tmp_path):
    """Steps 1-20, checkpoint, resume, steps 21-40 give the losses of the straight 40-step run."""
    run_dir, _ = debug_run
    resumed = tmp_path / "resumed"
    result = dilocox(
        "train",
        "--config",
        DEBUG,
        f"--run.out_dir={resumed}",
        f"--checkpoint.resume={run_dir / 'checkpoints' / 'step_00000020'}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    straight = {r["step"]: r for r in metrics(run_dir)}
    again = metrics(resumed)
    assert [r["step"] for r in again] == [25, 30, 35, 40]
    for row in again:
        assert row["loss"] == straight[row["step"]]["loss"]
        assert row["wan_bytes_sent"] == straight[row["step"]]["wan_bytes_sent"]
    assert again[-1]["eval_loss"] == straight[40]["eval_loss"]

    # resuming "latest" in place re-runs nothing past the last step and keeps metrics.jsonl one line per step
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "checkpoints" / "step_00000040")
    result = dilocox("train", "--config", DEBUG, f"--run.out_dir={copy}", "--checkpoint.resume=latest")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["step"] for r in metrics(copy)] == [r["step"] for r in metrics(run_dir)]
    assert metrics(copy)[-1]["loss"] == metrics(run_dir)[-1]["loss"]


def test_a_corrupt_checkpoint_falls_back_and_a_diverged_run_writes_none(debug_run, tmp_path):
    """A bit flip in the newest checkpoint: `latest` says so in one line and resumes the one before, which
    ends where the straight run ended. A run that diverges stops with one line, exit 2, and writes no checkpoint."""
    run_dir, _ = debug_run
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    newest = copy / "checkpoints" / "step_00000040" / "__1_0.distcp"  # what rank 1 wrote
    data = bytearray(newest.read_bytes())
    data[len(data) // 3] ^= 0x10
    newest.write_bytes(bytes(data))
    result = dilocox("train", "--config", DEBUG, f"--run.out_dir={copy}", "--checkpoint.resume=latest",
                     "--checkpoint.keep=5")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "skipping corrupt checkpoint" in result.stderr and "__1_0.distcp does not match its sha256" in result.stderr
    assert metrics(copy)[-1]["loss"] == metrics(run_dir)[-1]["loss"]  # resumed at step 20, not from the bad 40

    # Without the guard the first non-finite loss stops the run.
    diverged = tmp_path / "diverged"
    result = dilocox("train", "--config", DEBUG, f"--run.out_dir={diverged}", "--train.lr=1e3",
                     "--train.grad_clip=0", "--sync.guard.enabled=false")  # fmt: skip
    assert result.returncode == 2
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("dilocox: error:")]
    assert "training diverged" in line and "no checkpoint was written" in line
    assert not (diverged / "checkpoints").exists() or not list((diverged / "checkpoints").glob("step_*"))
    # With it (the default) each cluster heals to the agreed parameters and tries again; a run that stays
    # non-finite stops after sync.guard.max_bad_rounds rounds, and what it checkpointed is finite (the agreed params).
    guarded = tmp_path / "guarded"
    result = dilocox("train", "--config", DEBUG, f"--run.out_dir={guarded}", "--train.lr=1e3",
                     "--train.grad_clip=0")  # fmt: skip
    assert result.returncode == 2
    assert result.stdout.count("restarts round") >= 2
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("dilocox: error:")]
    assert "own update was non-finite" in line and "3 rounds in a row" in line
    for path in (guarded / "checkpoints").glob("step_*"):
        for rank in range(read_meta(path)["world_size"]):
            state = load_rank_state(path, rank)
            assert all(torch.isfinite(t).all() for t in state["model"].values()), (path, rank)


def test_a_run_whose_eval_loss_climbs_stops_in_one_line_before_a_checkpoint_of_it(tmp_path):
    """An outer step far too large (AdamW at lr 0.7): the agreed model's eval loss climbs from ~6.2 to ~40, above
    eval.divergence_ratio x its lowest. The run stops at that eval in one line, exit 2, with the eval logged, no
    summary.json (not a finished run) and the checkpoint before it intact; with the ratio at 0 it finishes."""
    flags = ["train", "--config", DEBUG, "--preset=diloco", "--sync.outer.optimizer=adamw", "--sync.outer.lr=0.7",
             "--train.steps=20", "--sync.inner_steps=5", "--checkpoint.interval=5", "--eval.interval=10"]  # fmt: skip
    run_dir = tmp_path / "diverging"
    result = dilocox(*flags, f"--run.out_dir={run_dir}")
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("dilocox: error:")]
    assert "training diverged" in line and "at step 10: the agreed model's eval loss is " in line
    assert "above eval.divergence_ratio = 1.5 x its lowest so far" in line and "lower sync.outer.lr" in line
    assert f"the last checkpoint, {run_dir / 'checkpoints' / 'step_00000005'}, is from before it" in line
    evals = [r["eval_loss"] for r in metrics(run_dir) if "eval_loss" in r]
    assert evals[-1] > 1.5 * 6 and [r["step"] for r in metrics(run_dir)][-1] == 10
    assert not (run_dir / "summary.json").exists()
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_00000005"]
    verify_checkpoint(list_checkpoints(run_dir)[0])

    result = dilocox(*flags, f"--run.out_dir={tmp_path / 'unchecked'}", "--eval.divergence_ratio=0")
    assert result.returncode == 0, result.stderr[-3000:]


def test_allreduce_baseline_sends_its_own_yardstick(tmp_path):
    run_dir = tmp_path / "ar"
    result = dilocox(
        "train",
        "--config",
        DEBUG,
        f"--run.out_dir={run_dir}",
        "--sync.kind=allreduce",
        "--train.steps=20",
        "--eval.interval=0",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["wan_bytes_total"] == summary["allreduce_equiv_bytes"] > 0
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]


def test_every_outer_round_is_logged_when_h_is_not_a_multiple_of_the_log_interval(tmp_path):
    """H = 6 with a line every 5 steps: rounds end at 6, 12, ..., 18 and at the last step; each has its record."""
    run_dir = tmp_path / "h6"
    result = dilocox("train", "--config", DEBUG, f"--run.out_dir={run_dir}", "--train.steps=20", "--sync.inner_steps=6",
                     "--metrics.log_interval=5", "--checkpoint.interval=0", "--eval.interval=0")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(run_dir)
    rounds = {r["step"]: r["round_inner_steps"] for r in rows if "round_inner_steps" in r}
    assert rounds == {6: 6, 12: 6, 18: 6, 20: 2}  # the last round is cut short by train.steps
    assert [r["step"] for r in rows] == [5, 6, 10, 12, 15, 18, 20]


@pytest.mark.gpu
def test_two_clusters_on_one_gpu_train_like_on_cpu_and_resume_on_cpu(tmp_path):
    """The one-GPU check: 2 clusters of 1 rank share cuda:0 (NCCL is not needed inside a 1-rank cluster, the slow
    link is gloo from host memory), reach the CPU run's loss, and the GPU run's checkpoint resumes on the CPU."""
    common = ["--config", DEBUG, "--preset=dilocox-lowrank", "--train.steps=40", "--checkpoint.interval=20"]
    runs = {}
    for device in ("cpu", "cuda"):
        run_dir = tmp_path / device
        result = dilocox("train", *common, f"--run.out_dir={run_dir}", f"--run.device={device}")
        assert result.returncode == 0, result.stderr[-3000:]
        runs[device] = json.loads((run_dir / "summary.json").read_text())
    assert runs["cuda"]["final_eval_loss"] == pytest.approx(runs["cpu"]["final_eval_loss"], rel=0.02)
    assert runs["cuda"]["wan_bytes_total"] == runs["cpu"]["wan_bytes_total"]  # exact bytes on either device
    resumed = tmp_path / "cuda-then-cpu"
    shutil.copytree(tmp_path / "cuda", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000040")
    result = dilocox("train", *common, f"--run.out_dir={resumed}", "--run.device=cpu", "--checkpoint.resume=latest")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["final_eval_loss"] == pytest.approx(runs["cpu"]["final_eval_loss"], rel=0.02)


def test_bf16_with_activation_checkpointing_trains(tmp_path):
    run_dir = tmp_path / "bf16"
    result = dilocox("train", "--config", DEBUG, f"--run.out_dir={run_dir}", "--train.steps=20", "--eval.interval=0",
                     "--train.dtype=bf16", "--train.activation_checkpointing", "--checkpoint.interval=0")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.5
    assert 'dtype = "bf16"' in (run_dir / "config.toml").read_text()
    bad = dilocox("train", "--config", DEBUG, f"--run.out_dir={tmp_path / 'bad'}", "--train.dtype=fp8")
    assert bad.returncode == 2 and "train.dtype = 'fp8' is not one of: fp32, bf16" in bad.stderr


@pytest.mark.parametrize("reduction", ["gather", "scalable"])
def test_dilocox_compressed_trains_and_resumes_with_a_delayed_update_in_flight(tmp_path, reduction):
    """lowrank_int4 trains; the checkpoint at step 20 holds round 2's sync (not yet applied), the error-feedback
    residuals and the codec's warm starts (shared ones, for the scalable reduction); the resumed run continues
    exactly."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = [
        "--config",
        DEBUG,
        "--preset=dilocox-lowrank",
        "--compression.kind=lowrank_int4",
        f"--compression.reduction={reduction}",
        "--checkpoint.keep=5",
        "--metrics.log_interval=1",
    ]
    result = dilocox("train", *common, f"--run.out_dir={straight}")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["sync_delay"] == 1 and summary["hidden_comm_fraction"] is not None
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.5
    # 10 steps per round and a ~40x codec: far fewer bytes than AllReduce
    assert summary["allreduce_equiv_bytes"] > 100 * summary["wan_bytes_total"]
    rounds = [r for r in metrics(straight) if "round_compression_ratio" in r]
    assert rounds and all(r["round_compression_ratio"] > 10 and r["round_rank"] == 8 for r in rounds)
    assert all(r["round_bits_per_value"] == pytest.approx(32 / r["round_compression_ratio"]) for r in rounds)
    result = dilocox(
        "train",
        *common,
        f"--run.out_dir={resumed}",
        f"--checkpoint.resume={straight / 'checkpoints' / 'step_00000020'}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    want = {r["step"]: r for r in metrics(straight)}
    got = metrics(resumed)
    assert [r["step"] for r in got] == list(range(21, 41))
    for row in got:
        assert row["loss"] == want[row["step"]]["loss"], row["step"]
    assert got[-1]["eval_loss"] == want[40]["eval_loss"]
    assert json.loads((resumed / "summary.json").read_text())["wan_bytes_total"] == summary["wan_bytes_total"]


def test_adaptive_codec_state_stays_bounded_over_rounds_and_a_late_resume_is_exact(tmp_path):
    """H = 1 and compression.window = 2: the adaptive codec's checkpointed history holds the last 2 rounds whether
    written after 4 rounds or 8 (the same exact shapes), each round logs every matrix's rank, and a run resumed at
    round 8 logs the losses, ranks and final eval loss of the run that never stopped."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = [
        "--config",
        DEBUG,
        "--preset=dilocox-lowrank",
        "--sync.inner_steps=1",
        "--compression.window=2",
        "--train.steps=12",
        "--checkpoint.interval=4",
        "--checkpoint.keep=5",
        "--metrics.log_interval=1",
        "--eval.interval=0",
        "--eval.final_max_batches=2",
    ]
    result = dilocox("train", *common, f"--run.out_dir={straight}")
    assert result.returncode == 0, result.stderr[-3000:]
    policies = {}
    for step in (4, 8):
        state = load_rank_state(straight / "checkpoints" / f"step_{step:08d}", 0)
        policies[step] = state["sync"]["fragments"][0]["reducer"]["codec"]["policy"]
        assert policies[step]["history"][:, 0].tolist() == [step - 2, step - 1]  # 0-based rounds: the last two
    num_matrices = policies[4]["matrix_ranks"].shape[-1]
    assert num_matrices > 0 and policies[8]["matrix_ranks"].shape == policies[4]["matrix_ranks"].shape
    assert policies[4]["matrix_ranks"].shape == (2, 2, num_matrices)
    want = {r["step"]: r for r in metrics(straight)}
    rounds = [r for r in want.values() if "round_matrix_ranks" in r]
    assert len(rounds) == 11  # the first round's sync is applied a round later (sync_delay = 1)
    assert all(len(r["round_matrix_ranks"]) == num_matrices for r in rounds)
    result = dilocox(
        "train",
        *common,
        f"--run.out_dir={resumed}",
        f"--checkpoint.resume={straight / 'checkpoints' / 'step_00000008'}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    got = metrics(resumed)
    assert [r["step"] for r in got] == list(range(9, 13))
    for row in got:
        assert row["loss"] == want[row["step"]]["loss"], row["step"]
        assert row["round_matrix_ranks"] == want[row["step"]]["round_matrix_ranks"], row["step"]
    assert got[-1]["eval_loss"] == want[12]["eval_loss"]


def test_pipeline_two_stages_matches_unsplit_and_resumes(debug_run, tmp_path):
    """2 clusters x 2 stages (4 ranks) follow the 1-stage loss curve, and resume exactly."""
    unsplit, _ = debug_run
    staged, resumed = tmp_path / "staged", tmp_path / "staged-resumed"
    common = ["--config", DEBUG, "--topology.pp_degree=2", "--checkpoint.keep=5"]
    result = dilocox("train", *common, f"--run.out_dir={staged}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "stage" in result.stdout and "largest rank state" in result.stdout
    want = {r["step"]: r for r in metrics(unsplit)}
    for row in metrics(staged):
        assert row["loss"] == pytest.approx(want[row["step"]]["loss"], abs=1e-4)
        assert row["wan_bytes_sent"] < want[row["step"]]["wan_bytes_sent"] or row["wan_bytes_sent"] == 0
    summary = json.loads((staged / "summary.json").read_text())
    assert summary["final_eval_loss"] == pytest.approx(
        json.loads((unsplit / "summary.json").read_text())["final_eval_loss"], abs=1e-4
    )
    assert len(summary["rank_state_bytes"]) == 4
    assert {r["stage"] for r in summary["rank_state_bytes"]} == {0, 1}
    result = dilocox(
        "train", *common, f"--run.out_dir={resumed}", f"--checkpoint.resume={staged / 'checkpoints' / 'step_00000020'}"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    straight = {r["step"]: r for r in metrics(staged)}
    for row in metrics(resumed):
        assert row["loss"] == straight[row["step"]]["loss"]


def test_muon_inner_optimizer_learns(debug_run, tmp_path):
    """train.optimizer = muon on the debug run: the loss goes down as far as with AdamW's, and each rank's inner
    state is AdamW's less one fp32 buffer per element of the blocks' matrices (Muon keeps one, AdamW two)."""
    adamw_dir, _ = debug_run
    run_dir = tmp_path / "muon"
    result = dilocox("train", "--config", DEBUG, f"--run.out_dir={run_dir}", "--train.optimizer=muon")
    assert result.returncode == 0, result.stderr[-3000:]
    summary, adamw = (json.loads((d / "summary.json").read_text()) for d in (run_dir, adamw_dir))
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.5
    assert summary["final_eval_loss"] < adamw["final_eval_loss"] + 0.1
    muon, _ = split_muon_parameters(Decoder(model_args("debug", vocab_size=512)))  # the blocks: any vocabulary
    matrices = sum(p.numel() for _, p in muon)
    for with_muon, with_adamw in zip(summary["rank_state_bytes"], adamw["rank_state_bytes"], strict=True):
        assert with_adamw["inner_state"] - with_muon["inner_state"] == 4 * matrices


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--sync.inner_steps=0"], "sync.inner_steps"),
        (["--train.optimizer=muon", "--train.muon_lr=0"], "train.muon_lr"),
        (["--model.flavor=huge"], "model.flavor"),
        (["--data.path=/nonexistent/corpus.txt"], "data.path"),
        (["--train.stepz=3"], "train.steps"),
        (["--checkpoint.resume=latest"], "checkpoint.resume"),
        (["--topology.clusters=,,"], "topology.clusters = ',,' has an empty entry"),  # not an ordinary run
        (["--topology.clusters=dp2,,dp1"], "topology.clusters = 'dp2,,dp1' has an empty entry"),  # not 2 clusters
        (["--sync.round.mode=time", "--sync.round.seconds=1e-9"], "sync.round.seconds = 1e-09 is less than H = 10"),
        pytest.param(
            ["--run.device=cuda"],
            "run.device = cuda",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: cuda is not an error"),
        ),
    ],
)
def test_bad_config_exits_nonzero_naming_the_field(tmp_path, args, field):
    run_dir = tmp_path / "bad"
    result = dilocox("train", "--config", DEBUG, f"--run.out_dir={run_dir}", *args, timeout=60)
    assert result.returncode == 2
    assert field in result.stderr
    assert result.stderr.startswith("dilocox: error:")
    assert "Traceback" not in result.stderr
    assert not run_dir.exists()


def test_a_finished_run_is_never_rewritten_by_another_setting_nor_resumed_to_train_nothing(debug_run, tmp_path):
    """A finished 1Gbps run rerun with --network.bandwidth=100Mbps: the new run trains in DIR-2 and says so, the
    finished one keeps every byte (config.toml and summary.json still say 1Gbps). Resuming it explicitly at its last
    step would train nothing: refused in one line, nothing written."""
    run_dir, _ = debug_run
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    result = dilocox("train", "--config", DEBUG, f"--run.out_dir={copy}", "--network.bandwidth=100Mbps",
                     "--train.steps=10", "--eval.interval=0", timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"dilocox: {copy} holds a run of other settings (network.bandwidth: '1Gbps' -> '100Mbps'" in result.stdout
    assert f"so this run is a new one in {copy}-2" in result.stdout
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()} == before
    assert json.loads((tmp_path / "copy-2" / "summary.json").read_text())["bandwidth"] == "100Mbps"
    result = dilocox("train", "--config", DEBUG, f"--run.out_dir={copy}", "--network.bandwidth=100Mbps",
                     "--checkpoint.resume=latest", timeout=120)  # fmt: skip
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr[-3000:]
    assert "step_00000040 is the end of its run (train.steps = 40): nothing is left to train" in result.stderr
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()} == before


def test_help_lists_options_with_docstrings():
    result = dilocox("train", "--help", timeout=60)
    assert result.returncode == 0
    assert "--sync.inner_steps=INT" in result.stdout
    assert "H: local inner steps between two outer syncs" in result.stdout


def test_lighthouse_bad_input_is_one_line_and_exit_2():
    pytest.importorskip("torchft")
    for args, message in [
        (["--bind", "nonsense"], "dilocox: error: the Lighthouse could not start on nonsense: invalid socket address"),
        (["--bind"], "dilocox: error: --bind needs a value: --bind BIND"),
        (["--network.heartbeat=0"], "dilocox: error: network.heartbeat = '0' must be > 0, e.g. '5s'"),
    ]:
        result = dilocox("lighthouse", *args, timeout=60)
        assert (result.returncode, result.stderr.strip(), result.stdout) == (2, message, ""), args
    result = dilocox("lighthouse", "--help", timeout=60)
    assert result.returncode == 0 and "--network.lighthouse" in result.stdout


def test_a_cluster_that_diverges_heals_and_the_run_finishes(tmp_path):
    """faults.kind = diverge: cluster 1's parameters go NaN in round 2. It abstains, the others leave it out, it
    restarts round 3 from the agreed parameters, and the run ends normally with the exclusion counted."""
    run_dir = tmp_path / "heal"
    result = dilocox("train", "--config", DEBUG, f"--run.out_dir={run_dir}", "--preset=dilocox-lowrank",
                     "--topology.num_clusters=3", "--faults.kind=diverge", "--faults.cluster=1",
                     "--faults.rounds=2")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "guard: round 2: cluster 1's update left out (it sent none: its own was non-finite)" in result.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["guard_excluded_updates"] == 1 and summary["guard_skipped_rounds"] == 0
    rounds = [r for r in metrics(run_dir) if "round_excluded" in r]
    assert [r["round_excluded"] for r in rounds] == [0, 1, 0]  # syncs of rounds 1, 2 and (flushed at step 40) 4
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.5


def test_a_cluster_that_sends_sign_flipped_updates_is_left_out_of_every_round_it_lies_in(tmp_path):
    """faults.kind = sign: cluster 2 of 3 sends its pseudo-gradients negated from round 2 on. Its norm is normal, so
    only the peer check sees it (it points away from both others): one guard line per round, each round's metrics
    name it, and the summary counts the exclusions. Without the drained residual: drained residuals are noise to each
    other (their cosines near 0), so whether a negated one points away depends on the CPU's float rounding."""
    run_dir = tmp_path / "sign"
    result = dilocox("train", "--config", DEBUG, f"--run.out_dir={run_dir}", "--preset=dilocox-lowrank",
                     "--topology.num_clusters=3", "--faults.kind=sign", "--faults.cluster=2",
                     "--sync.drain_residual=false", "--checkpoint.interval=0")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("guard:") and "left out" in line]
    assert [line.split(" (")[0] for line in lines] == [
        f"guard: round {round_index}: cluster 2's update left out" for round_index in (2, 3, 4)
    ]
    assert all("(it points away from the others" in line for line in lines)
    rounds = [r for r in metrics(run_dir) if "round_excluded" in r]
    # step 20: round 1's sync; step 30: round 2's; step 40: round 3's, then the final flush's round 4
    assert [[(e["round"], e["cluster"]) for e in r.get("round_exclusions", [])] for r in rounds] == [
        [],
        [(2, 2)],
        [(3, 2), (4, 2)],
    ]
    assert [r["round_excluded"] for r in rounds] == [0, 1, 2]
    assert all("points away" in e["why"] for r in rounds for e in r.get("round_exclusions", []))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["guard_excluded_updates"] == len(lines) == 3 and summary["guard_skipped_rounds"] == 0


def test_an_outer_adamw_trains_from_the_cli_and_the_drain_it_cannot_take_is_refused_in_one_line(tmp_path):
    """--sync.outer.optimizer=adamw: the debug run learns, its clusters end with the same outer params, and the
    checkpoint holds AdamW's moments. The dilocox preset's drained residual assumes an SGD step, so with adamw it is
    refused."""
    run_dir = tmp_path / "adamw"
    result = dilocox("train", "--config", DEBUG, f"--run.out_dir={run_dir}", "--preset=dilocox",
                     "--sync.outer.optimizer=adamw", "--sync.outer.lr=0.03", "--sync.drain_residual=false")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.5
    last = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    states = [load_rank_state(last, rank)["sync"]["fragments"][0] for rank in range(read_meta(last)["world_size"])]
    assert len(states) == 2 and torch.equal(states[0]["outer_params"], states[1]["outer_params"])
    assert {"exp_avg", "exp_avg_sq"} <= set(states[0]["outer_optimizer"]["state"][0])
    refused = tmp_path / "refused"
    result = dilocox("train", "--config", DEBUG, f"--run.out_dir={refused}", "--preset=dilocox",
                     "--sync.outer.optimizer=adamw", "--sync.drain_residual=true", timeout=60)  # fmt: skip
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr[-3000:]
    assert result.stderr.startswith(
        "dilocox: error: sync.drain_residual = true does not work with sync.outer.optimizer = 'adamw'"
    )
    assert "set sync.drain_residual = false" in result.stderr and not refused.exists()
