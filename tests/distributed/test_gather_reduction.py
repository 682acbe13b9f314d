"""The compressed outer sync (gather reduction) on 3 gloo ranks, with pseudo-gradients engineered round by round.

Each rank sets its parameters to `outer params - delta` just before a round boundary, so its pseudo-gradient is the
`delta` chosen here. The reference, computed in the test process with fresh codecs of the same settings and the error
feedback loop written out (cluster c sends decode(encode(pg_c,t + r_c,t-1)), r_c,t = what that lost), gives every
round's mean and the new outer params (outer SGD with lr 1 and no momentum: phi -= mean).
"""

import pytest
import torch

from dilocox.compress import build_codec
from dilocox.config import load_config
from dilocox.net.channel import WanChannel
from dilocox.sync import build_sync
from dilocox.topology import Topology, build_process_groups
from tests.multiproc import run_ranks

NUM_CLUSTERS = 3
SHAPES = [(20, 24), (20,)]
# the clusters' updates are independent noise, not one task's pseudo-gradients: the peer check would leave out some
BLOCKING_PLAIN_OUTER = [
    "--sync.kind=diloco",
    "--sync.inner_steps=1",
    "--sync.outer.lr=1",
    "--sync.outer.momentum=0",
    "--sync.local_residual=false",  # the codec's residual stays with it (auto would keep a share here)
    "--sync.drain_residual=false",
    "--sync.guard.peers=false",
]
ADAPTIVE = {"rank_min": 1, "rank_max": 8, "energy": 0.9, "window": 1}
# the rank of each cluster's matrix, per round: the adaptive codec must choose these, different in the same round
ADAPTIVE_RANKS = [(2, 6, 4), (6, 2, 3)]
CASES = {
    # name: (codec kind, its options, config overrides beyond them, rounds)
    "adaptive": ("adaptive", ADAPTIVE, [], len(ADAPTIVE_RANKS)),
    "lowrank": ("lowrank", {"rank": 1}, [], 3),
    "int4": ("int4", {"group_size": 480}, [], 3),  # one scale for the whole matrix: its small values round to 0
    "lowrank-no-feedback": ("lowrank", {"rank": 1}, ["--compression.error_feedback=false"], 3),
}


def initial_params() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def matrix_of_rank(rank: int, generator: torch.Generator) -> torch.Tensor:
    """(20, 24) with `rank` equal singular values and random singular vectors: keeping 90% of its energy takes all
    `rank` directions (rank - 1 keep at most 5/6)."""
    left = torch.linalg.qr(torch.randn(SHAPES[0][0], rank, generator=generator)).Q
    right = torch.linalg.qr(torch.randn(SHAPES[0][1], rank, generator=generator)).Q
    return 0.1 * left @ right.T


def delta(case: str, cluster: int, round_index: int) -> list[torch.Tensor]:
    """The pseudo-gradient cluster `cluster` produces in round `round_index` (0-based)."""
    generator = torch.Generator().manual_seed(100 * round_index + cluster)
    if case == "adaptive":
        matrix = matrix_of_rank(ADAPTIVE_RANKS[round_index][cluster], generator)
    else:
        matrix = 0.1 * torch.randn(SHAPES[0], generator=generator)  # full rank: a rank-1 codec drops most of it
    return [matrix, 0.1 * torch.randn(SHAPES[1], generator=generator)]


def _run(rank, world_size):
    groups = build_process_groups(Topology(NUM_CLUSTERS), rank)
    out = {}
    for case, (kind, options, overrides, rounds) in CASES.items():
        codec_options = [f"--compression.kind={kind}", *(f"--compression.{k}={v}" for k, v in options.items())]
        cfg = load_config(None, [*BLOCKING_PLAIN_OUTER, f"--train.steps={rounds}", *codec_options, *overrides])
        params = [torch.nn.Parameter(p) for p in initial_params()]
        channel = WanChannel(groups.cluster_group, bandwidth=None, latency_s=0.0)
        sync = build_sync(cfg, params, channel=channel, dp_group=groups.dp_group)
        trace = []
        for round_index in range(rounds):
            phi = sync.outer_params.split([p.numel() for p in params])
            with torch.no_grad():  # the round "trained" to outer params - delta
                for p, start, d in zip(params, phi, delta(case, rank, round_index), strict=True):
                    p.copy_(start.view_as(p) - d)
            sync.after_inner_step(round_index + 1)
            assert sync.status().boundary
            stats = channel.stats()
            trace.append((sync.outer_params.clone(), stats["bytes_sent"], stats["bytes_recv"]))
        channel.close()
        out[case] = trace
    return out


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_run, NUM_CLUSTERS)


def reference(case: str, *, feedback: bool):
    """Per round: the outer params after it, each cluster's payload size, and the rank each cluster's codec chose."""
    kind, options, _, rounds = CASES[case]
    codecs = [build_codec(kind, **options) for _ in range(NUM_CLUSTERS)]  # each cluster's own, same settings
    residuals = [None] * NUM_CLUSTERS
    phi = torch.cat([p.reshape(-1) for p in initial_params()])
    out = []
    for round_index in range(rounds):
        starts = phi.split([shape.numel() for shape in map(torch.Size, SHAPES)])
        decoded, sizes = [], []
        for cluster, codec in enumerate(codecs):
            # the sync's pseudo-gradient: round start - params, where params = round start - delta
            pseudo_grad = [
                s.view(d.shape) - (s.view(d.shape) - d)
                for s, d in zip(starts, delta(case, cluster, round_index), strict=True)
            ]
            if feedback and residuals[cluster] is not None:
                pseudo_grad = [g + r for g, r in zip(pseudo_grad, residuals[cluster], strict=True)]
            payload = codec.encode_list(pseudo_grad)
            sent = codec.decode_list(payload, SHAPES)
            residuals[cluster] = [g - s for g, s in zip(pseudo_grad, sent, strict=True)]
            decoded.append(torch.cat([s.reshape(-1) for s in sent]))
            sizes.append(payload.nbytes)
        phi = phi - sum(decoded) / NUM_CLUSTERS
        ranks = [codec.policy.ranks[-1] if kind == "adaptive" else None for codec in codecs]
        out.append((phi, sizes, ranks))
    return out


@pytest.mark.dist
def test_adaptive_ranks_differ_per_cluster_and_the_gathered_mean_is_exact(runs):
    want = reference("adaptive", feedback=True)
    assert [ranks for _, _, ranks in want] == [list(r) for r in ADAPTIVE_RANKS]  # the premise: different ranks
    received = [0] * NUM_CLUSTERS
    sent = [0] * NUM_CLUSTERS
    for round_index, (want_phi, sizes, _) in enumerate(want):
        assert len(set(sizes)) == NUM_CLUSTERS  # three payload sizes in one round
        for rank, result in enumerate(runs):
            outer_params, bytes_sent, bytes_recv = result["adaptive"][round_index]
            # every cluster applies the same mean: that of the payloads each cluster decoded for itself
            assert torch.equal(outer_params, runs[0]["adaptive"][round_index][0])
            torch.testing.assert_close(outer_params, want_phi, rtol=0, atol=1e-6)
            # the slow link carried exactly the others' payloads (ring all-gather: each rank receives every payload
            # but its own, and sends every payload but that of the next rank on the ring, which already has it)
            received[rank] += sum(sizes) - sizes[rank]
            sent[rank] += sum(sizes) - sizes[(rank + 1) % NUM_CLUSTERS]
            assert (bytes_sent, bytes_recv) == (sent[rank], received[rank])


@pytest.mark.dist
@pytest.mark.parametrize("case", ["lowrank", "int4"])
def test_error_feedback_is_carried_across_rounds_on_the_gather_path(runs, case):
    with_feedback = reference(case, feedback=True)
    without = reference(case, feedback=False)
    for round_index, ((phi, _, _), (phi_without, _, _)) in enumerate(zip(with_feedback, without, strict=True)):
        for result in runs:
            torch.testing.assert_close(result[case][round_index][0], phi, rtol=0, atol=1e-6)
        if round_index == 0:  # nothing to carry yet
            torch.testing.assert_close(phi, phi_without, rtol=0, atol=1e-6)
        else:  # from round 2 on, what round 1 dropped is sent: a clearly different update
            assert (phi - phi_without).abs().max() > 1e-2
    # the same sync with feedback off follows the no-feedback reference (so that reference is the one to tell apart)
    if case == "lowrank":
        reference_off = reference("lowrank-no-feedback", feedback=False)
        for round_index, (phi, _, _) in enumerate(reference_off):
            for result in runs:
                torch.testing.assert_close(result["lowrank-no-feedback"][round_index][0], phi, rtol=0, atol=1e-6)
