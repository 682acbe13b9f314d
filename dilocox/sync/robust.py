"""Robust averaging of pseudo-gradients: the numeric guard and the aggregation rules (docs/design.md §4.5).

Clusters joined by the internet are not all healthy, and not all of them may be trusted. Before an outer step
uses the pseudo-gradients of a round, `UpdateGuard` judges each cluster's (decoded) update: it must be finite and
its L2 norm must stay within `max_ratio` times the median norm of the updates accepted in recent rounds. Every
cluster judges the same bytes with the same history, so every cluster excludes the same senders without another
message. `aggregate` then averages what was accepted: the plain mean, or a coordinate-wise robust statistic for
clusters that may lie with finite, normal-sized updates (sign flips, noise).

    guard = UpdateGuard(max_ratio=10.0)
    verdicts = guard.judge([u0, u1, None, u3])       # [None, None, 'no usable update arrived', 'norm 4.1e3 is ...']
    avg = aggregate([u for u, v in zip(updates, verdicts) if v is None], "trimmed_mean", trim_fraction=0.25)
    guard.accept([u for u, v in zip(updates, verdicts) if v is None])
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

AGGREGATES = ("mean", "trimmed_mean", "median", "norm_clip")
"""Every `sync.aggregate`: how the accepted updates of a round are averaged (coordinate-wise but norm_clip)."""

HISTORY_ROUNDS = 8
"""The guard's reference is the median norm of the updates accepted in this many recent rounds."""


class GuardError(RuntimeError):
    """The guard cannot go on: this cluster's own update stayed bad, or no cluster's update was usable, for
    `sync.guard_max_bad_rounds` rounds in a row. The trainer turns it into one line and a non-zero exit."""


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
            raise ValueError(f"sync.guard_max_ratio = {max_ratio} must be a finite number > 1")
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
