"""Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512): the stage's outer sync in `sync.fragments` parts.

The parameter tensors of this rank's stage are split into N contiguous fragments of about equal size
(`fragment_bounds`, on tensor borders), and each fragment runs its own DiLoCo round (`DiLoCoSync` over its tensors)
offset by k x H // N steps: fragment k ends its rounds at the steps s >= 1 with (s - k x H // N) % H == 0 (fragment 0
at H, 2H, ...; fragment k >= 1 first after a short round of k x H // N steps) and at the end of training. The slow
link (one `WanChannel`, a FIFO) so carries N bursts of ~1/N of the stage per round instead of one of the whole stage.
Each fragment owns its pseudo-gradient, its sync in flight (`sync_delay`), its reducer and codec state (error
feedback, adaptive rank), its outer optimizer over its slice of phi, its merge rule's start and its guard.

    sync = StreamingSync(model.parameters(), SyncConfig(inner_steps=40, sync_delay=1, fragments=4), channel=channel,
                         dp_group=dp_group)
    ...inner step...; sync.after_inner_step(step)     # at steps 10, 20, 30, 40, 50, ...: one fragment's round ends
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.distributed as dist

from dilocox.compress import CompressionConfig
from dilocox.net.channel import WanChannel
from dilocox.sync.base import FlatParams, RoundStats, StepRounds, dp_mean_
from dilocox.sync.config import SyncConfig
from dilocox.sync.diloco import DiLoCoSync
from dilocox.sync.outer_optimizer import OuterOptimizerFactory

STATE_KEYS: tuple[str, ...] = ("fragments",)
"""The keys of `StreamingSync.state_dict`."""


def fragment_bounds(numels: Sequence[int], num_fragments: int) -> list[tuple[int, int]]:
    """(first, end) tensor indices of each of `num_fragments` contiguous fragments of tensors with `numels` values:
    every fragment holds at least one tensor, and each ends on the tensor border closest to an equal share of the
    values that still leaves a tensor for every later fragment."""
    if not 1 <= num_fragments <= len(numels):
        raise ValueError(
            f"sync.fragments = {num_fragments} is more than the {len(numels)} parameter tensors of this rank's stage: "
            f"each fragment syncs whole tensors; use sync.fragments <= {len(numels)}"
        )
    offsets = list(itertools.accumulate(numels, initial=0))
    bounds, start = [], 0
    for k in range(num_fragments):
        if k == num_fragments - 1:
            end = len(numels)
        else:
            target = offsets[-1] * (k + 1) / num_fragments
            last = len(numels) - (num_fragments - 1 - k)  # leave one tensor for every later fragment
            end = min(range(start + 1, last + 1), key=lambda e: (abs(offsets[e] - target), e))
        bounds.append((start, end))
        start = end
    return bounds


def fragment_offset(fragment: int, inner_steps: int, num_fragments: int) -> int:
    """The step of fragment `fragment`'s first round end: H for fragment 0, k x H // N for fragment k >= 1."""
    return (fragment * inner_steps) // num_fragments or inner_steps


class StreamingSync(StepRounds):
    """The outer loop of one stage as `sync.fragments` staggered `DiLoCoSync` rounds (module docstring), behind the
    protocol `OuterSync` drives: `after_inner_step`, `flush`, `state_dict`, ...

    The gradient mean over `dp_group` is one collective over all the stage's parameters. A fragment's sync lands at
    its own boundaries; the syncs that land at one step are returned as one `RoundStats` (`fragment` set) with the
    others in `also_landed`. At `total_steps` every fragment ends its round and `flush` lands what is left; the
    stats of both are returned by `flush`, the end of training's call. With `sync.guard`, a fragment whose own
    update is non-finite heals as in `DiLoCoSync`; the other fragments' parameters went bad in the same steps, so
    those that are non-finite start their round in progress again from its start.
    """

    state_keys = STATE_KEYS
    elastic = None
    """Elastic runs sync whole stages (`Config.validate` refuses fragments there)."""
    time_rounds = False
    """Fragments stagger by steps within rounds of H steps (`sync.round = time` is refused with them)."""
    done = False
    """The run ends at train.steps (time rounds end by rounds); the rest of the round clock is `StepRounds`'."""

    def __init__(
        self,
        params,
        cfg: SyncConfig,
        compression: CompressionConfig | None = None,
        *,
        channel: WanChannel,
        dp_group: dist.ProcessGroup | None,
        pp_group: dist.ProcessGroup | None = None,
        seed: int = 0,
        total_steps: int | None = None,
        outer_optimizer: OuterOptimizerFactory | None = None,
    ) -> None:
        cfg.validate()
        self.cfg = cfg
        self.name = cfg.kind
        self.flat = FlatParams(params)
        self.numel = self.flat.numel
        self.dp_group = dp_group
        self.total_steps = total_steps
        self.bounds = fragment_bounds(self.flat.numels, cfg.fragments)
        """(first, end) parameter indices of every fragment."""
        self.fragments = [
            DiLoCoSync(
                self.flat.params[first:end],
                cfg,
                compression,
                channel=channel,
                dp_group=dp_group,
                pp_group=pp_group,
                seed=seed,
                total_steps=total_steps,
                outer_optimizer=outer_optimizer,
                first_round_end=fragment_offset(k, cfg.inner_steps, cfg.fragments),
            )
            for k, (first, end) in enumerate(self.bounds)
        ]
        self._warnings: list[str] = []
        self._last_step: list[RoundStats] = []
        """The syncs landed by the rounds that ended at `total_steps`, returned by `flush`."""

    # ---------------------------------------------------------------------------------------------- protocol
    def reduce_gradients(self) -> None:
        self.flat.scatter_grads(dp_mean_(self.flat.gather_grads(), self.dp_group))

    def after_inner_step(self, step: int) -> RoundStats | None:
        """Every fragment's `after_inner_step`: the round of the fragments whose boundary `step` is ends."""
        ended = [fragment.is_round_boundary(step) for fragment in self.fragments]
        landed = [fragment.after_inner_step(step) for fragment in self.fragments]
        if self.cfg.guard and any(ended):
            self._restart_non_finite(ended)
        stats = _tagged(landed)
        if step == self.total_steps:
            self._last_step = stats
            return None
        return _combined(stats)

    def _restart_non_finite(self, ended: list[bool]) -> None:
        """The guard healed the fragments whose round just ended non-finite; the others that are non-finite went bad
        in the same steps and start their round in progress again from its start."""
        for fragment, just_ended in zip(self.fragments, ended, strict=True):
            if not just_ended and not bool(torch.isfinite(fragment.flat.gather_data()).all()):
                fragment.restart_round()

    def end_round(self, step: int) -> RoundStats | None:
        """End the round in progress of every fragment that has steps in it (a flush before `total_steps`)."""
        landed = [f.end_round(step) if f.last_boundary < step else None for f in self.fragments]
        return _combined(_tagged(landed))

    def flush(self) -> RoundStats | None:
        """Every fragment's `flush`; returns the stats of the syncs landed by it and by the rounds that ended at
        `total_steps`."""
        stats = self._last_step + _tagged([fragment.flush() for fragment in self.fragments])
        self._last_step = []
        return _combined(stats)

    def is_round_boundary(self, step: int) -> bool:
        """Whether some fragment's round ends at `step` (a checkpoint there holds every fragment's state)."""
        return any(fragment.is_round_boundary(step) for fragment in self.fragments)

    def take_healed(self) -> bool:
        return any([fragment.take_healed() for fragment in self.fragments])  # every fragment's flag is cleared

    @property
    def last_boundary(self) -> int:
        """The earliest step at which a fragment's round in progress began."""
        return min(fragment.last_boundary for fragment in self.fragments)

    @property
    def outer_step(self) -> int:
        """The most rounds a fragment has completed (fragments k >= 1 complete a short first round early)."""
        return max(fragment.outer_step for fragment in self.fragments)

    @property
    def inner_steps(self) -> int:
        return self.cfg.inner_steps

    @property
    def guard_counts(self) -> dict[str, int]:
        """sync.guard's totals over every fragment's rounds."""
        counts = [fragment.guard_counts for fragment in self.fragments]
        return {key: sum(c[key] for c in counts) for key in counts[0]}

    @property
    def warnings(self) -> list[str]:
        """The fragments' messages, each naming its fragment; the trainer pops and prints them."""
        for k, fragment in enumerate(self.fragments):
            self._warnings.extend(f"fragment {k}/{len(self.fragments)}: {text}" for text in fragment.warnings)
            fragment.warnings.clear()
        return self._warnings

    @property
    def outer_params(self) -> torch.Tensor:
        """phi of the whole stage (numel,) fp32, the fragments' in parameter order (a copy)."""
        return torch.cat([fragment.outer_params for fragment in self.fragments])

    @contextmanager
    def agreed_model(self) -> Iterator[bool]:
        with ExitStack() as stack:
            for fragment in self.fragments:
                stack.enter_context(fragment.agreed_model())
            yield True

    def state_bytes(self) -> int:
        return sum(fragment.state_bytes() for fragment in self.fragments)

    def state_dict(self) -> dict[str, Any]:
        """Every fragment's state (`DiLoCoSync.state_dict`), its sync in flight included."""
        return {"fragments": [fragment.state_dict() for fragment in self.fragments]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Every fragment's state, in fragment order on every cluster, so that the syncs in flight sent again pair up
        across the clusters."""
        saved = state.get("fragments")
        if not isinstance(saved, list) or len(saved) != len(self.fragments):
            have = len(saved) if isinstance(saved, list) else "no"
            raise ValueError(
                f"this outer-sync state holds {have} fragments, this run syncs sync.fragments = {len(self.fragments)}: "
                "resume with the sync.fragments it was saved with"
            )
        for fragment, fragment_state in zip(self.fragments, saved, strict=True):
            fragment.load_state_dict(fragment_state)


def _tagged(landed: list[RoundStats | None]) -> list[RoundStats]:
    """The stats of the syncs that landed, each with its fragment."""
    return [dataclasses.replace(stats, fragment=k) for k, stats in enumerate(landed) if stats is not None]


def _combined(stats: list[RoundStats]) -> RoundStats | None:
    """The first sync's stats carrying the others (`RoundStats.also_landed`); None when none landed."""
    return dataclasses.replace(stats[0], also_landed=tuple(stats[1:])) if stats else None
