"""The charts of `dilocox plot` and `dilocox bench` stay readable with dozens of long-labelled runs: one legend under
the panels, never over them, and the panels keep their size."""

import json

import pytest

from dilocox.config import load_config, to_toml
from dilocox.tools.plot import (
    Membership,
    chart_lines,
    cluster_steps,
    frontier,
    frontier_points,
    legend_below,
    load_run,
    plot_cluster_steps,
    plot_membership,
    run_style,
)
from dilocox.tools.plot import main as plot_main

plt = pytest.importorskip("matplotlib.pyplot")

LONG = "delay 1, top-k int4 (density 0.05, residual kept whole), H = 12, average applied 7 steps into the next round"


def test_forty_runs_have_forty_distinct_styles():
    styles = {tuple(sorted(run_style(i).items())) for i in range(40)}
    assert len(styles) == 40


@pytest.mark.parametrize("panels", [1, 3])
def test_the_legend_sits_under_the_panels_and_their_labels(panels):
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.2), squeeze=False)
    entries = [(f"{LONG}, run {i}", run_style(i)) for i in range(41)]
    for ax in axes[0]:
        for i, (_, style) in enumerate(entries):
            ax.plot([0, 1], [i, i + 1], **style)
        ax.set_xlabel("tokens")
    legend_below(fig, entries)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend = fig.legends[0].get_window_extent(renderer)
    assert [text.get_text() for text in fig.legends[0].get_texts()][5].replace("\n", " ") == f"{LONG}, run 5"
    for ax in axes[0]:
        assert legend.y1 <= ax.get_tightbbox(renderer).y0  # below the axes, tick labels and x label
        assert ax.get_window_extent(renderer).height / fig.dpi >= 2.5  # the panel kept most of its 4.2 inches
    assert legend.y0 >= 0  # inside the figure
    plt.close(fig)


def write_run(run_dir, flags, records):
    """A run directory as `dilocox train` leaves it: the resolved config.toml and metrics.jsonl."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.toml").write_text(to_toml(load_config(None, flags)))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def records(*, delayed: bool):
    """Four logged steps of a DiLoCo run with one sync per two steps; a codec's rank only for the delayed run."""
    rows = []
    for step in (2, 4, 6, 8):
        exposed = 0.0 if delayed else 0.5
        row = {"step": step, "tokens": 100 * step, "elapsed_s": step, "loss": 5 - step / 10,
               "wan_bytes_sent": 1000 * step, "link_busy_s": step / 4, "exposed_comm_s": exposed * step / 4,
               "outer_step": step // 2, "round_link_s": 0.5, "round_exposed_s": exposed,
               "round_hidden_s": 0.5 - exposed, "round_bytes_sent": 2000, "round_inner_steps": 2}  # fmt: skip
        if delayed:
            row["round_rank"] = 4
        rows.append(row)
    return rows


def test_a_blocking_run_gets_no_hidden_share_and_no_empty_panel(tmp_path):
    blocking = load_run(write_run(tmp_path / "diloco", ["--sync.kind=diloco"], records(delayed=False)))
    delayed = load_run(write_run(tmp_path / "dilocox", ["--preset=dilocox-lowrank"], records(delayed=True)))
    assert not blocking.overlaps and delayed.overlaps

    def drawn(runs):
        return {chart.filename: {panel.y: lines for panel, lines in panels} for chart, panels in chart_lines(runs)}

    alone = drawn([blocking])
    assert "hidden_fraction.png" not in alone  # 0 by construction: nothing to show
    assert alone["rounds.png"] == {"round_inner_steps": [0]}  # no codec: no empty rank panel
    assert alone["loss_vs_tokens.png"] == {"loss": [0]}  # no evaluation logged yet: no empty eval panel
    both = drawn([blocking, delayed])
    assert both["hidden_fraction.png"] == {"round_hidden_fraction": [1], "hidden_fraction": [1]}
    assert both["rounds.png"] == {"round_rank": [1], "round_inner_steps": [0, 1]}

    assert plot_main([str(tmp_path / "diloco"), "--out", str(tmp_path / "plots")]) == 0
    written = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert written == ["loss_vs_time.png", "loss_vs_tokens.png", "rounds.png", "slow_link_bytes.png"]


def test_an_elastic_run_gets_a_membership_chart_of_its_rounds_and_events(tmp_path):
    run_dir = write_run(tmp_path / "elastic", ["--preset=dilocox-lowrank"], records(delayed=True))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lines = []
    for row in rows:
        row["round_clusters"] = [0, 1] if 4 < row["step"] <= 6 else [0, 1, 2]
        lines.append(row)
        if row["step"] == 4:  # the records `dilocox.elastic.events` writes, between the per-step ones
            lines.append(
                {"step": 4, "event": "elastic", "kind": "stalled", "cluster": 2, "reason": "r", "seconds": 6.1}
            )
        if row["step"] == 6:
            lines.append({"step": 6, "event": "elastic", "kind": "rejoined", "cluster": 2, "reason": "r", "seconds": 9})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))

    membership = Membership.of(load_run(run_dir))
    assert [(e["kind"], e["cluster"], e["step"]) for e in membership.events] == [
        ("stalled", 2, 4),
        ("rejoined", 2, 6),
    ]
    assert [members for step, members in membership.rounds if step in (4, 6, 8)] == [[0, 1, 2], [0, 1], [0, 1, 2]]
    assert membership.clusters() == [0, 1, 2]

    assert plot_main([str(run_dir), "--out", str(tmp_path / "plots")]) == 0
    written = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert "membership.png" in written and "loss_vs_tokens.png" in written  # the event records break no chart
    static = write_run(tmp_path / "static", ["--preset=dilocox-lowrank"], records(delayed=True))
    assert plot_membership([load_run(static)], tmp_path / "static_plots") is None  # not elastic: no chart


def test_a_time_round_run_gets_a_chart_of_each_clusters_steps_per_round(tmp_path):
    rows = records(delayed=True)
    for row in rows:  # rounds 1..4 land one per logged step; the last step also carries the round before
        landed = [row["outer_step"] - 1, row["outer_step"]] if row["step"] == 8 else [row["outer_step"]]
        row["rounds_landed"] = [
            {"round": r, "cluster_steps": [2, 2, 1], "cluster_tokens": [200, 200, 100]} for r in landed
        ]
    run_dir = write_run(tmp_path / "time", ["--sync.round.mode=time", "--sync.inner_steps=2"], rows)
    assert cluster_steps(load_run(run_dir)) == {r: [2, 2, 1] for r in (1, 2, 3, 4)}
    assert plot_main([str(run_dir), "--out", str(tmp_path / "plots")]) == 0
    assert "cluster_steps.png" in {p.name for p in (tmp_path / "plots").iterdir()}
    steps = write_run(tmp_path / "steps", [], records(delayed=True))
    assert plot_cluster_steps([load_run(steps)], tmp_path / "steps_plots") is None  # no per-cluster steps: no chart


def bench_results(name, rows):
    """A bench's results.json as `dilocox bench` writes it, reduced to what the frontier reads: (run, bytes per
    token, mean gap, gap sd) per row."""
    return {
        "bench": name,
        "baseline": "allreduce",
        "runs": [
            {"name": run, "label": f"{run} (long label)", "wan_bytes_per_token": bpt, "gap_to_baseline_pct": gap,
             "gap_sd_pct": sd}
            for run, bpt, gap, sd in rows
        ],
    }  # fmt: skip


def test_the_frontier_keeps_the_fewest_bytes_for_each_gap():
    results = bench_results(
        "h12",
        [
            ("allreduce", 2560.0, 0.0, None),
            ("fp32", 213.0, 2.5, 0.1),
            ("int4-d05", 4.2, 1.8, 0.4),  # fewer bytes and a lower gap than fp32: fp32 is off the frontier
            ("int2-d01", 0.9, 2.1, 0.3),
            ("sign-d01", 0.8, 2.6, 0.5),
            ("sign-d005", 0.45, 4.0, 0.2),
            ("int4-d02", 1.7, 2.1, 0.3),  # the same gap as int2-d01 for more bytes: off
            ("no-comm", 0.0, 18.0, 1.0),  # sends nothing: not on a log axis, not a point
            ("alone", 1.0, None, None),  # no gap (no paired baseline): not a point
        ],
    )
    points = frontier_points(results)
    assert [p.name for p in points] == [
        "allreduce",
        "fp32",
        "int4-d05",
        "int2-d01",
        "sign-d01",
        "sign-d005",
        "int4-d02",
    ]
    assert [p.name for p in frontier(points)] == ["sign-d005", "sign-d01", "int2-d01", "int4-d05", "allreduce"]
    other = bench_results("h30", [("sign-d02", 0.5, 2.4, 0.2)])  # pooled: it beats sign-d01 (fewer bytes, lower gap)
    pooled = frontier(points + frontier_points(other))
    assert [p.name for p in pooled] == ["sign-d005", "sign-d02", "int2-d01", "int4-d05", "allreduce"]
    assert [p.bench for p in pooled][1] == "h30"


def test_dilocox_plot_draws_the_frontier_of_benches_results(tmp_path, capsys):
    paths = []
    for name, rows in (("h12", [("a", 1.0, 2.0, 0.1), ("b", 2.0, 1.0, None)]), ("h30", [("c", 0.5, 3.0, 0.5)])):
        paths.append(tmp_path / name / "results.json")
        paths[-1].parent.mkdir()
        paths[-1].write_text(json.dumps(bench_results(name, rows)))
    assert plot_main([*map(str, paths), "--out", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "frontier.png").stat().st_size > 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "plots" / "frontier.png")
    (tmp_path / "bad.json").write_text('{"runs": []}')
    assert plot_main([str(tmp_path / "bad.json"), "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bad.json is not a bench's results.json" in err
    assert not (tmp_path / "bad").exists()
    run_dir = write_run(tmp_path / "run", [], records(delayed=True))
    assert plot_main([str(paths[0]), str(run_dir), "--out", str(tmp_path / "mixed")]) == 2
    assert "either run directories or benches' results.json" in capsys.readouterr().err
