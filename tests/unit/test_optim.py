"""`train.optimizer = muon`: which parameters Muon gets, `MuonAdamW` against the two torch optimizers it combines,
its state dict, its learning rates on the trainer's schedule and its state's size."""

import copy
import dataclasses
import io

import pytest
import torch

from dilocox.config import load_config
from dilocox.models import Decoder, model_args
from dilocox.optim import MuonAdamW, inner_state_bytes, split_muon_parameters
from dilocox.parallel import build_stage
from dilocox.trainer import build_inner_optimizer, lr_at, set_inner_lr

MATRICES = ["attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "attention.wo.weight",
            "feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight"]  # fmt: skip
OTHERS = ["attention_norm.weight", "attention.wq.bias", "attention.wk.bias", "attention.wv.bias", "ffn_norm.weight"]


def block(index: int, names: list[str]) -> list[str]:
    return [f"layers.{index}.{name}" for name in names]


def debug_args(**changes):
    return dataclasses.replace(model_args("debug", vocab_size=300), max_seq_len=32, **changes)


def names(named) -> list[str]:
    return [name for name, _ in named]


def test_muon_gets_the_blocks_matrices_of_the_debug_model():
    muon, adamw = split_muon_parameters(Decoder(debug_args()))
    assert names(muon) == block(0, MATRICES) + block(1, MATRICES)
    head = ["norm.weight", "output.weight"]
    assert names(adamw) == ["tok_embeddings.weight", *block(0, OTHERS), *block(1, OTHERS), *head]


def test_a_tied_head_stays_with_adamw():
    model = Decoder(debug_args(tie_embeddings=True))
    muon, adamw = split_muon_parameters(model)
    assert names(muon) == block(0, MATRICES) + block(1, MATRICES)
    assert names(adamw) == ["tok_embeddings.weight", *block(0, OTHERS), *block(1, OTHERS), "norm.weight"]
    assert model.output.weight is model.tok_embeddings.weight  # the head is the embedding: one AdamW parameter


def test_each_pipeline_stage_splits_its_own_parameters():
    """pp 2: stage 0 owns the embedding and block 0, stage 1 block 1, the final norm and the head; each stage's
    optimizer holds exactly its stage's parameters, Muon's group first."""
    expected = {
        0: (block(0, MATRICES), ["tok_embeddings.weight", *block(0, OTHERS)]),
        1: (block(1, MATRICES), [*block(1, OTHERS), "norm.weight", "output.weight"]),
    }
    cfg = load_config(None, ["--train.optimizer=muon"])
    for stage, (want_muon, want_adamw) in expected.items():
        model = build_stage(debug_args(), stage, 2, seed=0)
        muon, adamw = split_muon_parameters(model)
        assert (names(muon), names(adamw)) == (want_muon, want_adamw)
        optimizer = build_inner_optimizer(cfg, model)
        assert isinstance(optimizer, MuonAdamW)
        by_id = {id(p): name for name, p in model.named_parameters()}
        grouped = [[by_id[id(p)] for p in group["params"]] for group in optimizer.param_groups]
        assert grouped[0] == want_muon
        assert sorted(grouped[1] + grouped[2]) == sorted(want_adamw)
        assert grouped[1] == [n for n in want_adamw if model.get_parameter(n).ndim == 2]  # decayed: embedding, head
        assert [g["weight_decay"] for g in optimizer.param_groups] == [cfg.train.weight_decay] * 2 + [0.0]


def loss_of(model: Decoder, step: int) -> torch.Tensor:
    tokens = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(step))
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def combined(model: Decoder) -> MuonAdamW:
    muon, adamw = split_muon_parameters(model)
    return MuonAdamW([p for _, p in muon], [p for _, p in adamw], lr=2e-3, muon_lr=5e-3, weight_decay=0.1)


def train(model: Decoder, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        loss_of(model, step).backward()
        for group in optimizer.param_groups:  # a schedule that moves, as the trainer's does
            group["lr"] *= 0.9
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_muon_adamw_steps_as_torch_muon_and_adamw_side_by_side():
    """The reference is torch.optim.Muon's own recipe: Muon over the matrices and AdamW over the rest, each
    stepped on the same gradients. MuonAdamW gives the same parameters bit for bit, and the loss goes down."""
    model, reference = Decoder(debug_args()), Decoder(debug_args())
    muon, adamw = split_muon_parameters(reference)
    ref_muon = torch.optim.Muon(
        [p for _, p in muon], lr=5e-3, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw"
    )
    decayed, not_decayed = [p for _, p in adamw if p.ndim == 2], [p for _, p in adamw if p.ndim < 2]
    ref_adamw = torch.optim.AdamW(
        [{"params": decayed, "weight_decay": 0.1}, {"params": not_decayed, "weight_decay": 0.0}],
        lr=2e-3,
        betas=(0.9, 0.95),
    )
    optimizer = combined(model)
    before = loss_of(model, 0).item()
    for step in range(5):
        loss_of(reference, step).backward()
        for group in [*ref_muon.param_groups, *ref_adamw.param_groups]:
            group["lr"] *= 0.9
        ref_muon.step()
        ref_adamw.step()
        ref_muon.zero_grad()
        ref_adamw.zero_grad()
    train(model, optimizer, range(5))
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([5e-3 * 0.9**5] + [2e-3 * 0.9**5] * 2)
    assert loss_of(model, 0).item() < before - 0.1


def test_state_dict_round_trips_and_resumes_bit_for_bit():
    """4 steps, state dict through torch.save / torch.load(weights_only=True) as a checkpoint does, a fresh
    optimizer loads it and runs 4 more: the parameters are those of 8 steps straight. A deep copy keeps working."""
    straight = Decoder(debug_args())
    train(straight, combined(straight), range(8))

    first = Decoder(debug_args())
    optimizer = combined(first)
    train(first, optimizer, range(4))
    saved = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": optimizer.state_dict()}, saved)
    saved.seek(0)
    state = torch.load(saved, weights_only=True)
    assert len(state["optimizer"]["param_groups"]) == 3
    assert all("momentum_buffer" in state["optimizer"]["state"][i] for i in range(len(MATRICES) * 2))
    assert all("exp_avg_sq" in s for i, s in state["optimizer"]["state"].items() if i >= len(MATRICES) * 2)

    resumed = Decoder(debug_args())
    resumed.load_state_dict(state["model"])
    optimizer = combined(resumed)
    optimizer.load_state_dict(state["optimizer"])
    assert optimizer.muon.param_groups[0] is optimizer.param_groups[0]  # the loaded groups are the ones stepped
    assert optimizer.adamw.state is optimizer.state and optimizer.muon.state is optimizer.state
    train(resumed, optimizer, range(4, 8))
    for (name, p), q in zip(resumed.named_parameters(), straight.parameters(), strict=True):
        assert torch.equal(p, q), name

    twin = copy.deepcopy(optimizer)
    assert twin.muon.param_groups[0] is twin.param_groups[0] and twin.muon.state is twin.state


def test_clearing_the_state_restarts_both_optimizers():
    """The guard's heal clears the inner optimizer's state: both halves then start afresh, as a new MuonAdamW."""
    model, fresh = Decoder(debug_args()), Decoder(debug_args())
    optimizer = combined(model)
    train(model, optimizer, range(2))
    fresh.load_state_dict(model.state_dict())
    optimizer.state.clear()
    lrs = [g["lr"] for g in optimizer.param_groups]
    reference = combined(fresh)
    for group, lr in zip(reference.param_groups, lrs, strict=True):
        group["lr"] = lr
    train(model, optimizer, range(2, 4))
    train(fresh, reference, range(2, 4))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters(), strict=True))


def test_muon_follows_the_trainers_schedule_from_its_own_peak():
    cfg = load_config(None, ["--train.optimizer=muon", "--train.lr=2e-3", "--train.muon_lr=6e-3", "--train.steps=50",
                             "--train.warmup_steps=5"])  # fmt: skip
    optimizer = build_inner_optimizer(cfg, Decoder(debug_args()))
    for step in (0, 4, 5, 30, 49):
        set_inner_lr(optimizer, cfg, step)
        lrs = [g["lr"] for g in optimizer.param_groups]
        assert lrs == [lr_at(cfg, step, peak=6e-3), lr_at(cfg, step), lr_at(cfg, step)]
        assert lrs[0] == pytest.approx(3 * lrs[1], rel=1e-12)  # the same schedule, scaled by muon_lr / lr
    assert lr_at(cfg, 4, peak=6e-3) == pytest.approx(6e-3)  # the end of the warm-up: the peak
    assert lr_at(cfg, 49, peak=6e-3) == pytest.approx(6e-3 * cfg.train.min_lr_ratio)


def test_inner_state_bytes_count_one_buffer_per_muon_matrix_and_two_per_adamw_parameter():
    model = Decoder(debug_args())
    muon, adamw = split_muon_parameters(model)
    muon_numel, adamw_numel = (sum(p.numel() for _, p in part) for part in (muon, adamw))
    assert inner_state_bytes(combined(model)) == 4 * muon_numel + 2 * 4 * adamw_numel
    assert inner_state_bytes(torch.optim.AdamW(model.parameters())) == 2 * 4 * (muon_numel + adamw_numel)
    assert inner_state_bytes(torch.optim.SGD(model.parameters(), lr=0.1)) == 0
    optimizer = combined(model)
    train(model, optimizer, range(1))  # what the first step allocates is what was counted
    allocated = sum(t.numel() * t.element_size() for s in optimizer.state.values() for k, t in s.items() if k != "step")
    assert allocated == inner_state_bytes(optimizer)


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--train.muon_lr=0", "train.muon_lr = 0.0 must be > 0"),
        ("--train.muon_momentum=1.0", "train.muon_momentum = 1.0 must be in [0, 1)"),
        ("--train.optimizer=lion", "train.optimizer"),
    ],
)
def test_bad_muon_settings_are_refused_naming_the_field(flag, message):
    cfg = load_config(None, ["--train.optimizer=muon", flag])
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(")", r"\)")) as error:
        cfg.validate(cfg.world_size)
    assert "\n" not in str(error.value)
