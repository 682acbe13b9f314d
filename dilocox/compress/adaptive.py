"""Adaptive rank: pick each round's low-rank rank from the measured spectrum of recent pseudo-gradients."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dilocox.compress.codecs import LowRankCodec, ValueFormat, as_matrix, sent_dense
from dilocox.compress.config import CompressionConfig
from dilocox.compress.lowrank import Factors, randomized_factors
from dilocox.compress.payload import numel_of

_ENERGY_TOLERANCE = 1e-6  # a spectrum built to hold exactly the target must not miss it by a rounding error


@dataclass(frozen=True)
class RankDecision:
    """What `AdaptiveRank` decided in one round."""

    round: int
    """0-based index of the round (the number of earlier decisions)."""
    target_energy: float
    """Share of the squared-singular-value energy the rank had to keep this round (after the schedule)."""
    raw_rank: int
    """Smallest rank keeping `target_energy` of this round's spectrum, in [1, rank_max], before smoothing."""
    rank: int
    """The rank used: ceil(mean of the last `window` raw ranks), clipped to [rank_min, rank_max]; per_matrix: the
    mean of `matrix_ranks`, rounded up (what the round record shows)."""
    matrix_raw_ranks: tuple[int, ...] = ()
    """per_matrix: each matrix's smallest rank keeping `target_energy` of its own spectrum, in the spectra's order."""
    matrix_ranks: tuple[int, ...] = ()
    """per_matrix: each matrix's rank used, its raw ranks smoothed over `window` rounds and clipped."""


class AdaptiveRank:
    """Chooses the low-rank rank of each round from the spectrum of recent pseudo-gradients.

    DiLoCoX (Qi et al. 2025, arXiv 2506.21263) adapts its compression to the pseudo-gradient. Each round this
    takes, per matrix, the smallest rank that keeps `energy` of its squared-singular-value energy (`per_matrix`,
    the default: every matrix is sent at its own rank), or one rank for all (the pooled energy of all matrices,
    or the mean/max of the per-matrix ranks), averages it over the last `window` rounds and clips it to
    [rank_min, rank_max]. Public descriptions of DiLoCoX disagree on whether compression should be strongest early
    or late in training, so `schedule` offers both: "early_strong" ramps the energy target up from `energy_floor`
    to `energy` over `ramp_rounds` rounds, "late_strong" ramps it down from `energy` to `energy_floor`, and
    "spectrum" keeps `energy`. Only the top rank_max singular values are estimated (randomized SVD, or the Ritz
    values the codec's power iteration yields), never a full SVD; the total energy is the exact squared Frobenius
    norm, so the kept share is underestimated, never over: the rank errs high. Only the decisions of the last
    `window` rounds are kept (the smoothing reads no further back), so its memory and its checkpointed state stay the
    same size however long the run; metrics.jsonl logs every round's ranks.

        policy = AdaptiveRank(CompressionConfig(kind="adaptive", rank_min=2, rank_max=32, energy=0.9, window=4))
        rank = policy.update(pseudo_grads)               # once per round
        policy.history[-1]                               # the last round's decision (per matrix too)
    """

    OVERSAMPLE = 8
    """Extra directions of the randomized spectrum estimate (`update`)."""
    SPECTRUM_ITERATIONS = 2
    """Subspace iterations of the randomized spectrum estimate: accurate for decaying spectra."""

    def __init__(self, cfg: CompressionConfig, *, seed: int = 0) -> None:
        cfg.validate()
        self.cfg = cfg
        """The options: rank_min, rank_max, energy, energy_floor, window, schedule, ramp_rounds, rank_rule."""
        self.generator = torch.Generator().manual_seed(seed)
        self.rounds = 0
        """Rounds decided so far (the schedule's clock)."""
        self.history: deque[RankDecision] = deque(maxlen=cfg.window)
        """The decisions of the last `window` rounds, oldest first."""

    @property
    def rank(self) -> int:
        """The latest chosen rank (rank_max before the first round)."""
        return self.history[-1].rank if self.history else self.cfg.rank_max

    @property
    def ranks(self) -> list[int]:
        """The chosen rank of each of the last `window` rounds, oldest first."""
        return [decision.rank for decision in self.history]

    def target_energy(self, round_index: int | None = None) -> float:
        """The energy target of round `round_index` (default: the next round) under the schedule."""
        index = self.rounds if round_index is None else round_index
        progress = min(1.0, index / self.cfg.ramp_rounds)
        span = self.cfg.energy - self.cfg.energy_floor
        if self.cfg.schedule == "early_strong":
            return self.cfg.energy_floor + span * progress
        if self.cfg.schedule == "late_strong":
            return self.cfg.energy - span * progress
        return self.cfg.energy

    def update(self, tensors: Sequence[torch.Tensor]) -> int:
        """Measure the spectra of the 2+-D `tensors` (as matrices (shape[0], -1)), record and return the rank."""
        sigmas: list[torch.Tensor] = []
        totals: list[float] = []
        costs: list[int] = []
        for tensor in tensors:
            if tensor.dim() <= 1:
                continue
            matrix = as_matrix(tensor.detach().to(torch.float32))  # (m, n)
            if matrix.numel() == 0:
                continue
            costs.append(sum(matrix.shape))
            factors = randomized_factors(
                matrix,
                self.cfg.rank_max,
                oversample=self.OVERSAMPLE,
                iterations=self.SPECTRUM_ITERATIONS,
                generator=self.generator,
            )
            sigmas.append(factors.sigma)
            totals.append(float(torch.linalg.vector_norm(matrix)) ** 2)
        return self.update_from_spectra(sigmas, totals, costs)

    def update_from_spectra(
        self,
        sigmas: Sequence[torch.Tensor],
        total_energies: Sequence[float],
        rank_costs: Sequence[int] | None = None,
    ) -> int:
        """Record and return this round's rank from each matrix's leading singular values and total energy.

        `sigmas[i]` holds matrix i's largest singular values, descending (any number, at most rank_max used);
        `total_energies[i]` its squared Frobenius norm, the sum of *all* its squared singular values;
        `rank_costs[i]` what one more rank of matrix i sends, m + n values (`budget` only; default 1 each).
        """
        if len(sigmas) != len(total_energies):
            raise ValueError(f"got {len(sigmas)} spectra but {len(total_energies)} total energies; pass one per matrix")
        target = self.target_energy()
        spectra = [sigma[: self.cfg.rank_max].double().cpu() for sigma in sigmas]
        if self.cfg.rank_rule == "budget":
            costs = [1] * len(spectra) if rank_costs is None else list(rank_costs)
            raw = self._budget_raw_ranks(spectra, total_energies, costs, target)
            return self._update_per_matrix(spectra, total_energies, target, raw)
        if self.cfg.rank_rule == "per_matrix":
            return self._update_per_matrix(spectra, total_energies, target)
        raw_rank = self._raw_rank(spectra, total_energies, target)
        rank = self._smoothed(raw_rank, [decision.raw_rank for decision in self._window()])
        self._record(RankDecision(self.rounds, target, raw_rank, rank))
        return rank

    def _record(self, decision: RankDecision) -> None:
        self.history.append(decision)  # the deque drops the decision that left the window
        self.rounds += 1

    def _window(self) -> list[RankDecision]:
        """The decisions of the rounds before this one that its rank is smoothed over (window - 1 of them)."""
        return list(self.history)[-(self.cfg.window - 1) :] if self.cfg.window > 1 else []

    def _smoothed(self, raw_rank: int, recent: Sequence[int]) -> int:
        """ceil(mean of `recent` raw ranks and this round's), clipped to [rank_min, rank_max]."""
        smoothed = math.ceil(sum([*recent, raw_rank]) / (len(recent) + 1) - 1e-9)
        return min(max(smoothed, self.cfg.rank_min), self.cfg.rank_max)

    def _update_per_matrix(
        self, sigmas: list[torch.Tensor], totals: Sequence[float], target: float, raw: tuple[int, ...] | None = None
    ) -> int:
        if raw is None:
            raw = tuple(self._matrix_raw_rank(s, total, target) for s, total in zip(sigmas, totals, strict=True))
        recent = [d.matrix_raw_ranks for d in self._window() if len(d.matrix_raw_ranks) == len(raw)]
        ranks = tuple(self._smoothed(raw[i], [r[i] for r in recent]) for i in range(len(raw)))
        rank = math.ceil(sum(ranks) / len(ranks) - 1e-9) if ranks else self.cfg.rank_min
        raw_rank = math.ceil(sum(raw) / len(raw) - 1e-9) if raw else 1
        self._record(RankDecision(self.rounds, target, raw_rank, rank, raw, ranks))
        return rank

    def _budget_raw_ranks(
        self, sigmas: list[torch.Tensor], totals: Sequence[float], costs: Sequence[int], target: float
    ) -> tuple[int, ...]:
        """Per-matrix ranks that keep `target` of the pooled energy of all matrices for the fewest values sent.

        Greedy on energy per value: every matrix's next singular direction is a candidate worth sigma^2 / cost; taking
        candidates from the best ratio down keeps each matrix's a prefix (its sigmas descend) and stops once the kept
        share reaches the target. At least one rank each; rank_max each when the estimated spectra cannot reach it.
        """
        if len(costs) != len(sigmas):
            raise ValueError(f"got {len(costs)} rank costs for {len(sigmas)} matrices; pass one per matrix")
        total = sum(totals)
        if not sigmas or total <= 0:
            return tuple(1 for _ in sigmas)
        owner = torch.cat([torch.full((sigma.numel(),), i, dtype=torch.int64) for i, sigma in enumerate(sigmas)])
        energy = torch.cat([sigma.square() for sigma in sigmas])  # (candidates,) float64
        ratio = energy / torch.tensor([float(costs[i]) for i in owner.tolist()], dtype=torch.float64)
        order = torch.argsort(ratio, descending=True, stable=True)
        kept = torch.cumsum(energy[order], dim=0) / total  # share kept after taking each candidate
        reached = torch.nonzero(kept >= target - _ENERGY_TOLERANCE)
        if not reached.numel():
            return tuple(self.cfg.rank_max for _ in sigmas)
        taken = owner[order[: int(reached[0, 0]) + 1]]
        counts = torch.bincount(taken, minlength=len(sigmas)).tolist()
        return tuple(min(max(count, 1), self.cfg.rank_max) for count in counts)

    def _matrix_raw_rank(self, sigma: torch.Tensor, total: float, target: float) -> int:
        """Smallest k in [1, rank_max] keeping `target` of one matrix's energy (1 for a zero matrix)."""
        if total <= 0:
            return 1
        return _first_reaching(_padded_cumulative(sigma.square(), self.cfg.rank_max) / total, target, self.cfg.rank_max)

    def _raw_rank(self, sigmas: list[torch.Tensor], totals: Sequence[float], target: float) -> int:
        matrices = [(sigma, total) for sigma, total in zip(sigmas, totals, strict=True) if total > 0]
        if not matrices:
            return 1  # nothing to keep: the smallest rank, which the clip raises to rank_min
        if self.cfg.rank_rule == "pooled":
            kept = torch.zeros(self.cfg.rank_max, dtype=torch.float64)  # (rank_max,) energy kept at rank k + 1
            for sigma, _ in matrices:
                kept += _padded_cumulative(sigma.square(), self.cfg.rank_max)
            return _first_reaching(kept / sum(total for _, total in matrices), target, self.cfg.rank_max)
        per_matrix = [
            _first_reaching(_padded_cumulative(sigma.square(), self.cfg.rank_max) / total, target, self.cfg.rank_max)
            for sigma, total in matrices
        ]
        if self.cfg.rank_rule == "max":
            return max(per_matrix)
        return math.ceil(sum(per_matrix) / len(per_matrix) - 1e-9)

    def state_dict(self) -> dict[str, Any]:
        """The decisions of the last `window` rounds (at most `window` rows: the next rounds' smoothing and the
        schedule's clock, the last row's round + 1, need no more) and the spectrum estimate's generator."""
        # Tensors rather than lists of records so that torch.distributed.checkpoint stores them as plain arrays.
        history = torch.tensor(
            [[d.round, d.target_energy, d.raw_rank, d.rank] for d in self.history], dtype=torch.float64
        ).reshape(-1, 4)  # (rounds, 4)
        width = max((len(d.matrix_ranks) for d in self.history), default=0)
        # (rounds, 2, matrices): raw and used per-matrix ranks, -1 past a round's matrices
        matrix_ranks = torch.full((len(self.history), 2, width), -1, dtype=torch.int64)
        for index, decision in enumerate(self.history):
            matrix_ranks[index, 0, : len(decision.matrix_raw_ranks)] = torch.tensor(decision.matrix_raw_ranks)
            matrix_ranks[index, 1, : len(decision.matrix_ranks)] = torch.tensor(decision.matrix_ranks)
        return {"history": history, "matrix_ranks": matrix_ranks, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict`; a state with more rows (saved while every round was kept) keeps its last `window`."""
        per_matrix = state.get("matrix_ranks")  # absent in states saved before per-matrix ranks
        rows = state["history"].tolist()
        self.rounds = int(rows[-1][0]) + 1 if rows else 0
        self.history = deque(maxlen=self.cfg.window)
        first = max(0, len(rows) - self.cfg.window)
        for index, (round_index, target, raw, rank) in enumerate(rows[first:], start=first):
            raws, ranks = ([], []) if per_matrix is None else per_matrix[index].tolist()
            self.history.append(
                RankDecision(
                    int(round_index),
                    float(target),
                    int(raw),
                    int(rank),
                    tuple(r for r in raws if r >= 0),
                    tuple(r for r in ranks if r >= 0),
                )  # fmt: skip
            )
        self.generator.set_state(state["generator"])

    def __repr__(self) -> str:
        return (
            f"AdaptiveRank(rank_min={self.cfg.rank_min}, rank_max={self.cfg.rank_max}, energy={self.cfg.energy}, "
            f"energy_floor={self.cfg.energy_floor}, window={self.cfg.window}, schedule={self.cfg.schedule!r}, "
            f"ramp_rounds={self.cfg.ramp_rounds}, rank_rule={self.cfg.rank_rule!r})"
        )


def _padded_cumulative(squares: torch.Tensor, length: int) -> torch.Tensor:
    """Cumulative sums of (s,) squared singular values, extended to (length,) with the last value."""
    cumulative = torch.cumsum(squares, dim=0)[:length]
    last = cumulative[-1] if cumulative.numel() else torch.zeros((), dtype=cumulative.dtype)
    return torch.cat([cumulative, last.expand(length - cumulative.numel())])


def _first_reaching(kept_share: torch.Tensor, target: float, rank_max: int) -> int:
    """Smallest k in [1, rank_max] with kept_share[k - 1] >= target; rank_max when none reaches it."""
    reached = torch.nonzero(kept_share >= target - _ENERGY_TOLERANCE)
    return int(reached[0, 0]) + 1 if reached.numel() else rank_max


class AdaptiveCodec(LowRankCodec):
    """`lowrank_int4` whose rank is chosen every round by an `AdaptiveRank` from the pseudo-gradient's spectrum.

    DiLoCoX's adaptive gradient compression (Qi et al. 2025, arXiv 2506.21263). Each `encode_list` call is one
    round: every matrix that could go low-rank is factorized at min(rank_max, m, n) with its warm start, and every
    matrix is sent with the leading triplets of its rank (`per_matrix`: its own; else one rank for all). The rank
    is in each matrix's 2-byte header, so receivers need no state. Whose spectrum sets the rank
    (`compression.spectrum_of`): `pseudo_grad` (default), the pseudo-gradient's own, which `ErrorFeedback` hands
    to `observe` before adding the residual, measured by a randomized SVD at rank_max per matrix; or
    `codec_input`, the sorted Ritz values of the encoding's own iteration on pseudo-gradient plus residual (no
    extra SVD). The residual of an int4 low-rank codec is mostly quantization noise and the directions the rounds
    dropped, a flat spectrum that builds up: measured there the rank climbed to rank_max and stayed (benchmarks
    /results/gap). Without an `observe` call (error feedback off, or a direct `encode_list`) the spectrum is that
    of what is encoded. The factorization costs a power iteration at rank_max, not at the chosen rank: about 2.5x
    `lowrank_int4` at rank 8 for rank_max 32, plus the randomized SVD of `pseudo_grad`.

        codec = build_codec(CompressionConfig(kind="adaptive", rank_min=2, rank_max=32, energy=0.9))
        payload = codec.encode_list(pseudo_grads)        # size varies with the rank: codec.max_nbytes_list bounds it
        codec.policy.rank                                # the rank of the last round
    """

    def __init__(
        self,
        policy: AdaptiveRank,
        *,
        factor_format: ValueFormat,
        small_format: ValueFormat,
        power_iterations: int = 1,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(
            "adaptive",
            rank=policy.cfg.rank_max,
            factor_format=factor_format,
            small_format=small_format,
            power_iterations=power_iterations,
            generator=generator,
        )
        self.policy = policy
        self.sorted_factors = True
        self._round_factors: dict[int, Factors] = {}
        self._round_ranks: dict[int, int] = {}  # slot -> this round's rank (per_matrix)
        self._observed: tuple[list[torch.Size], dict[int, tuple[torch.Tensor, float]]] | None = None

    def current_rank(self) -> int:
        return self.policy.rank

    def current_matrix_ranks(self) -> tuple[int, ...] | None:
        decisions = self.policy.history
        return decisions[-1].matrix_ranks if decisions and decisions[-1].matrix_ranks else None

    def observe(self, pseudo_grads: Sequence[torch.Tensor]) -> None:
        if self.policy.cfg.spectrum_of != "pseudo_grad":
            return
        spectra: dict[int, tuple[torch.Tensor, float]] = {}  # index in the list -> (sigma, total energy)
        for index, tensor in enumerate(pseudo_grads):
            matrix = self._measured_matrix(tensor)
            if matrix is None:
                continue
            top = min(self.policy.cfg.rank_max, *matrix.shape)
            factors = randomized_factors(
                matrix, top, oversample=AdaptiveRank.OVERSAMPLE, iterations=AdaptiveRank.SPECTRUM_ITERATIONS,
                generator=self.policy.generator,
            )  # fmt: skip
            spectra[index] = (factors.sigma, float(torch.linalg.vector_norm(matrix)) ** 2)
        self._observed = ([tensor.shape for tensor in pseudo_grads], spectra)

    def _measured_matrix(self, value: torch.Tensor) -> torch.Tensor | None:
        """`value` as an fp32 matrix (m, n) if the policy's rank matters for it, else None (1-D, or dense even at
        rank_min: sent whole at every rank the policy can pick)."""
        if value.dim() <= 1:
            return None
        matrix = as_matrix(value.detach().to(torch.float32))  # (m, n)
        num_rows, num_cols = matrix.shape
        if sent_dense(min(self.policy.cfg.rank_min, num_rows, num_cols), num_rows, num_cols):
            return None
        return matrix

    def _encode_values(self, values: list[torch.Tensor], first_slot: int) -> list[torch.Tensor]:
        observed, self._observed = self._observed, None
        if observed is not None:
            assert observed[0] == [value.shape for value in values], "observe() saw other tensors than encode_list"
        sigmas: list[torch.Tensor] = []
        totals: list[float] = []
        slots: list[int] = []
        costs: list[int] = []
        for index, value in enumerate(values):
            matrix = self._measured_matrix(value)
            if matrix is None:
                continue
            slot = first_slot + index
            factors = self._factorize(matrix, min(self.policy.cfg.rank_max, *matrix.shape), slot)
            self._round_factors[slot] = factors
            sigma, total = (
                observed[1][index] if observed is not None
                else (factors.sigma, float(torch.linalg.vector_norm(matrix)) ** 2)
            )  # fmt: skip
            sigmas.append(sigma)
            totals.append(total)
            slots.append(slot)
            costs.append(sum(matrix.shape))  # values one more rank sends: a column of P and one of Q
        self.policy.update_from_spectra(sigmas, totals, costs)
        self._round_ranks = dict(zip(slots, self.policy.history[-1].matrix_ranks, strict=False))
        try:
            return super()._encode_values(values, first_slot)
        finally:
            self._round_factors, self._round_ranks = {}, {}

    def _matrix_rank(self, slot: int) -> int:
        return self._round_ranks.get(slot, self.policy.rank)

    def _matrix_factors(self, matrix: torch.Tensor, rank: int, slot: int) -> Factors:
        # Ritz triplets are sorted, so the leading `rank` ones are the best rank-`rank` part of the measured subspace.
        return self._round_factors[slot].truncate(rank)

    def expected_nbytes(self, shape: Sequence[int]) -> int | None:
        if len(shape) <= 1:
            return self.small_format.nbytes(numel_of(shape))
        num_rows, num_cols = shape[0], numel_of(shape[1:])
        top = min(self.policy.cfg.rank_max, num_rows, num_cols)
        low = min(self.policy.cfg.rank_min, top)
        # Fixed when the min(m, n) cap leaves one possible rank, or the matrix is dense even at the lowest.
        if low == top or sent_dense(low, num_rows, num_cols):
            return self.nbytes_at_rank(shape, low)
        return None

    def max_nbytes(self, shape: Sequence[int]) -> int:
        if len(shape) <= 1:
            return self.small_format.nbytes(numel_of(shape))
        top = min(self.policy.cfg.rank_max, shape[0], numel_of(shape[1:]))
        low = min(self.policy.cfg.rank_min, top)
        # Not monotone in the rank near the dense switch (int4 scale rounding), so take the maximum over all ranks.
        return max(self.nbytes_at_rank(shape, rank) for rank in range(low, top + 1))

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["policy"] = self.policy.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.policy.load_state_dict(state["policy"])

    def __repr__(self) -> str:
        return (
            f"AdaptiveCodec({self.policy!r}, factors={self.factor_format.name}, small_tensors={self.small_format.name})"
        )
