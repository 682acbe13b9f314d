"""`[faults]`: injected faults, to see what the guard and the robust aggregation do (docs/design.md §4.5).

One cluster misbehaves in chosen outer rounds, as a broken or a malicious cluster would. Never set it for a
run whose model you want; it exists for tests, the fault benchmark and users who check their own settings.

| `faults.kind` | what cluster `faults.cluster` does in the chosen rounds |
| --- | --- |
| `diverge` | its own training goes non-finite at the round's start (parameters set to NaN): an honest failure |
| `nan` | sends a pseudo-gradient of NaN |
| `scale` | sends its pseudo-gradient times `faults.scale` |
| `random` | sends Gaussian noise of its pseudo-gradient's norm |
| `sign` | sends its pseudo-gradient negated |
| `forge` | sends its payloads under a tag that does not verify, as a forger without the key would (needs a key) |

The lying kinds (all but `diverge`) change only what is sent: the cluster's own parameters follow the honest
update, so its next pseudo-gradients are normal again.

The lying kinds are a wrapper around the cluster's reducer (`FaultyReducer`): `forge` hands the channel a key no
cluster holds (`FORGER`) for the next payload it seals (`WanChannel.sign_next_with`), the others change the values
sent; `diverge` acts on the parameters, where the outer loop asks `diverges` at the first step of each round.

Slow clusters (`faults.slow_clusters`, e.g. `{2 = 2.0}`) make heterogeneity measurable on one machine, independently
of `faults.kind`: with `faults.slow_mode = "sleep"` every inner step of such a cluster takes factor x longer for real
(its ranks sleep (factor - 1) x the step's measured compute time after it); with `"virtual"` nothing sleeps and the
time-round clock (`sync.round.mode = "time"`, `dilocox.sync.rounds`) counts each of its steps as exactly factor
units, so schedules are deterministic.

    faults = FaultConfig(cluster=3, kind="scale", rounds="2-4")
    faults.active(cluster=3, round_index=3)          # True
    sent = faults.corrupt(pseudo_grad, round_index=3)
    reducer = FaultyReducer(reducer, faults, channel=channel, cluster=1, round_index=lambda: sync.outer_step + 1)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

from dilocox.checks import check_types
from dilocox.net.auth import MIN_KEY_BYTES, PayloadAuth

if TYPE_CHECKING:
    import torch

    from dilocox.net.channel import WanChannel
    from dilocox.sync.reducers import PendingMean, Reducer

FaultKind = Literal["none", "diverge", "nan", "scale", "random", "sign", "forge"]
"""Every `faults.kind` (the table above)."""
FAULT_KINDS: tuple[str, ...] = get_args(FaultKind)
SlowMode = Literal["sleep", "virtual"]
"""How a slow cluster is slow (`faults.slow_mode`): it sleeps for real, or only the time-round clock counts it slow."""
FORGER = PayloadAuth(b"dilocox/faults/a-key-no-cluster-holds".ljust(MIN_KEY_BYTES))
"""faults.kind = forge: what a forger without the shared key tags its payloads with, a key no cluster holds."""


@dataclass
class FaultConfig:
    kind: FaultKind = "none"
    """none, diverge, nan, scale, random, sign or forge (see the table above)."""
    cluster: int = 0
    """The misbehaving cluster (0-based)."""
    rounds: str = "2-"
    """Outer rounds (1-based) in which it misbehaves: "3", "2-5", "2-" (every round from the 2nd) or "3,10-12,40-"."""
    scale: float = 1000.0
    """kind = scale: the factor."""
    slow_clusters: dict = field(default_factory=dict)
    """Clusters slower than the rest, cluster -> factor >= 1: {2 = 2.0} (flag: --faults.slow_clusters=2:2.0,1:1.5)."""
    slow_mode: SlowMode = "sleep"
    """slow_clusters: sleep (each step really takes factor x longer) or virtual (only time rounds count it)."""

    def validate(self, num_clusters: int | None = None) -> None:
        """Raise ValueError naming the first impossible setting of `[faults]` and how to fix it."""
        check_types("faults", self)  # also faults.kind, a choice
        self.round_ranges()
        if self.cluster < 0 or (num_clusters is not None and self.cluster >= num_clusters):
            limit = f" < topology.num_clusters = {num_clusters}" if num_clusters is not None else ""
            raise ValueError(f"faults.cluster = {self.cluster} must be >= 0{limit}")
        self.slow_factors(num_clusters)

    def slow_factors(self, num_clusters: int | None = None) -> dict[int, float]:
        """`slow_clusters` as {cluster: factor}, checked: clusters are ints in [0, num_clusters), factors >= 1."""
        factors: dict[int, float] = {}
        for key, value in self.slow_clusters.items():
            try:
                cluster = int(key)
            except (TypeError, ValueError):
                cluster = -1
            limit = f" < topology.num_clusters = {num_clusters}" if num_clusters is not None else ""
            if cluster < 0 or (num_clusters is not None and cluster >= num_clusters) or isinstance(key, bool):
                raise ValueError(
                    f"faults.slow_clusters names cluster {key!r}, which is not a cluster: use 0 <= cluster{limit}, "
                    "e.g. {2 = 2.0}"
                )
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 1:
                raise ValueError(
                    f"faults.slow_clusters = {{{key} = {value!r}}}: a factor must be a number >= 1 (2.0: every step "
                    "of that cluster takes twice as long)"
                )
            factors[cluster] = float(value)
        return factors

    def slow_factor(self, cluster: int) -> float:
        """How many times slower than an unslowed cluster `cluster` is (1.0: not slowed)."""
        return self.slow_factors().get(cluster, 1.0)

    def round_ranges(self) -> list[tuple[int, int | None]]:
        """(first, last) of each comma-separated part of `rounds`, last None for an open range."""
        ranges = []
        for part in self.rounds.split(","):
            first, dash, last = part.strip().partition("-")
            try:
                start = int(first)
                end = (int(last) if last.strip() else None) if dash else start
            except ValueError:
                raise ValueError(
                    f"faults.rounds = {self.rounds!r} must be rounds, ranges or an open range, separated by commas, "
                    "e.g. '3', '2-5', '2-' or '3,10-12,40-'"
                ) from None
            if start < 1 or (end is not None and end < start):
                raise ValueError(f"faults.rounds = {self.rounds!r}: rounds count from 1 and a range must not be empty")
            ranges.append((start, end))
        return ranges

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    def active(self, *, cluster: int, round_index: int) -> bool:
        """Whether `cluster` misbehaves in outer round `round_index` (1-based)."""
        if not self.enabled or cluster != self.cluster:
            return False
        return any(start <= round_index and (end is None or round_index <= end) for start, end in self.round_ranges())

    def corrupt(self, pseudo_grad: torch.Tensor, *, round_index: int) -> torch.Tensor:
        """What a lying cluster sends instead of `pseudo_grad` (a new tensor; `pseudo_grad` is not changed)."""
        import torch  # here: the config half of this module is read without torch (`dilocox train --help`)

        if self.kind == "nan":
            return torch.full_like(pseudo_grad, float("nan"))
        if self.kind == "scale":
            return pseudo_grad * self.scale
        if self.kind == "sign":
            return -pseudo_grad
        if self.kind == "random":
            generator = torch.Generator().manual_seed(round_index)
            noise = torch.randn(pseudo_grad.shape, generator=generator).to(pseudo_grad.device)
            return noise * (pseudo_grad.norm() / noise.norm().clamp_min(1e-30))
        raise ValueError(f"faults.kind = {self.kind!r} does not change the values sent")

    def diverges(self, *, cluster: int, round_index: int) -> bool:
        """Whether `cluster`'s own training goes non-finite at the start of round `round_index` (kind diverge)."""
        return self.kind == "diverge" and self.active(cluster=cluster, round_index=round_index)

    @property
    def lies(self) -> bool:
        """Whether the kind changes what the cluster sends (every kind but none and diverge)."""
        return self.enabled and self.kind != "diverge"


class FaultyReducer:
    """A reducer whose cluster lies in the rounds `faults` chooses: what it launches is `faults.corrupt`ed (nan,
    scale, random, sign) or goes out under a forged tag (forge); everything else is the wrapped reducer's. A payload
    sent again (a resumed run's sync in flight) is sent as it was, lie included.

        reducer = FaultyReducer(build_reducer(...), FaultConfig(kind="sign", cluster=1), channel=channel, cluster=1,
                                round_index=lambda: sync.outer_step + 1)
    """

    def __init__(
        self,
        reducer: Reducer,
        faults: FaultConfig,
        *,
        channel: WanChannel,
        cluster: int,
        round_index: Callable[[], int],
    ) -> None:
        self.reducer = reducer
        self.faults = faults
        self.channel = channel
        self.cluster = cluster
        """This cluster's index in the run (not its rank in a quorum)."""
        self.round_index = round_index
        """The round (1-based) a launch belongs to."""

    def launch(self, pseudo_grad: torch.Tensor) -> PendingMean:
        round_index = self.round_index()
        if self.faults.active(cluster=self.cluster, round_index=round_index):
            if self.faults.kind == "forge":  # the values are honest, their tag is not
                if not self.channel.tag_bytes:
                    raise ValueError("faults.kind = 'forge' needs network.auth_key_file: without it no tag is sent")
                self.channel.sign_next_with(FORGER)
            else:
                pseudo_grad = self.faults.corrupt(pseudo_grad, round_index=round_index)
        return self.reducer.launch(pseudo_grad)

    def __getattr__(self, name: str) -> Any:
        """Every other member of the `Reducer` protocol is the wrapped reducer's."""
        return getattr(self.__dict__["reducer"], name)
