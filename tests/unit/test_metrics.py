"""The metrics sinks (TensorBoard, W&B), their preflight checks, and the end-of-run summary text."""

import dataclasses
import json
import sys

import pytest

from dilocox.cli import main
from dilocox.metrics import (
    METRICS_FILE,
    TENSORBOARD_DIR,
    RunSummary,
    TensorBoardSink,
    check_sinks,
    format_summary,
    numeric_items,
    read_metrics,
    truncate_metrics,
)


def test_sinks_take_the_finite_numbers_of_a_record():
    record = {"step": 10, "loss": 5.25, "tokens": 1024, "eval_loss": None, "kind": "diloco", "flag": True}
    record["nan"] = float("nan")
    assert numeric_items(record) == {"step": 10, "loss": 5.25, "tokens": 1024}


def scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_sink_writes_numeric_keys_and_a_resume_replaces_what_followed_the_checkpoint(tmp_path):
    sink = TensorBoardSink(tmp_path, start_step=0)
    for step in (5, 10, 15):
        sink.log({"step": step, "loss": 1.0 / step, "kind": "diloco", "eval_loss": None})
    sink.close()
    assert scalars(tmp_path / TENSORBOARD_DIR) == {"loss": [(5, 0.20000000298023224), (10, 0.10000000149011612),
                                                            (15, 0.06666667014360428)]}  # fmt: skip
    # resumed from the checkpoint at step 10: step 15 is logged again, and only the new value is kept
    sink = TensorBoardSink(tmp_path, start_step=10)
    for step in (15, 20):
        sink.log({"step": step, "loss": 2.0 / step})
    sink.close()
    steps = [step for step, _ in scalars(tmp_path / TENSORBOARD_DIR)["loss"]]
    values = [value for _, value in scalars(tmp_path / TENSORBOARD_DIR)["loss"]]
    assert steps == [5, 10, 15, 20]
    assert values == pytest.approx([1 / 5, 1 / 10, 2 / 15, 2 / 20], rel=1e-7)


@pytest.mark.parametrize(
    "flag, modules, extra",
    [
        ("--metrics.tensorboard=true", ("tensorboard", "torch.utils.tensorboard"), "tensorboard"),
        ("--metrics.wandb=offline", ("wandb",), "wandb"),
    ],
)
def test_a_missing_sink_package_fails_before_anything_is_written(tmp_path, monkeypatch, capsys, flag, modules, extra):
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)  # what Python does for a package that is not installed
    with pytest.raises(ValueError, match=rf"pip install 'dilocox\[{extra}\]'"):
        check_sinks(tensorboard="tensorboard" in flag, wandb="offline" if "wandb" in flag else "off")
    run_dir = tmp_path / "run"
    assert main(["train", "--model.flavor=debug", f"--run.out_dir={run_dir}", flag]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dilocox: error: metrics.")
    assert f"pip install 'dilocox[{extra}]'" in err
    assert not run_dir.exists()


def test_wandb_online_without_a_login_fails_before_anything_is_written(tmp_path, monkeypatch, capsys):
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    check_sinks(tensorboard=False, wandb="offline")  # offline needs no login
    run_dir = tmp_path / "run"
    assert main(["train", "--model.flavor=debug", f"--run.out_dir={run_dir}", "--metrics.wandb=online"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dilocox: error: metrics.wandb = online needs a W&B login: run `wandb login`")
    assert not run_dir.exists()


SUMMARY = RunSummary(
    final_eval_loss=5.0,
    initial_eval_loss=7.0,
    tokens=1000,
    wall_s=2.0,
    tokens_per_s=500.0,
    eval_s=0.0,
    wan_bytes_total=100,
    allreduce_equiv_bytes=1000,
    link_busy_s=0.5,
    exposed_comm_s=0.1,
    hidden_comm_fraction=0.8,
    steps=20,
    outer_steps=2,
    sync_kind="diloco",
    sync_delay=0,
    merge="reset",
    inner_steps=10,
    final_inner_steps=10,
    flavor="debug",
    num_params=1,
    rank_state_bytes=[],
    num_clusters=2,
    dp_degree=1,
    pp_degree=1,
    bandwidth="1Gbps",
    latency="10ms",
    checkpoint=None,
    run_dir="runs/x",
)


def test_summary_names_the_latency_only_where_the_link_is_emulated():
    first = format_summary(SUMMARY).splitlines()[0]
    assert first.endswith("20 steps, 2 outer steps, link 1Gbps / 10ms")
    unlimited = format_summary(dataclasses.replace(SUMMARY, bandwidth="unlimited")).splitlines()[0]
    assert unlimited.endswith("20 steps, 2 outer steps, link unlimited (not emulated)")
    assert "10ms" not in format_summary(dataclasses.replace(SUMMARY, bandwidth="unlimited"))


def test_summary_says_whose_slow_link_bytes_it_counts(tmp_path):
    static = [line for line in format_summary(SUMMARY).splitlines() if "slow link" in line]
    assert len(static) == 1 and " sent by all ranks; AllReduce would send " in static[0]
    elastic = dataclasses.replace(SUMMARY, wan_bytes_clusters=[0])
    line = next(line for line in format_summary(elastic).splitlines() if "slow link" in line)
    assert " sent by cluster 0's ranks; AllReduce would send " in line
    assert line.endswith(f"; an elastic run counts each cluster alone, not all {SUMMARY.num_clusters})")
    elastic.write(tmp_path)
    assert RunSummary.read(tmp_path).wan_bytes_clusters == [0]
    SUMMARY.write(tmp_path)
    assert RunSummary.read(tmp_path).wan_bytes_clusters is None


def test_a_half_written_last_line_is_left_out_and_a_resume_drops_it(tmp_path):
    """metrics.jsonl is read while the run appends to it (`dilocox plot` of a live run, a test waiting for a step),
    and a killed run may leave its last line torn: only complete lines are records."""
    lines = ['{"step": 10, "loss": 5.5}', '{"step": 20, "loss": 5.1}', '{"step": 30, "loss": 4.9}']
    path = tmp_path / METRICS_FILE
    path.write_text("\n".join(lines) + '\n{"step": 40, "lo')
    assert [record["step"] for record in read_metrics(tmp_path)] == [10, 20, 30]
    truncate_metrics(tmp_path, 20)
    assert path.read_text() == lines[0] + "\n" + lines[1] + "\n"  # kept lines stay byte for byte
    path.write_text(lines[0] + "\n")
    assert read_metrics(tmp_path) == [{"step": 10, "loss": 5.5}]
    path.write_text(lines[0] + "\nnot json\n" + lines[1] + "\n")  # a complete line that is not a record: damage
    with pytest.raises(ValueError, match="line 2 is not a metrics record"):
        read_metrics(tmp_path)
    assert read_metrics(tmp_path / "no-such-run") == []


def test_summary_tells_the_wait_for_the_link_from_the_wait_for_other_clusters(tmp_path):
    """A straggler is not the link: its wait is said apart, and the hidden share counts only the link's."""
    line = next(line for line in format_summary(dataclasses.replace(SUMMARY, peer_wait_s=5.65)).splitlines()
                if line.startswith("  link time"))  # fmt: skip
    assert (
        line
        == "  link time   busy 0.50 s; rank 0 waited 0.10 s for the link (80% hidden) and 5.65 s for other clusters"
    )
    data = json.loads(json.dumps(dataclasses.asdict(SUMMARY)))
    del data["peer_wait_s"]  # a summary written before the wait for peers was recorded
    (tmp_path / "summary.json").write_text(json.dumps(data))
    assert RunSummary.read(tmp_path).peer_wait_s == 0.0
