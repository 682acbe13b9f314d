"""Hugging Face Qwen2/Llama <-> dilocox: config mapping, weights in and out against transformers itself, checkpoint
consolidation, and HF tokenizer directories as data.tokenizer."""

import json
import sys
from dataclasses import replace

import pytest
import torch

from dilocox.checkpoint import consolidated_model_state, save_checkpoint
from dilocox.data import EOS_TOKEN, Tokenizer, prepare_tokens, train_bpe, validation_document_indices
from dilocox.models import Decoder, model_args
from dilocox.models.hf import (
    check_hf_weights,
    hf_model_args,
    hf_tokenizer_path,
    load_hf_weights_,
    read_hf_config,
    write_hf_model,
)
from dilocox.parallel import build_stage
from dilocox.sync.base import FlatParams

transformers = pytest.importorskip("transformers")

VOCAB = 300
TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)


def _hf_model(kind: str, *, tie: bool, seed: int = 0):
    """A tiny random Qwen2 or Llama made by transformers itself, with non-trivial norms and biases."""
    if kind == "qwen2":
        config = transformers.Qwen2Config(**TINY, rope_theta=50000.0, tie_word_embeddings=tie)
    else:
        config = transformers.LlamaConfig(**TINY, rope_theta=50000.0, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:  # norms start at 1 and biases at 0: move them so that a mix-up shows
                param.add_(0.1 * torch.randn_like(param))
    return model


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(seed))  # (batch, seq)


@pytest.mark.parametrize(("kind", "tie"), [("qwen2", False), ("qwen2", True), ("llama", False)])
def test_hf_checkpoint_loads_into_the_decoder_with_the_same_logits(tmp_path, kind, tie):
    hf = _hf_model(kind, tie=tie)
    hf.save_pretrained(tmp_path)
    args = hf_model_args(read_hf_config(tmp_path), vocab_size=VOCAB)
    assert (args.dim, args.num_layers, args.num_heads, args.num_kv_heads, args.ffn_dim) == (64, 3, 4, 2, 96)
    assert (args.rope_theta, args.norm_eps, args.max_seq_len) == (50000.0, 1e-5, 128)
    assert (args.qkv_bias, args.tie_embeddings) == (kind == "qwen2", tie)
    check_hf_weights(tmp_path, args)
    model = build_stage(args, 0, 1, seed=1)
    load_hf_weights_(model, tmp_path)
    if tie:
        assert model.output.weight is model.tok_embeddings.weight
    tokens = _tokens()
    with torch.no_grad():
        want, got = hf(tokens).logits, model(tokens)  # (batch, seq, vocab)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_each_pipeline_stage_takes_its_slice_of_the_hf_checkpoint(tmp_path):
    hf = _hf_model("qwen2", tie=False, seed=1)
    hf.save_pretrained(tmp_path)
    args = hf_model_args(read_hf_config(tmp_path), vocab_size=VOCAB)
    stages = [build_stage(args, stage, 2, seed=stage + 5) for stage in range(2)]
    for stage in stages:
        load_hf_weights_(stage, tmp_path)
    tokens = _tokens(1)
    with torch.no_grad():
        got = stages[1](stages[0](tokens))
        want = hf(tokens).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("tie", [False, True])
def test_written_model_loads_in_transformers_with_the_same_logits(tmp_path, tie):
    args = replace(model_args("debug", vocab_size=VOCAB), tie_embeddings=tie, rope_theta=1e6, norm_eps=1e-5)
    model = Decoder(args)
    model.init_weights(seed=3)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn_like(param))
    write_hf_model(tmp_path, model.state_dict(), args, eos_id=7)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["eos_token_id"] == 7
    assert hf_model_args(config) == args  # the config maps back to the same shape
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    tokens = _tokens(2)
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), atol=1e-4, rtol=0)


def test_a_decoder_without_qkv_bias_is_written_as_llama(tmp_path):
    args = replace(model_args("debug", vocab_size=VOCAB), qkv_bias=False)
    model = Decoder(args)
    write_hf_model(tmp_path, model.state_dict(), args, eos_id=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    tokens = _tokens(3)
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope scaling 'linear'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope scaling 'yarn'"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"model_type": "llama", "attention_bias": True}, "attention_bias"),
        ({"num_attention_heads": 3}, "not divisible by num_heads"),
        ({"vocab_size": 200}, "the tokenizer has 300 ids but the model's embedding has 200 rows"),
        ({"hidden_size": None}, "config.json has no 'hidden_size'"),
    ],
)
def test_unrepresentable_hf_configs_are_refused_with_the_reason(change, message):
    config = {"model_type": "qwen2", **TINY, **change}
    with pytest.raises(ValueError, match=message) as error:
        hf_model_args(config, vocab_size=VOCAB, source="some/dir")
    assert str(error.value).startswith("model.init_from = 'some/dir': ") and "\n" not in str(error.value)


def test_init_from_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="never downloads"):
        read_hf_config("Qwen/Qwen2-0.5B")
    with pytest.raises(ValueError, match="has no config.json"):
        read_hf_config(tmp_path)
    with pytest.raises(ValueError, match="no tokenizer.json and data.tokenizer is empty; pass the tokenizer"):
        hf_tokenizer_path(tmp_path)
    hf = _hf_model("qwen2", tie=False)
    hf.model.save_pretrained(tmp_path)  # the base model: no lm_head, names without the "model." prefix
    args = hf_model_args(read_hf_config(tmp_path), vocab_size=VOCAB)
    with pytest.raises(ValueError, match=r"do not match .*missing model\.embed_tokens\.weight"):
        check_hf_weights(tmp_path, args)


def test_missing_safetensors_names_the_extra(tmp_path, monkeypatch):
    args = model_args("debug", vocab_size=VOCAB)
    monkeypatch.setitem(sys.modules, "safetensors", None)  # as if the package were not installed
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ValueError, match=r"pip install 'dilocox\[hf\]'"):
        write_hf_model(tmp_path, Decoder(args).state_dict(), args, eos_id=0)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"pip install 'dilocox\[hf\]'"):
        check_hf_weights(tmp_path, args)


@pytest.mark.parametrize("agreed", [True, False])
def test_consolidated_state_takes_the_outer_params_in_parameter_order(tmp_path, agreed):
    """A tied model's flat outer params (one copy of the shared matrix) go back to the right names."""
    args = replace(model_args("debug", vocab_size=VOCAB), tie_embeddings=True)
    model = Decoder(args)
    flat = FlatParams(model.parameters())
    outer = flat.gather_data() + torch.arange(flat.numel, dtype=torch.float32)  # a distinct shift for every value
    state = {"model": model.state_dict(), "sync": {"outer_params": outer}}
    meta = {"num_clusters": 2, "dp_degree": 1, "pp_degree": 1}
    path = save_checkpoint(tmp_path, 10, state, rank=0, meta=meta, keep=1)
    got, used_outer = consolidated_model_state(path, agreed=agreed)
    assert used_outer == agreed
    if agreed:
        flat.scatter_data(outer)  # the reference: FlatParams itself puts the vector back into the model
    for name, tensor in model.state_dict().items():
        assert torch.equal(got[name], tensor), name
    assert torch.equal(got["output.weight"], got["tok_embeddings.weight"])


# ------------------------------------------------------------------------------------------------ tokenizers
def test_data_tokenizer_accepts_an_hf_tokenizer_directory_and_its_tokenizer_json(tmp_path):
    documents = [f"document {i}: the king and the queen walk by the river, {i * 7} times.\n" * 20 for i in range(6)]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(documents):
        (corpus / f"doc{i}.txt").write_text(text)
    ours = train_bpe(documents, VOCAB)
    hf_dir = tmp_path / "hf-tokenizer"
    transformers.PreTrainedTokenizerFast(tokenizer_object=ours.backend, eos_token=EOS_TOKEN).save_pretrained(hf_dir)
    by_dir = prepare_tokens(path=str(corpus), tokenizer=str(hf_dir), val_fraction=0.2)
    by_file = prepare_tokens(path=str(corpus), tokenizer=str(hf_dir / "tokenizer.json"), val_fraction=0.2)
    assert by_dir.vocab_size == by_file.vocab_size == ours.vocab_size
    held_out = validation_document_indices(len(documents), 0.2)

    def joined(indices: list[int]) -> list[int]:  # documents encoded by our tokenizer, EOS between them
        ids = [token for i in indices for token in ours.encode(documents[i]) + [ours.eos_id]]
        return ids[:-1]

    assert by_dir.val.tolist() == joined(held_out)
    assert by_dir.train.tolist() == joined([i for i in range(len(documents)) if i not in held_out])
    assert by_file.train.tolist() == by_dir.train.tolist() and by_file.val.tolist() == by_dir.val.tolist()
    assert Tokenizer.from_file(hf_dir).encode(documents[0]) == ours.encode(documents[0])


def test_hub_names_and_directories_without_tokenizer_json_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"'Qwen/Qwen2-0\.5B' is not a local file or directory.*never downloads"):
        Tokenizer.from_file("Qwen/Qwen2-0.5B")
    with pytest.raises(ValueError, match="directory without tokenizer.json.*save_pretrained"):
        Tokenizer.from_file(tmp_path)


def test_a_gpt2_style_model_is_not_exported_to_a_qwen_layout(tmp_path):
    args = model_args("gpt2-char", vocab_size=257, max_seq_len=64)
    with pytest.raises(ValueError, match="style 'gpt2' has no Qwen2/Llama layout.*dilocox eval"):
        write_hf_model(tmp_path / "hf", Decoder(args).state_dict(), args, eos_id=256)
    assert not (tmp_path / "hf").exists()
