"""Hugging Face Qwen2 / Llama checkpoints <-> the dilocox `Decoder`: config mapping, weight names, safetensors.

The `Decoder` is the Qwen2 architecture (Llama's when `qkv_bias` is False) under other module names, with the same
tensor layouts (the "rotate half" rotary pairing, `nn.Linear` weights as (out, in)), so a conversion only renames
tensors. Qwen2 always has a bias on q/k/v and Llama never has one there, so `qkv_bias` picks the architecture.

    args = hf_model_args(read_hf_config("my-qwen2"), vocab_size=tokenizer.vocab_size)
    stage = build_stage(args, stage=0, num_stages=1, seed=0); load_hf_weights_(stage, "my-qwen2")
    write_hf_model(out_dir, state, args, eos_id=tokenizer.eos_id)   # config.json + model.safetensors

config.json is read and written as plain JSON in the layout that transformers 4.40 writes (top-level `rope_theta`,
`torch_dtype`) and that transformers 5 also reads; the `rope_parameters` of transformers 5 are read too. Only
`safetensors` is imported, lazily: transformers is needed to use the files, not to make them.

This module never imports torch.distributed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch

from dilocox.fileio import write_atomic
from dilocox.models.decoder import Decoder, ModelArgs

HF_EXTRA_HINT = "run `pip install 'dilocox[hf]'`"
"""How to get the optional libraries of the Hugging Face conversion."""

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
"""The Hugging Face model types dilocox reads and writes, and their causal-LM class."""

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"

_TOP_LEVEL_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_MODULE_NAMES = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
}


def hf_name(name: str) -> str:
    """The Hugging Face name of a `Decoder` parameter: `layers.3.attention.wq.bias` -> `model.layers.3.self_attn.
    q_proj.bias`."""
    if name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[name]
    prefix, index, rest = name.split(".", 2)
    module, leaf = rest.rsplit(".", 1)
    assert prefix == "layers" and module in _BLOCK_MODULE_NAMES, f"no Hugging Face name for {name!r}"
    return f"model.layers.{index}.{_BLOCK_MODULE_NAMES[module]}.{leaf}"


def architecture(args: ModelArgs) -> str:
    """`qwen2` for a decoder with q/k/v biases, else `llama` (whose only attention bias option also biases o)."""
    if args.style != "qwen":
        raise ValueError(
            f"a model of style {args.style!r} has no Qwen2/Llama layout to export to Hugging Face; read its checkpoint "
            "with dilocox eval, or train a Qwen-style flavor to export"
        )
    return "qwen2" if args.qkv_bias else "llama"


def expected_tensors(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape of every tensor a checkpoint of `args` holds (a tied head is not stored)."""
    with torch.device("meta"):
        model = Decoder(args)
    return {
        hf_name(name): tuple(tensor.shape)
        for name, tensor in model.state_dict().items()
        if not (args.tie_embeddings and name == "output.weight")
    }


# ------------------------------------------------------------------------------------------------ reading
def read_hf_config(directory: str | Path) -> dict[str, Any]:
    """config.json of a local Hugging Face model directory, or a ValueError saying how to get one (no downloads)."""
    path = Path(directory).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"model.init_from = {str(directory)!r} is not a local directory; dilocox never downloads: save the model "
            "first (AutoModelForCausalLM.from_pretrained(NAME).save_pretrained(DIR), or `hf download NAME "
            "--local-dir DIR`) and pass DIR"
        )
    if not (path / CONFIG_FILE).is_file():
        raise ValueError(
            f"model.init_from = {str(directory)!r} has no {CONFIG_FILE}; pass a directory written by "
            "save_pretrained (config.json and model.safetensors)"
        )
    try:
        return json.loads((path / CONFIG_FILE).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"model.init_from: {path / CONFIG_FILE} is not valid JSON ({exc})") from None


def _rope_theta(config: dict[str, Any], fail: Callable[[str], NoReturn]) -> float:
    """The rotary base, from transformers 5's `rope_parameters` or 4's `rope_theta` / `rope_scaling`."""
    parameters = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    for rope in (parameters, scaling):
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            fail(f"rope scaling {kind!r} is not supported (dilocox has plain rotary embeddings)")
    return float(parameters.get("rope_theta", config.get("rope_theta", 10000.0)))


def hf_model_args(config: dict[str, Any], *, vocab_size: int | None = None, source: str = "") -> ModelArgs:
    """The `ModelArgs` of a Hugging Face Qwen2 or Llama config.json, or a ValueError naming what dilocox cannot
    represent. `vocab_size` (the tokenizer's ids) must fit the embedding; `max_seq_len` is the model's context
    (`max_position_embeddings`)."""
    where = f"model.init_from = {source!r}: " if source else "Hugging Face config: "

    def fail(problem: str) -> NoReturn:
        raise ValueError(f"{where}{problem}; dilocox continues training Qwen2 and Llama models of the plain layout")

    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        fail(f"model_type {model_type!r} is not supported (supported: {', '.join(ARCHITECTURES)})")

    def get(key: str, default: Any = None) -> Any:
        value = config.get(key, default)
        if value is None:
            fail(f"config.json has no {key!r}")
        return value

    if get("hidden_act", "silu") != "silu":
        fail(f"hidden_act {config['hidden_act']!r} is not supported (dilocox's feed-forward is SwiGLU)")
    if float(config.get("attention_dropout") or 0.0) != 0.0:
        fail(f"attention_dropout {config['attention_dropout']} is not supported (dilocox trains without dropout)")
    if model_type == "qwen2":
        if config.get("use_sliding_window"):
            fail("use_sliding_window = true is not supported (dilocox attends to the whole causal context)")
        qkv_bias = True
    else:
        if config.get("attention_bias"):
            fail("attention_bias = true (a bias on q, k, v and o) is not supported (dilocox has no bias on o)")
        if config.get("mlp_bias"):
            fail("mlp_bias = true is not supported (dilocox's feed-forward has no biases)")
        qkv_bias = False
    dim, num_heads = int(get("hidden_size")), int(get("num_attention_heads"))
    head_dim = config.get("head_dim")
    if head_dim is not None and num_heads and head_dim * num_heads != dim:
        fail(f"head_dim {head_dim} x {num_heads} heads != hidden_size {dim} (dilocox's heads split the hidden size)")
    layer_types = config.get("layer_types") or []
    if any(kind != "full_attention" for kind in layer_types):
        fail("layers other than full_attention are not supported")
    args = ModelArgs(
        dim=dim,
        num_layers=int(get("num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        ffn_dim=int(get("intermediate_size")),
        vocab_size=int(get("vocab_size")),
        max_seq_len=int(get("max_position_embeddings")),
        rope_theta=_rope_theta(config, fail),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        qkv_bias=qkv_bias,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
    try:
        args.validate()
    except ValueError as exc:
        fail(str(exc))
    if vocab_size is not None and vocab_size > args.vocab_size:
        raise ValueError(
            f"{where}the tokenizer has {vocab_size} ids but the model's embedding has {args.vocab_size} rows; "
            "train with the model's own tokenizer (--data.tokenizer=DIR with its tokenizer.json)"
        )
    return args


def _safe_open():
    try:
        from safetensors import safe_open
    except ImportError:
        raise ValueError(f"reading Hugging Face weights needs safetensors; {HF_EXTRA_HINT}") from None
    return safe_open


def _weight_files(directory: Path) -> dict[str, Path]:
    """Hugging Face tensor name -> the safetensors file that holds it (one file, or the shards of an index)."""
    if (directory / WEIGHTS_INDEX_FILE).is_file():
        weight_map = json.loads((directory / WEIGHTS_INDEX_FILE).read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    if (directory / WEIGHTS_FILE).is_file():
        with _safe_open()(str(directory / WEIGHTS_FILE), framework="pt") as handle:
            return {name: directory / WEIGHTS_FILE for name in handle.keys()}
    raise ValueError(
        f"model.init_from = {str(directory)!r} has no {WEIGHTS_FILE} (or {WEIGHTS_INDEX_FILE}); save the model with "
        "save_pretrained(DIR), which writes safetensors"
    )


def check_hf_weights(directory: str | Path, args: ModelArgs) -> None:
    """Every tensor a model of `args` needs is in the checkpoint with its shape (reads the file headers only)."""
    directory = Path(directory).expanduser()
    files = _weight_files(directory)
    missing, wrong = [], []
    safe_open = _safe_open()
    for name, shape in expected_tensors(args).items():
        if name not in files:
            missing.append(name)
            continue
        with safe_open(str(files[name]), framework="pt") as handle:
            found = tuple(handle.get_slice(name).get_shape())
        if found != shape:
            wrong.append(f"{name} {found} (expected {shape})")
    if missing or wrong:
        problems = [f"missing {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"] if missing else []
        problems += [f"wrong shape {', '.join(wrong[:3])}"] if wrong else []
        raise ValueError(
            f"model.init_from = {str(directory)!r}: the weights do not match its config.json ({'; '.join(problems)}); "
            "save the ...ForCausalLM model (not the base model) with save_pretrained"
        )


@torch.no_grad()
def load_hf_weights_(model: Decoder, directory: str | Path) -> None:
    """Copy the checkpoint's tensors into the parameters `model` (a whole decoder or one pipeline stage) holds.

    Each rank of a run opens the same files and reads only its stage's tensors (safetensors reads lazily), so every
    cluster starts from identical weights and none crosses the slow link. Tensors are cast to the parameters'
    dtype and device."""
    directory = Path(directory).expanduser()
    files = _weight_files(directory)
    by_file: dict[Path, list[tuple[str, torch.Tensor]]] = {}
    for name, param in model.state_dict(keep_vars=True).items():
        if model.args.tie_embeddings and name == "output.weight" and model.tok_embeddings is not None:
            continue  # the same tensor as the embedding
        by_file.setdefault(files[hf_name(name)], []).append((hf_name(name), param))
    safe_open = _safe_open()
    for file, params in by_file.items():
        with safe_open(str(file), framework="pt") as handle:
            for name, param in params:
                param.copy_(handle.get_tensor(name))


# ------------------------------------------------------------------------------------------------ writing
def hf_config(args: ModelArgs, *, eos_id: int, dtype: str = "float32") -> dict[str, Any]:
    """The config.json of `args` (`max_seq_len` becomes `max_position_embeddings`)."""
    kind = architecture(args)
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[kind]],
        "model_type": kind,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "rope_theta": float(args.rope_theta),
        "rope_scaling": None,
        "rms_norm_eps": float(args.norm_eps),
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,
    }
    if kind == "qwen2":
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=args.num_layers)
    else:
        config.update(attention_bias=False, mlp_bias=False, head_dim=args.head_dim, pretraining_tp=1)
    return config


def hf_tensors(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """A whole `Decoder` state dict under Hugging Face names, as contiguous fp32 tensors (a tied head dropped)."""
    expected = expected_tensors(args)
    tensors = {
        hf_name(name): tensor.detach().to("cpu", torch.float32).contiguous()
        for name, tensor in state.items()
        if not (args.tie_embeddings and name == "output.weight")
    }
    if set(tensors) != set(expected) or any(tuple(t.shape) != expected[n] for n, t in tensors.items()):
        raise ValueError(
            "the checkpoint's model does not have the shape of its model arguments; was it written by another "
            "dilocox version?"
        )
    return tensors


def write_hf_model(directory: str | Path, state: dict[str, torch.Tensor], args: ModelArgs, *, eos_id: int) -> None:
    """config.json and model.safetensors (fp32) of a whole `Decoder` state dict into `directory`."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ValueError(f"writing Hugging Face weights needs safetensors; {HF_EXTRA_HINT}") from None
    config = hf_config(args, eos_id=eos_id)  # before anything is written: a model without the layout is refused
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # a tied pair shares one storage, which safetensors refuses: hf_tensors stores the embedding only
    save_file(hf_tensors(state, args), str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    (directory / WEIGHTS_FILE).chmod(0o644)  # safetensors creates it private, unlike every other file of a model
    write_atomic(directory / CONFIG_FILE, (json.dumps(config, indent=2) + "\n").encode())


def hf_tokenizer_path(directory: str | Path) -> str:
    """The tokenizer a run started from `directory` uses when data.tokenizer is empty: the model's own."""
    if not (Path(directory).expanduser() / "tokenizer.json").is_file():
        raise ValueError(
            f"model.init_from = {str(directory)!r} has no tokenizer.json and data.tokenizer is empty; pass the "
            "tokenizer the model was trained with (--data.tokenizer=DIR or FILE): a new BPE would not match its ids"
        )
    return str(directory)
