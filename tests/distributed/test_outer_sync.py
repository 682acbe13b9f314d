"""`OuterSync`, the public API for a user's own loop (docs/api.md), on real gloo ranks.

- parity: OuterSync driving a plain loop (the dp mean from its optimizer hook, the last round ended by the flush)
  gives bit-identical outer params, parameters and slow-link bytes to `DiLoCoSync` driven as the trainer drives
  it (reduce_gradients, after_inner_step(step), total_steps, flush), on 2 clusters x dp 2;
- resume: a state saved with a delayed sync in flight (at a round's end and mid-round), loaded into a fresh
  OuterSync, continues bit for bit like the uninterrupted run, bytes counted once;
- errors that need process groups: a rank outside its group, overlapping groups, clusters or replicas that
  start from different parameters or different models.
"""

import pytest
import torch
import torch.distributed as dist

from dilocox import CompressionConfig, OuterSync, SyncConfig
from dilocox.net.channel import WanChannel
from dilocox.sync import DiLoCoSync
from dilocox.sync.base import shard_bounds
from dilocox.sync.config import OuterConfig
from dilocox.topology import Topology, build_process_groups
from tests.multiproc import run_ranks

H, STEPS = 3, 8  # rounds end at steps 3 and 6; the last (2 steps) is ended by the flush / by total_steps

VARIANTS = {
    # name: (OuterSync keyword arguments, the same settings spelled out as the trainer's configs)
    "dilocox-defaults": (
        {"kind": "dilocox"},
        (
            SyncConfig(
                kind="dilocox",
                inner_steps=H,
                sync_delay=1,
                overlap_steps=2,
                merge="own_payload",
                local_residual=True,
                drain_residual=True,
                outer=OuterConfig(lr=1.4, momentum=0.0),
            ),
            CompressionConfig(kind="topk_int4", density=0.05, feedback_decay=1.0),
        ),
    ),
    "dilocox-int4-reset-nesterov": (
        {"kind": "dilocox", "compression": "int4", "merge": "reset", "outer_lr": 0.7, "outer_momentum": 0.9},
        (
            SyncConfig(
                kind="dilocox",
                inner_steps=H,
                sync_delay=1,
                overlap_steps=0,
                merge="reset",
                local_residual=False,
                drain_residual=False,
                outer=OuterConfig(lr=0.7, momentum=0.9),
            ),
            CompressionConfig(kind="int4", density=0.05),
        ),
    ),
    "diloco-blocking": (
        {"kind": "diloco"},
        (
            SyncConfig(
                kind="diloco", inner_steps=H, merge="keep_local", drain_residual=False, outer=OuterConfig(lr=0.7)
            ),
            CompressionConfig(),
        ),
    ),
}


def make_model(seed: int = 0, width: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, width), torch.nn.Tanh(), torch.nn.Linear(width, 3))


def backward(model, shard: int, step: int) -> None:
    """This shard's loss on its own batch of `step`, backward."""
    generator = torch.Generator().manual_seed(1000 * shard + step)
    x, y = torch.randn(5, 6, generator=generator), torch.randn(5, 3, generator=generator)
    torch.nn.functional.mse_loss(model(x), y).backward()


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _user_loop(groups, shard, options) -> dict:
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    rounds = []
    with OuterSync(
        model,
        optimizer,
        cluster_group=groups.cluster_group,
        dp_group=groups.dp_group,
        inner_steps=H,
        **options,
    ) as sync:
        for step in range(1, STEPS + 1):
            backward(model, shard, step)
            optimizer.step()  # the dp mean runs in OuterSync's pre-step hook
            optimizer.zero_grad()
            sync.step()
            if sync.status().boundary:
                rounds.append(sync.outer_params.clone())
    outer = sync.outer_params.clone()
    return {"rounds": rounds, "outer": outer, "model": flat(model), "bytes": sync.channel.stats(),
            "allreduce_equiv": sync.allreduce_equiv_bytes, "numel": outer.numel()}  # fmt: skip


def _trainer_loop(groups, shard, configs) -> dict:
    """DiLoCoSync as `Trainer.train_step` drives it: reduce_gradients, step, after_inner_step(step), flush."""
    sync_cfg, compression = configs
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    channel = WanChannel(groups.cluster_group, bandwidth=None, latency_s=0.0, num_sharing=2)
    sync = DiLoCoSync(
        model.parameters(), sync_cfg, compression, channel=channel, dp_group=groups.dp_group, total_steps=STEPS
    )
    rounds = []
    for step in range(1, STEPS + 1):
        backward(model, shard, step)
        sync.reduce_gradients()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync.after_inner_step(step)
        if sync.status().boundary and step < STEPS:
            rounds.append(sync.outer_params.clone())
    sync.flush()
    channel.close()
    return {"rounds": rounds, "outer": sync.outer_params.clone(), "model": flat(model), "bytes": channel.stats()}


def _parity(rank, world_size):
    topology = Topology(2, 2, 1)
    groups = build_process_groups(topology, rank)
    shard = topology.shard_index(rank)
    out = {}
    for name, (options, configs) in VARIANTS.items():
        out[name] = (_user_loop(groups, shard, options), _trainer_loop(groups, shard, configs))
    return out


@pytest.fixture(scope="module")
def parity():
    return run_ranks(_parity, 4)


@pytest.mark.dist
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_outer_sync_in_a_plain_loop_equals_diloco_sync_driven_like_the_trainer(parity, variant):
    initial = flat(make_model())
    for rank, rank_result in enumerate(parity):
        user, trainer = rank_result[variant]
        assert len(user["rounds"]) == len(trainer["rounds"]) == 2
        for got, want in zip(user["rounds"], trainer["rounds"], strict=True):
            assert torch.equal(got, want)
        assert torch.equal(user["outer"], trainer["outer"])
        assert torch.equal(user["model"], trainer["model"])
        assert user["bytes"]["bytes_sent"] == trainer["bytes"]["bytes_sent"] > 0
        # AllReduce's yardstick: each replica's half of the fp32 gradient, all-reduced over 2 clusters every step
        # (a ring of 2 sends its whole shard: 2 (C-1)/C x 4 bytes a value)
        start, end = shard_bounds(user["numel"], 2, rank % 2)  # ranks cluster-major: rank = cluster x 2 + dp
        assert user["allreduce_equiv"] == STEPS * 4 * (end - start)
        drains = VARIANTS[variant][1][0].drain_residual  # the flush's int4 payload of the held-back residual
        assert user["bytes"]["num_transfers"] == trainer["bytes"]["num_transfers"] == 3 + drains
        # after the flush every cluster and replica holds the same parameters: the outer params
        assert torch.equal(user["model"], parity[0][variant][0]["model"])
        assert torch.equal(user["model"], user["outer"])
    assert (parity[0][variant][0]["outer"] - initial).abs().max() > 1e-3  # the outer steps moved them


# ---------------------------------------------------------------------------------------------- resume
RESUME_STEPS = 10
RESUME_OPTIONS = {"kind": "dilocox", "compression": "int4", "inner_steps": H, "bandwidth": "1Gbps", "latency": "250ms"}


def _resume_step(model, optimizer, sync, rank, step) -> None:
    backward(model, rank, step)
    optimizer.step()
    optimizer.zero_grad()
    sync.step()


def _resume(rank, world_size, root):
    group = dist.group.WORLD
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    saved = {}
    with OuterSync(model, optimizer, cluster_group=group, **RESUME_OPTIONS) as sync:
        for step in range(1, RESUME_STEPS + 1):
            _resume_step(model, optimizer, sync, rank, step)
            if step in (2 * H, 2 * H + 2):  # at a round end and mid-round, each with a sync on the 250 ms link
                path = root / f"rank{rank}_step{step}.pt"
                torch.save(
                    {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "sync": sync.state_dict()}, path
                )
                saved[step] = path
    straight = {"outer": sync.outer_params.clone(), "model": flat(model), "bytes": sync.channel.stats()["bytes_sent"]}

    resumed, in_flight = {}, {}
    for step, path in saved.items():
        state = torch.load(path, weights_only=True)
        in_flight[step] = state["sync"]["fragments"][0]["pending_seq"] >= state["sync"]["channel"]["num_transfers"]
        model = make_model(seed=99)  # the saved state, not the constructor's model, must decide where it resumes
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
        if step == 2 * H:  # build OuterSync, then load the model: either order works
            sync = OuterSync(model, optimizer, cluster_group=group, **RESUME_OPTIONS)
            model.load_state_dict(state["model"])
        else:
            model.load_state_dict(state["model"])
            sync = OuterSync(model, optimizer, cluster_group=group, **RESUME_OPTIONS)
        optimizer.load_state_dict(state["optimizer"])
        sync.load_state_dict(state["sync"])
        with sync:
            assert sync.num_steps == step
            for later in range(step + 1, RESUME_STEPS + 1):
                _resume_step(model, optimizer, sync, rank, later)
        resumed[step] = {
            "outer": sync.outer_params.clone(),
            "model": flat(model),
            "bytes": sync.channel.stats()["bytes_sent"],
        }
    return {"straight": straight, "resumed": resumed, "in_flight": in_flight, "errors": _errors(rank)}


def _errors(rank) -> dict[str, str]:
    """The message of each mistake that needs process groups (every rank makes it, so every rank raises)."""
    errors = {}

    def attempt(name, build, steps=0):
        try:
            model, optimizer, sync = build()
            with sync:
                for step in range(1, steps + 1):
                    _resume_step(model, optimizer, sync, rank, step)
        except ValueError as error:
            errors[name] = str(error)

    def build(*, seed=0, width=16, **options):
        def make():
            model = make_model(seed, width)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            return model, optimizer, OuterSync(model, optimizer, **{"inner_steps": H, **options})

        return make

    world = dist.group.WORLD
    only_rank_0 = dist.new_group([0])  # every rank creates every group; rank 1 is outside this one
    if rank == 1:
        attempt("not a member", build(cluster_group=only_rank_0))
    attempt("overlapping groups", build(cluster_group=world, dp_group=world))
    attempt("clusters start apart", build(seed=rank, cluster_group=world), steps=1)
    attempt("different models", build(width=16 + rank, cluster_group=world), steps=1)
    attempt("replicas start apart", build(seed=rank, cluster_group=None, dp_group=world))
    return errors


@pytest.fixture(scope="module")
def resume(tmp_path_factory):
    return run_ranks(_resume, 2, args=(tmp_path_factory.mktemp("outer-sync-resume"),))


@pytest.mark.dist
@pytest.mark.parametrize("save_step", [2 * H, 2 * H + 2])
def test_state_dict_resumes_a_sync_in_flight_like_the_uninterrupted_run(resume, save_step):
    for result in resume:
        straight, resumed = result["straight"], result["resumed"][save_step]
        assert result["in_flight"][save_step]  # the round's sync was still on the link when saved
        assert torch.equal(resumed["outer"], straight["outer"])
        assert torch.equal(resumed["model"], straight["model"])
        assert resumed["bytes"] == straight["bytes"] > 0  # the re-sent transfer is counted once
    assert torch.equal(resume[0]["straight"]["model"], resume[1]["straight"]["model"])  # the clusters agree


@pytest.mark.dist
@pytest.mark.parametrize(
    "mistake, words",
    [
        ("not a member", ["not a member of cluster_group"]),
        ("overlapping groups", ["share ranks [0, 1]", "meet only in this rank"]),
        ("clusters start apart", ["clusters of cluster_group start from different parameters", "same seed"]),
        ("different models", ["different numbers of parameter values", "163, 173"]),
        ("replicas start apart", ["data-parallel replicas of dp_group start from different parameters"]),
    ],
)
def test_mistakes_across_ranks_give_clear_errors(resume, mistake, words):
    ranks = [1] if mistake == "not a member" else [0, 1]
    for rank in ranks:
        message = resume[rank]["errors"][mistake]
        for word in words:
            assert word in message, message
