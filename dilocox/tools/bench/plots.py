"""A bench's plots (PNG): eval loss vs tokens, eval loss vs wall time, and throughput."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """eval loss vs tokens, eval loss vs wall time, and a throughput bar chart (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("plots need matplotlib: pip install 'dilocox[bench]'") from None
    paths = []
    for key, xlabel, filename in (
        ("tokens", "tokens", "loss_vs_tokens.png"),
        ("elapsed_s", "wall time (s)", "loss_vs_time.png"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for row in results["runs"]:
            if row["curve"]:
                ax.plot([p[key] for p in row["curve"]], [p["eval_loss"] for p in row["curve"]], marker="o",
                        markersize=3, label=row["label"])  # fmt: skip
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss")
        ax.set_title(f"{results['bench']}: validation loss vs {xlabel}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / filename, dpi=120)
        plt.close(fig)
        paths.append(out_dir / filename)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = [row["label"] for row in results["runs"]]
    ax.barh(labels, [row["tokens_per_s"] for row in results["runs"]], color="tab:blue")
    ax.set_xlabel("tokens/s (training, all ranks)")
    ax.set_title(f"{results['bench']}: throughput")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(out_dir / "throughput.png", dpi=120)
    plt.close(fig)
    paths.append(out_dir / "throughput.png")
    return paths
