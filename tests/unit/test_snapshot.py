"""The comparison logic of benchmarks/snapshot.py (its runs are real CLI runs and not part of the suite): which fields
it reads from a run directory, what it leaves out as timing, and how two recordings are told apart."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import torch

from dilocox.checkpoint import save_checkpoint

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("snapshot_benchmark", REPO / "benchmarks" / "snapshot.py")
snapshot = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = snapshot  # dataclasses resolve the module's annotations through sys.modules
_spec.loader.exec_module(snapshot)


def _rank_state(*, elapsed_s: float = 1.5, outer: torch.Tensor | None = None) -> dict:
    outer = torch.arange(6, dtype=torch.float32) if outer is None else outer
    return {
        "model": {"w": outer.view(2, 3).clone(), "b": torch.zeros(2)},
        "sync": {"outer_params": outer, "outer_step": 4, "channel": {"bytes_sent": 100, "link_busy_s": 0.25}},
        "channel": {"bytes_sent": 100, "bytes_recv": 90, "link_busy_s": 0.25, "exposed_s": 0.1},
        "trainer": {"step": 12, "elapsed_s": elapsed_s, "initial_eval_loss": 6.25},
    }


def _write_run(run_dir: Path, *, timing: float, loss: float = 5.5, state: dict | None = None) -> None:
    # step 1's bytes change with `timing`: a delayed sync's bytes show at a step the communicator thread decides
    rows = [
        {"step": 1, "loss": 6.0, "lr": 1e-3, "tokens_per_s": 1000.0 * timing, "wan_bytes_sent": int(50 * timing)},
        {
            "step": 2,
            "loss": loss,
            "lr": 5e-4,
            "tokens_per_s": 900.0 * timing,
            "wan_bytes_sent": 100,
            "eval_loss": 5.75,
            "round_compute_s": 0.5 * timing,
        },
    ]
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    summary = {"final_eval_loss": 5.75, "outer_steps": 1, "wall_s": 3.0 * timing, "hidden_comm_fraction": timing,
               "run_dir": str(run_dir), "checkpoint": str(run_dir / "checkpoints" / "step_00000002")}  # fmt: skip
    (run_dir / "summary.json").write_text(json.dumps(summary))
    state = state if state is not None else _rank_state(elapsed_s=timing)
    save_checkpoint(run_dir, 2, state, rank=0, meta={"world_size": 1, "tokenizer_vocab": "abc"}, keep=1)


def test_two_runs_that_differ_only_in_timing_and_paths_record_the_same_fields(tmp_path):
    _write_run(tmp_path / "a", timing=1.0)
    _write_run(tmp_path / "b", timing=2.0)
    a, b = snapshot.observe(tmp_path / "a"), snapshot.observe(tmp_path / "b")
    assert snapshot.diff_fields(a, b) == []
    assert a["losses"] == [6.0, 5.5] and a["final_loss"] == 5.5 and a["eval_losses"] == [[2, 5.75]]
    assert a["rank0.channel"] == {"bytes_sent": 100, "bytes_recv": 90}
    assert a["summary.outer_steps"] == 1 and a["metrics.wan_bytes_sent"]["last"] == [2, 100]
    assert not any(key.endswith(("_s", "run_dir", "checkpoint", "hidden_comm_fraction")) for key in a)
    assert a["checkpoints"] == ["step_00000002"] and "rank0.outer_params" in a and "rank0.state" in a


def test_one_ulp_in_a_loss_or_one_bit_of_the_outer_params_is_a_difference_and_named(tmp_path):
    _write_run(tmp_path / "a", timing=1.0)
    _write_run(tmp_path / "b", timing=1.0, loss=math.nextafter(5.5, 6.0))
    flipped = torch.arange(6, dtype=torch.float32)
    flipped.view(torch.int32)[4] ^= 1  # the lowest mantissa bit of one agreed parameter
    _write_run(tmp_path / "c", timing=1.0, state=_rank_state(outer=flipped))
    a, b, c = (snapshot.observe(tmp_path / name) for name in "abc")
    assert snapshot.diff_fields(a, b) == [
        "final_loss: 5.5 -> 5.500000000000001",
        "losses: [1] 5.5 -> 5.500000000000001 (1 of 2 differ)",
    ]
    d = {**a, "metrics.lr": {"sha256": "0" * 64, "last": a["metrics.lr"]["last"]}}
    assert snapshot.diff_fields(a, d) == ["metrics.lr: the series differs before its last (step, value) [2, 0.0005]"]
    assert [line.split(":")[0] for line in snapshot.diff_fields(a, c)] == [
        "rank0.model",
        "rank0.outer_params",
        "rank0.state",
    ]


def test_state_digest_ignores_key_order_and_timing_but_not_settings():
    base = _rank_state()
    reordered = dict(reversed(list(_rank_state(elapsed_s=99.0).items())))
    assert snapshot.state_digest(base) == snapshot.state_digest(reordered)
    other = _rank_state()
    other["sync"]["outer_step"] = 5
    assert snapshot.state_digest(base) != snapshot.state_digest(other)


def test_missing_fields_nan_and_errors():
    nan = float("nan")
    assert snapshot.diff_fields({"x": nan, "y": [1, 2]}, {"x": nan, "y": [1, 2]}) == []  # NaN == NaN, exactly
    assert snapshot.diff_fields({"x": 1}, {"x": 1, "rank3.model": "ab"}) == ['rank3.model: (absent) -> "ab"']
    recorded = {"fields": {"x": 1}}
    refused = snapshot.Outcome("pp2", error="exit 2: dilocox: error: sync.merge = 'x' is not one of ...")
    assert snapshot.compare_outcome(recorded, refused) == ("ERROR", [refused.error])
    assert snapshot.compare_outcome(recorded, snapshot.Outcome("pp2", fields={"x": 1})) == ("identical", [])
    assert snapshot.compare_outcome(recorded, snapshot.Outcome("pp2", fields={"x": 2})) == ("DIFFERENT", ["x: 1 -> 2"])
