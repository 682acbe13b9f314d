"""`topology.dp_mode = shard` (FSDP2 inside a cluster) against `replicate`, on 2 clusters x dp 2 of gloo ranks.

Each case runs the Trainer on 4 ranks for 3 rounds of the blocking fp32 DiLoCo (`--preset=diloco`, grad clipping
on), and the sharded one again resumed from the checkpoint of round 2; then with the one-step delay and phi
evaluated at every step, with int4 payloads, and on 8 ranks with 2 pipeline stages (1F1B). Checked: the sharded
run's losses are the replicated run's to float rounding at every step of every rank; every rank puts the same bytes
on the slow link (its 1/2 of the stage, both ways: rank d's FSDP shard instead of slice d of the replicated stage);
each rank's parameters, gradients, inner and outer state in the memory report are half the replicated rank's; the
resumed run ends bit for bit where the straight one does; and the checkpoint's consolidated model (`dilocox eval`,
`export`) is the whole model, as the replicated run's is.
"""

from pathlib import Path

import pytest
import torch

from dilocox.checkpoint import consolidated_model_state
from dilocox.config import load_config
from dilocox.trainer import Trainer, prepare_data
from tests.distributed.test_dilocox_parallel import GROUP as PARALLEL_GROUP
from tests.distributed.test_dilocox_parallel import int4_nbytes
from tests.multiproc import run_ranks

CORPUS = "corpus.txt"
H, STEPS = 2, 6
COMMON = [
    "--model.flavor=debug",
    "--data.vocab_size=300",
    "--train.seq_len=32",
    "--train.micro_batch_size=4",
    f"--train.steps={STEPS}",
    "--train.warmup_steps=1",
    "--train.grad_clip=1.0",
    "--preset=diloco",
    f"--sync.inner_steps={H}",
    "--topology.dp_degree=2",
    "--network.bandwidth=unlimited",
    "--network.latency=0",
    "--eval.interval=0",
    "--eval.max_batches=1",
    "--eval.final_max_batches=1",
    f"--checkpoint.interval={H}",
    "--checkpoint.keep=5",
    "--metrics.progress=false",
]
DELAYED = ["--sync.sync_delay=1", "--eval.interval=1"]  # phi != the live params mid-round: every step evaluates phi
GROUP = PARALLEL_GROUP  # the group size int4_nbytes counts with
INT4 = ["--preset=dilocox", "--compression.kind=int4", f"--compression.group_size={GROUP}"]
PER_STEP, MODES = ("allreduce", "cocktail"), ("replicate", "shard")
VARIANTS = {
    "replicate": ["--topology.dp_mode=replicate"],
    "shard": ["--topology.dp_mode=shard"],
    "replicate-delayed": ["--topology.dp_mode=replicate", *DELAYED],
    "shard-delayed": ["--topology.dp_mode=shard", *DELAYED],
    "shard-int4": ["--topology.dp_mode=shard", *INT4],
    **{f"{mode}-muon": [f"--topology.dp_mode={mode}", "--train.optimizer=muon"] for mode in MODES},
    **{f"{mode}-{kind}": [f"--topology.dp_mode={mode}", f"--preset={kind}"] for kind in PER_STEP for mode in MODES},
}


def config(corpus: Path, *overrides: str):
    cfg = load_config(None, [*COMMON, f"--data.path={corpus}", *overrides])
    cfg.validate(cfg.world_size)
    return cfg


def _one_run(cfg, rank, data, run_dir: Path, resume: Path | None = None) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(cfg, rank=rank, run_dir=run_dir, data=data)
    if resume is not None:
        trainer.resume(resume)
    losses, train_step = [], trainer.train_step

    def recorded_step():
        losses.append(train_step())
        return losses[-1]

    trainer.train_step = recorded_step
    summary = trainer.train()
    stats = trainer.channel.stats()
    out = {
        "coords": trainer.coords,
        "losses": losses,
        "outer": trainer.sync.diloco.outer_params.clone() if cfg.sync.has_outer_loop else None,
        "shards": [p.to_local().numel() for p in trainer.model.parameters()] if cfg.topology.dp_mode == "shard" else [],
        "bytes": (stats["bytes_sent"], stats["bytes_recv"]),
        "memory": trainer.memory[rank],
        "eval_loss": trainer.last_eval_loss,
        "summary": summary,
    }
    trainer.close()
    return out


def _all_runs(rank, world_size, data, root):
    out = {}
    for name, overrides in VARIANTS.items():
        out[name] = _one_run(config(root / CORPUS, *overrides), rank, data, root / name)
    checkpoint = root / "shard" / "checkpoints" / f"step_{2 * H:08d}"
    out["resumed"] = _one_run(config(root / CORPUS, *VARIANTS["shard"]), rank, data, root / "resumed", checkpoint)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of this module in one set of 4 processes: starting them is most of the cost."""
    root = tmp_path_factory.mktemp("fsdp")
    words = "each rank keeps a shard of the stage and the slow link carries the shards".split()
    generator = torch.Generator().manual_seed(0)
    lines = [" ".join(words[i] for i in torch.randint(len(words), (12,), generator=generator)) for _ in range(400)]
    (root / CORPUS).write_text("\n".join(lines) + "\n")
    data = prepare_data(config(root / CORPUS))
    ranks = run_ranks(_all_runs, 4, args=(data, root))
    return {name: [rank[name] for rank in ranks] for name in (*VARIANTS, "resumed")}, root


PIPELINE = ["--topology.pp_degree=2", "--train.pipeline_schedule=1f1b", "--train.num_microbatches=4", *DELAYED]
PIPELINE_VARIANTS = {
    "replicate-pp": ["--topology.dp_mode=replicate", *PIPELINE],
    "shard-pp": ["--topology.dp_mode=shard", *PIPELINE],
}


def _variant_runs(rank, world_size, data, root, variants, sharded):
    """Every run of `variants`, then `sharded` again, resumed from its checkpoint of round 2 ("resumed-" + its name)."""
    out = {name: _one_run(config(root / CORPUS, *o), rank, data, root / name) for name, o in variants.items()}
    checkpoint = root / sharded / "checkpoints" / f"step_{2 * H:08d}"
    resumed = config(root / CORPUS, *variants[sharded])
    out[f"resumed-{sharded}"] = _one_run(resumed, rank, data, root / f"resumed-{sharded}", checkpoint)
    return out


def _run_variants(root, world_size, variants, sharded, *flags):
    """`_variant_runs` on `world_size` gloo ranks: each run's results by name, one per rank."""
    data = prepare_data(config(root / CORPUS, *flags))
    ranks = run_ranks(_variant_runs, world_size, args=(data, root, variants, sharded))
    return {name: [rank[name] for rank in ranks] for name in ranks[0]}


@pytest.fixture(scope="module")
def pipeline_runs(runs):
    """2 clusters x dp 2 x pp 2: 8 ranks, each stage sharded over its cluster's 2 dp ranks under the 1F1B schedule."""
    return _run_variants(runs[1], 8, PIPELINE_VARIANTS, "shard-pp")


@pytest.mark.dist
def test_shard_composes_with_the_pipeline_as_replicate_does(runs, pipeline_runs):
    for replicated, sharded, resumed in zip(*pipeline_runs.values(), strict=True):
        assert sharded["coords"] == replicated["coords"]
        assert sharded["losses"] == pytest.approx(replicated["losses"], rel=1e-5, abs=1e-6)
        assert sharded["bytes"] == replicated["bytes"]
        for key in ("params", "grads", "inner_state", "outer_state", "total"):
            assert 2 * sharded["memory"][key] == replicated["memory"][key], key
        assert resumed["losses"] == sharded["losses"][2 * H :]
        assert torch.equal(resumed["outer"], sharded["outer"])
        assert resumed["bytes"] == sharded["bytes"]
    sharded = pipeline_runs["shard-pp"][0]
    assert sharded["eval_loss"] == pytest.approx(pipeline_runs["replicate-pp"][0]["eval_loss"], rel=1e-5)
    _, root = runs
    step = f"checkpoints/step_{STEPS:08d}"
    whole, _ = consolidated_model_state(root / "shard-pp" / step, agreed=True)
    replicated, _ = consolidated_model_state(root / "replicate-pp" / step, agreed=True)
    assert whole.keys() == replicated.keys()  # both stages, each from its 2 dp ranks' shards
    for name, tensor in replicated.items():
        torch.testing.assert_close(whole[name], tensor, rtol=1e-4, atol=1e-5)


@pytest.mark.dist
def test_per_step_kinds_reduce_each_rank_s_gradient_shard_over_the_clusters(runs):
    """allreduce: FSDP's dp mean, then each rank's shard all-reduced over the clusters, as replicate's slice d is:
    the same losses and bytes. cocktail compresses each rank's shard (its random and top-k picks are of another
    vector than the replicated slice), so only its bytes are the same."""
    results, _ = runs
    for replicated, sharded in zip(results["replicate-allreduce"], results["shard-allreduce"], strict=True):
        assert sharded["losses"] == pytest.approx(replicated["losses"], rel=1e-5, abs=1e-6)
        assert sharded["bytes"] == replicated["bytes"]
        assert 2 * sharded["memory"]["total"] == replicated["memory"]["total"]
    for replicated, sharded in zip(results["replicate-cocktail"], results["shard-cocktail"], strict=True):
        assert sharded["losses"][0] == replicated["losses"][0]
        assert sharded["bytes"] == replicated["bytes"]


@pytest.mark.dist
def test_shard_evaluates_phi_mid_round_and_trains_on_as_replicate(runs):
    """With the one-step delay the live params differ from phi inside a round; an evaluation of phi at every step
    gathers phi's shards in its forward and must leave the live shards to the next training forward."""
    results, _ = runs
    for replicated, sharded in zip(results["replicate-delayed"], results["shard-delayed"], strict=True):
        assert sharded["losses"] == pytest.approx(replicated["losses"], rel=1e-5, abs=1e-6)
        assert sharded["bytes"] == replicated["bytes"]
    assert results["shard-delayed"][0]["eval_loss"] == pytest.approx(
        results["replicate-delayed"][0]["eval_loss"], rel=1e-5
    )
    assert results["shard-delayed"][0]["losses"] != results["shard"][0]["losses"]  # the delay changed the run


@pytest.mark.dist
def test_a_shard_rank_sends_the_int4_payload_of_its_own_shards(runs):
    results, _ = runs
    payloads = STEPS // H + 1  # one per round, and the final flush's drain of what the codec held back (int4 too)
    for sharded in results["shard-int4"]:
        want = payloads * sum(int4_nbytes(numel) for numel in sharded["shards"])
        assert sharded["bytes"] == (want, want)  # 2 clusters: it receives its peer's payload of the same shards


@pytest.mark.dist
def test_shard_trains_as_replicate_with_the_same_bytes_and_half_the_state(runs):
    results, _ = runs
    for replicated, sharded in zip(results["replicate"], results["shard"], strict=True):
        assert replicated["coords"] == sharded["coords"]
        assert len(sharded["losses"]) == STEPS
        assert sharded["losses"][0] == replicated["losses"][0]  # the same start and batch
        assert sharded["losses"] == pytest.approx(replicated["losses"], rel=1e-5, abs=1e-6)
        assert sharded["losses"][-1] < sharded["losses"][0] - 0.1  # it trained
        # the debug stage's tensors have even first dimensions: rank d's FSDP shard has the values of slice d of
        # the replicated stage, so the fp32 ring all-reduce over 2 clusters moves the same bytes
        assert sharded["bytes"] == replicated["bytes"]
        assert sharded["bytes"][0] > 0
        for key in ("params", "grads", "inner_state", "outer_state", "total"):
            assert 2 * sharded["memory"][key] == replicated["memory"][key], key
    numel = sum(r["outer"].numel() for r in results["replicate"][:1])
    assert sum(s["outer"].numel() for s in results["shard"][:2]) == numel  # the two shards make one stage
    # every cluster holds the same phi on its dp rank d; the shards' concatenation is the replicated phi's values
    by_dp = {s["coords"].dp: s["outer"] for s in results["shard"]}
    for s in results["shard"]:
        assert torch.equal(s["outer"], by_dp[s["coords"].dp])
    summary = results["shard"][0]["summary"]
    assert summary.wan_bytes_total == results["replicate"][0]["summary"].wan_bytes_total
    assert summary.allreduce_equiv_bytes == results["replicate"][0]["summary"].allreduce_equiv_bytes
    assert summary.final_eval_loss == pytest.approx(results["replicate"][0]["summary"].final_eval_loss, rel=1e-5)


@pytest.mark.dist
def test_a_resumed_shard_run_ends_where_the_straight_one_does(runs):
    results, _ = runs
    for straight, resumed in zip(results["shard"], results["resumed"], strict=True):
        assert resumed["losses"] == straight["losses"][2 * H :]
        assert torch.equal(resumed["outer"], straight["outer"])
        assert resumed["bytes"] == straight["bytes"]
        assert resumed["eval_loss"] == straight["eval_loss"]


@pytest.mark.dist
def test_the_consolidated_model_of_a_shard_checkpoint_is_the_whole_stage(runs):
    _, root = runs
    step = root / "{}" / "checkpoints" / f"step_{STEPS:08d}"
    whole, used_outer = consolidated_model_state(Path(str(step).format("shard")), agreed=True)
    replicated, _ = consolidated_model_state(Path(str(step).format("replicate")), agreed=True)
    assert used_outer
    assert whole.keys() == replicated.keys()
    for name, tensor in replicated.items():
        assert whole[name].shape == tensor.shape, name
        torch.testing.assert_close(whole[name], tensor, rtol=1e-4, atol=1e-5)


@pytest.mark.dist
def test_muon_steps_sharded_matrices_as_whole_ones_with_half_the_inner_state(runs):
    results, _ = runs
    for replicated, sharded in zip(results["replicate-muon"], results["shard-muon"], strict=True):
        assert sharded["losses"] == pytest.approx(replicated["losses"], rel=1e-5, abs=1e-6)
        assert sharded["bytes"] == replicated["bytes"]
        for key in ("params", "grads", "inner_state", "outer_state", "total"):
            assert 2 * sharded["memory"][key] == replicated["memory"][key], key
    assert results["shard-muon"][0]["losses"][1:] != pytest.approx(results["shard"][0]["losses"][1:], rel=1e-3)


def _muon_steps(rank, world_size, rows):
    """3 steps of `ShardedMuon` on a matrix of `rows` x 64 sharded over 2 ranks, and of torch's Muon on the whole."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from dilocox.optim import MUON_LR_CONVENTION, ShardedMuon

    torch.manual_seed(0)
    sharded, whole = torch.nn.Linear(64, rows, bias=False), torch.nn.Linear(64, rows, bias=False)
    whole.load_state_dict(sharded.state_dict())
    mesh = DeviceMesh.from_group(torch.distributed.group.WORLD, "cpu")
    fully_shard(sharded, mesh=mesh)
    options = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr_fn": MUON_LR_CONVENTION}
    optimizer, reference = ShardedMuon(sharded.parameters(), **options), torch.optim.Muon(whole.parameters(), **options)
    gathers = []
    for step in range(3):
        grad = torch.randn(rows, 64, generator=torch.Generator().manual_seed(step))
        sharded.weight.grad = distribute_tensor(grad, mesh, [Shard(0)])
        whole.weight.grad = grad
        with CommDebugMode() as comm:
            optimizer.step()
        reference.step()
        gathers.append(comm.get_total_counts())
    return {"equal": torch.equal(sharded.weight.full_tensor(), whole.weight), "collectives": gathers}


@pytest.mark.dist
@pytest.mark.parametrize("rows", [96, 97], ids=["even", "uneven"])
def test_sharded_muon_gathers_each_update_once_and_equals_muon_on_the_whole_matrix(rows):
    """The momentum stays sharded; one all-gather of the update, Newton-Schulz on the whole matrix, this rank's rows
    of it: bit for bit torch's Muon on the unsharded matrix, with FSDP2's uneven cut too (49 + 48 rows)."""
    for result in run_ranks(_muon_steps, 2, args=(rows,)):
        assert result == {"equal": True, "collectives": [1, 1, 1]}
