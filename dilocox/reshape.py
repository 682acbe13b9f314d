"""A checkpoint resumed at another data-parallel degree (`topology.dp_degree`): each rank of the new shape builds its
state from the saved ranks of its cluster and stage, D of them at the saved degree, for D' replicas now.

    state = reshaped_rank_state(path, trainer)   # this rank's state, as `load_rank_state` gives a saved one

Replicated stages hold the same model, inner optimizer, phi, round start, outer optimizer and round counters on
every replica: replica 0's are taken. What each replica holds of its own is redistributed:

- **Error feedback**: a residual per tensor of the replica's slice. Slices are whole tensors
  (`param_aligned_bounds`), so every tensor's residual moves, unchanged, to the new replica whose slice holds it.
- **The sync in flight**: what each replica sent. Uncompressed, that is the whole pseudo-gradient (replica 0's is sent
  again, over the new slices). A codec's payloads of the D old slices are decoded into the cluster's update, and each
  new replica encodes its slice of it again and sends it, through its error feedback: what the codec holds back of it
  stays in the residual, so the update is neither lost nor sent twice, only re-cut.
- **The codec**: replica d' takes the generator of saved replica d' mod D; low-rank warm starts start cold.
- **The guard's norm history** (of one replica's slice) starts afresh: the next round's median is its reference.
- **The data position**: each replica's stream goes on at the same share of its epoch, over the new deal of windows
  (C x D' shards instead of C x D).
- **The link counters**: replica d' takes the sum of the saved replicas d with d mod D' = d', so the run's totals
  carry over; **the RNG**: replica d' mod D's.

Elastic runs, clusters of different dp, sharded stages (`topology.dp_mode = shard`), time rounds and the reductions
that keep state shared over replicas (`scalable`, lanes) resume at the degree they were saved with
(`checkpoint.reshape_refusal` says so in one line, before anything is written).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dilocox.checkpoint import load_rank_state, meta_topology, read_meta
from dilocox.compress.payload import Payload
from dilocox.sync.reducers import ReplicaSlice

_SHARED_KEYS = ("outer_params", "outer_optimizer", "round_start", "outer_step", "inner_steps", "round_end")
"""A fragment's state that is the same on every replica of a replicated stage."""


def reshaped_rank_state(path: Path, trainer: Any) -> dict[str, Any]:
    """The state of the resuming `trainer`'s rank (its coords, topology, sync, data stream and config), built from
    the saved ranks of its cluster and stage at the checkpoint's dp degree (module docstring). Verifies each file it
    reads, as `load_rank_state` does."""
    saved_topology = meta_topology(read_meta(path))
    coords = trainer.coords
    old_dp, new_dp = saved_topology.dp_degree, trainer.topology.dp_degree
    states = [load_rank_state(path, saved_topology.rank_of(coords.cluster, d, coords.pp)) for d in range(old_dp)]
    first = states[0]
    return {
        "model": first["model"],
        "inner_optimizer": first["inner_optimizer"],
        "sync": reshaped_sync_state([s["sync"] for s in states], trainer, new_dp=new_dp),
        "data": _reshaped_position(first["data"], trainer, saved_topology),
        "channel": _merged_counters([s["channel"] for s in states], coords.dp, new_dp),
        "rng": states[coords.dp % old_dp]["rng"],
        "trainer": first["trainer"],
    }


def reshaped_sync_state(saved: list[dict[str, Any]], trainer: Any, *, new_dp: int) -> dict[str, Any]:
    """The outer sync's state of this replica (of `new_dp`) from the saved replicas' (`saved`, in dp order)."""
    if "fragments" not in saved[0]:  # a strategy without an outer loop (allreduce): nothing per replica
        return saved[0]
    fragments = trainer.sync.diloco.fragments  # type: ignore[union-attr]
    per_fragment = zip(fragments, zip(*(s["fragments"] for s in saved), strict=True), strict=True)
    states = [_reshaped_fragment(list(old), fragment, trainer.coords.dp, new_dp) for fragment, old in per_fragment]
    channel = _merged_counters([s["channel"] for s in saved], trainer.coords.dp, new_dp)
    return {**saved[0], "fragments": states, "channel": channel}


def _reshaped_fragment(old: list[dict[str, Any]], fragment: Any, new_index: int, new_dp: int) -> dict[str, Any]:
    old_dp = len(old)
    state = dict(old[0])  # phi, round start, outer optimizer, counters: the same on every replica
    for key in _SHARED_KEYS:  # each replica's copy of what the outer step wrote: alike, or the file is not this run's
        if isinstance(old[0][key], torch.Tensor) and not all(torch.equal(old[0][key], o[key]) for o in old[1:]):
            raise ValueError(f"the checkpoint's replicas of one stage hold different {key}: it is damaged")
    state["guard"] = _fresh_guard(old[0]["guard"])
    shapes = list(fragment.flat.shapes)
    if old[0]["reduction"] == "gather":
        reducer = dict(old[0]["reducer"])
        residuals = _tensors_of_replicas([o["reducer"]["feedback"] for o in old], shapes, old_dp)
        mine = _replica_tensors(shapes, new_dp, new_index)
        feedback = dict(reducer["feedback"])
        if residuals is not None:
            feedback["residuals"] = {str(i): residuals[t] for i, t in enumerate(mine)}
        codec = dict(old[new_index % old_dp]["reducer"]["codec"])
        if "warm_starts" in codec:
            codec["warm_starts"] = {}
        reducer.update(feedback=feedback, codec=codec)
        if "guard" in reducer:
            reducer["guard"] = {"history": []}
        state["reducer"] = reducer
        if old[0]["pending_sent"] is not None:  # every replica's payload, decoded: the cluster's update
            state["pending_decoded"] = _decoded_update(old, fragment, shapes)
            state["pending_sent"] = None
    elif old[0]["reduction"] != "dense":
        raise ValueError(f"the {old[0]['reduction']!r} reduction cannot resume at another dp degree")
    return state


def _fresh_guard(guard: dict[str, Any]) -> dict[str, Any]:
    """A `RoundGuard` state with its totals kept and the mean's norm history (of a replica's slice) emptied."""
    return {**guard, "mean": None if guard.get("mean") is None else {"history": []}}


def _replica_tensors(shapes: list[torch.Size], dp: int, index: int) -> list[int]:
    """The positions of the tensors of replica `index`'s slice among `dp` replicas."""
    return ReplicaSlice.at(shapes, dp, index).indices


def _tensors_of_replicas(
    feedbacks: list[dict[str, Any]], shapes: list[torch.Size], dp: int
) -> list[torch.Tensor] | None:
    """Every tensor's residual, from the saved replicas' error-feedback states (None: nothing held back yet)."""
    if not any(feedback["residuals"] for feedback in feedbacks):
        return None
    residuals: list[torch.Tensor | None] = [None] * len(shapes)
    for index, feedback in enumerate(feedbacks):
        tensors = _replica_tensors(shapes, dp, index)
        saved = feedback["residuals"]
        for position, tensor in enumerate(tensors):
            residuals[tensor] = saved[str(position)] if saved else torch.zeros(shapes[tensor])
    return [r if r is not None else torch.zeros(shape) for r, shape in zip(residuals, shapes, strict=True)]


def _decoded_update(old: list[dict[str, Any]], fragment: Any, shapes: list[torch.Size]) -> torch.Tensor:
    """The flat update the saved replicas' payloads of the sync in flight decode to, over the whole fragment."""
    reducer = fragment.reducer
    codec = getattr(reducer, "reducer", reducer).codec  # under a FaultyReducer: the one it wraps
    flat = torch.zeros(sum(shape.numel() for shape in shapes))
    for index, state in enumerate(old):
        part = ReplicaSlice.at(shapes, len(old), index)
        sent = state["pending_sent"]
        if not part.shapes or not sent.numel():  # an empty slice, or an abstention (nothing of this cluster's)
            continue
        for (start, end), values in zip(part.spans, codec.decode_list(Payload(sent.clone()), part.shapes), strict=True):
            flat[start:end] = values.reshape(-1).to(flat.dtype)
    return flat


def _reshaped_position(data: dict[str, Any], trainer: Any, saved_topology: Any) -> dict[str, Any]:
    """The data position of this replica's new stream: the same share of its epoch as the saved streams had (every
    replica of a cluster takes the same number of windows a step, so they are at the same share)."""
    from dilocox.data import ShardedTokenStream

    cfg, stream = trainer.cfg, trainer.stream
    rank = saved_topology.rank_of(trainer.coords.cluster, 0, trainer.coords.pp)
    old = ShardedTokenStream(
        trainer.data.train,
        seq_len=cfg.train.seq_len,
        batch_size=cfg.train.micro_batch_size,
        shard_index=saved_topology.shard_index(rank),
        num_shards=saved_topology.num_shards,
        seed=cfg.run.seed,
        shard=cfg.data.shard,
    )
    done = int(data["epoch"]) * old.num_windows + int(data["index"])
    epoch, index = divmod(round(done * stream.num_windows / old.num_windows), stream.num_windows)
    return {**data, "epoch": epoch, "index": index}


def _merged_counters(channels: list[dict[str, Any]], index: int, new_dp: int) -> dict[str, Any]:
    """Replica `index`'s link counters: the sum of the saved replicas' d with d mod `new_dp` = `index` (the
    collectives' numbering, the same on every replica, from replica 0; the peak in flight, the largest)."""
    mine = [channel for d, channel in enumerate(channels) if d % new_dp == index]
    merged: dict[str, Any] = {}
    for key, value in channels[0].items():
        if key in ("num_transfers", "num_launched"):
            merged[key] = value
        elif key.startswith("peak"):
            merged[key] = max((channel[key] for channel in mine), default=0)
        else:
            merged[key] = sum(channel[key] for channel in mine) if mine else type(value)(0)
    return merged
