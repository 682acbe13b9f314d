"""`[sync]`: which strategy keeps the clusters together, and the outer loop's settings, owned and validated here.

The round's core settings are `[sync]`'s own; three parts have a sub-section each: `[sync.outer]` the outer optimizer
(`OuterConfig`), `[sync.guard]` the numeric guard (`GuardConfig`), `[sync.round]` what makes a round
(`RoundConfig`). Each validates its own values.

The settings of DiLoCoX and of the baselines are presets (`dilocox/presets/*.toml`, `dilocox train --preset NAME`).
An option that follows from others is "auto" until `resolved` sets it by the rule its docstring states (from the
codec, the delay, the outer optimizer); a value the user sets is kept, and refused only by its own checks here or by
the compatibility table (`dilocox.compat`).

cfg = SyncConfig(kind="dilocox", inner_steps=50, sync_delay=1).resolved(CompressionConfig(kind="int4"))
cfg.validate()                                   # ValueError naming sync.<field> and the fix
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from dilocox.checks import AUTO, Auto, check_non_negative, check_positive, check_types
from dilocox.compress.config import SPARSE_KINDS

SyncKind = Literal["allreduce", "cocktail", "diloco", "dilocox"]
"""Every `sync.kind` (docs/design.md §6). `diloco` and `dilocox` run the same outer loop (`DiLoCoSync`) with the
settings as written; `dilocox` names a run of DiLoCoX (the summary, plots and checkpoints carry the name)."""
SYNC_KINDS: tuple[str, ...] = get_args(SyncKind)
OUTER_LOOP_KINDS = ("diloco", "dilocox")
"""The kinds with H local steps and an outer sync of pseudo-gradients; the others sync every step."""
OuterStateDevice = Literal["device", "cpu"]
"""Where the outer state lives (`sync.outer.state_device`)."""
MergeRule = Literal["reset", "keep_local", "eager", "lookahead", "own_payload"]
"""Where a round starts under the one-step delay (see `DiLoCoSync` and docs/design.md §3)."""
MERGE_RULES: tuple[str, ...] = get_args(MergeRule)
MergeChoice = Literal["auto", "reset", "keep_local", "eager", "lookahead", "own_payload"]
"""`sync.merge`: a merge rule, or auto (its rule in the field's docstring)."""
OuterOptimizerName = Literal["sgd", "adamw"]
"""Every `sync.outer.optimizer` (`dilocox.sync.outer_optimizer`)."""
OUTER_LR = {"sgd": 0.7, "adamw": 1e-2}
"""`sync.outer.lr = auto` by outer optimizer: OpenDiLoCo's SGD 0.7; AdamW 1e-2, the best of 3e-3 / 1e-2 / 3e-2 on the
gap protocol (docs/results.md, "The outer optimizer")."""
OUTER_OPTIMIZER_SETTINGS = ("lr", "momentum", "nesterov", "beta1", "beta2", "weight_decay")
"""The `[sync.outer]` options that configure the outer optimizer: a preset's values of them are its outer optimizer's,
and apply only while `sync.outer.optimizer` is the preset's (`dilocox.config.load_config`)."""
OVERLAP_SHARE = 7 / 12
"""`sync.overlap_steps = auto` with a sparse codec (`SPARSE_KINDS`: a few percent of the values, whose sync lands well
inside a round) under the delay: 7 of H = 12 steps measured best with top-k int4 (docs/results.md, "The paper
regime")."""
CHECKPOINT_STEPS = 100
"""`checkpoint.interval = auto`: about this many steps, a whole number of rounds (`dilocox.config.Config.resolve`)."""
OuterLrSchedule = Literal["constant", "cosine"]
"""How the outer learning rate moves over the outer updates (`OuterConfig.lr_at`)."""
Aggregate = Literal["mean", "trimmed_mean", "median", "norm_clip"]
"""How the accepted updates of a round are averaged (`sync.aggregate`, `dilocox/sync/robust.py`)."""
AGGREGATES: tuple[str, ...] = get_args(Aggregate)
RoundMode = Literal["steps", "time"]
"""What makes a round (`sync.round.mode`): H inner steps on every cluster, or one time budget
(`dilocox.sync.rounds`)."""
MIN_STEP_SECONDS = 1e-3
"""The least time one inner step can take (a forward, a backward and an optimizer step of the smallest model): a
`sync.round.seconds` under H of them cuts every round to the one step a time round keeps at least."""
FIT_HEADROOM = 1.1
"""`sync.round.fit_link` sizes a round so that its compute is at least this multiple of the last sync's link time."""


FIT_LINK_RANGE = 8
"""`sync.round.fit_link_max_steps = auto`: this many times sync.inner_steps."""


@dataclass
class OuterConfig:
    optimizer: OuterOptimizerName = "sgd"
    """The outer optimizer of phi: sgd (lr, momentum, nesterov) or adamw (lr, beta1, beta2, weight_decay)."""
    lr: float | Auto = "auto"
    """Outer learning rate (sgd: lr 1 and momentum 0 = plain averaging; adamw: its step); auto: sgd 0.7, adamw 0.01"""
    momentum: float = 0.9
    """Momentum of the outer SGD."""
    nesterov: bool = True
    """Use Nesterov momentum in the outer SGD."""
    beta1: float = 0.9
    """adamw: decay rate of the outer AdamW's first moment (its momentum)."""
    beta2: float = 0.999
    """adamw: decay rate of the outer AdamW's second moment (its per-value scale)."""
    weight_decay: float = 0.0
    """adamw: the outer AdamW's decoupled weight decay of phi, per outer update."""
    lr_schedule: OuterLrSchedule = "constant"
    """Outer learning rate over the outer updates: constant, or cosine down to lr x min_lr_ratio."""
    warmup_rounds: int = 0
    """Outer updates over which the outer learning rate ramps up linearly to lr (either schedule)."""
    min_lr_ratio: float = 0.1
    """cosine: the outer learning rate of the last outer update, as a fraction of lr."""
    state_device: OuterStateDevice = "device"
    """Where outer params, momentum and residuals live: device (the rank's), or cpu to leave a GPU room for a stage."""

    def lr_at(self, update: int, num_updates: int) -> float:
        """The learning rate of the 0-based outer update `update` of `num_updates` (docs/design.md §3): linear
        warm-up over `warmup_rounds` W, then constant or a cosine from lr down to lr x rho, rho = min_lr_ratio,
        reached at the last update (the inner schedule's rule, `lr_at`, per update)."""
        if update < self.warmup_rounds:
            return self.lr * (update + 1) / self.warmup_rounds
        if self.lr_schedule == "constant":
            return self.lr
        progress = min(1.0, (update - self.warmup_rounds) / max(1, num_updates - self.warmup_rounds - 1))
        rho = self.min_lr_ratio
        return self.lr * (rho + (1.0 - rho) * (1.0 + math.cos(math.pi * progress)) / 2.0)

    def validate(self) -> None:
        """Raise ValueError naming the first impossible value of `[sync.outer]` and how to fix it."""
        check_types("sync.outer", self)
        check_non_negative("sync.outer", self, "momentum", "weight_decay", "warmup_rounds")
        if self.lr != AUTO and self.lr <= 0:
            raise ValueError(f"sync.outer.lr = {self.lr} must be > 0 (1.0 with momentum 0 = plain averaging)")
        if self.momentum >= 1.0:
            raise ValueError(f"sync.outer.momentum = {self.momentum} must be < 1")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"sync.outer.{name} = {getattr(self, name)} must be in [0, 1): a moment's decay rate")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(
                f"sync.outer.min_lr_ratio = {self.min_lr_ratio} must be in [0, 1]: the last outer update's learning "
                "rate as a fraction of sync.outer.lr (1 = no decay)"
            )


@dataclass
class GuardConfig:
    enabled: bool = True
    """Per-round numeric guard: non-finite or outsized updates are left out; a diverged cluster heals (§4.5)."""
    max_ratio: float = 10.0
    """An update whose norm exceeds this multiple of the recent accepted median is left out."""
    peers: bool = True
    """Gather reduction, 3+ updates: also leave out one much longer than the round's median or pointing away."""
    peer_ratio: float = 2.0
    """peers: an update whose norm, or median |value| sent, exceeds this multiple of the round's median is out."""
    max_bad_rounds: int = 3
    """The run stops when this cluster's update, or every cluster's, is unusable this many rounds in a row."""

    def validate(self) -> None:
        """Raise ValueError naming the first impossible value of `[sync.guard]` and how to fix it."""
        check_types("sync.guard", self)
        check_positive("sync.guard", self, "max_bad_rounds")
        if not (math.isfinite(self.max_ratio) and self.max_ratio > 1.0):
            raise ValueError(
                f"sync.guard.max_ratio = {self.max_ratio} must be a finite number > 1 (10 leaves out an update "
                "ten times longer than the recent median)"
            )
        if not (math.isfinite(self.peer_ratio) and self.peer_ratio > 1.0):
            raise ValueError(
                f"sync.guard.peer_ratio = {self.peer_ratio} must be a finite number > 1 (2 leaves out an update "
                "twice as large as the median of the round's updates), or set sync.guard.peers = false"
            )


@dataclass
class RoundConfig:
    mode: RoundMode = "steps"
    """steps: every cluster does H inner steps per round; time: every cluster trains for the same time budget."""
    seconds: float = 0.0
    """mode = time: the budget of a round in seconds; 0 = H x the fastest cluster's mean step time."""
    fit_link: bool = False
    """With sync_delay 1: raise H each round so that one sync's measured link time fits in the next round's compute."""
    fit_link_max_steps: int | Auto = "auto"
    """fit_link: the largest H it may choose; auto: 8 x sync.inner_steps."""

    def validate(self, inner_steps: int) -> None:
        """Raise ValueError naming the first impossible value of `[sync.round]` and how to fix it (`inner_steps`: H,
        the least fit_link may choose)."""
        check_types("sync.round", self)
        check_non_negative("sync.round", self, "seconds")
        if 0 < self.seconds < inner_steps * MIN_STEP_SECONDS:
            least = inner_steps * MIN_STEP_SECONDS
            raise ValueError(
                f"sync.round.seconds = {self.seconds:g} is less than H = {inner_steps} steps of "
                f"{MIN_STEP_SECONDS * 1e3:g} ms, shorter than any inner step: every round would be cut to one step; "
                f"use --sync.round.seconds={least:g} or more (the budget of H steps), or 0 (auto: H x the fastest "
                "cluster's step time)"
            )
        if self.fit_link_max_steps != AUTO:
            check_positive("sync.round", self, "fit_link_max_steps")
        if self.fit_link_max_steps != AUTO and self.fit_link and self.fit_link_max_steps < inner_steps:
            raise ValueError(
                f"sync.round.fit_link_max_steps = {self.fit_link_max_steps} is below sync.inner_steps = {inner_steps}: "
                f"fit_link only raises H; use auto ({FIT_LINK_RANGE} x H) or a value >= {inner_steps}"
            )


@dataclass
class SyncConfig:
    kind: SyncKind = "diloco"
    """Strategy: allreduce, cocktail (compressed every step), diloco (H local steps, outer sync), dilocox (as diloco)"""
    inner_steps: int = 50
    """H: local inner steps between two outer syncs (diloco, dilocox)."""
    sync_delay: int = 0
    """Rounds between launching an outer sync and applying it: 0 = blocking, 1 = overlapped (the one-step delay)."""
    # overlap_steps = auto: 7/12 of H, rounded half up and below H, where a delayed sync of a sparse codec lands inside
    # a round (rounds of steps, without fit_link); 0 otherwise (`resolved`). With sync_delay 0 a value tau launches
    # each sync tau steps before its boundary and lands it there (Streaming DiLoCo), mixed by `alpha`. Under time
    # rounds a value is the same share of each cluster's own round (`DiLoCoSync._planned_events`).
    overlap_steps: int | Auto = "auto"
    """Steps a sync overlaps: delay 1, landed this far into the next round; delay 0, launched this far before (tau)"""
    alpha: float = 0.0
    """sync_delay 0: a landed average leaves the live parameters at lerp(phi, live, alpha) (0: phi, 1: live)"""
    # merge, local_residual and drain_residual = auto: the rule of `keeps_residual`, under which the residual options
    # are on and a delayed round starts at own_payload; without it a delayed round starts at eager when the outer
    # step has no SGD momentum, else at keep_local (also for a blocking sync, which merges nothing).
    merge: MergeChoice = "auto"
    """Where a delayed round starts; auto: own_payload if residuals kept, eager if no SGD momentum, else keep_local"""
    local_residual: bool | Auto = "auto"
    """Keep 1/C of the codec's error-feedback residual in the cluster's parameters; auto: see merge's rule"""
    drain_residual: bool | Auto = "auto"
    """After the last step send what every codec holds back, dense int4; auto: as local_residual, sgd, aggregate mean"""
    fragments: int = 1
    """Streaming DiLoCo: sync the stage as this many parameter fragments at staggered steps (1: all at once)."""
    aggregate: Aggregate = "mean"
    """mean, trimmed_mean, median or norm_clip (the robust ones need a codec with compression.reduction = gather)."""
    trim_fraction: float = 0.25
    """aggregate = trimmed_mean: the share of the largest and of the smallest values dropped per coordinate."""
    min_clusters: int | Auto = "auto"
    """Fewest clusters a round may have before the run stops; auto: all of them (static), 1 (topology.elastic)."""
    outer: OuterConfig = field(default_factory=OuterConfig)
    """The outer optimizer of phi and its learning-rate schedule."""
    guard: GuardConfig = field(default_factory=GuardConfig)
    """The per-round numeric guard and the peer check (docs/design.md §4.5)."""
    round: RoundConfig = field(default_factory=RoundConfig)
    """What makes a round, H inner steps or a time budget, and fit_link's H."""

    @property
    def has_outer_loop(self) -> bool:
        return self.kind in OUTER_LOOP_KINDS

    def keeps_residual(self, compression: Any) -> bool:
        """The rule of the auto residual options: `local_residual`, `drain_residual` (with an outer SGD) and the merge
        `own_payload` (under the delay) are on when the codec holds an error-feedback residual back (`holds_back`) and
        the outer step has no SGD momentum: with plain averaging they took the dilocox presets from +7.44% to +6.23%
        (docs/results.md); with the paper's SGD 0.7 / Nesterov 0.9 keep_local measured best and the residual stays
        with the codec. Elastic runs keep them too: a cluster healed from a peer starts its residual afresh."""
        momentum = self.outer.optimizer == "sgd" and self.outer.momentum > 0
        return self.has_outer_loop and holds_back(compression) and not momentum

    def resolved(self, compression: Any) -> SyncConfig:
        """A copy with every auto option set by its rule, from the codec `compression` (a `CompressionConfig`);
        values set explicitly are kept as they are (`validate` and the compatibility table judge them).
        `min_clusters` needs the topology: `Config.resolve` sets it."""
        cfg = copy.deepcopy(self)
        delayed = self.has_outer_loop and cfg.sync_delay == 1
        keeps = cfg.keeps_residual(compression)
        if cfg.outer.lr == AUTO:
            cfg.outer.lr = OUTER_LR.get(cfg.outer.optimizer, OUTER_LR["sgd"])  # an unknown name: validate() says so
        if cfg.local_residual == AUTO:
            cfg.local_residual = keeps
        if cfg.drain_residual == AUTO:  # a robust statistic of the residuals hurt (docs/results.md, robust aggregates)
            cfg.drain_residual = keeps and cfg.outer.optimizer == "sgd" and cfg.aggregate == "mean"
        if cfg.merge == AUTO:  # eager beat keep_local by 1.3 points with plain averaging (docs/results.md)
            momentum = cfg.outer.optimizer == "sgd" and cfg.outer.momentum > 0
            cfg.merge = "keep_local" if not delayed or momentum else "own_payload" if keeps else "eager"
        if cfg.overlap_steps == AUTO:
            lands_inside = delayed and compression.kind in SPARSE_KINDS and not cfg.round.fit_link
            if lands_inside and cfg.round.mode == "steps" and isinstance(cfg.inner_steps, int):
                cfg.overlap_steps = max(0, min(cfg.inner_steps - 1, math.floor(OVERLAP_SHARE * cfg.inner_steps + 0.5)))
            else:
                cfg.overlap_steps = 0
        if cfg.round.fit_link_max_steps == AUTO:
            cfg.round.fit_link_max_steps = FIT_LINK_RANGE * cfg.inner_steps
        return cfg

    def validate(self) -> None:
        """Raise ValueError naming the first impossible value of `[sync]` (and of its sub-sections) and how to fix it
        (auto values are judged once resolved; pairs of options that do not work together: `dilocox.compat`)."""
        check_types("sync", self)  # also every choice: kind, merge, aggregate, ...
        self.outer.validate()
        self.guard.validate()
        check_positive("sync", self, "inner_steps", "fragments")
        self.round.validate(self.inner_steps)
        if self.sync_delay not in (0, 1):
            raise ValueError(f"sync.sync_delay = {self.sync_delay} must be 0 (blocking) or 1 (one-step-delay overlap)")
        if not 0.0 < self.trim_fraction < 0.5:
            raise ValueError(
                f"sync.trim_fraction = {self.trim_fraction} must be in (0, 0.5): the share of the largest and of the "
                "smallest values dropped per coordinate (0.25 drops one of four clusters at each end)"
            )
        if self.overlap_steps != AUTO:
            check_non_negative("sync", self, "overlap_steps")
            shortest = max(1, self.inner_steps // self.fragments) if self.sync_delay == 0 else self.inner_steps
            if self.overlap_steps >= shortest:
                what = "sync.inner_steps ="
                if self.fragments > 1 and self.sync_delay == 0:
                    what = "a fragment's shortest round, H // sync.fragments ="
                fix = "blocking" if self.sync_delay == 0 else "each average applied at the end of the next round"
                raise ValueError(
                    f"sync.overlap_steps = {self.overlap_steps} must be below {what} {shortest}: a sync launched that "
                    f"many steps before its boundary or applied that many into the next round; use 0 ({fix}), or auto"
                )
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"sync.alpha = {self.alpha} must be between 0 and 1: lerp(phi, live, alpha) when it lands")
        if self.fragments > self.inner_steps and self.has_outer_loop:
            raise ValueError(
                f"sync.fragments = {self.fragments} is more than sync.inner_steps = {self.inner_steps}: fragment k "
                f"syncs at offset k x H / fragments, so each needs a step of its own; use sync.fragments <= "
                f"{self.inner_steps}"
            )


def holds_back(compression: Any) -> bool:
    """Whether the codec keeps an error-feedback residual, what `sync.local_residual` keeps a share of."""
    return compression.kind != "none" and compression.error_feedback
