"""`dilocox` (sync_delay 1, int4 payloads) inside clusters of 2 data-parallel replicas, and of 2 pipeline stages,
with AdamW and with Muon (`train.optimizer = muon`) as the inner optimizer.

Each case runs the Trainer on 4 gloo ranks, straight for 3 rounds and again resumed from the checkpoint of round 2,
whose sync is still in flight (launched, not applied). Checked: replicas and clusters agree on the outer params at
every round, and on everything after the flush; the slow-link bytes are the int4 payload sizes worked out by hand
(a dp replica sends its share of its stage, a pipeline stage its own parameters; once per round and once more for
the drain of `sync.drain_residual`, a `dilocox` default); the resumed run ends bit for bit
where the straight one does; and the two stages together hold the unsplit model's outer params.
"""

import math
from pathlib import Path

import pytest
import torch

from dilocox.config import load_config
from dilocox.trainer import Trainer, prepare_data
from tests.multiproc import run_ranks

CORPUS = "corpus.txt"
H, STEPS, GROUP = 2, 6, 64  # rounds end at steps 2, 4, 6; the checkpoint of step 4 holds round 2's sync in flight
COMMON = [
    "--model.flavor=debug",
    "--data.vocab_size=300",
    "--train.seq_len=32",
    "--train.micro_batch_size=4",
    f"--train.steps={STEPS}",
    "--train.warmup_steps=1",
    "--preset=dilocox-lowrank",
    f"--sync.inner_steps={H}",
    "--compression.kind=int4",
    f"--compression.group_size={GROUP}",
    "--network.bandwidth=unlimited",
    "--network.latency=0",
    "--eval.interval=0",
    "--eval.max_batches=1",
    f"--checkpoint.interval={H}",
    "--checkpoint.keep=5",
    "--metrics.progress=false",
]


VARIANTS = {
    "dp": ["--topology.dp_degree=2"],
    "pp": ["--topology.pp_degree=2"],
    # MuLoCo: Muon on each stage's block matrices, AdamW on the rest; the pipeline one under bf16 autocast
    "dp-muon": ["--topology.dp_degree=2", "--train.optimizer=muon"],
    "pp-muon-bf16": ["--topology.pp_degree=2", "--train.optimizer=muon", "--train.dtype=bf16"],
}


def int4_nbytes(numel: int) -> int:
    """int4 payload of one tensor: an fp16 scale per group of GROUP values, two values per byte."""
    return 2 * math.ceil(numel / GROUP) + math.ceil(numel / 2)


def config(corpus: Path, *overrides: str):
    cfg = load_config(None, [*COMMON, f"--data.path={corpus}", *overrides])
    cfg.validate(cfg.world_size)
    return cfg


def _one_run(cfg, rank, data, run_dir: Path, resume: Path | None = None) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(cfg, rank=rank, run_dir=run_dir, data=data)
    initial = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    if resume is not None:
        trainer.resume(resume)
    sync, rounds = trainer.sync, []
    after_inner_step = sync.after_inner_step

    def after_and_record(step, **timing):  # at each round boundary: the outer params, where the next round starts
        stats = after_inner_step(step, **timing)
        if sync.status().boundary:
            start = torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])
            rounds.append({"step": step, "outer": sync.outer_params.clone(), "start": start})
        return stats

    sync.after_inner_step = after_and_record
    trainer.train()  # flushes the last sync at the last step
    out = {
        "coords": trainer.coords,
        "initial": initial,
        "rounds": rounds,
        "outer": sync.outer_params.clone(),
        "model": {name: p.detach().clone() for name, p in trainer.model.named_parameters()},
        "bytes": (trainer.channel.stats()["bytes_sent"], trainer.channel.stats()["bytes_recv"]),
        "outer_steps": sync.outer_step,
    }
    trainer.close()
    return out


def _all_runs(rank, world_size, data, root):
    out = {}
    for name, overrides in VARIANTS.items():
        cfg = config(root / CORPUS, *overrides)
        straight = _one_run(cfg, rank, data, root / name / "straight")
        checkpoint = root / name / "straight" / "checkpoints" / f"step_{2 * H:08d}"
        out[name] = straight, _one_run(cfg, rank, data, root / name / "resumed", resume=checkpoint)
    # The unsplit model on 2 clusters needs a world of 2: ranks 0-1 and 2-3 re-form one each and both run it
    # (starting processes is most of this test's cost), which also shows it is deterministic.
    pair, pair_rank = divmod(rank, 2)
    torch.distributed.destroy_process_group()
    init = f"file://{root / f'pair{pair}.init'}"
    torch.distributed.init_process_group("gloo", init_method=init, rank=pair_rank, world_size=2)
    out["unsplit"] = _one_run(config(root / CORPUS), pair_rank, data, root / f"unsplit{pair}")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of this module in one set of 4 processes: starting them is most of the cost."""
    root = tmp_path_factory.mktemp("dilocox-parallel")
    # a small corpus: its 300-token BPE trains in well under a second; tokenized once here for every rank
    words = "the outer step averages what each cluster learned while the slow link carries it".split()
    generator = torch.Generator().manual_seed(0)
    lines = [" ".join(words[i] for i in torch.randint(len(words), (12,), generator=generator)) for _ in range(400)]
    (root / CORPUS).write_text("\n".join(lines) + "\n")
    data = prepare_data(config(root / CORPUS))
    ranks = run_ranks(_all_runs, 4, args=(data, root))
    return {name: [rank[name] for rank in ranks] for name in (*VARIANTS, "unsplit")}


def check_agreement_and_resume(results, *, stage_of, replica_of) -> None:
    """Ranks of one stage agree on the outer params at every round, and replicas (same cluster and stage) on where
    the next round starts (keep_local: outer params minus the cluster's own last pseudo-gradient); after the flush
    each rank's model is its outer params; the resumed run equals the straight one bit for bit."""
    for straight, resumed in results:
        assert [r["step"] for r in straight["rounds"]] == [H, 2 * H, 3 * H]
        assert [r["step"] for r in resumed["rounds"]] == [3 * H]  # resumed at step 2H: one more round
        assert straight["outer_steps"] == resumed["outer_steps"] == STEPS // H
        assert torch.equal(torch.cat([p.reshape(-1) for p in straight["model"].values()]), straight["outer"])
        assert torch.equal(resumed["outer"], straight["outer"])
        assert all(torch.equal(resumed["rounds"][0][k], straight["rounds"][-1][k]) for k in ("outer", "start"))
        assert all(torch.equal(resumed["model"][k], v) for k, v in straight["model"].items())
        assert resumed["bytes"] == straight["bytes"]  # the sync re-sent on resume is counted once
    for group_of, key in ((stage_of, "outer"), (replica_of, "start")):
        groups: dict = {}
        for straight, _ in results:
            groups.setdefault(group_of(straight["coords"]), []).append(straight)
        for first, *others in groups.values():
            for other in others:
                for a, b in zip(first["rounds"], other["rounds"], strict=True):
                    assert torch.equal(a[key], b[key])
                assert torch.equal(first["outer"], other["outer"])
    # the outer step moved the params: a run that never applied a sync would pass the checks above too
    first_round = results[0][0]["rounds"][0]["outer"]
    assert not torch.equal(results[0][0]["outer"], first_round)


@pytest.mark.dist
def test_dilocox_with_two_dp_replicas_per_cluster(runs):
    results = runs["dp"]
    # one stage: all four ranks agree on the outer params; the two replicas of a cluster also on its params
    check_agreement_and_resume(results, stage_of=lambda c: c.pp, replica_of=lambda c: (c.cluster, c.pp))
    assert all(len(straight["rounds"]) == 3 for straight, _ in results)
    by_cluster = {straight["coords"].cluster: straight["rounds"][0]["start"] for straight, _ in results}
    assert not torch.equal(by_cluster[0], by_cluster[1])  # keep_local: the clusters start round 2 apart
    # slow-link bytes: per round the two replicas of a cluster send the stage's int4 payload between them, each a
    # run of whole tensors of it (the low-rank codecs need whole matrices); with 2 clusters what a replica receives
    # is its peer's payload of the same tensors
    sizes = [int4_nbytes(p.numel()) for p in results[0][0]["model"].values()]
    payloads = STEPS // H + 1  # one per round, and the final flush's drain of what the codec held back (same slice)
    by_dp = {straight["coords"].dp: straight["bytes"] for straight, _ in results}
    for straight, _ in results:
        assert straight["bytes"] == by_dp[straight["coords"].dp]  # the same on both clusters
        assert straight["bytes"][0] == straight["bytes"][1]
    assert by_dp[0][0] + by_dp[1][0] == payloads * sum(sizes)
    prefix_sums = [payloads * sum(sizes[:k]) for k in range(len(sizes) + 1)]
    assert by_dp[0][0] in prefix_sums
    assert 0.25 < by_dp[0][0] / (payloads * sum(sizes)) < 0.75  # each replica sends about half


@pytest.mark.dist
def test_dilocox_with_two_pipeline_stages_per_cluster(runs):
    results = runs["pp"]
    check_agreement_and_resume(results, stage_of=lambda c: c.pp, replica_of=lambda c: (c.cluster, c.pp))
    payloads = STEPS // H + 1  # one per round, and the final flush's drain of what the codec held back
    stages = {}
    for straight, _ in results:
        stage = straight["coords"].pp
        # a stage rank sends its stage's payload each round and receives the other cluster's of the same stage
        want = payloads * sum(int4_nbytes(p.numel()) for p in straight["model"].values())
        assert straight["bytes"] == (want, want)
        stages[stage] = straight["model"]
    assert stages[0].keys().isdisjoint(stages[1].keys())
    # the stages' outer params are the unsplit model's: to float rounding (and the rare int4 value it rounds the
    # other way), far closer than how far the run moved them; a stage synced or stepped wrongly is off by ~all of it
    unsplit = runs["unsplit"]
    for other in unsplit[1:]:
        assert all(torch.equal(other["model"][k], v) for k, v in unsplit[0]["model"].items())
    whole, initial = unsplit[0]["model"], unsplit[0]["initial"]
    assert whole.keys() == stages[0].keys() | stages[1].keys()
    staged = {**stages[0], **stages[1]}
    difference = torch.cat([(staged[name] - value).reshape(-1) for name, value in whole.items()])
    moved = torch.cat([(value - initial[name]).reshape(-1) for name, value in whole.items()])
    assert difference.norm() < 1e-2 * moved.norm()  # measured: 1.3e-4


@pytest.mark.dist
@pytest.mark.parametrize(("name", "adamw"), [("dp-muon", "dp"), ("pp-muon-bf16", "pp")])
def test_muon_inner_optimizer_with_dp_replicas_and_pipeline_stages(runs, name, adamw):
    """train.optimizer = muon (per-stage split, one state dict for Muon and AdamW): replicas and clusters agree
    as with AdamW, the resumed run ends bit for bit where the straight one does, and the same bytes cross the slow
    link; the parameters are not AdamW's, so Muon did step them."""
    results = runs[name]
    check_agreement_and_resume(results, stage_of=lambda c: c.pp, replica_of=lambda c: (c.cluster, c.pp))
    for (straight, _), (with_adamw, _) in zip(results, runs[adamw], strict=True):
        assert straight["bytes"] == with_adamw["bytes"]
        assert not torch.equal(straight["outer"], with_adamw["outer"])
