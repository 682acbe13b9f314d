"""What a round is on each cluster (`sync.round.mode`), and what the clusters tell each other about it.

With `sync.round.mode = "steps"` every round is H inner steps on every cluster, so the fastest cluster waits for the
slowest at every boundary. With `"time"` every cluster trains for the same budget per round and decides its own
number of steps at the start of each round (`RoundClock.next_steps`): steps_c = max(1, floor(budget / its step
time + carry)), where the carry is what the earlier rounds' floors left over, so that a cluster's steps average its
budget (2.67 steps a round: 2, 3, 3, 2, 3, 3, ...) instead of losing up to a step of every round to waiting. The
budget is `sync.round.seconds`, or H x the fastest cluster's mean step time, which arrives with the syncs
(`RoundReport`, exchanged just before each pseudo-gradient); the first rounds, before any report landed, are H
steps. With `faults.slow_mode = "virtual"` a step of cluster c counts exactly its slow factor f_c units of time
and the budget is H units, so steps_c follows H / f_c from the first round on, whatever the machine's load.

The run is ceil(train.steps / H) rounds for every cluster; its last round has the budget of the steps left
(train.steps - (R - 1) H) instead of H. A cluster's inner learning rate follows the run's progress
(`RoundClock.progress_step`: the round index plus the fraction of the round done), so a slow cluster still
finishes its decay.

    clock = RoundClock(cfg.sync, total_steps=400, virtual_factor=2.0)
    clock.first_steps()                 # 25 with H = 50 (virtual, factor 2)
    clock.add_step_time(0.12)           # measured modes: each step's training time
    steps = clock.next_steps(2, last_step_s=clock.close_round(), reports=landed, own_index=cluster)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dilocox.sync.config import SyncConfig
from dilocox.topology import group_size

REPORT_FIELDS = 3
"""A `RoundReport` on the wire: (steps, tokens, step seconds) as float64."""
_FLOOR_SLACK = 1e-9
"""floor(x + slack): a budget of exactly k steps computed through a division stays k, not k - 1."""


@dataclass(frozen=True)
class TokenWeights:
    """How this cluster's tokens weigh its updates (docs/design.md §2.1, §3.1): under time rounds always, with rounds
    of steps when `round_tokens` is given (clusters of different dp)."""

    per_step: int = 1
    """The tokens this cluster trains on per inner step (all its data-parallel replicas)."""
    round_tokens: int | None = None
    """n_ref, the nominal tokens of one round, the same on every cluster (None: H x this cluster's tokens a step, and
    rounds of steps are not weighted)."""
    first_sum: float | None = None
    """sum_c n_c / n_ref expected before any round landed (None: C, every cluster n_ref)."""


@dataclass(frozen=True)
class RoundReport:
    """What one cluster trained in one round: exchanged before its pseudo-gradient, on the same slow link."""

    steps: int
    """Inner steps of the round."""
    tokens: int
    """Tokens trained on in it (steps x the cluster's tokens per step; 0 when the cluster abstained)."""
    step_s: float
    """Its mean step time over the round: seconds of training (virtual mode: its slow factor, in units)."""

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([self.steps, self.tokens, self.step_s], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, values: torch.Tensor) -> RoundReport:
        steps, tokens, step_s = values.tolist()
        return cls(int(steps), int(tokens), float(step_s))


class RoundClock:
    """The number of inner steps of each round on this cluster, and the run's progress (module docstring).

    `virtual_factor`: this cluster's slow factor when `faults.slow_mode = "virtual"` (None: measured time).
    `dp_group`, `pp_group`: the cluster's replicas and stages, which agree on one step time (the largest) so that
    every rank of the cluster does the same number of steps."""

    def __init__(
        self,
        cfg: SyncConfig,
        *,
        total_steps: int,
        virtual_factor: float | None = None,
        dp_group: dist.ProcessGroup | None = None,
        pp_group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.inner_steps = cfg.inner_steps
        self.round_seconds = cfg.round.seconds
        self.total_steps = total_steps
        self.num_rounds = math.ceil(total_steps / cfg.inner_steps)
        self.virtual_factor = virtual_factor
        self.dp_group = dp_group
        self.pp_group = pp_group
        self.device = device if device is not None else torch.device("cpu")
        self.compute_s = 0.0
        """Training seconds of the round in progress on this rank (measured modes)."""
        self.compute_steps = 0
        """Steps timed in it."""
        self.carry = 0.0
        """The fraction of a step the earlier rounds' budgets held beyond their whole steps, in [-1, 1)."""

    def nominal_steps(self, round_index: int) -> int:
        """The steps of an unslowed cluster in round `round_index` (1-based): H, the last round what is left."""
        return min(self.inner_steps, self.total_steps - (round_index - 1) * self.inner_steps)

    def first_steps(self) -> int:
        """The steps of round 1: H (measured modes: nothing is measured yet), virtual mode floor(H / factor)
        (with the carry of later rounds: `_steps`)."""
        if self.virtual_factor is not None:
            return self._steps(self.nominal_steps(1) / self.virtual_factor)
        return self.nominal_steps(1)

    def add_step_time(self, seconds: float) -> None:
        """Count one inner step's training time (no evaluation, checkpoint or wait at a boundary in it)."""
        self.compute_s += seconds
        self.compute_steps += 1

    def close_round(self) -> float:
        """The cluster's mean step time over the round that ends now, agreed by its ranks (the largest; collective
        over the cluster's dp and pp groups in measured modes), and start timing the next round."""
        if self.virtual_factor is not None:
            return self.virtual_factor
        mean = self.compute_s / self.compute_steps if self.compute_steps else 0.0
        self.compute_s, self.compute_steps = 0.0, 0
        value = torch.tensor([mean], dtype=torch.float64, device=self.device)
        for group in (self.dp_group, self.pp_group):
            if group_size(group) > 1:
                dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        return float(value.item())

    def next_steps(
        self, round_index: int, *, last_step_s: float, reports: list[RoundReport | None] | None, own_index: int
    ) -> int:
        """Inner steps of round `round_index` (1-based) on this cluster. `last_step_s`: its agreed step time of the
        round just ended (`close_round`); `reports`: every cluster's report of the last round whose sync landed
        (None before any), its own at `own_index`. With `round_seconds` the budget is known and the cluster's latest
        step time divides it; otherwise the fastest reported step time sets it, and the cluster's own reported step
        time (from the same reports) divides it, so the fastest cluster gets exactly the nominal steps."""
        nominal = self.nominal_steps(round_index)
        if self.virtual_factor is not None:
            return self._steps(nominal / self.virtual_factor)
        if self.round_seconds > 0:
            if last_step_s <= 0:
                return nominal
            return self._steps(self.round_seconds * nominal / self.inner_steps / last_step_s)
        known = [r for r in reports or [] if r is not None and r.steps > 0 and r.step_s > 0]
        own = reports[own_index] if reports else None
        if not known or own is None or own.step_s <= 0:
            return nominal
        fastest = min(r.step_s for r in known)
        return self._steps(nominal * (fastest / own.step_s))

    def progress_step(self, round_index: int, steps_done: int, round_steps: int) -> float:
        """The run's progress in inner steps of an unslowed cluster: round `round_index` (1-based) is `steps_done`
        of `round_steps` steps along. An unslowed cluster's own step count, as an int-valued float."""
        done = (round_index - 1) * self.inner_steps
        return float(done + steps_done * self.nominal_steps(round_index) / round_steps)

    def _steps(self, budget_in_steps: float) -> int:
        """The whole steps of a budget of `budget_in_steps`, at least one, with the carry of the earlier rounds."""
        wanted = budget_in_steps + self.carry
        steps = max(1, math.floor(wanted + _FLOOR_SLACK))
        self.carry = min(max(wanted - steps, -1.0), 1.0 - _FLOOR_SLACK)
        return steps

    def state_dict(self) -> dict[str, Any]:
        return {"compute_s": self.compute_s, "compute_steps": self.compute_steps, "carry": self.carry}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.compute_s = float(state["compute_s"])
        self.compute_steps = int(state["compute_steps"])
        self.carry = float(state.get("carry", 0.0))  # a state saved before the carry existed: none


def report_weights(reports: Sequence[RoundReport | None], round_tokens: int) -> list[float]:
    """n_c / n_ref of every cluster's report; one whose report did not arrive (its tag did not verify) counts one
    nominal round."""
    return [1.0 if report is None else report.tokens / round_tokens for report in reports]


def token_weighted_factor(
    reports: list[RoundReport | None], *, excluded: dict[int, str], round_tokens: int, robust: bool = False
) -> tuple[float, float]:
    """(factor, weight sum): a reducer's mean of pre-scaled pseudo-gradients (n_c / n_ref x delta_c) times `factor`
    is the token-weighted mean sum_c n_c delta_c / sum_c n_c over the clusters it kept. The mean divided by the
    clusters it kept (C, or with the gather reduction C less the excluded), so factor = kept x n_ref / sum n_c.
    A cluster whose report did not arrive (its tag did not verify) counts one nominal round. The weight sum is
    sum_c n_c / n_ref (0: nothing to average, factor 0).

    `robust` (a robust `sync.aggregate` of the pre-scaled updates): the weight sum is
    kept x the median weight, so factor = 1 / median weight: the statistic of the updates each scaled by its
    cluster's tokens against the median cluster's. Equal tokens give the plain statistic of the updates; a cluster
    that reports far more tokens than it trained on scales only its own update, which the statistic leaves out,
    where in a sum it would shrink every other cluster's share."""
    kept = [index for index in range(len(reports)) if index not in excluded]
    weights = [weight for index, weight in enumerate(report_weights(reports, round_tokens)) if index not in excluded]
    total = len(weights) * statistics.median(weights) if robust and weights else sum(weights)
    return (len(kept) / total if total > 0 else 0.0), total
