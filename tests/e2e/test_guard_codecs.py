"""The peer check under the `dilocox` preset (top-k int4 with error feedback, own_payload, local residual, drain), end
to end: `dilocox train` on the debug config with 3 clusters of one rank each, real processes over gloo, 6 rounds and
the drained residual (docs/design.md §4.5).

- clean: nothing is left out, and the run ends at the same final loss, to the bit, as the run without the peer check;
- cluster 2 sends x4, x9 or negated pseudo-gradients from round 2 on: it is left out of round 2 (the x4 payload is
  2.4 x as long as its peers', which the check of norms at 3 x let in: nothing was left out of that run), for its
  size or for its direction, and an honest cluster never is. It is not left out of every round it lies in: a
  cluster left out keeps the residual its last accepted round left (ErrorFeedback.undo), and where that outweighs
  the round's lie the payload passes (docs/design.md §4.5, what is and is not detected; the loss it costs per codec,
  3 seeds: benchmarks/results/guard_codecs/). What passed stays in its residual, and its drained residual is left
  out whatever it looks like: the rounds' check left that cluster out before (`PeerCheck.distrusts`).
"""

import json

import pytest

from dilocox.sync.robust import DISTRUSTED
from tests.e2e.helpers import DEBUG, dilocox, metrics

pytestmark = pytest.mark.e2e

COMMON = ("--preset=dilocox", "--topology.num_clusters=3", "--train.steps=60", "--network.bandwidth=unlimited",
          "--checkpoint.interval=0", "--eval.interval=0", "--run.num_threads=1")  # fmt: skip
LIES = {
    "x4": ("--faults.kind=scale", "--faults.scale=4", "--faults.cluster=2"),
    "x9": ("--faults.kind=scale", "--faults.scale=9", "--faults.cluster=2"),
    "sign": ("--faults.kind=sign", "--faults.cluster=2"),
}


def train(run_dir, *flags) -> tuple[dict, list[tuple[int | None, int, str]]]:
    """The run's summary and what each sync of this run (since its resume) left out: (round, None for the drain;
    cluster; why)."""
    result = dilocox("train", "--config", DEBUG, f"--run.out_dir={run_dir}", *COMMON, *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    left_out = [(e["round"], e["cluster"], e["why"]) for r in metrics(run_dir) for e in r.get("round_exclusions", [])]
    if not any(flag.startswith("--checkpoint.resume") for flag in flags):  # a resumed run counts from the start
        assert summary["guard_excluded_updates"] == len(left_out)
    return summary, left_out


def test_a_clean_run_is_the_same_with_and_without_the_peer_check(tmp_path):
    checked, left_out = train(tmp_path / "clean")
    unchecked, _ = train(tmp_path / "unchecked", "--sync.guard.peers=false")
    assert left_out == []
    assert checked["final_eval_loss"] == unchecked["final_eval_loss"]


@pytest.mark.parametrize("lie", LIES)
def test_a_lying_cluster_of_three_is_left_out_under_the_dilocox_preset(tmp_path, lie):
    _, left_out = train(tmp_path / lie, *LIES[lie])
    assert {cluster for _, cluster, _ in left_out} == {2}, left_out  # never an honest cluster
    *in_rounds, drained = left_out
    assert in_rounds[0][0] == 2 and None not in [round_index for round_index, _, _ in in_rounds], left_out
    assert drained == (None, 2, DISTRUSTED)  # its drained residual: caught before, not trusted with it
    if lie == "sign":  # for its direction
        assert all("points away from the others" in why for _, _, why in in_rounds)
    else:  # for its size: more than 2 x the round's median norm or median |value| sent
        assert all(" x the median " in why for _, _, why in in_rounds), left_out


def test_a_run_resumed_while_a_left_out_sync_is_in_flight_ends_as_the_uninterrupted_run(tmp_path):
    """The x4 liar's round-2 sync is launched at step 20 and lands, left out, 7 steps into round 3: a checkpoint of
    step 20 holds the residuals its error feedback returns to (`ErrorFeedback.undo`), so the resumed run takes the
    same verdicts and ends on the same loss, to the bit."""
    flags = (*LIES["x4"], "--checkpoint.interval=20", "--checkpoint.keep=5")
    straight, left_out = train(tmp_path / "straight", *flags)
    assert left_out[0][:2] == (2, 2)
    resumed, resumed_left_out = train(
        tmp_path / "resumed", *flags, f"--checkpoint.resume={tmp_path / 'straight' / 'checkpoints' / 'step_00000020'}"
    )
    assert resumed_left_out == left_out[len(left_out) - len(resumed_left_out) :] and resumed_left_out
    assert resumed_left_out[0][0] == 2  # the sync in flight at the checkpoint
    assert resumed["final_eval_loss"] == straight["final_eval_loss"]


def test_a_cluster_left_out_once_is_left_out_of_the_drain_also_in_a_resumed_run(tmp_path):
    """x4 in round 2 only: left out of round 2 and honest afterwards (its lie undone), and its drained residual is
    left out, because the rounds' check left it out before (`PeerCheck.distrusts`). The checkpoint of step 40 holds
    that record: resumed from there, the run leaves the drain out again and ends on the same loss, to the bit."""
    flags = (*LIES["x4"], "--faults.rounds=2", "--checkpoint.interval=20", "--checkpoint.keep=5")
    straight, left_out = train(tmp_path / "straight", *flags)
    assert [(round_index, cluster) for round_index, cluster, _ in left_out] == [(2, 2), (None, 2)]
    assert left_out[-1][2] == DISTRUSTED
    resumed, resumed_left_out = train(
        tmp_path / "resumed", *flags, f"--checkpoint.resume={tmp_path / 'straight' / 'checkpoints' / 'step_00000040'}"
    )
    assert resumed_left_out == [(None, 2, DISTRUSTED)]
    assert resumed["final_eval_loss"] == straight["final_eval_loss"]
    assert resumed["guard_excluded_updates"] == straight["guard_excluded_updates"] == 2
