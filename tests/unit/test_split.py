"""The stage split: exact balance by parameter count (checked against brute force), and stages that hold exactly
their modules with the full model's names and weights."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from dilocox.models import Decoder, count_parameters, model_args
from dilocox.parallel import build_stage, format_split, split_layers, stage_parameter_counts


def _small_args(flavor: str):
    return model_args(flavor, vocab_size=2048)


def _brute_force_best(args, num_stages: int) -> tuple[int, int]:
    """(smallest possible largest stage, then largest possible smallest stage) over every contiguous split: the
    obvious, exponential reference."""
    with torch.device("meta"):
        model = Decoder(args)
    layer = sum(p.numel() for p in model.layers["0"].parameters())
    embedding = model.tok_embeddings.weight.numel()
    head = model.norm.weight.numel() + model.output.weight.numel()
    best = None
    for cuts in itertools.combinations(range(1, args.num_layers), num_stages - 1):
        bounds = (0, *cuts, args.num_layers)
        counts = [(bounds[s + 1] - bounds[s]) * layer for s in range(num_stages)]
        counts[0] += embedding
        counts[-1] += head
        key = (max(counts), -min(counts))
        best = key if best is None else min(best, key)
    return best[0], -best[1]


def _check_ranges(ranges: list[range], num_layers: int, num_stages: int) -> None:
    assert len(ranges) == num_stages
    assert ranges[0].start == 0 and ranges[-1].stop == num_layers
    for before, after in itertools.pairwise(ranges):
        assert before.stop == after.start  # contiguous
    assert [i for r in ranges for i in r] == list(range(num_layers))  # every layer exactly once
    assert all(len(r) >= 1 for r in ranges)


@pytest.mark.parametrize("flavor", ["debug", "tiny", "small"])
@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
def test_small_flavors_split_optimally(flavor, num_stages):
    args = _small_args(flavor)
    if num_stages > args.num_layers:
        with pytest.raises(ValueError, match="topology.pp_degree"):
            split_layers(args, num_stages)
        return
    ranges = split_layers(args, num_stages)
    _check_ranges(ranges, args.num_layers, num_stages)
    counts = stage_parameter_counts(args, num_stages)
    assert sum(counts) == count_parameters(args)
    # Whole layers cannot always balance small models (tiny at 4 stages: one block each, plus the embedding on
    # stage 0), so the bound checked here is optimality, against every possible split.
    assert (max(counts), min(counts)) == _brute_force_best(args, num_stages)
    assert split_layers(args, num_stages) == ranges  # deterministic


def test_split_gives_the_end_stages_fewer_layers():
    # medium: the embedding and the head are each about 0.3 of a block; 16 layers over 3 stages.
    args = _small_args("medium")
    assert [len(r) for r in split_layers(args, 3)] == [5, 6, 5]
    assert [len(r) for r in split_layers(args, 2)] == [8, 8]


def test_qwen_107b_splits_into_eight_balanced_stages_on_meta():
    args = model_args("qwen1.5-107b")
    ranges = split_layers(args, 8)
    _check_ranges(ranges, args.num_layers, 8)
    counts = stage_parameter_counts(args, 8)
    assert sum(counts) == count_parameters(args) == 107_132_971_008
    assert max(counts) / min(counts) <= 1.15
    # The embedding and head (1.25B each, about 0.92 of a 1.36B block) cost the end stages a layer.
    assert [len(r) for r in ranges] == [9, 9, 10, 10, 10, 10, 10, 9]
    table = format_split(args, 8)
    assert "tok_embeddings" in table.splitlines()[1] and "norm, output" in table.splitlines()[8]
    assert "max/min = 1.111" in table


def test_split_errors():
    args = _small_args("tiny")
    with pytest.raises(ValueError, match="topology.pp_degree = 5 exceeds the model's 4 layers"):
        split_layers(args, 5)
    with pytest.raises(ValueError, match="topology.pp_degree = 0"):
        split_layers(args, 0)
    with pytest.raises(ValueError, match="stage 4 is outside"):
        build_stage(args, 4, 4, seed=0)


def test_build_stage_holds_only_its_modules_with_the_full_models_names_and_weights():
    args = _small_args("small")
    full = Decoder(args)
    full.init_weights(7)
    full_params = dict(full.named_parameters())
    num_stages = 3
    ranges = split_layers(args, num_stages)
    seen: list[str] = []
    inputs = torch.randint(0, args.vocab_size, (2, 8))
    hidden = inputs
    for stage in range(num_stages):
        module = build_stage(args, stage, num_stages, seed=7)
        assert sorted(module.layers.keys(), key=int) == [str(i) for i in ranges[stage]]
        assert (module.tok_embeddings is not None) == (stage == 0)
        assert (module.norm is not None) == (module.output is not None) == (stage == num_stages - 1)
        for name, param in module.named_parameters():
            assert torch.equal(param, full_params[name]), name
            seen.append(name)
        assert not any(buffer.is_meta for buffer in module.buffers())
        with torch.no_grad():
            hidden = module(hidden)  # (batch, seq, dim), then logits
    # The stages together are the full model, each parameter exactly once, and compute its logits.
    assert sorted(seen) == sorted(full_params)
    with torch.no_grad():
        torch.testing.assert_close(hidden, full(inputs), rtol=0, atol=0)


def test_single_stage_is_the_whole_model():
    args = _small_args("debug")
    module = build_stage(args, 0, 1, seed=1)
    full = Decoder(args)
    full.init_weights(1)
    assert module.state_dict().keys() == full.state_dict().keys()
    for name, tensor in full.state_dict().items():
        assert torch.equal(module.state_dict()[name], tensor)


def test_tied_embeddings_cannot_be_split():
    args = replace(_small_args("debug"), tie_embeddings=True)
    with pytest.raises(ValueError, match="model.flavor"):
        build_stage(args, 0, 2, seed=0)
    module = build_stage(args, 0, 1, seed=0)  # one stage holds both ends: the tie is kept
    assert module.output.weight is module.tok_embeddings.weight
    assert stage_parameter_counts(args, 1) == [count_parameters(args)]
