"""`OuterSync`: the outer loop of DiLoCo and DiLoCoX for a training loop you write yourself (docs/api.md).

    with OuterSync(model, inner_optimizer, cluster_group=group, inner_steps=50, compression="int4") as sync:
        for x, y in data:
            loss_fn(model(x), y).backward(); inner_optimizer.step(); inner_optimizer.zero_grad()
            sync.step()         # every H-th step: launch this round's sync, apply the one that is due

It is a facade over `DiLoCoSync` (the round, the delay, the reducers: docs/design.md §3-§4) and a `WanChannel`
(§5). `build_sync` returns the same class to the CLI's trainer (`OuterSync.from_configs`), so a user's loop and
`dilocox train` run one implementation; what this module adds is only what a user's loop lacks: a step counter,
keyword arguments with the strategies' defaults, the dp mean hooked to the inner optimizer, checks of the
arguments and of the clusters' starting point, and a context manager that flushes. Its keyword arguments start from
the `[sync]` and `[compression]` of the preset of `kind` (`dilocox`: what `dilocox train` runs), and its configs
resolve and meet the compatibility table (`dilocox.compat`) as `dilocox train`'s do.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.distributed as dist

from dilocox.compress import CompressionConfig
from dilocox.compress.config import CODEC_KINDS
from dilocox.elastic.membership import ElasticMembership
from dilocox.net.channel import PendingTransfer, WanChannel
from dilocox.net.link import parse_bandwidth, parse_duration
from dilocox.sync.allreduce import allreduce_bytes_per_step
from dilocox.sync.base import RoundStats, SyncStatus, clear_non_finite_state
from dilocox.sync.config import OUTER_LOOP_KINDS, SyncConfig
from dilocox.sync.diloco import DiLoCoSync
from dilocox.sync.faults import FaultConfig
from dilocox.sync.outer_optimizer import OuterOptimizerFactory
from dilocox.sync.replica import StageMirror, Told
from dilocox.sync.rounds import TokenWeights
from dilocox.topology import group_size

RESUME_SETTINGS = {
    "kind": "kind",
    "inner_steps": "inner_steps",
    "sync_delay": "sync_delay",
    "outer_lr": "outer.lr",
    "outer_momentum": "outer.momentum",
    "nesterov": "outer.nesterov",
}
"""`SyncConfig` fields a saved state overrides (H, the outer optimizer's settings) or depends on (the delay), so
`load_state_dict` refuses a state saved with other values instead of silently keeping the saved ones: by the name the
state records each under (this class's keyword argument), the field's path in `SyncConfig`."""
_FINGERPRINT_VALUES = 4096
"""Parameter values (evenly strided) hashed into the fingerprint that checks the clusters start alike."""


class OuterSync:
    """DiLoCo's outer sync around a model you train yourself (Douillard et al. 2023, arXiv 2311.08105), with
    DiLoCoX's one-step delay and compressed pseudo-gradients (Qi et al. 2025, arXiv 2506.21263).

    Every `inner_steps` (H) calls of `step()` a round ends: the pseudo-gradient `round start - params` is averaged
    over `cluster_group` (the slow link, through a `WanChannel`) and applied to the outer params by the outer
    optimizer: an SGD by default, `"adamw"`, or any `torch.optim.Optimizer` that `outer_optimizer`, a factory, builds
    from the list it is given (the outer params, one flat fp32 tensor that this object creates).
    With `sync_delay = 1` round t's average travels while round t+1 trains and is applied at the end of round t+1;
    `flush()` (also on leaving the `with` block without an exception) ends the round in progress, waits for what
    is in flight and sets every cluster to the same parameters.

        with OuterSync(model, inner_optimizer, cluster_group=cluster_group, inner_steps=50) as sync:
            ...; inner_optimizer.step(); sync.step()      # the RoundStats of the sync applied, or None
        # here every cluster holds the same parameters

    `kind` is a preset (`dilocox/presets/KIND.toml`): the keyword arguments left at None take its `[sync]` and
    `[compression]` values, then the fields' (auto) rules. `dilocox` is what `dilocox train` runs: H = 12, delayed,
    top-k int4 at density 0.05, plain averaging, and by the auto rules the average landing 7 steps into the next
    round, the `own_payload` merge, `local_residual` and `drain_residual` (each `flush()` then also sends what the
    codec still holds back, one dense int4 payload: flush at the end, not to peek); `diloco` is blocking, fp32, SGD
    lr 0.7 with Nesterov 0.9, H = 50. `dp_group` (the
    data-parallel replicas of this model inside the cluster) gets the gradient mean before every inner step, from a
    pre-step hook on `inner_optimizer` unless `reduce_gradients()` was called since the last one, and shares the
    cluster's uplink: each replica sends 1/D of the pseudo-gradient.

    Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512): `fragments = N` syncs the model in N contiguous
    parts, fragment k at (k + 1) H // N and every H steps after; with `sync_delay = 0`, `overlap_steps = tau` launches
    each sync tau steps before its boundary and `alpha` leaves the live parameters at lerp(phi, live, alpha) once it
    lands (`sync.overlap_steps`, `sync.alpha`). `guard` turns the numeric guard off or on (docs/design.md §4.5).
    """

    def __init__(
        self,
        model_or_params: torch.nn.Module | Iterable[torch.Tensor],
        inner_optimizer: torch.optim.Optimizer,
        *,
        cluster_group: dist.ProcessGroup | None,
        inner_steps: int | None = None,
        kind: str = "dilocox",
        compression: str | CompressionConfig | None = None,
        sync_delay: int | None = None,
        overlap_steps: int | None = None,
        outer_optimizer: str | OuterOptimizerFactory | None = None,
        outer_lr: float | None = None,
        outer_momentum: float | None = None,
        nesterov: bool | None = None,
        merge: str | None = None,
        local_residual: bool | None = None,
        drain_residual: bool | None = None,
        fragments: int | None = None,
        alpha: float | None = None,
        guard: bool | None = None,
        dp_group: dist.ProcessGroup | None = None,
        bandwidth: str | None = None,
        latency: str = "0",
        seed: int = 0,
    ) -> None:
        params = _parameters(model_or_params)
        _check_optimizer(inner_optimizer, params)
        _check_group("cluster_group", cluster_group)
        _check_group("dp_group", dp_group)
        _check_disjoint(cluster_group, dp_group)
        factory = _outer_optimizer_argument(outer_optimizer, outer_lr=outer_lr, outer_momentum=outer_momentum,
                                            nesterov=nesterov)  # fmt: skip
        sync, codec = outer_configs(
            kind,
            compression,
            inner_steps=inner_steps,
            sync_delay=sync_delay,
            overlap_steps=overlap_steps,
            outer_optimizer=outer_optimizer if isinstance(outer_optimizer, str) else None,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            nesterov=nesterov,
            merge=merge,
            local_residual=local_residual,
            drain_residual=False if drain_residual is None and factory is not None else drain_residual,
            fragments=fragments,
            alpha=alpha,
            guard=guard,
        )  # the drain adds at an SGD's learning rate: auto drains only under the built-in sgd
        bytes_per_s = None if bandwidth is None else parse_bandwidth(bandwidth)
        latency_s = parse_duration(latency)
        if bytes_per_s is None and latency_s:
            raise ValueError(
                f"latency = {latency!r} is only emulated together with a bandwidth: pass bandwidth too (e.g. "
                "'1Gbps'), or leave latency out on a real link"
            )
        channel = WanChannel(
            cluster_group, bandwidth=bytes_per_s, latency_s=latency_s, num_sharing=group_size(dp_group)
        )
        diloco = DiLoCoSync(params, sync, codec, channel=channel, dp_group=dp_group, seed=seed, outer_optimizer=factory)
        self._setup(diloco, owns_channel=True, inner_optimizer=inner_optimizer)
        self._start_check = _launch_start_check(self.diloco.outer_params, channel, dp_group)
        if group_size(dp_group) > 1:
            self._hook = inner_optimizer.register_step_pre_hook(self._before_inner_step)

    @classmethod
    def from_configs(
        cls,
        params: Iterable[torch.Tensor],
        sync: SyncConfig,
        compression: CompressionConfig | None = None,
        *,
        channel: WanChannel,
        dp_group: dist.ProcessGroup | None = None,
        pp_group: dist.ProcessGroup | None = None,
        agree_group: dist.ProcessGroup | None = None,
        seed: int = 0,
        total_steps: int | None = None,
        inner_optimizer: torch.optim.Optimizer | None = None,
        faults: FaultConfig | None = None,
        membership: ElasticMembership | None = None,
        outer_optimizer: OuterOptimizerFactory | None = None,
        weights: TokenWeights | None = None,
        sharded: bool = False,
        dp_reduced: bool = False,
        mirror: StageMirror | None = None,
    ) -> OuterSync:
        """Around a `channel` the caller owns (and closes), with the config dataclasses: the trainer's path
        (`build_sync`), and the one to `sync.round.fit_link` or `sync.outer.state_device`. Nothing is hooked or
        checked beyond the configs: the caller calls `reduce_gradients()` before each inner step itself, and
        the rounds also end at `total_steps`. `inner_optimizer` (optional here) gets its state reset when the
        guard heals this cluster; `faults` injects the faults of `[faults]`; `pp_group` (a pipeline's stages, each
        with its own OuterSync) makes the stages agree on what the guard leaves out; `outer_optimizer` (a factory,
        as for the constructor) replaces the one `sync.outer.optimizer` names. `weights`: how this cluster's tokens
        weigh its updates (`TokenWeights`: time rounds, clusters of different dp). `sharded`: `params` are
        FSDP shards over `dp_group` (topology.dp_mode = shard, `DiLoCoSync`); `dp_reduced`: the gradients arrive
        averaged over `dp_group` already (DDP). `mirror`: this rank is replica 0 of its stage and syncs it for the
        other replicas, which follow it (`dilocox.sync.replica`); `agree_group`: the ranks that sync, which agree on
        fit_link's H (None: every rank)."""
        if sync.kind not in OUTER_LOOP_KINDS:
            raise ValueError(f"OuterSync needs sync.kind = diloco or dilocox, not {sync.kind!r}")
        compression = compression or CompressionConfig()
        sync = sync.resolved(compression)
        check_outer(
            sync,
            compression,
            faults=faults,
            elastic=membership is not None,
            authenticated=channel.tag_bytes > 0,
        )
        diloco = DiLoCoSync(
            list(params),
            sync,
            compression,
            channel=channel,
            dp_group=dp_group,
            pp_group=pp_group,
            agree_group=agree_group,
            seed=seed,
            total_steps=total_steps,
            faults=faults,
            membership=membership,
            outer_optimizer=outer_optimizer,
            weights=weights,
            sharded=sharded,
            dp_reduced=dp_reduced,
        )
        self = cls.__new__(cls)
        self._setup(diloco, owns_channel=False, inner_optimizer=inner_optimizer)
        self.mirror = mirror
        return self

    def _setup(self, diloco: DiLoCoSync, *, owns_channel: bool, inner_optimizer: torch.optim.Optimizer | None) -> None:
        self.diloco = diloco
        """The implementation this facade drives (docs/design.md §3): the stage's fragments' rounds."""
        self.inner_optimizer = inner_optimizer
        """Its state is reset when the guard heals this cluster (None: the caller's own concern)."""
        self.sync_config = diloco.cfg
        self.compression = diloco.stage.compression
        self.channel = diloco.channel
        """The slow link: cumulative bytes and busy, exposed and hidden time in `channel.stats()`."""
        self.dp_group = self.diloco.dp_group
        self.last_round: RoundStats | None = None
        """What the last sync applied cost: bytes sent, link, exposed and hidden time, the codec's payload and rank."""
        self._owns_channel = owns_channel
        self.mirror: StageMirror | None = None
        """The stage's replicas that follow this one's sync (`dilocox.sync.replica`), or None."""
        self._start_check: PendingTransfer[list[torch.Tensor]] | None = None
        self._hook: torch.utils.hooks.RemovableHandle | None = None
        self._reduced = False  # reduce_gradients() ran since the last inner step

    # ---------------------------------------------------------------------------------------------- the loop
    def step(self) -> RoundStats | None:
        """Count one inner step (call it after `inner_optimizer.step()`); at a round's end launch this round's sync
        and apply the one that is due. Returns what the sync it applied cost, or None (no round ended, or the
        first round of a delayed sync: nothing was due yet)."""
        self._finish_start_check(compare=True)
        return self.after_inner_step(self.num_steps + 1)

    def after_inner_step(self, step: int, *, step_s: float = 0.0) -> RoundStats | None:
        """`step()` with the caller's 1-based step count and the step's training time in seconds, which time rounds
        measure each cluster's step time from (the trainer's protocol, `SyncStrategy`)."""
        with self._telling() as told:
            self.diloco.add_step_time(step_s)
            stats = told.value = self.diloco.after_inner_step(step)
            told.healed = self._reset_if_healed()
            told.wrote = self.diloco.wrote_params
        if stats is not None:
            self.last_round = stats
        return stats

    def _reset_if_healed(self) -> bool:
        """The guard reset this cluster's parameters to the agreed ones: the inner optimizer's state starts afresh
        where it is non-finite (AdamW's moments after a diverged round). Finite state is kept: a fresh AdamW's first
        rounds move 3 to 4.5 x further than its warmed-up peers' (docs/design.md §4.5), which the peer check would
        leave out again, and heal again, round after round. Returns whether the guard healed."""
        healed = self.diloco.take_healed()
        if healed:
            clear_non_finite_state(self.inner_optimizer)
        return healed

    @contextmanager
    def _telling(self) -> Iterator[Told]:
        """A call of the trainer's whose outcome (`Told`, filled in by the call) the stage's following replicas
        take after it (`StageMirror`, docs/design.md §10.1): also its error."""
        told = Told(value=None, status=None, wrote=True)
        if self.mirror is None:
            yield told
            return
        try:
            yield told
        except Exception as error:
            self.mirror.tell(Told(value=None, status=None, wrote=False, error=error))
            raise
        told.status = self.status()
        self.mirror.tell(told)

    # ---------------------------------------------------------------------------------------------- elastic runs
    def rejoin(self) -> tuple[int, str] | None:
        """Join the run before the first step: in an elastic run its quorum (`ElasticRounds.rejoin`), where a cluster
        that heals from a peer gets (step, phase) and its inner optimizer starts afresh; a static run has nothing to
        join (None). Either way the following replicas learn where the stage stands."""
        with self._telling() as told:
            elastic = self.diloco.elastic
            joined = told.value = None if elastic is None else elastic.rejoin()
        if joined is not None:
            self.num_steps = joined[0]
            if self.inner_optimizer is not None:
                self.inner_optimizer.state.clear()
        return joined

    def reduce_gradients(self) -> None:
        """Average this step's gradients over `dp_group` (a copy for a group of one): call it after backward and
        before clipping; otherwise the optimizer hook does it just before the inner step."""
        self.diloco.reduce_gradients()
        self._reduced = True

    def flush(self) -> RoundStats | None:
        """End the round in progress (if it has steps), wait for every sync in flight and apply it: afterwards
        every cluster holds the same parameters, the outer params. Training may go on from there. Returns what the
        last sync waited for cost, or None if nothing was pending."""
        stats = None
        with self._telling() as told:
            if any(self.diloco.in_progress(fragment, self.num_steps) for fragment in self.diloco.fragments):
                stats = self.diloco.end_round(self.num_steps)
                told.healed = self._reset_if_healed()
            stats = told.value = self.diloco.flush() or stats
        if stats is not None:
            self.last_round = stats
        return stats

    def close(self, *, cancel: bool = False) -> None:
        """Remove the optimizer hook and stop the channel this object built (not a `from_configs` caller's). It
        does not flush; `cancel=True` (error paths) drops transfers not yet started."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._owns_channel:
            self.channel.close(cancel=cancel)

    def __enter__(self) -> OuterSync:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc_type is not None:
            self.close(cancel=True)
            return
        try:
            self.flush()
        except BaseException:
            self.close(cancel=True)
            raise
        self.close()

    # ---------------------------------------------------------------------------------------------- the protocol
    @property
    def name(self) -> str:
        return self.diloco.name

    @property
    def outer_step(self) -> int:
        """Rounds ended, each one's sync launched. With `sync_delay = 1` the last one's average is still on its way
        (it is applied at the end of the next round, or by `flush()`): `outer_step - 1` averages have been applied
        then, and after `flush()` all of them."""
        return self.diloco.outer_step

    @property
    def allreduce_equiv_bytes(self) -> int:
        """Bytes an AllReduce of the same inner steps (an fp32 gradient all-reduce over `cluster_group` every step,
        sharded over `dp_group` as this sync is) would have put on the slow link from this rank: the yardstick of
        `dilocox train`'s summary ("AllReduce would send"); what this sync sent is `channel.bytes_sent`."""
        channel = self.channel
        per_step = allreduce_bytes_per_step(
            self.diloco.numel, dp_group=self.dp_group, clusters=channel.world_size, position=channel.group_rank
        )
        return self.num_steps * per_step

    @property
    def warnings(self) -> list[str]:
        """Messages for the user (the link cannot keep up, the guard's verdicts); pop and print them."""
        return self.diloco.warnings

    @property
    def outer_params(self) -> torch.Tensor:
        """phi, the outer params (numel,) fp32: the same on every cluster after each outer step."""
        return self.diloco.outer_params

    def status(self) -> SyncStatus:
        """Where the outer loop stands after the last step (`SyncStatus`: the trainer's view of it)."""
        return self.diloco.status()

    @property
    def num_steps(self) -> int:
        """Inner steps taken (the step of the last `step()` or `after_inner_step(step)`)."""
        return self.diloco.step

    @num_steps.setter
    def num_steps(self, step: int) -> None:
        self.diloco.step = step

    def agreed_model(self) -> AbstractContextManager[bool]:
        """Inside it the model holds phi, the parameters every cluster agrees on (evaluate the model there); its
        own parameters come back on exit."""
        return self.diloco.agreed_model()

    # ---------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The outer state (docs/design.md §3), the step count, the link's counters and the settings that resuming
        needs. A sync in flight is not waited for: what this rank sent is saved and sent again by
        `load_state_dict`. Save the model's and the inner optimizer's state beside it."""
        return {
            **self.diloco.state_dict(),
            "num_steps": self.num_steps,
            "channel": self.channel.state_dict(),
            "settings": self._resume_settings(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()`. Every cluster must call it at the same point (a sync that was in flight is
        sent again over the slow link), on an object built with the same settings."""
        if not isinstance(state, dict) or not {"fragments", "outer_params"} & state.keys():
            keys = sorted(state)[:5] if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"load_state_dict takes what OuterSync.state_dict() returned, got {keys}")
        missing = [key for key in ("num_steps", "channel", "settings") if key not in state]
        if missing:
            raise ValueError(
                f"this outer-sync state lacks {', '.join(missing)}: load_state_dict takes what OuterSync.state_dict() "
                "of this version returned"
            )
        self._check_settings(state["settings"])
        self._finish_start_check(compare=False)  # the saved state, not the constructor's model, is the start now
        # the counters first: the sync decides from them how to send a saved transfer again
        self.channel.load_state_dict(state["channel"])
        self.diloco.load_state_dict(state)
        self.num_steps = int(state["num_steps"])

    def _check_settings(self, saved: dict[str, Any]) -> None:
        mine = self._resume_settings()
        changed = [
            f"{name} = {saved.get(name)!r} (now {value!r})" for name, value in mine.items() if saved.get(name) != value
        ]
        if saved.get("fragments", 1) != self.sync_config.fragments:  # saved without the key: one fragment
            changed.append(f"fragments = {saved.get('fragments', 1)!r} (now {self.sync_config.fragments!r})")
        if changed:
            raise ValueError(
                f"this outer-sync state was saved with {', '.join(changed)}: resume with the settings it was saved "
                "with (the saved outer optimizer and round would silently override the new ones)"
            )

    def _resume_settings(self) -> dict[str, Any]:
        """The settings a saved state must be resumed with (`RESUME_SETTINGS` and the codec)."""
        fragments = {"fragments": self.sync_config.fragments} if self.sync_config.fragments > 1 else {}
        return (
            {
                name: functools.reduce(getattr, path.split("."), self.sync_config)
                for name, path in RESUME_SETTINGS.items()
            }
            | {"compression": self.compression.kind}
            | fragments
        )

    # ---------------------------------------------------------------------------------------------- internals
    def _before_inner_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._reduced:
            self.diloco.reduce_gradients()
        self._reduced = False

    def _finish_start_check(self, *, compare: bool) -> None:
        """Wait for the fingerprints launched at construction; with `compare`, refuse clusters that start apart."""
        if self._start_check is None:
            return
        pending, self._start_check = self._start_check, None
        fingerprints = [tuple(int(v) for v in f.tolist()) for f in pending.wait() if f is not None]
        if compare:
            _check_same_start(fingerprints, "cluster_group", "clusters")


def outer_configs(
    kind: str, compression: str | CompressionConfig | None = None, **sync_options: Any
) -> tuple[SyncConfig, CompressionConfig]:
    """The resolved, checked configs of `OuterSync`'s keyword arguments: the `[sync]` and `[compression]` of the
    preset of `kind`, then the arguments that are not None (a codec name replaces the preset's codec kind; a
    `CompressionConfig` replaces its whole section), then the auto rules (`SyncConfig.resolved`), then the
    compatibility table."""
    from dilocox.config import (
        MOVED_KEYS,
        Config,
        apply_toml,
        flat_settings,
        keep_preset_optimizer,
        read_preset,
        section_of,
    )

    if kind not in OUTER_LOOP_KINDS:
        per_step = " (allreduce and cocktail sync every step: in your own loop use DistributedDataParallel)"
        raise ValueError(
            f"kind = {kind!r} is not an outer-loop strategy; use 'dilocox' (the dilocox preset: one-step delay, "
            f"top-k int4) or 'diloco' (blocking, fp32)" + (per_step if kind in ("allreduce", "cocktail") else "")
        )
    inner_steps = sync_options.get("inner_steps")
    if inner_steps is not None and (
        isinstance(inner_steps, bool) or not isinstance(inner_steps, int) or inner_steps < 1
    ):
        raise ValueError(f"inner_steps = {inner_steps!r} must be an int >= 1: H, the inner steps between outer syncs")
    values = read_preset(kind)
    cfg = apply_toml(Config(), {section: values[section] for section in ("sync", "compression") if section in values})
    preset_keys = {name for name in flat_settings(values) if name.startswith("sync.")}
    if isinstance(compression, str):
        if compression not in CODEC_KINDS:
            raise ValueError(f"compression = {compression!r} is not a codec; use one of: {', '.join(CODEC_KINDS)}")
        cfg.compression.kind = compression
    elif isinstance(compression, CompressionConfig):
        cfg.compression = dataclasses.replace(compression)  # the caller's object is never changed
    elif compression is not None:
        raise ValueError(
            f"compression = {compression!r} must be a codec name ({', '.join(CODEC_KINDS)}) or a CompressionConfig"
        )
    # the keyword arguments are flat: outer_lr is sync.outer.lr, guard sync.guard.enabled (`MOVED_KEYS`)
    given = {
        MOVED_KEYS.get(f"sync.{name}", f"sync.{name}"): value
        for name, value in sync_options.items()
        if value is not None
    }
    for option, value in given.items():
        section, _, key = option.rpartition(".")
        setattr(section_of(cfg, section), key, value)
    keep_preset_optimizer(cfg, values, preset_keys - set(given))
    cfg.sync.validate()  # the arguments' own values first, named as given
    cfg.compression.validate()
    cfg.sync = cfg.sync.resolved(cfg.compression)
    check_outer(cfg.sync, cfg.compression)
    return cfg.sync, cfg.compression


def check_outer(
    sync: SyncConfig,
    compression: CompressionConfig,
    *,
    faults: FaultConfig | None = None,
    elastic: bool = False,
    authenticated: bool = False,
) -> None:
    """`sync` and `compression` (resolved) with what the caller runs them in (`authenticated`: a channel that tags
    its payloads), checked as `Config.validate` checks a run: each section's values, then the compatibility table
    (`dilocox.compat`)."""
    from dilocox import compat
    from dilocox.config import Config, NetworkConfig, TopologyConfig

    sync.validate()
    compression.validate()
    topology = TopologyConfig(elastic=elastic)
    sync = dataclasses.replace(sync, min_clusters="auto")  # the trainer's membership reads it, not this object
    network = NetworkConfig(auth_key_file="(the channel's key)" if authenticated else "")
    compat.check(
        Config(sync=sync, compression=compression, faults=faults or FaultConfig(), topology=topology, network=network)
    )


def _outer_optimizer_argument(
    outer_optimizer: Any, *, outer_lr: float | None, outer_momentum: float | None, nesterov: bool | None
) -> OuterOptimizerFactory | None:
    """The factory of a callable `outer_optimizer` (None for a name, which `outer_configs` takes, or for None). The
    built-in optimizers' keyword arguments do not reach a factory, so passing both is refused."""
    if outer_optimizer is None or isinstance(outer_optimizer, str):
        return None
    if isinstance(outer_optimizer, torch.optim.Optimizer) or not callable(outer_optimizer):
        raise ValueError(
            f"outer_optimizer must be 'sgd', 'adamw' or a callable that builds a torch.optim.Optimizer from the list "
            f"it is given (the outer params, a flat fp32 tensor that OuterSync creates), e.g. lambda params: "
            f"torch.optim.Adam(params, lr=0.01); got {type(outer_optimizer).__name__}"
        )
    given = [name for name, value in (("outer_lr", outer_lr), ("outer_momentum", outer_momentum),
                                      ("nesterov", nesterov)) if value is not None]  # fmt: skip
    if given:
        raise ValueError(
            f"{', '.join(given)} configure the built-in outer optimizers; with your own outer_optimizer set them in "
            "its factory (e.g. lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9))"
        )
    return outer_optimizer


def _parameters(model_or_params: Any) -> list[torch.Tensor]:
    if isinstance(model_or_params, torch.nn.Module):
        params = list(model_or_params.parameters())
    elif isinstance(model_or_params, torch.Tensor | dict | str) or not isinstance(model_or_params, Iterable):
        raise ValueError(
            f"model_or_params must be an nn.Module or an iterable of its parameters (model.parameters()), got "
            f"{type(model_or_params).__name__}"
        )
    else:
        params = list(model_or_params)
        wrong = [type(p).__name__ for p in params if not isinstance(p, torch.Tensor)]
        if wrong:
            raise ValueError(
                f"model_or_params holds {wrong[0]}, not parameters: pass model.parameters() (not named_parameters() "
                "or a state_dict)"
            )
    if not any(p.requires_grad for p in params):
        raise ValueError("model_or_params has no parameter that requires grad: there is nothing to train or sync")
    return params


def _check_optimizer(inner_optimizer: Any, params: list[torch.Tensor]) -> None:
    if not isinstance(inner_optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"inner_optimizer must be a torch.optim.Optimizer over the model's parameters, got "
            f"{type(inner_optimizer).__name__}"
        )
    synced = {id(p) for p in params if p.requires_grad}  # frozen parameters never change: nothing to sync
    optimized = {id(p) for group in inner_optimizer.param_groups for p in group["params"]}
    missing, extra = len(synced - optimized), len(optimized - {id(p) for p in params})
    if missing or extra:
        raise ValueError(
            f"inner_optimizer must step exactly the synced parameters: it misses {missing} of them and holds {extra} "
            "others; build it from the same model.parameters() (clusters would drift apart otherwise)"
        )


def _check_group(name: str, group: Any) -> None:
    if group is None:
        return
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"this rank is not a member of {name}: every rank passes the group that contains it "
            "(dist.new_group returns a placeholder to the ranks outside a group)"
        )
    if not isinstance(group, dist.ProcessGroup):
        role = (
            "the ranks that hold this model in the other clusters (one rank per cluster)"
            if name == "cluster_group"
            else "this model's data-parallel replicas inside the cluster"
        )
        raise ValueError(
            f"{name} must be a torch.distributed ProcessGroup of {role}, e.g. dist.new_group(ranks), or None; got "
            f"{type(group).__name__}"
        )


def _check_disjoint(cluster_group: dist.ProcessGroup | None, dp_group: dist.ProcessGroup | None) -> None:
    if cluster_group is None or dp_group is None:
        return
    shared = set(dist.get_process_group_ranks(cluster_group)) & set(dist.get_process_group_ranks(dp_group))
    if shared != {dist.get_rank()}:
        raise ValueError(
            f"cluster_group and dp_group share ranks {sorted(shared)}: they must meet only in this rank "
            "(cluster_group: one rank per cluster across the slow link; dp_group: the replicas inside this cluster)"
        )


def _fingerprint(outer_params: torch.Tensor) -> torch.Tensor:
    """(2,) int64: the parameter count and a hash of evenly strided values (bit for bit)."""
    sample = outer_params[:: max(1, outer_params.numel() // _FINGERPRINT_VALUES)].detach().cpu()
    digest = hashlib.blake2b(sample.numpy().tobytes(), digest_size=8).digest()
    return torch.tensor([outer_params.numel(), int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)


def _launch_start_check(
    outer_params: torch.Tensor, channel: WanChannel, dp_group: dist.ProcessGroup | None
) -> PendingTransfer[list[torch.Tensor]]:
    """DiLoCo needs every replica to start from the same parameters (the trainer builds them from one seed). A
    user's model is checked: at once over the fast dp_group, and over the slow link in the background (not counted
    as payload), compared at the first step unless a loaded state replaces the start."""
    fingerprint = _fingerprint(outer_params)
    if group_size(dp_group) > 1:
        gathered = [torch.empty_like(fingerprint) for _ in range(group_size(dp_group))]
        dist.all_gather(gathered, fingerprint, group=dp_group)
        _check_same_start([tuple(int(v) for v in f.tolist()) for f in gathered], "dp_group", "data-parallel replicas")
    return channel.launch_all_gather(fingerprint, account=False)


def _check_same_start(fingerprints: list[tuple[int, ...]], group: str, members: str) -> None:
    if len({numel for numel, _ in fingerprints}) > 1:
        counts = ", ".join(f"{numel:,}" for numel, _ in fingerprints)
        raise ValueError(
            f"the {members} of {group} sync different numbers of parameter values ({counts}): each must pass the "
            "same model"
        )
    if len(set(fingerprints)) > 1:
        raise ValueError(
            f"the {members} of {group} start from different parameters: build the model with the same seed on every "
            "rank (torch.manual_seed before constructing it) or load the same weights before building OuterSync"
        )
