"""Which options work together: the one table of refused pairs, applied to a resolved config before anything starts.

A row names two options' values that do not work together, why, and the fix; `check` raises the first row a config
meets as one line. The parts declare what they can do (`sums_in_transit`, `holds_back`, `Feature`s such as "an outer
loop" or "clusters of different data-parallel degree"), and rows read those declarations. `Config.validate` and
`OuterSync` apply the table; the compatibility matrix of docs/reference/configuration.md is generated from it
(`matrix_markdown`), and tests/unit/test_compat.py runs every row's example and fixes. An option left at auto never
meets a row: its rule resolves to a value that works with the rest (`SyncConfig.resolved`, `Config.resolve`).

    check(cfg)  # ValueError: sync.round.mode = 'time' does not work with sync.fragments = 4: ...; set sync.fragments=1
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dilocox.compress.config import CODEC_KINDS, SCALABLE_KINDS
from dilocox.sync.config import holds_back

Config = Any
"""A resolved `dilocox.config.Config` (not imported: config.py applies this table, and imports this module)."""


def _value(cfg: Config, option: str) -> Any:
    section, _, key = option.rpartition(".")
    return getattr(functools.reduce(getattr, section.split("."), cfg), key)


def _show(value: Any) -> str:
    """A value as a message writes it: true/false, 'text', numbers as they are."""
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, str) else str(value)


@dataclass(frozen=True)
class Feature:
    """One side of a refused pair: an option holding some values (`on`), named in a message with the config's own
    value (`said`), e.g. `sync.fragments = 4`."""

    option: str
    """The option, as the user writes it (the matrix's column)."""
    when: str
    """The values that turn the feature on, as the matrix writes them (e.g. "> 1")."""
    on: Callable[[Config], bool]
    said: Callable[[Config], str] | None = None
    """How a message names this feature in a config (default: `option = its value`)."""

    def describe(self, cfg: Config) -> str:
        return self.said(cfg) if self.said is not None else f"{self.option} = {_show(_value(cfg, self.option))}"


@dataclass(frozen=True)
class Row:
    """Two features that do not work together, why, and the fix: alternatives separated by "; ", each one or more
    assignments (`option = value`, joined by " with ") or a preset (`--preset NAME`). `example` is flags over the
    default preset that this row refuses first (its test; `{key_file}` stands for a payload key file)."""

    a: Feature
    b: Feature
    why: str
    fix: str
    example: str

    @property
    def fixes(self) -> list[list[str]]:
        """The fix's alternatives, each a list of assignments or a preset."""
        return [alternative.split(" with ") for alternative in self.fix.split("; ")]

    def applies(self, cfg: Config) -> bool:
        return self.a.on(cfg) and self.b.on(cfg)

    def message(self, cfg: Config) -> str:
        fixes = ", or ".join(" with ".join(fix) for fix in self.fixes)
        return f"{self.a.describe(cfg)} does not work with {self.b.describe(cfg)}: {self.why}; set {fixes}"


# --------------------------------------------------------------------------------------------------------------
# What the parts can do


def sums_in_transit(cfg: Config) -> bool:
    """The outer sync's reduction adds the clusters' values on the wire (the dense fp32 all-reduce of
    `compression.kind = none`, or `compression.reduction = scalable`), so no receiver sees one cluster's update: it
    cannot check a sender's tag or aggregate robustly. The gather reduction of a codec delivers every update."""
    scalable = cfg.compression.kind != "none" and cfg.compression.reduction == "scalable"
    return cfg.sync.has_outer_loop and (scalable or cfg.compression.kind == "none")


def mixed_dp(cfg: Config) -> bool:
    """Clusters of different data-parallel degrees (`topology.clusters`): replica 0 of each stage syncs it, weighted by
    its cluster's tokens."""
    return bool(cfg.topology.clusters) and len(set(_dp_degrees(cfg))) > 1


def _dp_degrees(cfg: Config) -> tuple[int, ...]:
    try:
        return cfg.topology.shape()[0]
    except ValueError:
        return ()


def _flag(option: str, on: Callable[[Any], bool], when: str) -> Feature:
    return Feature(option, when, lambda cfg: bool(on(_value(cfg, option))))


# fmt: off
PER_STEP = Feature("sync.kind", "allreduce, cocktail", lambda cfg: not cfg.sync.has_outer_loop)
"""A strategy that syncs every step: no outer rounds, no pseudo-gradients."""
ALLREDUCE = Feature("sync.kind", "allreduce", lambda cfg: cfg.sync.kind == "allreduce")
DELAY = _flag("sync.sync_delay", lambda v: v == 1, "1")
BLOCKING = _flag("sync.sync_delay", lambda v: v == 0, "0")
OVERLAP = _flag("sync.overlap_steps", lambda v: v > 0, "> 0")
ALPHA = _flag("sync.alpha", lambda v: v > 0, "> 0")
FIT_LINK = _flag("sync.round.fit_link", bool, "true")
FRAGMENTS = _flag("sync.fragments", lambda v: v > 1, "> 1")
TIME_ROUNDS = _flag("sync.round.mode", lambda v: v == "time", "time")
STEP_ROUNDS = _flag("sync.round.mode", lambda v: v == "steps", "steps")
ROUND_SECONDS = _flag("sync.round.seconds", lambda v: v > 0, "> 0")
ROBUST = _flag("sync.aggregate", lambda v: v != "mean", "trimmed_mean, median, norm_clip")
LOCAL_RESIDUAL = _flag("sync.local_residual", bool, "true")
DRAIN = _flag("sync.drain_residual", bool, "true")
OWN_PAYLOAD = Feature("sync.merge", "own_payload (sync_delay 1)",
                      lambda cfg: cfg.sync.merge == "own_payload" and cfg.sync.sync_delay == 1)
NOT_SGD = _flag("sync.outer.optimizer", lambda v: v != "sgd", "adamw")
CODEC = _flag("compression.kind", lambda v: v != "none", "a codec")
NO_RESIDUAL = Feature("compression.kind", "none, or compression.error_feedback = false",
                      lambda cfg: cfg.sync.has_outer_loop and not holds_back(cfg.compression),
                      lambda cfg: f"compression.kind = {cfg.compression.kind!r}" if cfg.compression.kind == "none"
                      else f"compression.error_feedback = false ({cfg.compression.kind})")
"""A codec that keeps no error-feedback residual: nothing is held back."""
SUMMED = Feature("compression.kind", "none, or compression.reduction = scalable", sums_in_transit,
                 lambda cfg: "compression.kind = 'none'" if cfg.compression.kind == "none"
                 else "compression.reduction = 'scalable'")
SCALABLE = Feature("compression.reduction", "scalable (with a codec)",
                   lambda cfg: cfg.compression.kind != "none" and cfg.compression.reduction == "scalable")
UNSCALABLE_CODEC = Feature("compression.kind", ", ".join(k for k in CODEC_KINDS if k not in ("none", *SCALABLE_KINDS)),
                           lambda cfg: cfg.compression.kind not in ("none", *SCALABLE_KINDS))
"""Codecs whose payloads the scalable reduction cannot sum (`SCALABLE_KINDS` can): each cluster chooses its own rank
or positions."""
FAULTS = _flag("faults.kind", lambda v: v != "none", "any but none")
FORGE = _flag("faults.kind", lambda v: v == "forge", "forge")
AUTH = Feature("network.auth_key_file", "a key file", lambda cfg: bool(cfg.network.auth_key_file),
               lambda cfg: "network.auth_key_file")
NO_AUTH = _flag("network.auth_key_file", lambda v: not v, '""')
ELASTIC = _flag("topology.elastic", bool, "true")
STATIC = _flag("topology.elastic", lambda v: not v, "false")
MIXED_DP = Feature("topology.clusters", "of different dp", mixed_dp,
                   lambda cfg: f"topology.clusters = {cfg.topology.clusters} (clusters of different data-parallel "
                   "degrees)")
SHARDED = _flag("topology.dp_mode", lambda v: v == "shard", "shard")
SOME_CLUSTERS = Feature("sync.min_clusters", "< topology.num_clusters", lambda cfg: cfg.sync.min_clusters != "auto"
                        and cfg.sync.min_clusters < cfg.topology.num_clusters)  # OuterSync's stays auto
LIGHTHOUSE = _flag("network.lighthouse", bool, "a URL")
NO_LIGHTHOUSE = _flag("network.lighthouse", lambda v: not v, '""')
ADVERTISE = _flag("network.advertise_host", bool, "an address")
NO_ADVERTISE = _flag("network.advertise_host", lambda v: not v, '""')
LOCAL_CLUSTERS = _flag("topology.local_clusters", lambda v: bool(v.strip()), "a list")
SOME_HERE = Feature("topology.local_clusters", "some of the clusters", lambda cfg: cfg.topology.elastic
                    and len(cfg.topology.launched_clusters()) < cfg.topology.num_clusters)
RESUME_ONE = _flag("checkpoint.resume", lambda v: v not in ("", "auto"), "latest, or a checkpoint")
OVERWRITE = _flag("run.overwrite", bool, "true")

ROWS: tuple[Row, ...] = (
    # per-step strategies have no outer rounds
    Row(DELAY, PER_STEP, "the one-step delay applies a round's average a round later; a per-step kind has no rounds",
        "sync.sync_delay = 0; --preset dilocox", "--preset=allreduce --sync.sync_delay=1"),
    Row(CODEC, PER_STEP, "a codec compresses the pseudo-gradients of outer rounds; allreduce sends fp32 gradients and "
        "cocktail has its own format ([cocktail])",
        "compression.kind = none; --preset dilocox", "--preset=cocktail --compression.kind=int4"),
    Row(LOCAL_RESIDUAL, PER_STEP, "it keeps a codec's residual between outer rounds",
        "sync.local_residual = false; --preset dilocox", "--preset=allreduce --sync.local_residual=true"),
    Row(DRAIN, PER_STEP, "it sends a codec's residual after the last outer round",
        "sync.drain_residual = false; --preset dilocox", "--preset=allreduce --sync.drain_residual=true"),
    Row(FRAGMENTS, PER_STEP, "fragments stagger the outer syncs of rounds",
        "sync.fragments = 1; --preset dilocox", "--preset=allreduce --sync.fragments=2"),
    Row(ROBUST, PER_STEP, "a robust aggregate combines the clusters' pseudo-gradients of a round",
        "sync.aggregate = mean; --preset dilocox", "--preset=allreduce --sync.aggregate=median"),
    Row(TIME_ROUNDS, PER_STEP, "a time round ends an outer round by the clock",
        "sync.round.mode = steps; --preset dilocox", "--preset=allreduce --sync.round.mode=time"),
    Row(FAULTS, PER_STEP, "faults are injected into outer rounds",
        "faults.kind = none; --preset dilocox", "--preset=allreduce --faults.kind=nan"),
    Row(ELASTIC, PER_STEP, "the quorum of an elastic run meets at outer-round boundaries",
        "topology.elastic = false; --preset dilocox", "--preset=allreduce --topology.elastic=true"),
    Row(MIXED_DP, PER_STEP, "replica 0 of each stage syncs it for clusters of different shapes in the outer sync",
        "topology.clusters = []; --preset dilocox", "--preset=allreduce --topology.clusters=dp2,dp1"),
    # the delay, and what lands inside a round
    Row(FIT_LINK, BLOCKING, "fit_link sizes H so that a sync travels during the next round, which only a delayed sync "
        "does", "sync.sync_delay = 1; sync.round.fit_link = false", "--preset=diloco --sync.round.fit_link=true"),
    Row(ALPHA, DELAY, "it mixes a landed average into the round that launched it; under the delay the round restarted "
        "when it launched, where sync.merge says", "sync.alpha = 0; sync.sync_delay = 0",
        "--sync.alpha=0.5"),
    Row(OVERLAP, FIT_LINK, "fit_link sizes H so that a sync travels during a whole round, which a landing inside it "
        "cuts short", "sync.overlap_steps = 0; sync.round.fit_link = false",
        "--sync.round.fit_link=true --sync.overlap_steps=3"),
    Row(FRAGMENTS, FIT_LINK, "fit_link changes H between rounds, which breaks the fragments' stagger",
        "sync.fragments = 1; sync.round.fit_link = false", "--sync.round.fit_link=true --sync.fragments=2"),
    # time rounds
    Row(TIME_ROUNDS, FIT_LINK, "a time round's length is its budget; fit_link sizes H itself",
        "sync.round.fit_link = false; sync.round.mode = steps", "--sync.round.mode=time --sync.round.fit_link=true"),
    Row(ROUND_SECONDS, STEP_ROUNDS, "it is the budget of a time round",
        "sync.round.mode = time; sync.round.seconds = 0", "--sync.round.seconds=2"),
    # what a reduction that sums in transit cannot do
    Row(ROBUST, SUMMED, "a robust aggregate needs every cluster's update at every receiver; this reduction delivers "
        "only their sum",
        "sync.aggregate = mean; compression.kind = int4 with compression.reduction = gather",
        "--compression.kind=none --sync.aggregate=median"),
    Row(AUTH, ALLREDUCE, "its gradients are summed in transit, where no sender's tag can be checked",
        "network.auth_key_file = \"\"; --preset dilocox", "--preset=allreduce --network.auth_key_file={key_file}"),
    Row(AUTH, SUMMED, "its values are summed or re-encoded in transit, where no sender's tag can be checked",
        "network.auth_key_file = \"\"; compression.kind = int4 with compression.reduction = gather",
        "--compression.kind=none --network.auth_key_file={key_file}"),
    Row(FORGE, NO_AUTH, "it sends payloads under a tag that does not verify; without a key no tag is sent or checked",
        "faults.kind = none; network.auth_key_file = FILE", "--faults.kind=forge"),
    Row(SCALABLE, UNSCALABLE_CODEC, "each cluster picks its own rank or positions, and the scalable reduction sums "
        "payloads of one layout that every cluster agrees on beforehand",
        "compression.reduction = gather; compression.kind = lowrank_int4", "--compression.reduction=scalable"),
    # what a codec's residual options need
    Row(LOCAL_RESIDUAL, NO_RESIDUAL, "it keeps a share of what the codec's error feedback holds back, and this codec "
        "holds nothing back",
        "sync.local_residual = false; compression.kind = topk_int4 with compression.error_feedback = true",
        "--compression.kind=none --sync.local_residual=true"),
    Row(DRAIN, NO_RESIDUAL, "it sends what the codec's error feedback holds back, and this codec holds nothing back",
        "sync.drain_residual = false; compression.kind = topk_int4 with compression.error_feedback = true",
        "--compression.kind=none --sync.drain_residual=true"),
    Row(OWN_PAYLOAD, NO_RESIDUAL, "it starts a round from what the codec sent and held back, and this codec holds "
        "nothing back",
        "sync.merge = eager; compression.kind = topk_int4 with compression.error_feedback = true",
        "--compression.kind=none --sync.merge=own_payload"),
    Row(DRAIN, NOT_SGD, "the drained residual is added to phi at the outer SGD's learning rate, and this optimizer's "
        "steps have a length of their own",
        "sync.drain_residual = false; sync.outer.optimizer = sgd",
        "--sync.outer.optimizer=adamw --sync.drain_residual=true"),
    # elastic runs: a cluster heals from a peer, and every cluster's H is the same
    Row(FIT_LINK, ELASTIC, "each cluster would size H from its own link and end its rounds at other steps than its "
        "peers, while every quorum meets at one round boundary",
        "sync.round.fit_link = false; topology.elastic = false", "--topology.elastic=true --sync.round.fit_link=true"),
    # options that only an elastic run reads
    Row(SOME_CLUSTERS, STATIC, "a run goes on without some clusters only when it is elastic",
        "sync.min_clusters = auto; topology.elastic = true", "--topology.num_clusters=3 --sync.min_clusters=2"),
    Row(LIGHTHOUSE, STATIC, "only the clusters of an elastic run meet at a Lighthouse",
        "network.lighthouse = \"\"; topology.elastic = true", "--network.lighthouse=http://127.0.0.1:29510"),
    Row(LOCAL_CLUSTERS, STATIC, "a static run starts every cluster on one machine or under torchrun",
        "topology.local_clusters = \"\"; topology.elastic = true", "--topology.local_clusters=0"),
    Row(ADVERTISE, STATIC, "only the machines of an elastic run listen for each other",
        "network.advertise_host = \"\"; topology.elastic = true", "--network.advertise_host=127.0.0.1"),
    Row(SOME_HERE, NO_LIGHTHOUSE, "the machines that start the other clusters meet this one at one Lighthouse: start "
        "`dilocox lighthouse` on a host they all reach",
        "network.lighthouse = http://127.0.0.1:29510; topology.local_clusters = \"\"",
        "--topology.elastic=true --topology.local_clusters=0"),
    Row(SOME_HERE, NO_ADVERTISE, "the other machines need the address they reach this one at",
        "network.advertise_host = 127.0.0.1; topology.local_clusters = \"\"",
        "--topology.elastic=true --topology.local_clusters=0 --network.lighthouse=http://127.0.0.1:29510"),
    # clusters of different data-parallel degrees: replica 0 of each stage syncs for the others
    Row(MIXED_DP, SHARDED, "replica 0 of each stage syncs the whole stage for its cluster, and a sharded stage's "
        "replica holds only its shard", "topology.dp_mode = replicate; topology.clusters = []",
        "--topology.clusters=dp2,dp1 --topology.dp_mode=shard"),
    # the run directory
    Row(RESUME_ONE, OVERWRITE, "resuming keeps the run directory that overwriting replaces",
        "run.overwrite = false; checkpoint.resume = auto", "--checkpoint.resume=latest --run.overwrite=true"),
)
# fmt: on
"""Every refused pair. A config meets the first row that applies to it (`check`)."""


def refusals(cfg: Config) -> list[Row]:
    """The rows a resolved config meets, in table order."""
    return [row for row in ROWS if row.applies(cfg)]


def check(cfg: Config) -> None:
    """Raise a ValueError with the line of the first row a resolved config meets (nothing when none)."""
    for row in ROWS:
        if row.applies(cfg):
            raise ValueError(row.message(cfg))


def matrix_markdown() -> str:
    """Markdown: the compatibility matrix, one line per row of the table (docs/reference/configuration.md)."""
    lines = [
        "| option | does not work with | why | fix |",
        "| --- | --- | --- | --- |",
    ]
    for row in ROWS:
        fixes = ", or ".join(" with ".join(f"`{part}`" for part in fix) for fix in row.fixes)
        lines.append(
            f"| `{row.a.option}` {row.a.when} | `{row.b.option}` {row.b.when} | {row.why.replace('|', '/')} | {fixes} |"
        )
    return "\n".join(lines) + "\n"
