"""CocktailSGD's sparse int4 codec (dilocox.compress.sparse) and its sync without a slow link: no process group."""

import math

import pytest
import torch

from dilocox.compress import CocktailConfig
from dilocox.compress.int4 import QMAX
from dilocox.compress.payload import Payload
from dilocox.compress.sparse import SparseInt4Codec, sample_seed
from dilocox.net.channel import WanChannel
from dilocox.sync.cocktail import CocktailSync


def sparse_codec(seed: int = 0, **options) -> SparseInt4Codec:
    return SparseInt4Codec(CocktailConfig(**options), seed=seed)


def randn(numel: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def hand_nbytes(numel: int, sample_ratio: float, topk_ratio: float, group_size: int) -> int:
    """The documented formula, written out: w k + 2 ceil(k / g) + ceil(k / 2)."""
    if numel == 0:
        return 0
    m = min(numel, max(1, round(sample_ratio * numel)))
    k = min(m, max(1, round(topk_ratio * numel)))
    width = 2 if m <= 65536 else 4
    return width * k + 2 * math.ceil(k / group_size) + math.ceil(k / 2)


@pytest.mark.parametrize(
    ("numel", "sample_ratio", "topk_ratio", "group_size", "nbytes"),
    [
        (1, 0.1, 0.01, 64, 2 + 2 + 1),  # m = k = 1
        (5, 0.1, 0.01, 64, 2 + 2 + 1),  # round(0.05) = 0 -> k = 1; round(0.5) = 0 -> m = 1
        (7, 1.0, 1.0, 4, 2 * 7 + 2 * 2 + 4),  # every value sent, odd k, a short last group
        (1000, 0.1, 0.01, 64, 2 * 10 + 2 * 1 + 5),
        (1001, 0.5, 0.333, 8, 2 * 333 + 2 * 42 + 167),
        (65536, 1.0, 0.5, 64, 2 * 32768 + 2 * 512 + 16384),  # the largest sample with uint16 positions
        (65537, 1.0, 0.01, 64, 4 * 655 + 2 * 11 + 328),  # one more: int32 positions
        (1_312_896, 0.1, 0.01, 64, 4 * 13129 + 2 * 206 + 6565),  # the tiny flavor at the defaults
    ],
)
def test_exact_nbytes(numel, sample_ratio, topk_ratio, group_size, nbytes):
    codec = sparse_codec(sample_ratio=sample_ratio, topk_ratio=topk_ratio, group_size=group_size)
    assert hand_nbytes(numel, sample_ratio, topk_ratio, group_size) == nbytes
    assert codec.expected_nbytes(numel) == nbytes
    payload = codec.encode(randn(numel), step=3)
    assert payload.nbytes == nbytes
    assert codec.decode(payload, numel, step=3).shape == (numel,)


def test_empty_shard_is_an_empty_payload():
    codec = sparse_codec()
    payload = codec.encode(torch.empty(0), step=0)
    assert payload.nbytes == codec.expected_nbytes(0) == 0
    assert codec.decode(payload, 0, step=0).shape == (0,)


def test_sample_is_shared_by_seed_and_step_and_changes_every_step():
    numel = 10_007
    first, second = sparse_codec(seed=5), sparse_codec(seed=5, topk_ratio=0.05, group_size=32)
    sample = first.sample_indices(numel, step=11)
    assert torch.equal(sample, second.sample_indices(numel, step=11))  # another instance (another cluster)
    assert sample.numel() == first.sample_size(numel) == 1001
    assert torch.equal(sample.unique(), sample)  # distinct and sorted
    assert 0 <= int(sample.min()) and int(sample.max()) < numel
    assert not torch.equal(sample, first.sample_indices(numel, step=12))
    assert not torch.equal(sample, sparse_codec(seed=6).sample_indices(numel, step=11))
    assert sample_seed(5, 11) != sample_seed(5, 12)
    # over many steps every coordinate is sampled about sample_ratio of the time
    counts = torch.zeros(numel)
    for step in range(200):
        counts[first.sample_indices(numel, step=step)] += 1
    assert abs(float(counts.mean()) / 200 - 0.1) < 1e-3
    assert int(counts.min()) > 0


@pytest.mark.parametrize(("numel", "sample_ratio", "topk_ratio"), [(5000, 0.2, 0.02), (999, 1.0, 0.1), (300, 0.5, 0.5)])
def test_round_trip_keeps_the_largest_sampled_values(numel, sample_ratio, topk_ratio):
    group_size = 16
    codec = sparse_codec(sample_ratio=sample_ratio, topk_ratio=topk_ratio, group_size=group_size, seed=1)
    values = randn(numel, seed=2) * torch.linspace(0.1, 3.0, numel)
    decoded = codec.decode(codec.encode(values, step=4), numel, step=4)

    # slow reference: sort the sample by magnitude, keep the first k
    sample = codec.sample_indices(numel, step=4).tolist()
    ranked = sorted(sample, key=lambda index: -abs(float(values[index])))
    k = codec.num_selected(numel)
    kept = ranked[:k]
    others = torch.ones(numel, dtype=torch.bool)
    others[kept] = False
    assert torch.count_nonzero(decoded[others]) == 0  # zeros everywhere else, exactly
    # int4 with groups taken in order of decreasing magnitude: each error is at most half a scale, the scale
    # being the group's absmax / 7 rounded up to fp16 (relative step 2^-10)
    for start in range(0, k, group_size):
        group = kept[start : start + group_size]
        bound = abs(float(values[group[0]])) / QMAX / 2 * (1 + 2**-10) + 1e-12
        errors = (decoded[group] - values[group]).abs()
        assert float(errors.max()) <= bound


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"sample_ratio": 0.0}, "cocktail.sample_ratio"),
        ({"sample_ratio": 1.5}, "cocktail.sample_ratio"),
        ({"sample_ratio": float("nan")}, "cocktail.sample_ratio"),
        ({"topk_ratio": 0.0}, "cocktail.topk_ratio"),
        ({"topk_ratio": -0.1}, "cocktail.topk_ratio"),
        ({"sample_ratio": 0.1, "topk_ratio": 0.2}, "cocktail.topk_ratio"),
        ({"group_size": 0}, "cocktail.group_size"),
        ({"group_size": 2.5}, "cocktail.group_size"),
        ({"seed": -1}, "run.seed"),
    ],
)
def test_bad_options_name_the_field(options, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        sparse_codec(**options)


def test_bad_calls_say_what_to_fix():
    codec = sparse_codec(sample_ratio=0.5, topk_ratio=0.1)
    payload = codec.encode(randn(100), step=0)
    with pytest.raises(ValueError, match="same cocktail.sample_ratio"):
        codec.decode(payload, 200, step=0)
    with pytest.raises(ValueError, match="step"):
        codec.encode(randn(100), step=-1)
    with pytest.raises(ValueError, match="flat"):
        codec.encode(torch.zeros(4, 4), step=0)
    corrupt = payload.data.clone()
    corrupt[0], corrupt[1] = 255, 255  # position 65535 in a sample of 50
    with pytest.raises(ValueError, match="same seed"):
        codec.decode(Payload(corrupt), 100, step=0)


def test_sync_with_one_cluster_passes_gradients_through_and_keeps_its_state():
    """No slow link, nothing to spare: exact gradients; the counter and residual round-trip through state_dict."""
    model = torch.nn.Linear(6, 3)
    channel = WanChannel(None, bandwidth=None, latency_s=0.0)
    cfg = CocktailConfig(sample_ratio=0.5, topk_ratio=0.1, group_size=4)
    sync = CocktailSync(model.parameters(), cfg, channel=channel, dp_group=None)
    model(torch.randn(2, 6)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    sync.reduce_gradients()
    for p, g in zip(model.parameters(), grads, strict=True):
        assert torch.equal(p.grad, g)
    assert sync.after_inner_step(1) is None and sync.status().boundary  # nothing crossed a link
    assert sync.payload_nbytes() == 0 and sync.bytes_per_step() == (0, 0)
    assert sync.state_bytes() == 4 * 21  # the fp32 residual of the whole (unsharded) gradient
    state = sync.state_dict()
    state["sync_step"] = 7
    state["feedback"] = {"enabled": True, "residuals": {"0": torch.arange(21, dtype=torch.float32)}}
    sync.load_state_dict(state)
    assert sync.sync_step == 7 and torch.equal(sync.feedback.residuals[0], torch.arange(21, dtype=torch.float32))
    with pytest.raises(ValueError, match="resume with the topology"):
        sync.load_state_dict({**state, "feedback": {"enabled": True, "residuals": {"0": torch.zeros(5)}}})
    with pytest.raises(ValueError, match="cocktail.topk_ratio"):
        CocktailSync(
            model.parameters(), CocktailConfig(sample_ratio=0.1, topk_ratio=0.5), channel=channel, dp_group=None
        )
