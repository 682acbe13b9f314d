"""`dilocox bench [CONFIG] [--out DIR] [--quick] [--only a,b] [--regime paper] [--seeds N] [--timing-repeats N]
[--retime] [--resume]`: arguments, exit codes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dilocox.tools.args import ToolParser, user_error
from dilocox.tools.bench.harness import run_bench
from dilocox.tools.bench.spec import REGIMES

BENCH_FILE = """\
a bench file (more in benchmarks/configs/):

  [bench]
  name = "mine"                        # results go to runs/bench/mine/ (or --out)
  base = "../../configs/debug.toml"    # optional: a `dilocox train --config` file, relative to this file
  overrides = ["--eval.interval=50"]   # flags every run gets (a run's own come after, and win)
  baseline = "allreduce"               # the run every gap is paired with, seed by seed
  tuned_baseline = ["allreduce", "allreduce-lr4e-3"]  # optional: a second gap column, to the best of these
  notes = "printed under the table"

  [[runs]]
  name = "allreduce"
  overrides = ["--preset=allreduce"]   # a preset replaces the base file's own; no base: dilocox train's default

  [[runs]]
  name = "allreduce-lr4e-3"
  overrides = ["--preset=allreduce", "--train.lr=4e-3"]

  [[runs]]
  name = "dilocox"
  label = "DiLoCoX, the default"       # the row's name in results.md (default: name)
  overrides = ["--preset=dilocox"]

[bench] may also set regime = "paper" (convergence link off, throughput on the paper-like link: docs/planner.md
section 3) and timing_repeats = N (that regime's timed runs per row, the median reported).
"""


def _parser() -> ToolParser:
    parser = ToolParser(
        prog="dilocox bench",
        description="Compare strategies on one setting.",
        epilog=BENCH_FILE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config", nargs="?", default="benchmarks/configs/default.toml", help="bench TOML file")
    parser.add_argument(
        "--out",
        default=None,
        help="output directory (default runs/bench/NAME, which git ignores; --out benchmarks/results/NAME for a result "
        "the docs cite: git keeps its tables and plots, not its run directories and logs)",
    )
    parser.add_argument("--quick", action="store_true", help="debug flavor, 20 steps: a smoke check of the table")
    parser.add_argument("--only", default="", help="comma-separated run names to (re)run; others are kept")
    parser.add_argument(
        "--seeds", type=int, default=1, help="run each run with N seeds (run.seed, +1, ...); rows show mean and spread"
    )
    parser.add_argument(
        "--regime",
        choices=REGIMES,
        default=None,
        help="paper: convergence with the link off, throughput on a link as slow relative to compute as the paper's",
    )
    parser.add_argument(
        "--timing-repeats",
        type=int,
        default=None,
        help="paper regime: time each run N times, interleaved, and report the median (default: the bench file's "
        "timing_repeats, 1 with --quick)",
    )
    parser.add_argument(
        "--retime",
        action="store_true",
        help="paper regime: re-run only the timed runs (of --only's runs and the reference) on the earlier link; "
        "the convergence runs on disk stay",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep every seed whose run directory already holds a finished run of the same settings (its config.toml "
        "and summary.json): a bench stopped halfway goes on where it stopped",
    )
    return parser


def main(argv: list[str]) -> int:
    """Run `dilocox bench` with `argv` (the arguments after `bench`); returns the exit code.

    Bad arguments or a bad bench file: one `dilocox: error: ...` line, exit 2; a failed training run: exit 1."""
    try:
        args = _parser().parse_args(argv)
        run_bench(
            Path(args.config),
            out_dir=Path(args.out) if args.out else None,
            quick=args.quick,
            only=[n for n in args.only.split(",") if n] or None,
            regime=args.regime,
            seeds=args.seeds,
            timing_repeats=args.timing_repeats,
            retime=args.retime,
            resume=args.resume,
        )
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except ValueError as exc:
        return user_error(exc)
    except RuntimeError as exc:
        print(f"dilocox: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
