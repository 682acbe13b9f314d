"""Benchmarks and projections: the paper-scale planner (`dilocox.bench.planner`, `dilocox plan`)."""
