"""What a run logs besides metrics.jsonl, seen from the outside: TensorBoard event files and an offline W&B run hold
the jsonl's values, `dilocox plot` draws them, and the start and end of a run say the right things."""

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from dilocox.tools.plot import CHARTS, load_run
from tests.e2e.helpers import DEBUG, dilocox, metrics

pytestmark = pytest.mark.e2e

SHORT = ["--config", DEBUG, "--train.steps=20", "--sync.inner_steps=5", "--eval.interval=10", "--checkpoint.keep=5"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two short runs: DiLoCo on the emulated 1 Gbps link with TensorBoard and a checkpoint interval of 7 at H = 5;
    DiLoCoX (adaptive low-rank codec) on an unlimited link with an offline W&B run."""
    root = tmp_path_factory.mktemp("logging")
    wandb_home = root / "wandb-home"  # W&B's own settings and caches, kept out of the user's home
    env = {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_X_DISABLE_STATS": "true",  # no system-metrics sampler
        "WANDB_CONFIG_DIR": str(wandb_home / "config"),
        "WANDB_CACHE_DIR": str(wandb_home / "cache"),
        "WANDB_DATA_DIR": str(wandb_home / "data"),
    }
    diloco, dilocox_run = root / "diloco", root / "dilocox"
    first = dilocox("train", *SHORT, f"--run.out_dir={diloco}", "--checkpoint.interval=7", "--metrics.tensorboard")
    second = dilocox("train", *SHORT, f"--run.out_dir={dilocox_run}", "--preset=dilocox-lowrank",
                     "--checkpoint.interval=0", "--network.bandwidth=unlimited", "--metrics.wandb=offline",
                     env=env)  # fmt: skip
    for result in (first, second):
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return {"diloco": (diloco, first), "dilocox": (dilocox_run, second)}


def numeric_keys(rows: list[dict]) -> set[str]:
    return {k for row in rows for k, v in row.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def test_tensorboard_scalars_equal_metrics_jsonl(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = runs["diloco"]
    rows = metrics(run_dir)
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == numeric_keys(rows) - {"step"}
    for key in ("loss", "eval_loss", "tokens", "wan_bytes_sent", "round_link_s", "lr"):
        logged = [(row["step"], row[key]) for row in rows if row.get(key) is not None]
        assert len(logged) >= 2, key
        # TensorBoard scalars are float32
        assert [(e.step, e.value) for e in events.Scalars(key)] == [(s, float(np.float32(v))) for s, v in logged], key


def wandb_history(path: Path) -> list[dict]:
    """The history rows of a W&B transaction log (`run-*.wandb`): LevelDB-log blocks of 32 KiB holding W&B's own
    protobuf `Record`s, after a 7-byte ":W&B" file header."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block, header = path.read_bytes(), 32 * 1024, 7
    assert data[:4] == b":W&B"
    rows, pos, pending = [], 7, b""
    while pos + header <= len(data):
        left = block - pos % block
        if left < header:  # a block's tail too short for a record header is padding
            pos += left
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[pos : pos + header])
        if kind == 0:  # zero padding at the end of a block
            pos += left
            continue
        pending += data[pos + header : pos + header + length]
        pos += header + length
        if kind in (1, 4):  # a whole record, or the last fragment of one
            record = Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or ".".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})  # fmt: skip
    return rows


def test_wandb_offline_run_holds_the_history(runs):
    run_dir, _ = runs["dilocox"]
    (offline_run,) = (run_dir / "wandb").glob("offline-run-*")
    (log,) = offline_run.glob("run-*.wandb")
    history = {row["_step"]: row for row in wandb_history(log)}
    rows = metrics(run_dir)
    assert sorted(history) == [row["step"] for row in rows]
    assert "round_rank" in numeric_keys(rows)  # the codec's rank is among the keys checked
    for row in rows:
        logged = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}  # strings skipped
        assert {k: history[row["step"]][k] for k in logged} == logged
        assert set(history[row["step"]]) - set(logged) == {"_step", "_runtime", "_timestamp"}


def test_checkpoints_follow_the_rounds_when_the_interval_is_not_a_multiple_of_h(runs):
    run_dir, result = runs["diloco"]
    # H = 5, interval 7: the boundaries at or after 7 and 14, then the end
    assert [p.name for p in sorted((run_dir / "checkpoints").iterdir())] == [
        "step_00000010",
        "step_00000015",
        "step_00000020",
    ]
    assert result.stdout.count("note: checkpoint.interval = 7 is not a multiple of sync.inner_steps = 5") == 1


def test_the_summary_of_an_unlimited_link_shows_no_latency(runs):
    _, limited = runs["diloco"]
    _, unlimited = runs["dilocox"]
    assert "link 1Gbps / 10ms" in limited.stdout
    assert "link unlimited (not emulated)" in unlimited.stdout and "10ms" not in unlimited.stdout


def test_plot_draws_both_runs_from_their_metrics(runs, tmp_path):
    (diloco, _), (dilocox_run, _) = runs["diloco"], runs["dilocox"]
    out = tmp_path / "plots"
    result = dilocox("plot", diloco, dilocox_run, "--out", out, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = [chart.filename for chart in CHARTS] + ["throughput.png"]
    assert result.stdout.split() == [str(out / name) for name in expected]
    for name in expected:
        assert (out / name).stat().st_size > 10_000, name
    # the series the charts draw are the jsonl's values; a run that did not log a key has no line
    for run_dir in (diloco, dilocox_run):
        run, rows = load_run(run_dir), metrics(run_dir)
        for x, y in (("tokens", "loss"), ("elapsed_s", "eval_loss"), ("tokens", "wan_bytes_sent")):
            points = [(row[x], row[y]) for row in rows if row.get(y) is not None]
            assert run.series(x, y) == ([a for a, _ in points], [b for _, b in points])
        rounds = [row for row in rows if row.get("round_link_s")]
        assert run.series("step", "round_hidden_fraction") == (
            [row["step"] for row in rounds],
            [row["round_hidden_s"] / row["round_link_s"] for row in rounds],
        )
    assert load_run(diloco).series("outer_step", "round_rank") == ([], [])  # DiLoCo has no codec
    ranks = [(row["outer_step"], row["round_rank"]) for row in metrics(dilocox_run) if "round_rank" in row]
    assert len(ranks) >= 2
    assert load_run(dilocox_run).series("outer_step", "round_rank") == ([a for a, _ in ranks], [b for _, b in ranks])


def test_plot_refuses_a_directory_without_metrics(tmp_path):
    (tmp_path / "empty").mkdir()
    result = dilocox("plot", tmp_path / "empty", "--out", tmp_path / "plots", timeout=120)
    assert result.returncode == 2
    assert result.stderr == (
        f"dilocox: error: {tmp_path / 'empty'} has no metrics.jsonl: not a dilocox run directory, or it has not "
        "logged yet\n"
    )
    assert os.listdir(tmp_path) == ["empty"]  # no plots directory either
