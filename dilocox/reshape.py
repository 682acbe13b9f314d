"""A checkpoint resumed at another data-parallel degree (`topology.dp_degree`): each rank of the new shape builds its
state from the saved ranks of its cluster and stage, D of them at the saved degree, for D' replicas now.

    state = reshaped_rank_state(path, trainer)   # this rank's state, as `load_rank_state` gives a saved one

Replicated stages hold the same model, inner optimizer, phi, round start and outer optimizer on every replica:
replica 0's are taken. Sharded stages (`topology.dp_mode = shard`) hold dim-0 rows of each tensor (FSDP2's cut): the
saved rows are put together and cut again for this rank, for the model, the inner optimizer's moments, phi, the round
start and the outer optimizer's state. What each replica holds of its own is redistributed:

- **Error feedback**: a residual per piece of the replica's slice (a replicated stage: whole tensors,
  `ReplicaSlice`; a sharded one: its rows of every tensor); every piece moves, unchanged, to the new replica that
  holds it.
- **The sync in flight**: what each replica sent. Uncompressed, that is its flat pseudo-gradient (cut again like
  phi). A codec's payloads of the D old slices are decoded into the cluster's update, and each new replica encodes
  its slice of it again and sends it, through its error feedback: what the codec holds back of it stays in the
  residual, so the update is neither lost nor sent twice, only re-cut.
- **The codec**: replica d' takes the generator of saved replica d' mod D; low-rank warm starts start cold.
- **The guard's norm history** (of one replica's slice) starts afresh: the next round's median is its reference.
- **The data position**: each replica's stream goes on at the same share of its epoch, over the new deal of windows
  (C x D' shards instead of C x D).
- **The link counters**: replica d' takes the sum of the saved replicas d with d mod D' = d', so the run's totals
  carry over; **the RNG**: replica d' mod D's.

An elastic run's clusters each build their ranks' states from their own checkpoint (`checkpoints/cluster{c}/`,
ranks numbered inside the cluster); a cluster without one heals from a peer at the new degree, as at any resume.
Clusters of different dp, time rounds, cocktail and the reductions that keep state shared over replicas
(`scalable`, lanes) resume at the degree they were saved with (`checkpoint.reshape_refusal` says so in one
line, before anything is written).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dilocox.checkpoint import load_rank_state, meta_topology, read_meta
from dilocox.compress.payload import Payload
from dilocox.sync.reducers import ReplicaSlice

_SHARED_KEYS = ("outer_params", "round_start")
"""A fragment's flat tensors that the outer step writes: the same on every replica of a replicated stage, each
replica's rows of a sharded one."""


def reshaped_rank_state(path: Path, trainer: Any) -> dict[str, Any]:
    """The state of the resuming `trainer`'s rank (its coords, topology, model, optimizers, sync, data stream and
    config), built from the saved ranks of its cluster and stage at the checkpoint's dp degree (module docstring).
    Verifies each file it reads, as `load_rank_state` does."""
    saved_topology = meta_topology(read_meta(path))
    coords = trainer.coords
    old_dp, new_dp = saved_topology.dp_degree, trainer.topology.dp_degree
    per_cluster = old_dp * saved_topology.pp_degree  # an elastic cluster's checkpoint numbers its own ranks
    ranks = [saved_topology.rank_of(coords.cluster, d, coords.pp) for d in range(old_dp)]
    states = [load_rank_state(path, rank % per_cluster if trainer.elastic else rank) for rank in ranks]
    first = states[0]
    model, inner = first["model"], first["inner_optimizer"]
    if trainer.sharded:  # the DTensors' rows cut again; the rest (buffers) is the same on every replica
        sharded = [key for key, value in trainer.model.state_dict().items() if hasattr(value, "to_local")]
        model = {**model, **{key: _reshard([s["model"][key] for s in states], new_dp, coords.dp) for key in sharded}}
        inner = _resharded_optimizer([s["inner_optimizer"] for s in states], trainer.inner_optimizer, new_dp, coords.dp)
    return {
        "model": model,
        "inner_optimizer": inner,
        "sync": reshaped_sync_state([s["sync"] for s in states], trainer, new_dp=new_dp),
        "data": _reshaped_position(first["data"], trainer, saved_topology),
        "channel": _merged_counters([s["channel"] for s in states], coords.dp, new_dp),
        "rng": states[coords.dp % old_dp]["rng"],
        "trainer": first["trainer"],
    }


def _span(rows: int, dp: int, index: int) -> tuple[int, int]:
    """The dim-0 rows replica `index` of `dp` holds of a tensor of `rows` rows, as FSDP2 cuts it (`torch.chunk`:
    ceil(rows / dp) each, the last ones short or empty)."""
    chunk = -(-rows // dp)
    start = min(index * chunk, rows)
    return start, min(start + chunk, rows)


def _reshard(shards: list[torch.Tensor], dp: int, index: int) -> torch.Tensor:
    """Replica `index`'s shard, of `dp`, of the tensor whose saved shards (in dp order) are `shards`."""
    whole = torch.cat(shards)
    start, end = _span(whole.shape[0], dp, index)
    return whole[start:end].clone()


def _resharded_optimizer(saved: list[dict[str, Any]], optimizer: Any, dp: int, index: int) -> dict[str, Any]:
    """An inner optimizer's `local_state` for this rank: the state tensors of sharded parameters (those of dim >= 1,
    as `load_local_optimizer_state_` reads them) resharded, the rest (step counts) replica 0's."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[Any, Any] = {}
    for key, entry in saved[0]["state"].items():
        sharded = hasattr(params[int(key)], "to_local")
        state[key] = {
            name: _reshard([s["state"][key][name] for s in saved], dp, index)
            if sharded and isinstance(value, torch.Tensor) and value.dim() > 0
            else value
            for name, value in entry.items()
        }
    return {**saved[0], "state": state}


def reshaped_sync_state(saved: list[dict[str, Any]], trainer: Any, *, new_dp: int) -> dict[str, Any]:
    """The outer sync's state of this replica (of `new_dp`) from the saved replicas' (`saved`, in dp order)."""
    if "fragments" not in saved[0]:  # a strategy without an outer loop (allreduce): nothing per replica
        return saved[0]
    fragments = trainer.sync.diloco.fragments  # type: ignore[union-attr]
    layout = _Layout(len(saved), new_dp, trainer.coords.dp, sharded=trainer.sharded)
    per_fragment = zip(fragments, zip(*(s["fragments"] for s in saved), strict=True), strict=True)
    states = [_reshaped_fragment(list(old), fragment, layout) for fragment, old in per_fragment]
    channel = _merged_counters([s["channel"] for s in saved], trainer.coords.dp, new_dp)
    return {**saved[0], "fragments": states, "channel": channel}


class _Layout:
    """Which pieces of a fragment's tensors a replica holds, as (tensor, first row, end row): in its flat vector (a
    replicated stage: every tensor whole; a sharded one: its rows of every tensor) and in its reducer's slice (a
    replicated stage: the whole tensors of its `ReplicaSlice`; a sharded one: its flat vector's)."""

    def __init__(self, old_dp: int, new_dp: int, index: int, *, sharded: bool) -> None:
        self.old_dp, self.new_dp, self.index, self.sharded = old_dp, new_dp, index, sharded

    def flat_parts(self, shapes: list[torch.Size], dp: int, index: int) -> list[tuple[int, int, int]]:
        if not self.sharded:
            return [(t, 0, shape[0]) for t, shape in enumerate(shapes)]
        return [(t, *_span(shape[0], dp, index)) for t, shape in enumerate(shapes)]

    def slice_parts(self, shapes: list[torch.Size], dp: int, index: int) -> list[tuple[int, int, int]]:
        if self.sharded:
            return self.flat_parts(shapes, dp, index)
        return [(t, 0, shapes[t][0]) for t in ReplicaSlice.at(shapes, dp, index).indices]

    @staticmethod
    def piece_shapes(shapes: list[torch.Size], parts: list[tuple[int, int, int]]) -> list[torch.Size]:
        return [torch.Size([end - start, *shapes[t][1:]]) for t, start, end in parts]

    def assemble(self, shapes: list[torch.Size], pieces: list[list[torch.Tensor]], slices: bool) -> list[torch.Tensor]:
        """The whole tensors from every saved replica's pieces (of its slice, or of its flat vector)."""
        whole = [torch.zeros(shape) for shape in shapes]
        for index, held in enumerate(pieces):
            parts = (self.slice_parts if slices else self.flat_parts)(shapes, self.old_dp, index)
            for (t, start, end), piece in zip(parts, held, strict=True):
                whole[t][start:end] = piece.reshape(end - start, *shapes[t][1:])
        return whole

    def mine(self, shapes: list[torch.Size], whole: list[torch.Tensor], slices: bool) -> list[torch.Tensor]:
        """This rank's pieces of the whole tensors (of its slice, or of its flat vector)."""
        parts = (self.slice_parts if slices else self.flat_parts)(shapes, self.new_dp, self.index)
        return [whole[t][start:end].clone() for t, start, end in parts]

    def split_flat(self, shapes: list[torch.Size], flat: torch.Tensor, index: int) -> list[torch.Tensor]:
        """Saved replica `index`'s flat vector cut into its pieces."""
        sizes = [s.numel() for s in self.piece_shapes(shapes, self.flat_parts(shapes, self.old_dp, index))]
        return list(torch.split(flat.reshape(-1), sizes))

    def reshard_flat(self, shapes: list[torch.Size], flats: list[torch.Tensor]) -> torch.Tensor:
        """This rank's flat vector of the fragment from the saved replicas' (a sharded stage; replicated ones agree)."""
        if not self.sharded:
            return flats[0]
        whole = self.assemble(shapes, [self.split_flat(shapes, f, d) for d, f in enumerate(flats)], slices=False)
        return torch.cat([piece.reshape(-1) for piece in self.mine(shapes, whole, slices=False)])


def _reshaped_fragment(old: list[dict[str, Any]], fragment: Any, layout: _Layout) -> dict[str, Any]:
    shapes = [torch.Size(p.shape) for p in fragment.flat.params]  # whole tensors (a DTensor's shape is its global one)
    state = dict(old[0])  # the round counters: the same on every replica
    if not layout.sharded:  # what the outer step wrote: alike on every replica, or the file is not this run's
        for key in _SHARED_KEYS:
            if isinstance(old[0][key], torch.Tensor) and not all(torch.equal(old[0][key], o[key]) for o in old[1:]):
                raise ValueError(f"the checkpoint's replicas of one stage hold different {key}: it is damaged")
    for key in _SHARED_KEYS:
        state[key] = layout.reshard_flat(shapes, [o[key] for o in old])
    state["outer_optimizer"] = _reshaped_outer(old, shapes, layout)
    state["guard"] = _fresh_guard(old[0]["guard"])
    if old[0]["reduction"] == "gather":
        reducer = dict(old[0]["reducer"])
        feedback = dict(reducer["feedback"])
        if any(o["reducer"]["feedback"]["residuals"] for o in old):
            pieces = [_residual_pieces(o["reducer"]["feedback"], shapes, layout, d) for d, o in enumerate(old)]
            whole = layout.assemble(shapes, pieces, slices=True)
            feedback["residuals"] = {str(i): r for i, r in enumerate(layout.mine(shapes, whole, slices=True))}
        codec = dict(old[layout.index % layout.old_dp]["reducer"]["codec"])
        if "warm_starts" in codec:
            codec["warm_starts"] = {}
        reducer.update(feedback=feedback, codec=codec)
        if "guard" in reducer:
            reducer["guard"] = {"history": []}
        state["reducer"] = reducer
        if old[0]["pending_sent"] is not None:  # every replica's payload, decoded: the cluster's update
            whole = layout.assemble(shapes, [_decoded(o, fragment, shapes, layout, d) for d, o in enumerate(old)], True)
            state["pending_decoded"] = torch.cat([p.reshape(-1) for p in layout.mine(shapes, whole, slices=False)])
            state["pending_sent"] = None
    elif old[0]["reduction"] == "dense":
        if old[0]["pending_sent"] is not None:  # the whole pseudo-gradient (a sharded stage: each replica's rows)
            state["pending_sent"] = layout.reshard_flat(shapes, [o["pending_sent"] for o in old])
    else:
        raise ValueError(f"the {old[0]['reduction']!r} reduction cannot resume at another dp degree")
    return state


def _reshaped_outer(old: list[dict[str, Any]], shapes: list[torch.Size], layout: _Layout) -> dict[str, Any]:
    """The outer optimizer's state: its tensors over the fragment's flat vector (momentum, moments) resharded."""
    saved = old[0]["outer_optimizer"]
    if not layout.sharded:
        return saved
    state = {
        key: {
            name: layout.reshard_flat(shapes, [o["outer_optimizer"]["state"][key][name] for o in old])
            if isinstance(value, torch.Tensor) and value.numel() == old[0]["outer_params"].numel()
            else value
            for name, value in entry.items()
        }
        for key, entry in saved["state"].items()
    }
    return {**saved, "state": state}


def _residual_pieces(feedback: dict[str, Any], shapes: list[torch.Size], layout: _Layout, index: int):
    """Saved replica `index`'s residuals, one per piece of its slice (zeros where it holds none yet)."""
    parts = layout.slice_parts(shapes, layout.old_dp, index)
    saved = feedback["residuals"]
    return [saved[str(i)] if saved else torch.zeros(s) for i, s in enumerate(layout.piece_shapes(shapes, parts))]


def _decoded(state: dict[str, Any], fragment: Any, shapes: list[torch.Size], layout: _Layout, index: int):
    """What saved replica `index`'s payload of the sync in flight decodes to, one tensor per piece of its slice
    (zeros for an empty slice or an abstention, which sends nothing of this cluster's)."""
    reducer = fragment.reducer
    codec = getattr(reducer, "reducer", reducer).codec  # under a FaultyReducer: the one it wraps
    pieces = layout.piece_shapes(shapes, layout.slice_parts(shapes, layout.old_dp, index))
    sent = state["pending_sent"]
    if not pieces or not sent.numel():
        return [torch.zeros(shape) for shape in pieces]
    return [t.to(torch.float32) for t in codec.decode_list(Payload(sent.clone()), pieces)]


def _fresh_guard(guard: dict[str, Any]) -> dict[str, Any]:
    """A `RoundGuard` state with its totals kept and the mean's norm history (of a replica's slice) emptied."""
    return {**guard, "mean": None if guard.get("mean") is None else {"history": []}}


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
