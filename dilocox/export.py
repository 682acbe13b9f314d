"""`dilocox export`: a run's checkpoint as a Hugging Face model directory that transformers loads.

    result = export_hf(Path("runs/dilocox"), Path("hf/my-model"))            # the newest checkpoint
    model = AutoModelForCausalLM.from_pretrained("hf/my-model")              # Qwen2ForCausalLM (LlamaForCausalLM
    tokenizer = AutoTokenizer.from_pretrained("hf/my-model")                 # for a model without q/k/v biases)

The directory holds config.json, model.safetensors (fp32) and the run's tokenizer as tokenizer.json with the
tokenizer_config.json and special_tokens_map.json that `PreTrainedTokenizerFast` reads. It is written beside its
final path and renamed into place, so an interrupted export leaves no half-written model.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from dilocox.checkpoint import checkpoint_model_args, consolidated_model_state, find_step, read_meta
from dilocox.data import EOS_TOKEN, Tokenizer
from dilocox.fileio import write_atomic
from dilocox.models.hf import ARCHITECTURES, architecture, write_hf_model

FORMATS = ("hf",)
"""What `dilocox export --format` writes: hf, a Hugging Face transformers model directory."""


def _check_out(out: Path, *, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; choose a directory path")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"--out {out} is not empty; pass --overwrite to replace it, or choose another --out")


def write_tokenizer_files(directory: Path, tokenizer: Tokenizer, *, model_max_length: int) -> None:
    """tokenizer.json plus the two small files that let `AutoTokenizer.from_pretrained` load it as a fast tokenizer
    (no post-processor: it adds no BOS/EOS, so it encodes exactly as dilocox does)."""
    tokenizer.save(directory / "tokenizer.json")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,  # decode(encode(text)) == text, as dilocox's decode
    }
    write_atomic(directory / "tokenizer_config.json", (json.dumps(config, indent=2) + "\n").encode())
    write_atomic(directory / "special_tokens_map.json", (json.dumps({"eos_token": EOS_TOKEN}) + "\n").encode())


def export_hf(run_dir: Path, out: Path, *, step: int | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Write checkpoint `step` (default: the newest) of `run_dir` to `out` as a Hugging Face model directory.

    The weights are the agreed model of the run: the outer parameters of the sync state when the strategy keeps
    them (diloco, dilocox), else cluster 0's (allreduce and cocktail keep every cluster equal), with the pipeline
    stages put together. Returns what was written, for the command's report."""
    run_dir, out = Path(run_dir), Path(out)
    if not (run_dir / "config.toml").is_file():
        raise ValueError(f"{run_dir} is not a dilocox run directory (no config.toml); pass the run.out_dir of a run")
    _check_out(out, overwrite=overwrite)
    path = find_step(run_dir, step)
    meta = read_meta(path)
    tokenizer = Tokenizer.from_file(run_dir / "tokenizer.json")
    args = checkpoint_model_args(meta, tokenizer.vocab_size)
    state, agreed = consolidated_model_state(path, agreed=True)
    partial = out.parent / f".{out.name}.partial"
    if partial.exists():
        shutil.rmtree(partial)
    try:
        write_hf_model(partial, state, args, eos_id=tokenizer.eos_id)
        write_tokenizer_files(partial, tokenizer, model_max_length=args.max_seq_len)
        if out.exists():
            shutil.rmtree(out)
        os.replace(partial, out)
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        raise ValueError(f"--out {out} is not writable ({exc.strerror}); choose another --out") from None
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return {
        "out": str(out),
        "checkpoint": str(path),
        "step": meta["step"],
        "architecture": ARCHITECTURES[architecture(args)],
        "weights": "outer parameters" if agreed else "cluster 0's parameters",
        "num_params": sum(t.numel() for n, t in state.items() if not (args.tie_embeddings and n == "output.weight")),
        "max_position_embeddings": args.max_seq_len,
    }
