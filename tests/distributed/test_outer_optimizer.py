"""A custom outer optimizer through the Python API (`OuterSync(..., outer_optimizer=factory)`), on 2 gloo clusters.

A plain `torch.optim.Adam` steps phi, blocking and under the one-step delay with a codec whose merge rule predicts
through it (`own_payload`): the clusters learn a shared regression task (the agreed model's loss falls far below
its start: below half of it), they end bit for bit alike, and the optimizer that stepped phi is Adam, with its
moments as the state.
"""

import pytest
import torch
import torch.distributed as dist

from dilocox import OuterSync
from tests.multiproc import run_ranks

STEPS, H = 60, 5
VARIANTS = {
    "blocking": {"kind": "diloco"},
    "delayed-int4-own-payload": {"kind": "dilocox", "compression": "int4", "drain_residual": False},
}


def teacher() -> torch.nn.Module:
    torch.manual_seed(123)
    return torch.nn.Linear(8, 2)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # every cluster starts from the same parameters
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def batch(cluster: int, step: int, target: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1000 * cluster + step))
    with torch.no_grad():
        return x, target(x)


def eval_loss(model: torch.nn.Module, target: torch.nn.Module) -> float:
    x, y = batch(99, 0, target)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), y))


def _train(rank, world_size):
    target = teacher()
    results = {}
    for name, options in VARIANTS.items():
        model = make_model()
        inner = torch.optim.AdamW(model.parameters(), lr=0.01)
        initial = eval_loss(model, target)
        with OuterSync(
            model,
            inner,
            cluster_group=dist.group.WORLD,
            inner_steps=H,
            outer_optimizer=lambda params: torch.optim.Adam(params, lr=0.02),
            **options,
        ) as sync:
            for step in range(1, STEPS + 1):
                x, y = batch(rank, step, target)
                torch.nn.functional.mse_loss(model(x), y).backward()
                inner.step()
                inner.zero_grad()
                sync.step()
        optimizer = sync.diloco.fragments[0].outer.optimizer
        state = optimizer.state[sync.outer_params]
        results[name] = {
            "initial": initial,
            "final": eval_loss(model, target),
            "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "outer": sync.outer_params.clone(),
            "optimizer": type(optimizer).__name__,
            "adam_steps": int(state["step"]),
            "moments": sorted(key for key, value in state.items() if torch.is_tensor(value) and value.numel() > 1),
        }
    return results


@pytest.mark.dist
def test_a_plain_adam_outer_optimizer_trains_and_the_clusters_agree():
    per_rank = run_ranks(_train, 2)
    for name in VARIANTS:
        first, second = (results[name] for results in per_rank)
        assert torch.equal(first["params"], second["params"]) and torch.equal(first["outer"], second["outer"]), name
        assert torch.equal(first["params"], first["outer"]), name  # after the flush: the agreed model
        assert first["final"] < 0.5 * first["initial"], (name, first["initial"], first["final"])
        assert first["optimizer"] == "Adam" and first["moments"] == ["exp_avg", "exp_avg_sq"], name
        assert first["adam_steps"] == STEPS // H  # one Adam step per round, none for a prediction
