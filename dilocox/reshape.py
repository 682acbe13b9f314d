"""A checkpoint resumed at another data-parallel or pipeline degree (`topology.dp_degree`, `topology.pp_degree`):
each rank of the new shape builds its state from the saved ranks of its cluster, D of them per saved stage, for D'
replicas now. At the same pp degree it reads its own stage's; at another, every saved stage that holds some of its
tensors: parameter names are the full model's in every stage (`parallel/split.py`), so each tensor's state is found
by name, and a saved stage's inner optimizer order and flat layout are rebuilt on the meta device.

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
- **The codec**: replica d' takes the generator of saved replica d' mod D; low-rank warm starts start cold. At
  another pp degree (other tensors than any saved codec's) it starts as at the run's start.
- **The guard's norm history** (of one replica's slice) starts afresh: the next round's median is its reference.
- **The data position**: each replica's stream goes on at the same share of its epoch, over the new deal of windows
  (C x D' shards instead of C x D).
- **The link counters**: replica d' takes the sum of the saved replicas d with d mod D' = d' (at another pp degree,
  of the saved stages whose first tensor it now holds, so each is counted once), so the run's totals carry over, to
  within the one sync in flight at the checkpoint when stages are put together; **the RNG**: replica d' mod D's.

An elastic run's clusters each build their ranks' states from their own checkpoint (`checkpoints/cluster{c}/`,
ranks numbered inside the cluster); a cluster without one heals from a peer at the new degree, as at any resume.
Clusters of different dp, time rounds, cocktail and the reductions that keep state shared over replicas
(`scalable`) resume at the degrees they were saved with, and `sync.fragments > 1` at its pp degree (its
fragments' rounds are staggered per stage) (`checkpoint.reshape_refusal` says so in one line, before anything is
written).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dilocox.checkpoint import load_rank_state, meta_topology, read_meta
from dilocox.compress.payload import Payload
from dilocox.optim import build_inner_optimizer
from dilocox.parallel.split import stage_on_meta
from dilocox.sync.reducers import ReplicaSlice
from dilocox.topology import fsdp_rows

_SHARED_KEYS = ("outer_params", "round_start")
"""A fragment's flat tensors that the outer step writes: the same on every replica of a replicated stage, each
replica's rows of a sharded one."""


def reshaped_rank_state(path: Path, trainer: Any) -> dict[str, Any]:
    """The state of the resuming `trainer`'s rank (its coords, topology, model, optimizers, sync, data stream and
    config), built from the saved ranks of its cluster: those of its stage at the checkpoint's dp degree, or at
    another pp degree every saved stage that holds some of its tensors (module docstring). Verifies each file it
    reads, as `load_rank_state` does."""
    saved_topology = meta_topology(read_meta(path))
    coords, args = trainer.coords, trainer.model_shape
    old_dp, new_dp, old_pp = saved_topology.dp_degree, trainer.topology.dp_degree, saved_topology.pp_degree
    names = {id(param): name for name, param in trainer.model.named_parameters()}
    own = [names[id(param)] for param in trainer.model.parameters()]
    modules = {stage: stage_on_meta(args, stage, old_pp) for stage in range(old_pp)}  # the saved stages' layouts
    saved = {stage: [name for name, _ in module.named_parameters()] for stage, module in modules.items()}
    stages = [stage for stage in range(old_pp) if set(saved[stage]) & set(own)]  # in pipeline order
    modules = {stage: modules[stage] for stage in stages}
    per_cluster = old_dp * old_pp  # an elastic cluster's checkpoint numbers its own ranks
    ranks = {stage: [saved_topology.rank_of(coords.cluster, d, stage) for d in range(old_dp)] for stage in stages}
    states = {s: [load_rank_state(path, r % per_cluster if trainer.elastic else r) for r in ranks[s]] for s in stages}
    first = states[stages[0]][0]  # the round, data position and trainer counters: the same on every saved rank
    model: dict[str, Any] = {}
    for key, value in trainer.model.state_dict().items():
        stage = next((s for s in stages if key in states[s][0]["model"]), None)
        if stage is None:
            raise ValueError(f"the checkpoint {path} holds no {key} for this rank's stage: it is damaged")
        shards = [state["model"][key] for state in states[stage]]  # a DTensor's rows cut again; buffers alike
        model[key] = _reshard(shards, new_dp, coords.dp) if hasattr(value, "to_local") else shards[0]
    # the first tensor of a saved stage says which new stage counts its link bytes: each is counted once
    counted = [stage for stage in stages if saved[stage][0] in own]
    return {
        "model": model,
        "inner_optimizer": _inner_state(
            trainer, {s: [x["inner_optimizer"] for x in states[s]] for s in stages}, modules, names
        ),
        "sync": reshaped_sync_state(
            {s: [x["sync"] for x in states[s]] for s in stages}, trainer, modules, names, counted
        ),
        "data": _reshaped_position(first["data"], trainer, saved_topology),
        "channel": _merged_counters(
            [x["channel"] for x in states[stages[0]]],
            [[x["channel"] for x in states[s]] for s in counted],
            coords.dp,
            new_dp,
        ),
        "rng": states[stages[0]][coords.dp % old_dp]["rng"],
        "trainer": first["trainer"],
    }


def _reshard(shards: list[torch.Tensor], dp: int, index: int) -> torch.Tensor:
    """Replica `index`'s shard, of `dp`, of the tensor whose saved shards (in dp order) are `shards`."""
    whole = torch.cat(shards)
    start, end = fsdp_rows(whole.shape[0], dp, index)
    return whole[start:end].clone()


def _inner_state(
    trainer: Any, saved: dict[int, list[dict[str, Any]]], modules: dict[int, Any], names: dict[int, str]
) -> dict[str, Any]:
    """The inner optimizer's `local_state` for this rank (`names`: its parameters' names by id): each of its
    parameters' state from the saved stage and index that held it (a saved stage's optimizer order, rebuilt over its
    meta-device module in `modules`), the tensors of sharded parameters (dim >= 1, as `load_local_optimizer_state_`
    reads them) resharded; the groups' settings the saved ones, their parameters this stage's."""
    where: dict[str, tuple[int, int]] = {}
    for stage, module in modules.items():
        held = {id(param): name for name, param in module.named_parameters()}
        order = [
            held[id(p)] for group in build_inner_optimizer(trainer.cfg, module).param_groups for p in group["params"]
        ]
        where.update({name: (stage, index) for index, name in enumerate(order)})
    optimizer, dp, index = trainer.inner_optimizer, trainer.topology.dp_degree, trainer.coords.dp
    state: dict[Any, Any] = {}
    for new, param in enumerate(p for group in optimizer.param_groups for p in group["params"]):
        stage, old = where[names[id(param)]]
        replicas = [s["state"] for s in saved[stage]]
        if old not in replicas[0]:  # a parameter that has not stepped yet
            continue
        sharded = hasattr(param, "to_local")
        state[new] = {
            name: _reshard([r[old][name] for r in replicas], dp, index)
            if sharded and isinstance(value, torch.Tensor) and value.dim() > 0
            else value
            for name, value in replicas[0][old].items()
        }
    groups = next(iter(saved.values()))[0]["param_groups"]
    mine = optimizer.state_dict()["param_groups"]
    return {"state": state, "param_groups": [{**g, "params": m["params"]} for g, m in zip(groups, mine, strict=True)]}


@dataclass
class _SavedFragment:
    """A saved stage's fragment: its tensors' names and whole shapes, and each saved replica's state of it."""

    names: list[str]
    shapes: list[torch.Size]
    replicas: list[dict[str, Any]]


def reshaped_sync_state(
    saved: dict[int, list[dict[str, Any]]],
    trainer: Any,
    modules: dict[int, Any],
    own: dict[int, str],
    counted: list[int],
) -> dict[str, Any]:
    """The outer sync's state of this rank from the saved stages' (`saved[stage]`: its replicas' in dp order;
    `modules[stage]`: its meta-device module; `own`: this rank's parameters' names by id), its link counters from
    the stages `counted`."""
    stages = list(saved)
    base = saved[stages[0]][0]
    if "fragments" not in base:  # a strategy without an outer loop (allreduce): nothing per replica
        return base
    coords, new_dp = trainer.coords, trainer.topology.dp_degree
    layout = _Layout(len(saved[stages[0]]), new_dp, coords.dp, sharded=trainer.sharded)
    fragments = trainer.sync.diloco.fragments  # type: ignore[union-attr]
    names = {stage: [name for name, _ in module.named_parameters()] for stage, module in modules.items()}
    same_stage = list(names.values()) == [[own[id(p)] for p in trainer.model.parameters()]]
    # every saved stage's tensors' whole shapes (a DTensor's shape is its global one)
    shapes = {name: torch.Size(p.shape) for module in modules.values() for name, p in module.named_parameters()}
    if same_stage:  # fragment k from saved fragment k
        olds = [[_SavedFragment(*_named(f, own, shapes), [x["fragments"][k] for x in saved[stages[0]]])]
                for k, f in enumerate(fragments)]  # fmt: skip
    else:  # another pp degree, one fragment a stage: every saved stage that holds some of this stage's tensors
        olds = [[_SavedFragment(names[s], [shapes[n] for n in names[s]], [x["fragments"][0] for x in saved[s]])
                 for s in stages]]  # fmt: skip
    states = [
        _reshaped_fragment(old, fragment, _named(fragment, own, shapes)[0], layout, same_stage=same_stage)
        for old, fragment in zip(olds, fragments, strict=True)
    ]
    channels = [[x["channel"] for x in saved[stage]] for stage in counted]
    channel = _merged_counters([x["channel"] for x in saved[stages[0]]], channels, coords.dp, new_dp)
    return {**base, "fragments": states, "channel": channel}


def _named(fragment: Any, names: dict[int, str], shapes: dict[str, torch.Size]) -> tuple[list[str], list[torch.Size]]:
    """A live fragment's tensors' names and whole shapes, in its flat order."""
    order = [names[id(param)] for param in fragment.flat.params]
    return order, [shapes[name] for name in order]


class _Layout:
    """Which pieces of a fragment's tensors a replica holds, as (tensor, first row, end row): in its flat vector (a
    replicated stage: every tensor whole; a sharded one: its rows of every tensor) and in its reducer's slice (a
    replicated stage: the whole tensors of its `ReplicaSlice`; a sharded one: its flat vector's)."""

    def __init__(self, old_dp: int, new_dp: int, index: int, *, sharded: bool) -> None:
        self.old_dp, self.new_dp, self.index, self.sharded = old_dp, new_dp, index, sharded

    def flat_parts(self, shapes: list[torch.Size], dp: int, index: int) -> list[tuple[int, int, int]]:
        if not self.sharded:
            return [(t, 0, shape[0]) for t, shape in enumerate(shapes)]
        return [(t, *fsdp_rows(shape[0], dp, index)) for t, shape in enumerate(shapes)]

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

    def mine_flat(self, shapes: list[torch.Size], whole: list[torch.Tensor]) -> torch.Tensor:
        """This rank's flat vector of the whole tensors: its pieces of them, in order."""
        return torch.cat([piece.reshape(-1) for piece in self.mine(shapes, whole, slices=False)])


def _reshaped_fragment(
    old: list[_SavedFragment], fragment: Any, names: list[str], layout: _Layout, *, same_stage: bool
) -> dict[str, Any]:
    """This rank's state of `fragment` (its tensors `names`) from the saved fragments `old` that hold them: every
    flat vector, residual and sync in flight put together by tensor from the saved replicas' pieces, then cut for
    this rank (module docstring)."""
    shapes = [torch.Size(p.shape) for p in fragment.flat.params]  # whole tensors (a DTensor's shape is its global one)
    base = old[0].replicas[0]
    state = dict(base)  # the round counters: the same on every replica and stage
    if not layout.sharded:  # what the outer step wrote: alike on every replica, or the file is not this run's
        for saved in old:
            for key in _SHARED_KEYS:
                first = saved.replicas[0][key]
                if isinstance(first, torch.Tensor) and not all(torch.equal(first, o[key]) for o in saved.replicas[1:]):
                    raise ValueError(f"the checkpoint's replicas of one stage hold different {key}: it is damaged")

    def by_tensor(pieces_of, slices: bool) -> list[torch.Tensor]:
        """This fragment's whole tensors from every saved replica's pieces (of its slice, or of its flat vector)."""
        whole: dict[str, torch.Tensor] = {}
        for saved in old:
            pieces = [pieces_of(saved, d, o) for d, o in enumerate(saved.replicas)]
            whole.update(zip(saved.names, layout.assemble(saved.shapes, pieces, slices), strict=True))
        return [whole[name] for name in names]

    def flat(get) -> torch.Tensor:
        """This rank's flat vector of the fragment from the flat vector `get` of each saved replica's state."""
        whole = by_tensor(lambda saved, d, o: layout.split_flat(saved.shapes, get(o), d), slices=False)
        return layout.mine_flat(shapes, whole)

    for key in _SHARED_KEYS:
        state[key] = flat(lambda o, key=key: o[key])
    outer, numel = base["outer_optimizer"], base["outer_params"].numel()
    state["outer_optimizer"] = {  # its tensors over the flat vector (momentum, moments) put together and cut again
        **outer,
        "state": {
            k: {
                name: flat(lambda o, k=k, name=name: o["outer_optimizer"]["state"][k][name])
                if isinstance(value, torch.Tensor) and value.numel() == numel
                else value
                for name, value in entry.items()
            }
            for k, entry in outer["state"].items()
        },
    }
    state["guard"] = _fresh_guard(base["guard"])
    if base["reduction"] == "gather":
        reducer = dict(base["reducer"])
        feedback = dict(reducer["feedback"])
        feedback.pop("before", None)  # not re-cut: should the sync in flight be left out, every residual is forgotten
        if any(o["reducer"]["feedback"]["residuals"] for saved in old for o in saved.replicas):
            whole = by_tensor(lambda saved, d, o: _residual_pieces(o["reducer"]["feedback"], saved, layout, d), True)
            feedback["residuals"] = {str(i): r for i, r in enumerate(layout.mine(shapes, whole, slices=True))}
        if same_stage:  # the generator of saved replica d' mod D; low-rank warm starts start cold
            codec = dict(old[0].replicas[layout.index % layout.old_dp]["reducer"]["codec"])
            if "warm_starts" in codec:
                codec["warm_starts"] = {}
        else:  # other tensors than any saved codec's: it starts as at the run's start
            codec = _codec_of(fragment).state_dict()
        reducer.update(feedback=feedback, codec=codec)
        if "guard" in reducer:
            reducer["guard"] = {"history": []}
        state["reducer"] = reducer
        if base["pending_sent"] is not None:  # every replica's payload, decoded: the cluster's update
            whole = by_tensor(lambda saved, d, o: _decoded(o, fragment, saved.shapes, layout, d), slices=True)
            state["pending_decoded"] = layout.mine_flat(shapes, whole)
            state["pending_sent"] = None
    elif base["reduction"] == "dense":
        if base["pending_sent"] is not None:  # the whole pseudo-gradient (a sharded stage: each replica's rows)
            state["pending_sent"] = flat(lambda o: o["pending_sent"])
    else:
        raise ValueError(f"the {base['reduction']!r} reduction cannot resume at another dp or pp degree")
    return state


def _codec_of(fragment: Any) -> Any:
    return fragment.reducer.codec  # under a FaultyReducer, the one it wraps


def _residual_pieces(feedback: dict[str, Any], saved: _SavedFragment, layout: _Layout, index: int):
    """Saved replica `index`'s residuals, one per piece of its slice (zeros where it holds none yet)."""
    shapes = saved.shapes
    parts = layout.slice_parts(shapes, layout.old_dp, index)
    residuals = feedback["residuals"]
    pieces = layout.piece_shapes(shapes, parts)
    return [residuals[str(i)] if residuals else torch.zeros(s) for i, s in enumerate(pieces)]


def _decoded(state: dict[str, Any], fragment: Any, shapes: list[torch.Size], layout: _Layout, index: int):
    """What saved replica `index`'s payload of the sync in flight decodes to, one tensor per piece of its slice
    (zeros for an empty slice or an abstention, which sends nothing of this cluster's)."""
    codec = _codec_of(fragment)
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
    rank = saved_topology.rank_of(trainer.coords.cluster, 0, 0)  # every stage of a pipeline reads the same data
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


def _merged_counters(
    numbering: list[dict[str, Any]], counted: list[list[dict[str, Any]]], index: int, new_dp: int
) -> dict[str, Any]:
    """Replica `index`'s link counters: the sum over the saved stages `counted` (each a list of its replicas') of
    their replicas d with d mod `new_dp` = `index`; the collectives' numbering, which the sync in flight refers to,
    from `numbering`'s replica 0 (the same on every replica); the peak in flight, the largest."""
    mine = [channel for stage in counted for d, channel in enumerate(stage) if d % new_dp == index]
    merged: dict[str, Any] = {}
    for key, value in numbering[0].items():
        if key in ("num_transfers", "num_launched"):
            merged[key] = value
        elif key.startswith("peak"):
            merged[key] = max((channel[key] for channel in mine), default=0)
        else:
            merged[key] = sum(channel[key] for channel in mine) if mine else type(value)(0)
    return merged
