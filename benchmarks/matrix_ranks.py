"""Per-matrix adaptive ranks over the outer rounds of finished runs, read from their metrics.jsonl.

    python benchmarks/matrix_ranks.py RUN_DIR [more run dirs] --out benchmarks/results/outer_delay/matrix_ranks

Under `compression.rank_rule = per_matrix` (or budget) `metrics.jsonl` logs, with every round, the rank of each
matrix (`round_matrix_ranks`, after smoothing, as sent) and their mean rounded up (`round_rank`); rank 0 logs, so
these are cluster 0's ranks of pipeline stage 0. The matrix names come from the model state of the run's newest
checkpoint when it has one. This writes, per run, a heatmap of the rank of every matrix over the rounds (`NAME.png`)
and a table of the ranks at a few rounds (`NAME.md`). Needs matplotlib.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # read runs with the code of this tree

from dilocox.checkpoint import list_checkpoints, load_rank_state  # noqa: E402
from dilocox.metrics import read_metrics  # noqa: E402


def matrix_names(model_state: dict[str, torch.Tensor]) -> list[str]:
    """The parameters with 2+ dims, in the order the codec sees them (the order of the stage's parameters)."""
    return [name for name, tensor in model_state.items() if tensor.dim() >= 2]


def read_decisions(run_dir: Path) -> tuple[list[str], list[int], torch.Tensor]:
    """(matrix names, the outer step of each logged round, ranks (rounds, matrices)) of cluster 0 in `run_dir`."""
    rows = [row for row in read_metrics(run_dir) if row.get("round_matrix_ranks")]
    if not rows:
        raise SystemExit(f"{run_dir}: no per-matrix ranks (compression.kind = adaptive, rank_rule = per_matrix)")
    outer_steps = [int(row["outer_step"]) for row in rows]
    ranks = torch.tensor([row["round_matrix_ranks"] for row in rows])  # (rounds, matrices)
    checkpoints = list_checkpoints(run_dir)
    names: list[str] = []
    if checkpoints:
        try:
            state = load_rank_state(checkpoints[-1], 0)  # verified against meta.json
        except ValueError as exc:
            raise SystemExit(f"{run_dir}: {exc}") from None
        names = matrix_names(state["model"])
    if len(names) != ranks.shape[-1]:  # no checkpoint, or a matrix dense even at rank_min is not measured
        names = [f"matrix {i}" for i in range(ranks.shape[-1])]
    return names, outer_steps, ranks


def write(run_dir: Path, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, outer_steps, ranks = read_decisions(run_dir)
    rounds = ranks.shape[0]
    fig, ax = plt.subplots(figsize=(10, 0.22 * len(names) + 1.5))
    extent = (outer_steps[0] - 0.5, outer_steps[-1] + 0.5, len(names) - 0.5, -0.5)
    image = ax.imshow(ranks.T.numpy(), aspect="auto", cmap="viridis", interpolation="nearest", extent=extent)
    ax.set_yticks(range(len(names)), [n.replace(".weight", "") for n in names], fontsize=7)
    ax.set_xlabel("outer step")
    ax.set_title(f"{run_dir.name}: rank of each matrix (smoothed; mean per round in metrics.jsonl's round_rank)")
    fig.colorbar(image, ax=ax, label="rank")
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_dir / f"{run_dir.name}.png", dpi=110)
    plt.close(fig)
    shown = sorted({0, rounds // 4, rounds // 2, 3 * rounds // 4, rounds - 1})
    lines = [
        f"Rank of each matrix (after smoothing, as sent) at outer steps "
        f"{', '.join(str(outer_steps[r]) for r in shown)} of `{run_dir.name}` (cluster 0, from its metrics.jsonl).",
        "",
        "| matrix | " + " | ".join(f"outer step {outer_steps[r]}" for r in shown) + " |",
        "| --- | " + " | ".join("---:" for _ in shown) + " |",
    ]
    for index, name in enumerate(names):
        cells = [f"{int(ranks[r, index])}" for r in shown]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    means = [f"{float(ranks[r].float().mean()):.1f}" for r in shown]
    lines.append("| mean (used) | " + " | ".join(means) + " |")
    (out_dir / f"{run_dir.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories with a final checkpoint")
    parser.add_argument("--out", type=Path, default=Path("."), help="directory for NAME.png and NAME.md")
    args = parser.parse_args()
    for run_dir in args.runs:
        write(run_dir, args.out)


if __name__ == "__main__":
    main()
