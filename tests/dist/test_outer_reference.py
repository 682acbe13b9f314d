"""Blocking and delayed DiLoCo on 3 gloo ranks against a single-process simulation of the 3 clusters.

The reference below is the algorithm of DESIGN.md section 3 written out plainly, sharing no code with
`dilocox.sync`: per cluster, H plain-SGD inner steps from the round start; pseudo-gradient = round start - params;
mean over the clusters; outer SGD as `torch.optim.SGD` documents it (buf = m buf + g, or g at the first step;
Nesterov steps along g + m buf, plain momentum along buf). With `sync_delay = 1` the outer step applies the previous
round's mean, and the next round starts at the outer params (`reset`) or at the outer params minus this cluster's own
last pseudo-gradient (`keep_local`); the mean still in flight is applied by the flush at the end.
"""

import pytest
import torch

from dilocox.config import load_config
from dilocox.net.channel import WanChannel
from dilocox.sync import build_sync
from dilocox.topology import Topology, build_process_groups
from tests.multiproc import run_ranks

NUM_CLUSTERS, H, STEPS, INNER_LR = 3, 3, 7, 0.1  # rounds end at steps 3, 6 and 7 (cut short by the end of training)

VARIANTS = {
    # name: (sync_delay, merge, outer_lr, outer_momentum, nesterov)
    "blocking-keep_local": (0, "keep_local", 0.7, 0.9, True),
    "blocking-reset": (0, "reset", 0.7, 0.9, True),
    "delayed-keep_local": (1, "keep_local", 0.7, 0.9, True),
    "delayed-reset-heavy-ball": (1, "reset", 0.5, 0.6, False),
}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # every cluster starts from the same parameters
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def inner_step(model, optimizer, cluster: int, step: int, sync=None) -> None:
    generator = torch.Generator().manual_seed(1000 * cluster + step)
    x, y = torch.randn(5, 4, generator=generator), torch.randn(5, 2, generator=generator)
    torch.nn.functional.mse_loss(model(x), y).backward()
    if sync is not None:
        sync.reduce_gradients()  # a no-op here (one rank per cluster), as the trainer calls it
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def load(model, vector: torch.Tensor) -> None:
    with torch.no_grad():
        for p, chunk in zip(model.parameters(), vector.split([p.numel() for p in model.parameters()]), strict=True):
            p.copy_(chunk.view_as(p))


def reference(sync_delay, merge, outer_lr, outer_momentum, nesterov) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """(outer params, every cluster's params) after each round and after the final flush."""
    models = [make_model() for _ in range(NUM_CLUSTERS)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=INNER_LR) for m in models]
    phi = flat(models[0]).clone()
    buf = None
    round_start = [phi.clone() for _ in models]
    pending = None

    def outer_step(phi, buf, g):
        buf = g.clone() if buf is None else outer_momentum * buf + g
        direction = g + outer_momentum * buf if nesterov else buf
        return phi - outer_lr * direction, buf

    trace = []
    for step in range(1, STEPS + 1):
        for cluster, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            inner_step(model, optimizer, cluster, step)
        if step % H and step != STEPS:
            continue
        pseudo_grads = [round_start[c] - flat(m) for c, m in enumerate(models)]
        mean = sum(pseudo_grads) / NUM_CLUSTERS
        if sync_delay == 0:
            phi, buf = outer_step(phi, buf, mean)
            round_start = [phi.clone() for _ in models]
        else:
            if pending is not None:
                phi, buf = outer_step(phi, buf, pending)
            pending = mean
            round_start = [phi - g if merge == "keep_local" else phi.clone() for g in pseudo_grads]
        for model, start in zip(models, round_start, strict=True):
            load(model, start)
        trace.append((phi.clone(), [flat(m) for m in models]))
    if pending is not None:
        phi, buf = outer_step(phi, buf, pending)
        for model in models:
            load(model, phi)
    trace.append((phi.clone(), [flat(m) for m in models]))
    return trace


def _run(rank, world_size):
    groups = build_process_groups(Topology(NUM_CLUSTERS), rank)
    traces = {}
    for name, (sync_delay, merge, outer_lr, outer_momentum, nesterov) in VARIANTS.items():
        cfg = load_config(None, [
            "--sync.kind=diloco", f"--sync.inner_steps={H}", f"--train.steps={STEPS}",
            f"--sync.sync_delay={sync_delay}", f"--sync.merge={merge}", f"--sync.outer_lr={outer_lr}",
            f"--sync.outer_momentum={outer_momentum}", f"--sync.nesterov={str(nesterov).lower()}",
        ])  # fmt: skip
        model = make_model()
        channel = WanChannel(groups.cluster_group, bandwidth=None, latency_s=0.0)
        sync = build_sync(cfg, model.parameters(), channel=channel, dp_group=groups.dp_group)
        optimizer = torch.optim.SGD(model.parameters(), lr=INNER_LR)
        trace = []
        for step in range(1, STEPS + 1):
            inner_step(model, optimizer, rank, step, sync)
            sync.after_inner_step(step)
            if sync.is_round_boundary(step):
                trace.append((sync.outer_params.clone(), flat(model)))
        sync.flush()
        trace.append((sync.outer_params.clone(), flat(model)))
        channel.close()
        traces[name] = trace
    return traces


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_run, NUM_CLUSTERS)


@pytest.mark.dist
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_outer_loop_matches_the_single_process_simulation(runs, variant):
    want = reference(*VARIANTS[variant])
    assert len(want) == 3 + 1  # rounds ending at steps 3, 6, 7, then the flush
    for cluster, traces in enumerate(runs):
        got = traces[variant]
        assert len(got) == len(want)
        for (outer_params, params), (want_phi, want_params) in zip(got, want, strict=True):
            torch.testing.assert_close(outer_params, want_phi, rtol=0, atol=1e-6)
            torch.testing.assert_close(params, want_params[cluster], rtol=0, atol=1e-6)
    # the outer steps moved the parameters (else a sync that applied nothing would pass), and keep_local's clusters
    # really start their rounds apart
    assert (want[-1][0] - want[0][0]).abs().max() > 1e-2
    if VARIANTS[variant][:2] == (1, "keep_local"):
        assert (want[0][1][0] - want[0][1][1]).abs().max() > 1e-2
