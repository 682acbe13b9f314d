"""The pieces of a resume at another dp degree (dilocox/reshape.py) that need no processes: the residuals of whole
tensors redistributed over new slices, the link counters merged, and the settings that keep the saved degree."""

import pytest
import torch

from dilocox.checkpoint import reshape_refusal
from dilocox.config import load_config
from dilocox.reshape import _merged_counters, _replica_tensors, _tensors_of_replicas

SHAPES = [torch.Size(s) for s in ([64, 32], [32], [128, 32], [32, 32], [7], [512])]


def _feedbacks(full: list[torch.Tensor], dp: int) -> list[dict]:
    """The error-feedback states `dp` replicas save: each its slice's residuals, keyed by position."""
    return [
        {"enabled": True, "residuals": {str(i): full[t] for i, t in enumerate(_replica_tensors(SHAPES, dp, index))}}
        for index in range(dp)
    ]


@pytest.mark.parametrize(("old", "new"), [(2, 4), (2, 1), (3, 2), (4, 3)])
def test_every_tensors_residual_reaches_the_new_replica_whose_slice_holds_it(old, new):
    full = [torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i, shape in enumerate(SHAPES)]
    gathered = _tensors_of_replicas(_feedbacks(full, old), SHAPES, old)
    assert all(torch.equal(a, b) for a, b in zip(gathered, full, strict=True))
    slices = [_replica_tensors(SHAPES, new, index) for index in range(new)]
    assert sorted(t for tensors in slices for t in tensors) == list(range(len(SHAPES)))  # each tensor once
    again = _tensors_of_replicas(_feedbacks(gathered, new), SHAPES, new)
    assert all(torch.equal(a, b) for a, b in zip(again, full, strict=True))


def test_nothing_held_back_yet_stays_nothing():
    assert _tensors_of_replicas([{"enabled": True, "residuals": {}}] * 2, SHAPES, 2) is None


def test_the_link_counters_keep_the_runs_totals_and_the_collectives_numbering():
    saved = [
        {"bytes_sent": 100 + d, "link_busy_s": 1.5, "num_transfers": 12, "num_launched": 30, "peak_in_flight_bytes": d}
        for d in range(2)
    ]
    merged = [_merged_counters(saved, index, 1) for index in range(1)]
    assert merged == [
        {"bytes_sent": 201, "link_busy_s": 3.0, "num_transfers": 12, "num_launched": 30, "peak_in_flight_bytes": 1}
    ]
    wider = [_merged_counters(saved, index, 4) for index in range(4)]
    assert sum(c["bytes_sent"] for c in wider) == 201 and [c["bytes_sent"] for c in wider] == [100, 101, 0, 0]
    assert {c["num_transfers"] for c in wider} == {12} and {c["num_launched"] for c in wider} == {30}


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        ([], None),
        (["--compression.kind=none"], None),
        (["--preset=allreduce"], None),
        (["--topology.elastic=true"], "an elastic run's clusters resume at the dp degree they were saved with"),
        (["--topology.dp_mode=shard"], "a sharded stage (topology.dp_mode = shard) resumes at the dp degree"),
        (["--sync.round.mode=time", "--sync.overlap_steps=0"], "time rounds (sync.round.mode = time) resume"),
        (["--preset=cocktail"], "sync.kind = cocktail resumes at the dp degree it was saved with"),
        (
            ["--compression.kind=int4", "--compression.reduction=scalable"],
            "compression.reduction = scalable keeps state shared over a stage's replicas",
        ),
    ],
)
def test_what_cannot_change_its_dp_degree_says_why_and_how(flags, said):
    cfg = load_config(None, ["--topology.dp_degree=2", *flags])
    problem = reshape_refusal(cfg, {"topology.dp_degree": 4})
    if said is None:
        assert problem is None
    else:
        assert said in problem and problem.endswith("resume with --topology.dp_degree=4 or start a new run directory")
