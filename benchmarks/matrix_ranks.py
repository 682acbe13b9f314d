"""Per-matrix adaptive ranks over the outer rounds of finished runs, read from their final checkpoints.

    python benchmarks/matrix_ranks.py benchmarks/results/outer_delay/runs/adaptive-rank [more run dirs] \
        --out benchmarks/results/outer_delay/matrix_ranks

`metrics.jsonl` logs one rank per round (`round_rank`: under `compression.aggregate = per_matrix` the mean of the
matrices' ranks, rounded up). The decisions of every matrix are in the adaptive codec's state, which every
checkpoint holds (`RankDecision.matrix_ranks`); this reads cluster 0's (rank_00000.pt, the stage of pipeline stage
0) from a run's newest checkpoint and writes, per run, a heatmap of the rank of every matrix over the rounds
(`NAME.png`) and a table of the ranks at a few rounds (`NAME.md`). Needs matplotlib, and the run directories with
their checkpoints where the bench ran: git keeps a bench's tables and plots, not its runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from dilocox.checkpoint import list_checkpoints, load_rank_state


def matrix_names(model_state: dict[str, torch.Tensor]) -> list[str]:
    """The parameters with 2+ dims, in the order the codec sees them (the order of the stage's parameters)."""
    return [name for name, tensor in model_state.items() if tensor.dim() >= 2]


def read_decisions(run_dir: Path) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """(matrix names, used ranks (rounds, matrices), raw ranks (rounds, matrices)) of cluster 0 in `run_dir`."""
    checkpoints = list_checkpoints(run_dir)
    if not checkpoints:
        raise SystemExit(f"{run_dir}: no checkpoint (the bench keeps the final one)")
    try:
        state = load_rank_state(checkpoints[-1], 0)  # verified against meta.json
    except ValueError as exc:
        raise SystemExit(f"{run_dir}: {exc}") from None
    policy = state["sync"]["reducer"]["codec"].get("policy")
    if policy is None or "matrix_ranks" not in policy or policy["matrix_ranks"].shape[-1] == 0:
        raise SystemExit(f"{run_dir}: no per-matrix ranks (compression.kind = adaptive, aggregate = per_matrix)")
    per_matrix = policy["matrix_ranks"]  # (rounds, 2, matrices): raw, used
    names = matrix_names(state["model"])
    if len(names) != per_matrix.shape[-1]:  # a matrix dense even at rank_min is not measured
        names = [f"matrix {i}" for i in range(per_matrix.shape[-1])]
    return names, per_matrix[:, 1], per_matrix[:, 0]


def write(run_dir: Path, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, ranks, raw = read_decisions(run_dir)
    rounds = ranks.shape[0]
    fig, ax = plt.subplots(figsize=(10, 0.22 * len(names) + 1.5))
    image = ax.imshow(ranks.T.numpy(), aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_yticks(range(len(names)), [n.replace(".weight", "") for n in names], fontsize=7)
    ax.set_xlabel("outer round")
    ax.set_title(f"{run_dir.name}: rank of each matrix (smoothed; mean per round in metrics.jsonl's round_rank)")
    fig.colorbar(image, ax=ax, label="rank")
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_dir / f"{run_dir.name}.png", dpi=110)
    plt.close(fig)
    shown = sorted({0, rounds // 4, rounds // 2, 3 * rounds // 4, rounds - 1})
    lines = [
        f"Rank of each matrix (raw -> used after smoothing) at outer rounds {', '.join(str(r + 1) for r in shown)} "
        f"of `{run_dir.name}` (cluster 0, from its final checkpoint).",
        "",
        "| matrix | " + " | ".join(f"round {r + 1}" for r in shown) + " |",
        "| --- | " + " | ".join("---:" for _ in shown) + " |",
    ]
    for index, name in enumerate(names):
        cells = [f"{int(raw[r, index])} -> {int(ranks[r, index])}" for r in shown]
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
