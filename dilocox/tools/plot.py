"""`dilocox plot RUN_DIR... --out DIR`: the curves of any set of runs, read from their metrics.jsonl, as PNG files.

One chart per file, one line per run; a run that did not log a metric (no codec rank in a DiLoCo run, no eval loss
before the first evaluation) simply has no line in that panel, a panel no run has a line in is left out, and so is a
chart left with no panel. The hidden share of link time is drawn for runs whose sync can travel during compute (a
delayed outer sync, `sync.sync_delay = 1`) only: a blocking sync waits for all of it, so its share is 0 by
construction. `dilocox bench` draws its plots with the same code.

    runs = [load_run(Path("runs/a")), load_run(Path("runs/b"), label="dilocox")]
    xs, ys = runs[0].series("tokens", "eval_loss")          # the values the chart draws
    paths = plot_runs(runs, Path("plots"))                   # loss_vs_tokens.png, loss_vs_time.png, ...
"""

from __future__ import annotations

import json
import math
import textwrap
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dilocox.elastic.events import EVENT
from dilocox.metrics import METRICS_FILE, SUMMARY_FILE, RunSummary, read_metrics
from dilocox.tools.args import ToolParser, user_error


def _ratio(numerator: str, denominator: str, *, complement: bool = False) -> Callable[[dict[str, Any]], float | None]:
    def value(record: dict[str, Any]) -> float | None:
        top, bottom = record.get(numerator), record.get(denominator)
        if top is None or not bottom:
            return None
        share = top / bottom
        return min(1.0, max(0.0, 1.0 - share)) if complement else share

    return value


DERIVED: dict[str, Callable[[dict[str, Any]], float | None]] = {
    "round_hidden_fraction": _ratio("round_hidden_s", "round_link_s"),
    "hidden_fraction": _ratio("exposed_comm_s", "link_busy_s", complement=True),
}
"""Values computed from a record: the share of one sync's link time hidden behind compute, and the share of all
link time so far (1 - exposed / busy, clamped to [0, 1], as the summary's `hidden_comm_fraction`)."""


@dataclass(frozen=True)
class Panel:
    """One axes: `y` (a metrics.jsonl key or a `DERIVED` name) against the key `x`, one line per run."""

    y: str
    x: str
    ylabel: str
    xlabel: str
    markers: bool = False
    log_y: bool = False
    overlapping_only: bool = False
    """Drawn for the runs whose sync may be hidden behind compute (`RunCurves.overlaps`) only."""


@dataclass(frozen=True)
class Chart:
    """One PNG file of side-by-side panels."""

    filename: str
    title: str
    panels: tuple[Panel, ...]


_TOKENS, _TIME, _STEP, _ROUND = "tokens", "wall time (s)", "inner step", "outer round"
CHARTS = (
    Chart(
        "loss_vs_tokens.png",
        "loss vs tokens",
        (
            Panel("loss", "tokens", "training loss (mean since the last log)", _TOKENS),
            Panel("eval_loss", "tokens", "validation loss", _TOKENS, markers=True),
        ),
    ),
    Chart(
        "loss_vs_time.png",
        "loss vs wall time",
        (
            Panel("loss", "elapsed_s", "training loss (mean since the last log)", _TIME),
            Panel("eval_loss", "elapsed_s", "validation loss", _TIME, markers=True),
        ),
    ),
    Chart(
        "slow_link_bytes.png",
        "slow-link bytes (rank 0)",
        (
            Panel("wan_bytes_sent", "tokens", "bytes sent, cumulative", _TOKENS, log_y=True),
            Panel("round_bytes_sent", "step", "bytes sent per sync", _STEP, markers=True, log_y=True),
        ),
    ),
    Chart(
        "hidden_fraction.png",
        "link time hidden behind compute (rank 0)",
        (
            Panel(
                "round_hidden_fraction",
                "step",
                "hidden share of each sync's link time",
                _STEP,
                markers=True,
                overlapping_only=True,
            ),
            Panel("hidden_fraction", "tokens", "hidden share of all link time so far", _TOKENS, overlapping_only=True),
        ),
    ),
    Chart(
        "rounds.png",
        "rank and H over outer rounds",
        (
            Panel("round_rank", "outer_step", "codec rank", _ROUND, markers=True),
            Panel("round_inner_steps", "outer_step", "inner steps of the round (H)", _ROUND, markers=True),
        ),
    ),
)
"""Every chart `plot_runs` writes."""


@dataclass
class RunCurves:
    """The metrics.jsonl records of one run, under the label its lines get."""

    label: str
    run_dir: Path
    records: list[dict[str, Any]] = field(repr=False)
    overlaps: bool = True
    """Whether its sync may travel during compute (a delayed outer sync); False for a blocking one (sync_delay 0,
    AllReduce, CocktailSGD), whose link time is all exposed. True where the run directory does not say."""

    def value(self, record: dict[str, Any], key: str) -> float | None:
        """`key` of `record` (or the `DERIVED` value of that name); None when absent, not a number or not finite."""
        value = DERIVED[key](record) if key in DERIVED else record.get(key)
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
            return None
        return value

    def series(self, x: str, y: str) -> tuple[list[float], list[float]]:
        """The points (x, y) of the records that hold both, in logged order."""
        points = [(self.value(r, x), self.value(r, y)) for r in self.records]
        kept = [(a, b) for a, b in points if a is not None and b is not None]
        return [a for a, _ in kept], [b for _, b in kept]


def load_run(run_dir: Path, label: str | None = None) -> RunCurves:
    """The records of `run_dir`'s metrics.jsonl (ValueError when it has none), labelled by the directory's name."""
    run_dir = Path(run_dir)
    if not (run_dir / METRICS_FILE).is_file():
        raise ValueError(f"{run_dir} has no {METRICS_FILE}: not a dilocox run directory, or it has not logged yet")
    return RunCurves(label or run_dir.name, run_dir, read_metrics(run_dir), overlaps=_overlaps(run_dir))


def _overlaps(run_dir: Path) -> bool:
    """From the run's resolved config.toml (every run writes one first): an outer loop with the one-step delay."""
    try:
        sync = tomllib.loads((run_dir / "config.toml").read_text()).get("sync", {})
    except (OSError, tomllib.TOMLDecodeError):
        return True
    return sync.get("kind") in ("diloco", "dilocox") and sync.get("sync_delay") == 1


def chart_lines(runs: list[RunCurves]) -> list[tuple[Chart, list[tuple[Panel, list[int]]]]]:
    """What `plot_runs` draws: each chart with its panels and, per panel, the indices of the runs with a line in it;
    panels without a line and charts without a panel are left out."""
    drawn = []
    for chart in CHARTS:
        panels = []
        for panel in chart.panels:
            lines = [
                index
                for index, run in enumerate(runs)
                if (run.overlaps or not panel.overlapping_only) and run.series(panel.x, panel.y)[0]
            ]
            if lines:
                panels.append((panel, lines))
        if panels:
            drawn.append((chart, panels))
    return drawn


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plots need matplotlib: pip install 'dilocox[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _titled(title: str, what: str) -> str:
    return f"{title}: {what}" if title else what


def _save(fig: Any, path: Path, *, suptitle: str | None = None) -> Path:
    """Write `fig` to `path` (with `suptitle`: titled above its panels and laid out) and free it."""
    if suptitle is not None:
        fig.suptitle(suptitle)
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def _panels(out_dir: Path, num_panels: int) -> tuple[Any, list[Any]]:
    """A figure of `num_panels` panels side by side, and their axes; `out_dir` is made for it."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, num_panels, figsize=(6 * num_panels, _PLOT_HEIGHT), squeeze=False)
    return fig, list(axes[0])


def _end_run_panel(ax: Any, label: str, xlabel: str, ylabel: str) -> None:
    """A panel of one run: its axes' labels, the run's above it, a grid and its legend."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(label, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")


_LINESTYLES = ("-", "--", ":", "-.")
_PLOT_HEIGHT = 4.2
"""Inches of a chart's panels; the legend below them adds its own height."""
_BAR_LABEL_CHARS = 60
"""Characters per line of a bar's label in the throughput chart."""


def run_style(index: int) -> dict[str, str]:
    """Colour and line style of the `index`-th run, the same in every chart: matplotlib's ten colours, then the ten
    again dashed, dotted and dash-dotted, so that a bench of dozens of rows still tells its lines apart."""
    return {"color": f"C{index % 10}", "linestyle": _LINESTYLES[index // 10 % len(_LINESTYLES)]}


def legend_below(fig: Any, entries: list[tuple[str, dict[str, Any]]]) -> None:
    """One legend for the whole figure, under its panels: `entries` are (label, line style) pairs. The figure grows
    by the legend's height (long labels wrap), so the panels keep their size however many runs there are; with no
    entries the figure is only laid out."""
    from matplotlib.lines import Line2D

    if not entries:
        fig.tight_layout()
        return

    width, height = fig.get_size_inches()
    columns = 2 if width >= 12 and len(entries) > 1 else 1
    chars = int(width * 17 / columns) - 8  # about 17 characters of 7-point text per inch, less the line sample
    labels = [textwrap.fill(label, chars) for label, _ in entries]
    handles = [Line2D([], [], linewidth=1.2, **style) for _, style in entries]
    legend = fig.legend(handles, labels, loc="lower center", ncol=columns, fontsize=7, frameon=False)
    fig.canvas.draw()  # lays the legend out, so its height is measured rather than guessed
    legend_height = legend.get_window_extent().height / fig.dpi + 0.1  # inches: text, unlike axes, keeps its size
    fig.set_size_inches(width, height + legend_height)
    fig.tight_layout(rect=(0, legend_height / (height + legend_height), 1, 1))


def plot_runs(runs: list[RunCurves], out_dir: Path, *, title: str = "") -> list[Path]:
    """Write the charts of `CHARTS` that have a line to draw for `runs` (`chart_lines`) into `out_dir`; returns the
    paths."""
    _pyplot()  # matplotlib, or the one line that says how to get it
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for chart, panels in chart_lines(runs):
        fig, axes = _panels(out_dir, len(panels))
        drawn: dict[int, dict[str, Any]] = {}  # the runs with a line in some panel, by index
        for ax, (panel, lines) in zip(axes, panels, strict=True):
            for index in lines:
                xs, ys = runs[index].series(panel.x, panel.y)
                marker = {"marker": "o", "markersize": 3} if panel.markers else {}
                drawn[index] = run_style(index)
                ax.plot(xs, ys, linewidth=1.2, **drawn[index], **marker)
            if panel.log_y and all(v > 0 for line in ax.get_lines() for v in line.get_ydata()):
                ax.set_yscale("log")  # byte counts of strategies differ by orders of magnitude
            ax.set_xlabel(panel.xlabel)
            ax.set_ylabel(panel.ylabel)
            ax.grid(alpha=0.3)
        fig.suptitle(_titled(title, chart.title))
        legend_below(fig, [(runs[index].label, style) for index, style in sorted(drawn.items())])
        paths.append(_save(fig, out_dir / chart.filename))
    return paths


MEMBERSHIP_FILE = "membership.png"
_EVENT_MARKERS = {"stalled": ("x", "C3"), "left": ("v", "C1"), "rejoined": ("^", "C2")}
"""How each elastic event (`dilocox.elastic.events`) is drawn in the membership chart: marker and colour."""


@dataclass(frozen=True)
class Membership:
    """An elastic run's membership over time, from its metrics.jsonl: the clusters of the round settled at each
    logged step (`round_clusters`) and the `elastic` event records (stalled, left, rejoined)."""

    rounds: list[tuple[int, list[int]]]
    """(step, clusters of the last round settled), one per logged step that carries them."""
    events: list[dict[str, Any]]

    @classmethod
    def of(cls, run: RunCurves) -> Membership:
        rounds = [(r["step"], list(r["round_clusters"])) for r in run.records if r.get("round_clusters")]
        events = [r for r in run.records if r.get("event") == EVENT]
        return cls(rounds, events)

    def clusters(self) -> list[int]:
        return sorted({c for _, members in self.rounds for c in members} | {e["cluster"] for e in self.events})


def plot_membership(runs: list[RunCurves], out_dir: Path, *, title: str = "") -> Path | None:
    """`membership.png`: for each elastic run (a panel each), a dot per cluster and logged step where the cluster
    was in the round, and each stall, leave and rejoin marked where it happened; None when no run is elastic."""
    memberships = [(run, Membership.of(run)) for run in runs]
    memberships = [(run, m) for run, m in memberships if m.rounds or m.events]
    if not memberships:
        return None
    fig, axes = _panels(out_dir, len(memberships))
    for ax, (run, membership) in zip(axes, memberships, strict=True):
        xs = [step for step, members in membership.rounds for _ in members]
        ys = [cluster for _, members in membership.rounds for cluster in members]
        ax.scatter(xs, ys, s=6, color="C0", label="in the round")
        for kind, (marker, color) in _EVENT_MARKERS.items():
            events = [e for e in membership.events if e["kind"] == kind]
            if events:
                steps, clusters = [e["step"] for e in events], [e["cluster"] for e in events]
                ax.scatter(steps, clusters, s=60, marker=marker, color=color, label=kind, zorder=3)
        ax.set_yticks(membership.clusters())
        _end_run_panel(ax, run.label, _STEP, "cluster")
    return _save(fig, out_dir / MEMBERSHIP_FILE, suptitle=_titled(title, "clusters in each round"))


CLUSTER_STEPS_FILE = "cluster_steps.png"


def cluster_steps(run: RunCurves) -> dict[int, list[int]]:
    """Each cluster's inner steps per outer round, from the rounds a run's records say landed (`rounds_landed`,
    written by token-weighted syncs such as `sync.round.mode = time`): {round: [steps of cluster 0, 1, ...]}."""
    return {
        entry["round"]: list(entry["cluster_steps"])
        for record in run.records
        for entry in record.get("rounds_landed", [])
    }


def plot_cluster_steps(runs: list[RunCurves], out_dir: Path, *, title: str = "") -> Path | None:
    """`cluster_steps.png`: for each run whose records carry the clusters' steps per round (a panel each), one line
    per cluster over the outer rounds; None when no run has them."""
    tables = [(run, cluster_steps(run)) for run in runs]
    tables = [(run, table) for run, table in tables if table]
    if not tables:
        return None
    fig, axes = _panels(out_dir, len(tables))
    for ax, (run, table) in zip(axes, tables, strict=True):
        rounds = sorted(table)
        for cluster in range(max(len(steps) for steps in table.values())):
            steps = [table[r][cluster] if cluster < len(table[r]) else None for r in rounds]
            ax.plot(rounds, steps, marker="o", markersize=3, linewidth=1.2, label=f"cluster {cluster}")
        _end_run_panel(ax, run.label, _ROUND, "inner steps of the round")
    return _save(fig, out_dir / CLUSTER_STEPS_FILE, suptitle=_titled(title, "steps per cluster per round"))


def plot_throughput(labels: list[str], tokens_per_s: list[float], path: Path, *, title: str = "") -> Path:
    """A bar chart of training tokens/s (all ranks), one bar per run."""
    plt = _pyplot()
    wrapped = [textwrap.fill(label, _BAR_LABEL_CHARS) for label in labels]  # long bench labels: several lines each
    lines = sum(label.count("\n") + 1 for label in wrapped)
    fig, ax = plt.subplots(figsize=(11, 0.9 + 0.16 * lines + 0.12 * max(1, len(labels))))
    ax.barh(range(len(wrapped)), tokens_per_s, color="tab:blue")
    ax.set_yticks(range(len(wrapped)), wrapped, fontsize=7)
    ax.set_xlabel("tokens/s (training, all ranks)")
    ax.set_title(_titled(title, "throughput"))
    ax.invert_yaxis()
    fig.tight_layout()
    return _save(fig, path)


def plot_seed_spread(rows: list[dict[str, Any]], path: Path, *, title: str = "") -> Path:
    """Eval loss vs tokens per run over its seeds: the mean line and the min-max band shaded (the bench's rows,
    each with `seeds`: one `curve` of {tokens, eval_loss} per seed, evaluated at the same steps)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    entries = []
    for index, row in enumerate(rows):
        curves = [seed["curve"] for seed in row.get("seeds", []) if seed["curve"]]
        if not curves:
            continue
        length = min(len(c) for c in curves)  # seeds evaluate at the same steps; a shorter one cuts the band
        tokens = [curves[0][i]["tokens"] for i in range(length)]
        losses = [[c[i]["eval_loss"] for c in curves] for i in range(length)]
        mean = [sum(v) / len(v) for v in losses]
        style = run_style(index)
        ax.plot(tokens, mean, marker="o", markersize=3, linewidth=1.2, **style)
        ax.fill_between(tokens, [min(v) for v in losses], [max(v) for v in losses], color=style["color"], alpha=0.2)
        entries.append((f"{row['label']} ({len(curves)} seeds)", style))
    ax.set_xlabel("tokens")
    ax.set_ylabel("validation loss (agreed model)")
    ax.set_title(_titled(title, "mean and min-max over seeds"))
    ax.grid(alpha=0.3)
    legend_below(fig, entries)
    return _save(fig, path)


@dataclass(frozen=True)
class FrontierPoint:
    """One bench row on the bytes-against-quality plane: its slow-link bytes per token and its gap to the baseline."""

    name: str
    label: str
    bytes_per_token: float
    gap_pct: float
    gap_sd_pct: float | None
    bench: str


def frontier_points(results: dict[str, Any]) -> list[FrontierPoint]:
    """The rows of a bench's results (`dilocox bench`'s results.json) that send bytes and have a gap to its baseline."""
    return [
        FrontierPoint(
            row["name"],
            row["label"],
            row["wan_bytes_per_token"],
            row["gap_to_baseline_pct"],
            row.get("gap_sd_pct"),
            results["bench"],
        )
        for row in results["runs"]
        if row.get("gap_to_baseline_pct") is not None and row.get("wan_bytes_per_token")
    ]


def frontier(points: list[FrontierPoint]) -> list[FrontierPoint]:
    """The points no other point beats on both axes (as few bytes or fewer and a lower mean gap), by bytes: the
    fewest bytes that reach each gap."""
    best, kept = math.inf, []
    for point in sorted(points, key=lambda p: (p.bytes_per_token, p.gap_pct)):
        if point.gap_pct < best:
            kept.append(point)
            best = point.gap_pct
    return kept


FRONTIER_FILE = "frontier.png"


def plot_frontier(benches: list[dict[str, Any]], path: Path, *, title: str = "") -> Path:
    """Gap to the baseline against slow-link bytes per token (log scale) for every row of `benches` (results.json
    dicts; one colour each), with the spread of the paired gaps as error bars, each point named, and the frontier
    of all of them as a line. Gaps are to each bench's own baseline."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    points, entries = [], []
    for index, results in enumerate(benches):
        mine = frontier_points(results)
        points += mine
        style = {"color": f"C{index % 10}"}
        ax.errorbar(
            [p.bytes_per_token for p in mine],
            [p.gap_pct for p in mine],
            yerr=[p.gap_sd_pct or 0.0 for p in mine],
            fmt="o",
            markersize=4,
            capsize=2,
            linewidth=0.8,
            **style,
        )
        for p in mine:
            ax.annotate(p.name, (p.bytes_per_token, p.gap_pct), fontsize=6, xytext=(3, 3), textcoords="offset points")
        entries.append(
            (f"{results['bench']} (gap to {results['baseline']})", {**style, "linestyle": "none", "marker": "o"})
        )
    line = frontier(points)
    ax.plot([p.bytes_per_token for p in line], [p.gap_pct for p in line], color="black", linewidth=1.0, zorder=0)
    entries.append(("frontier: the fewest bytes for each gap", {"color": "black", "linestyle": "-"}))
    ax.set_xscale("log")
    ax.set_xlabel("slow-link bytes per token (all ranks)")
    ax.set_ylabel("gap to the baseline's eval loss (%), mean and sd over paired seeds")
    ax.set_title(f"{title}: bytes against quality" if title else "bytes against quality")
    ax.grid(alpha=0.3, which="both")
    legend_below(fig, entries)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


DESCRIPTION = """Plot runs side by side from their metrics.jsonl: loss vs tokens and vs wall time, slow-link bytes, the
hidden share of link time (runs with a delayed sync), the codec rank and H over outer rounds, the clusters in each
round of an elastic run with its stalls, leaves and rejoins, the steps of each cluster per round (time rounds), and
(for finished runs) throughput. A run that did not
log a metric has no line in that plot; a panel or chart with no line is not written. Given a bench's results.json
(`dilocox bench`) instead of run directories, it draws the bytes-against-quality frontier of its rows (frontier.png;
several results.json: one frontier over all of them)."""


def main(argv: list[str]) -> int:
    parser = ToolParser(prog="dilocox plot", description=DESCRIPTION)
    parser.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", type=Path, help="run directories, or benches' results.json files"
    )
    parser.add_argument("--out", required=True, type=Path, help="directory for the PNG files (created if needed)")
    parser.add_argument("--label", action="append", help="a run's label in the legends, once per RUN_DIR, in order")
    parser.add_argument("--title", default="", help="prefix of every chart's title")
    try:
        args = parser.parse_args(argv)
        benches = [path for path in args.run_dirs if path.suffix == ".json"]
        if benches:
            if len(benches) != len(args.run_dirs) or args.label is not None:
                raise ValueError("give either run directories or benches' results.json files (without --label)")
            results = [_read_results(path) for path in benches]
            args.out.mkdir(parents=True, exist_ok=True)
            print(plot_frontier(results, args.out / FRONTIER_FILE, title=args.title))
            return 0
        if args.label is not None and len(args.label) != len(args.run_dirs):
            raise ValueError(f"--label was given {len(args.label)} times for {len(args.run_dirs)} run directories")
        labels = args.label or _default_labels(args.run_dirs)
        runs = [load_run(run_dir, label) for run_dir, label in zip(args.run_dirs, labels, strict=True)]
        paths = plot_runs(runs, args.out, title=args.title)
        membership = plot_membership(runs, args.out, title=args.title)
        if membership is not None:
            paths.append(membership)
        steps = plot_cluster_steps(runs, args.out, title=args.title)
        if steps is not None:
            paths.append(steps)
        finished = [run for run in runs if (run.run_dir / SUMMARY_FILE).exists()]
        if finished:
            tokens_per_s = [RunSummary.read(run.run_dir).tokens_per_s for run in finished]
            labels = [run.label for run in finished]
            paths.append(plot_throughput(labels, tokens_per_s, args.out / "throughput.png", title=args.title))
    except SystemExit as exc:  # --help printed the help
        return int(exc.code or 0)
    except ValueError as exc:
        return user_error(exc)
    for path in paths:
        print(path)
    return 0


def _default_labels(run_dirs: list[Path]) -> list[str]:
    """Each directory's name, or its whole path where two runs share a name."""
    names = [path.name for path in run_dirs]
    return [str(path) if names.count(path.name) > 1 else path.name for path in run_dirs]


def _read_results(path: Path) -> dict[str, Any]:
    """A bench's results.json, refused in one line when it is not one."""
    try:
        results = json.loads(path.read_text())
        if not all(key in results for key in ("bench", "baseline", "runs")):
            raise KeyError("bench, baseline or runs")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a bench's results.json ({err}); make one with dilocox bench") from None
    return results
