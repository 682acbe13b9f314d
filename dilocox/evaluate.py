"""`dilocox eval`: the loss of a run's checkpoint on its validation split or on any text.

The model evaluated is the one the training log's eval_loss and `dilocox export` use: the agreed model (the outer
parameters every cluster holds, `consolidated_model_state(agreed=True)`), or with `local=True` cluster 0's own
weights (the log's eval_loss_local); all pipeline stages put together, so a pipeline-split run is evaluated whole.

result = evaluate_run(Path("runs/dilocox"))                         # {"loss": ..., "perplexity": ...}
result = evaluate_run(Path("runs/dilocox"), data_path="my_text.txt")
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dilocox.checkpoint import checkpoint_model_args, consolidated_model_state, find_checkpoint, find_step, read_meta
from dilocox.config import from_dict
from dilocox.data import Tokenizer, load_documents, prepare_tokens
from dilocox.parallel import build_stage
from dilocox.trainer import evaluate, model_eval_step


def evaluate_run(
    run_dir: Path,
    *,
    data_path: str | None = None,
    checkpoint: str | None = None,
    step: int | None = None,
    max_batches: int = 0,
    local: bool = False,
) -> dict[str, Any]:
    if not (run_dir / "config.toml").is_file():
        raise ValueError(f"{run_dir} is not a dilocox run directory (no config.toml); pass the run.out_dir of a run")
    cfg = from_dict(tomllib.loads((run_dir / "config.toml").read_text()))
    # the run's CPU threads: torch's default (one per core) oversubscribes a machine the user shares or trains on
    torch.set_num_threads(cfg.run.num_threads)
    # the newest checkpoint or `step`'s, as `dilocox export` picks it: a corrupt one is refused, never passed over
    path = find_checkpoint(run_dir, checkpoint) if checkpoint else find_step(run_dir, step)
    meta = read_meta(path)
    tokenizer_file = run_dir / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    if data_path:
        docs = load_documents(data_path, text_field=cfg.data.text_field)
        ids: list[int] = []
        for encoded in tokenizer.encode_batch(docs):
            ids.extend(encoded)
            ids.append(tokenizer.eos_id)
        tokens = np.asarray(ids[:-1], dtype=np.int64)
        source = str(data_path)
    else:
        d = cfg.data
        data = prepare_tokens(
            path=d.path,
            tokenizer=str(tokenizer_file),
            val_fraction=d.val_fraction,
            text_field=d.text_field,
            seed=cfg.split_seed,
        )
        tokens, source = data.val, "validation split"
    args = checkpoint_model_args(meta, tokenizer.vocab_size)
    model = build_stage(dataclasses.replace(args, max_seq_len=cfg.train.seq_len), 0, 1, seed=cfg.run.seed)
    model.load_state_dict(consolidated_model_state(path, agreed=not local)[0])
    seq_len, batch = cfg.train.seq_len, cfg.train.micro_batch_size
    if len(tokens) < batch * (seq_len + 1):
        batch = max(1, len(tokens) // (seq_len + 1))  # small user files still get evaluated
    loss, num_tokens = evaluate(
        model_eval_step(model), tokens, seq_len=seq_len, batch_size=batch, max_batches=max_batches or None
    )
    return {
        "source": source,
        "checkpoint": str(path),
        "step": meta["step"],
        "loss": loss,
        "perplexity": math.exp(loss),
        "tokens": num_tokens,
        "model": "local" if local else "agreed",
        "num_threads": torch.get_num_threads(),
    }
