"""`sync.local_residual` on 3 gloo ranks against a single-process simulation of the 3 clusters.

The reference is written out plainly and shares no code with `dilocox.sync` (it uses the codec itself, tested on its
own in tests/unit/test_codecs.py): per cluster, H plain-SGD inner steps; pseudo-gradient g = round start - params; the
codec sends decode(encode(g + d r)) and keeps r = (g + d r) - decoded (d = compression.feedback_decay); phi takes the
mean of what was sent (outer SGD as `torch.optim.SGD` documents it). With local_residual each cluster also keeps
h / C, h = d r (what its next encoding will add), in its parameters:
- blocking: round t+1 starts at phi - h / C (h after round t's encoding);
- delayed: round t+1 starts where the merge rule says (keep_local phi - g, eager one outer step on a copy of phi with
  g / C), minus h / C with h read before round t's encoding (what the in-flight round does not carry yet);
  own_payload: one outer step on a copy of phi with what the cluster's codec sent of round t, minus h / C with h read
  after that encoding (as eager where the codec held nothing back before, in the first round);
- an average that lands k steps into a round (`overlap_steps`): phi takes it, each cluster's restart point becomes
  phi - h / C (h after the in-flight round's encoding), and its parameters move by what that point moved past the
  old round start; the final flush sets every cluster to phi.
With drain_residual the final flush then also sends every cluster's h = d r dense in int4 (the int4 codec, no error
feedback), and phi takes the mean of what arrives times the outer learning rate, at most 1 (averaged in, never
extrapolated), with no momentum step.
"""

import pytest
import torch

from dilocox.compress import CompressionConfig, build_codec
from dilocox.topology import Topology, build_process_groups
from tests.distributed.test_outer_reference import (
    STEPS,
    assert_traces_match,
    drive,
    flat,
    inner_step,
    load,
    make_model,
    sync_flags,
)
from tests.multiproc import run_ranks

NUM_CLUSTERS, H, INNER_LR, DECAY = 3, 3, 0.1, 0.9  # rounds end at steps 3, 6 and 7 (STEPS = 7)
CODEC = {"kind": "topk_int4", "density": 0.4, "feedback_decay": DECAY}
AVERAGING = {"outer_lr": 1.0, "outer_momentum": 0.0}
NESTEROV = {"outer_lr": 0.7, "outer_momentum": 0.9}
VARIANTS = {
    # name: the SyncConfig fields each variant sets (local_residual on unless named)
    "blocking-averaging": {"sync_delay": 0, **AVERAGING},
    "blocking-nesterov": {"sync_delay": 0, **NESTEROV},
    "delayed-eager": {"sync_delay": 1, "merge": "eager", **AVERAGING},
    "delayed-keep_local-nesterov": {"sync_delay": 1, "merge": "keep_local", **NESTEROV},
    "delayed-eager-overlap1": {"sync_delay": 1, "merge": "eager", "overlap_steps": 1, **AVERAGING},
    "delayed-eager-overlap1-off": {
        "sync_delay": 1,
        "merge": "eager",
        "overlap_steps": 1,
        "local_residual": False,
        **AVERAGING,
    },
    "blocking-averaging-off": {"sync_delay": 0, "local_residual": False, **AVERAGING},
    "blocking-averaging-drain": {"sync_delay": 0, "drain_residual": True, **AVERAGING},
    "delayed-keep_local-nesterov-drain": {"sync_delay": 1, "merge": "keep_local", "drain_residual": True, **NESTEROV},
    "delayed-eager-drain-only": {
        "sync_delay": 1,
        "merge": "eager",
        "local_residual": False,
        "drain_residual": True,
        **AVERAGING,
    },
    "delayed-eager-off": {"sync_delay": 1, "merge": "eager", "local_residual": False, **AVERAGING},
    "delayed-own_payload": {"sync_delay": 1, "merge": "own_payload", **AVERAGING},
    "delayed-own_payload-nesterov-overlap1": {
        "sync_delay": 1,
        "merge": "own_payload",
        "overlap_steps": 1,
        **NESTEROV,
    },
    "delayed-own_payload-off": {"sync_delay": 1, "merge": "own_payload", "local_residual": False, **AVERAGING},
    # the dilocox preset's outer lr: the rounds step 1.4 x the mean, the drain only 1 x
    "delayed-own_payload-lr1.4-drain": {
        "sync_delay": 1,
        "merge": "own_payload",
        "drain_residual": True,
        "outer_lr": 1.4,
        "outer_momentum": 0.0,
    },
}
DEFAULTS = {"merge": "keep_local", "overlap_steps": 0, "local_residual": True, "drain_residual": False}
DRAIN_CODEC = CompressionConfig(kind="int4", error_feedback=False)


def settings(name: str) -> dict:
    return DEFAULTS | VARIANTS[name]


def reference(sync_delay, merge, outer_lr, outer_momentum, overlap_steps, local_residual, drain_residual):
    """(outer params, every cluster's params) after each round and after the final flush."""
    models = [make_model() for _ in range(NUM_CLUSTERS)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=INNER_LR) for m in models]
    shapes = [p.shape for p in models[0].parameters()]
    codecs = [build_codec(CompressionConfig(**CODEC)) for _ in models]
    residuals = [None] * NUM_CLUSTERS
    phi = flat(models[0]).clone()
    buf = None

    def outer_step(phi, buf, g):
        if outer_momentum > 0:  # Nesterov: phi - lr (g + m buf), buf = m buf + g (g at the first step)
            buf = g.clone() if buf is None else outer_momentum * buf + g
            return phi - outer_lr * (g + outer_momentum * buf), buf
        return phi - outer_lr * g, buf

    def held_share(c):
        if not local_residual or residuals[c] is None:
            return torch.zeros_like(phi)
        return DECAY * residuals[c] / NUM_CLUSTERS

    def send(c, g):
        """What cluster c's codec sends of g (decoded), keeping its residual."""
        codec_input = g if residuals[c] is None else g + DECAY * residuals[c]
        decoded = round_trip(codecs[c], codec_input, shapes)
        residuals[c] = codec_input - decoded
        return decoded

    def start(g):
        if merge == "keep_local":
            return phi - g
        return outer_step(phi, buf, g / NUM_CLUSTERS)[0]  # eager (and own_payload's first round), on copies

    round_start = [phi.clone() for _ in models]
    pending = None
    trace = []
    last_boundary = 0
    for step in range(1, STEPS + 1):
        for cluster, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            inner_step(model, optimizer, cluster, step)
        if step % H and step != STEPS:
            if pending is not None and overlap_steps and step == last_boundary + overlap_steps:
                phi, buf = outer_step(phi, buf, pending)
                pending = None
                for c, model in enumerate(models):
                    restart = phi - held_share(c)
                    load(model, flat(model) + (restart - round_start[c]))
                    round_start[c] = restart
            continue
        last_boundary = step
        pseudo_grads = [round_start[c] - flat(m) for c, m in enumerate(models)]
        if sync_delay == 0:
            mean = sum(send(c, g) for c, g in enumerate(pseudo_grads)) / NUM_CLUSTERS
            phi, buf = outer_step(phi, buf, mean)
            round_start = [phi - held_share(c) for c in range(NUM_CLUSTERS)]
        else:
            if pending is not None:
                phi, buf = outer_step(phi, buf, pending)
            held_before = [held_share(c) for c in range(NUM_CLUSTERS)]
            fresh = [r is None for r in residuals]  # the codec holds nothing back yet: own_payload starts as eager
            sent = [send(c, g) for c, g in enumerate(pseudo_grads)]
            pending = sum(sent) / NUM_CLUSTERS
            round_start = [start(g) - held_before[c] for c, g in enumerate(pseudo_grads)]
            if merge == "own_payload":  # own decoded payload taken as the mean, minus h / C after the encoding
                round_start = [
                    round_start[c] if fresh[c] else outer_step(phi, buf, sent[c])[0] - held_share(c)
                    for c in range(NUM_CLUSTERS)
                ]
        for model, start_params in zip(models, round_start, strict=True):
            load(model, start_params)
        trace.append((phi.clone(), [flat(m) for m in models]))
    if pending is not None:
        phi, buf = outer_step(phi, buf, pending)
    if drain_residual:
        drain = build_codec(DRAIN_CODEC)
        phi = phi - min(outer_lr, 1.0) * sum(round_trip(drain, DECAY * r, shapes) for r in residuals) / NUM_CLUSTERS
    for model in models:
        load(model, phi)
    trace.append((phi.clone(), [flat(m) for m in models]))
    return trace


def round_trip(codec, vector, shapes):
    """What `codec` delivers of the flat `vector` (one tensor per shape, encoded and decoded), flat again."""
    tensors = [part.view(s) for part, s in zip(vector.split([s.numel() for s in shapes]), shapes, strict=True)]
    return torch.cat([t.reshape(-1) for t in codec.decode_list(codec.encode_list(tensors), shapes)])


def _run(rank, world_size):
    groups = build_process_groups(Topology(NUM_CLUSTERS), rank)
    common = ["--sync.kind=diloco", f"--sync.inner_steps={H}", f"--train.steps={STEPS}"]
    # each cluster fits its own random targets (inner_step): its updates need not agree with the others', so the
    # peer check is off; the reference is the plain mean of what was sent
    common.append("--sync.guard.peers=false")
    common += [f"--compression.{key}={value}" for key, value in CODEC.items()]
    traces, flush_bytes = {}, {}
    for name in VARIANTS:
        flush_bytes[name] = []
        flags = common + sync_flags(settings(name))
        traces[name] = drive(groups, rank, flags, make_model(), flush_bytes=flush_bytes[name])
    return traces, flush_bytes


@pytest.fixture(scope="module")
def results():
    return run_ranks(_run, NUM_CLUSTERS)


@pytest.fixture(scope="module")
def runs(results):
    return [traces for traces, _ in results]


@pytest.mark.dist
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_local_residual_matches_the_single_process_simulation(runs, variant):
    assert_traces_match([traces[variant] for traces in runs], reference(**settings(variant)))
    for (phi_0, _), (phi_1, _), (phi_2, _) in zip(*(traces[variant] for traces in runs), strict=True):
        assert torch.equal(phi_0, phi_1) and torch.equal(phi_0, phi_2)  # phi only takes the true averages


@pytest.mark.dist
def test_the_drain_sends_one_int4_payload_per_cluster(results):
    """The drain's bytes: this rank's int4 payload of the whole model to each of the C - 1 others (the all-gather's
    ring count). Blocking, the flush sends nothing else; delayed, the run sends exactly that more than the same run
    without the drain (their rounds are the same until the flush; its last round's transfer may complete before or
    during the flush, so whole runs are compared)."""
    shapes = [p.shape for p in make_model().parameters()]
    drain_payload = build_codec(DRAIN_CODEC).encode_list([torch.ones(s) for s in shapes]).nbytes
    assert drain_payload > 0
    for _, flush_bytes in results:
        before, after = flush_bytes["blocking-averaging"]
        assert after - before == 0
        before, after = flush_bytes["blocking-averaging-drain"]
        assert after - before == (NUM_CLUSTERS - 1) * drain_payload
        total_off, total_drained = flush_bytes["delayed-eager-off"][1], flush_bytes["delayed-eager-drain-only"][1]
        assert total_off > 0
        assert total_drained == total_off + (NUM_CLUSTERS - 1) * drain_payload


def test_the_reference_keeps_the_held_back_share_and_it_changes_the_run():
    """The codec really holds part back, local_residual really moves the clusters' parameters by it, the clusters
    start apart by their own residuals, and the runs end elsewhere than without it."""
    on, off = reference(**settings("blocking-averaging")), reference(**settings("blocking-averaging-off"))
    torch.testing.assert_close(on[0][0], off[0][0], rtol=0, atol=0)  # round 1 sends the same either way
    for cluster in range(NUM_CLUSTERS):
        assert torch.equal(off[0][1][cluster], off[0][0])  # without it every cluster restarts at phi
        assert (on[0][1][cluster] - on[0][0]).abs().max() > 1e-3  # with it, at phi - h / C
    assert (on[0][1][0] - on[0][1][1]).abs().max() > 1e-3
    assert (on[-1][0] - off[-1][0]).abs().max() > 1e-4
    early_on = reference(**settings("delayed-eager-overlap1"))
    early_off = reference(**settings("delayed-eager-overlap1-off"))
    assert (early_on[1][1][0] - early_off[1][1][0]).abs().max() > 1e-3


def test_the_reference_drain_moves_only_the_final_phi():
    """The drain is not a no-op: the rounds are the same, and only the flush moves phi (by what was held back)."""
    drained, kept = reference(**settings("blocking-averaging-drain")), reference(**settings("blocking-averaging"))
    for (phi_a, params_a), (phi_b, params_b) in zip(drained[:-1], kept[:-1], strict=True):
        assert torch.equal(phi_a, phi_b) and all(torch.equal(a, b) for a, b in zip(params_a, params_b, strict=True))
    assert (drained[-1][0] - kept[-1][0]).abs().max() > 1e-3


def test_the_reference_own_payload_starts_elsewhere_than_eager():
    """`own_payload` is not `eager` under another name: the first round, with nothing held back before it, starts
    where eager's does; from the second on the clusters start elsewhere, and the run ends elsewhere."""
    own, eager = reference(**settings("delayed-own_payload")), reference(**settings("delayed-eager"))
    assert torch.equal(own[0][0], eager[0][0]) and torch.equal(own[1][0], eager[1][0])
    assert all(torch.equal(a, b) for a, b in zip(own[0][1], eager[0][1], strict=True))  # round 1: as eager
    assert (own[1][1][0] - eager[1][1][0]).abs().max() > 1e-3  # round 2 on: its own payload
    assert (own[-1][0] - eager[-1][0]).abs().max() > 1e-4
