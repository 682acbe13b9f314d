"""The charts of `dilocox plot` and `dilocox bench` stay readable with dozens of long-labelled runs: one legend under
the panels, never over them, and the panels keep their size."""

import pytest

from dilocox.tools.plot import legend_below, run_style

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
