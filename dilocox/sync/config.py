"""`[sync]`: which strategy keeps the clusters together, and the outer loop's settings, owned and validated here.

Every field's default is the one `dilocox train --help` shows; no strategy changes another field's default. The
settings of DiLoCoX and of the baselines are presets (`dilocox/presets/*.toml`, `dilocox train --preset NAME`).

cfg = SyncConfig(kind="dilocox", inner_steps=50, sync_delay=1)
cfg.validate()                                   # ValueError naming sync.<field> and the fix
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

from dilocox.checks import check_non_negative, check_positive, check_types

SyncKind = Literal["allreduce", "cocktail", "diloco", "dilocox"]
"""Every `sync.kind` (docs/design.md §6). `diloco` and `dilocox` run the same outer loop (`DiLoCoSync`) with the
settings as written; `dilocox` names a run of DiLoCoX (the summary, plots and checkpoints carry the name)."""
SYNC_KINDS: tuple[str, ...] = get_args(SyncKind)
OUTER_LOOP_KINDS = ("diloco", "dilocox")
"""The kinds with H local steps and an outer sync of pseudo-gradients; the others sync every step."""
OuterStateDevice = Literal["device", "cpu"]
"""Where the outer state lives (`sync.outer_state_device`)."""
MergeRule = Literal["reset", "keep_local", "eager", "lookahead", "own_payload"]
"""Where a round starts under the one-step delay (see `DiLoCoSync` and docs/design.md §3)."""
MERGE_RULES: tuple[str, ...] = get_args(MergeRule)
OuterOptimizerName = Literal["sgd", "adamw"]
"""Every `sync.outer_optimizer` (`dilocox.sync.outer_optimizer`)."""
OUTER_OPTIMIZERS: tuple[str, ...] = get_args(OuterOptimizerName)
OuterLrSchedule = Literal["constant", "cosine"]
"""How the outer learning rate moves over the outer updates (`SyncConfig.outer_lr_at`)."""
Aggregate = Literal["mean", "trimmed_mean", "median", "norm_clip"]
"""How the accepted updates of a round are averaged (`sync.aggregate`, `dilocox/sync/robust.py`)."""
AGGREGATES: tuple[str, ...] = get_args(Aggregate)
RoundMode = Literal["steps", "time"]
"""What makes a round (`sync.round`): H inner steps on every cluster, or one time budget (`dilocox.sync.rounds`)."""
ROUND_MODES: tuple[str, ...] = get_args(RoundMode)
FIT_HEADROOM = 1.1
"""`fit_link` sizes a round so that its compute is at least this multiple of the last sync's link time."""


HELD_BACK_OPTIONS = ("local_residual", "drain_residual")
"""The `[sync]` options that work on what a codec's error feedback holds back (`holds_back`)."""


@dataclass
class SyncConfig:
    kind: SyncKind = "diloco"
    """Strategy: allreduce, cocktail (compressed every step), diloco (H local steps, outer sync), dilocox (as diloco)"""
    inner_steps: int = 50
    """H: local inner steps between two outer syncs (diloco, dilocox)."""
    outer_optimizer: OuterOptimizerName = "sgd"
    """The outer optimizer of phi: sgd (outer_lr, outer_momentum, nesterov) or adamw (outer_lr, outer_beta1/2, ...)."""
    outer_lr: float = 0.7
    """Outer learning rate (sgd with momentum 0 and lr 1.0: plain averaging); adamw takes it as its step length."""
    outer_momentum: float = 0.9
    """Momentum of the outer SGD."""
    nesterov: bool = True
    """Use Nesterov momentum in the outer SGD."""
    outer_beta1: float = 0.9
    """adamw: decay rate of the outer AdamW's first moment (its momentum)."""
    outer_beta2: float = 0.999
    """adamw: decay rate of the outer AdamW's second moment (its per-value scale)."""
    outer_weight_decay: float = 0.0
    """adamw: the outer AdamW's decoupled weight decay of phi, per outer update."""
    sync_delay: int = 0
    """Rounds between launching an outer sync and applying it: 0 = blocking, 1 = overlapped (the one-step delay)."""
    overlap_steps: int = 0
    """Steps a sync overlaps: delay 0, launched this many before its boundary (tau); delay 1, applied this many in."""
    alpha: float = 0.0
    """sync_delay 0: where a landed average leaves the live parameters, lerp(phi, live, alpha) (0 = phi, 1 = live)."""
    merge: MergeRule = "keep_local"
    """With sync_delay 1, where a round starts: keep_local (phi - own progress), reset, eager, lookahead, own_payload"""
    local_residual: bool = False
    """Keep 1/C of this cluster's error-feedback residual (what its codec has not sent yet) in its own parameters."""
    drain_residual: bool = False
    """At the end of training, send what every codec still holds back (its residual) once, dense int4, into phi."""
    outer_lr_schedule: OuterLrSchedule = "constant"
    """Outer learning rate over the outer updates: constant, or cosine down to outer_lr x outer_min_lr_ratio."""
    outer_warmup_rounds: int = 0
    """Outer updates over which the outer learning rate ramps up linearly to outer_lr (either schedule)."""
    outer_min_lr_ratio: float = 0.1
    """cosine: the outer learning rate of the last outer update, as a fraction of outer_lr."""
    fragments: int = 1
    """Streaming DiLoCo: sync the stage as this many parameter fragments at staggered steps (1: all at once)."""
    fit_link: bool = False
    """With sync_delay 1: raise H each round so that one sync's measured link time fits in the next round's compute."""
    fit_link_max_steps: int = 0
    """fit_link: the largest H it may choose; 0 = 8 x sync.inner_steps."""
    outer_state_device: OuterStateDevice = "device"
    """Where outer params, momentum and residuals live: device (the rank's), or cpu to leave a GPU room for a stage."""
    guard: bool = True
    """Per-round numeric guard: non-finite or outsized updates are left out; a diverged cluster heals (§4.5)."""
    guard_max_ratio: float = 10.0
    """guard: an update whose norm exceeds this multiple of the recent accepted median is left out."""
    guard_peers: bool = True
    """guard, gather reduction, 3+ updates: also leave out one much longer than the round's median or pointing away."""
    guard_peer_ratio: float = 3.0
    """guard_peers: an update whose norm exceeds this multiple of the median norm of the round's updates is left out."""
    guard_max_bad_rounds: int = 3
    """guard: the run stops when this cluster's update, or every cluster's, is unusable this many rounds in a row."""
    aggregate: Aggregate = "mean"
    """mean, trimmed_mean, median or norm_clip (the robust ones need a codec with compression.reduction = gather)."""
    trim_fraction: float = 0.25
    """aggregate = trimmed_mean: the share of the largest and of the smallest values dropped per coordinate."""
    min_clusters: int = 0
    """Fewest clusters a round may have before the run stops; 0 = all of them (static), 1 (topology.elastic)."""
    round: RoundMode = "steps"
    """steps: every cluster does H inner steps per round; time: every cluster trains for the same time budget."""
    round_seconds: float = 0.0
    """round = time: the budget of a round in seconds; 0 = H x the fastest cluster's mean step time."""

    @property
    def has_outer_loop(self) -> bool:
        return self.kind in OUTER_LOOP_KINDS

    @property
    def max_inner_steps(self) -> int:
        """The largest H that fit_link may choose."""
        return self.fit_link_max_steps or 8 * self.inner_steps

    def outer_lr_at(self, update: int, num_updates: int) -> float:
        """The learning rate of the 0-based outer update `update` of `num_updates` (docs/design.md §3): linear
        warm-up over `outer_warmup_rounds` W, then constant or a cosine from outer_lr down to outer_lr x rho,
        rho = outer_min_lr_ratio, reached at the last update (the inner schedule's rule, `lr_at`, per update)."""
        if update < self.outer_warmup_rounds:
            return self.outer_lr * (update + 1) / self.outer_warmup_rounds
        if self.outer_lr_schedule == "constant":
            return self.outer_lr
        progress = min(1.0, (update - self.outer_warmup_rounds) / max(1, num_updates - self.outer_warmup_rounds - 1))
        rho = self.outer_min_lr_ratio
        return self.outer_lr * (rho + (1.0 - rho) * (1.0 + math.cos(math.pi * progress)) / 2.0)

    def validate(self) -> None:
        """Raise ValueError naming the first impossible setting of `[sync]` and how to fix it."""
        check_types("sync", self)  # also every choice: kind, merge, aggregate, outer_optimizer, outer_lr_schedule, ...
        check_positive("sync", self, "inner_steps")
        check_non_negative("sync", self, "outer_momentum", "fit_link_max_steps")
        if self.outer_lr <= 0:
            raise ValueError(f"sync.outer_lr = {self.outer_lr} must be > 0 (1.0 with momentum 0 = plain averaging)")
        if self.outer_momentum >= 1.0:
            raise ValueError(f"sync.outer_momentum = {self.outer_momentum} must be < 1")
        if self.sync_delay not in (0, 1):
            raise ValueError(f"sync.sync_delay = {self.sync_delay} must be 0 (blocking) or 1 (one-step-delay overlap)")
        check_positive("sync", self, "guard_max_bad_rounds")
        if not (math.isfinite(self.guard_max_ratio) and self.guard_max_ratio > 1.0):
            raise ValueError(
                f"sync.guard_max_ratio = {self.guard_max_ratio} must be a finite number > 1 (10 leaves out an update "
                "ten times longer than the recent median)"
            )
        if not (math.isfinite(self.guard_peer_ratio) and self.guard_peer_ratio > 1.0):
            raise ValueError(
                f"sync.guard_peer_ratio = {self.guard_peer_ratio} must be a finite number > 1 (3 leaves out an update "
                "three times longer than the median of the round's updates), or set sync.guard_peers = false"
            )
        if not 0.0 < self.trim_fraction < 0.5:
            raise ValueError(
                f"sync.trim_fraction = {self.trim_fraction} must be in (0, 0.5): the share of the largest and of the "
                "smallest values dropped per coordinate (0.25 drops one of four clusters at each end)"
            )
        if self.aggregate != "mean" and not self.has_outer_loop:
            raise ValueError(
                f"sync.aggregate = {self.aggregate!r} averages the pseudo-gradients of an outer loop: use sync.kind = "
                "diloco or dilocox"
            )
        for name in ("outer_beta1", "outer_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"sync.{name} = {getattr(self, name)} must be in [0, 1): a moment's decay rate")
        check_non_negative("sync", self, "outer_weight_decay")
        if self.outer_optimizer != "sgd" and self.drain_residual:
            raise ValueError(
                f"sync.drain_residual = true adds the drained residual to phi at the outer SGD's learning rate, but "
                f"sync.outer_optimizer = {self.outer_optimizer!r} takes steps of its own length; set "
                "sync.drain_residual = false, or use sync.outer_optimizer = sgd"
            )
        check_non_negative("sync", self, "outer_warmup_rounds")
        if not 0.0 <= self.outer_min_lr_ratio <= 1.0:
            raise ValueError(
                f"sync.outer_min_lr_ratio = {self.outer_min_lr_ratio} must be in [0, 1]: the last outer update's "
                "learning rate as a fraction of sync.outer_lr (1 = no decay)"
            )
        for option in HELD_BACK_OPTIONS:
            if getattr(self, option) and not self.has_outer_loop:
                raise ValueError(
                    f"sync.{option} = true works on a codec's residual between outer rounds, but sync.kind = "
                    f"{self.kind!r} has no outer rounds; use sync.kind = diloco or dilocox"
                )
        if not self.has_outer_loop and self.sync_delay:
            raise ValueError("sync.sync_delay = 1 needs an outer loop: use sync.kind = diloco or dilocox")
        if self.fit_link and self.sync_delay != 1:
            raise ValueError(
                "sync.fit_link = true sizes H so that a sync travels during the next round, which needs "
                "sync.sync_delay = 1; with a blocking sync raise sync.inner_steps instead"
            )
        check_non_negative("sync", self, "overlap_steps")
        check_positive("sync", self, "fragments")
        if self.overlap_steps and not self.has_outer_loop:
            raise ValueError(
                f"sync.overlap_steps = {self.overlap_steps} overlaps an outer sync with inner steps, but sync.kind = "
                f"{self.kind!r} syncs every step; use sync.kind = diloco or dilocox, or 0"
            )
        shortest = max(1, self.inner_steps // self.fragments) if self.sync_delay == 0 else self.inner_steps
        if self.overlap_steps >= shortest:
            what = "a fragment's shortest round, H // sync.fragments =" if self.fragments > 1 else "sync.inner_steps ="
            fix = "blocking" if self.sync_delay == 0 else "each average applied at the end of the next round"
            raise ValueError(
                f"sync.overlap_steps = {self.overlap_steps} must be below {what} {shortest}: a sync launched that many "
                f"steps before its boundary or applied that many into the next round; use 0 ({fix})"
            )
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"sync.alpha = {self.alpha} must be in [0, 1]: lerp(phi, live, alpha) once a sync lands")
        if self.alpha and self.sync_delay != 0:
            raise ValueError(
                f"sync.alpha = {self.alpha} mixes a landed average into the round that launched it, but with "
                "sync.sync_delay = 1 the round restarted when it launched, where sync.merge says: set sync.alpha = 0, "
                "or sync.sync_delay = 0"
            )
        if self.overlap_steps and self.fit_link:
            raise ValueError(
                "sync.fit_link = true sizes H so that a sync travels during a whole round, but sync.overlap_steps = "
                f"{self.overlap_steps} applies it {self.overlap_steps} steps in; use one or the other"
            )
        self._check_fragments()
        self._validate_round()
        if self.fit_link and 0 < self.fit_link_max_steps < self.inner_steps:
            raise ValueError(
                f"sync.fit_link_max_steps = {self.fit_link_max_steps} is below sync.inner_steps = {self.inner_steps}: "
                f"fit_link only raises H; use 0 (8 x H) or a value >= {self.inner_steps}"
            )

    def _check_fragments(self) -> None:
        check_positive("sync", self, "fragments")
        if self.fragments == 1:
            return
        if not self.has_outer_loop:
            raise ValueError(
                f"sync.fragments = {self.fragments} staggers the outer syncs of an outer loop, but sync.kind = "
                f"{self.kind!r} syncs every step; use sync.kind = diloco or dilocox, or sync.fragments = 1"
            )
        if self.fragments > self.inner_steps:
            raise ValueError(
                f"sync.fragments = {self.fragments} is more than sync.inner_steps = {self.inner_steps}: fragment k "
                f"syncs at offset k x H / fragments, so each needs a step of its own; use sync.fragments <= "
                f"{self.inner_steps}"
            )
        for option, value, why in (
            ("fit_link", self.fit_link, "changes H between rounds, which would break the fragments' stagger"),
        ):
            if value:
                raise ValueError(
                    f"sync.{option} = {str(value).lower()} does not work with sync.fragments = {self.fragments}: it "
                    f"{why}; set sync.{option} = {'false' if isinstance(value, bool) else 0}, or sync.fragments = 1"
                )

    def _validate_round(self) -> None:
        """`sync.round` and `sync.round_seconds` against the rest: time rounds need an outer loop whose rounds end
        where each cluster's budget does and an average that can weigh the clusters by their tokens."""
        check_non_negative("sync", self, "round_seconds")
        if self.round == "steps":
            if self.round_seconds:
                raise ValueError(
                    f"sync.round_seconds = {self.round_seconds} is the budget of a time round: add "
                    "--sync.round=time, or leave sync.round_seconds at 0"
                )
            return
        refused = [  # (what, whether this config has it, the fix)
            (f"sync.kind = {self.kind}", not self.has_outer_loop, "use sync.kind = diloco or dilocox"),
            ("sync.fit_link = true", self.fit_link, "fit_link sizes H itself; leave it off"),
            (
                f"sync.overlap_steps = {self.overlap_steps}",
                self.overlap_steps > 0,
                "a landing a fixed number of steps into a round has no meaning when clusters do different numbers "
                "of steps; use 0",
            ),
            (
                f"sync.aggregate = {self.aggregate}",
                self.aggregate != "mean",
                "the clusters' updates are weighted by their tokens, which only the mean can do; use mean",
            ),
            (
                f"sync.fragments = {self.fragments}",
                self.fragments > 1,
                "fragments are staggered by steps within rounds of H steps; use sync.fragments = 1",
            ),
        ]
        for what, bad, fix in refused:
            if bad:
                raise ValueError(f"sync.round = time does not work with {what}: {fix}")


def check_robust_reduction(sync: SyncConfig, compression: Any, *, lanes: bool = False) -> None:
    """A robust `sync.aggregate` needs every cluster's update at every receiver, which only the gather reduction of
    a codec delivers (the dense all-reduce and the scalable reduction sum in transit); clusters of different
    data-parallel degree (`lanes`) always exchange every cluster's payload."""
    if sync.aggregate == "mean" or lanes:
        return
    if compression.kind == "none" or compression.reduction != "gather":
        raise ValueError(
            f"sync.aggregate = {sync.aggregate!r} needs every cluster's update at every receiver, but "
            f"compression.kind = {compression.kind!r} with compression.reduction = {compression.reduction!r} sums "
            "them in transit; use a codec with compression.reduction = gather (e.g. compression.kind = fp16 or "
            "adaptive), or sync.aggregate = mean"
        )


def holds_back(compression: Any) -> bool:
    """Whether the codec keeps an error-feedback residual, what `sync.local_residual` keeps a share of."""
    return compression.kind != "none" and compression.error_feedback


def check_held_back_options(sync: SyncConfig, compression: Any) -> None:
    """`sync.local_residual`, `sync.drain_residual` and the delayed merge rule `own_payload` work on what a codec's
    error feedback holds back, so they need such a codec. One error names every such option that is set, with the
    values that turn them all off."""
    used = [f"sync.{option} = true" for option in HELD_BACK_OPTIONS if getattr(sync, option)]
    fix = [f"sync.{option} = false" for option in HELD_BACK_OPTIONS if getattr(sync, option)]
    if sync.merge == "own_payload" and sync.sync_delay == 1:
        used.append("sync.merge = 'own_payload'")
        fix.append("sync.merge = eager")
    if not used:
        return
    named, fixes = _and(used), _and(fix)
    if not holds_back(compression):
        raise ValueError(
            f"{named} {'works' if len(used) == 1 else 'work'} on what a codec's error feedback holds back, but "
            f"compression.kind = {compression.kind!r} with compression.error_feedback = "
            f"{str(compression.error_feedback).lower()} holds nothing back; use a codec with error feedback (e.g. "
            f"compression.kind = topk_int4), or set {fixes}"
        )


def _and(items: list[str]) -> str:
    """ "a", "a and b", "a, b and c"."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"
