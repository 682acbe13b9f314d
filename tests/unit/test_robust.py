"""The numeric guard, the robust aggregates and the injected faults, on tensors (no process group)."""

import math

import pytest
import torch

from dilocox.config import load_config
from dilocox.faults import FaultConfig
from dilocox.sync.robust import UpdateGuard, aggregate


def updates(*rows) -> list[torch.Tensor]:
    return [torch.tensor(row, dtype=torch.float32) for row in rows]


def test_aggregates_against_hand_computed_values():
    u = updates([1.0, -4.0, 0.0], [2.0, 0.0, 10.0], [3.0, 4.0, -2.0], [100.0, 8.0, 1.0])
    assert torch.equal(aggregate(u, "mean"), torch.tensor([106 / 4, 8 / 4, 9 / 4]))
    # median of four: the mean of the two middle values per coordinate
    assert torch.equal(aggregate(u, "median"), torch.tensor([2.5, 2.0, 0.5]))
    assert torch.equal(aggregate(u[:3], "median"), torch.tensor([2.0, 0.0, 0.0]))
    # trimmed mean, 0.25 of four: drop the largest and the smallest per coordinate
    assert torch.equal(aggregate(u, "trimmed_mean", trim_fraction=0.25), torch.tensor([2.5, 2.0, 0.5]))
    five = [*u, torch.tensor([0.0, 1.0, 3.0])]
    assert torch.allclose(aggregate(five, "trimmed_mean", trim_fraction=0.25), torch.tensor([2.0, 5 / 3, 4 / 3]))
    # fewer than three: nothing to trim, the plain mean
    assert torch.equal(aggregate(u[:2], "trimmed_mean"), torch.tensor([1.5, -2.0, 5.0]))


def test_norm_clip_limits_a_long_update_to_the_median_norm():
    u = updates([3.0, 4.0], [0.0, 5.0], [5.0, 0.0], [600.0, 800.0])  # norms 5, 5, 5, 1000
    expected = (
        torch.tensor([3.0, 4.0]) + torch.tensor([0.0, 5.0]) + torch.tensor([5.0, 0.0]) + torch.tensor([3.0, 4.0])
    ) / 4
    assert torch.allclose(aggregate(u, "norm_clip"), expected)


def test_one_update_is_returned_as_is_and_none_is_an_error():
    (only,) = updates([1.0, 2.0])
    assert torch.equal(aggregate([only], "median"), only)
    with pytest.raises(ValueError, match="at least one"):
        aggregate([], "mean")
    with pytest.raises(ValueError, match="sync.aggregate"):
        aggregate([only, only], "mode")


def test_robust_aggregates_resist_one_liar_of_four():
    torch.manual_seed(0)
    honest = [torch.full((1000,), 1.0) + 0.01 * torch.randn(1000) for _ in range(3)]
    true_mean = sum(honest) / 3
    for liar in (-honest[0], 1000 * honest[0], torch.randn(1000) * honest[0].norm() / math.sqrt(1000)):
        for how in ("median", "trimmed_mean"):
            error = (aggregate([*honest, liar], how) - true_mean).norm() / true_mean.norm()
            assert error < 0.05, (how, float(error))
        # the plain mean is pulled away by a sign flip or a huge update
    assert (aggregate([*honest, -honest[0]], "mean") - true_mean).norm() / true_mean.norm() > 0.4


def test_guard_leaves_out_missing_nonfinite_and_outsized_updates():
    guard = UpdateGuard(max_ratio=10.0)
    normal = torch.ones(16)
    verdicts = guard.judge([normal, 2 * normal, None, torch.full((16,), math.nan), 1000 * normal])
    assert verdicts[0] is None and verdicts[1] is None
    assert verdicts[2] == "no usable update arrived"
    assert verdicts[3] == "non-finite values"
    assert verdicts[4] is not None and "x the recent median" in verdicts[4]


def test_guard_history_decides_once_rounds_were_accepted():
    guard = UpdateGuard(max_ratio=10.0)
    # round 1 of two clusters: the median of this round's norms cannot tell which of two is wrong
    assert guard.judge([torch.ones(4), 100 * torch.ones(4)]) == [None, None]
    guard.accept([torch.ones(4), torch.ones(4)])
    verdicts = guard.judge([torch.ones(4), 100 * torch.ones(4)])
    assert verdicts[0] is None and verdicts[1] is not None
    # a slowly growing norm stays in
    assert guard.judge([5 * torch.ones(4)]) == [None]
    restored = UpdateGuard(max_ratio=10.0)
    restored.load_state_dict(guard.state_dict())
    assert restored.reference([]) == guard.reference([]) == 2.0


def test_fault_config_rounds_and_corruptions():
    faults = FaultConfig(kind="scale", cluster=2, rounds="3-4", scale=10.0)
    faults.validate(num_clusters=4)
    assert [faults.active(cluster=2, round_index=r) for r in range(1, 6)] == [False, False, True, True, False]
    assert not faults.active(cluster=1, round_index=3)
    assert FaultConfig(kind="sign", rounds="2-").round_range() == (2, None)
    g = torch.tensor([3.0, -4.0])
    assert torch.equal(faults.corrupt(g, round_index=3), 10 * g)
    assert torch.equal(FaultConfig(kind="sign").corrupt(g, round_index=1), -g)
    assert torch.isnan(FaultConfig(kind="nan").corrupt(g, round_index=1)).all()
    noise = FaultConfig(kind="random").corrupt(g, round_index=7)
    assert math.isclose(float(noise.norm()), 5.0, rel_tol=1e-5) and not torch.allclose(noise, g)
    assert torch.equal(noise, FaultConfig(kind="random").corrupt(g, round_index=7))  # the same on every dp replica


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--sync.kind=dilocox", "--sync.aggregate=median", "--compression.kind=none"], "sum"),
        (
            [
                "--sync.kind=dilocox",
                "--sync.aggregate=median",
                "--compression.reduction=scalable",
                "--compression.kind=int4",
            ],
            "sum",
        ),
        (["--sync.kind=allreduce", "--sync.aggregate=median"], "outer loop"),
        (["--sync.kind=dilocox", "--sync.trim_fraction=0.5"], "sync.trim_fraction"),
        (["--sync.kind=dilocox", "--sync.guard_max_ratio=1"], "sync.guard_max_ratio"),
        (["--sync.kind=dilocox", "--sync.guard_max_bad_rounds=0"], "guard_max_bad_rounds"),
        (["--sync.kind=dilocox", "--faults.kind=scale", "--faults.cluster=2"], "faults.cluster"),
        (["--sync.kind=dilocox", "--faults.kind=scale", "--faults.rounds=5-2"], "faults.rounds"),
        (["--sync.kind=dilocox", "--faults.kind=scale", "--faults.rounds=x"], "faults.rounds"),
        (["--sync.kind=allreduce", "--faults.kind=scale"], "outer rounds"),
    ],
)
def test_bad_guard_and_fault_settings_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides).validate()
