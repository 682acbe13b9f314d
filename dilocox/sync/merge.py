"""Merge rules (`sync.merge`): where a round starts while the last round's average is still in flight.

With the one-step delay (`sync_delay = 1`) round t's average lands one round late. phi only ever takes the true
averages, so every cluster holds the same phi whatever the rule; the rules differ only in where this cluster's next
round starts meanwhile (docs/design.md §3). The next pseudo-gradient is measured from that start, so when round t's
true average lands it replaces whatever the rule assumed instead of adding to it. One class per rule, in `RULES`:

    rule = build_merge_rule("eager")
    start = rule.start(InFlight(phi, pseudo_grad, num_clusters=2, predict=predict))   # a new tensor, or phi itself
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch


class InFlight:
    """What a merge rule sees at a delayed round's end, just after round t's sync was launched.

    `predict(estimate)` is phi after the outer step that round t's average will take, were that average `estimate`
    (the outer optimizer's own step on copies: `OuterOptimizer.predict`). `held_before` is what this cluster's codec
    held back before round t's encoding (None: nothing yet, or not read); `held_after()` what it holds back after it,
    read once (on demand: it is a collective over the cluster's dp replicas)."""

    def __init__(
        self,
        outer_params: torch.Tensor,
        pseudo_grad: torch.Tensor,
        *,
        num_clusters: int,
        predict: Callable[[torch.Tensor], torch.Tensor],
        held_before: torch.Tensor | None = None,
        read_held_after: Callable[[], torch.Tensor | None] | None = None,
        feedback_decay: float = 1.0,
        weight: float | None = None,
        weight_sum: float | None = None,
    ) -> None:
        self.outer_params = outer_params
        """phi, with every landed average applied: (numel,) fp32."""
        self.pseudo_grad = pseudo_grad
        """This cluster's round-t pseudo-gradient (round start - theta), just launched."""
        self.num_clusters = num_clusters
        """C: the clusters the average is over."""
        self.predict = predict
        self.held_before = held_before
        self.feedback_decay = feedback_decay
        """`compression.feedback_decay` d: what the codec holds back is d times its residual."""
        self.weight = weight
        """Token-weighted syncs: this cluster's n_c / n_ref of round t, by which its payload was scaled (None:
        unweighted, every cluster counts 1)."""
        self.weight_sum = weight_sum
        """Token-weighted syncs: the sum of the clusters' weights of the last landed round (the estimate of round
        t's, by which the average divides)."""
        self._read_held_after = read_held_after
        self._held_after: torch.Tensor | None = None
        self._read = False

    @property
    def share_divisor(self) -> float:
        """What this cluster's part of the sum is divided by in the average: C, or the sum of weights."""
        return self.num_clusters if self.weight_sum is None else self.weight_sum

    def own_share(self) -> torch.Tensor:
        """This cluster's share of round t's average, were the others' zero: pseudo_grad / C, or weighted
        n_c delta_c / sum_c n_c."""
        if self.weight is None:
            return self.pseudo_grad / self.num_clusters
        return self.pseudo_grad * self.weight / self.share_divisor

    def held_after(self) -> torch.Tensor | None:
        if not self._read:
            self._held_after = self._read_held_after() if self._read_held_after is not None else None
            self._read = True
        return self._held_after


class MergeRule:
    """Where the next round starts under the one-step delay (`start`), and what part of what the codec holds back
    that start keeps out under `sync.local_residual` (`held_share`, of which the cluster keeps 1/C)."""

    name: ClassVar[str]
    reads_held_back: ClassVar[bool] = False
    """Whether `start` needs `InFlight.held_before` even without `sync.local_residual`."""

    def start(self, flight: InFlight) -> torch.Tensor:
        raise NotImplementedError

    def held_share(self, flight: InFlight) -> torch.Tensor | None:
        """What the codec holds back that the start does not carry: by default what it held before round t's
        encoding (that encoding added it to round t's payload, which the start counts)."""
        return flight.held_before


class Reset(MergeRule):
    """Start at phi, like every cluster: round t's own progress comes back, averaged, one round later (the one-step
    delay of DiLoCoX, Qi et al. 2025, arXiv 2506.21263, without a correction)."""

    name = "reset"

    def start(self, flight: InFlight) -> torch.Tensor:
        return flight.outer_params


class KeepLocal(MergeRule):
    """Start at phi minus this cluster's round-t pseudo-gradient: its own progress is not thrown away while the
    average is in flight (the idea of eager updates, Kale et al. 2025, arXiv 2502.12996, and of Streaming DiLoCo,
    Douillard et al. 2025, arXiv 2501.18512)."""

    name = "keep_local"

    def start(self, flight: InFlight) -> torch.Tensor:
        return flight.outer_params - flight.pseudo_grad


class Eager(MergeRule):
    """The eager update of Kale et al. 2025 (arXiv 2502.12996): start at the outer step phi would take if round t's
    average were this cluster's own share of it, pseudo_grad / C (the others' part is in phi already, one round
    stale). With plain averaging this is the paper's phi - pseudo_grad / C."""

    name = "eager"

    def start(self, flight: InFlight) -> torch.Tensor:
        return flight.predict(flight.own_share())


class Lookahead(MergeRule):
    """Delay-corrected momentum by weight prediction (SpecTrain, Chen et al. 2018, arXiv 1809.02839): start at the
    outer step phi would take if round t's average were this cluster's whole pseudo-gradient, momentum included, so
    the next round computes near where phi will be when its average lands. With plain averaging: keep_local."""

    name = "lookahead"

    def start(self, flight: InFlight) -> torch.Tensor:
        return flight.predict(flight.pseudo_grad)


class OwnPayload(MergeRule):
    """A codec with error feedback: start at the outer step phi would take if round t's average were what this
    cluster's codec sent of round t (its decoded payload: the codec's input less what it now holds back,
    pseudo_grad + held_before - held_after / d). Not a better guess of the average (docs/design.md §3): the round's
    first steps run from the cluster's own point on the values it sent. Where the codec held nothing back before the
    encoding (the first round, or the one after a heal) it starts where `Eager` does. Under `sync.local_residual` it
    keeps out a share of what the codec holds back after round t's encoding, all of which it counted as not sent.
    The rule of DiLoCoX's own defaults in this repository (the eager update of Kale et al. 2025, arXiv 2502.12996,
    with the cluster's payload as its share)."""

    name = "own_payload"
    reads_held_back = True

    def start(self, flight: InFlight) -> torch.Tensor:
        if flight.held_before is None:
            return Eager().start(flight)
        held_after = flight.held_after()  # d r_new, d = compression.feedback_decay
        assert held_after is not None, "a codec that held something back before an encoding holds a residual after it"
        if flight.weight is None:
            sent = flight.pseudo_grad + flight.held_before - held_after / flight.feedback_decay  # input - new residual
            return flight.predict(sent)
        # weighted: the codec's input was weight x pseudo_grad + held_before; what it sent, back in own units
        scaled = flight.pseudo_grad * flight.weight + flight.held_before - held_after / flight.feedback_decay
        return flight.predict(scaled / flight.weight)

    def held_share(self, flight: InFlight) -> torch.Tensor | None:
        return None if flight.held_before is None else flight.held_after()


RULES: dict[str, type[MergeRule]] = {rule.name: rule for rule in (Reset, KeepLocal, Eager, Lookahead, OwnPayload)}
"""Every `sync.merge`, by name."""


def build_merge_rule(name: str) -> MergeRule:
    if name not in RULES:
        raise ValueError(f"sync.merge = {name!r} is not one of: {', '.join(RULES)}")
    return RULES[name]()
