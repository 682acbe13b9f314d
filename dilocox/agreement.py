"""The ranks of a run compare their settings before training; a difference stops the run with one line naming it.

The ranks of a run are started apart (torchrun on each node, `dilocox train` on each machine of an elastic run),
each from its own command line. A setting given otherwise on one node (another learning rate, codec or key file) does
not fail by itself: the clusters average what does not belong together and end apart. So every rank describes what
it must share with the others (`run_settings`: `Config.shared_settings`, the settings a static run's ranks use
together, fingerprints of what its data files hold and of its payload key) and the ranks compare the descriptions
before anything is written.

    check_same_settings(cfg, group=dist.group.WORLD, node="2")   # collective; SettingsMismatch on every rank:
    # "the ranks were started with other settings: train.lr: 0.003 on ranks 0-1 (nodes 0-1), 0.03 on rank 2 (node 2)"
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from dilocox.net.json_gather import all_gather_json

if TYPE_CHECKING:  # config.py imports sync/, whose elastic rounds use this module's messages
    from dilocox.config import Config

STATIC_SHARED_SETTINGS = (
    "checkpoint.interval",
    "eval.interval",
    "eval.max_batches",
    "eval.final_max_batches",
    "eval.local",
)
"""Settings outside `Config.shared_settings` that the ranks of a static run use together: every rank saves each
checkpoint at one barrier, and the stages of cluster 0 evaluate together."""
KEY_SETTING = "network.auth_key_file"
"""The name under which `run_settings` holds the payload key's fingerprint (the file's path may differ per machine;
its key may not)."""
DATA_SETTINGS = ("data.path", "data.tokenizer")
"""The names under which `run_settings` holds fingerprints of what the data and the tokenizer files hold (a node may
read a copy at another path; the copy must hold the same)."""
_MAX_SETTINGS_BYTES = 256 << 10
"""The most bytes a rank may declare for its settings as JSON (about 5 KB)."""
_MAX_SHOWN = 6
"""Differing settings named in the message; the rest are counted."""
_MAX_VALUE_CHARS = 60


class SettingsMismatch(ValueError):
    """The ranks of a run were started with other settings: one line naming them, a non-zero exit on every rank."""


def run_settings(cfg: Config) -> dict[str, Any]:
    """What this rank must share with every other rank of its run, by dotted name: `Config.shared_settings`, for a
    static run `STATIC_SHARED_SETTINGS`, under `DATA_SETTINGS` fingerprints of what data.path and the tokenizer
    hold (`data.data_fingerprint`, a few sampled blocks per file), and under `KEY_SETTING` the fingerprint of
    network.auth_key_file's key (`PayloadAuth.fingerprint`, which reveals nothing of the key) or None without one.
    Reads the data and key files: their ValueError names the one that cannot be read."""
    from dilocox.config import flat_settings, to_dict
    from dilocox.data import data_fingerprint
    from dilocox.data.tokenfiles import tokenizer_fingerprint
    from dilocox.data.tokenizer import Tokenizer

    settings = cfg.shared_settings()
    if not cfg.topology.elastic:
        values = flat_settings(to_dict(cfg))
        for name in STATIC_SHARED_SETTINGS:
            settings[name] = values[name]
    settings["data.path"] = f"content {data_fingerprint(cfg.data.path, cfg.data.text_field)}"
    tokenizer = None
    if cfg.data.tokenizer:
        serialized = Tokenizer.from_file(cfg.data.tokenizer).backend.to_str(pretty=False).encode("utf-8")
        tokenizer = f"content {tokenizer_fingerprint(serialized)}"
    settings["data.tokenizer"] = tokenizer
    auth = cfg.network.payload_auth()
    settings[KEY_SETTING] = None if auth is None else f"key {auth.fingerprint()}"
    return settings


def settings_fingerprint(settings: dict[str, Any]) -> int:
    """A fingerprint (63 bits, fits an int64 tensor) of `run_settings`: what an elastic run's clusters compare at
    every round boundary, before they compare the settings themselves when it differs."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def differing_settings(described: Sequence[dict[str, Any]]) -> list[str]:
    """The names whose values are not the same in every description, in the order of the first one (a name that
    some description lacks, from another dilocox version, differs too)."""
    names = list(dict.fromkeys(name for settings in described for name in settings))
    return [name for name in names if len({_canonical(settings.get(name, _MISSING)) for settings in described}) > 1]


def describe_differences(
    described: Sequence[dict[str, Any]],
    *,
    noun: str = "rank",
    numbers: Sequence[int] | None = None,
    nodes: Sequence[str | None] | None = None,
) -> str:
    """The settings that differ, each with its values and the members that hold them, e.g. `train.lr: 0.003 on
    ranks 0-1 (nodes 0-1), 0.03 on rank 2 (node 2)`; members are called `noun`, numbered by `numbers` (by default
    their index in `described`), with `nodes` their node where known. Empty when every description is the same."""
    differing = differing_settings(described)
    parts = []
    for name in differing[:_MAX_SHOWN]:
        holders: dict[str, list[int]] = {}
        for index, settings in enumerate(described):
            holders.setdefault(_canonical(settings.get(name, _MISSING)), []).append(index)
        values = ", ".join(
            f"{_shown(json.loads(value))} on {_members(indices, noun, nodes, numbers)}"
            for value, indices in holders.items()
        )
        parts.append(f"{name}: {values}")
    if len(differing) > _MAX_SHOWN:
        parts.append(f"and {len(differing) - _MAX_SHOWN} more")
    return "; ".join(parts)


def check_same_settings(cfg: Config, *, group: dist.ProcessGroup | None, node: str | None = None) -> None:
    """Compare this rank's `run_settings` with every rank's of `group` (a collective: one bounded JSON all-gather).
    Raises on every rank alike: the ValueError of a rank whose settings cannot be read (its key file), naming that
    rank, or SettingsMismatch naming each setting that differs, its values and the ranks (and `node`s) that hold them.
    Group ranks number the members: pass the default group (None) so that they are the global ranks."""
    try:
        mine: dict[str, Any] = {"settings": run_settings(cfg)}
    except ValueError as exc:
        mine = {"error": str(exc)[:4000]}
    mine["node"] = node
    gathered = all_gather_json(mine, group=group, max_bytes=_MAX_SETTINGS_BYTES)
    nodes = [entry["node"] for entry in gathered]
    for rank, entry in enumerate(gathered):
        if "error" in entry:
            raise ValueError(f"{_members([rank], 'rank', nodes)}: {entry['error']}")
    differences = describe_differences([entry["settings"] for entry in gathered], nodes=nodes)
    if differences:
        raise SettingsMismatch(
            f"the ranks of this run were started with other settings: {differences}; start every node with the same "
            f"config file and flags, the same data and the same key ({', '.join(DATA_SETTINGS)} and {KEY_SETTING} may "
            "be other paths on other nodes, not other contents)"
        )


_MISSING = "<not set: another dilocox version>"


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _shown(value: Any) -> str:
    if value == _MISSING:
        return value
    if value is None:
        return "none"
    text = value if isinstance(value, str) and value.startswith(("key ", "content ")) else json.dumps(value)
    return text if len(text) <= _MAX_VALUE_CHARS else text[: _MAX_VALUE_CHARS - 3] + "..."


def _members(
    indices: list[int], noun: str, nodes: Sequence[str | None] | None, numbers: Sequence[int] | None = None
) -> str:
    """`rank 2 (node 2)`, `ranks 0-1, 4 (nodes 0-1)`: the members at `indices` (numbered by `numbers`), and their
    nodes where known."""
    text = f"{noun}{'s' if len(indices) > 1 else ''} {_ranges([numbers[i] if numbers else i for i in indices])}"
    where = {nodes[i] for i in indices if nodes is not None and nodes[i] is not None}
    if where:
        shown = _ranges(sorted(where, key=int)) if all(n.isdigit() for n in where) else ", ".join(sorted(where))
        text += f" (node{'s' if len(where) > 1 else ''} {shown})"
    return text


def _ranges(values: Sequence[int | str]) -> str:
    """`0-2, 5` for [0, 1, 2, 5]."""
    numbers = sorted(int(v) for v in values)
    spans: list[list[int]] = []
    for number in numbers:
        if spans and number == spans[-1][1] + 1:
            spans[-1][1] = number
        else:
            spans.append([number, number])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
