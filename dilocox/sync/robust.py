"""Robust averaging of pseudo-gradients: the numeric guard, the peer check and the aggregation rules (docs/design.md
§4.5).

Clusters joined by the internet are not all healthy, and not all of them may be trusted. Before an outer step
uses the pseudo-gradients of a round, `UpdateGuard` judges each cluster's (decoded) update: it must be finite and
its L2 norm must stay within `max_ratio` times the median norm of the updates accepted in recent rounds. With three
or more updates left, `PeerCheck` then compares them with each other within the round: an update much larger than
the round's median (in norm, or in the median magnitude of the values it sent), or one that points away from most
of the others (a sign flip), is left out too. Every cluster
judges the same bytes with the same history, so every cluster excludes the same senders without another message.
`aggregate` then averages what was accepted: the plain mean, or a coordinate-wise robust statistic.

    guard, peers = UpdateGuard(max_ratio=10.0), PeerCheck(max_ratio=2.0)
    verdicts = guard.judge([u0, u1, None, u3])       # [None, None, 'no usable update arrived', 'norm 4.1e3 is ...']
    stats = peer_statistics([u0, u1, None, u3])      # (4, 8 + bins) float64; sum it over the shards of an update
    excluded = peers.judge(stats, [0, 1])            # {}: fewer than 3 updates cannot be compared
    avg = aggregate([u for u, v in zip(updates, verdicts) if v is None], "trimmed_mean", trim_fraction=0.25)
    guard.accept([u for u, v in zip(updates, verdicts) if v is None])

`RoundGuard` is the outer loop's side of it: what each round's reduction left out is said and counted, the summing
reductions' mean is judged, this cluster's bad rounds are counted and its heals announced.
"""

from __future__ import annotations

import math
import struct
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from dilocox.sync.config import AGGREGATES  # every `sync.aggregate`: coordinate-wise statistics, but norm_clip

HISTORY_ROUNDS = 8
"""The guard's reference is the median norm of the updates accepted in this many recent rounds."""

PEER_MIN_UPDATES = 3
"""`PeerCheck` compares updates only when at least this many are left: of two, neither can be told the wrong one."""

DIRECTION_MARGIN = 0.05
"""`PeerCheck`: two updates disagree when their cosine on the values both sent is at or below minus this. Honest
clusters' lowest was -0.03 (docs/design.md §4.5), a sign-flipped update's -0.26 or lower; noise is near 0."""

FRESH_ROUNDS = 20
"""`PeerCheck`: rounds after a cluster's update was missing or left out by `UpdateGuard` (it abstained, was down, or
restarted) in which its sizes count in the round's median at the largest of the others'. It restarted from phi without
its error-feedback residual (a cluster the peer check leaves out keeps it: `ErrorFeedback.undo`), and a top-k payload
without the residual its peers carry is a fraction of theirs until its own builds up again, in about 1/density rounds
(20 at the dilocox preset's 5%): counted as they were, two such clusters made an honest third one look 2.5 x
outsized."""

DISTRUSTED = (
    "the peer check left it out in an earlier round: what it held back since may hold the rounds that passed, so its "
    "drained residual is not trusted"
)
"""`PeerCheck`'s reason for a cluster it `distrusts`."""

GRAM_CHUNK = 1 << 18
"""Values per chunk of `inner_products`: bounds its scratch memory to (clusters x this) float64."""

MAGNITUDE_BITS = 4
"""`magnitude_counts` bins |values| by their fp32 exponent and this many leading mantissa bits: 2^4 = 16 bins per
octave, so a median magnitude is known to within 1/16 of itself."""
MAGNITUDE_BINS = 256 << MAGNITUDE_BITS
"""Bins of `magnitude_counts`: every fp32 exponent (inf and NaN included) times the mantissa bins."""


class GuardError(RuntimeError):
    """The guard cannot go on: this cluster's own update stayed bad, or no cluster's update was usable, for
    `sync.guard.max_bad_rounds` rounds in a row. The trainer turns it into one line and a non-zero exit."""


class UpdateGuard:
    """Judges the clusters' updates of a round against each other and against recent rounds.

    An update is excluded when it is missing (its sender found it non-finite and sent nothing, or it failed
    authentication), has a non-finite value, or its norm exceeds `max_ratio` x the reference: the median norm of
    the updates accepted in the last `HISTORY_ROUNDS` rounds. Before any round was accepted the reference is the
    median of this round's finite norms, which tells an outlier apart from three or more clusters but not from two
    (with two clusters the first round cannot say which one is wrong; from the second round on it can).
    Norms grow slowly over training (the inner learning rate warms up, then decays), far less than the default
    ratio of 10 between neighbouring rounds."""

    def __init__(self, max_ratio: float) -> None:
        if not (math.isfinite(max_ratio) and max_ratio > 1.0):
            raise ValueError(f"sync.guard.max_ratio = {max_ratio} must be a finite number > 1")
        self.max_ratio = max_ratio
        self.history: deque[list[float]] = deque(maxlen=HISTORY_ROUNDS)  # accepted norms, one list per round

    def reference(self, norms: Sequence[float]) -> float | None:
        """The norm an update is compared with: recent accepted norms, or this round's (`norms`) at the start."""
        past = [norm for round_norms in self.history for norm in round_norms]
        pool = past or [norm for norm in norms if math.isfinite(norm)]
        return _median(pool) if pool else None

    def judge(self, updates: Sequence[torch.Tensor | None]) -> list[str | None]:
        """For each cluster's update (None: nothing usable arrived), None if it is accepted, else why not."""
        norms = [float(u.norm()) if u is not None else math.nan for u in updates]
        reference = self.reference(norms)
        verdicts: list[str | None] = []
        for update, norm in zip(updates, norms, strict=True):
            if update is None:
                verdicts.append("no usable update arrived")
            elif not math.isfinite(norm):
                verdicts.append("non-finite values")
            elif reference is not None and reference > 0 and norm > self.max_ratio * reference:
                verdicts.append(f"norm {norm:.3g} is {norm / reference:,.0f} x the recent median {reference:.3g}")
            else:
                verdicts.append(None)
        return verdicts

    def accept(self, updates: Sequence[torch.Tensor]) -> None:
        """Remember the norms of a round's accepted updates (all clusters call it with the same updates)."""
        if updates:
            self.history.append([float(u.norm()) for u in updates])

    def state_dict(self) -> dict[str, Any]:
        return {"history": [list(norms) for norms in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = deque((list(norms) for norms in state["history"]), maxlen=HISTORY_ROUNDS)


class PeerCheck:
    """Judges the updates of one round against each other: the peer check of `sync.guard.peers` (docs/design.md §4.5).

    Among the `n >= 3` updates the guard left in, an update is excluded when
    - its size exceeds `max_ratio` x the median of the n sizes (one outsized update cannot move the median), by
      either of two sizes: its norm, or the median |value| of the values it sent (its nonzero values). A sender
      that scales its update multiplies both. The second is the one that tells a scaled sparse update apart: a
      top-k payload with error feedback holds a few long residual values, whose share of the norm varies from
      cluster to cluster and round to round, while the median of what it sent stays within a few % of its peers';
    - it disagrees (cosine <= -`DIRECTION_MARGIN` on the values both sent, see below) with so many of the other n - 1
      that it agrees with fewer than floor((n - 1) / 2) of them (of 3, it points away from both others; of 5, from at
      least 3 of the 4 others), and the updates that pass this test are a strict majority of the n: where they are
      not (of 3, when the two honest updates of a round happen to point apart too), nothing is excluded for its
      direction. Honest clusters that train on the same distribution from the same start agree with each other; a
      sign-flipped update has the negated cosine with every one of them. The cosine of two updates is taken on the
      positions both sent, `G[i, j] / sqrt(S[i, j] S[j, i])` (`inner_products`): the whole vectors' cosine for dense
      updates, and for sparse ones (which share a few % of their positions) the cosine where they can be compared.
      Updates that are noise to each other (the residuals of a dense int4 codec, drained at the end: cosines of
      either sign near 0) agree.
    Both tests run on all n updates at once (the direction test on those the size tests kept); with fewer than 3
    updates nothing is judged. In the size tests' median, a cluster that just healed (`fresh`: its update was not a
    candidate, missing or left out by `UpdateGuard`, in one of the last `FRESH_ROUNDS` rounds) counts at the largest
    size of those that did not (where every one did, of those that healed longest ago): it healed without its residual,
    and its smaller payloads would lower the median below its peers'; its own size is still judged. `fresh` is kept by
    cluster id across the rounds, the same on every cluster: it follows from the verdicts. The input is
    `peer_statistics` of the whole updates (summed over the shards of a sharded update), so the decision depends only on
    it and `fresh`: the same statistics and history give the same verdicts.

    The drained residual (`sync.drain_residual`, sent once at the end) is judged by a check that also `distrusts` the
    clusters the rounds' check left out (`left_out`): left out of every drain, whatever its size and direction. A lie
    that passed in some rounds stays in its sender's residual (its left-out rounds are undone, the passing ones are
    not), and the drain sends that residual whole, at a size close to its peers' (a x9 liar's 1.4 x the median norm,
    1.7 x the median |value|): a cluster caught once is not trusted with what it held back (docs/design.md §4.5).

    Weighted payloads: where every cluster's payload is its update times its weight n_c / n_ref (clusters of different
    dp, each cluster's tokens of a round of H steps), `judge`'s `weights` holds them and the sizes are compared divided
    by them; where the clusters train for a time budget (time rounds), a cluster that trained twice the steps moves
    further, so `sizes = False` leaves the size tests out and only the direction is judged.

        peers = PeerCheck(max_ratio=2.0)
        excluded = peers.judge(peer_statistics(updates), candidates=[0, 1, 2])   # {cluster: reason}
    """

    def __init__(self, max_ratio: float, *, sizes: bool = True) -> None:
        if not (math.isfinite(max_ratio) and max_ratio > 1.0):
            raise ValueError(f"sync.guard.peer_ratio = {max_ratio} must be a finite number > 1")
        self.max_ratio = max_ratio
        self.sizes = sizes
        """Whether the size tests run (False: weights unknown to the receivers)."""
        self.fresh: dict[int, int] = {}
        """Cluster -> rounds left in which it counts as just healed (`FRESH_ROUNDS`)."""
        self.left_out: set[int] = set()
        """The clusters this check left out in a round so far."""
        self.distrusts: frozenset[int] = frozenset()
        """Clusters left out whatever they send (the drain's check: the rounds' `left_out`)."""

    def judge(
        self,
        stats: torch.Tensor | None,
        candidates: Sequence[int],
        *,
        clusters: Sequence[int] | None = None,
        weights: Sequence[float] | None = None,
    ) -> dict[int, str]:
        """The `candidates` (rows of the (C, 2C + MAGNITUDE_BINS) float64 `peer_statistics`, all of finite updates) to
        leave out, and why. `clusters`: the cluster of each row (default: row r is cluster r); `stats` None: fewer
        than 3 updates, nothing to judge, and `clusters` given (the round still counts for `fresh`); `weights`: the
        weight each row's payload was multiplied by (None: 1 for every row)."""
        if clusters is None:
            clusters = range(len(stats))
        excluded = {row: DISTRUSTED for row in candidates if clusters[row] in self.distrusts}
        trusted = [row for row in candidates if row not in excluded]
        if stats is not None:
            excluded |= self._judge(stats, trusted, clusters, weights or [1.0] * len(stats))
        self.left_out.update(clusters[row] for row in excluded)
        for row, cluster in enumerate(clusters):
            if row not in candidates:
                self.fresh[cluster] = FRESH_ROUNDS
            elif self.fresh.get(cluster, 0) > 1:
                self.fresh[cluster] -= 1
            else:
                self.fresh.pop(cluster, None)
        return excluded

    def state_dict(self) -> dict[str, Any]:
        return {
            "fresh": {str(cluster): rounds for cluster, rounds in self.fresh.items()},
            "left_out": sorted(self.left_out),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.fresh = {int(cluster): int(rounds) for cluster, rounds in state.get("fresh", {}).items()}
        self.left_out = {int(cluster) for cluster in state.get("left_out", ())}

    def _judge(
        self, stats: torch.Tensor, candidates: Sequence[int], clusters: Sequence[int], scales: Sequence[float]
    ) -> dict[int, str]:
        if len(candidates) < PEER_MIN_UPDATES:
            return {}
        count = stats.shape[0]
        gram, shared = stats[:, :count].tolist(), stats[:, count : 2 * count].tolist()  # Python floats: exact compares
        # a weight of 0 (a cluster that reported no tokens, yet sent an update) leaves its sizes as they were sent
        scales = [scale or 1.0 for scale in scales]
        norms = {i: math.sqrt(max(gram[i][i], 0.0)) / scales[i] for i in candidates}
        magnitudes = {i: median_magnitude(stats[i, 2 * count :].tolist()) / scales[i] for i in candidates}
        excluded: dict[int, str] = {}
        # the reference: the clusters that healed longest ago (all but those that just healed, or where every one did,
        # the one furthest from its heal); the others count at the largest of theirs
        least = min(self.fresh.get(clusters[i], 0) for i in candidates)
        settled = [i for i in candidates if self.fresh.get(clusters[i], 0) == least]
        among = f"this round's {len(candidates)} updates"
        if len(settled) < len(candidates):
            among += ", those of clusters that healed later counted at the largest of the others'"
        for what, sizes in (("norm", norms), ("median |value| sent", magnitudes)) if self.sizes else ():
            top = max(sizes[i] for i in settled)
            median = _median([sizes[i] if i in settled else top for i in candidates])
            for i in candidates:
                if i not in excluded and median > 0 and sizes[i] > self.max_ratio * median:
                    excluded[i] = (
                        f"{what} {sizes[i]:.3g} is {sizes[i] / median:.1f} x the median {median:.3g} of {among}"
                    )
        kept = [i for i in candidates if i not in excluded]
        if len(kept) < PEER_MIN_UPDATES:
            return excluded
        needed = (len(kept) - 1) // 2
        away: dict[int, str] = {}
        for i in kept:
            others = [j for j in kept if j != i]
            cosines = [_shared_cosine(gram[i][j], shared[i][j], shared[j][i]) for j in others]
            agree = sum(cosine > -DIRECTION_MARGIN for cosine in cosines)
            if agree < needed:
                away[i] = (
                    f"it points away from the others: cosine <= -{DIRECTION_MARGIN} on the values both sent with "
                    f"{len(others) - agree} of the other {len(others)} updates (median {_median(cosines):.2f}), above "
                    f"with {agree} < {needed} needed"
                )
        if 2 * len(away) < len(kept):  # those that agree are a majority: otherwise nothing can be told apart
            excluded.update(away)
        return excluded


def judges_state(guard: UpdateGuard | None, peers: PeerCheck | None) -> dict[str, Any]:
    """The history of a gather reduction's judges, the same on every cluster: the norms `guard` accepted ("guard")
    and the clusters `peers` counts as just healed ("peers"), for those it has."""
    state: dict[str, Any] = {}
    if guard is not None:
        state["guard"] = guard.state_dict()
    if peers is not None:
        state["peers"] = peers.state_dict()
    return state


def load_judges_state(guard: UpdateGuard | None, peers: PeerCheck | None, state: dict[str, Any]) -> None:
    """Take `judges_state`; a judge the state has no history of (saved without it) keeps its own."""
    if guard is not None and state.get("guard") is not None:
        guard.load_state_dict(state["guard"])
    if peers is not None and state.get("peers") is not None:
        peers.load_state_dict(state["peers"])


def _shared_cosine(product: float, square_i: float, square_j: float) -> float:
    """The cosine of two updates on the positions both sent (0.0 where they share none)."""
    return product / math.sqrt(square_i * square_j) if square_i > 0 and square_j > 0 else 0.0


def inner_products(updates: Sequence[torch.Tensor | None], *, chunk: int = GRAM_CHUNK) -> torch.Tensor:
    """(C, 2C) float64 `[G | S]` of equal-length fp32 vectors, on the CPU: the Gram matrix `G[i, j] = <u_i, u_j>`
    and `S[i, j]`, the sum of `u_i^2` over the positions where `u_j` is nonzero, so that `S[i, j]` and `S[j, i]` are
    the squared norms of the two on the values both sent (a sparse codec's updates share few positions). Rows and
    columns of a None update are 0. Products of fp32 values are exact in float64 and the sums run over fixed chunks in
    a fixed order, so the same updates give the same matrix. Sharded updates: sum the shards'."""
    count = len(updates)
    products = torch.zeros(count, 2 * count, dtype=torch.float64)
    present = [i for i, u in enumerate(updates) if u is not None]
    if not present:
        return products
    numel = updates[present[0]].numel()
    rows = torch.tensor(present).unsqueeze(1)
    columns = torch.tensor(present + [count + i for i in present]).unsqueeze(0)
    for start in range(0, numel, chunk):
        block = torch.stack([updates[i][start : start + chunk].double() for i in present])  # (present, chunk)
        sent = (block != 0).double()
        products[rows, columns] += torch.cat([block @ block.T, (block * block) @ sent.T], dim=1).cpu()
    return products


def magnitude_counts(updates: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """(C, MAGNITUDE_BINS) float64 counts of each update's nonzero |values| per magnitude bin, on the CPU; a None
    update's row is 0. A value's bin is the top bits of its fp32 |value| (exponent, then `MAGNITUDE_BITS` of mantissa),
    which grow with |value|: integer counts, exact in float64 and independent of the order of the sums and of the
    hardware. Sharded updates: sum the shards'."""
    counts = torch.zeros(len(updates), MAGNITUDE_BINS, dtype=torch.float64)
    for i, update in enumerate(updates):
        if update is not None and update.numel():
            bits = update.detach().float().abs().view(torch.int32)  # (n,) sign cleared: >= 0, ordered as |value|
            bins = bits[bits != 0] >> (23 - MAGNITUDE_BITS)
            counts[i] = torch.bincount(bins, minlength=MAGNITUDE_BINS).cpu().double()
    return counts


def median_magnitude(counts: Sequence[float]) -> float:
    """The lower edge of the bin that holds the (lower) median of the counted |values| (`magnitude_counts`): within a
    1/16 of itself below the median |value| of the nonzero values; 0.0 when none was counted."""
    total = sum(counts)
    if total <= 0:
        return 0.0
    seen = 0.0
    for index, count in enumerate(counts):
        seen += count
        if 2 * seen >= total:
            return struct.unpack("<f", struct.pack("<i", index << (23 - MAGNITUDE_BITS)))[0]
    raise AssertionError("unreachable: the counts reach their total")


def peer_statistics(updates: Sequence[torch.Tensor | None], *, chunk: int = GRAM_CHUNK) -> torch.Tensor:
    """What `PeerCheck` judges a round by: (C, 2C + MAGNITUDE_BINS) float64, each update's rows of `inner_products`
    followed by its magnitude counts (`magnitude_counts`). Sums over shards: sum the shards'."""
    return torch.cat([inner_products(updates, chunk=chunk), magnitude_counts(updates)], dim=1)


def aggregate(updates: Sequence[torch.Tensor], how: str, *, trim_fraction: float = 0.25) -> torch.Tensor:
    """The average of `updates` (each (n,) fp32, at least one) by `sync.aggregate`:

    - `mean`: the arithmetic mean (what every reducer computes without a guard);
    - `trimmed_mean`: per coordinate, drop the `k = max(1, floor(trim_fraction * count))` largest and smallest
      values and average the rest (plain mean when fewer than 3 updates: nothing can be trimmed);
    - `median`: per coordinate, the median (the mean of the two middle values for an even count);
    - `norm_clip`: scale every update down to at most the median of their norms, then the mean: a sender can
      pull the average by no more than a typical update's length (centred clipping without the centre).

    The result does not depend on the order of `updates` beyond float rounding of the sums."""
    if not updates:
        raise ValueError("aggregate needs at least one update")
    if how not in AGGREGATES:
        raise ValueError(f"sync.aggregate = {how!r} is not one of {', '.join(AGGREGATES)}")
    if len(updates) == 1:
        return updates[0].clone()
    if how == "norm_clip":
        norms = [float(u.norm()) for u in updates]
        limit = _median(norms)
        total = torch.zeros_like(updates[0])
        for update, norm in zip(updates, norms, strict=True):
            total.add_(update, alpha=min(1.0, limit / norm) if norm > 0 else 1.0)
        return total.div_(len(updates))
    if how == "mean" or (how == "trimmed_mean" and len(updates) < 3):
        total = torch.zeros_like(updates[0])
        for update in updates:
            total.add_(update)
        return total.div_(len(updates))
    stacked, _ = torch.sort(torch.stack(list(updates)), dim=0)  # (count, n), each coordinate ascending
    count = stacked.shape[0]
    if how == "median":
        middle = (count - 1) // 2
        return stacked[middle].clone() if count % 2 else (stacked[middle] + stacked[middle + 1]) / 2
    k = min(max(1, math.floor(trim_fraction * count)), (count - 1) // 2)  # trimmed_mean: keep at least one
    return stacked[k : count - k].mean(dim=0)


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


class RoundGuard:
    """The outer loop's bookkeeping of `sync.guard` (docs/design.md §4.5), one per rank.

    Every landing: the clusters the reduction left out are announced and counted; the summing reductions, which
    cannot judge the clusters one by one, get their mean judged by an `UpdateGuard` (`judges_mean`); a round with no
    usable mean is skipped (no outer step). Every round: this cluster's own non-finite update is counted, and
    `max_bad_rounds` bad rounds in a row, of this cluster (`own`) or of every cluster (`all`), raise `GuardError`:
    only a cluster's own non-finite updates stop the run, one the others leave out heals and goes on. A heal is
    announced, counted and flagged in `healed` for whoever owns the inner optimizer.

        guard = RoundGuard(max_ratio=10.0, max_bad_rounds=3, judges_mean=True, warnings=warnings)
        skip = guard.judge_landing(avg, excluded={}, num_clusters=3, where="round 4")   # True: no outer step
        guard.count_own(bad=False, round_index=4); guard.heal(cluster=0, round_index=4, why="...")
    """

    def __init__(self, *, max_ratio: float, max_bad_rounds: int, judges_mean: bool, warnings: list[str]) -> None:
        self.mean_guard = UpdateGuard(max_ratio) if judges_mean else None
        """The summing reductions' guard of the mean (the gather reduction judges every update itself)."""
        self.max_bad_rounds = max_bad_rounds
        self.warnings = warnings
        """The outer loop's messages for the user (shared with it)."""
        self.counts = {"excluded_updates": 0, "skipped_rounds": 0, "healed_rounds": 0}  # base.GUARD_COUNTS
        """Totals over the run: updates left out, rounds without a usable mean, rounds this cluster healed."""
        self.bad_in_row = {"own": 0, "all": 0}
        self.healed = False
        """Set by `heal`; the owner of the inner optimizer resets its state and clears it."""

    def judge_landing(
        self, avg: torch.Tensor, excluded: dict[int, str], *, num_clusters: int, where: str, judge_mean: bool = True
    ) -> bool:
        """Announce and count what the reduction left out of `avg` (`excluded`: cluster -> why); judge the mean of
        a summing reduction against recent rounds' (not when `judge_mean` is False: the drained residual is no
        round's pseudo-gradient). Returns whether the round has no usable mean (skip its outer step)."""
        for cluster, why in sorted(excluded.items()):
            self.warnings.append(f"guard: {where}: cluster {cluster}'s update left out ({why})")
        self.counts["excluded_updates"] += len(excluded)
        if self.mean_guard is not None and judge_mean:
            verdict = self.mean_guard.judge([avg])[0]
            if verdict is None:
                self.mean_guard.accept([avg])
            skip = verdict is not None
            why = f"the mean has {verdict}"
        else:
            skip = len(excluded) >= num_clusters
            why = "every cluster's update was left out"
        if skip:
            self.counts["skipped_rounds"] += 1
            self.warnings.append(f"guard: {where}: no outer step ({why})")
        self._count_bad("all", skip, "no usable mean of the clusters' updates")
        return skip

    def count_own(self, bad: bool, round_index: int) -> None:
        """This cluster's own update of round `round_index` was non-finite (`bad`) or not."""
        self._count_bad("own", bad, f"this cluster's own update was non-finite (round {round_index})")

    def heal(self, *, cluster: int, round_index: int, why: str) -> None:
        """Cluster `cluster` restarts the round after `round_index` from the agreed parameters."""
        self.healed = True
        self.counts["healed_rounds"] += 1
        self.warnings.append(
            f"guard: cluster {cluster} restarts round {round_index + 1} from the agreed parameters "
            f"with a fresh inner optimizer state: {why}"
        )

    def _count_bad(self, which: str, bad: bool, what: str) -> None:
        self.bad_in_row[which] = self.bad_in_row[which] + 1 if bad else 0
        if self.bad_in_row[which] >= self.max_bad_rounds:
            raise GuardError(
                f"{what}, {self.bad_in_row[which]} rounds in a row (sync.guard.max_bad_rounds = "
                f"{self.max_bad_rounds}): training cannot recover by itself"
            )

    def state_dict(self) -> dict[str, Any]:
        """The totals, the bad rounds in a row and the mean's norm history."""
        return {
            "counts": dict(self.counts),
            "bad_in_row": dict(self.bad_in_row),
            "mean": self.mean_guard.state_dict() if self.mean_guard is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counts.update(state["counts"])
        self.bad_in_row.update(state["bad_in_row"])
        if self.mean_guard is not None and state["mean"] is not None:
            self.mean_guard.load_state_dict(state["mean"])
