"""Measurement tools: the strategy bench (`dilocox bench`), the planner (`dilocox plan`) and the shaped-link check
(`dilocox linkcheck`).

They drive the runtime (`dilocox train` subprocesses, `WanChannel`, `LinkModel`) from the outside; nothing in the
runtime imports them (tests/unit/test_tools.py checks it).
"""
