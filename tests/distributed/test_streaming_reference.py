"""Streaming DiLoCo as its paper and torchft's `DiLoCo` define it: fragment 0 syncs first, each fragment's sync is
launched `overlap` (tau) steps before its boundary, and the live parameters become lerp(phi, live, alpha) once it
lands. Two real gloo clusters drive `OuterSync` with the setting of torchft's mocked regression test, and every
parameter after every step, and phi at every sync, must equal torchft's own fixture trajectories
(tests/distributed/golden/streaming_torchft.json, transcribed from torchft's test_fixtures)."""

import json
from pathlib import Path

import pytest
import torch

from dilocox import OuterSync
from dilocox.topology import Topology, build_process_groups
from tests.multiproc import run_ranks

GOLDEN = json.loads((Path(__file__).parent / "golden" / "streaming_torchft.json").read_text())
H, STEPS, GRAD, INNER_LR, OUTER_LR = 6, 15, 2.0, 1.0, 2.0


def _trajectories(rank: int, world_size: int) -> list[dict]:
    """Every case of the golden file on this cluster: each step's parameters and phi at each sync step."""
    groups = build_process_groups(Topology(world_size), rank)
    results = []
    for case in GOLDEN["cases"]:
        weights = [torch.nn.Parameter(torch.ones(1, 1)) for _ in range(2)]  # one fragment each
        inner = torch.optim.SGD(weights, lr=INNER_LR)
        sync = OuterSync(
            weights,
            inner,
            cluster_group=groups.cluster_group,
            kind="diloco",
            inner_steps=H,
            compression="none",
            sync_delay=0,
            outer_optimizer=lambda params: torch.optim.SGD(params, lr=OUTER_LR),
            fragments=2,
            overlap_steps=case["overlap"],
            alpha=case["alpha"],
        )
        params, outer = [[w.item() for w in weights]], {0: [f.outer_params.item() for f in sync.diloco.fragments]}
        for step in range(1, STEPS + 1):
            for w in weights:
                w.grad = torch.full_like(w, GRAD)
            inner.step()
            sync.step()
            params.append([w.item() for w in weights])
            if step % (H // 2) == 0:
                outer[step] = [f.outer_params.item() for f in sync.diloco.fragments]
        sync.close()
        results.append({"params": params, "outer_params": outer})
    return results


@pytest.mark.dist
def test_fragments_overlap_and_mixing_follow_torchfts_trajectories_in_all_six_cases():
    for cluster_results in run_ranks(_trajectories, 2):
        for case, got in zip(GOLDEN["cases"], cluster_results, strict=True):
            where = f"overlap {case['overlap']}, alpha {case['alpha']}"
            torch.testing.assert_close(
                torch.tensor(got["params"]), torch.tensor(case["params"]), rtol=0, atol=1e-6, msg=where
            )
            for step, phi in case["outer_params"].items():
                assert got["outer_params"][int(step)] == pytest.approx(phi, abs=1e-6), (where, step)
