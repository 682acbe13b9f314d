"""Benchmarks and projections: the strategy comparison harness (`dilocox bench`) and the paper-scale planner
(`dilocox plan`).

`dilocox bench`: `spec` (the bench file), `runs` (one `dilocox train` subprocess and its summary), `results` (rows,
comparisons, results.json/md, and the plots of `dilocox.tools.plot`), `table`, `paper_regime` (the paper's regime:
timed windows), `harness` (`run_bench`), `bench_cli`. `dilocox plan`: `planner` (the analytic round model),
`plan_report` (its table), `plan_cli`.
"""
