"""Hugging Face in and out through the CLI: `dilocox export` of real runs (1 and 2 pipeline stages) loaded by
transformers, `dilocox eval` of a pipeline-split run, and `model.init_from` of a model transformers made."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dilocox.checkpoint import list_checkpoints, load_rank_state, saved_outer_params
from dilocox.cli import main
from dilocox.config import load_config
from dilocox.data import EOS_TOKEN, Tokenizer, iter_eval_batches, load_documents, prepare_tokens
from dilocox.trainer import build_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
SEQ_LEN, BATCH, EVAL_BATCHES = 32, 4, 2


def dilocox(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dilocox", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ),
        cwd=REPO,
    )


def train_args(corpus: Path, run_dir: Path, *extra: str) -> list[str]:
    """4 steps of the debug flavor, H = 2 of blocking DiLoCo (`extra` may name another preset), a checkpoint every 2
    steps, on 4 plays."""
    return [
        "train",
        "--preset=diloco",
        "--model.flavor=debug",
        f"--data.path={corpus}",
        "--data.vocab_size=300",
        "--data.val_fraction=0.25",
        "--train.steps=4",
        f"--train.seq_len={SEQ_LEN}",
        f"--train.micro_batch_size={BATCH}",
        "--train.warmup_steps=1",
        "--train.lr=3e-3",
        "--sync.inner_steps=2",
        "--checkpoint.interval=2",
        "--checkpoint.keep=5",
        "--eval.interval=0",
        f"--eval.max_batches={EVAL_BATCHES}",
        f"--eval.final_max_batches={EVAL_BATCHES}",
        "--metrics.progress=false",
        "--network.bandwidth=unlimited",
        "--network.latency=0",
        f"--run.out_dir={run_dir}",
        *extra,
    ]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def eval_batches(run_dir: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The validation batches the run's evaluations scored."""
    cfg = load_config(run_dir / "config.toml")
    data = prepare_tokens(
        path=cfg.data.path,
        tokenizer=str(run_dir / "tokenizer.json"),
        val_fraction=cfg.data.val_fraction,
        seed=cfg.run.seed,
    )
    return list(iter_eval_batches(data.val, seq_len=SEQ_LEN, batch_size=BATCH, max_batches=EVAL_BATCHES))


@torch.no_grad()
def hf_eval_loss(model, batches) -> float:
    """Mean token loss of a transformers model on the batches, as the trainer's evaluate() averages it."""
    losses = [
        F.cross_entropy(model(inputs).logits.flatten(0, 1), targets.flatten()).item() for inputs, targets in batches
    ]
    return sum(losses) / len(losses)


def dilocox_model(run_dir: Path, step: int):
    """The run's whole model with cluster 0's weights at `step`, put together from its stages' rank files."""
    cfg = load_config(run_dir / "config.toml")
    path = run_dir / "checkpoints" / f"step_{step:08d}"
    model = build_model(cfg, Tokenizer.from_file(run_dir / "tokenizer.json").vocab_size)
    state = {}
    for rank in range(cfg.topology.pp_degree):  # cluster 0, replica 0: ranks 0 .. pp_degree - 1
        state.update(load_rank_state(path, rank)["model"])
    model.load_state_dict(state)
    return model.eval()


def load_hf(directory: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 1-stage dilocox run and a 2-stage DiLoCo run, 2 clusters each, on 4 plays."""
    root = tmp_path_factory.mktemp("hf")
    corpus = root / "corpus"
    corpus.mkdir()
    for index, play in enumerate(load_documents()[:4]):
        (corpus / f"play{index}.txt").write_text(play)
    one, two = root / "pp1", root / "pp2"
    for run_dir, extra in ((one, ["--preset=dilocox-lowrank"]), (two, ["--topology.pp_degree=2"])):
        result = dilocox(*train_args(corpus, run_dir, *extra))
        assert result.returncode == 0, result.stderr[-3000:]
    return corpus, one, two


def test_export_of_a_run_loads_in_transformers_with_the_same_logits_and_tokens(runs, tmp_path):
    _, run_dir, _ = runs
    out = tmp_path / "hf"
    result = dilocox("export", run_dir, "--format", "hf", "--out", out)
    assert result.returncode == 0, result.stderr
    assert "step 4 (outer parameters" in result.stdout and "Qwen2ForCausalLM" in result.stdout
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    # the outer params exported are the model every cluster holds after the last step
    ranks = [load_rank_state(run_dir / "checkpoints" / "step_00000004", rank) for rank in range(2)]
    assert torch.equal(saved_outer_params(ranks[0]["sync"]), saved_outer_params(ranks[1]["sync"]))

    hf, ours = load_hf(out), dilocox_model(run_dir, 4)
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    batches = eval_batches(run_dir)
    with torch.no_grad():
        torch.testing.assert_close(hf(batches[0][0]).logits, ours(batches[0][0]), atol=1e-4, rtol=0)
    assert hf_eval_loss(hf, batches) == pytest.approx(summary(run_dir)["final_eval_loss"], abs=1e-4)

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    reference = Tokenizer.from_file(run_dir / "tokenizer.json")
    for text in ("To be, or not to be, that is the question:", f"naïve café 日本語 {EOS_TOKEN} and\n\ttabs"):
        ids = reference.encode(text)
        assert tokenizer(text)["input_ids"] == ids
        assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id == reference.eos_id == hf.config.eos_token_id


def test_pipeline_split_run_is_evaluated_and_exported_whole(runs, tmp_path, capsys):
    _, _, run_dir = runs
    final = summary(run_dir)["final_eval_loss"]
    result = dilocox("eval", run_dir, "--json", "--max-batches", EVAL_BATCHES)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["loss"] == pytest.approx(final, abs=1e-5)

    assert main(["export", str(run_dir), "--out", str(tmp_path / "step4"), "--step", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["weights"] == "outer parameters"
    hf = load_hf(tmp_path / "step4")
    batches = eval_batches(run_dir)
    with torch.no_grad():
        torch.testing.assert_close(
            hf(batches[0][0]).logits, dilocox_model(run_dir, 4)(batches[0][0]), atol=1e-4, rtol=0
        )
    assert hf_eval_loss(hf, batches) == pytest.approx(final, abs=1e-4)

    # an earlier checkpoint exports that step's model (blocking DiLoCo: the outer params are the local weights)
    assert main(["export", str(run_dir), "--out", str(tmp_path / "step2"), "--step", "2"]) == 0
    with torch.no_grad():
        earlier = load_hf(tmp_path / "step2")(batches[0][0]).logits
        torch.testing.assert_close(earlier, dilocox_model(run_dir, 2)(batches[0][0]), atol=1e-4, rtol=0)


def test_export_errors_are_one_line_with_exit_code_2(runs, tmp_path, capsys):
    _, run_dir, _ = runs
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    bare = tmp_path / "untrained"
    bare.mkdir()
    (bare / "config.toml").write_text((run_dir / "config.toml").read_text())
    cases = [
        (["--out", str(out)], "is not empty; pass --overwrite"),
        (["--out", str(tmp_path / "x"), "--step", "3"], "no checkpoint of step 3; its checkpoints are at steps 2, 4"),
        (["--out", str(tmp_path / "x"), "--format", "gguf"], "--format 'gguf' is not supported"),
        (["--out", str(tmp_path / "x"), "--step", "last"], "--step 'last' is not a step number"),
    ]
    for args, message in cases:
        assert main(["export", str(run_dir), *args]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert main(["export", str(bare), "--out", str(tmp_path / "x")]) == 2
    assert "has no complete checkpoint" in capsys.readouterr().err
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert "not a dilocox run directory" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and (out / "keep.txt").is_file()
    assert main(["export", str(run_dir), "--out", str(out), "--overwrite"]) == 0
    assert (out / "model.safetensors").is_file() and not (out / "keep.txt").exists()
    assert not list(tmp_path.glob(".*partial"))


def test_training_continues_from_a_transformers_model(runs, tmp_path, capsys):
    """A tiny random Qwen2 saved by transformers, with the run's tokenizer: 2 clusters x 2 stages start from its
    weights (the first eval loss is transformers' loss on the same batches) and train; the export keeps its shape."""
    corpus, source_run, _ = runs
    reference = Tokenizer.from_file(source_run / "tokenizer.json")
    config = transformers.Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=reference.vocab_size + 4,  # padded rows, as released checkpoints have
        max_position_embeddings=256,
        rope_theta=50000.0,
        rms_norm_eps=1e-5,
        eos_token_id=reference.eos_id,
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    source = tmp_path / "tiny-qwen2"
    hf.save_pretrained(source)
    # the model's own tokenizer, in the directory save_pretrained writes: the run takes it when data.tokenizer is empty
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=reference.backend, eos_token=EOS_TOKEN)
    fast.save_pretrained(source)

    run_dir = tmp_path / "continued"
    result = dilocox(*train_args(corpus, run_dir, f"--model.init_from={source}", "--topology.pp_degree=2"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"model {source}:" in result.stdout
    got = summary(run_dir)
    assert got["initial_eval_loss"] == pytest.approx(hf_eval_loss(hf, eval_batches(run_dir)), abs=1e-4)
    assert got["final_eval_loss"] < got["initial_eval_loss"]
    # every cluster started from the same weights: the outer params they agree on are equal stage by stage
    checkpoint = list_checkpoints(run_dir)[-1]
    for stage in range(2):
        cluster0, cluster1 = (load_rank_state(checkpoint, 2 * cluster + stage) for cluster in range(2))
        assert torch.equal(saved_outer_params(cluster0["sync"]), saved_outer_params(cluster1["sync"]))

    assert main(["export", str(run_dir), "--out", str(tmp_path / "out")]) == 0
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["vocab_size"] == reference.vocab_size + 4 and exported["max_position_embeddings"] == 256
    assert (exported["rope_theta"], exported["rms_norm_eps"], exported["num_hidden_layers"]) == (50000.0, 1e-5, 4)

    # a tokenizer with more ids than the embedding, and a hub name, are refused before any rank starts
    config.vocab_size = reference.vocab_size - 10
    small = tmp_path / "too-small"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(small)
    for init_from, message in (
        (small, f"the tokenizer has {reference.vocab_size} ids but the model's embedding has"),
        ("Qwen/Qwen2-0.5B", "never downloads"),
    ):
        args = train_args(corpus, tmp_path / "refused", f"--model.init_from={init_from}", f"--data.tokenizer={source}")
        capsys.readouterr()
        assert main(args) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "refused").exists()
