"""The pieces of a resume at another dp degree (dilocox/reshape.py) that need no processes: what each replica holds
of a fragment's tensors put together and cut anew, the link counters merged, and the settings that keep the saved
degree."""

import pytest
import torch

from dilocox.checkpoint import reshape_refusal
from dilocox.config import load_config
from dilocox.reshape import _Layout, _merged_counters

SHAPES = [torch.Size(s) for s in ([64, 32], [32], [128, 32], [32, 32], [7], [512])]


@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize(("old", "new"), [(2, 4), (2, 1), (3, 2), (4, 3)])
def test_every_piece_of_every_tensor_reaches_the_new_replica_that_holds_it(old, new, sharded):
    """The pieces each replica holds (whole tensors of its slice, or its dim-0 rows of every tensor as FSDP2 cuts
    them) at `old` replicas put together, cut for `new` replicas and put together again: the same tensors."""
    full = [torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i, shape in enumerate(SHAPES)]
    there, back = _Layout(old, new, 0, sharded=sharded), _Layout(new, old, 0, sharded=sharded)
    for slices in (True, False):
        parts = [(there.slice_parts if slices else there.flat_parts)(SHAPES, old, d) for d in range(old)]
        held = [[full[t][a:b] for t, a, b in replica] for replica in parts]
        whole = there.assemble(SHAPES, held, slices)
        assert all(torch.equal(a, b) for a, b in zip(whole, full, strict=True))
        cut = [_Layout(old, new, d, sharded=sharded).mine(SHAPES, whole, slices) for d in range(new)]
        again = back.assemble(SHAPES, cut, slices)
        assert all(torch.equal(a, b) for a, b in zip(again, full, strict=True))
    if sharded:  # FSDP2's cut: ceil(rows / D) rows each, the last short or empty
        assert [there.flat_parts(SHAPES, 3, d)[4] for d in range(3)] == [(4, 0, 3), (4, 3, 6), (4, 6, 7)]
    else:  # each tensor on exactly one replica
        counts = [t for d in range(new) for t, _, _ in there.slice_parts(SHAPES, new, d)]
        assert sorted(counts) == list(range(len(SHAPES)))


def test_a_sharded_flat_vector_is_recut_for_the_new_replicas():
    layout = _Layout(2, 3, 1, sharded=True)
    full = [
        torch.arange(shape.numel(), dtype=torch.float32).reshape(shape) + 1000 * t for t, shape in enumerate(SHAPES)
    ]
    flats = [torch.cat([full[t][a:b].reshape(-1) for t, a, b in layout.flat_parts(SHAPES, 2, d)]) for d in range(2)]
    whole = layout.assemble(SHAPES, [layout.split_flat(SHAPES, f, d) for d, f in enumerate(flats)], slices=False)
    mine = layout.mine_flat(SHAPES, whole)
    assert torch.equal(mine, torch.cat([full[t][a:b].reshape(-1) for t, a, b in layout.flat_parts(SHAPES, 3, 1)]))


def test_the_link_counters_keep_the_runs_totals_and_the_collectives_numbering():
    saved = [
        {"bytes_sent": 100 + d, "link_busy_s": 1.5, "num_transfers": 12, "num_launched": 30, "peak_in_flight_bytes": d}
        for d in range(2)
    ]
    merged = [_merged_counters(saved, [saved], index, 1) for index in range(1)]
    assert merged == [
        {"bytes_sent": 201, "link_busy_s": 3.0, "num_transfers": 12, "num_launched": 30, "peak_in_flight_bytes": 1}
    ]
    wider = [_merged_counters(saved, [saved], index, 4) for index in range(4)]
    assert sum(c["bytes_sent"] for c in wider) == 201 and [c["bytes_sent"] for c in wider] == [100, 101, 0, 0]
    assert {c["num_transfers"] for c in wider} == {12} and {c["num_launched"] for c in wider} == {30}


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        ([], None),
        (["--compression.kind=none"], None),
        (["--preset=allreduce"], None),
        (["--topology.elastic=true"], None),
        (["--topology.dp_mode=shard"], None),
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
