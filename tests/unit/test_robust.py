"""The numeric guard, the robust aggregates and the injected faults, on tensors (no process group)."""

import math
import statistics

import pytest
import torch

from dilocox.config import load_config
from dilocox.sync.faults import FaultConfig
from dilocox.sync.robust import (
    DISTRUSTED,
    FRESH_ROUNDS,
    MAGNITUDE_BITS,
    PeerCheck,
    UpdateGuard,
    aggregate,
    inner_products,
    magnitude_counts,
    median_magnitude,
    peer_statistics,
)


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


# ------------------------------------------------------------------------------------------------ the peer check
def reference_dot(a: torch.Tensor, b: torch.Tensor) -> float:
    """The exact inner product of two fp32 vectors, one Python float at a time (math.fsum rounds only once)."""
    return math.fsum(x * y for x, y in zip(a.tolist(), b.tolist(), strict=True))


def reference_median_magnitude(update: torch.Tensor) -> float:
    """The lower median of the nonzero |values| of `update`, rounded down to a multiple of 2^e / 2^MAGNITUDE_BITS where
    2^e <= it < 2^(e+1) (normal fp32 values): the lower edge of its magnitude bin, computed on Python floats."""
    values = sorted(abs(x) for x in update.tolist() if x != 0)
    if not values:
        return 0.0
    median = values[(len(values) + 1) // 2 - 1]
    mantissa, exponent = math.frexp(median)  # median = mantissa x 2^exponent, 0.5 <= mantissa < 1
    steps = 1 << MAGNITUDE_BITS
    return math.ldexp(0.5 + math.floor((2 * mantissa - 1) * steps) / (2 * steps), exponent)


def reference_shared_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """The cosine of `a` and `b` restricted to the positions where both are nonzero (0.0 where there is none)."""
    both = (a != 0) & (b != 0)
    x, y = a[both], b[both]
    squares = reference_dot(x, x) * reference_dot(y, y)
    return reference_dot(x, y) / math.sqrt(squares) if squares > 0 else 0.0


def reference_peer_exclusions(updates: list[torch.Tensor], candidates: list[int], ratio: float) -> set[int]:
    """The rule of docs/design.md §4.5 written out on the vectors: with 3+ candidates, out if the norm exceeds ratio x
    the median norm, or the median |value| sent exceeds ratio x the median of those; then, among the rest (3+), out if
    the cosine on the positions both sent is above -0.05 with fewer than floor((n-1)/2) others, provided those that are
    not out that way are a strict majority of the rest."""
    if len(candidates) < 3:
        return set()
    out = set()
    for size in (lambda u: math.sqrt(reference_dot(u, u)), reference_median_magnitude):
        sizes = {i: size(updates[i]) for i in candidates}
        median = statistics.median(sizes.values())
        out |= {i for i in candidates if median > 0 and sizes[i] > ratio * median}
    kept = [i for i in candidates if i not in out]
    if len(kept) >= 3:
        away = set()
        for i in kept:
            agreeing = [j for j in kept if j != i and reference_shared_cosine(updates[i], updates[j]) > -0.05]
            if len(agreeing) < (len(kept) - 1) // 2:
                away.add(i)
        if len(kept) - len(away) > len(kept) / 2:
            out |= away
    return out


def honest_updates(count: int, seed: int, *, numel: int = 500, signal: float = 0.5) -> list[torch.Tensor]:
    """Pseudo-gradients of clusters on the same task: a common direction plus each cluster's own noise."""
    generator = torch.Generator().manual_seed(seed)
    common = torch.randn(numel, generator=generator)
    return [signal * common + torch.randn(numel, generator=generator) for _ in range(count)]


def test_inner_products_match_exact_sums_whatever_the_chunks_and_shards():
    u = honest_updates(4, seed=1, numel=1000)
    u[3][::3] = 0.0  # sparse in part: S sums u_i^2 where u_3 sent something
    gram = [[reference_dot(a, b) for b in u] for a in u]
    shared = [[reference_dot(a.double() ** 2, (b != 0).double()) for b in u] for a in u]
    exact = torch.tensor([g + s for g, s in zip(gram, shared, strict=True)], dtype=torch.float64)
    for chunk in (1, 7, 1000, 1 << 18):
        assert torch.allclose(inner_products(u, chunk=chunk), exact, rtol=1e-12, atol=0)
    # a sharded update: the shards' matrices sum to the whole one's
    halves = inner_products([x[:300] for x in u]) + inner_products([x[300:] for x in u])
    assert torch.allclose(halves, exact, rtol=1e-12, atol=0)
    # a missing update: its rows and columns are 0, the rest unchanged
    products = inner_products([u[0], None, u[2], u[3]])
    assert torch.equal(products[1], torch.zeros(8, dtype=torch.float64))
    assert torch.equal(products[:, 1], torch.zeros(4, dtype=torch.float64))
    assert torch.equal(products[:, 5], products[:, 1])
    rest = [0, 2, 3]
    columns = rest + [4 + i for i in rest]
    assert torch.allclose(products[rest][:, columns], exact[rest][:, columns], rtol=1e-12, atol=0)


@pytest.mark.parametrize("seed", range(6))
def test_median_magnitude_against_the_slow_reference_whatever_the_shards(seed):
    generator = torch.Generator().manual_seed(seed)
    scale = float(10 ** torch.randint(-6, 4, (1,), generator=generator))
    u = [scale * torch.randn(301 + 40 * i, generator=generator) for i in range(3)]
    for update in u:  # sparse, as a top-k or random-k payload decodes: most values are 0
        update[torch.rand(update.shape, generator=generator) < 0.8] = 0.0
    u.append(torch.zeros(341))  # nothing sent: its median magnitude is 0
    counts = magnitude_counts(u)
    assert torch.equal(counts, magnitude_counts([x[:100] for x in u]) + magnitude_counts([x[100:] for x in u]))
    for update, row in zip(u, counts, strict=True):
        expected = reference_median_magnitude(update)
        assert median_magnitude(row.tolist()) == expected
        nonzero = update[update != 0].abs()
        if nonzero.numel():  # the bin's lower edge: less than 1/16 of itself below the true lower median
            true = float(nonzero.sort().values[(nonzero.numel() + 1) // 2 - 1])
            assert expected <= true < expected * (1 + 2**-MAGNITUDE_BITS)
    assert magnitude_counts([None, u[0]])[0].sum() == 0


def sparse_updates(count: int, seed: int, *, numel: int = 2000, kept: int = 100) -> list[torch.Tensor]:
    """What top-k payloads with error feedback decode to: each cluster sends its own positions (they overlap little)
    of a common direction, a few of them long (residuals grown over rounds), so norms vary more than magnitudes."""
    generator = torch.Generator().manual_seed(seed)
    common = torch.randn(numel, generator=generator)
    out = []
    for _ in range(count):
        update = torch.zeros(numel)
        index = torch.randperm(numel, generator=generator)[:kept]
        update[index] = common[index] + 0.3 * torch.randn(kept, generator=generator)
        update[index[:5]] *= 20  # long residual values
        out.append(update)
    return out


def test_peer_check_leaves_out_a_sparse_update_scaled_below_the_ratio_in_norm_by_its_median_magnitude():
    u = sparse_updates(3, seed=5)
    peers = PeerCheck(max_ratio=2.0)
    assert peers.judge(peer_statistics(u), [0, 1, 2]) == {}
    liar = u[2].clone()
    liar[liar.abs() > 5] /= 20  # a healed liar: no long residual values, the rest x 3
    liar *= 3
    stats = peer_statistics([u[0], u[1], liar])
    assert math.sqrt(stats[2, 2]) < 2.0 * math.sqrt(stats[0, 0])  # the norm alone would let it in
    excluded = peers.judge(stats, [0, 1, 2])
    assert list(excluded) == [2] and "median |value| sent" in excluded[2]
    assert set(excluded) == reference_peer_exclusions([u[0], u[1], liar], [0, 1, 2], 2.0)


def healed(update: torch.Tensor) -> torch.Tensor:
    """What the same cluster sends once it healed: its residual dropped, no long values."""
    out = update.clone()
    out[out.abs() > 5] /= 20
    return out


def test_peer_check_leaves_clusters_that_just_healed_out_of_the_size_median_but_still_judges_them():
    u = sparse_updates(3, seed=11)
    fresh = [u[0], healed(u[1]), healed(u[2])]  # clusters 1 and 2 restarted: no residual yet
    stats = peer_statistics(fresh)
    assert math.sqrt(stats[0, 0]) > 3 * math.sqrt(stats[1, 1])
    # counted in the median, the two healed clusters make the honest cluster 0 look outsized
    assert list(PeerCheck(max_ratio=2.0).judge(stats, [0, 1, 2])) == [0]
    peers = PeerCheck(max_ratio=2.0)
    assert peers.judge(None, [0], clusters=[0, 1, 2]) == {}  # the round they were down: 1 and 2 sent nothing
    assert peers.fresh == {1: FRESH_ROUNDS, 2: FRESH_ROUNDS}
    assert peers.judge(stats, [0, 1, 2]) == {}  # they count at cluster 0's size: the median is its own
    # a healed liar is still judged against the median of those that did not heal
    liar = peer_statistics([u[0], healed(u[1]), 4 * healed(u[2])])
    excluded = peers.judge(liar, [0, 1, 2])
    assert list(excluded) == [2] and "healed later counted at the largest of the others'" in excluded[2]
    # left out by the peer check, it keeps what earlier rounds held back (ErrorFeedback.undo): its count goes on
    assert peers.fresh == {1: FRESH_ROUNDS - 2, 2: FRESH_ROUNDS - 2}
    # every one healed (a run whose clusters keep failing): the one that healed longest ago is the reference, and a
    # cluster is not left out for being further from its heal than the others
    every = PeerCheck(max_ratio=2.0)
    every.judge(None, [], clusters=[0, 1, 2])  # all three restarted
    every.judge(None, [0], clusters=[0, 1, 2])  # 1 and 2 once more, a round later
    assert every.judge(stats, [0, 1, 2]) == {}
    assert list(PeerCheck(max_ratio=2.0).judge(stats, [0, 1, 2])) == [0]
    for _ in range(FRESH_ROUNDS):  # rounds in which every update counts: the healed clusters count again
        peers.judge(peer_statistics(u), [0, 1, 2])
    assert peers.fresh == {}
    # kept by cluster id (an elastic round's members), and through a checkpoint or a heal
    peers.judge(None, [0], clusters=[0, 2, 5])
    restored = PeerCheck(max_ratio=2.0)
    restored.load_state_dict(peers.state_dict())
    assert restored.fresh == {2: FRESH_ROUNDS, 5: FRESH_ROUNDS}


def test_peer_check_compares_weighted_payloads_per_unit_of_weight_and_without_sizes_where_weights_are_unknown():
    u = honest_updates(3, seed=7)
    weights = [2.0, 1.0, 1.0]  # clusters of dp 2, 1, 1: n_c / n_ref of a round of H steps
    sent = [w * x for w, x in zip(weights, u, strict=True)]
    stats = peer_statistics(sent)
    assert list(PeerCheck(max_ratio=1.9).judge(stats, [0, 1, 2])) == [0]  # unweighted, the dp-2 cluster reads as x2
    assert PeerCheck(max_ratio=1.9).judge(stats, [0, 1, 2], weights=weights) == {}  # the weight is no lie
    liar = peer_statistics([sent[0], sent[1], 4 * sent[2]])
    assert list(PeerCheck(max_ratio=1.9).judge(liar, [0, 1, 2], weights=weights)) == [2]
    # time rounds: the clusters train different steps, so only the direction is judged
    unknown = PeerCheck(max_ratio=1.9, sizes=False)
    assert unknown.judge(liar, [0, 1, 2]) == {}
    flipped = unknown.judge(peer_statistics([sent[0], sent[1], -sent[2]]), [0, 1, 2])
    assert list(flipped) == [2] and "points away" in flipped[2]


def test_peer_check_leaves_out_a_long_or_a_sign_flipped_update_of_three():
    peers = PeerCheck(max_ratio=3.0)
    u = honest_updates(3, seed=2)
    assert peers.judge(peer_statistics(u), [0, 1, 2]) == {}
    scaled = peers.judge(peer_statistics([u[0], 9 * u[1], u[2]]), [0, 1, 2])
    assert list(scaled) == [1] and "x the median" in scaled[1]
    flipped = peers.judge(peer_statistics([u[0], u[1], -u[2]]), [0, 1, 2])
    assert list(flipped) == [2] and "points away from the others" in flipped[2]
    # below the ratio, a scaled update stays in (docs/design.md §4.5: what is not detected)
    assert peers.judge(peer_statistics([2.5 * u[0], u[1], u[2]]), [0, 1, 2]) == {}


def test_the_drains_check_leaves_out_every_cluster_the_rounds_check_left_out_whatever_it_sends():
    rounds = PeerCheck(max_ratio=2.0)
    u = honest_updates(4, seed=5)
    assert rounds.judge(peer_statistics(u), [0, 1, 2, 3], clusters=[0, 1, 2, 7]) == {}
    assert list(rounds.judge(peer_statistics([u[0], u[1], u[2], 4 * u[3]]), [0, 1, 2, 3], clusters=[0, 1, 2, 7])) == [3]
    assert rounds.judge(peer_statistics(u), [0, 1, 2, 3], clusters=[0, 1, 2, 7]) == {}  # honest again: it passes
    assert rounds.left_out == {7}  # by cluster id (an elastic round's members), through a checkpoint or a heal
    restored = PeerCheck(max_ratio=2.0)
    restored.load_state_dict(rounds.state_dict())
    assert restored.left_out == {7}
    assert PeerCheck(max_ratio=2.0).judge(peer_statistics(u), [0, 1, 2, 3], clusters=[0, 1, 2, 7]) == {}
    drain = PeerCheck(max_ratio=2.0)
    drain.distrusts = frozenset(restored.left_out)
    # the same honest residuals: cluster 7 is left out for what the rounds saw, the others are judged among themselves
    assert drain.judge(peer_statistics(u), [0, 1, 2, 3], clusters=[0, 1, 2, 7]) == {3: DISTRUSTED}
    liar = drain.judge(peer_statistics([u[0], u[1], -u[2], u[3]]), [0, 1, 2, 3], clusters=[0, 1, 2, 7])
    assert liar[3] == DISTRUSTED and "points away" in liar[2] and len(liar) == 2
    # with fewer than 3 updates nothing is compared, but what is distrusted is still left out
    assert drain.judge(None, [0, 1], clusters=[0, 7]) == {1: DISTRUSTED}


def test_peer_check_judges_nothing_with_fewer_than_three_updates():
    peers = PeerCheck(max_ratio=3.0)
    u = honest_updates(3, seed=3)
    for pair in ([u[0], -u[1]], [u[0], 100 * u[1]]):
        assert peers.judge(peer_statistics(pair), [0, 1]) == {}
    # three sent, one already left out by the guard: the two left are not compared
    assert peers.judge(peer_statistics([u[0], -u[1], u[2]]), [0, 1]) == {}


def test_peer_check_majority_two_liars_of_five_are_left_out_and_of_four_no_honest_one_is():
    peers = PeerCheck(max_ratio=3.0)
    u = honest_updates(5, seed=4)
    # two sign flips of five: they agree with each other but with no honest one, 1 < floor(4 / 2)
    assert set(peers.judge(peer_statistics([u[0], u[1], u[2], -u[3], -u[4]]), list(range(5)))) == {3, 4}
    # two of four: no majority either way, nothing is excluded rather than an honest cluster
    assert peers.judge(peer_statistics([u[0], u[1], -u[2], -u[3]]), list(range(4))) == {}


def test_peer_check_excludes_nothing_for_its_direction_when_no_majority_agrees():
    peers = PeerCheck(max_ratio=10.0)  # their median magnitudes differ 5 x: only the direction is tested here
    # three updates that all point apart (the two honest ones of a round happen to disagree, and the third is flipped)
    e = torch.eye(3)
    apart = [e[0] - 0.1 * e[1], e[1] - 0.1 * e[0], -(e[0] + e[1]) / 2 + e[2]]
    gram = inner_products(apart)[:, :3]
    assert all(gram[i, j] < -0.05 * gram[i, i].sqrt() * gram[j, j].sqrt() for i in range(3) for j in range(3) if i != j)
    assert peers.judge(peer_statistics(apart), [0, 1, 2]) == {}
    assert reference_peer_exclusions(apart, [0, 1, 2], 10.0) == set()


@pytest.mark.parametrize("seed", range(40))
def test_peer_check_against_the_slow_reference(seed):
    generator = torch.Generator().manual_seed(1000 + seed)
    count = 3 + seed % 5
    u = honest_updates(count, seed=seed, numel=64, signal=[0.05, 0.3, 1.0][seed % 3])
    for i in torch.randperm(count, generator=generator)[: seed % 3].tolist():  # up to two liars of any kind
        kind = int(torch.randint(4, (1,), generator=generator))
        u[i] = [-u[i], float(1 + 10 * torch.rand(1, generator=generator)) * u[i], torch.zeros_like(u[i]), u[i]][kind]
    candidates = sorted(torch.randperm(count, generator=generator)[: max(2, count - seed % 2)].tolist())
    ratio = [1.5, 3.0, 10.0][seed % 3]
    got = PeerCheck(ratio).judge(peer_statistics(u), candidates)
    assert set(got) == reference_peer_exclusions(u, candidates, ratio)
    assert set(got) <= set(candidates)


def test_fault_config_rounds_and_corruptions():
    faults = FaultConfig(kind="scale", cluster=2, rounds="3-4", scale=10.0)
    faults.validate(num_clusters=4)
    assert [faults.active(cluster=2, round_index=r) for r in range(1, 6)] == [False, False, True, True, False]
    assert not faults.active(cluster=1, round_index=3)
    assert FaultConfig(kind="sign", rounds="2-").round_ranges() == [(2, None)]
    scattered = FaultConfig(kind="sign", cluster=1, rounds="2, 5-6,9-")
    assert [r for r in range(1, 12) if scattered.active(cluster=1, round_index=r)] == [2, 5, 6, 9, 10, 11]
    for bad in ("", "2,", "0", "4-3", "2;5", "x"):
        with pytest.raises(ValueError, match="faults.rounds"):
            FaultConfig(kind="sign", rounds=bad).validate()
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
        (["--preset=dilocox-lowrank", "--sync.aggregate=median", "--compression.kind=none"], "sum"),
        (
            [
                "--preset=dilocox-lowrank",
                "--sync.aggregate=median",
                "--compression.reduction=scalable",
                "--compression.kind=int4",
            ],
            "sum",
        ),
        (["--sync.kind=allreduce", "--sync.aggregate=median"], "pseudo-gradients of a round"),
        (["--preset=dilocox-lowrank", "--sync.trim_fraction=0.5"], "sync.trim_fraction"),
        (["--preset=dilocox-lowrank", "--sync.guard.max_ratio=1"], "sync.guard.max_ratio"),
        (["--preset=dilocox-lowrank", "--sync.guard.peer_ratio=0.5"], "sync.guard.peer_ratio"),
        (["--preset=dilocox-lowrank", "--sync.guard.peer_ratio=inf"], "sync.guard.peer_ratio"),
        (["--preset=dilocox-lowrank", "--sync.guard.max_bad_rounds=0"], "sync.guard.max_bad_rounds"),
        (["--preset=dilocox-lowrank", "--faults.kind=scale", "--faults.cluster=2"], "faults.cluster"),
        (["--preset=dilocox-lowrank", "--faults.kind=scale", "--faults.rounds=5-2"], "faults.rounds"),
        (["--preset=dilocox-lowrank", "--faults.kind=scale", "--faults.rounds=x"], "faults.rounds"),
        (["--sync.kind=allreduce", "--faults.kind=scale"], "outer rounds"),
    ],
)
def test_bad_guard_and_fault_settings_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides).validate()
