"""How much of real pseudo-gradients each codec keeps per byte, round by round under error feedback.

    python benchmarks/codec_energy.py                                   # paper regime, inner lr 3e-3, 8 rounds
    python benchmarks/codec_energy.py --warm-steps 100 --rounds 4 --out benchmarks/results/codec_energy.md

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

One process, one thread by default: about 7 minutes, half of it the warm-up (about 0.25 s a step on one core), the
rest the held-out evaluations (15, each of the whole split).
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

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
    "low-rank int4, rank 8": {"kind": "lowrank_int4", "rank": 8},
    "low-rank fp32, rank 8": {"kind": "lowrank", "rank": 8},
    "adaptive low-rank int4, rank_max 8": {"kind": "adaptive", "rank_max": 8},
    "adaptive low-rank int4 (the default: rank_max 32, energy 0.95)": {"kind": "adaptive"},
}


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


def pseudo_gradients(
    overrides: list[str], warm_steps: int, rounds: int, inner_steps: int
) -> tuple[list[list[torch.Tensor]], list[torch.Tensor], HeldOut]:
    """`rounds` consecutive pseudo-gradients (one tensor per parameter) of cluster 0 of 2 training alone, the
    parameters at the first round's start, and the held-out loss of the model."""
    # the diloco preset: the inner training of the field defaults, on the default setting's model and data
    cfg = load_config(None, ["--preset=diloco", *overrides])
    cfg.validate()
    if warm_steps + rounds * inner_steps > cfg.train.steps:
        raise SystemExit(
            f"--warm-steps {warm_steps} + --rounds {rounds} x --inner-steps {inner_steps} runs past train.steps = "
            f"{cfg.train.steps}: lower one, or raise train.steps with --set=--train.steps=N"
        )
    torch.manual_seed(cfg.run.seed)
    data = prepare_data(cfg)
    model = build_model(cfg, data.vocab_size)
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
) -> dict[str, float]:
    codec = build_codec(CompressionConfig(**options), seed=0)
    feedback = ErrorFeedback()
    payload_bytes, first_kept, first_decoded = [], None, None
    sent = [torch.zeros_like(t) for t in sequence[0]]
    for pseudo_grad in sequence:
        payload, decoded = feedback.compress(codec, pseudo_grad)
        payload_bytes.append(payload.nbytes)
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
        "residual": norm(feedback.residuals) / norm(sequence[-1]),
        "cosine": dot / (norm(total) * norm(sent)),
        "loss_first": bought(first_decoded, whole["first"]),
        "loss_all": bought(sent, whole["all"]),
    }


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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    overrides = args.set if args.set is not None else ["--data.val_fraction=0.1", "--train.lr=3e-3"]
    sequence, start, held_out = pseudo_gradients(overrides, args.warm_steps, args.rounds, args.inner_steps)
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
    for label, options in CODECS.items():
        m = measure(options, sequence, total, start, held_out, whole)
        lines.append(
            f"| {label} | {m['bytes']:,.0f} | {m['first_kept']:.3f} | {m['residual']:.2f} | {m['cosine']:.3f} "
            f"| {m['loss_first']:.3f} | {m['loss_all']:.3f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
