"""One-step-delay overlap (`sync_delay = 1`) on real gloo ranks.

The golden trace in `golden/delayed_diloco.json` holds the outer parameters after each of 3 rounds (and after the
final flush) of a hand-written single-process reference; regenerate it with
`DILOCOX_REGEN_GOLDEN=1 python -m pytest tests/distributed/test_overlap.py` after a deliberate change of the algorithm.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from dilocox.compress import CompressionConfig
from dilocox.net.channel import WanChannel
from dilocox.sync import DiLoCoSync, SyncConfig
from dilocox.sync.config import OuterConfig, RoundConfig
from tests.distributed.resume import simulated, straight_and_resumed
from tests.multiproc import run_ranks

GOLDEN = Path(__file__).parent / "golden" / "delayed_diloco.json"
STEPS, H, LR, OUTER_LR, MOMENTUM = 6, 2, 0.1, 0.7, 0.9
TOPK = {"kind": "topk_int4", "density": 0.3, "feedback_decay": 0.9}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def batch(cluster: int, step: int):
    g = torch.Generator().manual_seed(100 * cluster + step)
    return torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)


def inner_step(model, optimizer, cluster, step):
    x, y = batch(cluster, step)
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def reference(merge: str, num_clusters: int = 2) -> list[list[float]]:
    """Delayed DiLoCo by hand: Delta_t is applied at the end of round t+1; the outer step is Nesterov SGD."""
    models = [make_model() for _ in range(num_clusters)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()])  # noqa: E731

    def load(m, vector):
        with torch.no_grad():
            for p, chunk in zip(m.parameters(), vector.split([p.numel() for p in m.parameters()]), strict=True):
                p.copy_(chunk.view_as(p))

    phi = flat(models[0]).clone()
    buf = torch.zeros_like(phi)
    round_start = [phi.clone() for _ in models]
    pending = None
    trace = []

    def outer_step(phi, buf, g):
        buf = MOMENTUM * buf + g
        return phi - OUTER_LR * (g + MOMENTUM * buf), buf

    for step in range(1, STEPS + 1):
        for c, (m, o) in enumerate(zip(models, optimizers, strict=True)):
            inner_step(m, o, c, step)
        if step % H:
            continue
        deltas = [round_start[c] - flat(m) for c, m in enumerate(models)]
        avg = torch.stack(deltas).mean(0)
        if pending is not None:
            phi, buf = outer_step(phi, buf, pending)
        pending = avg
        for c, m in enumerate(models):
            round_start[c] = phi - deltas[c] if merge == "keep_local" else phi.clone()
            load(m, round_start[c])
        trace.append(phi.tolist())
    phi, buf = outer_step(phi, buf, pending)
    trace.append(phi.tolist())
    return trace


def _delayed(rank, world_size, merge, sync_delay):
    model = make_model()
    channel = WanChannel(torch.distributed.group.WORLD, bandwidth=None, latency_s=0.0)
    cfg = SyncConfig(
        inner_steps=H, sync_delay=sync_delay, merge=merge, outer=OuterConfig(lr=OUTER_LR, momentum=MOMENTUM)
    )
    sync = DiLoCoSync(model.parameters(), cfg, channel=channel, dp_group=None, total_steps=STEPS)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    trace, models = [], []
    for step in range(1, STEPS + 1):
        inner_step(model, optimizer, rank, step)
        sync.after_inner_step(step)
        if sync.is_round_boundary(step):
            trace.append(sync.outer_params.tolist())
            models.append(sync.flat.gather_data())
    sync.flush()
    trace.append(sync.outer_params.tolist())
    models.append(sync.flat.gather_data())
    channel.close()
    return trace, models


def _all_variants(rank, world_size):
    return {
        (merge, delay): _delayed(rank, world_size, merge, delay)
        for merge in ("reset", "keep_local")
        for delay in (1,)  # blocking DiLoCo is checked against its reference in test_outer_reference.py
    }


@pytest.fixture(scope="module")
def variants():
    return run_ranks(_all_variants, 2)


@pytest.mark.dist
@pytest.mark.parametrize("merge", ["reset", "keep_local"])
def test_delayed_trace_matches_golden_and_reference(variants, merge):
    want = reference(merge)
    if os.environ.get("DILOCOX_REGEN_GOLDEN"):
        golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        golden[merge] = want
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())[merge]
    assert len(golden) == STEPS // H + 1
    torch.testing.assert_close(torch.tensor(want), torch.tensor(golden), rtol=0, atol=1e-6)
    for rank_result in variants:
        trace, models = rank_result[(merge, 1)]
        torch.testing.assert_close(torch.tensor(trace), torch.tensor(golden), rtol=0, atol=1e-6)
        # after the flush every cluster holds phi
        torch.testing.assert_close(models[-1], torch.tensor(golden[-1]), rtol=0, atol=1e-6)
    # the first round has nothing to apply yet: phi is still the initial point
    assert golden[0] == torch.cat([p.detach().reshape(-1) for p in make_model().parameters()]).tolist()


def _exposure(rank, world_size, sync_delay):
    """Rounds of H steps of compute on a virtual clock with a link that needs half a round per sync."""
    step_s, inner_steps, rounds = 0.0625, 4, 5
    model = torch.nn.Linear(64, 64)  # 4160 fp32 values: 16,640 bytes per sync on 2 ranks
    nbytes = sum(p.numel() for p in model.parameters()) * 4
    link_s = 0.5 * step_s * inner_steps
    latency = 0.0078125
    channel = simulated(
        lambda clock: WanChannel(
            torch.distributed.group.WORLD, bandwidth=nbytes / (link_s - latency), latency_s=latency, clock=clock
        )
    )
    sync = DiLoCoSync(
        model.parameters(), SyncConfig(inner_steps=inner_steps, sync_delay=sync_delay), channel=channel, dp_group=None
    )
    for step in range(1, rounds * inner_steps + 1):
        channel.clock.sleep(step_s)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        sync.after_inner_step(step)
    stats = channel.stats()  # before the flush: the final wait is the end of training, not a round
    sync.flush()
    channel.close()
    return stats, link_s


@pytest.mark.dist
def test_overlap_hides_the_link():
    delayed = run_ranks(_exposure, 2, args=(1,))
    blocking = run_ranks(_exposure, 2, args=(0,))
    for stats, link_s in delayed:
        assert stats["num_transfers"] == 4  # the fifth sync is waited for by the flush
        assert stats["link_busy_s"] == pytest.approx(4 * link_s, rel=1e-9)
        assert stats["exposed_s"] == 0.0  # each sync travels during a round that computes twice as long
    for stats, link_s in blocking:
        assert stats["num_transfers"] == 5
        assert stats["link_busy_s"] == pytest.approx(5 * link_s, rel=1e-9)
        assert stats["exposed_s"] == pytest.approx(stats["link_busy_s"], rel=1e-9)  # every sync waited for in full


def _checkpoint_in_flight(rank, world_size, options):
    """6 rounds on a slow link, checkpointed at the end of round 3 while that round's sync is on the wire; `options`
    are further SyncConfig fields (the merge rule; under `outer` the outer learning-rate schedule), and `compression` a
    codec's CompressionConfig fields."""
    inner_steps, rounds, step_s = 2, 6, 0.03
    options = dict(options)
    compression = CompressionConfig(**options.pop("compression", {}))
    outer_options = options.pop("outer", {})  # OuterConfig fields (the outer learning-rate schedule)
    # each sync needs ~0.25 s of link: far longer than the 0.06 s of a round (a codec's payload is under 1/4 of fp32)
    nbytes = sum(p.numel() for p in make_model().parameters()) * (4 if compression.kind == "none" else 1)

    def fresh():
        model = make_model()
        channel = simulated(
            lambda clock: WanChannel(torch.distributed.group.WORLD, bandwidth=nbytes / 0.25, latency_s=0.0, clock=clock)
        )
        outer = OuterConfig(lr=OUTER_LR, momentum=MOMENTUM, **outer_options)
        cfg = SyncConfig(inner_steps=inner_steps, outer=outer, sync_delay=1, **options)
        sync = DiLoCoSync(
            model.parameters(), cfg, compression, channel=channel, dp_group=None, total_steps=rounds * inner_steps
        )
        return model, channel, sync, torch.optim.SGD(model.parameters(), lr=LR)

    def train_step(model, optimizer, step):
        inner_step(model, optimizer, rank, step)

    out = straight_and_resumed(
        fresh, train_step, total_steps=rounds * inner_steps, save_after=3 * inner_steps, step_s=step_s
    )
    return out["straight"], out["resumed"], out["save_s"], out["in_flight"]


@pytest.mark.dist
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"merge": "eager"},
        {"merge": "lookahead", "outer": {"lr_schedule": "cosine", "warmup_rounds": 2}},
        {"merge": "eager", "overlap_steps": 1},
        {"merge": "eager", "overlap_steps": 1, "local_residual": True, "compression": TOPK},
    ],
    ids=["keep_local", "eager", "lookahead-cosine-warmup", "eager-overlap_steps", "eager-overlap_steps-local_residual"],
)
def test_checkpoint_does_not_wait_for_the_sync_in_flight_and_resume_is_exact(options):
    for straight, resumed, save_s, in_flight in run_ranks(_checkpoint_in_flight, 2, args=(options,)):
        assert in_flight  # the transfer was still on the wire when the state was saved
        assert save_s == 0.0  # ... and saving did not wait for it (a wait would move the virtual clock)
        assert torch.equal(straight[0], resumed[0])
        assert straight[1] == resumed[1]  # the re-sent transfer is counted once


def _delayed_sync_warnings(rank, world_size, link_s, step_s):
    """Delayed syncs of `link_s` seconds each over rounds of 2 steps of `step_s` (virtual seconds), then the final
    flush (which waits right after the last launch); returns the sync's warnings."""
    model = torch.nn.Linear(16, 16)
    nbytes = sum(p.numel() for p in model.parameters()) * 4
    channel = simulated(
        lambda clock: WanChannel(torch.distributed.group.WORLD, bandwidth=nbytes / link_s, latency_s=0.0, clock=clock)
    )
    sync = DiLoCoSync(model.parameters(), SyncConfig(inner_steps=2, sync_delay=1), channel=channel, dp_group=None)
    for step in range(1, 7):
        channel.clock.sleep(step_s)
        sync.after_inner_step(step)
    sync.flush()
    channel.close()
    return sync.warnings


@pytest.mark.dist
def test_warns_once_when_the_link_cannot_keep_up():
    # a link that needs 4 rounds per sync: the delayed sync cannot be hidden and the user is told what fits
    # (times are powers of two, so the advice is exact: 0.5 s of link over rounds of 2 x 0.0625 s needs H = 8)
    for warnings in run_ranks(_delayed_sync_warnings, 2, args=(0.5, 0.0625)):
        assert len(warnings) == 1
        assert "cannot keep up" in warnings[0]
        assert "one outer sync takes 0.50 s on the link but a round computes in 0.12 s" in warnings[0]
        assert "sync.inner_steps >= 8 " in warnings[0]
        assert "network.bandwidth >=" in warnings[0]


@pytest.mark.dist
def test_the_final_flush_does_not_warn_that_the_link_cannot_keep_up():
    # regression: the flush waits right after the last launch, with no compute to hide behind, and every run ended
    # with "a round computes in 0.00 s ... use sync.inner_steps >= 600" on an unlimited link. Here the link keeps
    # up (2 ms per sync, 0.2 s rounds), and the flush's wait is not judged.
    for warnings in run_ranks(_delayed_sync_warnings, 2, args=(0.002, 0.1)):
        assert warnings == []


def _fit_link(rank, world_size, max_steps):
    """A sync needs 0.5 s of link; a step computes in 0.0625 s (virtual seconds), so H = 2 leaves it exposed and
    fit_link raises H to ceil(1.1 x 0.5 / 0.0625) = 9."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    nbytes = sum(p.numel() for p in model.parameters()) * 4
    channel = simulated(
        lambda clock: WanChannel(torch.distributed.group.WORLD, bandwidth=nbytes / 0.5, latency_s=0.0, clock=clock)
    )
    cfg = SyncConfig(inner_steps=2, sync_delay=1, round=RoundConfig(fit_link=True, fit_link_max_steps=max_steps))
    sync = DiLoCoSync(model.parameters(), cfg, channel=channel, dp_group=None, total_steps=60)
    rounds = []
    for step in range(1, 61):
        channel.clock.sleep(0.0625)
        with torch.no_grad():
            model.weight.add_(0.01 * (rank + 1))  # each cluster moves its own way
        stats = sync.after_inner_step(step)
        if stats is not None:
            rounds.append((step, stats.inner_steps, stats.exposed_s))
    sync.flush()
    channel.close()
    return rounds, sync.inner_steps, sync.warnings, sync.outer_params


@pytest.mark.dist
def test_fit_link_raises_h_until_the_sync_is_hidden():
    results = run_ranks(_fit_link, 2, args=("auto",))
    (rounds, final_h, warnings, params), other = results
    assert rounds == other[0]  # both clusters end their rounds at the same steps
    assert torch.equal(params, other[3])
    # the first sync, launched at step 2 (0.125 s) and due at 0.625 s, is waited for at step 4 (0.25 s): 0.375 s
    assert rounds[0] == (4, 2, 0.375)
    assert final_h == 9
    # then hidden behind the 9-step rounds (0.5625 s of compute for 0.5 s of link); the last round, cut short by the
    # end of training at step 60, is not judged
    steps = [(13, 9), (22, 9), (31, 9), (40, 9), (49, 9), (58, 9), (60, 2)]
    assert [(step, h) for step, h, _ in rounds[1:]] == steps
    assert all(exposed == 0.0 for _, _, exposed in rounds[1:-1])
    assert warnings == []


@pytest.mark.dist
def test_fit_link_stops_at_its_maximum_and_says_so():
    for rounds, final_h, warnings, _ in run_ranks(_fit_link, 2, args=(4,)):
        assert final_h == 4
        assert max(h for _, h, _ in rounds) == 4
        assert len(warnings) == 1 and "sync.round.fit_link_max_steps = 4" in warnings[0]
