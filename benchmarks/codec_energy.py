"""How much of real pseudo-gradients each codec keeps per byte, round by round under error feedback.

    python benchmarks/codec_energy.py                                   # paper regime, inner lr 3e-3, 8 rounds
    python benchmarks/codec_energy.py --warm-steps 100 --rounds 4 --out benchmarks/results/codec_energy.md
    python benchmarks/codec_energy.py --rounds 16 --save /tmp/pg.pt      # keep the pseudo-gradients ...
    python benchmarks/codec_energy.py --load /tmp/pg.pt                  # ... and measure again without training

`benchmarks/codec_speed.py` measures codecs on synthetic tensors; this one on the pseudo-gradients of real training.
It trains the model of `dilocox train`'s setting (with `--set` overrides; by default the paper regime's held-out split
and the best top-k row's inner lr, 3e-3) alone on cluster 0's data shard of 2 for `--warm-steps` AdamW steps on the
run's learning-rate schedule, then `--rounds` rounds of `--inner-steps` steps, keeping each round's pseudo-gradient
(the parameters' change). Every codec then compresses that sequence with `ErrorFeedback`, as a cluster's sender
does, and the table shows per codec:

- bytes of one round's payload (mean over the rounds);
- the share of the first round's energy its decoding keeps, 1 - |decoded - pseudo_grad|^2 / |pseudo_grad|^2;
- |residual| / |pseudo_grad| after the last round: how much progress waits in the error feedback;
- the cosine between the sum of the decoded payloads and the sum of the pseudo-gradients;
- the share of the held-out loss drop it buys: the model at the first round's start moved by the first decoded
  payload (round 1) or by the sum of all of them (all rounds), scored on the whole held-out split, as a share of
  the drop of the same start moved by the pseudo-gradient (the first, or their sum: the model at the end). Energy
  measures how much of the change a payload carries; this measures how much of the training it carries.

Two more tables explain the codecs by the pseudo-gradients' structure:

- spectra: for each kind of matrix (embedding, head, attention q/k/v/o, MLP w1/w2/w3; the mean over layers), the
  share of the first round's pseudo-gradient energy in its top 1, 8 and 32 singular values and in its largest 5% and
  1% of entries (what low rank and top-k can keep), its stable rank |A|^2 / sigma_1^2, and the same shares of a
  Gaussian matrix of its shape (a spectrum with no structure); and the same for what error feedback holds after the
  last round under low-rank rank 8 and under top-k 5% (what each codec leaves behind);
- error feedback over rounds: |residual| / |pseudo-grad| after each round, per codec.

One process, one thread by default: about 7 minutes for 8 rounds, half of it the warm-up (about 0.25 s a step on one
core), the rest the held-out evaluations (2 per codec, each of the whole split).
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path
from typing import Any

import torch

from dilocox.compress import ErrorFeedback, build_codec
from dilocox.compress.config import CompressionConfig
from dilocox.config import load_config
from dilocox.data.dataset import token_stream_for_rank
from dilocox.parallel.pipeline import clip_grad_norm_, mean_token_cross_entropy
from dilocox.trainer import build_inner_optimizer, build_model, evaluate, lr_at, model_eval_step, prepare_data

REPO = Path(__file__).resolve().parents[1]
CODECS = {
    "top-k int4, density 0.05": {"kind": "topk_int4", "density": 0.05},
    "top-k int4, density 0.25": {"kind": "topk_int4", "density": 0.25},
    "top-k int4, density 0.02": {"kind": "topk_int4", "density": 0.02},
    "top-k int2, density 0.02": {"kind": "topk_int2", "density": 0.02},
    "top-k int2, density 0.01": {"kind": "topk_int2", "density": 0.01},
    "top-k sign, density 0.02": {"kind": "topk_sign", "density": 0.02},
    "top-k sign, density 0.01": {"kind": "topk_sign", "density": 0.01},
    "top-k sign, 1 of every 64": {"kind": "topk_sign", "density": 1 / 64, "chunk_size": 64},
    "top-k sign, 1 of every 128": {"kind": "topk_sign", "density": 1 / 128, "chunk_size": 128},
    "DCT-64 top-k sign, density 0.01": {"kind": "dct_sign", "density": 0.01},
    "DCT-64 top-k sign, 1 of every 64": {"kind": "dct_sign", "density": 1 / 64, "chunk_size": 64},
    "low-rank int4, rank 2": {"kind": "lowrank_int4", "rank": 2},
    "low-rank int4, rank 8": {"kind": "lowrank_int4", "rank": 8},
    "low-rank int4, rank 32": {"kind": "lowrank_int4", "rank": 32},
    "low-rank fp32, rank 8": {"kind": "lowrank", "rank": 8},
    "adaptive low-rank int4, rank_max 8": {"kind": "adaptive", "rank_max": 8},
    "adaptive low-rank int4 (the default: rank_max 32, energy 0.95)": {"kind": "adaptive"},
}
RESIDUAL_CODECS = ("top-k int4, density 0.05", "low-rank int4, rank 8")
"""The codecs whose residual after the last round the spectra table takes apart."""
MATRIX_KINDS = {
    "embedding": "tok_embeddings",
    "head": "output",
    "attention q": "attention.wq.weight",
    "attention k": "attention.wk.weight",
    "attention v": "attention.wv.weight",
    "attention o": "attention.wo.weight",
    "MLP w1": "feed_forward.w1",
    "MLP w2": "feed_forward.w2",
    "MLP w3": "feed_forward.w3",
}
"""Kinds of matrix by a part of their parameter names (`dilocox.models`)."""


class HeldOut:
    """The held-out loss of the model with its parameters set to given values (the model's own are put back)."""

    def __init__(self, model: torch.nn.Module, tokens, *, seq_len: int, batch_size: int) -> None:
        self.model, self.tokens, self.seq_len, self.batch_size = model, tokens, seq_len, batch_size

    @torch.no_grad()
    def loss(self, values: list[torch.Tensor]) -> float:
        params = list(self.model.parameters())
        own = [p.detach().clone() for p in params]
        for p, v in zip(params, values, strict=True):
            p.copy_(v)
        try:
            loss, _ = evaluate(
                model_eval_step(self.model), self.tokens, seq_len=self.seq_len, batch_size=self.batch_size,
                max_batches=None,
            )  # fmt: skip
        finally:
            for p, v in zip(params, own, strict=True):
                p.copy_(v)
        return loss


def setup(overrides: list[str]) -> tuple[Any, Any, torch.nn.Module]:
    """The config, the data and the freshly initialised model of `dilocox train --preset diloco` with `overrides`."""
    # the diloco preset: the inner training of the field defaults, on the default setting's model and data; the
    # benchmarks' 400 steps (the first run's 96 are shorter than the warm-up and rounds measured here)
    cfg = load_config(None, ["--preset=diloco", "--train.steps=400", *overrides])
    cfg.validate()
    torch.manual_seed(cfg.run.seed)
    data = prepare_data(cfg)
    return cfg, data, build_model(cfg, data.vocab_size)


def held_out_of(overrides: list[str]) -> HeldOut:
    """The held-out loss of the model of `setup` (its parameters are always set before scoring)."""
    cfg, data, model = setup(overrides)
    return HeldOut(model, data.val, seq_len=cfg.train.seq_len, batch_size=cfg.train.micro_batch_size)


def pseudo_gradients(
    overrides: list[str], warm_steps: int, rounds: int, inner_steps: int
) -> tuple[list[list[torch.Tensor]], list[torch.Tensor], HeldOut]:
    """`rounds` consecutive pseudo-gradients (one tensor per parameter) of cluster 0 of 2 training alone, the
    parameters at the first round's start, and the held-out loss of the model."""
    cfg, data, model = setup(overrides)
    if warm_steps + rounds * inner_steps > cfg.train.steps:
        raise SystemExit(
            f"--warm-steps {warm_steps} + --rounds {rounds} x --inner-steps {inner_steps} runs past train.steps = "
            f"{cfg.train.steps}: lower one, or raise train.steps with --set=--train.steps=N"
        )
    optimizer = build_inner_optimizer(cfg, model)
    stream = token_stream_for_rank(
        data, seq_len=cfg.train.seq_len, batch_size=cfg.train.micro_batch_size, shard_index=0, num_shards=2,
        seed=cfg.run.seed, shard=cfg.data.shard,
    )  # fmt: skip
    params = list(model.parameters())

    def step(index: int) -> None:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(cfg, index)
        inputs, targets = stream.next_batch()
        loss = mean_token_cross_entropy(model(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.train.grad_clip > 0:
            clip_grad_norm_(params, cfg.train.grad_clip, pp_group=None)  # the trainer's clipping, one stage
        optimizer.step()

    for index in range(warm_steps):
        step(index)
    sequence, first_start = [], [p.detach().clone() for p in params]
    for round_index in range(rounds):
        start = [p.detach().clone() for p in params]
        for index in range(inner_steps):
            step(warm_steps + round_index * inner_steps + index)
        sequence.append([p.detach() - s for p, s in zip(params, start, strict=True)])
    held_out = HeldOut(model, data.val, seq_len=cfg.train.seq_len, batch_size=cfg.train.micro_batch_size)
    return sequence, first_start, held_out


def norm(tensors: list[torch.Tensor]) -> float:
    return sum(float(t.double().square().sum()) for t in tensors) ** 0.5


def moved(start: list[torch.Tensor], change: list[torch.Tensor]) -> list[torch.Tensor]:
    return [s + c for s, c in zip(start, change, strict=True)]


def whole_drops(
    sequence: list[list[torch.Tensor]], total: list[torch.Tensor], start: list[torch.Tensor], held_out: HeldOut
) -> dict[str, float]:
    """The held-out loss at the first round's start and the drops the pseudo-gradients themselves (the first, and
    their sum `total`) buy from there."""
    base = held_out.loss(start)
    return {
        "base": base,
        "first": base - held_out.loss(moved(start, sequence[0])),
        "all": base - held_out.loss(moved(start, total)),
    }


def measure(
    options: dict,
    sequence: list[list[torch.Tensor]],
    total: list[torch.Tensor],
    start: list[torch.Tensor],
    held_out: HeldOut,
    whole: dict[str, float],
) -> dict[str, Any]:
    codec = build_codec(CompressionConfig(**options), seed=0)
    feedback = ErrorFeedback()
    payload_bytes, first_kept, first_decoded, residuals = [], None, None, []
    sent = [torch.zeros_like(t) for t in sequence[0]]
    for pseudo_grad in sequence:
        payload, decoded = feedback.compress(codec, pseudo_grad)
        payload_bytes.append(payload.nbytes)
        residuals.append(norm(feedback.residuals) / norm(pseudo_grad))
        if first_kept is None:
            first_kept = (
                1 - norm([d - p for d, p in zip(decoded, pseudo_grad, strict=True)]) ** 2 / norm(pseudo_grad) ** 2
            )
            first_decoded = decoded
        sent = [a + b for a, b in zip(sent, decoded, strict=True)]
    dot = sum(float((a.double() * b.double()).sum()) for a, b in zip(total, sent, strict=True))

    def bought(payload: list[torch.Tensor], drop: float) -> float:
        return (whole["base"] - held_out.loss(moved(start, payload))) / drop

    return {
        "bytes": sum(payload_bytes) / len(payload_bytes),
        "first_kept": first_kept,
        "residual": residuals[-1],
        "residuals": residuals,
        "held_back": [r.clone() for r in feedback.residuals],
        "cosine": dot / (norm(total) * norm(sent)),
        "loss_first": bought(first_decoded, whole["first"]),
        "loss_all": bought(sent, whole["all"]),
    }


def shares(matrix: torch.Tensor) -> dict[str, float]:
    """Where a matrix's energy is: in its top 1, 8 and 32 singular values, in its largest 5% and 1% of entries; and
    its stable rank |A|^2 / sigma_1^2."""
    singular = torch.linalg.svdvals(matrix.double())
    energy = singular.square()
    entries = matrix.double().reshape(-1).square().sort(descending=True).values
    total = float(energy.sum())
    return {
        "top1": float(energy[:1].sum()) / total,
        "top8": float(energy[:8].sum()) / total,
        "top32": float(energy[:32].sum()) / total,
        "entries5": float(entries[: max(1, round(0.05 * entries.numel()))].sum()) / total,
        "entries1": float(entries[: max(1, round(0.01 * entries.numel()))].sum()) / total,
        "stable_rank": total / float(energy[0]),
    }


def spectra_table(names: list[str], tensors: list[torch.Tensor]) -> list[str]:
    """The `shares` of each kind of matrix (`MATRIX_KINDS`), averaged over its matrices, beside a Gaussian's."""
    generator = torch.Generator().manual_seed(0)
    lines = []
    for kind, part in MATRIX_KINDS.items():
        matrices = [t for n, t in zip(names, tensors, strict=True) if part in n and t.dim() == 2]
        if not matrices:
            continue
        measured = [shares(m) for m in matrices]
        mean = {key: sum(m[key] for m in measured) / len(measured) for key in measured[0]}
        gauss = shares(torch.randn(matrices[0].shape, generator=generator))
        lines.append(
            f"| {kind} | {tuple(matrices[0].shape)} x {len(matrices)} | {mean['top1']:.2f} | {mean['top8']:.2f} "
            f"| {mean['top32']:.2f} | {mean['entries5']:.2f} | {mean['entries1']:.2f} | {mean['stable_rank']:.1f} "
            f"| {gauss['top8']:.2f} / {gauss['top32']:.2f} / {gauss['entries5']:.2f} |"
        )
    return lines


SPECTRA_HEAD = [
    "| matrix | shape x count | top 1 | top 8 | top 32 | largest 5% of entries | largest 1% | stable rank "
    "| Gaussian: top 8 / top 32 / largest 5% |",
    "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warm-steps", type=int, default=300, help="AdamW steps before the first round")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--inner-steps", type=int, default=12, help="H: steps of one round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--set", action="append", default=None, metavar="--SECTION.KEY=VALUE",
        help="a training override (repeat; default: --data.val_fraction=0.1 --train.lr=3e-3)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, help="also write the table to this .md file")
    parser.add_argument("--save", type=Path, help="also save the pseudo-gradients and the start (torch.save)")
    parser.add_argument("--load", type=Path, help="measure the pseudo-gradients --save wrote instead of training")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    overrides = args.set if args.set is not None else ["--data.val_fraction=0.1", "--train.lr=3e-3"]
    if args.load:
        saved = torch.load(args.load)
        overrides, args.warm_steps, args.inner_steps = saved["overrides"], saved["warm_steps"], saved["inner_steps"]
        sequence, start = saved["sequence"], saved["start"]
        args.rounds = len(sequence)
        held_out = held_out_of(overrides)
    else:
        sequence, start, held_out = pseudo_gradients(overrides, args.warm_steps, args.rounds, args.inner_steps)
    if args.save:
        torch.save({"overrides": overrides, "warm_steps": args.warm_steps, "inner_steps": args.inner_steps,
                    "sequence": sequence, "start": start}, args.save)  # fmt: skip
    names = [name for name, _ in held_out.model.named_parameters()]
    lines = [
        f"Pseudo-gradients of {args.rounds} rounds of H = {args.inner_steps} after {args.warm_steps} AdamW steps, "
        f"cluster 0 of 2 training alone (dilocox train --preset diloco {' '.join(overrides)}); "
        f"`python benchmarks/codec_energy.py`, {datetime.date.today()}.",
        "",
        "| codec | bytes per round | energy kept, round 1 | residual / pseudo-grad at the end | cosine of sums "
        "| held-out loss drop bought, round 1 | all rounds |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    total = [sum(parts) for parts in zip(*sequence, strict=True)]  # the pseudo-gradients' sum, every codec's reference
    whole = whole_drops(sequence, total, start, held_out)
    measured = {}
    for label, options in CODECS.items():
        m = measured[label] = measure(options, sequence, total, start, held_out, whole)
        lines.append(
            f"| {label} | {m['bytes']:,.0f} | {m['first_kept']:.3f} | {m['residual']:.2f} | {m['cosine']:.3f} "
            f"| {m['loss_first']:.3f} | {m['loss_all']:.3f} |"
        )
        print(lines[-1], flush=True)
    lines += [
        "",
        "Where the energy of the first round's pseudo-gradient is (means over the matrices of each kind):",
        "",
    ]
    lines += SPECTRA_HEAD + spectra_table(names, sequence[0])
    for label in RESIDUAL_CODECS:
        lines += ["", f"The same for what error feedback holds after round {args.rounds} under {label}:", ""]
        lines += SPECTRA_HEAD + spectra_table(names, measured[label]["held_back"])
    shown = sorted({1, 2, 4, 8, args.rounds} & set(range(1, args.rounds + 1)))
    lines += ["", "|residual| / |pseudo-grad| after each round (error feedback):", ""]
    lines += ["| codec | " + " | ".join(f"round {r}" for r in shown) + " |", "| --- |" + " ---: |" * len(shown)]
    for label, m in measured.items():
        lines.append(f"| {label} | " + " | ".join(f"{m['residuals'][r - 1]:.2f}" for r in shown) + " |")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
