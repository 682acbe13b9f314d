"""Benchmarks and projections: the strategy comparison harness (`dilocox bench`) and the paper-scale planner
(`dilocox plan`)."""
